"""Every parser a peer's bytes reach, fed mutations of valid input: each input parses to what SPEC.md allows or
raises the library's error for it (WireError, MsgError, LayerError, FrameError, a 4xx answer), never another
exception; and the room cores, fed what those parsers let through, keep serving the rooms nobody lied about.

The mutations start from valid frames, messages and bodies so that they reach every later check: bytes
flipped, inserted, deleted or duplicated, parts truncated, dropped, duplicated or added, huge and non-UTF-8
parts, out-of-range numbers, NaN and infinities. `pytest --hypothesis-profile=fuzz` runs many more examples.
"""

from __future__ import annotations

import json
import os
from urllib.parse import parse_qs

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from prefill_rooms import BOOT, ENCODE, KEY0, core, spec

from transfer import _native, wire
from transfer import bootstrap as bs
from transfer.core.encode import EncodeCore, Offer, PushStatus, StartWrite
from transfer.core.lane import settles
from transfer.core.prefill import Conclude, PrefillCore, SendAsk
from transfer.frames import (
    MAX_REASON_BYTES,
    Cancel,
    CancelAnswer,
    CancelReply,
    Registration,
    TransferInfo,
    UnreadableChecksum,
    WireError,
    cancel_frames,
    cancel_reply_frames,
    is_cancel,
    is_registration,
    parse_cancel,
    parse_cancel_reply,
    parse_failure_reason,
    parse_registration,
    parse_status,
    registration_frames,
    status_frames,
)
from transfer.status import TransferPoll

I64_MIN, I64_MAX, U64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1

# Parts a hostile peer would try in place of a number or a text.
ODD_PARTS = [b"", b"NaN", b"nan", b"inf", b"-inf", b"Infinity", b"-1", b"-0", b"+5", b" 1", b"1 ", b"1_0", b"0x10",
             b"1e3", b"1.0", b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xef\xbb\xbf1", b"\xd9\xa3",
             b"9223372036854775807", b"9223372036854775808", b"-9223372036854775809", b"18446744073709551615",
             b"18446744073709551616", b"0" * 5000 + b"7", b"9" * 4400, b"\xff" * 300, b"x" * 70000]


@st.composite
def mutated_bytes(draw, data: bytes) -> bytes:
    """`data` with up to four edits: a bit flipped, bytes inserted, deleted or duplicated, a cut, a huge or
    non-UTF-8 run, or the whole replaced by an odd part."""
    b = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut", "duplicate", "append", "odd"]))
        if op == "flip" and b:
            b[draw(st.integers(0, len(b) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            at = draw(st.integers(0, len(b)))
            b[at:at] = draw(st.binary(min_size=1, max_size=4) | st.sampled_from([b"\n", b"=", b"\n\n", b"\xff"]))
        elif op == "delete" and b:
            at = draw(st.integers(0, len(b) - 1))
            del b[at:at + draw(st.integers(1, 4))]
        elif op == "cut":
            del b[draw(st.integers(0, len(b))):]
        elif op == "duplicate" and b:
            start = draw(st.integers(0, len(b) - 1))
            end = draw(st.integers(start, len(b)))
            b[end:end] = b[start:end]
        elif op == "append":
            b += draw(st.sampled_from(ODD_PARTS))
        elif op == "odd":
            b = bytearray(draw(st.sampled_from(ODD_PARTS)))
    return bytes(b)


@st.composite
def mutated_parts(draw, parts: list[bytes]) -> list[bytes]:
    """`parts` with up to four edits: a part mutated, dropped, duplicated or added, the list cut, or
    hundreds of parts appended."""
    parts = list(parts)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["part", "part", "drop", "duplicate", "add", "cut", "many"]))
        if op == "part" and parts:
            at = draw(st.integers(0, len(parts) - 1))
            parts[at] = draw(mutated_bytes(parts[at]))
        elif op == "drop" and parts:
            del parts[draw(st.integers(0, len(parts) - 1))]
        elif op == "duplicate" and parts:
            at = draw(st.integers(0, len(parts) - 1))
            parts.insert(at, parts[at])
        elif op == "add":
            parts.insert(draw(st.integers(0, len(parts))), draw(st.binary(max_size=10) | st.sampled_from(ODD_PARTS)))
        elif op == "cut":
            parts = parts[:draw(st.integers(0, len(parts)))]
        elif op == "many":
            parts += [draw(st.sampled_from([b"1", b"", b"None"]))] * draw(st.integers(1, 300))
    return parts


# ------------------------------------------------------------------ control-plane frames (SPEC.md 4, 8)

ASK = TransferInfo(5, "10.0.0.1", 5555, "10.0.0.1:17000", 0x1000, 0x2000, 4, 8, "torch.float16", True, 2, 0, 8, 4)
VALID_FRAMES = [
    ASK.to_frames(),  # 14 parts: our deepstack row bytes
    ASK.to_frames()[:13],  # a peer's
    registration_frames("10.0.0.1", 5555, "10.0.0.1:17000", 0x1000, 0x2000, 4096, 2048),
    registration_frames("10.0.0.1", 5555, "10.0.0.1:17000", 0x1000, 0),
    status_frames(5, TransferPoll.Success, 0, (1, U64_MAX)),
    status_frames(5, TransferPoll.Transferring, 3),
    status_frames(5, TransferPoll.Failed, 0, (), ("send_failed", "é" * 400)),
    cancel_frames(5, "10.0.0.1", 5555, "10.0.0.1:17000", True),
    cancel_frames(5, "10.0.0.1", 5555, "10.0.0.1:17000"),
    *(cancel_reply_frames(5, 0, answer) for answer in CancelAnswer),
]
frames_from_peers = st.sampled_from(VALID_FRAMES).flatmap(mutated_parts)


def in_i64(*values: int) -> bool:
    return all(type(v) is int and I64_MIN <= v <= I64_MAX for v in values)


def ascii_str(*values: str) -> bool:
    return all(type(v) is str and v.isascii() for v in values)


def allowed_ask(info: TransferInfo) -> None:
    """What SPEC.md 4.2 (and our part 13) lets a parsed TransferInfo hold."""
    assert type(info.room) is int and 0 <= info.room <= I64_MAX
    assert type(info.port) is int and 0 <= info.port <= 0xFFFF
    assert ascii_str(info.endpoint, info.session_id, info.dtype)
    assert all(type(p) is int and 0 <= p <= U64_MAX for p in (info.embedding_ptr, info.deepstack_ptr))
    assert in_i64(info.rows, info.hidden, info.fanout, info.row_start, info.span)
    assert type(info.has_deepstack) is bool
    assert info.deepstack_row_bytes is None or (in_i64(info.deepstack_row_bytes) and info.deepstack_row_bytes >= 0)


def parsed(parser, frames):
    """What `parser` made of `frames` (list and tuple alike: the shortcut and the strict parser agree), or the
    WireError's text; any other exception fails the test."""
    outcomes = []
    for given_frames in (list(frames), tuple(frames)):
        try:
            outcomes.append(("ok", parser(given_frames)))
        except UnreadableChecksum as exc:
            assert parser is parse_status
            assert 0 <= exc.room <= I64_MAX and type(exc.status) is TransferPoll and in_i64(exc.rank)
            outcomes.append(("error", str(exc)))
        except WireError as exc:
            assert str(exc) and len(str(exc)) < 200, str(exc)
            outcomes.append(("error", str(exc)))
    assert outcomes[0] == outcomes[1]
    return outcomes[0]


@given(frames_from_peers)
def test_every_frame_parser_takes_mutated_frames_within_the_spec_or_raises_wire_error(frames):
    assert type(is_registration(frames)) is bool and type(is_cancel(frames)) is bool
    kind, info = parsed(TransferInfo.from_frames, frames)
    if kind == "ok":
        allowed_ask(info)
    kind, reg = parsed(parse_registration, frames)
    if kind == "ok":
        assert is_registration(frames) and ascii_str(reg.endpoint, reg.session_id) and 0 <= reg.port <= 0xFFFF
        assert all(0 <= p <= U64_MAX for p in (reg.embedding_base, reg.deepstack_base))
        assert all(n is None or 0 <= n <= I64_MAX for n in (reg.embedding_len, reg.deepstack_len))
    kind, status = parsed(parse_status, frames)
    if kind == "ok":
        room, poll, rank, sums = status
        assert 0 <= room <= I64_MAX and type(poll) is TransferPoll and in_i64(rank)
        assert len(sums) <= 2 and all(0 <= s <= U64_MAX for s in sums)
    kind, cancel = parsed(parse_cancel, frames)
    if kind == "ok":
        assert is_cancel(frames) and 0 <= cancel.room <= I64_MAX and 0 <= cancel.port <= 0xFFFF
        assert ascii_str(cancel.endpoint, cancel.session_id) and type(cancel.reads_write_failed) is bool
    kind, reply = parsed(parse_cancel_reply, frames)
    if kind == "ok" and reply is not None:
        assert 0 <= reply.room <= I64_MAX and in_i64(reply.rank) and type(reply.answer) is CancelAnswer
    reason = parse_failure_reason(frames)  # never raises
    if reason is not None:
        kind_text, detail = reason
        assert 0 < len(kind_text) <= 32 and len(detail.encode()) <= 3 * MAX_REASON_BYTES + 3
        assert kind_text.isprintable() and detail.isprintable()


# ------------------------------------------------------------------ the framed wire (SPEC.md 9)

MSG = wire.Msg({"room": 5, "rows": 3, "sum": U64_MAX, "eq": "a=b", "ключ": "значение"}, b"body\n\nwith blank lines")


@given(mutated_bytes(MSG.encode()))
def test_msg_decode_takes_a_mutated_message_or_raises_msg_error(data):
    try:
        msg = wire.Msg.decode(data)
    except wire.MsgError as exc:
        assert str(exc) == "a message that is not UTF-8" or str(exc).startswith("a header line without '='")
        return
    for key in msg.keys():
        assert "=" not in key and "\n" not in key and "\n" not in msg.get(key)
        try:
            assert -(1 << 63) <= msg.number(key) <= U64_MAX
        except wire.MsgError as exc:
            assert str(exc) == f"{key}: not a number"
    assert wire.Msg.decode(msg.encode()) == msg


LAYER = wire.layer_frame(3, 2, bytes(range(40)))


@given(mutated_bytes(LAYER))
def test_parse_layer_takes_a_mutated_layer_payload_only_when_its_checksum_holds(payload):
    try:
        layer, rows, data = wire.parse_layer(payload)
    except wire.LayerError as exc:
        assert str(exc).startswith(("LAYER payload shorter than", "LAYER checksum mismatch"))
        return
    assert 0 <= layer <= 0xFFFF_FFFF and 0 <= rows <= 0xFFFF_FFFF
    assert wire.layer_sum(data) == int.from_bytes(payload[8:16], "little") and bytes(data) == payload[16:]


def frame(kind: int, payload: bytes) -> bytes:
    return (len(payload) + 1).to_bytes(4, "little") + bytes([kind]) + payload


STREAM = frame(wire.PREFILL, MSG.encode()) + frame(wire.LAYER, LAYER) + frame(wire.FIRST, b"")
READ_LIMIT = 4096  # a header may claim up to 4 GiB: past this, refused before anything is allocated


@given(mutated_bytes(STREAM))
def test_read_frame_reads_a_mutated_stream_frame_by_frame_or_raises_frame_error(stream):
    stream = stream[:60000]  # the whole stream fits the pipe: nothing blocks
    r, w = os.pipe()
    try:
        os.write(w, stream)
        os.close(w)
        w = -1
        read = 0
        while True:
            try:
                kind, payload, wire_us = wire.read_frame(r, READ_LIMIT)
            except wire.FrameError as exc:
                assert str(exc).startswith("read: ") and isinstance(exc, OSError)
                if "exceeds the limit" in str(exc):
                    assert int.from_bytes(stream[read:read + 4], "little") - 1 > READ_LIMIT
                break
            assert 0 <= kind <= 255 and len(payload) <= READ_LIMIT and wire_us >= 0
            assert stream[read + 5:read + 5 + len(payload)] == payload
            read += 5 + len(payload)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


# ------------------------------------------------------------------ the bootstrap rendezvous (SPEC.md 5)

PUT_BODY = json.dumps({"role": "Prefill", "world_size": 4, "dp_size": 2, "rank_ip": "10.0.0.1", "rank_port": 7000,
                       "engine_rank": 3}).encode()
json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers(-(10**30), 10**30) | st.text(max_size=8)
    | st.sampled_from([float("nan"), float("inf"), -float("inf"), 10**4000, -(10**4000), 1 << 64, 2, 1, 0, -1]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
put_fields = st.dictionaries(st.sampled_from(["role", "world_size", "dp_size", "rank_ip", "rank_port", "engine_rank"]),
                             json_values)


def registration_or_400(raw: bytes):
    """What the server makes of a PUT or DELETE /route body: its five fields within their bounds, or a 4xx whose
    text is short."""
    try:
        world_size, dp_size, rank_ip, rank_port, engine_rank = bs._parse_registration(raw)
    except bs._RequestError as error:
        assert 400 <= error.status < 500 and 0 < len(error.text) <= 1024, (error.status, len(error.text))
        return None
    assert in_i64(world_size, dp_size, rank_port, engine_rank)
    assert 1 <= dp_size <= world_size <= bs.MAX_WORLD_SIZE and world_size % dp_size == 0
    assert 1 <= rank_port <= 65535 and 0 <= engine_rank < world_size
    assert 0 < len(rank_ip) <= bs.MAX_HOST_CHARS and bs._HOST.fullmatch(rank_ip)
    return world_size, dp_size, rank_ip, rank_port, engine_rank


@given(mutated_bytes(PUT_BODY))
def test_a_mutated_route_body_is_taken_within_its_bounds_or_answered_4xx(raw):
    registration_or_400(raw)
    assert type(bs._registered(raw)) is bool and bs._unregistered(raw) in (True, False, None)


@given(put_fields, st.booleans())
def test_a_route_body_of_any_json_values_nan_and_huge_numbers_among_them_is_taken_or_answered_4xx(fields, fill):
    if fill:  # the valid body with some of its fields replaced, so the later checks are reached too
        fields = {**json.loads(PUT_BODY), **fields}
    raw = json.dumps(fields).encode()
    if registration_or_400(raw) is not None:
        assert fields["role"] == "Prefill"


QUERY = "engine_rank=-1&target_dp_group=-1"


@given(mutated_bytes(QUERY.encode()))
def test_a_mutated_route_query_reads_as_integers_or_answers_400(query):
    values = parse_qs(query.decode("latin-1"), keep_blank_values=True)
    for name in ("engine_rank", "target_dp_group"):
        try:
            value = bs._query_int(values, name)
        except bs._RequestError as error:
            assert error.status == 400 and name in error.text
        else:
            assert type(value) is int and len(str(value)) <= 4300


# ------------------------------------------------------------------ the cores behind the listeners

HIDDEN, DTYPE, ROW, SRC = 256, "torch.bfloat16", 512, 0x7000_0000
GOOD_ROOM = 1
GOOD = TransferInfo(GOOD_ROOM, "10.1.1.1", 7000, "10.1.1.1:17000", 0x10000, 0, 4, HIDDEN, DTYPE, False, 1, 0, 4)
GOOD_REGISTRATION = Registration("10.1.1.1", 7000, "10.1.1.1:17000", 0x10000, 0, 4 * ROW, 0)
LIAR = "10.2.2.2"


class Token:
    """The caller's object for one send of a room."""


def other_rooms(value: int) -> int:
    """A hostile event's room: any room but the one the test serves."""
    return value if value != GOOD_ROOM else value + 1


texts = st.text(st.characters(max_codepoint=127), max_size=24) | st.sampled_from(["", DTYPE, "torch.bool", LIAR,
                                                                                      f"{LIAR}:1", "*", "::1%x"])
numbers = st.integers(I64_MIN, I64_MAX) | st.sampled_from([0, 1, -1, 4, HIDDEN, 1 << 31, 1 << 32, 1 << 62, I64_MAX,
                                                           I64_MIN])
pointers = st.integers(0, U64_MAX) | st.sampled_from([0, 0x10000, U64_MAX])
rooms = st.integers(0, I64_MAX).map(other_rooms)
widths = st.none() | st.integers(0, I64_MAX)
built_asks = st.builds(TransferInfo, rooms, texts, st.integers(0, 0xFFFF), texts, pointers, pointers, numbers, numbers,
                       texts, st.booleans(), numbers, numbers, numbers, widths)
built_registrations = st.builds(Registration, texts, st.integers(0, 0xFFFF), texts, pointers, pointers, widths, widths)
built_cancels = st.builds(Cancel, rooms, texts, st.integers(0, 0xFFFF), texts, st.booleans())


def from_the_wire(frames: list[bytes]):
    """What the encode rank's driver makes of a request: a registration, a cancel, an ask, or None (dropped)."""
    try:
        if is_registration(frames):
            return parse_registration(frames)
        if is_cancel(frames):
            return parse_cancel(frames)
        return TransferInfo.from_frames(frames)
    except WireError:
        return None


def liars(event):
    """A hostile event kept off the served room's number and its receiver's endpoint and session."""
    if isinstance(event, (TransferInfo, Cancel)) and event.room == GOOD_ROOM:
        return None
    if event is not None and (event.session_id == GOOD.session_id or (event.endpoint, event.port) == ("10.1.1.1",
                                                                                                      7000)):
        return None
    return event


requests = st.one_of(built_asks, built_registrations, built_cancels,
                     st.sampled_from(VALID_FRAMES).flatmap(mutated_parts).map(from_the_wire)).map(liars)
encode_events = st.lists(st.one_of(requests, st.floats(0, 300)), max_size=12)


@given(encode_events)
def test_the_encode_core_fed_any_parsed_request_raises_nothing_and_still_serves_an_honest_receiver(events):
    now = 0.0
    encode = EncodeCore(fanout_timeout_s=120.0, now=now)
    encode.offer(Offer(GOOD_ROOM, Token(), SRC, 4, HIDDEN, DTYPE, ROW, None, 0, None), now)

    def carry(actions: list) -> None:
        for action in actions:  # the liars' writes complete as if their memory took the bytes
            if isinstance(action, StartWrite):
                carry(encode.write_done(action.wid, (), now))

    for event in events:
        now += 0.01
        if isinstance(event, float):
            carry(encode.tick(now + min(event, 100.0)))  # within the served room's fanout timeout
        elif isinstance(event, Registration):
            carry(encode.registration(event, now))
        elif isinstance(event, Cancel):
            carry(encode.cancel(event, now))
        elif isinstance(event, TransferInfo):
            carry(encode.ask(event, now))
    encode.registration(GOOD_REGISTRATION, now)
    [write] = [a for a in encode.ask(GOOD, now) if isinstance(a, StartWrite)]
    assert (write.session_id, write.srcs, write.dsts, write.lengths) == (GOOD.session_id, (SRC,), (0x10000,),
                                                                        (4 * ROW,))
    told = [a for a in encode.write_done(write.wid, (9,), now) if isinstance(a, PushStatus)]
    assert told == [PushStatus("10.1.1.1", 7000, GOOD_ROOM, TransferPoll.Success, (9,))]


status_events = st.one_of(
    st.sampled_from(VALID_FRAMES).flatmap(mutated_parts).map(lambda frames: ("frames", frames)),
    st.tuples(st.just("status"), st.integers(0, I64_MAX), st.sampled_from(list(TransferPoll)), numbers,
              st.lists(st.integers(0, U64_MAX), max_size=2).map(tuple)),
    st.tuples(st.just("answer"), st.integers(0, I64_MAX), numbers, st.sampled_from(list(CancelAnswer))),
)


def lies_about_the_room(room: int, rank: int) -> bool:
    """Whether a status could rightly change the served room: its number, from its encode rank (0)."""
    return room == GOOD_ROOM and rank == 0


def take_status(prefill: PrefillCore, event: tuple, now: float, lanes: bool = False) -> list:
    """What the prefill core does with one status event, as the session manager's I/O thread feeds it (with
    `lanes`, a message that settles a lane goes to `lanes_settled`, as the native intake hands it over)."""
    if event[0] == "frames":
        frames = event[1]
        if lanes:
            room = settles(frames, prefill.lanes)
            assert _native.lane_match(frames, prefill.lanes, int(TransferPoll.Success)) == room
            if room is not None:
                if lies_about_the_room(room, prefill.lanes[room]):
                    return []
                del prefill.lanes[room]
                return prefill.lanes_settled(now, [room])
        try:
            reply = parse_cancel_reply(frames)
            if reply is not None:
                if lies_about_the_room(reply.room, reply.rank):
                    return []
                return prefill.cancel_answered(now, reply.room, reply.rank, reply.answer)
            room, poll, rank, sums = parse_status(frames)
            unreadable = None
            reason = parse_failure_reason(frames) if poll is TransferPoll.Failed and len(frames) > 3 else None
        except UnreadableChecksum as exc:
            room, poll, rank, sums, unreadable, reason = exc.room, exc.status, exc.rank, (), str(exc), None
        except WireError:
            return []
        if lies_about_the_room(room, rank):
            return []
        return prefill.status(now, room, poll, rank, sums, unreadable, reason)
    if event[0] == "status" and not lies_about_the_room(event[1], event[3]):
        return prefill.status(now, *event[1:])
    if event[0] == "answer" and not lies_about_the_room(event[1], event[2]):
        return prefill.cancel_answered(now, *event[1:])
    return []


@given(st.lists(status_events, max_size=12))
def test_the_prefill_core_fed_any_parsed_status_raises_nothing_and_still_concludes_its_room(events):
    prefill = core()
    token, actions = prefill.receive(0.0, spec(GOOD_ROOM))
    prefill.parallel_resolved(0.0, BOOT, 1, 1)
    assert any(isinstance(a, SendAsk) for a in prefill.route_resolved(0.0, KEY0, ENCODE))
    now = 0.0
    for event in events:
        now += 0.01
        take_status(prefill, event, now)
    assert prefill.stage(GOOD_ROOM) == "asked"
    actions = prefill.status(now, GOOD_ROOM, TransferPoll.Success, 0)
    assert [(a.room, a.failure) for a in actions if isinstance(a, Conclude)] == [(GOOD_ROOM, None)]


# Rooms asked besides the served one, each in a lane (integrity checks off), which hostile statuses may settle
# or end; and one never asked.
LANE_ROOMS, UNASKED_ROOM = (5, 6), 7
lane_status_events = st.one_of(
    status_events,
    st.sampled_from([status_frames(room, TransferPoll.Success, 0, sums) for room in (*LANE_ROOMS, UNASKED_ROOM)
                     for sums in ((), (1,), (1, U64_MAX))]).flatmap(mutated_parts).map(lambda f: ("frames", f)),
    st.tuples(st.sampled_from((*LANE_ROOMS, UNASKED_ROOM)), st.sampled_from(list(TransferPoll)), st.integers(0, 2),
              st.lists(st.integers(0, U64_MAX), max_size=2).map(tuple))
    .map(lambda t: ("frames", status_frames(*t))),
    st.tuples(st.just("answer"), st.sampled_from(LANE_ROOMS), st.integers(0, 1), st.sampled_from(list(CancelAnswer))),
)


@given(st.lists(lane_status_events, max_size=12))
@example([("frames", status_frames(5, TransferPoll.Success, 0))])
def test_the_prefill_core_settling_lanes_does_with_any_status_what_its_general_rules_do(events):
    """Integrity checks off: one core settles what lanes take, the other takes everything through status();
    each event must do the same in both, and the served room still concludes on its Success."""
    cores = []
    for _ in range(2):
        prefill = core(integrity=False)
        for room in (GOOD_ROOM, *LANE_ROOMS):
            prefill.receive(0.0, spec(room, slot=room))
        prefill.parallel_resolved(0.0, BOOT, 1, 1)
        assert [a.room for a in prefill.route_resolved(0.0, KEY0, ENCODE) if isinstance(a, SendAsk)] \
            == [GOOD_ROOM, *LANE_ROOMS]
        assert prefill.lanes == {GOOD_ROOM: 0, **{room: 0 for room in LANE_ROOMS}}
        cores.append(prefill)
    in_lanes, general = cores
    now = 0.0
    for event in events:
        now += 0.01
        assert take_status(in_lanes, event, now, lanes=True) == take_status(general, event, now), event
        assert [(in_lanes.stage(room), in_lanes.token(room)) for room in (GOOD_ROOM, *LANE_ROOMS)] \
            == [(general.stage(room), general.token(room)) for room in (GOOD_ROOM, *LANE_ROOMS)]
        assert in_lanes._answered_at == general._answered_at
        assert all(in_lanes.stage(room) == "asked" for room in in_lanes.lanes)
    assert in_lanes.stage(GOOD_ROOM) == general.stage(GOOD_ROOM) == "asked"
    success = status_frames(GOOD_ROOM, TransferPoll.Success, 0)
    if settles(success, in_lanes.lanes) == GOOD_ROOM:  # else a status about it, from another rank, ended its lane
        del in_lanes.lanes[GOOD_ROOM]
        actions = in_lanes.lanes_settled(now, [GOOD_ROOM])
    else:
        actions = in_lanes.status(now, GOOD_ROOM, TransferPoll.Success, 0)
    assert actions == general.status(now, GOOD_ROOM, TransferPoll.Success, 0) \
        == [Conclude(GOOD_ROOM, in_lanes.token(GOOD_ROOM), None)]


def test_the_mutations_reach_every_kind_of_outcome():
    # The strategies are no use if they never get past the first check: each valid frame set, unmutated,
    # parses as what it is, and the mutations shown here are refused with the SPEC's own words.
    assert TransferInfo.from_frames(VALID_FRAMES[0]) == ASK
    assert parse_registration(VALID_FRAMES[2]).embedding_len == 4096
    assert parse_cancel(VALID_FRAMES[7]).reads_write_failed
    assert parse_cancel_reply(VALID_FRAMES[-1]) == CancelReply(5, 0, CancelAnswer.WRITE_FAILED)
    with pytest.raises(WireError, match="^rows is not an integer$"):
        TransferInfo.from_frames([*ASK.to_frames()[:6], b"NaN", *ASK.to_frames()[7:]])
    with pytest.raises(WireError, match="^room is not an integer$"):
        parse_status([b"0" * 5000 + b"7" + b"9" * 20, b"5", b"0"])

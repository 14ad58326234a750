"""Lanes (transfer.core.lane): which statuses settle one, the native twin of that rule, and when a
PrefillCore grants and ends one. Whole schedules with lanes on and off: tests/unit/test_core_pair.py."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prefill_rooms import BOOT, ENCODE, KEY0, asked, spec
from prefill_rooms import core as prefill_core

from transfer import _native
from transfer.core.failure import Failure, FailureKind
from transfer.core.lane import MAX_DIGITS, settles
from transfer.core.prefill import Announce, Conclude, LookUpParallel, PrefillCore, SendAsk, Warn
from transfer.frames import CancelAnswer, parse_cancel_reply, parse_status, status_frames
from transfer.status import TransferPoll

SUCCESS = int(TransferPoll.Success)


def digits(most: int = MAX_DIGITS + 3) -> st.SearchStrategy[bytes]:
    return st.text("0123456789", min_size=0, max_size=most).map(str.encode)


PART = st.one_of(
    digits(),
    st.integers(0, 12).map(lambda n: str(n).encode()),
    st.sampled_from([b"5", b"05", b"0", b"9223372036854775807", b"9223372036854775808", b"18446744073709551615",
                     b"18446744073709551616", b"cancel-confirmed", b"failure", b"+5", b" 5", b"\xd9\xa5", b""]),
    st.binary(max_size=4),
    st.sampled_from(["5", 5, None, bytearray(b"5"), memoryview(b"5")]),
)
EDGES = st.sampled_from([b"18446744073709551615", b"18446744073709551616", b"99999999999999999999",
                         b"9223372036854775807", b"9223372036854775808", b"000000000000000000001", b"0"])
# Mostly near-plain Successes of rooms 0-12 from ranks 0-12, so the rule's every branch is reached.
SMALL = st.integers(0, 12).map(lambda n: b"%d" % n)
NEAR_STATUS = st.tuples(
    st.one_of(SMALL, SMALL, SMALL, SMALL, st.sampled_from([b"01", b"0001"]), PART),
    st.one_of(st.just(b"5"), st.just(b"5"), st.just(b"5"), st.sampled_from([b"05", b"0", b"4"]), PART),
    st.one_of(SMALL, SMALL, SMALL, SMALL, EDGES, PART),
    st.lists(st.one_of(digits(21), EDGES, EDGES, PART), max_size=3),
).map(lambda t: [t[0], t[1], t[2], *t[3]])
MESSAGE = st.one_of(st.lists(PART, max_size=7), NEAR_STATUS, NEAR_STATUS, NEAR_STATUS)
LANES = st.dictionaries(st.integers(0, 12) | st.sampled_from([(1 << 63) - 1, 1 << 63]),
                        st.integers(0, 12) | st.sampled_from([(1 << 63) - 1, 1 << 63, -1]), max_size=6)


def with_its_lane(parts: list, lanes: dict[int, int]) -> dict[int, int]:
    """`lanes` plus one for the room and rank the message names, where it names them in digits."""
    if len(parts) >= 3 and all(type(p) is bytes and p.isdigit() for p in (parts[0], parts[2])):
        return {**lanes, int(parts[0]): int(parts[2])}
    return lanes


@settings(max_examples=3000, deadline=None)
@given(MESSAGE, LANES, st.booleans())
def test_the_native_rule_settles_exactly_what_the_python_rule_does(parts, lanes, its_lane):
    if its_lane:
        lanes = with_its_lane(parts, lanes)
    assert _native.lane_match(parts, lanes, SUCCESS) == settles(parts, lanes)


@settings(max_examples=1000, deadline=None)
@given(MESSAGE, LANES)
def test_a_status_a_lane_settles_is_that_rooms_success_from_its_lane_rank_to_the_general_parsers(parts, lanes):
    lanes = with_its_lane(parts, lanes)
    room = settles(parts, lanes)
    if room is None:
        return
    assert parse_cancel_reply(parts) is None
    assert parse_status(parts)[:3] == (room, TransferPoll.Success, lanes[room])


def test_only_plain_successes_of_the_lanes_rank_settle():
    lanes = {7: 0}
    assert settles(status_frames(7, TransferPoll.Success, 0), lanes) == 7
    assert settles([b"7", b"5", b"0", b"123", b"18446744073709551615"], lanes) == 7  # checksums, unread
    assert settles(status_frames(7, TransferPoll.Success, 1), lanes) is None  # another rank
    assert settles(status_frames(7, TransferPoll.Failed, 0), lanes) is None
    assert settles(status_frames(7, TransferPoll.Transferring, 0), lanes) is None
    assert settles(status_frames(8, TransferPoll.Success, 0), lanes) is None  # no lane
    assert settles([b"7", b"5", b"0", b"cancel-confirmed"], lanes) is None
    assert settles([b"7", b"5", b"0", b"1", b"2", b"3"], lanes) is None  # more parts than a status has
    assert settles([b"7", b"5", b"0", b"18446744073709551616"], lanes) is None  # a checksum past a u64
    assert settles((b"7", b"5", b"0"), lanes) is None  # not a received message


def test_lane_take_needs_a_lanes_dict_and_a_bound_socket_library():
    with pytest.raises(TypeError):
        _native.lane_match([b"1", b"5", b"0"], [(1, 0)], SUCCESS)
    with pytest.raises(TypeError):
        _native.lane_take(0, [(1, 0)], SUCCESS, 8)


# ------------------------------------------------------------- the core's grants


def plain() -> PrefillCore:
    return prefill_core(deadline_s=10.0, integrity=False)


def test_a_room_asked_in_the_plain_case_gets_a_lane_naming_its_encode_rank():
    c = plain()
    asked(c, 3)
    assert c.lanes == {3: 0}


def test_with_integrity_checks_on_no_room_gets_a_lane():
    c = prefill_core(deadline_s=10.0)
    asked(c, 3)
    assert c.lanes == {}


def test_settling_a_lane_does_what_the_status_would():
    settled, general = plain(), plain()
    tokens = [asked(c, 3) for c in (settled, general)]
    del settled.lanes[3]  # as the driver's intake takes it out
    assert settled.lanes_settled(1.0, [3]) == general.status(1.0, 3, TransferPoll.Success, 0) \
        == [Conclude(3, tokens[0], None)]
    assert settled.stage(3) == general.stage(3) == "concluded"
    assert settled._answered_at == general._answered_at == {ENCODE: 1.0}


def test_settling_a_lane_still_in_lanes_takes_it_out_as_the_status_would():
    """The driver's intake takes a room out of lanes as it settles it; handed one still there, the core takes it out."""
    settled, general = plain(), plain()
    tokens = [asked(c, room) for c in (settled, general) for room in (3, 4)]
    assert settled.lanes_settled(1.0, [3]) == general.status(1.0, 3, TransferPoll.Success, 0) \
        == [Conclude(3, tokens[0], None)]
    assert settled.lanes == general.lanes == {4: 0}
    assert books(settled) == books(general)


def test_a_lane_settled_for_a_room_no_longer_in_the_plain_case_is_warned_of_and_goes_the_general_rules():
    c, general = plain(), plain()
    for core in (c, general):
        token = asked(core, 3)
        core.abandon(1.0, 3, token)  # given up: a cancel went out, and its lane ended
    warning, *actions = c.lanes_settled(1.1, [3])
    assert type(warning) is Warn and "room 3: settled in a lane it should no longer have had" in warning.message
    assert actions == general.status(1.1, 3, TransferPoll.Success, 0)
    assert actions[0].failure.kind is FailureKind.OTHER  # the general rules do not take it as this ask's


# What becomes of a room before its lane's Success is settled: nothing (the plain case), given up (its lane
# ended: the general rules take the Success), or cleared (not held: the Success is warned of and dropped).
BEFORE_SETTLED = st.sampled_from(["plain", "plain", "plain", "given up", "cleared"])


@given(st.lists(st.tuples(st.integers(0, 7), BEFORE_SETTLED), min_size=1, max_size=6, unique_by=lambda r: r[0]))
@example([(1, "plain"), (2, "given up"), (3, "plain")])
@example([(1, "plain"), (2, "plain")])
def test_lanes_succeeded_tells_the_plain_answer_of_a_batch_by_tokens_and_any_other_as_the_rooms_one_by_one(rooms):
    """lanes_succeeded() of a batch: with every room in its plain case, each room's token in order (each a
    Conclude Success, as status() answers); else the actions settling each room alone would give, in order."""
    batch, single = plain(), plain()
    for core in (batch, single):
        for room, before in rooms:
            token = asked(core, room)
            if before == "given up":
                core.abandon(0.5, room, token)
            elif before == "cleared":
                core.clear(0.5, room, token)
            core.lanes.pop(room, None)  # as the driver's intake takes it out
    numbers = [room for room, _ in rooms]
    tokens, actions = batch.lanes_succeeded(1.0, numbers)
    one_by_one = [action for room in numbers for action in single.lanes_settled(1.0, [room])]
    if all(before == "plain" for _, before in rooms):
        assert actions == [] and tokens == [batch._rooms[room].token for room in numbers]
        assert one_by_one == [Conclude(room, token) for room, token in zip(numbers, tokens)]
    else:
        assert tokens == [] and actions == one_by_one
    assert books(batch) == books(single)


@pytest.mark.parametrize("event", ["status", "clear", "let_go", "abandon", "deadline", "refused", "close",
                                   "connect_failed", "unsent", "fail"])
def test_anything_else_that_happens_to_the_room_ends_its_lane(event):
    c = plain()
    token = asked(c, 3)
    asked(c, 4)
    if event == "status":
        c.status(1.0, 3, TransferPoll.Transferring, 0)
    elif event == "clear":
        c.clear(1.0, 3, token)
    elif event == "let_go":  # the room forgotten before the driver settled its lane: no Success concludes it
        assert c.let_go(1.0, 3, token) is False and c.stage(3) is None
    elif event == "abandon":
        c.abandon(1.0, 3, token)
    elif event == "deadline":
        c.tick(10.0 + 1e-3, unread=False)
        assert c.lanes == {}
        return
    elif event == "refused":
        c.refused(1.0, ENCODE, [SendAsk(ENCODE, 3, token, None)])  # the socket did not take it
        assert c.stage(3) == "queued"
    elif event == "close":
        c.close(1.0, Failure(FailureKind.OTHER, "closed"))
        assert c.lanes == {}
        return
    elif event == "connect_failed":
        c.connect_failed(1.0, ENCODE, "no route to host")
        assert c.lanes == {}
        return
    elif event == "unsent":
        c.unsent(1.0, SendAsk(ENCODE, 3, token, None), Failure(FailureKind.OTHER, "the socket raised"))
    elif event == "fail":
        c.fail(1.0, 3, token, Failure(FailureKind.OTHER, "the driver could not carry out an action"))
    assert c.lanes == {4: 0}


def test_a_room_asked_again_while_an_earlier_asks_statuses_may_come_gets_no_lane():
    """The earlier ask of the room number was given up: with its cancel unanswered, or with no cancel (its
    connection dropped), a Success may be that ask's, which only the general rules tell apart."""
    c = plain()
    token = asked(c, 7)
    c.abandon(1.0, 7, token)  # a cancel goes, unanswered
    c.clear(1.0, 7, token)
    c.cancel_answered(1.1, 7, 0, CancelAnswer.TOO_LATE)  # answered, with more to come
    asked(c, 7, 1.2)
    assert c.lanes == {}


def test_a_room_asked_again_while_its_earlier_cancel_is_set_aside_gets_no_lane():
    """A cancel set aside (its connection lost) still takes late answers: a Success may be the earlier ask's."""
    c = plain()
    token = asked(c, 7)
    c.abandon(1.0, 7, token)  # a cancel goes, unanswered
    c.clear(1.0, 7, token)
    c.cancels.set_aside((7, 0))  # as a stale cancel on a connection since lost is
    assert c.cancels.ghost((7, 0)) and (7, 0) not in c.cancels.awaiting
    asked(c, 7, 1.2)
    assert c.lanes == {}


# ------------------------------------------------- every core event, with lanes and without

ADDRS = [ENCODE, ("10.0.0.2", 7001), ("10.0.0.4", 7000)]
KEYS = [(BOOT, 0, 0), (BOOT, 1, 0)]  # with sizes (2, 2) and prefill tp 2: even rooms to encode rank 0, odd to 1
ROOMS = st.integers(0, 4)
RANKS = st.integers(0, 1)
SUCCESS_RANK = st.sampled_from([None, None, 0, 1])  # None: the room's own encode rank under sizes (2, 2)
EVENTS = st.lists(st.one_of(
    st.tuples(st.just("receive"), ROOMS),
    st.tuples(st.just("clear"), ROOMS, st.booleans()),  # abandoned first, as the driver's clear() does, or not
    st.tuples(st.just("status"), ROOMS, st.sampled_from(list(TransferPoll)), RANKS),
    *[st.tuples(st.just("success"), ROOMS, SUCCESS_RANK)] * 3,
    st.tuples(st.just("answer"), ROOMS, RANKS, st.sampled_from(list(CancelAnswer))),
    st.tuples(st.just("cancel_unsent"), ROOMS, RANKS),
    st.tuples(st.just("dropped"), st.sampled_from(ADDRS)),
    st.tuples(st.just("connect_failed"), st.sampled_from(ADDRS)),
    st.tuples(st.just("refused"),),  # the last step's asks, not taken by their socket
    st.tuples(st.just("unsent"),),  # the last step's first ask, which its socket raised on
    st.tuples(st.just("writable"), st.sampled_from(ADDRS)),
    st.tuples(st.just("parallel"), st.sampled_from([(2, 2), (2, 2), (1, 1), (2, 1)])),
    *[st.tuples(st.just("route"), st.sampled_from(KEYS), st.just(ENCODE), st.just(None))] * 2,
    st.tuples(st.just("route"), st.sampled_from(KEYS), st.sampled_from(ADDRS), st.sampled_from([None, "a", "b"])),
    st.tuples(st.just("missing"), st.sampled_from(KEYS)),
    st.tuples(st.just("lookup_failed"), st.sampled_from(KEYS)),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 1.0, 5.0, 10.0, 301.0]), st.booleans()),
    st.tuples(st.just("fail"), ROOMS),
    st.tuples(st.just("idle_closed"), st.sampled_from(ADDRS)),
    st.tuples(st.just("close"),),
), min_size=20, max_size=80)


def step(c: PrefillCore, event: tuple, now: float, last: list, lanes: bool) -> list:
    """One event into the core; a Success goes to `lanes_settled` when `lanes` and its lane settles it."""
    kind, *args = event
    token = c.token(args[0]) if args and type(args[0]) is int else None
    if kind == "receive":
        return [] if args[0] in c else c.receive(now, spec(args[0], slot=args[0]))[1]
    if kind == "clear":
        actions = c.abandon(now, args[0], token) if token is not None and args[1] else []
        c.clear(now, args[0], token)
        return actions
    if kind == "status":
        return c.status(now, *args)
    if kind == "success":
        room, rank = args[0], args[0] % 2 if args[1] is None else args[1]
        settled = settles(status_frames(room, TransferPoll.Success, rank), c.lanes) if lanes else None
        if settled is None:
            return c.status(now, room, TransferPoll.Success, rank)
        del c.lanes[settled]
        actions = c.lanes_settled(now, [settled])
        # What the driver's _settle_lanes() counts on, leaving a plain Success's memory_safe as it is.
        assert all(c.safe(a.room, a.token) is False for a in actions if type(a) is Conclude and a.failure is None
                   and not a.unverified and not any(type(b) is Warn for b in actions)), actions
        return actions
    if kind == "answer":
        return c.cancel_answered(now, *args)
    if kind == "cancel_unsent":
        return [] if token is None else c.cancel_unsent(now, args[0], args[1], token)
    if kind == "dropped":
        return c.connection_dropped(now, args[0])
    if kind == "connect_failed":
        return c.connect_failed(now, args[0], "connection refused")
    if kind == "refused":
        asks = [a for a in last if type(a) in (Announce, SendAsk)]
        return c.refused(now, asks[0].addr, [a for a in asks if a.addr == asks[0].addr]) if asks else []
    if kind == "unsent":
        asks = [a for a in last if type(a) is SendAsk]
        return c.unsent(now, asks[0], Failure(FailureKind.OTHER, "the socket raised")) if asks else []
    if kind == "writable":
        return c.writable(now, args[0])
    if kind == "parallel":
        return c.parallel_resolved(now, BOOT, *args[0])
    if kind == "route":
        return c.route_resolved(now, *args)
    if kind == "missing":
        return c.route_missing(now, args[0], "no such encode rank")
    if kind == "lookup_failed":
        return c.lookup_failed(now, BOOT, args[0], "server down", 0.1)
    if kind == "tick":
        return c.tick(now, 2, unread=args[1])
    if kind == "fail":
        return [] if token is None else c.fail(now, args[0], token, Failure(FailureKind.OTHER, "failed"))
    if kind == "idle_closed":
        return c.connection_closed(now, args[0]) if c.idle(args[0], now) else []
    return c.close(now, Failure(FailureKind.CLOSED, "closed"))


def books(c: PrefillCore) -> tuple:
    """What a lane must leave as status() would: the rooms, who answered when, cancels, unfenced asks."""
    rooms = sorted((room, s.stage, s.token, s.asked, s.given_up, s.safe, s.outcome) for room, s in c._rooms.items())
    return (rooms, dict(c._answered_at), dict(c._unfenced_asks), c.cancels.pending, dict(c.cancels.ghosts),
            dict(c._conns))


ASKED = [("receive", 0), ("parallel", (2, 2)), ("route", KEYS[0], ENCODE, None)]
# A lane's room cleared (not given up first), or its ask not taken by the socket, then its Success.
CLEARED = [*ASKED, ("clear", 0, False), ("success", 0, None)]
REFUSED = [*ASKED, ("refused",), ("success", 0, None)]
# Rooms asked again while the earlier ask's statuses may still come: its cancel unanswered, or given up with none.
ASKED_AGAIN_WITH_A_CANCEL_OUT = [*ASKED, ("clear", 0, True), ("receive", 0), ("tick", 1.0, False), ("success", 0, None)]
ASKED_AGAIN_WITH_NO_CANCEL = [*ASKED, ("dropped", ENCODE), ("clear", 0, True), ("receive", 0),
                              ("route", KEYS[0], ENCODE, None), ("success", 0, None)]


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.integers(1, 3), st.sampled_from([1, 2, 256]))
@example(CLEARED, 1, 256)
@example(REFUSED, 1, 256)
@example(ASKED_AGAIN_WITH_A_CANCEL_OUT, 1, 256)
@example(ASKED_AGAIN_WITH_NO_CANCEL, 1, 256)
def test_a_core_settling_lanes_takes_every_event_as_one_without_them(events, ask_batch, max_sockets):
    """Integrity checks off, prefill tp 2, rooms 0-4 over two encode ranks and three addresses: each event does
    the same to a core whose lane Successes go to lanes_settled as to one that takes them all through status()."""
    in_lanes, general = (prefill_core(tp_size=2, deadline_s=10.0, integrity=False, ask_batch=ask_batch,
                                      max_sockets=max_sockets) for _ in range(2))
    now = 0.0
    last: tuple[list, list] = ([], [])
    for event in events:
        now += 0.05 + (event[1] if event[0] == "tick" else 0.0)
        last = (step(in_lanes, event, now, last[0], lanes=True), step(general, event, now, last[1], lanes=False))
        assert last[0] == last[1], event
        assert books(in_lanes) == books(general), event
        assert all(in_lanes.stage(room) == "asked" for room in in_lanes.lanes), event


def test_a_room_given_up_before_its_ask_goes_out_gets_no_lane():
    """The driver clears a room in the same hold it gives it up in; a core driven alone may ask for it after."""
    c = plain()
    token, actions = c.receive(0.0, spec(5, slot=5))
    assert actions == [LookUpParallel(BOOT)]
    c.abandon(0.1, 5, token)
    c.parallel_resolved(0.2, BOOT, 1, 1)
    assert SendAsk in [type(a) for a in c.route_resolved(0.3, KEY0, ENCODE)]
    assert c.lanes == {}

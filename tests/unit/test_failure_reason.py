"""The encode side's failure reason on a Failed status (our extension): codec, encode core, prefill core."""

from __future__ import annotations

import pytest
import zmq

from transfer.core.encode import Conclude, EncodeCore, Offer, PushStatus
from transfer.core.failure import Failure, FailureKind
from transfer.core.parked import ParkedAsks
from transfer.core.prefill import ENCODE_FAILED, PrefillCore, RoomSpec
from transfer.core.prefill import Conclude as PrefillConclude
from transfer.frames import (
    FAILURE_MARKER,
    MAX_REASON_BYTES,
    CancelAnswer,
    TransferInfo,
    WireError,
    cancel_reply_frames,
    parse_cancel_reply,
    parse_failure_reason,
    parse_status,
    status_frames,
)
from transfer.status import TransferPoll

Failed = TransferPoll.Failed


# ------------------------------------------------------------------ codec


def test_without_a_reason_the_status_is_the_specs_three_parts_byte_for_byte():
    assert status_frames(7, Failed, 1) == [b"7", b"0", b"1"]
    assert status_frames(7, TransferPoll.Success, 1, (5, 6)) == [b"7", b"5", b"1", b"5", b"6"]


def test_a_reason_rides_in_three_parts_after_the_specs_three():
    frames = status_frames(7, Failed, 1, reason=("geometry", "room 7: hidden 512 != item hidden 1024"))
    assert frames == [b"7", b"0", b"1", FAILURE_MARKER, b"geometry", b"room 7: hidden 512 != item hidden 1024"]
    # What a peer reads (the first three parts) is a plain Failed; ours also reads why.
    assert parse_status(frames[:3]) == parse_status(frames) == (7, Failed, 1, ())
    assert parse_failure_reason(frames) == ("geometry", "room 7: hidden 512 != item hidden 1024")
    assert parse_failure_reason([zmq.Frame(f) for f in frames]) == parse_failure_reason(frames)


def test_a_reason_is_never_taken_for_a_cancel_answer_nor_a_cancel_answer_for_a_reason():
    frames = status_frames(7, Failed, 1, reason=("cleared", "x"))
    assert parse_cancel_reply(frames) is None
    answer = cancel_reply_frames(7, 1, CancelAnswer.CONFIRMED)
    assert parse_failure_reason(answer) is None
    assert parse_failure_reason(status_frames(7, Failed, 1)) is None
    assert parse_failure_reason(status_frames(7, TransferPoll.Success, 1, (9,))) is None


@pytest.mark.parametrize("status, checksums", [(TransferPoll.Success, ()), (Failed, (3,))])
def test_only_a_failed_status_without_checksums_carries_a_reason(status, checksums):
    with pytest.raises(WireError, match="only a Failed status"):
        status_frames(7, status, 1, checksums, reason=("write", "x"))


@pytest.mark.parametrize("kind", ["", "Geometry", "geo metry", "x" * 33, "g\n"])
def test_a_kind_is_a_short_lower_case_token(kind):
    with pytest.raises(WireError, match="lower-case token"):
        status_frames(7, Failed, 1, reason=(kind, "x"))


def test_a_long_detail_is_cut_on_a_character_boundary_and_marked():
    detail = "é" * MAX_REASON_BYTES  # two bytes each: the cut falls inside one unless it backs off
    part = status_frames(7, Failed, 1, reason=("write", detail))[5]
    assert len(part) <= MAX_REASON_BYTES and part.endswith(b"...")
    text = part.decode("utf-8")  # no character split
    assert set(text[:-3]) == {"é"}


def test_a_hostile_reason_is_bounded_and_printable():
    huge = b"\x1b[31m" + b"A" * (1 << 20) + b"\n"
    kind, detail = parse_failure_reason([b"7", b"0", b"1", FAILURE_MARKER, b"geometry\r\nX" * 10, huge])
    assert len(kind) <= 32 and kind.isprintable()
    assert detail.startswith("?[31mAAA") and detail.endswith("...") and detail.isprintable()
    assert len(detail) == MAX_REASON_BYTES + 3
    # Invalid UTF-8 reads as replacement characters, never raises.
    assert parse_failure_reason([b"7", b"0", b"1", FAILURE_MARKER, b"\xff", b"bad \xc3"]) == ("\ufffd", "bad \ufffd")


def test_a_truncated_reason_still_parses_and_the_status_stays_failed():
    assert parse_failure_reason([b"7", b"0", b"1", FAILURE_MARKER]) == ("other", "")
    assert parse_failure_reason([b"7", b"0", b"1", FAILURE_MARKER, b"write"]) == ("write", "")
    assert parse_status([b"7", b"0", b"1", FAILURE_MARKER]) == (7, Failed, 1, ())


def test_the_marker_on_a_success_is_an_unreadable_checksum_as_before():
    with pytest.raises(WireError, match="checksum is not an integer"):
        parse_status([b"7", b"5", b"1", FAILURE_MARKER, b"geometry", b"x"])


# ------------------------------------------------------------------ encode core

HIDDEN, DTYPE = 256, "torch.bfloat16"


def _offer(room: int, span: int = 4) -> Offer:
    return Offer(room, object(), 0x7000_0000, span, HIDDEN, DTYPE, HIDDEN * 2)


def _ask(room: int, rank: int = 0, fanout: int = 1, hidden: int = HIDDEN) -> TransferInfo:
    return TransferInfo(room, "10.0.0.7", 6000 + rank, f"10.0.0.7:{17000 + rank}", 0x10000 * (rank + 1), 0,
                        4 // fanout, hidden, DTYPE, False, fanout, rank * (4 // fanout), 4)


def _failed_pushes(actions: list) -> list[PushStatus]:
    return [a for a in actions if isinstance(a, PushStatus) and a.status is Failed]


def test_a_geometry_refusal_tells_every_receiver_why():
    enc = EncodeCore(fanout_timeout_s=10.0)
    enc.offer(_offer(3), 0.0)
    enc.ask(_ask(3, 0, fanout=2, hidden=512), 0.0)
    out = enc.ask(_ask(3, 1, fanout=2), 0.0)
    [conclusion] = [a for a in out if isinstance(a, Conclude)]
    pushes = _failed_pushes(out)
    assert [p.port for p in pushes] == [6000, 6001]
    assert {p.failure for p in pushes} == {conclusion.failure}
    assert conclusion.failure.kind is FailureKind.GEOMETRY
    assert "hidden 512 != item hidden 256" in conclusion.failure.detail


def test_asks_for_a_room_that_already_failed_are_told_its_reason():
    enc = EncodeCore(fanout_timeout_s=10.0)
    enc.offer(_offer(4), 0.0)
    enc.ask(_ask(4, 0, fanout=2), 0.0)
    enc.tick(10.6)  # the fanout never completed
    out = enc.ask(_ask(4, 1, fanout=2), 11.0)
    [push] = _failed_pushes(out)
    assert push.port == 6001 and push.failure.kind is FailureKind.FANOUT_TIMEOUT
    assert push.failure.detail == "receiver never registered within 10s (1 of 2 prefill ranks asked)"


def test_every_failed_push_of_the_core_says_why():
    enc = EncodeCore(fanout_timeout_s=10.0, parked=ParkedAsks(max_receivers=1, max_rooms=2))
    out = enc.ask(_ask(1, 0, fanout=1), 0.0)
    out += enc.ask(_ask(1, 1, fanout=1), 0.0)  # another shard: past the per-room bound
    out += enc.ask(_ask(2, 1, fanout=1), 0.0) + enc.ask(_ask(3, 2, fanout=1), 0.0)  # evicts room 1
    out += enc.tick(10.6)  # room 2's and 3's items never came
    enc.ask(_ask(5, 0, fanout=1), 11.0)
    out += enc.ask(_ask(6, 0, fanout=2), 11.0)  # no room takes two receivers
    out += enc.ask(_ask(7, 1), 11.0) + enc.ask(_ask(8, 1), 11.0)  # past one receiver's share: its room 7 goes
    out += enc.close(11.0, "sender pool closed")
    reasons = [(p.room, p.failure.kind, p.failure.detail) for p in _failed_pushes(out)]
    assert reasons == [
        (1, FailureKind.GEOMETRY, "room 1: more than 1 receivers asked"),
        (1, FailureKind.OTHER, "room 1: dropped unserved, the oldest of more than 2 rooms asked for and not served "
                               "yet"),
        (2, FailureKind.OTHER, "room 2: no item was sent for it within 10s of its first ask"),
        (3, FailureKind.OTHER, "room 3: no item was sent for it within 10s of its first ask"),
        (6, FailureKind.GEOMETRY, "room 6: asked with fanout 2, more than the 1 receivers a room may have"),
        (7, FailureKind.OTHER, "room 7: dropped unserved, the oldest of more than 1 rooms (or 16777216 bytes of "
                               "asks) receiver 10.0.0.7:17001 asked for and that were not served yet"),
        (5, FailureKind.CLOSED, "room 5: sender pool closed"),
        (8, FailureKind.CLOSED, "room 8: sender pool closed"),
    ]


def test_a_success_and_a_cancel_answer_carry_no_reason():
    enc = EncodeCore()
    enc.offer(_offer(1), 0.0)
    [write] = [a for a in enc.ask(_ask(1), 0.0) if type(a).__name__ == "StartWrite"]
    [success] = [a for a in enc.write_done(write.wid, (7,), 0.0) if isinstance(a, PushStatus)]
    assert success.failure is None and success.checksums == (7,)


# ------------------------------------------------------------------ prefill core

BOOT, ENCODE = "10.0.0.1:8998", ("10.0.0.2", 7000)


class _Region:
    addr, nbytes = 0x10000, 1 << 20


class _Regions:
    embedding, deepstack = _Region(), None


def _asked(room: int) -> PrefillCore:
    """A prefill core whose room was asked for from encode rank 0 at ENCODE."""
    c = PrefillCore(0, 1, 1, host="10.0.0.3", status_port=5555, session_id="10.0.0.3:1234")
    c.receive(0.0, RoomSpec(room, BOOT, 0x10000, rows=4, hidden=8, dtype="torch.float16", row_bytes=16,
                            row_start=0, span=4, regions=_Regions()))
    c.parallel_resolved(0.0, BOOT, 1, 1)
    assert type(c.route_resolved(0.0, (BOOT, 0, 0), ENCODE)[-1]).__name__ == "SendAsk"
    return c



def test_the_prefill_failure_keeps_peer_failed_and_shows_the_encode_kind_and_detail():
    c = _asked(1)
    reason = parse_failure_reason(status_frames(1, Failed, 0, reason=("geometry", "room 1: hidden 512 != item "
                                                                                   "hidden 1024")))
    [conclusion] = [a for a in c.status(1.1, 1, Failed, 0, reason=reason) if isinstance(a, PrefillConclude)]
    assert conclusion.failure == Failure(
        FailureKind.PEER_FAILED,
        f"{ENCODE_FAILED} (encode rank 0 at {ENCODE[0]}:{ENCODE[1]}): geometry: room 1: hidden 512 != item hidden "
        f"1024")


def test_a_bare_failed_from_a_peer_keeps_the_specs_reason():
    c = _asked(1)
    [conclusion] = [a for a in c.status(1.1, 1, Failed, 0) if isinstance(a, PrefillConclude)]
    assert conclusion.failure.detail == f"{ENCODE_FAILED} (encode rank 0 at {ENCODE[0]}:{ENCODE[1]})"


def test_a_deadline_before_the_route_answered_names_the_encode_rank_and_its_bootstrap():
    c = PrefillCore(0, 1, 1, host="10.0.0.3", status_port=5555, session_id="10.0.0.3:1234", deadline_s=0.001)
    c.receive(0.0, RoomSpec(1, BOOT, 0x10000, rows=4, hidden=8, dtype="torch.float16", row_bytes=16,
                            row_start=0, span=4, regions=_Regions()))
    c.parallel_resolved(0.0, BOOT, 1, 1)  # the sizes came, the route look-up has not answered
    [conclusion] = [a for a in c.tick(0.01) if isinstance(a, PrefillConclude)]
    assert conclusion.failure.kind is FailureKind.DEADLINE
    assert conclusion.failure.detail == (f"no status from encode rank 0 (bootstrap {BOOT}) within 0.001s for room 1 "
                                         f"(its bootstrap look-up had not answered)")

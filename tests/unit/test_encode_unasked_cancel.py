"""EncodeCore and an unasked cancel: a receiver that failed a room before asking for it fails the room for its
whole fanout at once (or its item when it comes), unanswered; anything of that receiver's under way stands."""

from __future__ import annotations

from encode_rooms import Run

from transfer.core.encode import REASK_GRACE_S, Offer, PushStatus, StartWrite
from transfer.core.failure import FailureKind
from transfer.frames import Cancel, TransferInfo, shard_rows
from transfer.status import TransferPoll

HIDDEN = 256
DTYPE = "torch.bfloat16"
ROW = HIDDEN * 2
SRC = 0x7000_0000
SPAN = 8


def _offer(room: int) -> Offer:
    return Offer(room, object(), SRC, SPAN, HIDDEN, DTYPE, ROW, None, 0, None)


def _ask(room: int, rank: int, fanout: int = 2) -> TransferInfo:
    start, rows = shard_rows(SPAN, rank, fanout)
    return TransferInfo(room, "10.0.0.7", 6000 + rank, f"10.0.0.7:{17000 + rank}", 0x10000 * (rank + 1), 0, rows,
                        HIDDEN, DTYPE, False, fanout, start, SPAN)


def _unasked(room: int, rank: int) -> Cancel:
    return Cancel(room, "10.0.0.7", 6000 + rank, f"10.0.0.7:{17000 + rank}", unasked=True)


def _told(out: list) -> list[tuple[int, int, TransferPoll]]:
    return [(a.room, a.port, a.status) for a in out if type(a) is PushStatus]


def test_an_unasked_cancel_fails_the_room_at_once_and_tells_the_rest_of_its_fanout():
    run = Run()
    run(run.core.offer(_offer(2), run.now))
    run(run.core.ask(_ask(2, 0), run.now))
    out = run(run.core.cancel(_unasked(2, 1), run.now))
    assert _told(out) == [(2, 6000, TransferPoll.Failed)]  # the rank that asked; the one that did not gets nothing
    assert run.conclusions() == [(2, TransferPoll.Failed, FailureKind.CANCELLED)]
    [push] = run.of(PushStatus, out)
    assert push.cancel is None
    assert "receiver 10.0.0.7:17001 failed it before asking for it" in push.failure.detail
    assert run.of(StartWrite) == []


def test_an_unasked_cancel_before_the_item_fails_the_item_when_it_comes_and_tells_those_that_asked():
    run = Run()
    run(run.core.ask(_ask(3, 0), run.now))
    assert _told(run(run.core.cancel(_unasked(3, 1), run.now))) == []
    run.now = 2 * REASK_GRACE_S
    out = run(run.core.offer(_offer(3), run.now))
    assert _told(out) == [(3, 6000, TransferPoll.Failed)]
    assert run.conclusions() == [(3, TransferPoll.Failed, FailureKind.CANCELLED)]
    assert run.of(StartWrite) == []


def test_an_ask_after_the_unasked_cancel_takes_it_back_and_the_room_is_served():
    run = Run()
    run(run.core.ask(_ask(4, 0), run.now))
    run(run.core.cancel(_unasked(4, 1), run.now))
    run.now = 1.0
    run(run.core.ask(_ask(4, 1), run.now))  # the caller received the room again: its rank asked this time
    run(run.core.offer(_offer(4), run.now))
    assert sorted(w.session_id for w in run.of(StartWrite)) == ["10.0.0.7:17000", "10.0.0.7:17001"]
    assert run.conclusions() == []


def test_an_unasked_cancel_leaves_that_receivers_own_parked_ask_and_a_room_being_written_alone():
    run = Run()
    run(run.core.offer(_offer(5), run.now))
    run(run.core.ask(_ask(5, 1), run.now))
    # Its parked ask is an earlier receive's, whose own cancel (or ask) rules hold: nothing changes.
    assert run(run.core.cancel(_unasked(5, 1), run.now)) == []
    run(run.core.ask(_ask(5, 0), run.now))
    assert len(run.of(StartWrite)) == 2
    # The room is being written to its fanout: an unasked cancel of another receiver stops nothing.
    assert run(run.core.cancel(_unasked(5, 2), run.now)) == []
    assert run.conclusions() == []


def test_a_plain_cancel_from_a_receiver_with_nothing_parked_still_stops_nothing():
    run = Run()
    run(run.core.offer(_offer(6), run.now))
    run(run.core.ask(_ask(6, 0), run.now))
    plain = Cancel(6, "10.0.0.7", 6001, "10.0.0.7:17001", reads_write_failed=True)
    out = run(run.core.cancel(plain, run.now))
    assert [(a.room, a.port, a.status, a.cancel is not None) for a in out if type(a) is PushStatus] == [
        (6, 6001, TransferPoll.Failed, True)]  # its answer only
    assert run.conclusions() == []

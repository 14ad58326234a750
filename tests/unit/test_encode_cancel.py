"""EncodeCore and a receiver's cancel: nothing more is written for it, the room fails, the answer says when."""

from __future__ import annotations

from encode_rooms import Run

from transfer.core import encode
from transfer.core.encode import (
    FAILED_WRITES_KEPT_S,
    REASK_GRACE_S,
    Conclude,
    Count,
    EncodeCore,
    Offer,
    PushStatus,
    StartWrite,
    Warn,
)
from transfer.core.failure import FailureKind
from transfer.frames import Cancel, CancelAnswer, TransferInfo, shard_rows
from transfer.status import TransferPoll

CONFIRMED, TOO_LATE, WRITE_FAILED = CancelAnswer.CONFIRMED, CancelAnswer.TOO_LATE, CancelAnswer.WRITE_FAILED

HIDDEN = 256
DTYPE = "torch.bfloat16"
ROW = HIDDEN * 2
SRC = 0x7000_0000


class NotReady:
    """A ready event that never completes (the write waits in the queue)."""

    def query(self) -> bool:
        return False


def _offer(room: int, span: int = 4, ready_event=None) -> Offer:
    return Offer(room, object(), SRC, span, HIDDEN, DTYPE, ROW, None, 0, ready_event)


def _ask(room: int, rank: int = 0, fanout: int = 1, span: int = 4, ptr: int | None = None) -> TransferInfo:
    start, rows = shard_rows(span, rank, fanout)
    return TransferInfo(room, "10.0.0.7", 6000 + rank, f"10.0.0.7:{17000 + rank}",
                        0x10000 * (rank + 1) if ptr is None else ptr, 0, rows, HIDDEN, DTYPE, False, fanout, start,
                        span)


def _cancel(room: int, rank: int = 0, reads_write_failed: bool = True) -> Cancel:
    return Cancel(room, "10.0.0.7", 6000 + rank, f"10.0.0.7:{17000 + rank}", reads_write_failed)


def test_a_cancelled_ask_is_never_written_when_its_item_comes_later():
    run = Run()
    run(run.core.ask(_ask(1), run.now))
    out = run(run.core.cancel(_cancel(1), run.now))
    assert run.answers(out) == [(1, 6000, CONFIRMED)]
    assert run.of(Count, out) == [Count("cancels_total", "confirmed")]
    assert run.core.parked.get(1) is None
    run.now = 0.5
    out = run(run.core.offer(_offer(1), run.now))
    assert run.of(StartWrite) == []
    assert run.conclusions() == [(1, TransferPoll.Failed, FailureKind.CANCELLED)]
    [conclusion] = run.of(Conclude, out)
    assert "receiver 10.0.0.7:17000 cancelled it 0.5s before the item was sent" in conclusion.failure.detail


def test_a_cancel_before_the_whole_fanout_asked_fails_the_room_and_tells_the_others():
    run = Run()
    run(run.core.offer(_offer(2, span=8), run.now))
    run(run.core.ask(_ask(2, 0, fanout=2, span=8), run.now))
    out = run(run.core.cancel(_cancel(2), run.now))
    assert run.answers(out) == [(2, 6000, CONFIRMED)]
    assert run.conclusions() == [(2, TransferPoll.Failed, FailureKind.CANCELLED)]
    out = run(run.core.ask(_ask(2, 1, fanout=2, span=8), run.now))
    assert [(a.room, a.port, a.status) for a in run.of(PushStatus, out)] == [(2, 6001, TransferPoll.Failed)]
    assert run.of(StartWrite) == []


def test_a_cancel_for_a_queued_write_drops_it_and_the_room_never_succeeds():
    run = Run()
    run(run.core.offer(_offer(3, ready_event=NotReady()), run.now))
    run(run.core.ask(_ask(3), run.now))
    assert run.core.waiting == 1 and run.of(StartWrite) == []
    out = run(run.core.cancel(_cancel(3), run.now))
    assert run.answers(out) == [(3, 6000, CONFIRMED)]
    assert run.conclusions() == [(3, TransferPoll.Failed, FailureKind.CANCELLED)]
    run.now = 1.0
    run(run.core.tick(run.now))
    assert run.of(StartWrite) == [] and run.core.waiting == 0


def test_a_cancel_for_a_write_in_flight_says_too_late_then_confirms_once_it_is_over():
    run = Run()
    run(run.core.offer(_offer(4), run.now))
    [write] = run.of(StartWrite, run(run.core.ask(_ask(4), run.now)))
    out = run(run.core.cancel(_cancel(4), run.now))
    assert run.answers(out) == [(4, 6000, TOO_LATE)]
    assert run.of(Count, out) == [Count("cancels_total", "too_late")]
    [conclusion] = run.of(Conclude, out)
    assert conclusion.status is TransferPoll.Failed and conclusion.failure.kind is FailureKind.CANCELLED
    assert "while its write was in flight" in conclusion.failure.detail
    out = run(run.core.write_done(write.wid, (7,), run.now))
    assert run.answers(out) == [(4, 6000, CONFIRMED)]
    assert [a.status for a in run.of(PushStatus, out) if a.cancel is None] == []  # no Success for it
    assert run.conclusions() == [(4, TransferPoll.Failed, FailureKind.CANCELLED)]


def _rank_zero_served_rank_one_writing(run: Run, room: int) -> StartWrite:
    """`room` at fanout 2: rank 0's write landed and it was told Success; rank 1's write (returned) flies."""
    run(run.core.offer(_offer(room, span=8), run.now))
    run(run.core.ask(_ask(room, 0, fanout=2, span=8), run.now))
    first, second = run.of(StartWrite, run(run.core.ask(_ask(room, 1, fanout=2, span=8), run.now)))
    run(run.core.write_done(first.wid, (7,), run.now))
    return second


def test_a_cancel_from_a_receiver_already_told_success_fails_the_room_saying_so():
    # A prefill rank cancels a room it cleared while its Success was on the way: the room still
    # fails (a room given up on does not succeed), and its reason says the write had landed.
    run = Run()
    _rank_zero_served_rank_one_writing(run, 1)
    out = run(run.core.cancel(_cancel(1, 0), run.now))
    assert run.answers(out) == [(1, 6000, CONFIRMED)]
    [conclusion] = run.of(Conclude, out)
    assert conclusion.failure.kind is FailureKind.CANCELLED
    assert conclusion.failure.detail == ("room 1: receiver 10.0.0.7:17000 cancelled it after its own write landed, "
                                         "before the room's other writes were over")
    assert [(a.port, a.status) for a in run.of(PushStatus, out) if a.cancel is None] == [(6001, TransferPoll.Failed)]


def test_a_cancel_from_a_receiver_that_asked_twice_is_spared_a_plain_failed():
    # The copy of its ask is not parked for a next send; the cancel finds its queued write.
    run = Run()
    run(run.core.offer(_offer(2, ready_event=NotReady()), run.now))
    run(run.core.ask(_ask(2), run.now))
    run(run.core.ask(_ask(2), run.now))
    assert 2 not in run.core.parked
    out = run(run.core.cancel(_cancel(2), run.now))
    assert run.answers(out) == [(2, 6000, CONFIRMED)]
    assert [a for a in run.of(PushStatus, out) if a.cancel is None] == []
    [conclusion] = run.of(Conclude, out)
    assert "cancelled it before its write started" in conclusion.failure.detail
    assert 2 not in run.core.parked


def test_a_write_in_flight_that_fails_after_a_cancel_is_answered_write_failed_not_confirmed():
    # The engine gave up on it: bytes it carried may still land in the receiver's memory.
    run = Run()
    run(run.core.offer(_offer(5), run.now))
    [write] = run.of(StartWrite, run(run.core.ask(_ask(5), run.now)))
    assert run.answers(run(run.core.cancel(_cancel(5), run.now))) == [(5, 6000, TOO_LATE)]
    out = run(run.core.write_failed(write.wid, "still in flight after the transfer timeout", 30.0, run.now))
    assert run.answers(out) == [(5, 6000, WRITE_FAILED)]
    assert run.of(Count, out) == [Count("cancels_total", "write_failed")]


def test_a_cancel_that_comes_after_its_write_failed_is_answered_write_failed():
    # The usual order: the write fails, the receiver is told Failed, clears the room and cancels.
    # The failed write's bytes may still land, so its memory must wait out its quarantine.
    run = Run()
    run(run.core.offer(_offer(6), run.now))
    [write] = run.of(StartWrite, run(run.core.ask(_ask(6), run.now)))
    run(run.core.write_failed(write.wid, "still in flight after the transfer timeout", 30.0, 30.0))
    out = run(run.core.cancel(_cancel(6), 30.1))
    assert run.answers(out) == [(6, 6000, WRITE_FAILED)]
    # Remembered long enough for the receiver's quarantine, then forgotten.
    assert run.answers(run(run.core.cancel(_cancel(6), 30.0 + FAILED_WRITES_KEPT_S + 1))) == [(6, 6000, CONFIRMED)]


def test_past_the_failed_writes_bound_no_cancel_is_confirmed_while_a_forgotten_failure_may_still_land(monkeypatch):
    # Writes failing faster than the book keeps them (a partition): the oldest is forgotten while its bytes may
    # still land, and a cancel of any room is answered write failed until that failure's window passed.
    monkeypatch.setattr(encode, "MAX_FAILED_WRITES", 3)
    run = Run()
    for room in range(1, 5):
        run.now = 30.0 + room
        run(run.core.offer(_offer(room), run.now))
        [write] = run.of(StartWrite, run(run.core.ask(_ask(room, ptr=0x10000 * room), run.now)))  # memory of its own
        run(run.core.write_failed(write.wid, "the peer reset the connection", 0.01, run.now))
    assert run.answers(run(run.core.cancel(_cancel(1), 40.0))) == [(1, 6000, WRITE_FAILED)]
    assert "failed writes forgotten" in [warn.key for warn in run.of(Warn)]
    run(run.core.ask(_ask(9), 40.0))  # a room no write of which failed: its memory cannot be told apart
    assert run.answers(run(run.core.cancel(_cancel(9), 40.0))) == [(9, 6000, WRITE_FAILED)]
    run(run.core.ask(_ask(10), 31.0 + FAILED_WRITES_KEPT_S + 1))
    assert run.answers(run(run.core.cancel(_cancel(10), 31.0 + FAILED_WRITES_KEPT_S + 1))) == [(10, 6000, CONFIRMED)]


def test_a_cancel_of_an_ask_for_the_rooms_next_send_leaves_the_send_under_way_alone():
    # Rank 0 was told Success, cleared and asked again (parked for the next send), then gave that up.
    run = Run()
    second = _rank_zero_served_rank_one_writing(run, 7)
    run(run.core.ask(_ask(7, 0, fanout=2, span=8), run.now))
    assert 7 in run.core.parked
    out = run(run.core.cancel(_cancel(7, 0), run.now))
    assert run.answers(out) == [(7, 6000, CONFIRMED)] and run.of(Conclude, out) == []
    assert 7 not in run.core.parked
    out = run(run.core.write_done(second.wid, (8,), run.now))
    assert [(a.port, a.status) for a in run.of(PushStatus, out)] == [(6001, TransferPoll.Success)]
    assert run.conclusions() == [(7, TransferPoll.Success, None)]


def test_a_receiver_that_does_not_read_write_failed_answers_is_told_confirmed_as_before():
    # An earlier release would take the unknown answer for a plain Failed of the room's next ask.
    run = Run()
    run(run.core.offer(_offer(5), run.now))
    [write] = run.of(StartWrite, run(run.core.ask(_ask(5), run.now)))
    run(run.core.cancel(_cancel(5, reads_write_failed=False), run.now))
    out = run(run.core.write_failed(write.wid, "peer gone", 0.01, run.now))
    assert run.answers(out) == [(5, 6000, CONFIRMED)]


def test_a_cancel_is_not_confirmed_when_any_write_it_found_in_flight_failed():
    run = Run()
    run(run.core.offer(_offer(1), run.now))
    [first] = run.of(StartWrite, run(run.core.ask(_ask(1), run.now)))
    run(run.core.offer(_offer(1), run.now))  # the room sent again beside the first send's write
    [second] = run.of(StartWrite, run(run.core.ask(_ask(1), run.now)))
    assert run.answers(run(run.core.cancel(_cancel(1), run.now))) == [(1, 6000, TOO_LATE)]
    assert run.answers(run(run.core.write_failed(first.wid, "peer gone", 0.01, run.now))) == []
    assert run.answers(run(run.core.write_done(second.wid, (), run.now))) == [(1, 6000, WRITE_FAILED)]


def test_a_cancel_the_core_knows_nothing_of_is_confirmed_and_changes_nothing():
    run = Run()
    out = run(run.core.cancel(_cancel(6), run.now))
    assert run.answers(out) == [(6, 6000, CONFIRMED)]
    assert run.conclusions() == [] and len(run.core.parked) == 0


def test_a_cancel_after_success_is_confirmed_and_the_room_stays_success():
    run = Run()
    run(run.core.offer(_offer(7), run.now))
    [write] = run.of(StartWrite, run(run.core.ask(_ask(7), run.now)))
    run(run.core.write_done(write.wid, (7,), run.now))
    out = run(run.core.cancel(_cancel(7), run.now))
    assert run.answers(out) == [(7, 6000, CONFIRMED)]
    assert run.conclusions() == [(7, TransferPoll.Success, None)]


def test_an_ask_after_a_cancel_of_a_room_served_in_full_waits_for_its_next_send():
    """The served room keeps its receivers: a retry's ask under its number is not written from the old item."""
    run = Run()
    run(run.core.offer(_offer(7), run.now))
    [write] = run.of(StartWrite, run(run.core.ask(_ask(7), run.now)))
    run(run.core.write_done(write.wid, (7,), run.now))
    run(run.core.cancel(_cancel(7), run.now))
    out = run(run.core.ask(_ask(7), run.now))
    assert run.of(StartWrite, out) == [] and run.core.parked.get(7) is not None
    assert run.conclusions() == [(7, TransferPoll.Success, None)]


def test_the_same_rank_asking_again_after_its_cancel_is_a_retry_and_is_served():
    run = Run()
    run(run.core.ask(_ask(8), run.now))
    run(run.core.cancel(_cancel(8), run.now))
    run(run.core.ask(_ask(8), run.now))
    out = run(run.core.offer(_offer(8), run.now))
    assert len(run.of(StartWrite, out)) == 1
    assert run.conclusions() == []


def test_a_cancelled_room_is_forgotten_after_the_fanout_timeout():
    run = Run()
    run(run.core.ask(_ask(9), run.now))
    run(run.core.cancel(_cancel(9), run.now))
    run.now = 11.0
    run(run.core.tick(run.now))
    run(run.core.offer(_offer(9), run.now))
    assert run.conclusions() == []  # parked, waiting for its asks as any item
    assert run.core.parked_rooms == 1


def test_the_cancelling_receiver_gets_only_its_answer_and_the_others_are_told_failed():
    run = Run()
    run(run.core.offer(_offer(10, span=8, ready_event=NotReady()), run.now))
    run(run.core.ask(_ask(10, 0, fanout=2, span=8), run.now))
    run(run.core.ask(_ask(10, 1, fanout=2, span=8), run.now))
    out = run(run.core.cancel(_cancel(10, 0), run.now))
    pushes = [(a.port, a.status, a.cancel) for a in run.of(PushStatus, out)]
    assert sorted(pushes) == [(6000, TransferPoll.Failed, CONFIRMED), (6001, TransferPoll.Failed, None)]


def test_an_item_cancelled_before_it_came_is_expected():
    """Its send fails at once, so the driver must wake for it rather than take it on a later turn."""
    run = Run()
    run(run.core.ask(_ask(5), run.now))
    assert run.core.expects(5)
    run(run.core.cancel(_cancel(5), run.now))
    assert run.core.expects(5)
    run.now = REASK_GRACE_S
    run(run.core.offer(_offer(5), run.now))
    assert not run.core.expects(5)
    assert run.conclusions() == [(5, TransferPoll.Failed, FailureKind.CANCELLED)]


def _ask_at(room: int, session: str, port: int, ptr: int) -> TransferInfo:
    return TransferInfo(room, "10.0.0.7", port, session, ptr, 0, 4, HIDDEN, DTYPE, False, 1, 0, 4)


def test_a_queued_write_cancelled_leaves_its_destination_free_for_the_next_room():
    other, session = "10.0.0.8:17000", "10.0.0.7:17000"
    core = EncodeCore(fanout_timeout_s=120.0, depth=1, now=0.0)
    core.offer(Offer(1, object(), SRC, 4, HIDDEN, DTYPE, ROW), 0.0)
    assert [a.room for a in core.ask(_ask_at(1, other, 6001, 0x50000), 0.0) if isinstance(a, StartWrite)] == [1]
    core.offer(Offer(2, object(), SRC + 0x10000, 4, HIDDEN, DTYPE, ROW), 0.0)
    assert not [a for a in core.ask(_ask_at(2, session, 6000, 0xA0000), 0.1) if isinstance(a, StartWrite)]

    answered = core.cancel(Cancel(2, "10.0.0.7", 6000, session), 60.0)
    assert [(a.room, a.cancel) for a in answered if isinstance(a, PushStatus)] == [(2, CONFIRMED)]

    # Confirmed: the receiver reuses the memory for its next room at once, while the only slot is still busy.
    core.offer(Offer(3, object(), SRC + 0x20000, 4, HIDDEN, DTYPE, ROW), 61.0)
    assert [a for a in core.ask(_ask_at(3, session, 6000, 0xA0000), 61.0) if isinstance(a, Conclude)] == []
    done = core.write_done(1, (), 62.0)
    assert [(a.room, a.dsts) for a in done if isinstance(a, StartWrite)] == [(3, (0xA0000,))]


def test_a_write_in_flight_when_its_room_fails_keeps_its_destination_until_it_is_over():
    session = "10.0.0.7:17000"
    core = EncodeCore(fanout_timeout_s=120.0, depth=4, now=0.0)
    core.offer(Offer(1, object(), SRC, 4, HIDDEN, DTYPE, ROW), 0.0)
    assert [a.room for a in core.ask(_ask_at(1, session, 6000, 0xA0000), 0.0) if isinstance(a, StartWrite)] == [1]
    answered = core.cancel(Cancel(1, "10.0.0.7", 6000, session), 1.0)
    assert [(a.room, a.cancel) for a in answered if isinstance(a, PushStatus)] == [(1, TOO_LATE)]
    core.offer(Offer(2, object(), SRC + 0x10000, 4, HIDDEN, DTYPE, ROW), 2.0)
    failed = [c for c in core.ask(_ask_at(2, session, 6000, 0xA0000), 2.0) if isinstance(c, Conclude)]
    assert [(c.room, c.status) for c in failed] == [(2, TransferPoll.Failed)]
    assert "overlaps room 1's" in str(failed[0].failure)


class Gate:
    """A ready event the test completes."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_cancel_covers_the_room_sent_again_beside_an_earlier_sends_write_in_flight():
    """Room 1's first send writes into the receiver; the room is sent again, the receiver asks again
    and then cancels: the current send's queued write is dropped and the room fails, and the answer
    is confirmed only once the earlier write is over, with nothing written after it."""
    run = Run()
    run(run.core.ask(_ask(1), run.now))
    [first] = run.of(StartWrite, run(run.core.offer(_offer(1), run.now)))
    gate = Gate()
    run(run.core.offer(_offer(1, ready_event=gate), 0.01))  # sent again: the first send is cleared
    run(run.core.ask(_ask(1), 0.02))  # the retry's write waits for its item
    out = run(run.core.cancel(_cancel(1), 0.03))
    assert run.answers(out) == [(1, 6000, TOO_LATE)]
    assert run.conclusions()[-1] == (1, TransferPoll.Failed, FailureKind.CANCELLED)
    assert run.answers(run(run.core.write_done(first.wid, (), 0.04))) == [(1, 6000, CONFIRMED)]
    gate.done = True
    run(run.core.tick(0.05))
    assert run.of(StartWrite) == [first], "a write after the cancel was confirmed"


def test_a_cancel_is_confirmed_only_once_every_write_it_found_in_flight_is_over():
    run = Run()
    run(run.core.ask(_ask(1), run.now))
    [first] = run.of(StartWrite, run(run.core.offer(_offer(1), run.now)))
    run(run.core.offer(_offer(1), 0.01))
    [second] = run.of(StartWrite, run(run.core.ask(_ask(1), 0.02)))  # the same destination, the same room
    assert run.answers(run(run.core.cancel(_cancel(1), 0.03))) == [(1, 6000, TOO_LATE)]
    assert run.answers(run(run.core.write_done(first.wid, (), 0.04))) == []
    assert not run.core.wants(second.wid)
    assert run.answers(run(run.core.write_done(second.wid, (), 0.05))) == [(1, 6000, CONFIRMED)]
    assert (1, TransferPoll.Success, None) not in run.conclusions()

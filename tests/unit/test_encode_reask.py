"""EncodeCore and a receiver that cancels a room and asks for it again at once, while the room's item comes."""

from __future__ import annotations

import pytest

from encode_rooms import Run

from transfer.core.encode import (
    CLEARED_GRACE_S,
    REASK_GRACE_S,
    Conclude,
    EncodeCore,
    Offer,
    PushStatus,
    StartWrite,
)
from transfer.core.failure import FailureKind
from transfer.frames import Cancel, CancelAnswer, TransferInfo
from transfer.status import TransferPoll

HIDDEN = 256
DTYPE = "torch.bfloat16"
ROW = HIDDEN * 2
SRC = 0x7000_0000
OLD, NEW = 0x10000, 0x90000  # the given-up ask's destination, and the new ask's


def _offer(room: int) -> Offer:
    return Offer(room, object(), SRC, 4, HIDDEN, DTYPE, ROW)


def _ask(room: int, ptr: int) -> TransferInfo:
    return TransferInfo(room, "10.0.0.7", 6000, "10.0.0.7:17000", ptr, 0, 4, HIDDEN, DTYPE, False, 1, 0, 4)


def _cancel(room: int) -> Cancel:
    return Cancel(room, "10.0.0.7", 6000, "10.0.0.7:17000", True)


def _cancelled_then_cleared(run: Run, room: int, cleared_at: float) -> None:
    """The receiver asks for `room` and cancels it at 0; the item, sent at 0.5 (past the grace), fails by
    that cancel, and the caller clears it at `cleared_at`."""
    run(run.core.ask(_ask(room, OLD), 0.0))
    run(run.core.cancel(_cancel(room), 0.0))
    item = _offer(room)
    run(run.core.offer(item, 0.5))
    run(run.core.clear(room, item.token, cleared_at))


def test_an_item_sent_right_after_a_cancel_waits_for_the_receivers_new_ask_and_is_written_to_it():
    run = Run()
    run(run.core.ask(_ask(1, OLD), 0.0))
    run(run.core.cancel(_cancel(1), 0.0))
    run(run.core.offer(_offer(1), 0.01))  # between the cancel and the new ask
    assert run.conclusions() == [] and run.of(StartWrite) == []
    [write] = run.of(StartWrite, run(run.core.ask(_ask(1, NEW), 0.02)))
    assert write.dsts == (NEW,), "written to the new ask's memory only"
    out = run(run.core.write_done(write.wid, (7,), 0.03))
    assert [(a.room, a.status) for a in run.statuses(out)] == [(1, TransferPoll.Success)]
    assert run.conclusions() == [(1, TransferPoll.Success, None)]
    run(run.core.tick(1.0))
    assert run.conclusions() == [(1, TransferPoll.Success, None)] and len(run.of(StartWrite)) == 1


def test_an_item_sent_right_after_a_cancel_fails_once_its_grace_passed_without_a_new_ask():
    run = Run()
    run(run.core.ask(_ask(2, OLD), 0.0))
    run(run.core.cancel(_cancel(2), 0.0))
    run(run.core.offer(_offer(2), 0.01))
    assert run.conclusions() == []
    assert run.core.next_wakeup() == pytest.approx(REASK_GRACE_S), "the wait is bounded and the driver wakes for it"
    run(run.core.tick(REASK_GRACE_S / 2))
    assert run.conclusions() == []
    out = run(run.core.tick(REASK_GRACE_S))
    assert run.conclusions() == [(2, TransferPoll.Failed, FailureKind.CANCELLED)]
    [conclusion] = run.of(Conclude, out)
    assert "receiver 10.0.0.7:17000 cancelled it 0.0s before the item was sent" in conclusion.failure.detail
    # A new ask after that is told at once that its own cancel failed the item.
    [told] = run.statuses(run(run.core.ask(_ask(2, NEW), 0.5)))
    assert told.status is TransferPoll.Failed and "asked for it again 0.500s after its own cancel" in told.failure.detail
    assert run.of(StartWrite) == []


def test_a_tick_at_the_wake_up_the_grace_asked_for_ends_the_grace():
    """The driver sleeps until next_wakeup() and ticks then: that tick must conclude what it woke for, even where
    the cancel's time plus the grace rounds below the sum's exact value (10.7 + 0.1 - 10.7 < 0.1)."""
    run = Run()
    run(run.core.tick(10.7))  # the sweep's next turn after the grace's end
    run(run.core.ask(_ask(2, OLD), 10.7))
    run(run.core.cancel(_cancel(2), 10.7))
    run(run.core.offer(_offer(2), 10.71))
    due = run.core.next_wakeup()
    assert due == 10.7 + REASK_GRACE_S and due - 10.7 < REASK_GRACE_S
    run(run.core.tick(due))
    assert run.conclusions() == [(2, TransferPoll.Failed, FailureKind.CANCELLED)]
    assert run.core.next_wakeup() > due, "nothing left due then: the driver does not wake again at once"


def test_a_new_ask_for_a_room_its_own_cancel_failed_in_flight_is_told_so_at_once():
    run = Run()
    run(run.core.offer(_offer(3), 0.0))
    [write] = run.of(StartWrite, run(run.core.ask(_ask(3, OLD), 0.0)))
    out = run(run.core.cancel(_cancel(3), 0.01))
    assert [a.cancel for a in run.of(PushStatus, out)] == [CancelAnswer.TOO_LATE]
    [told] = run.statuses(run(run.core.ask(_ask(3, NEW), 0.01)))
    assert told.status is TransferPoll.Failed and told.failure.kind is FailureKind.CANCELLED
    assert told.failure.detail.startswith("room 3: receiver 10.0.0.7:17000 asked for it again 0.000s after its own "
                                          "cancel had failed the room's item (receiver 10.0.0.7:17000 cancelled it "
                                          "while its write was in flight)")
    assert "Send the room again" in told.failure.detail
    run(run.core.write_done(write.wid, (7,), 0.02))
    assert [a.status for a in run.statuses()] == [TransferPoll.Failed], "the landed write is nobody's Success"


def test_an_item_cleared_and_sent_again_while_it_waits_for_a_new_ask_leaves_the_new_send_to_its_asks():
    run = Run()
    run(run.core.ask(_ask(6, OLD), 0.0))
    run(run.core.cancel(_cancel(6), 0.0))
    first = _offer(6)
    run(run.core.offer(first, 0.01))
    run(run.core.clear(6, first.token, 0.02))  # its caller clears it and sends it again
    run(run.core.offer(_offer(6), 0.03))
    run(run.core.tick(REASK_GRACE_S))
    assert run.conclusions() == [(6, TransferPoll.Failed, FailureKind.CLEARED)], "the send again waits for its asks"
    [write] = run.of(StartWrite, run(run.core.ask(_ask(6, NEW), 0.2)))
    assert write.dsts == (NEW,)


def test_a_new_ask_for_a_room_its_own_cancel_failed_is_told_why_after_the_caller_cleared_it():
    """The caller clears the failed item as it concludes; the receiver's new ask is told why once the
    clear's grace passed with no send again (not left to wait for an item nobody sends), and so is
    another receiver's, within the fanout timeout of the clear."""
    run = Run()
    _cancelled_then_cleared(run, 7, 0.6)
    assert run.conclusions() == [(7, TransferPoll.Failed, FailureKind.CANCELLED)]
    assert run.statuses(run(run.core.ask(_ask(7, NEW), 0.7))) == []
    other = TransferInfo(7, "10.0.0.8", 6000, "10.0.0.8:17000", NEW, 0, 4, HIDDEN, DTYPE, False, 1, 0, 4)
    run(run.core.ask(other, 0.75))
    assert run.statuses(run(run.core.tick(0.75))) == []
    assert run.core.next_wakeup() == pytest.approx(0.7 + CLEARED_GRACE_S), "the driver wakes for it"
    [told] = run.statuses(run(run.core.tick(0.7 + CLEARED_GRACE_S)))
    assert (told.port, told.status, told.failure.kind) == (6000, TransferPoll.Failed, FailureKind.CANCELLED)
    assert told.failure.detail.startswith("room 7: receiver 10.0.0.7:17000 asked for it again 0.700s after its "
                                          "own cancel had failed the room's item")
    [told] = run.statuses(run(run.core.tick(0.75 + CLEARED_GRACE_S)))
    assert (told.endpoint, told.failure.kind) == ("10.0.0.8", FailureKind.CANCELLED), "another receiver's too"
    assert told.failure.detail == "room 7: receiver 10.0.0.7:17000 cancelled it 0.5s before the item was sent"
    assert run.core.parked.get(7) is None
    _cancelled_then_cleared(run, 8, 1.6)
    run(run.core.ask(_ask(8, NEW), 11.7))
    assert run.statuses(run(run.core.tick(11.9))) == [], "room 8's clear is forgotten after the fanout timeout"


def test_a_new_ask_between_the_clear_of_a_room_its_cancel_failed_and_the_rooms_send_again_is_served():
    run = Run()
    _cancelled_then_cleared(run, 11, 0.6)  # its caller clears it and sends it again (a retry)
    run(run.core.ask(_ask(11, NEW), 0.62))
    [write] = run.of(StartWrite, run(run.core.offer(_offer(11), 0.65)))
    assert write.dsts == (NEW,)
    assert run.statuses(run(run.core.tick(1.0))) == []


@pytest.mark.parametrize("what", ["cancel", "asks told failed"])
def test_what_fails_a_late_item_is_remembered_for_the_fanout_timeout_whenever_the_sweep_runs(what):
    """A cancel before the item, or asks told Failed for want of it, fail an item sent within the fanout
    timeout of them; one sent later waits for its asks, though no sweep ran in between to forget them."""
    run = Run()
    run(run.core.ask(_ask(10, OLD), 0.0))
    run(run.core.cancel(_cancel(10), 1.0))
    run(run.core.offer(_offer(10), 10.9))
    assert run.conclusions() == [(10, TransferPoll.Failed, FailureKind.CANCELLED)]
    run(run.core.ask(_ask(9, OLD), 1.0))
    if what == "cancel":
        run(run.core.cancel(_cancel(9), 1.5))
        since = 1.5
    else:
        run(run.core.tick(11.5))  # its ask is told Failed: no item within the fanout timeout
        assert [(told.room, told.status) for told in run.statuses()][-1] == (9, TransferPoll.Failed)
        since = 11.5
    run(run.core.offer(_offer(9), since + 10.2))
    assert run.conclusions() == [(10, TransferPoll.Failed, FailureKind.CANCELLED)], "room 9's item waits"


def test_a_re_ask_let_in_at_the_end_of_the_clears_memory_is_still_told_why():
    """The re-ask comes just inside the fanout timeout of the clear, and a sweep runs before its grace
    passed: it is told why all the same, not left to wait for an item."""
    run = Run()
    _cancelled_then_cleared(run, 7, 0.6)
    run(run.core.tick(10.11))
    run(run.core.ask(_ask(7, NEW), 10.55))  # 9.95 s after the clear
    assert run.statuses(run(run.core.tick(10.61))) == []  # a sweep, past the clear's fanout timeout
    [told] = run.statuses(run(run.core.tick(10.65)))
    assert told.failure.kind is FailureKind.CANCELLED and "asked for it again 10.550s after" in told.failure.detail

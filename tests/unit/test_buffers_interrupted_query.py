"""transfer.buffers.ReceivePool: an interrupt (a KeyboardInterrupt from a signal) landing inside a copy-out event's
query() leaves every slot tracked once: the pool's bookkeeping around the caller's event is as it was before the
call for that event, so its slot is neither lost nor handed out twice. Recording engine and fake clock."""

from __future__ import annotations

import pytest
from fakes import FakeClock, FakeEvent, RecordingEngine

from transfer.buffers import ReceivePool

SLOT = 256


class InterruptedEvent(FakeEvent):
    """A copy-out event whose query() meets a KeyboardInterrupt once armed (a signal landing inside the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def query(self) -> bool:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return super().query()


def _lease_all(pool: ReceivePool) -> list:
    leases = []
    while (slot := pool.lease(SLOT)) is not None:
        leases.append(slot)
    return leases


def test_a_poll_interrupted_inside_a_later_events_query_settles_the_earlier_slots_once():
    clock = FakeClock()
    with ReceivePool(RecordingEngine(), 3 * SLOT, SLOT, clock=clock) as pool:
        first, second, kept = _lease_all(pool)
        copied, interrupted = FakeEvent(), InterruptedEvent()
        first.release(copied)
        second.release(interrupted)
        copied.done, interrupted.armed = True, True
        with pytest.raises(KeyboardInterrupt):
            pool.poll()  # the first slot's copy is seen done, then the second's query is interrupted
        interrupted.done = True
        pool.poll()
        again = _lease_all(pool)
        assert sorted(slot.index for slot in again) == sorted([first.index, second.index])
        stats = pool.stats()
        assert stats["leased"] == 3 and stats["free"] == 0 and stats["pending_events"] == 0


def test_a_release_interrupted_inside_its_events_query_leaves_the_slot_awaiting_the_event():
    with ReceivePool(RecordingEngine(), SLOT, SLOT, clock=FakeClock()) as pool:
        slot = pool.lease(SLOT)
        event = InterruptedEvent()
        event.armed = True
        with pytest.raises(KeyboardInterrupt):
            slot.release(event)
        stats = pool.stats()
        assert stats["leased"] + stats["free"] + stats["pending_events"] + stats["quarantined"] == stats["slots"]
        assert pool.lease(SLOT) is None, "freed before its copy-out completed"
        event.done = True
        again = pool.lease(SLOT)
        assert again is not None and again.index == slot.index

"""What clear() of a pooled room does with its slot (SessionManager._forget()): freed once no write can land in it,
else held back from the next room until its cancel is confirmed or the quarantine passes.

The real _forget() and a real ReceivePool on a recording engine and a fake clock; the driver stands in for what
_forget() asks of it: clear() says whether the room succeeded, when_safe() files what runs on its confirmation."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from fakes import FakeClock, FakeEvent, RecordingEngine
from hypothesis import given
from hypothesis import strategies as st

from transfer.buffers import ReceivePool, Slot
from transfer.core.quarantine import Fate, fate_of
from transfer.drive.prefill import Room
from transfer.receiver import SessionManager, _settle

SLOT = 256
GRACE = 10.0
QUARANTINE = 1000.0  # far past every grace the checks below wait out


class _Driver:
    """A driver whose clear() forgets the room and answers `succeeded`; when_safe() runs `on_safe` at once
    for memory known safe, else keeps it for the confirmation, as PrefillDriver.when_safe() does."""

    forked = False

    def __init__(self, succeeded: bool) -> None:
        self.succeeded = succeeded
        self.rooms: dict[int, Room] = {}
        self.on_safe = None

    def clear(self, record: Room) -> bool:
        return self.succeeded

    def when_safe(self, record: Room, on_safe) -> None:
        if record.memory_safe:
            on_safe()
        else:
            self.on_safe = on_safe


def _manager(driver: _Driver) -> SessionManager:
    """A session manager with only what _forget() reads: its driver and its (empty) set of fallback regions."""
    manager = object.__new__(SessionManager)
    manager._driver = driver
    manager._regions_lock = threading.Lock()
    manager._region_sets = []
    return manager


def _held_back(pool: ReceivePool, clock: FakeClock, lease: Slot) -> bool:
    """Whether the let-go lease's memory is kept from the next room: a slot the pool does not lease again, a
    fallback still registered once its grace passed."""
    if lease.is_fallback:
        pool.poll()  # a copy-out seen complete here starts the grace
        clock.advance(GRACE)
        pool.poll()
        return lease.addr in pool.engine.regions
    again = pool.lease(SLOT)
    if again is None:
        return True
    assert again.index == lease.index
    again.release()
    return False


@given(succeeded=st.booleans(), memory_safe=st.booleans(), copy_out=st.sampled_from([None, "pending", "done"]),
       fallback=st.booleans(), confirmed=st.booleans())
def test_a_cleared_pooled_rooms_memory_is_freed_exactly_when_no_write_can_land_in_it(succeeded, memory_safe, copy_out,
                                                                                    fallback, confirmed):
    """Succeeded, or known safe (never asked, or its cancel confirmed): freed, after the copy-out when one was given.
    Otherwise (failed, or cleared before it concluded, its cancel unconfirmed) it is held back whatever the copy-out,
    until the cancel's confirmation (`confirmed`) or the quarantine passing."""
    clock = FakeClock()
    with ReceivePool(RecordingEngine(), SLOT, SLOT, clock=clock, quarantine_s=QUARANTINE, grace_s=GRACE) as pool:
        taken = pool.lease(SLOT) if fallback else None  # the one slot taken: the room gets a fallback
        lease = pool.lease_or_fallback(SLOT)
        assert lease.is_fallback is fallback
        record = Room(7, started_at=clock(), nbytes=SLOT, lease=lease, token=1, succeeded=succeeded,
                      memory_safe=memory_safe)
        driver = _Driver(succeeded)
        event = None if copy_out is None else FakeEvent()
        if event is not None:
            event.done = copy_out == "done"
        if taken is not None:
            taken.release()
        _manager(driver)._forget(record, event)
        assert record.lease is None
        if succeeded or memory_safe:
            assert driver.on_safe is None
            if copy_out == "pending":
                assert _held_back(pool, clock, lease), "freed before its copy-out completed"
                event.done = True
            assert not _held_back(pool, clock, lease)
        else:
            assert _held_back(pool, clock, lease), "a late write may still land in it"
            if event is not None:
                event.done = True
                assert _held_back(pool, clock, lease), "its copy-out completing ended the quarantine"
            assert driver.on_safe is not None, "its cancel's confirmation would not free it"
            if confirmed:
                driver.on_safe()
            else:
                clock.advance(QUARANTINE)
            assert not _held_back(pool, clock, lease)


class _Lease:
    """A pool slot or fallback that records what is done with it."""

    def __init__(self, is_fallback: bool) -> None:
        self.is_fallback = is_fallback
        self.region = object()
        self.calls: list[tuple] = []

    def release(self, event=None) -> None:
        self.calls.append(("release", event))

    def fail(self) -> None:
        self.calls.append(("fail",))

    def end_quarantine(self) -> None:
        self.calls.append(("end_quarantine",))


@given(succeeded=st.booleans(), memory_safe=st.booleans(), copy_out=st.booleans(), fallback=st.booleans())
def test_forget_carries_out_exactly_the_fate_fate_of_gives(succeeded, memory_safe, copy_out, fallback):
    """_forget() frees a room that succeeded, without a copy-out, without asking fate_of(): every room ends as
    _give_back() of fate_of()'s fate would end it (the lease's calls, a fallback's region record dropped), and
    waits for its cancel's confirmation exactly when that fate is Fate.QUARANTINE_UNTIL_CONFIRMED."""
    event = FakeEvent() if copy_out else None
    fate = fate_of(succeeded=succeeded, memory_safe=memory_safe, confirmable=True, copy_out=copy_out)
    settled = _Lease(fallback)
    _settle(settled, fate, event)
    lease = _Lease(fallback)
    record = Room(7, started_at=0.0, nbytes=SLOT, lease=lease, token=1, succeeded=succeeded, memory_safe=memory_safe)
    driver = _Driver(succeeded)
    manager = _manager(driver)
    others = SimpleNamespace(embedding=object())
    manager._region_sets = [others, SimpleNamespace(embedding=lease.region)]
    manager._forget(record, event)
    assert lease.calls == settled.calls
    assert manager._region_sets[0] is others
    assert len(manager._region_sets) == (1 if fallback else 2), "a fallback's region record outlived it"
    if fate is Fate.QUARANTINE_UNTIL_CONFIRMED:
        assert driver.on_safe == lease.end_quarantine
    else:
        assert driver.on_safe is None

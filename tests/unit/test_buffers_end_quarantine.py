"""Slot.end_quarantine: a failed room's slot is free at once once no late write can land in it."""

from __future__ import annotations

import gc
import weakref

import pytest
from fakes import FakeClock, InterleavingEngine, RecordingEngine

from transfer.buffers import ReceivePool

SLOT = 256


def make_pool(slots: int = 2) -> tuple[ReceivePool, FakeClock]:
    clock = FakeClock()
    return ReceivePool(RecordingEngine(), slots * SLOT, SLOT, clock=clock, quarantine_s=30.0, grace_s=10.0), clock


def test_a_failed_slot_confirmed_safe_is_leased_again_at_once():
    pool, _ = make_pool(slots=1)
    with pool:
        slot = pool.lease(SLOT)
        slot.fail()
        assert pool.lease(SLOT) is None and pool.stats()["quarantined"] == 1
        slot.end_quarantine()
        assert pool.stats()["quarantined"] == 0
        again = pool.lease(SLOT)
        assert again is not None and again.index == slot.index


def test_ending_a_quarantine_that_already_ended_leaves_the_slots_next_lease_alone():
    pool, clock = make_pool(slots=1)
    with pool:
        slot = pool.lease(SLOT)
        slot.fail()
        clock.advance(31.0)
        pool.poll()
        again = pool.lease(SLOT)
        again.fail()
        slot.end_quarantine()  # the old handle's quarantine is over: the new one's stays
        assert pool.stats()["quarantined"] == 1 and pool.lease(SLOT) is None
        slot.end_quarantine()
        assert pool.stats()["quarantined"] == 1


def test_a_fallback_confirmed_safe_starts_its_grace():
    pool, clock = make_pool(slots=1)
    with pool:
        held = pool.lease(SLOT)
        fallback = pool.lease_or_fallback(SLOT)
        assert fallback.is_fallback
        fallback.fail()
        fallback.end_quarantine()
        clock.advance(9.5)
        assert pool.stats()["fallbacks_live"] == 1
        clock.advance(1.0)  # its grace ended, long before the 30 s quarantine would have
        assert pool.stats()["fallbacks_live"] == 0 and fallback.addr not in pool.engine.regions
        held.release()


def test_a_fallbacks_registration_leaves_the_lock_to_end_quarantine_and_to_leases():
    # Over RDMA a registration takes milliseconds: the prefill I/O thread's end_quarantine() and
    # the other leases must not wait for it.
    engine, clock = InterleavingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, clock=clock, quarantine_s=30.0, grace_s=10.0) as pool:
        engine.pool = pool
        failed = pool.lease(SLOT)
        failed.fail()
        leased = []

        def meanwhile() -> None:
            failed.end_quarantine()
            leased.append(pool.lease(SLOT))

        engine.during_register = meanwhile
        fallback = pool.lease_or_fallback(SLOT)
        assert engine.lock_free == [True]
        assert fallback.is_fallback and leased[0] is not None and leased[0].index == failed.index
        assert pool.stats()["quarantined"] == 0
        fallback.release()
        leased[0].release()


def _closed_with_quarantine_ended(how: str):
    """A pool whose failed lease is quarantined, closed, then confirmed safe; dropped with its handles. Returns
    a weak reference to the lease's memory (the fake clock never moves)."""
    pool, _ = make_pool(slots=2)
    if how == "fallback failed":
        lease = pool.lease_or_fallback(SLOT * 4)
    else:
        lease = pool.lease(SLOT)
    if how == "slot failed after close":  # a session manager still open gives its room's slot back then
        pool.close()
    lease.fail()
    pool.close()
    lease.end_quarantine()
    alive = weakref.ref(lease.region.tensor)
    del lease, pool
    gc.collect()
    return alive


@pytest.mark.parametrize("how", ["slot failed before close", "slot failed after close", "fallback failed"])
def test_a_quarantine_ended_after_close_lets_the_closed_pools_memory_go_with_the_pool(how):
    """end_quarantine() after close() is accepted, as release() and fail() are then, and does what it does on an
    open pool: the memory is no longer held back for a late write (it goes with the pool), not only once the
    quarantine bound passed."""
    alive = _closed_with_quarantine_ended(how)
    assert alive() is None, "a closed pool's memory stayed held for a quarantine that was ended"


def test_a_closed_pools_region_stays_held_until_every_quarantined_slot_of_it_ended():
    pool, _ = make_pool(slots=2)
    first, second = pool.lease(SLOT), pool.lease(SLOT)
    first.fail()
    second.fail()
    pool.close()
    first.end_quarantine()
    alive = weakref.ref(pool.region.tensor)
    del first, pool
    gc.collect()
    assert alive() is not None, "a late write for the other failed room may still land in the region"
    second.end_quarantine()
    second.end_quarantine()  # a second call changes nothing, as on an open pool
    del second
    gc.collect()
    assert alive() is None

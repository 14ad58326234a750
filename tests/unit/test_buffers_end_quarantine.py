"""Slot.end_quarantine: a failed room's slot is free at once once no late write can land in it."""

from __future__ import annotations

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

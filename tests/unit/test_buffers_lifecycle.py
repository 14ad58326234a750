"""transfer.buffers.ReceivePool: fallback lifetimes, hostile events, exhaustion and churn, on the recording engine and fake clock."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
from fakes import FakeClock, FakeEvent, RecordingEngine

from transfer.buffers import QUARANTINE_S, ReceivePool, SlotError


SLOT = 256


def test_close_keeps_a_fallback_alive_while_its_copy_out_event_is_pending():
    """release(event) promises the memory until the event completed; close() unregisters the
    fallback but must not free it under a copy-out still reading it (on CUDA the caching
    allocator would hand the block to the next allocation)."""
    engine, clock = RecordingEngine(), FakeClock()
    pool = ReceivePool(engine, SLOT, SLOT, clock=clock)
    big = pool.lease_or_fallback(SLOT * 4)
    alive = weakref.ref(big.region.tensor)
    event = FakeEvent()
    big.release(event)
    del big
    pool.close()
    gc.collect()
    assert engine.regions == {}
    assert alive() is not None, "close() freed a fallback buffer whose copy-out had not completed"


def test_close_with_live_and_quarantined_leases_unregisters_everything_and_stays_closed():
    engine, clock = RecordingEngine(), FakeClock()
    pool = ReceivePool(engine, 4 * SLOT, SLOT, clock=clock)
    held, failed, pending = pool.lease(8), pool.lease(8), pool.lease(8)
    failed.fail()
    pending.release(FakeEvent())
    live_fallback = pool.lease_or_fallback(SLOT * 2)
    pool.close()
    assert engine.regions == {}
    held.release()
    live_fallback.fail()
    clock.advance(QUARANTINE_S * 2)
    pool.poll()
    assert engine.regions == {}  # nothing unregistered twice, nothing registered again
    with pytest.raises(SlotError, match="is closed"):
        pool.lease_or_fallback(SLOT * 2)
    with pytest.raises(SlotError, match="is closed"):
        pool.lease(8)


def test_an_event_that_fails_later_quarantines_from_the_poll_that_saw_it():
    class FlakyEvent:
        def __init__(self):
            self.calls = 0

        def query(self):
            self.calls += 1
            if self.calls == 1:
                return False
            raise RuntimeError("CUDA error: unspecified launch failure")

    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, quarantine_s=30.0, clock=clock) as pool:
        slot = pool.lease(8)
        slot.release(FlakyEvent())
        clock.advance(100.0)
        assert pool.stats()["quarantined"] == 1  # this poll saw the failure
        seen_at = clock.now
        clock.now = seen_at + 29.999
        assert pool.lease(8) is None
        clock.now = seen_at + 30.0
        assert pool.lease(8) is not None


def test_an_event_that_never_completes_holds_its_slot_and_the_pool_falls_back():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, clock=clock) as pool:
        pool.lease(8).release(FakeEvent())
        clock.advance(10 * QUARANTINE_S)
        stats = pool.stats()
        assert (stats["free"], stats["leased"], stats["pending_events"], stats["quarantined"]) == (0, 0, 1, 0)
        spare = pool.lease_or_fallback(8)
        assert spare.is_fallback and engine.regions[spare.addr] == 8
        spare.release()


def test_an_unallocatable_fallback_raises_and_leaves_nothing_behind():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, clock=clock) as pool:
        with pytest.raises(RuntimeError):
            pool.lease_or_fallback(1 << 62)
        stats = pool.stats()
        assert (stats["free"], stats["fallbacks_live"], stats["fallbacks_total"]) == (1, 0, 0)
        assert list(engine.regions) == [pool.region.addr]


def test_zero_byte_items_lease_a_slot_and_view_nothing():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, clock=clock) as pool:
        empty = pool.lease(0)
        assert empty.view((0, 64), torch.bfloat16).numel() == 0
        spare = pool.lease_or_fallback(0)
        assert spare.view((0,), torch.float32).numel() == 0
        empty.release()
        spare.release()
        assert pool.stats()["free"] == 1


class _Done:
    """An event already completed."""

    def query(self) -> bool:
        return True


def test_churn_keeps_the_pools_bookkeeping_bounded():
    engine, clock = RecordingEngine(), FakeClock()
    slots = 4
    with ReceivePool(engine, slots * SLOT, SLOT, quarantine_s=1.0, grace_s=0.5, clock=clock) as pool:
        rng = random.Random(3)
        for _ in range(5000):
            slot = pool.lease_or_fallback(rng.choice((8, SLOT * 2)))
            rng.choice((slot.release, slot.fail, lambda s=slot: s.release(_Done())))()
            clock.advance(0.01)
            assert len(pool._pending) + len(pool._quarantine) <= slots
            assert len(pool._graces) == len(pool._fallbacks) <= 1.0 / 0.01 + 1
            assert len(engine.regions) == 1 + len(pool._fallbacks)
        clock.advance(2.0)
        stats = pool.stats()
        assert stats["free"] == slots and stats["fallbacks_live"] == 0


@pytest.mark.parametrize("arguments, error, message", [
    (dict(nbytes="65536"), "ConfigTypeError", "nbytes must be an int, got str '65536'"),
    (dict(slot_bytes=4096.0), "ConfigTypeError", "slot_bytes must be an int, got float 4096.0"),
    (dict(max_fallback_bytes=True), "ConfigTypeError", "max_fallback_bytes must be an int, got bool True"),
    (dict(max_fallback_bytes=0.9), "ConfigTypeError", "max_fallback_bytes must be an int, got float 0.9"),
    (dict(device="no-such-device"), "ConfigError", "cannot allocate the pool's 65536 bytes on device 'no-such-device'"),
])
def test_a_pool_argument_of_the_wrong_kind_is_refused_naming_it(arguments, error, message):
    from transfer import errors

    engine = RecordingEngine()
    values = dict(nbytes=65536, slot_bytes=4096) | arguments
    nbytes, slot_bytes = values.pop("nbytes"), values.pop("slot_bytes")
    with pytest.raises(getattr(errors, error)) as caught:
        ReceivePool(engine, nbytes, slot_bytes, clock=FakeClock(), **values)
    assert str(caught.value).startswith(message)
    assert engine.regions == {}


def _alive_after_drop(make_failed_lease):
    """Closes a pool whose memory a failed room left quarantined, drops it, and returns the pool's
    engine, clock and weak references to the quarantined memory."""
    engine, clock = RecordingEngine(), FakeClock()
    pool = ReceivePool(engine, 4 * SLOT, SLOT, clock=clock, quarantine_s=30.0, grace_s=5.0)
    lease = make_failed_lease(pool)
    alive = weakref.ref(lease.region.tensor)
    del lease
    pool.close()
    del pool
    gc.collect()
    return engine, clock, alive


@pytest.mark.parametrize("how", ["slot failed before close", "slot failed after close", "fallback failed"])
def test_a_closed_pools_quarantined_memory_stays_allocated_until_its_quarantine_ends(how):
    """close() unregisters the pool, but a late write for a failed room may still come within the
    quarantine: were its memory freed with the pool, the next pool (or fallback) registered with the
    engine would get the same address, and the late write would land in a slot leased to a new room."""

    def make_failed_lease(pool):
        if how == "fallback failed":
            lease = pool.lease_or_fallback(SLOT * 4)
            lease.fail()
            return lease
        lease = pool.lease(8)
        if how == "slot failed before close":
            lease.fail()
            return lease
        # A manager closed after its pool gives its rooms' slots back then.
        pool.close()
        lease.fail()
        return lease

    engine, clock, alive = _alive_after_drop(make_failed_lease)
    assert engine.regions == {}
    clock.advance(29.0)
    successor = ReceivePool(engine, 4 * SLOT, SLOT, clock=clock)
    gc.collect()
    assert alive() is not None, "a closed pool's memory was freed while a late write may still land in it"
    clock.advance(1.0)
    successor.poll()  # the quarantine is over: the memory goes
    gc.collect()
    assert alive() is None
    successor.close()


@pytest.mark.parametrize("when", ["cleared before close", "cleared after close"])
@pytest.mark.parametrize("what", ["slot", "fallback"])
def test_a_closed_pools_memory_a_copy_out_still_reads_stays_allocated_until_the_copy_completed(what, when):
    """A room cleared with a copy-out event still pending, its pool closed (before or after the clear) and
    dropped: the copy may still read the slot (or fallback), so its memory outlives the pool until the
    event says the copy is done."""
    engine, clock = RecordingEngine(), FakeClock()
    pool = ReceivePool(engine, 4 * SLOT, SLOT, clock=clock, quarantine_s=30.0, grace_s=5.0)
    lease = pool.lease_or_fallback(SLOT * 4) if what == "fallback" else pool.lease(8)
    event = FakeEvent()
    if when == "cleared after close":  # a manager still open clears its room after its pool was closed
        pool.close()
    lease.release(event)
    alive = weakref.ref(lease.region.tensor)
    del lease
    pool.close()
    del pool
    gc.collect()
    successor = ReceivePool(engine, 4 * SLOT, SLOT, clock=clock)
    successor.poll()
    gc.collect()
    assert alive() is not None, "a closed pool's memory was freed while a copy-out may still read it"
    event.done = True
    successor.poll()  # the copy completed: the memory goes, long before any quarantine would end
    gc.collect()
    assert alive() is None
    successor.close()


def test_a_closed_pools_memory_whose_copy_out_never_reports_goes_at_its_quarantine_bound():
    engine, clock = RecordingEngine(), FakeClock()
    pool = ReceivePool(engine, 4 * SLOT, SLOT, clock=clock, quarantine_s=30.0, grace_s=5.0)
    lease = pool.lease(8)
    lease.release(FakeEvent())  # never done
    alive = weakref.ref(lease.region.tensor)
    del lease
    pool.close()
    del pool
    clock.advance(29.0)
    successor = ReceivePool(engine, 4 * SLOT, SLOT, clock=clock)
    gc.collect()
    assert alive() is not None
    clock.advance(1.0)
    successor.poll()
    gc.collect()
    assert alive() is None
    successor.close()


def _counts(pool: ReceivePool) -> tuple[int, ...]:
    stats = pool.stats()
    assert stats["free"] + stats["leased"] + stats["pending_events"] + stats["quarantined"] == stats["slots"], stats
    return (stats["free"], stats["leased"], stats["pending_events"], stats["quarantined"], stats["fallbacks_live"],
            stats["fallback_bytes"])


def test_a_closed_pools_stats_add_up_to_its_slots_and_hold_nothing_back():
    """stats() of a closed pool: the slot leases not given back yet, every other slot free, nothing pending,
    quarantined or registered, however its leases were given back, before or after close(), and however the
    quarantines of those that failed end."""
    engine, clock = RecordingEngine(), FakeClock()
    pool = ReceivePool(engine, 6 * SLOT, SLOT, clock=clock, quarantine_s=30.0, grace_s=5.0)
    failed, pending, held, released_after, failed_after = (pool.lease(8) for _ in range(5))
    big = pool.lease_or_fallback(4 * SLOT)
    failed.fail()
    pending.release(FakeEvent())
    assert _counts(pool) == (1, 3, 1, 1, 1, 4 * SLOT)
    pool.close()
    assert _counts(pool) == (3, 3, 0, 0, 0, 0)
    released_after.release()
    failed_after.fail()
    big.fail()
    assert _counts(pool) == (5, 1, 0, 0, 0, 0)
    failed_after.end_quarantine()
    clock.advance(60.0)
    assert _counts(pool) == (5, 1, 0, 0, 0, 0)
    held.release(FakeEvent())
    assert _counts(pool) == (6, 0, 0, 0, 0, 0)

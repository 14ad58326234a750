"""transfer.buffers: the default quarantine follows the engine's bound on how long a write into its memory
may go on landing (the wire path's listener), by the bytes the quarantined memory holds."""

from __future__ import annotations

import pytest
from fakes import FakeClock, RecordingEngine

from transfer.buffers import LATE_START_S, QUARANTINE_S, ReceivePool, default_quarantine_s


SLOT = 1 << 20
RATE = 256 * 1024  # bytes/s
GRACE = 60.0


class RateBoundEngine(RecordingEngine):
    """A recording engine whose memory takes a write for a grace, then at least RATE bytes/s."""

    def late_write_s(self, nbytes: int) -> float:
        return GRACE + nbytes / RATE


@pytest.fixture(autouse=True)
def _no_quarantine_setting(monkeypatch):
    monkeypatch.delenv("EPD_QUARANTINE_S", raising=False)


def test_an_engine_without_a_bound_keeps_the_documented_default():
    assert default_quarantine_s(RecordingEngine(), 1 << 30) == QUARANTINE_S


def test_a_bound_longer_than_mooncakes_transfer_timeout_lengthens_the_default_by_size():
    engine = RateBoundEngine()
    assert default_quarantine_s(engine, SLOT) == LATE_START_S + GRACE + 4.0
    assert default_quarantine_s(engine, 64 * SLOT) == LATE_START_S + GRACE + 256.0
    assert default_quarantine_s(engine, SLOT) > QUARANTINE_S


def test_a_short_bound_never_shortens_the_default():
    class Quick(RecordingEngine):
        def late_write_s(self, nbytes: int) -> float:
            return 1.0

    assert default_quarantine_s(Quick(), SLOT) == QUARANTINE_S


def test_a_failed_slot_stays_out_until_a_late_write_of_its_size_is_over():
    clock = FakeClock()
    with ReceivePool(RateBoundEngine(), 2 * SLOT, SLOT, clock=clock) as pool:
        assert pool.quarantine_s == LATE_START_S + GRACE + 4.0
        doomed = pool.lease(SLOT)
        doomed.fail()
        clock.advance(QUARANTINE_S)  # where a pool sized for Mooncake's transfer timeout would free it
        assert {pool.lease(8).addr} == {pool.region.addr + SLOT} and pool.lease(8) is None
        clock.advance(pool.quarantine_s - QUARANTINE_S)
        assert pool.lease(8).addr == doomed.addr


def test_a_failed_fallback_is_held_by_its_own_size():
    clock = FakeClock()
    with ReceivePool(RateBoundEngine(), SLOT, SLOT, grace_s=0.0, clock=clock) as pool:
        big = pool.lease_or_fallback(64 * SLOT)
        assert big.is_fallback
        held = pool.quarantine_of(big.nbytes)
        assert held == LATE_START_S + GRACE + 256.0 > pool.quarantine_s
        big.fail()
        clock.advance(pool.quarantine_s)
        pool.poll()
        assert pool.stats()["fallbacks_live"] == 1
        clock.advance(held - pool.quarantine_s)
        pool.poll()
        assert pool.stats()["fallbacks_live"] == 0


@pytest.mark.parametrize("set_by", ["argument", "environment"])
def test_a_quarantine_set_is_kept_whatever_the_engine_bounds(monkeypatch, set_by):
    kwargs = {"quarantine_s": 5.0} if set_by == "argument" else {}
    if set_by == "environment":
        monkeypatch.setenv("EPD_QUARANTINE_S", "5")
    with ReceivePool(RateBoundEngine(), SLOT, SLOT, clock=FakeClock(), **kwargs) as pool:
        assert pool.quarantine_s == 5.0
        assert pool.quarantine_of(64 * SLOT) == 5.0

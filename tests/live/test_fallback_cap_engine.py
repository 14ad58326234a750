"""The fallback cap live: concurrent fallbacks, a real-engine pool, and a SessionManager whose receive() meets the cap.

Real Mooncake engines (tcp on 127.0.0.1), fed by a real SenderPool behind a real bootstrap server."""

from __future__ import annotations

import time

import pytest
import torch
from fakes import FakeClock
from live_helpers import wait_until
from lock_races import Race, WatchedLock, pause_on_read, run_racers

from transfer.buffers import FallbackLimitError, ReceivePool
from transfer.metrics import total


HOST = "127.0.0.1"
BF16 = "torch.bfloat16"
SLOT = 256


@pytest.mark.live
def test_concurrent_fallbacks_never_pass_the_cap(engines, monkeypatch):
    """Eight threads ask for a fallback at once and three fit under the cap: three get one,
    five are refused, and the bytes registered are the cap's. Each thread, once it read the
    fallback bytes held, waits there until every other one is inside too (no lock: all saw
    room for theirs) or blocked on the pool's lock or done."""
    _, engine = engines
    registered_before = set(engine.registered())
    threads, fits = 8, 3
    with ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=fits * 2 * SLOT, clock=FakeClock()) as pool:
        pool.lease(8)  # the only slot: every ask below needs a fallback
        race = Race()
        monkeypatch.setattr(pool, "_lock", WatchedLock(pool._lock, race))
        pause_on_read(monkeypatch, ReceivePool, "_fallback_bytes", race)
        results = run_racers(race, {f"asker {n}": lambda: pool.lease_or_fallback(2 * SLOT) for n in range(threads)})
        monkeypatch.undo()
        assert len(race.inside()) == threads  # every one got to the check
        got = [r for r in results.values() if not isinstance(r, BaseException)]
        refused = [r for r in results.values() if isinstance(r, FallbackLimitError)]
        assert (len(got), len(refused)) == (fits, threads - fits), results
        fallbacks = set(engine.registered()) - registered_before - {pool.region.addr}
        assert fallbacks == {slot.addr for slot in got}
        assert pool.stats()["fallback_bytes"] == fits * 2 * SLOT == sum(engine.registered()[a] for a in fallbacks)
    assert set(engine.registered()) == registered_before


@pytest.mark.live
def test_a_real_engine_pool_refuses_past_the_cap_until_the_quarantine_ends(engines):
    """A failed room's fallback holds the whole cap for its quarantine; the next fallback is
    refused (nothing registered for it) and allowed once the quarantine ended, and a real
    one-sided write then lands in it."""
    encode_engine, prefill_engine = engines
    registered_before = set(prefill_engine.registered())
    source = torch.randint(0, 256, (2 * SLOT,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    encode_engine.register(source)
    quarantine = 0.4
    try:
        with ReceivePool(prefill_engine, SLOT, SLOT, quarantine_s=quarantine, grace_s=0.05,
                         max_fallback_bytes=2 * SLOT) as pool:
            failed = pool.lease_or_fallback(2 * SLOT)
            failed_addr = failed.addr
            failed.fail()
            failed_at = time.monotonic()
            held = set(prefill_engine.registered())
            assert {pool.region.addr, failed_addr} <= held
            with pytest.raises(FallbackLimitError) as refused:
                pool.lease_or_fallback(2 * SLOT)
            text = str(refused.value)
            assert time.monotonic() < failed_at + quarantine, "the machine is too slow for this test's timing"
            assert "a fallback buffer of 512 bytes would take fallbacks past max_fallback_bytes=512" in text
            assert "they hold 512 bytes in 1 buffers (0 live, 0 awaiting copy-out events, 0 in grace, " \
                   "1 quarantined after failed rooms; the next retires in" in text
            assert "size the pool's slots to at least 512 bytes, or raise max_fallback_bytes" in text
            assert set(prefill_engine.registered()) == held  # nothing registered for the refused ask
            time.sleep(max(0.0, failed_at + quarantine + 0.05 - time.monotonic()))
            fresh = pool.lease_or_fallback(2 * SLOT)  # no explicit poll: the ask retires the old one
            assert fresh.is_fallback
            assert failed_addr not in prefill_engine.registered()
            assert pool.stats()["fallback_bytes"] == 2 * SLOT
            landing = fresh.view((2 * SLOT,), torch.uint8)
            landing.zero_()
            encode_engine.write(prefill_engine.session_id, [source.data_ptr()], [fresh.addr], [2 * SLOT])
            assert torch.equal(landing, source)
            fresh.release()
            assert wait_until(lambda: pool.stats()["fallback_bytes"] == 0, 3.0)
            assert fresh.addr not in prefill_engine.registered()
        assert set(prefill_engine.registered()) == registered_before
    finally:
        encode_engine.unregister(source.data_ptr())


@pytest.mark.live
def test_receive_past_the_cap_raises_to_its_caller_and_starts_no_room(engines):
    """SessionManager.receive() leases before filing the room: the cap's error reaches the
    caller as is, no room is started (its number is free again), nothing is registered, and
    once the first room's fallback retired the same room is received in full."""
    from transfer.bootstrap import BootstrapServer
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    encode_engine, prefill_engine = engines
    registered_before = set(prefill_engine.registered())
    rows, hidden = 8, 64
    item_nbytes = rows * hidden * 2
    first_item = torch.randn(rows, hidden).to(torch.bfloat16)
    second_item = torch.randn(rows, hidden).to(torch.bfloat16)
    encode_engine.register(first_item)
    encode_engine.register(second_item)
    try:
        with BootstrapServer(HOST, 0) as server, \
                ReceivePool(prefill_engine, SLOT, SLOT, quarantine_s=0.2, grace_s=0.2,
                            max_fallback_bytes=item_nbytes) as slots, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=10) as manager:
            sender.send(1, first_item)
            first = manager.receive(1, server.address, rows=rows, hidden=hidden, dtype=BF16)
            assert first.wait(5) == TransferPoll.Success, first.failure
            assert torch.equal(first.rows.view(torch.uint8), first_item.view(torch.uint8))
            held = set(prefill_engine.registered())
            started = total(manager.stats(), "epd_prefill_rooms_started_total")
            with pytest.raises(FallbackLimitError, match=f"a fallback buffer of {item_nbytes} bytes would take "
                                                         f"fallbacks past max_fallback_bytes={item_nbytes}: they "
                                                         f"hold {item_nbytes} bytes in 1 buffers \\(1 live") as caught:
                manager.receive(2, server.address, rows=rows, hidden=hidden, dtype=BF16)
            # Room 1 concluded and is not cleared yet: its lease is what holds the budget.
            assert str(caught.value).endswith("; 1 of the leases belong to rooms that concluded and were never "
                                              "cleared: call clear() on their handles"), str(caught.value)
            assert set(prefill_engine.registered()) == held
            assert total(manager.stats(), "epd_prefill_rooms_started_total") == started
            first.clear()  # its fallback starts its grace
            assert wait_until(lambda: slots.stats()["fallback_bytes"] == 0, 3.0)
            sender.send(2, second_item)
            second = manager.receive(2, server.address, rows=rows, hidden=hidden, dtype=BF16)
            assert second.wait(5) == TransferPoll.Success, second.failure
            assert torch.equal(second.rows.view(torch.uint8), second_item.view(torch.uint8))
            second.clear()
            assert wait_until(lambda: slots.stats()["fallback_bytes"] == 0, 3.0)
        assert set(prefill_engine.registered()) == registered_before
    finally:
        encode_engine.unregister(first_item.data_ptr())
        encode_engine.unregister(second_item.data_ptr())


@pytest.mark.live
def test_a_fallback_released_by_clear_and_taken_again_at_once_keeps_its_new_rooms_region(engines):
    """clear() hands a fallback back; another receive() may take it before clear() returns. The
    new room's region record must survive the first room's clear (its next receive is checked
    against the records)."""
    from transfer.receiver import SessionManager

    _, engine = engines
    boot = "127.0.0.1:9"  # nothing listens: the rooms' look-ups fail later, harmless here
    rows, hidden = 64, 64
    with ReceivePool(engine, SLOT, SLOT, grace_s=30.0) as pool, \
            SessionManager(engine, 0, 1, 1, pool=pool, host=HOST, deadline_s=30.0) as manager:
        first = manager.receive(1, boot, rows=rows, hidden=hidden, dtype=BF16)
        region = first._state.lease.region
        taken = []
        release = pool._on_release

        def release_then_receive_again(slot, event):
            release(slot, event)
            if not taken:  # another thread's receive(), between this release and the rest of clear()
                taken.append(manager.receive(2, boot, rows=rows, hidden=hidden, dtype=BF16))

        pool._on_release = release_then_receive_again
        first.clear()
        pool._on_release = release
        [second] = taken
        assert second._state.lease.region is region  # the idle fallback, taken again
        assert any(r.embedding is region for r in manager._region_sets), "the second room's region record is gone"
        second.clear()

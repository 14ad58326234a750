"""Review of transfer.buffers.ReceivePool's cap on fallback bytes (max_fallback_bytes).

Pure-logic tests reuse test_buffers' recording engine, fake clock and fake events; the
live tests run real Mooncake engines (tcp on 127.0.0.1): a pool on its own, and a
SessionManager whose receive() meets the cap, fed by a real SenderPool behind a real
bootstrap server.
"""

from __future__ import annotations

import random
import re
import threading
import time

import pytest
import torch
from live_helpers import wait_until
from test_buffers import FakeClock, FakeEvent, RecordingEngine

from transfer.buffers import FALLBACK_FLOOR_BYTES, FallbackLimitError, ReceivePool

HOST = "127.0.0.1"
BF16 = "torch.bfloat16"
SLOT = 256


def _fallback_bytes(engine: RecordingEngine, pool: ReceivePool) -> int:
    """Bytes the recording engine holds registered besides the pool's own region."""
    return sum(n for addr, n in engine.regions.items() if addr != pool.region.addr)


# -- the knob --------------------------------------------------------------------------------

def test_the_default_cap_is_the_pools_size_but_at_least_the_floor():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, 4 * SLOT, SLOT, clock=clock) as small:
        assert small.max_fallback_bytes == FALLBACK_FLOOR_BYTES
        stats = small.stats()
        assert (stats["fallback_bytes"], stats["max_fallback_bytes"]) == (0, FALLBACK_FLOOR_BYTES)
    big_bytes = FALLBACK_FLOOR_BYTES + 4 * SLOT  # torch.empty does not touch the pages
    with ReceivePool(engine, big_bytes, SLOT, clock=clock) as big:
        assert big.max_fallback_bytes == big_bytes


def test_a_negative_cap_is_refused_and_none_is_unbounded():
    engine, clock = RecordingEngine(), FakeClock()
    with pytest.raises(ValueError, match="max_fallback_bytes must be >= 0 or None, got -1"):
        ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=-1, clock=clock)
    assert list(engine.regions) == []
    with ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=None, clock=clock) as pool:
        held = [pool.lease_or_fallback(4 * SLOT) for _ in range(64)]
        stats = pool.stats()
        assert (stats["fallback_bytes"], stats["max_fallback_bytes"]) == (64 * 4 * SLOT, None)
        assert _fallback_bytes(engine, pool) == 64 * 4 * SLOT
        for slot in held:
            slot.release()


def test_fallbacks_fill_the_cap_exactly_and_the_next_one_is_refused():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=2 * SLOT + 1, clock=clock) as pool:
        empty = pool.lease_or_fallback(0)  # the pool's one slot
        assert not empty.is_fallback
        first, second = pool.lease_or_fallback(SLOT + 1), pool.lease_or_fallback(SLOT - 1)
        zero = pool.lease_or_fallback(0)  # a zero-byte item's buffer still counts its 1 byte
        assert first.is_fallback and second.is_fallback and zero.is_fallback
        assert pool.stats()["fallback_bytes"] == 2 * SLOT + 1 == _fallback_bytes(engine, pool)
        before = dict(engine.regions)
        with pytest.raises(FallbackLimitError):
            pool.lease_or_fallback(0)
        assert engine.regions == before
        for slot in (first, second, empty, zero):
            slot.release()


def test_a_zero_cap_allows_no_fallback_but_slots_still_lease():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, 2 * SLOT, SLOT, max_fallback_bytes=0, clock=clock) as pool:
        with pytest.raises(FallbackLimitError, match="bigger than a slot"):
            pool.lease_or_fallback(SLOT + 16)
        one, two = pool.lease_or_fallback(8), pool.lease_or_fallback(SLOT)
        assert not one.is_fallback and not two.is_fallback
        with pytest.raises(FallbackLimitError, match="all 2 slots are taken"):
            pool.lease_or_fallback(8)
        assert list(engine.regions) == [pool.region.addr]


# -- the error -------------------------------------------------------------------------------

def _fill_every_state(pool: ReceivePool) -> tuple[FakeEvent, list]:
    """Holds the pool's one slot and four SLOT fallbacks: live, awaiting an event, in grace,
    quarantined. Returns (the pending copy-out's event, the live handles)."""
    slot = pool.lease(8)
    live = pool.lease_or_fallback(SLOT)
    pending = pool.lease_or_fallback(SLOT)
    event = FakeEvent()
    pending.release(event)
    pool.lease_or_fallback(SLOT).release()  # grace: 10 s
    pool.lease_or_fallback(SLOT).fail()  # quarantine: 30 s
    return event, [slot, live]


def test_the_error_names_the_ask_what_fallbacks_hold_the_cap_and_the_remedy():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, quarantine_s=30.0, grace_s=10.0,
                     max_fallback_bytes=4 * SLOT, clock=clock) as pool:
        event, live = _fill_every_state(pool)
        before, total = dict(engine.regions), pool.stats()["fallbacks_total"]
        clock.advance(2.5)
        with pytest.raises(FallbackLimitError) as exhausted:
            pool.lease_or_fallback(8)
        expected = (
            f"receive pool at {pool.region.addr:#x}: a fallback buffer of 8 bytes would take fallbacks "
            f"past max_fallback_bytes=1024: they hold 1024 bytes in 4 buffers (1 live, 1 awaiting copy-out "
            f"events, 1 in grace, 1 quarantined after failed rooms; the next retires in 7.5s), and all 1 "
            f"slots are taken (1 leased, 0 quarantined, 0 awaiting copy-out events); size the pool larger "
            f"(more than 1 slots of 256 bytes), or raise max_fallback_bytes (None: unbounded)"
        )
        assert str(exhausted.value) == expected
        with pytest.raises(FallbackLimitError) as too_big:
            pool.lease_or_fallback(3 * SLOT)
        assert re.search(r"a fallback buffer of 768 bytes would take fallbacks past max_fallback_bytes=1024: "
                         r"they hold 1024 bytes .*, and the item is bigger than a slot \(256 bytes\); "
                         r"size the pool's slots to at least 768 bytes, or raise max_fallback_bytes",
                         str(too_big.value)), str(too_big.value)
        assert isinstance(too_big.value, RuntimeError)
        # Nothing allocated, registered or counted on the refused path.
        stats = pool.stats()
        assert engine.regions == before
        assert (stats["fallback_bytes"], stats["fallbacks_live"], stats["fallbacks_total"]) == (4 * SLOT, 4, total)
        event.done = True
        for slot in live:
            slot.release()


def test_retiring_graces_and_quarantines_makes_room_again_without_an_explicit_poll():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, quarantine_s=30.0, grace_s=10.0,
                     max_fallback_bytes=4 * SLOT, clock=clock) as pool:
        event, live = _fill_every_state(pool)
        clock.advance(10.0)  # the grace ended: one SLOT is free to take
        again = pool.lease_or_fallback(SLOT)
        assert again.is_fallback and pool.stats()["fallback_bytes"] == 4 * SLOT
        with pytest.raises(FallbackLimitError, match=r"1 quarantined after failed rooms; the next retires in 20\.0s"):
            pool.lease_or_fallback(2 * SLOT)
        clock.advance(20.0)  # the quarantine ended
        event.done = True  # and the copy-out finished: its grace starts at the next poll
        assert pool.lease_or_fallback(SLOT).is_fallback
        assert pool.stats()["fallback_bytes"] == 4 * SLOT == _fallback_bytes(engine, pool)
        for slot in live:
            slot.release()


def test_a_failed_allocation_or_registration_gives_its_reservation_back():
    class RefusingEngine(RecordingEngine):
        refuse = False

        def register(self, buf, length=None):
            if self.refuse:
                raise RuntimeError("register failed: out of memory regions")
            return super().register(buf, length)

    engine, clock = RefusingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=1 << 63, clock=clock) as pool:
        with pytest.raises(RuntimeError) as unallocatable:
            pool.lease_or_fallback(1 << 62)  # within the cap, beyond any machine
        assert not isinstance(unallocatable.value, FallbackLimitError)
        engine.refuse = True
        with pytest.raises(RuntimeError, match="out of memory regions"):
            pool.lease_or_fallback(2 * SLOT)
        stats = pool.stats()
        assert (stats["fallback_bytes"], stats["fallbacks_live"], stats["fallbacks_total"]) == (0, 0, 0)
        assert list(engine.regions) == [pool.region.addr]


def test_close_drops_the_count_and_late_returns_do_not_drive_it_negative():
    engine, clock = RecordingEngine(), FakeClock()
    pool = ReceivePool(engine, SLOT, SLOT, quarantine_s=1.0, grace_s=1.0, max_fallback_bytes=4 * SLOT, clock=clock)
    held = [pool.lease_or_fallback(SLOT) for _ in range(3)]
    pool.close()
    held[0].release()
    held[1].fail()
    clock.advance(5.0)
    pool.poll()
    stats = pool.stats()
    assert (stats["fallback_bytes"], stats["fallbacks_live"]) == (0, 0)
    assert engine.regions == {}


# -- threads and churn ---------------------------------------------------------------------------

def test_concurrent_fallbacks_never_pass_the_cap():
    engine, clock = RecordingEngine(), FakeClock()
    threads, fits = 8, 3
    with ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=fits * 2 * SLOT, clock=clock) as pool:
        pool.lease(8)  # the only slot: every ask below needs a fallback
        barrier = threading.Barrier(threads)
        got: list[object] = []
        refused: list[str] = []

        def ask() -> None:
            barrier.wait(10)
            try:
                got.append(pool.lease_or_fallback(2 * SLOT))
            except FallbackLimitError as exc:
                refused.append(str(exc))

        workers = [threading.Thread(target=ask) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        assert not any(w.is_alive() for w in workers)
        assert (len(got), len(refused)) == (fits, threads - fits)
        assert pool.stats()["fallback_bytes"] == fits * 2 * SLOT == _fallback_bytes(engine, pool)


def test_churn_keeps_the_fallback_byte_count_equal_to_what_is_registered():
    engine, clock = RecordingEngine(), FakeClock()
    cap = 6 * SLOT
    with ReceivePool(engine, 2 * SLOT, SLOT, quarantine_s=1.0, grace_s=0.3, max_fallback_bytes=cap,
                     clock=clock) as pool:
        rng = random.Random(11)
        held: list = []
        events: list[FakeEvent] = []
        refusals = 0
        for _ in range(4000):
            if held and rng.random() < 0.5:
                slot = held.pop(rng.randrange(len(held)))
                how = rng.choice(("release", "fail", "event"))
                if how == "event":
                    events.append(FakeEvent())
                    slot.release(events[-1])
                else:
                    getattr(slot, how)()
            else:
                try:
                    held.append(pool.lease_or_fallback(rng.choice((0, 8, SLOT, SLOT + 16, 3 * SLOT))))
                except FallbackLimitError:
                    refusals += 1
            if events and rng.random() < 0.2:
                events.pop(rng.randrange(len(events))).done = True
            clock.advance(rng.choice((0.0, 0.01, 0.1)))
            assert pool._fallback_bytes == _fallback_bytes(engine, pool) <= cap
        assert refusals > 0, "the churn never reached the cap: it tests nothing"
        for slot in held:
            slot.release()
        for event in events:
            event.done = True
        clock.advance(2.0)
        pool.poll()  # copy-outs that completed start their grace here
        clock.advance(2.0)
        stats = pool.stats()
        assert (stats["fallback_bytes"], stats["fallbacks_live"], stats["free"]) == (0, 0, 2)


# -- live ------------------------------------------------------------------------------------------

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
            started = manager.stats()["counters"]["rooms_started_total"]
            with pytest.raises(FallbackLimitError, match=f"a fallback buffer of {item_nbytes} bytes would take "
                                                         f"fallbacks past max_fallback_bytes={item_nbytes}: they "
                                                         f"hold {item_nbytes} bytes in 1 buffers \\(1 live"):
                manager.receive(2, server.address, rows=rows, hidden=hidden, dtype=BF16)
            assert set(prefill_engine.registered()) == held
            assert manager.stats()["counters"]["rooms_started_total"] == started
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

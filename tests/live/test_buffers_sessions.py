"""transfer.buffers.ReceivePool live: late writes into slots, fallback graces under a session manager, threads.

Real Mooncake engines (tcp on 127.0.0.1); the encode side is a real SenderPool behind a real
bootstrap server."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
import torch
from fakes import FakeClock, FakeEvent
from live_helpers import wait_until

from lock_races import Race, WatchedLock, pause_on_read, run_racers

from transfer.buffers import QUARANTINE_S, ReceivePool, Slot, SlotError


HOST = "127.0.0.1"
BF16 = "torch.bfloat16"
SLOT = 256


def _default(env: str) -> float:
    """The documented default of a setting (what applies when its EPD_* variable is unset)."""
    from transfer.config import setting

    return setting(env).default


def test_default_quarantine_outlasts_a_parked_ask_whose_item_then_waits_for_its_ready_event():
    """The encode rank parks an ask up to its fanout timeout for the item; the item that
    comes at the end of it may then wait up to another fanout timeout for its ready event
    (counted from send()), and the write itself lasts up to Mooncake's transfer timeout."""
    from transfer.engine import mooncake_transfer_timeout_s

    parking = _default("EPD_FANOUT_TIMEOUT_S")
    latest_write = 2 * parking + mooncake_transfer_timeout_s()
    assert QUARANTINE_S >= latest_write, (
        f"a failed room's slot is free again after {QUARANTINE_S:g}s, but its late write may land "
        f"up to {latest_write:g}s after the ask")


@pytest.mark.live
def test_a_late_write_held_by_its_ready_event_does_not_land_in_the_next_rooms_slot(engines):
    """Defaults scaled down 40 times: room 1 is asked for and given up at once; its item comes
    just before the encode rank's parking ends, with a ready event that completes just before
    the bound counted from send(). Room 2, leased after the failed slot's quarantine would end
    if it covered only the parking, must keep its bytes. Our encode rank starts no write for a
    room its receiver cancelled (room 1's clear() does), so room 1 fails unwritten
    and its slot, the cancel confirmed, serves room 2 (the quarantine stays sized for encode
    ranks without the cancel that count from send())."""
    from transfer.bootstrap import BootstrapServer
    from transfer.core.failure import FailureKind
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    scale = 1 / 40
    parking = _default("EPD_FANOUT_TIMEOUT_S") * scale  # 3 s
    quarantine = QUARANTINE_S * scale
    encode_engine, prefill_engine = engines
    rows, hidden = 4, 64
    slot = rows * hidden * 2
    late_item = torch.randn(rows, hidden).to(torch.bfloat16)
    next_item = torch.randn(rows, hidden).to(torch.bfloat16)
    encode_engine.register(late_item)
    encode_engine.register(next_item)
    ready = FakeEvent()  # the encode side's copy into late_item, still running
    try:
        with BootstrapServer(HOST, 0) as server, \
                ReceivePool(prefill_engine, slot, slot, quarantine_s=quarantine, grace_s=0) as slots, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, fanout_timeout_s=parking) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=30) as manager:
            given_up = manager.receive(1, server.address, rows=rows, hidden=hidden, dtype=BF16)
            assert wait_until(lambda: given_up.poll() == TransferPoll.WaitingForInput, 5.0)
            cleared_at = time.monotonic()
            given_up.clear()  # the request was aborted: its slot is free once the cancel is confirmed
            time.sleep(max(0.0, cleared_at + 2 / 3 * parking - time.monotonic()))
            written = sender.send(1, late_item, ready_event=ready)  # within the parking: it is served
            # After a quarantine of parking + 10 s (scaled) would have ended, before the ready
            # event's bound (send() + parking).
            time.sleep(max(0.0, cleared_at + parking * 130 / 120 + 0.25 - time.monotonic()))
            following = manager.receive(2, server.address, rows=rows, hidden=hidden, dtype=BF16)
            assert sender.send(2, next_item).wait(5) == TransferPoll.Success
            assert following.wait(5) == TransferPoll.Success, following.failure
            assert time.monotonic() < cleared_at + 2 / 3 * parking + parking - 0.2, \
                "the machine is too slow for this test's timing"
            ready.done = True
            assert written.wait(5) == TransferPoll.Failed
            assert written.failure_kind is FailureKind.CANCELLED, written.failure  # its clear() cancelled it
            written.clear()
            time.sleep(0.2)  # a write, had one started, would have landed by now
            assert torch.equal(following.rows.view(torch.uint8), next_item.view(torch.uint8)), \
                "room 1's late write landed in room 2's rows"
            # The encode rank confirmed the cancel: room 2 got room 1's slot back, not a fallback.
            assert slots.stats()["fallbacks_total"] == 0
            following.clear()
    finally:
        encode_engine.unregister(late_item.data_ptr())
        encode_engine.unregister(next_item.data_ptr())


@pytest.mark.live
def test_a_write_into_a_fallback_past_its_quarantine_is_refused_and_lands_nowhere(engines):
    """A failed fallback buffer is deregistered after its quarantine: a write that comes later
    still is refused by the engine, not written into memory that may be reused."""
    from transfer.engine import TransferError

    encode_engine, prefill_engine = engines
    clock = FakeClock()
    source = torch.randint(0, 256, (SLOT * 2,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    encode_engine.register(source)
    try:
        with ReceivePool(prefill_engine, SLOT, SLOT, quarantine_s=5.0, grace_s=1.0, clock=clock) as pool:
            big = pool.lease_or_fallback(SLOT * 2)
            buffer = big.view((SLOT * 2,), torch.uint8)
            buffer.zero_()
            big.fail()
            clock.advance(5.0)
            pool.poll()
            assert big.addr not in prefill_engine.registered()
            with pytest.raises(TransferError):
                encode_engine.write(prefill_engine.session_id, [source.data_ptr()], [big.addr], [SLOT * 2])
            assert int(buffer.count_nonzero()) == 0
    finally:
        encode_engine.unregister(source.data_ptr())


@pytest.mark.live
def test_a_late_write_for_a_closed_pools_failed_room_never_lands_in_the_next_pools_slots(engines):
    """A pool is closed while a failed room's slot is in quarantine, and a new pool of the same size is
    made on the same engine (a manager restarted, say). The late write for the failed room, to the old
    slot's address, must not land in a slot the new pool leases: it is refused, as for any memory
    unregistered."""
    import gc

    from transfer.engine import TransferError

    encode_engine, prefill_engine = engines
    clock = FakeClock()
    size, slot_bytes = 64 << 20, 1 << 20  # large enough to be mapped afresh, as a real pool is
    late = torch.full((SLOT,), 0x5A, dtype=torch.uint8)
    encode_engine.register(late)
    try:
        old = ReceivePool(prefill_engine, size, slot_bytes, quarantine_s=300.0, clock=clock)
        failed = old.lease(SLOT)
        old_slot = failed.addr
        failed.fail()
        del failed
        old.close()
        del old
        gc.collect()
        clock.advance(1.0)
        with ReceivePool(prefill_engine, size, slot_bytes, quarantine_s=300.0, clock=clock) as new:
            leased = [new.lease(SLOT) for _ in range(new.slots)]
            for slot in leased:
                slot.view((slot_bytes,), torch.uint8).zero_()
            try:
                encode_engine.write(prefill_engine.session_id, [late.data_ptr()], [old_slot], [SLOT])
            except TransferError:
                pass  # refused: the address is registered no more
            written = [slot.index for slot in leased if int(slot.view((slot_bytes,), torch.uint8).count_nonzero())]
            assert written == [], f"the late write landed in the new pool's slots {written}, leased to new rooms"
    finally:
        encode_engine.unregister(late.data_ptr())


@pytest.mark.live
def test_an_idle_session_manager_still_drops_a_fallback_after_its_grace(engines):
    """Graces and quarantines are checked lazily, by lease() and stats(): a prefill rank that
    stops receiving after a burst of big items keeps their fallback buffers registered (and
    allocated) until its next receive()."""
    from transfer.bootstrap import BootstrapServer
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    encode_engine, prefill_engine = engines
    rows, hidden = 8, 64
    item = torch.randn(rows, hidden).to(torch.bfloat16)
    encode_engine.register(item)
    try:
        with BootstrapServer(HOST, 0) as server, \
                ReceivePool(prefill_engine, SLOT, SLOT, quarantine_s=0.2, grace_s=0.2) as slots, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=10) as manager:
            sender.send(1, item)
            big = manager.receive(1, server.address, rows=rows, hidden=hidden, dtype=BF16)
            assert big.wait(5) == TransferPoll.Success, big.failure
            assert torch.equal(big.rows.view(torch.uint8), item.view(torch.uint8))
            fallback = big.rows.data_ptr()
            assert fallback in prefill_engine.registered()
            big.clear()
            assert wait_until(lambda: fallback not in prefill_engine.registered(), 3.0), \
                "the fallback stayed registered 3 s past a 0.2 s grace"
    finally:
        encode_engine.unregister(item.data_ptr())


@pytest.mark.live
def test_concurrent_lease_release_and_fail_never_double_lease(engines):
    """Threads lease, release (at once, or after a copy-out event that completes on its second
    query) and fail slots and fallbacks of one pool: no slot is leased twice at a time, no call
    raises, and once the quarantines passed every slot is free and every fallback unregistered.
    The interpreter switches threads every microsecond, and each event's query yields, so the
    threads interleave inside the pool's critical sections unless its lock keeps them out."""
    _, engine = engines
    registered_before = set(engine.registered())
    clock = FakeClock()
    slots, threads, rounds = 8, 4, 1500
    pool = ReceivePool(engine, slots * SLOT, SLOT, quarantine_s=0.5, grace_s=0.2, clock=clock)
    owners: dict[int, int] = {}
    owners_lock = threading.Lock()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(rounds):
                slot = pool.lease_or_fallback(rng.choice((8, SLOT, SLOT * 2)))
                if not slot.is_fallback:
                    with owners_lock:
                        if slot.index in owners:
                            errors.append(f"slot {slot.index} leased by {owners[slot.index]} and {seed}")
                        owners[slot.index] = seed
                slot.view((8,), torch.uint8).fill_(seed)
                if not slot.is_fallback:
                    with owners_lock:
                        owners.pop(slot.index, None)
                rng.choice((slot.release, slot.fail, lambda s=slot: s.release(_DoneOnSecondQuery())))()
                if rng.random() < 0.3:
                    with owners_lock:  # one writer at a time: the fake clock only moves forward
                        clock.advance(0.05)
        except Exception as exc:  # reported by the main thread
            errors.append(f"worker {seed}: {exc!r}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(w.is_alive() for w in workers)
    assert errors == []
    clock.advance(10.0)
    pool.poll()  # an event's second query: a fallback it releases starts its grace now
    clock.advance(10.0)
    stats = pool.stats()
    assert (stats["free"], stats["leased"], stats["pending_events"], stats["quarantined"]) == (slots, 0, 0, 0), stats
    assert (stats["fallbacks_live"], stats["fallback_bytes"]) == (0, 0), stats
    assert set(engine.registered()) == registered_before | {pool.region.addr}
    pool.close()
    assert set(engine.registered()) == registered_before


class _DoneOnSecondQuery:
    """A copy-out event still running when the slot is released, complete when asked again;
    each query lets other threads run."""

    def __init__(self) -> None:
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        time.sleep(0)
        return self.queries > 1


@pytest.mark.live
def test_two_threads_releasing_one_slot_give_it_back_once(engines, monkeypatch):
    """release() and fail() on one handle from two threads: exactly one of them gives the slot
    back, the other is refused. Each thread, once it read the handle's state, waits there until
    the other is inside too (no lock: both saw it leased, and both give it back) or blocked on
    the pool's lock."""
    _, engine = engines
    clock = FakeClock()
    with ReceivePool(engine, SLOT, SLOT, clock=clock) as pool:
        for _ in range(20):
            slot = pool.lease(8)
            race = Race()
            monkeypatch.setattr(pool, "_lock", WatchedLock(pool._lock, race))
            pause_on_read(monkeypatch, Slot, "_state", race)

            def give_back(how: str, slot=slot) -> str:
                try:
                    getattr(slot, how)()
                    return how
                except SlotError:
                    return "refused"

            outcomes = run_racers(race, {how: lambda how=how: give_back(how) for how in ("release", "fail")})
            monkeypatch.undo()
            assert race.inside() == {"release", "fail"}  # both got to the check
            assert sorted(outcomes.values()) in (["fail", "refused"], ["refused", "release"]), outcomes
            clock.advance(QUARANTINE_S)
            stats = pool.stats()
            assert (stats["free"], stats["leased"], stats["quarantined"]) == (1, 0, 0), stats


@pytest.mark.live
def test_a_pooled_receive_refused_before_any_ask_keeps_no_slot(engines):
    from transfer.bootstrap import BootstrapServer
    from transfer.errors import ConfigError
    from transfer.receiver import SessionManager

    _, engine = engines
    with BootstrapServer(HOST, 0) as server, ReceivePool(engine, 4 * SLOT * 2, SLOT * 2) as pool, \
            SessionManager(engine, 0, 1, 1, pool=pool, host=HOST, deadline_s=30.0) as manager:
        manager.receive(1, server.address, rows=4, hidden=64, dtype=BF16)  # waits for an encode rank
        with pytest.raises(ConfigError, match=r"^room 2: shard \[2, 6\) outside the item's span 4$"):
            manager.receive(2, server.address, rows=4, hidden=64, dtype=BF16, row_start=2, span=4)
        with pytest.raises(ConfigError, match=r"^room 1 is already being received"):
            manager.receive(1, server.address, rows=4, hidden=64, dtype=BF16)
        for room, geometry in enumerate([dict(rows=4, hidden=64.0), dict(rows=4, hidden=64, deepstack_hidden=-4),
                                         dict(rows=4, hidden=-64, deepstack_hidden=128),
                                         dict(rows=4 * SLOT, hidden=64.0)], start=3):  # the last a fallback's size
            with pytest.raises(ConfigError, match=rf"^room {room}: \w+ must be a (non-negative|positive) integer"):
                manager.receive(room, server.address, dtype=BF16, **geometry)
        stats = pool.stats()
        assert (stats["leased"], stats["quarantined"], stats["free"]) == (1, 0, 3)
        assert (stats["fallbacks_live"], stats["fallback_bytes"]) == (0, 0)


def _layout(t: torch.Tensor) -> tuple:
    """Where a tensor's elements are and how they are laid out and typed."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


@pytest.mark.live
@pytest.mark.parametrize("dtype, span, hidden, row_start, rows, deepstack_hidden", [
    (torch.bfloat16, 4, 64, 0, 4, None),  # a slot's whole 512 bytes
    ("float32", 6, 16, 2, 3, None),
    ("torch.int8", 8, 24, 1, 5, 16),  # with deepstack rows
    (torch.bfloat16, 0, 8, 0, 0, None),  # no rows at all
    (torch.bfloat16, 4, 8, 2, 0, 4),  # none of the item's rows
    (torch.float32, 4, 64, 0, 4, None),  # 1 KiB: a fallback buffer's
    (torch.float16, 4, 64, 1, 2, 32),  # a fallback buffer's, with deepstack rows
])
def test_a_pooled_receives_rows_and_regions_are_its_leases_bytes_as_its_dtype(engines, dtype, span, hidden, row_start,
                                                                              rows, deepstack_hidden):
    """A pooled receive's rows (and deepstack rows) are its lease's first bytes viewed as the dtype and shaped
    [span, hidden], each shard the rows asked for, and its announced regions those that hold them; as the
    lease's bytes viewed as uint8 and cut read them, and as _regions_for() finds them."""
    from transfer.bootstrap import BootstrapServer
    from transfer.frames import DTYPE_BYTES, normalize_dtype
    from transfer.receiver import SessionManager

    _, engine = engines
    name = normalize_dtype(dtype)
    torch_dtype = getattr(torch, name.removeprefix("torch."))
    nbytes, ds_nbytes = span * hidden * DTYPE_BYTES[name], span * (deepstack_hidden or 0) * DTYPE_BYTES[name]
    with BootstrapServer(HOST, 0) as server, ReceivePool(engine, 4 * SLOT * 2, SLOT * 2) as pool, \
            SessionManager(engine, 0, 1, 1, pool=pool, host=HOST, deadline_s=30.0) as manager:
        for room in (1, 2):  # a fresh lease, then the same slot or fallback leased again
            handle = manager.receive(room, server.address, rows=rows, hidden=hidden, dtype=dtype, row_start=row_start,
                                     span=span, deepstack_hidden=deepstack_hidden)
            lease = handle._state.lease
            assert lease.is_fallback == (nbytes + ds_nbytes > SLOT * 2)
            flat = lease.view((nbytes + ds_nbytes,), torch.uint8)
            full = flat[:nbytes].view(torch_dtype).view(span, hidden)
            assert _layout(handle.rows) == _layout(full)
            shard = full[row_start:row_start + rows]
            ds_ptr = ds_shard_nbytes = 0
            if deepstack_hidden:
                full_ds = flat[nbytes:].view(torch_dtype).view(span, deepstack_hidden)
                assert _layout(handle.deepstack) == _layout(full_ds)
                ds_ptr = full_ds[row_start:row_start + rows].data_ptr()
                ds_shard_nbytes = rows * deepstack_hidden * DTYPE_BYTES[name]
            else:
                assert handle.deepstack is None
            spec = manager._driver.core._rooms[room].spec
            assert (spec.embedding_ptr, spec.deepstack_ptr) == (shard.data_ptr(), ds_ptr)
            assert spec.regions is manager._regions_for(room, shard.data_ptr(), rows * hidden * DTYPE_BYTES[name],
                                                        ds_ptr, ds_shard_nbytes, bool(deepstack_hidden), leased=True)
            handle.clear()  # never asked for: its memory is free at once, a slot back in the pool
            stats = pool.stats()
            assert (stats["free"], stats["leased"], stats["quarantined"]) == (4, 0, 0), stats


@pytest.mark.live
@pytest.mark.driver_dies
def test_a_pooled_receive_its_dead_manager_refuses_gives_its_slot_back_at_once(engines):
    """The manager's I/O thread stopped after an error: receive() raises before any ask can
    leave, so its slot is free again, not quarantined."""
    from transfer.bootstrap import BootstrapServer
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    def broken(now, limit=None, unread=False):
        raise RuntimeError("injected")

    _, engine = engines
    with BootstrapServer(HOST, 0) as server, ReceivePool(engine, 2 * SLOT * 2, SLOT * 2) as pool, \
            SessionManager(engine, 0, 1, 1, pool=pool, host=HOST, deadline_s=30.0) as manager:
        first = manager.receive(1, server.address, rows=4, hidden=64, dtype=BF16)
        manager._driver.core.tick = broken  # the I/O thread calls it on every turn
        manager._driver._waker.wake()
        # Room 1 may fail first on its own (no encode rank is registered): wait for the thread's end.
        assert wait_until(lambda: manager._driver.failure is not None, 5.0)
        assert first.wait(5) == TransferPoll.Failed
        with pytest.raises(RuntimeError, match="I/O thread stopped after an error"):
            manager.receive(2, server.address, rows=4, hidden=64, dtype=BF16)
        stats = pool.stats()
        assert (stats["leased"], stats["quarantined"], stats["free"]) == (1, 0, 1)


@pytest.mark.live
def test_a_fallback_whose_cancel_is_never_confirmed_is_freed_after_its_quarantine(engines):
    """Room 1 asks into a fallback buffer, its encode rank goes away, and the room is cleared:
    no cancel confirmation will ever come. Once the quarantine passed, the pool retires the
    fallback and nothing of the manager's keeps its memory allocated."""
    import gc
    import weakref

    from transfer.bootstrap import BootstrapServer
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    encode_engine, prefill_engine = engines
    rows, hidden = 8, 64  # 1 KiB: more than a slot, so a fallback
    with BootstrapServer(HOST, 0) as server, \
            ReceivePool(prefill_engine, SLOT, SLOT, quarantine_s=0.3, grace_s=0) as slots, \
            SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=30) as manager:
        with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST):
            handle = manager.receive(1, server.address, rows=rows, hidden=hidden, dtype=BF16)
            assert wait_until(lambda: handle.poll() == TransferPoll.WaitingForInput, 5.0)
        fallback = handle.rows.data_ptr()
        memory = weakref.ref(handle._state.lease.region.tensor)
        handle.clear()
        assert not handle.safe_to_reuse
        del handle
        assert wait_until(lambda: fallback not in prefill_engine.registered(), 5.0), \
            "the fallback stayed registered 5 s past a 0.3 s quarantine"
        assert wait_until(lambda: gc.collect() >= 0 and memory() is None, 5.0), \
            "the retired fallback's memory is still referenced"
        assert slots.stats()["fallback_bytes"] == 0


@pytest.mark.live
def test_a_handle_dropped_without_clear_warns_that_its_slot_stays_held(engines):
    import gc
    import warnings

    from transfer.bootstrap import BootstrapServer
    from transfer.receiver import SessionManager

    _, engine = engines
    with BootstrapServer(HOST, 0) as server, ReceivePool(engine, 2 * SLOT * 2, SLOT * 2) as pool, \
            SessionManager(engine, 0, 1, 1, pool=pool, host=HOST, deadline_s=30.0) as manager:
        cleared = manager.receive(1, server.address, rows=4, hidden=64, dtype=BF16)
        cleared.clear()
        dropped = manager.receive(2, server.address, rows=4, hidden=64, dtype=BF16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del cleared, dropped
            gc.collect()
        messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert messages == ["room 2's handle was dropped without clear(): the session manager keeps the room "
                            "and its pool slot until it closes"], messages
        assert pool.stats()["leased"] == 1


@pytest.mark.live
def test_a_metrics_scrape_leaves_unregistering_a_fallback_to_the_managers_thread():
    """A scrape (the manager's stats(), on a thread of its own) reads the pool's gauges without doing its
    work: the fallback past its grace is unregistered by the manager's thread, not the scraper."""
    from transfer.engine import Engine
    from transfer.receiver import SessionManager

    class RecordingThreads(Engine):
        """A real engine that notes which thread unregistered each region."""

        unregistered: list[tuple[int, str]] = []

        def unregister(self, addr: int) -> None:
            self.unregistered.append((addr, threading.current_thread().name))
            super().unregister(addr)

    clock = FakeClock()
    with RecordingThreads(HOST, "tcp") as engine, \
            ReceivePool(engine, SLOT, SLOT, grace_s=1.0, clock=clock) as pool, \
            SessionManager(engine, 0, 1, 1, pool=pool, host=HOST, deadline_s=30.0) as manager:
        big = pool.lease_or_fallback(SLOT * 2)
        big.release()
        clock.advance(1.0)  # past its grace: the next poll unregisters it
        rows: list = []
        scraper = threading.Thread(target=lambda: rows.extend(manager.stats()), name="scraper")
        scraper.start()
        scraper.join(10)
        assert [r["value"] for r in rows if r["name"] == "epd_prefill_fallback_bytes"] in ([SLOT * 2], [0])
        assert wait_until(lambda: big.addr not in engine.registered(), 10)
        threads = [name for addr, name in engine.unregistered if addr == big.addr]
    assert threads and "scraper" not in threads, threads


@pytest.mark.live
def test_a_closed_managers_fallback_is_freed_once_the_pool_drops_it(engines):
    """close() gives a room's fallback back as clear() would: once its grace passed the pool unregisters
    it, and its memory is freed then, while the closed manager (and the room's handle, cleared) lives on."""
    import gc
    import socket
    import weakref

    from transfer.receiver import SessionManager

    _, prefill_engine = engines
    rows, hidden = 8, 64
    nobody = socket.socket()
    nobody.bind((HOST, 0))  # bound, never listening: the look-up is refused, no ask leaves
    try:
        with ReceivePool(prefill_engine, SLOT, SLOT, quarantine_s=0.2, grace_s=0.2) as slots:
            manager = SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=60)
            with manager:
                big = manager.receive(1, f"{HOST}:{nobody.getsockname()[1]}", rows=rows, hidden=hidden,
                                      dtype=BF16)
                fallback = big.rows.data_ptr()
                assert fallback in prefill_engine.registered()
                (memory,) = [weakref.ref(region.tensor) for region in slots._fallbacks.values()]
            big.clear()
            del big
            assert wait_until(lambda: slots.poll() or fallback not in prefill_engine.registered(), 5.0), \
                "the fallback stayed registered 5 s past a 0.2 s grace"
            gc.collect()
            assert memory() is None, "the closed session manager keeps its room's fallback buffer allocated"
            assert manager._closed  # alive until here
    finally:
        nobody.close()

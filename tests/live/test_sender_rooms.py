"""The encode side's sender pool: races between the caller's threads and the
pool's thread, rooms that concluded but were told otherwise, and registrations left behind.

Real Mooncake engines (protocol tcp on loopback), real ZMQ and the real bootstrap server
throughout. Where a race needs a precise interleaving, the pool's own dict of parked asks
is swapped for one that runs the caller's clear() at the exact step the race needs (the
pool's thread looks the dict up afresh on every use), so the test is deterministic.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from live_helpers import (
    DTYPE,
    HIDDEN,
    HOST,
    ITEM,
    LIVE,
    SENTINEL,
    SPAN,
    RawPrefill,
    item_bytes,
    item_tensor,
    stopped_peer,
    wait_until,
)

from transfer.engine import TransferError
from transfer.errors import EngineError, UsageError
from transfer.frames import TransferInfo, registration_frames
from transfer.metrics import total
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

@pytest.fixture
def peer(engines):
    """A prefill stand-in with 16 items of registered receive memory, per test."""
    _, prefill = engines
    raws: list[RawPrefill] = []

    def connect(pool: SenderPool) -> RawPrefill:
        raw = RawPrefill(prefill, pool.host, pool.port, 16 * ITEM)
        raws.append(raw)
        return raw

    yield connect
    for raw in raws:
        raw.close()


def _clear_as_the_ask_arrives(pool: SenderPool, handle) -> None:
    """Runs the caller's clear() once, just before the pool's thread files the next ask: the
    clear reaches the driver after the ask completed the room's fanout."""
    ask = pool._core.ask

    def hooked(info, now):
        if hooked.armed:
            hooked.armed = False
            handle.clear()
        return ask(info, now)

    hooked.armed = True
    pool._core.ask = hooked


def _status(raw: RawPrefill, timeout: float = 5.0) -> list[bytes] | None:
    """The next status's first three parts (room, status, rank), or None."""
    got = raw.statuses(1, timeout)
    return got[0][:3] if got else None


def _spy_statuses(pool: SenderPool) -> list[list[bytes]]:
    """Records every status the pool pushes from now on (they are still sent)."""
    pushed: list[list[bytes]] = []
    send = pool._driver.statuses.send

    def spy(endpoint: str, port: int, frames: list[bytes]) -> bool:
        pushed.append(list(frames))
        return send(endpoint, port, frames)

    pool._driver.statuses.send = spy
    return pushed


# ------------------------------------------------------------- wrong statuses


def test_a_stale_clear_after_the_room_was_sent_again_tells_its_receiver_nothing(engines, server, peer):
    """clear() on the handle of a room that succeeded, after the room was cleared and sent
    again, must not push Failed for that room number: the receiver asking for the new
    item would fail it (Failed is sticky on the wire)."""
    encode, _ = engines
    with SenderPool(encode, 0, 1, 1, server.address) as pool:
        raw = peer(pool)
        first = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        raw.ask(1, raw.base, SPAN, HIDDEN, SPAN)
        assert _status(raw) == [b"1", b"5", b"0"]
        assert first.wait(5) == TransferPoll.Success
        first.clear()
        second = pool.send(1, item_tensor(2, SPAN, HIDDEN))
        first.clear()  # again, by mistake: it was concluded and cleared long ago
        raw.ask(1, raw.base + ITEM, SPAN, HIDDEN, SPAN)
        assert _status(raw) == [b"1", b"5", b"0"]
        assert second.wait(5) == TransferPoll.Success
        assert bytes(raw.buffer[ITEM:2 * ITEM].numpy()) == bytes(item_bytes(2, ITEM))


def test_a_cleared_send_handle_never_reports_the_room_that_reused_its_number(engines, server, peer):
    """An old handle kept by mistake reads Failed (no reason) once cleared, not the status of
    the item sent later under the same room number; nor does its wait() block."""
    encode, _ = engines
    with SenderPool(encode, 0, 1, 1, server.address) as pool:
        raw = peer(pool)
        first = pool.send(7, item_tensor(1, SPAN, HIDDEN))
        first.clear()  # before any ask: it fails "cleared before it concluded"
        assert first.poll() == TransferPoll.Failed and first.failure is None
        second = pool.send(7, item_tensor(2, SPAN, HIDDEN))
        assert second.poll() == TransferPoll.WaitingForInput
        assert first.poll() == TransferPoll.Failed and first.failure is None
        # Asked to wait up to 600 s, it returns Failed at once: before room 7's new item concludes (it is
        # not asked for until then), which a wait on the room number rather than the handle would wait for.
        waited: list = []
        waiter = threading.Thread(target=lambda: waited.append(first.wait(600.0)), daemon=True)
        waiter.start()
        assert wait_until(lambda: not waiter.is_alive(), 30.0), "the cleared handle's wait() blocked"
        assert waited == [TransferPoll.Failed] and second.poll() == TransferPoll.WaitingForInput
        raw.ask(7, raw.base, SPAN, HIDDEN, SPAN)
        assert second.wait(5) == TransferPoll.Success
        assert first.poll() == TransferPoll.Failed


@pytest.mark.parametrize("stop", [pytest.param("thread fails", marks=pytest.mark.driver_dies), "close"])
def test_rooms_that_succeeded_are_not_told_failed_when_the_pool_stops(engines, server, peer, stop):
    """A room concluded Success (not cleared yet) keeps its receivers' Success when the pool's
    thread fails or the pool closes: neither pushes Failed for it."""
    encode, _ = engines
    pool = SenderPool(encode, 0, 1, 1, server.address)
    try:
        raw = peer(pool)
        done = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        raw.ask(1, raw.base, SPAN, HIDDEN, SPAN)
        assert _status(raw) == [b"1", b"5", b"0"]
        assert done.wait(5) == TransferPoll.Success
        pushed = _spy_statuses(pool)
        if stop == "thread fails":
            def broken(offer, now):
                raise RuntimeError("injected")

            pool._core.offer = broken  # the thread fails on the next item
            other = pool.send(2, item_tensor(2, SPAN, HIDDEN))
            assert other.wait(5) == TransferPoll.Failed
            assert wait_until(lambda: not pool._thread.is_alive(), 5.0)
        pool.close()
        assert [f for f in pushed if f[0] == b"1"] == [], pushed
        assert raw.statuses(1, 0.5) == []
        assert done.poll() == TransferPoll.Success
    finally:
        pool.close()


# ------------------------------------------------------------------- races


def test_a_clear_racing_the_dispatch_still_tells_every_receiver_failed(engines, server, peer):
    """The caller's clear() lands as the ask that completes the room's fanout is filed: the
    receivers must still be told Failed, and nothing is written."""
    encode, _ = engines
    with SenderPool(encode, 0, 1, 1, server.address) as pool:
        raw = peer(pool)
        rows = item_tensor(1, SPAN, HIDDEN)
        handle = pool.send(1, rows)
        _clear_as_the_ask_arrives(pool, handle)
        raw.ask(1, raw.base, SPAN, HIDDEN, SPAN)
        assert _status(raw) == [b"1", b"0", b"0"]
        assert raw.untouched()
        # The counts are the engine's, which every pool on it shares: this room's source is what goes.
        assert wait_until(lambda: rows.data_ptr() not in pool._sources.counts.counts(), 5.0)


def _clear_as_the_sweep_runs(pool: SenderPool, handle) -> None:
    """Runs the caller's clear() once, just before the first tick past the fanout timeout."""
    tick = pool._core.tick
    due = time.monotonic() + pool.fanout_timeout_s

    def hooked(now, unread=False):
        if hooked.armed and now >= due:
            hooked.armed = False
            handle.clear()
        return tick(now, unread)

    hooked.armed = True
    pool._core.tick = hooked


def test_a_clear_racing_the_parked_sweep_still_tells_the_receivers_that_asked(engines, server, peer):
    """A parked room (half its fanout asked) times out while the caller clears it: the
    receiver that asked must be told Failed either way."""
    encode, _ = engines
    with SenderPool(encode, 0, 1, 1, server.address, fanout_timeout_s=0.3) as pool:
        raw = peer(pool)
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        _clear_as_the_sweep_runs(pool, handle)
        raw.ask(1, raw.base, 2, HIDDEN, SPAN, fanout=2)  # the other half never asks
        assert _status(raw) == [b"1", b"0", b"0"]
        assert raw.untouched()


def test_a_send_racing_close_is_refused_and_registers_nothing(engines, server):
    """close() from another thread while send() is registering the source: the room must not
    be left WaitingForInput forever with its source registered."""
    encode, _ = engines
    pool = SenderPool(encode, 0, 1, 1, server.address)
    hold = pool._hold_registered

    def close_meanwhile(*regions):
        pool.close()  # the caller's other thread closes the pool right now
        return hold(*regions)

    pool._hold_registered = close_meanwhile
    rows = item_tensor(1, SPAN, HIDDEN)
    try:
        with pytest.raises(UsageError, match="sender pool is closed"):
            pool.send(1, rows)
        assert rows.data_ptr() not in encode.registered()
        assert not pool._book.held and rows.data_ptr() not in pool._sources.counts.counts()
    finally:
        pool.close()


def test_a_ready_event_the_pool_cannot_poll_is_refused_by_send_and_registers_nothing(engines, server):
    """The pool's one thread polls a ready event with query(); one it could only wait on (a
    threading.Event, or an object with synchronize() alone) would fail late or hold every room."""
    from transfer.errors import ConfigTypeError

    class WaitOnly:
        def synchronize(self) -> None:
            time.sleep(3)

    encode, _ = engines
    rows = item_tensor(1, SPAN, HIDDEN)
    with SenderPool(encode, 0, 1, 1, server.address) as pool:
        for event in (threading.Event(), WaitOnly()):
            with pytest.raises(ConfigTypeError, match=rf"^room 1: ready_event must have query\(\) .*"
                                                      rf"got {type(event).__name__}$"):
                pool.send(1, rows, ready_event=event)
        assert rows.data_ptr() not in encode.registered()
        assert not pool._book.held


def test_a_second_close_returns_only_once_the_pool_is_closed(engines, server, peer):
    """The first close() lingers up to a second on a Failed owed to a receiver nobody listens
    for; a close() from another thread meanwhile returns only once the pool's thread is gone,
    since its caller may close the engine next."""
    encode, _ = engines
    pool = SenderPool(encode, 0, 1, 1, server.address)
    raw = peer(pool)
    pool.send(1, item_tensor(1, SPAN, HIDDEN))
    parts = raw.ask(1, raw.base, SPAN // 2, HIDDEN, SPAN, fanout=2)
    # The other half's ask names a status port nobody listens on.
    raw.push.send_multipart([parts[0], parts[1], b"9", *parts[3:11], str(SPAN // 2).encode(), parts[12]])
    time.sleep(0.2)  # both asks read
    first = threading.Thread(target=pool.close)
    first.start()
    try:
        time.sleep(0.05)
        pool.close()
        assert not pool._thread.is_alive(), "close() returned with the pool's thread still running"
    finally:
        first.join(10)


def test_a_late_ask_for_a_failed_room_is_told_failed_at_once(engines, server, peer):
    """A receiver that asks after its room failed (here: nobody asked in time) hears Failed
    right away, not only once the caller cleared the room and a fanout timeout passed."""
    encode, _ = engines
    with SenderPool(encode, 0, 1, 1, server.address, fanout_timeout_s=0.3) as pool:
        raw = peer(pool)
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        assert handle.wait(5) == TransferPoll.Failed
        raw.ask(1, raw.base, SPAN, HIDDEN, SPAN)
        assert _status(raw, 2.0) == [b"1", b"0", b"0"]
        assert raw.untouched() and handle.poll() == TransferPoll.Failed
        assert 1 not in pool._core.parked


def test_a_room_that_failed_unasked_is_not_counted_as_parked(engines, server):
    """The parked_rooms gauge counts items still waiting for receivers, not failed ones."""
    encode, _ = engines
    with SenderPool(encode, 0, 1, 1, server.address, fanout_timeout_s=0.3) as pool:
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        assert total(pool.stats(), "epd_encode_parked_rooms") == 1
        assert handle.wait(5) == TransferPoll.Failed
        assert total(pool.stats(), "epd_encode_parked_rooms") == 0


def _junk_flooder(host: str, port: int) -> subprocess.Popen:
    """A process that pushes one-byte junk messages to host:port without pause (at most 60 s)."""
    code = ("import time, zmq\n"
            "s = zmq.Context().socket(zmq.PUSH); s.setsockopt(zmq.LINGER, 0)\n"
            f"s.connect('tcp://{host}:{port}')\n"
            "end = time.monotonic() + 60\n"
            "while time.monotonic() < end:\n"
            "    s.send(b'x')\n")
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_peer_that_never_stops_sending_cannot_stall_the_other_rooms(engines, server, peer):
    """One peer pushes junk without pause: the pool's thread still gets to start and settle
    other rooms' writes (and to close), instead of draining its socket forever."""
    encode, _ = engines
    pool = SenderPool(encode, 0, 1, 1, server.address)
    flooder = _junk_flooder(pool.host, pool.port)
    try:
        raw = peer(pool)
        time.sleep(1.0)  # the flood is on
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        raw.ask(1, raw.base, SPAN, HIDDEN, SPAN)
        assert handle.wait(10) == TransferPoll.Success, handle.poll()
        assert _status(raw) == [b"1", b"5", b"0"]
        pool.close()
        assert not pool._thread.is_alive()  # close() returned once its thread ended, not at its join's bound
    finally:
        flooder.kill()
        flooder.wait(10)
        pool.close()


# --------------------------------------------------- temporary registrations


def test_a_source_that_fails_to_register_leaves_no_other_registration_behind(engines, server):
    """send() registers the embedding rows, then the deepstack rows cannot be registered: the
    call fails and the embedding rows' temporary registration is dropped again."""
    encode, _ = engines
    arena = torch.zeros(2 * SPAN, HIDDEN * 2, dtype=torch.bfloat16)
    encode.register(arena[:SPAN])  # the caller's own registration of the first half
    rows = item_tensor(1, SPAN, HIDDEN)
    try:
        with SenderPool(encode, 0, 1, 1, server.address) as pool:
            deepstack = arena.view(-1)[: SPAN * HIDDEN * 4].view(SPAN, HIDDEN * 4)  # starts there, runs past it
            with pytest.raises(TransferError, match="already registered"):
                pool.send(1, rows, deepstack)
            assert rows.data_ptr() not in encode.registered()
            assert rows.data_ptr() not in pool._sources.counts.counts() and not pool._book.held
    finally:
        encode.unregister(arena.data_ptr())


def test_a_source_overlapping_another_rooms_temporary_registration_is_refused_with_the_way_out(engines, server):
    """Rows 2..5 of a buffer given by address while room 1 sends rows 0..3 of it: the pool
    registered room 1's rows alone, and the engine registers no byte twice. The send is
    refused naming the registration in the way and what to do instead; room 1 keeps it."""
    encode, _ = engines
    rows = item_tensor(1, 2 * SPAN, HIDDEN)
    with SenderPool(encode, 0, 1, 1, server.address) as pool:
        first = pool.send(1, rows.data_ptr(), span=SPAN, hidden=HIDDEN, dtype=DTYPE)
        with pytest.raises(EngineError, match=rf"^source {rows.data_ptr() + ITEM // 2:#x} \({ITEM} bytes\) overlaps "
                                              rf"memory already registered at {rows.data_ptr():#x} \({ITEM} bytes, a "
                                              rf"temporary registration held for another room's source\) .*"
                                              rf"register one region that holds the whole source"):
            pool.send(2, rows.data_ptr() + ITEM // 2, span=SPAN, hidden=HIDDEN, dtype=DTYPE)
        assert encode.registered() == {rows.data_ptr(): ITEM} and 2 not in pool._book.held
        first.clear()
        assert wait_until(lambda: encode.registered() == {}, 5.0)


def test_a_source_inside_another_rooms_temporary_registration_keeps_it_until_done(engines, server, peer):
    """Room 2's rows lie inside room 1's rows, which the pool registered for room 1: room 1
    concluding must not drop the registration room 2 still reads from."""
    encode, _ = engines
    whole = item_tensor(1, 2 * SPAN, HIDDEN)
    with SenderPool(encode, 0, 1, 1, server.address) as pool:
        raw = peer(pool)
        first = pool.send(1, whole)
        second = pool.send(2, whole[SPAN:])  # the second half of the same rows
        raw.ask(1, raw.base, 2 * SPAN, HIDDEN, 2 * SPAN)
        assert _status(raw) == [b"1", b"5", b"0"]
        assert first.wait(5) == TransferPoll.Success
        first.clear()
        raw.ask(2, raw.base + 2 * ITEM, SPAN, HIDDEN, SPAN)
        assert _status(raw) == [b"2", b"5", b"0"]
        assert second.wait(5) == TransferPoll.Success, second.failure
        assert bytes(raw.buffer[2 * ITEM:3 * ITEM].numpy()) == bytes(item_bytes(1, 2 * ITEM))[ITEM:]
        second.clear()
        assert wait_until(lambda: whole.data_ptr() not in encode.registered(), 5.0)
        assert whole.data_ptr() not in pool._sources.counts.counts()


def test_close_drops_the_registration_of_a_cleared_room_whose_write_never_started(engines, server, peer):
    """Room 2 waits for a free slot behind room 1's stuck write and is cleared; once room 1's
    write settles, close() must still drop room 2's temporary source registration."""
    from transfer import _io

    encode, _ = engines
    stuck, session, landing = stopped_peer(encode)
    big = torch.ones(64 << 20, dtype=torch.uint8).view(torch.bfloat16).view(8192, 4096)
    rows = item_tensor(2, SPAN, HIDDEN)
    resume = threading.Timer(1.0, os.kill, (stuck.pid, signal.SIGCONT))
    try:
        pool = SenderPool(encode, 0, 1, 1, server.address, depth=1)
        raw = peer(pool)
        statuses, status_port = _io.pull_socket(HOST, 0)
        asks = _io.push_socket(pool.host, pool.port)
        try:
            asks.send_multipart(registration_frames(HOST, status_port, session, landing, 0, 64 << 20, 0))
            asks.send_multipart(TransferInfo(1, HOST, status_port, session, landing, 0, 8192, 4096, DTYPE,
                                             False, 1, 0, 8192).to_frames())
            first = pool.send(1, big)
            assert wait_until(lambda: first.poll() == TransferPoll.Transferring, 10.0)
            second = pool.send(2, rows)
            raw.ask(2, raw.base, SPAN, HIDDEN, SPAN)
            assert wait_until(lambda: second.poll() == TransferPoll.Transferring, 10.0)
            assert rows.data_ptr() in encode.registered()
            second.clear()  # still waiting behind room 1: nothing of it was ever submitted
            resume.start()
            pool.close()
            assert not pool._thread.is_alive()
            assert rows.data_ptr() not in encode.registered()
            assert big.data_ptr() not in encode.registered()
            assert not {rows.data_ptr(), big.data_ptr()} & pool._sources.counts.counts().keys()
        finally:
            asks.close(0)
            statuses.close(0)
            pool.close()
    finally:
        resume.cancel()
        os.kill(stuck.pid, signal.SIGCONT)
        stuck.kill()
        stuck.wait(10)


# ------------------------------------------------------------------- close


class _NeverReady:
    """A ready event whose producer never finishes (query() stays False)."""

    def query(self) -> bool:
        return False


def test_close_tells_receivers_of_parked_asks_failed(engines, server, peer):
    """Receivers that asked for rooms the pool still holds as parked asks (half a fanout, or an
    item never sent) are told Failed by close(): a peer has no deadline of its own."""
    encode, _ = engines
    pool = SenderPool(encode, 0, 1, 1, server.address)
    try:
        raw = peer(pool)
        pool.send(1, item_tensor(1, SPAN, HIDDEN))
        raw.ask(1, raw.base, 2, HIDDEN, SPAN, fanout=2)  # half the fanout
        raw.ask(2, raw.base + ITEM, SPAN, HIDDEN, SPAN)  # an item never sent
        assert wait_until(lambda: sorted(pool._core.parked) == [1, 2], 5.0)
        pushed = _spy_statuses(pool)
        pool.close()
        assert sorted(f[:2] for f in pushed) == [[b"1", b"0"], [b"2", b"0"]], pushed
    finally:
        pool.close()


def test_close_delivers_the_failed_statuses_it_pushes(engines, server, peer):
    """close() fails rooms whose writes wait on a ready event: each receiver (a status endpoint
    of its own) must actually get its Failed, not have it discarded with the status socket."""
    encode, _ = engines
    pool = SenderPool(encode, 0, 1, 1, server.address)
    try:
        raws = [peer(pool) for _ in range(8)]
        handles = []
        for room, raw in enumerate(raws, start=1):
            handles.append(pool.send(room, item_tensor(room, SPAN, HIDDEN), ready_event=_NeverReady()))
            raw.ask(room, raw.base, SPAN, HIDDEN, SPAN)
        assert wait_until(lambda: all(h.poll() == TransferPoll.Transferring for h in handles), 5.0)
        pool.close()
        deadline = time.monotonic() + 3.0
        heard = [_status(raw, max(0.0, deadline - time.monotonic())) for raw in raws]
        assert heard == [[str(room).encode(), b"0", b"0"] for room in range(1, 9)]
        assert all(raw.untouched() for raw in raws)
    finally:
        pool.close()


class _NeverReady:
    """A ready event (CUDA-event-like) that never completes; counts how often it is asked."""

    def __init__(self) -> None:
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return False


def test_a_ready_event_that_never_completes_fails_its_room_within_the_fanout_timeout(engines, server, peer):
    """A producer that never finishes must not hang its room (or its receiver) for ever, and
    waiting on it must back off like polling a write instead of waking thousands of times a second."""
    encode, _ = engines
    pool = SenderPool(encode, 0, 1, 1, server.address, fanout_timeout_s=1.5)
    try:
        raw = peer(pool)
        event = _NeverReady()
        started = time.monotonic()
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN), ready_event=event)
        raw.ask(1, raw.base, SPAN, HIDDEN, SPAN)
        assert handle.wait(10.0) == TransferPoll.Failed
        waited = time.monotonic() - started
        assert "its ready event did not complete within 1.5s" in handle.failure, handle.failure
        assert _status(raw) == [b"1", b"0", b"0"]  # the receiver is told, not left waiting
        assert bool((raw.buffer[:ITEM] == SENTINEL).all())  # nothing was written
        # Polled at most every POLL_MAX_S (1 ms) once backed off, not thousands of times a second.
        assert event.queries / waited < 1600, (event.queries, waited)
    finally:
        pool.close()


def test_send_after_close_raises_the_usage_error_every_closed_component_raises(engines, server):
    encode, _ = engines
    pool = SenderPool(encode, 0, 1, 1, server.address)
    pool.close()
    with pytest.raises(UsageError, match=r"^sender pool is closed: its close\(\) ran \(called, or its with "
                                          r"block ended\); start a new SenderPool to send more$"):
        pool.send(1, item_tensor(1, SPAN, HIDDEN))


class _HeldWrites:
    """A real engine whose writes to receivers are held in flight (submitted, never done) until
    released: write slots fill as they would behind receivers that stopped reading."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.submitted: list[str] = []
        self.released = False

    def write_async(self, session_id, srcs, dsts, lengths) -> int:
        self.submitted.append(session_id)
        return len(self.submitted)

    def poll(self, ticket: int) -> bool:
        return self.released

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_burst_of_items_for_rooms_already_asked_starts_every_write(engines, server):
    """Asks parked for 400 rooms across 8 receivers, then their items all posted before the pool's
    thread takes the first: with write slots for all of them, every write starts and the thread
    lives (taking each item while the last one's writes start must not nest)."""
    import zmq

    encode, _ = engines
    rooms, receivers = 400, 8
    source = item_tensor(1, rooms * SPAN, HIDDEN).view(rooms, SPAN, HIDDEN)
    encode.register(source)
    engine = _HeldWrites(encode)
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        with SenderPool(engine, 0, 1, 1, server.address, host=HOST, depth=rooms) as pool:
            push.connect(f"tcp://{HOST}:{pool.port}")
            for room in range(rooms):
                rank = room % receivers
                push.send_multipart(TransferInfo(room, HOST, 20000 + rank, f"{HOST}:{7000 + rank}",
                                                 0x100000 * (room + 1), 0, SPAN, HIDDEN, DTYPE, False, 1, 0,
                                                 SPAN).to_frames())
            assert wait_until(lambda: len(pool._core.parked) == rooms, 10), "the asks were not all parked"
            driver = pool._driver
            wake = driver.waker.wake
            driver.waker.wake = lambda: None  # the items queue up until the thread's next turn
            handles = [pool.send(room, source[room]) for room in range(rooms)]
            driver.waker.wake = wake
            wake()
            assert wait_until(lambda: len(engine.submitted) == rooms or not pool._thread.is_alive(), 30)
            assert pool._thread.is_alive(), [h.failure for h in handles[:1]]
            assert sorted(engine.submitted) == sorted(f"{HOST}:{7000 + room % receivers}" for room in range(rooms))
            assert all(h.poll() is TransferPoll.Transferring for h in handles)
            engine.released = True
            assert wait_until(lambda: all(h.poll() is TransferPoll.Success for h in handles), 30)
            for handle in handles:
                handle.clear()
    finally:
        push.close(linger=0)
        encode.unregister(source.data_ptr())


def test_a_source_the_caller_drops_right_after_send_lands_exactly_and_goes_at_clear(engines, server):
    """send() copies nothing and the caller may drop its tensor at once: the pool keeps it alive, reads it once
    the receiver asks (well after the caller let go, another tensor allocated meanwhile), and lets go of it
    once the room is cleared."""
    import gc
    import weakref

    from transfer.receiver import SessionManager

    encode, prefill = engines
    for dtype in ("torch.float16", "torch.bfloat16", "torch.float32", "torch.int8"):
        want = item_tensor(1, SPAN, HIDDEN, dtype)
        src = want.clone()
        slot = torch.zeros_like(want)
        with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool, \
                SessionManager(prefill, 0, 1, 1, buffer=slot, host=HOST) as manager:
            handle = pool.send(1, src)
            kept = weakref.ref(src)
            del src
            gc.collect()
            assert kept() is not None
            scratch = [torch.full_like(want, 7) for _ in range(8)]  # what the freed memory would hold
            ask = manager.receive(1, server.address, slot)
            assert ask.wait(10.0) == TransferPoll.Success, ask.failure
            assert handle.wait(10.0) == TransferPoll.Success, handle.failure
            assert torch.equal(slot.view(torch.uint8), want.view(torch.uint8)), dtype
            ask.clear()
            handle.clear()
            assert wait_until(lambda: gc.collect() >= 0 and kept() is None, 5.0), dtype
            del scratch

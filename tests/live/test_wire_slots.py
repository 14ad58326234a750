"""Two ways one bad peer must not lock others out of the framed-wire data path.

- Listener slots: a fresh connection has the first-byte bound (10 s by default) to begin its first
  transfer; after that it is closed with a reason, counted as `silent`, and its slot is free. Held
  for the whole idle timeout (300 s by default), a handful of silent connections would answer every
  real sender "listener busy" for five minutes. A connection that already carried a transfer keeps
  the idle timeout (a pooled sender connection sits idle between items).
- Sender writers: each peer session of WireEngine has its own queue and at most WRITERS_PER_PEER of
  its writes running at once, so writes to a peer that stopped reading cannot hold every writer
  and keep writes to healthy peers waiting for the stalled ones' reply timeouts.

Every wait here is bounded."""

from __future__ import annotations

import math
import os
import re
import socket
import threading
import time

import numpy as np
import pytest
import torch

from wire_bytes import transfer_bytes

from transfer import _native, wire
from transfer.engine import TransferError
from transfer.wire import FrameError, Msg
from transfer.wire_engine import WRITERS_PER_PEER, WireEngine, _WriterPool

PAGE = 4096
DEFAULT_RATE = 256 * 1024.0  # the listener's default least average rate, bytes/s
SILENT = (r"^read: nothing received within {:.2f} s of connecting \(the first-byte bound\); "
          r"connection closed$")


def wait_for(predicate, limit: float, step: float = 0.01) -> bool:
    """Polls predicate until it holds or limit seconds pass; whether it held."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def good_transfer(sock: socket.socket, dest: int, data: bytes) -> None:
    """Sends a whole transfer on sock and checks the RESULT."""
    sock.sendall(transfer_bytes(dest, data))
    kind, payload, _ = wire.read_frame(sock)
    assert kind == wire.RESULT, Msg.decode(payload)
    assert Msg.decode(payload) == Msg({"bytes": len(data), "room": 7})


def connect(port: int) -> socket.socket:
    """A raw loopback connection; every wait on it is bounded by 15 s."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def expect_silent_close(sock: socket.socket, bound: float) -> str:
    """Reads the listener's ERROR for a silent connection (no room), then its orderly close."""
    kind, payload, _ = wire.read_frame(sock)
    answer = Msg.decode(payload)
    assert kind == wire.ERROR, (kind, answer)
    assert answer.get("room") is None
    reason = answer.body.decode()
    assert re.match(SILENT.format(bound), reason), reason
    with pytest.raises(FrameError, match="connection closed"):
        wire.read_frame(sock)
    return reason


class Raw:
    """A raw native listener (loopback, ephemeral port) with one registered page."""

    def __init__(self, recv: float, idle: float, conns: int, first_byte: float | None,
                 evict_after: float = 1.0) -> None:
        extra = () if first_byte is None else (DEFAULT_RATE, -1.0, first_byte)
        self.handle = _native.wire_listen("127.0.0.1", 0, recv, idle, PAGE, conns, *extra, evict_after=evict_after)
        self.port = _native.wire_listener_port(self.handle)
        self.memory = np.zeros(PAGE, dtype=np.uint8)
        self.base = self.memory.ctypes.data
        _native.wire_add_region(self.handle, self.base, PAGE)

    def stats(self) -> dict:
        """The listener's counters."""
        return _native.wire_listener_stats(self.handle)

    def close(self) -> None:
        """Stops and joins the listener's threads."""
        _native.wire_listener_close(self.handle)

    def __enter__(self) -> Raw:
        """Context-manager entry."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on exit."""
        self.close()


# ------------------------------------------------------------------ listener: silent connections


def test_silent_connections_lose_their_slots_at_the_first_byte_bound():
    """Two silent connections fill both slots (a third is busy); at the 0.5 s first-byte bound each
    reads a reason and a clean close, the slots free up, and a real transfer is served, long before
    the idle timeout (60 s here). Eviction is off (a negative evict_after),
    else the third would close a silent one for itself: this is the first-byte bound alone."""
    with Raw(recv=5.0, idle=60.0, conns=2, first_byte=0.5, evict_after=-1.0) as lst:
        started = time.monotonic()
        silent = [connect(lst.port) for _ in range(2)]
        try:
            assert wait_for(lambda: lst.stats()["active"] == 2, 5)
            with connect(lst.port) as extra:
                kind, payload, _ = wire.read_frame(extra)
                assert (kind, Msg.decode(payload).body) == (wire.ERROR, b"listener busy: all 2 connections in use")
            reasons = [expect_silent_close(sock, 0.5) for sock in silent]
            took = time.monotonic() - started
        finally:
            for sock in silent:
                sock.close()
        assert took > 0.45, took  # not before the first-byte bound, which each reason names
        assert wait_for(lambda: lst.stats()["active"] == 0, 3), lst.stats()
        with connect(lst.port) as sock:
            good_transfer(sock, lst.base, b"\x5c" * 300)
        assert bytes(lst.memory[:300]) == b"\x5c" * 300
        stats = lst.stats()
        # Logged as such: its own counter and the last reason; no transfer was refused.
        assert (stats["silent"], stats["failures"], stats["transfers"], stats["refused"]) == (2, 0, 1, 1)
        assert stats["last_error"] == reasons[-1]


def test_a_pooled_connection_keeps_the_idle_timeout():
    """After one transfer a connection may sit idle far past the first-byte bound (0.2 s) and carry
    the next one; a fresh connection whose first bytes come in time is served as before."""
    with Raw(recv=2.0, idle=10.0, conns=2, first_byte=0.2) as lst:
        with connect(lst.port) as pooled:
            good_transfer(pooled, lst.base, b"\x01" * 100)
            time.sleep(1.0)  # five first-byte bounds, well inside the idle timeout
            good_transfer(pooled, lst.base + 100, b"\x02" * 100)
        with connect(lst.port) as prompt:
            time.sleep(0.05)  # a sender's start-up: well inside the bound
            good_transfer(prompt, lst.base + 200, b"\x03" * 100)
        stats = lst.stats()
        assert (stats["silent"], stats["failures"], stats["transfers"]) == (0, 0, 3)
        assert bytes(lst.memory[:300]) == b"\x01" * 100 + b"\x02" * 100 + b"\x03" * 100


def test_a_peer_that_began_is_judged_by_the_receive_timeout_not_the_first_byte_bound():
    """One header byte, then silence: the transfer has begun, so the receive timeout (1 s) ends it
    with the usual reason, not the first-byte bound (0.2 s)."""
    with Raw(recv=1.0, idle=10.0, conns=1, first_byte=0.2) as lst, connect(lst.port) as sock:
        started = time.monotonic()
        sock.sendall(b"\x40")
        kind, payload, _ = wire.read_frame(sock)
        took = time.monotonic() - started
        assert kind == wire.ERROR
        assert Msg.decode(payload).body.decode() == (
            "read: timed out waiting for the peer at the start of a transfer (1 of 5 header bytes)")
        assert took > 0.9, took  # not before the receive timeout, which the reason names
        assert lst.stats()["silent"] == 0


def test_the_first_byte_bound_is_checked_and_capped_by_the_idle_timeout():
    """NaN is refused like the other timeouts; a bound beyond the idle timeout is cut to it (a fresh
    connection never gets longer than a pooled one)."""
    with pytest.raises(ValueError, match=r"^wire listener: a timeout is NaN$"):
        _native.wire_listen("127.0.0.1", 0, 1.0, 1.0, PAGE, 2, DEFAULT_RATE, -1.0, math.nan)
    with Raw(recv=5.0, idle=0.3, conns=1, first_byte=30.0) as lst, connect(lst.port) as sock:
        expect_silent_close(sock, 0.3)  # its reason names the bound it was closed at: 0.3 s, not 30


def test_the_engines_default_bound_frees_a_slot_long_before_the_idle_timeout():
    """WireEngine with its defaults (10 s first-byte bound) and a 60 s idle timeout: a silent
    connection holding the only slot makes writes fail "listener busy" until about 10 s, then the
    slot is free and writes land, not only after the whole 60 s. Eviction is off
    (evict_after_s negative), else the write would close the silent connection for itself: this is
    the first-byte bound alone."""
    n = 64 << 10
    with WireEngine("127.0.0.1", idle_timeout_s=60.0, max_connections=1, evict_after_s=-1.0) as rx, \
            WireEngine("127.0.0.1") as tx:
        src = torch.arange(n, dtype=torch.int32).to(torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        tx.register(src)
        rx.register(dst)
        started = time.monotonic()
        with connect(rx.port) as silent:
            assert wait_for(lambda: rx.stats()["active"] == 1, 5)
            with pytest.raises(TransferError, match="listener busy: all 1 connections in use"):
                tx.write(rx.session_id, [src.data_ptr()], [dst.data_ptr()], [n])
            silent.settimeout(20)
            expect_silent_close(silent, 10.0)
            took = time.monotonic() - started
        assert took > 9.5, took  # not before the first-byte bound, which the reason names
        assert wait_for(lambda: rx.stats()["active"] == 0, 3)
        tx.write(rx.session_id, [src.data_ptr()], [dst.data_ptr()], [n])
        assert torch.equal(dst, src)
        stats = rx.stats()
        assert (stats["silent"], stats["transfers_received"], stats["evicted"]) == (1, 1, 0)


def test_the_engine_passes_its_first_byte_bound_on():
    """WireEngine(first_byte_timeout_s=...) reaches the listener."""
    with WireEngine("127.0.0.1", first_byte_timeout_s=0.3) as rx, connect(rx.port) as sock:
        expect_silent_close(sock, 0.3)  # its reason names the bound it was closed at: 0.3 s, not the default 10
        assert rx.stats()["silent"] == 1


# ------------------------------------------------------------------ sender: a stalled peer's writers


class StalledPeer:
    """A port whose connections complete (in the kernel's backlog) but are never read: to a sender,
    a peer that accepted and then stopped reading. A small receive buffer makes it fill at once."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.session_id = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        """Closes the port (and with it every pending connection)."""
        self.sock.close()

    def __enter__(self) -> StalledPeer:
        """Context-manager entry."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on exit."""
        self.close()


def healthy_write_ahead(stalled_writes: int, reply_timeout_s: float) -> tuple[list[bool], list[str]]:
    """A 1 MiB write_async to a healthy peer while `stalled_writes` 16 MiB writes to a stalled peer are
    pending (all submitted first): which of the stalled writes were still pending once it landed, and
    their errors."""
    big, small = 16 << 20, 1 << 20
    with StalledPeer() as stalled, WireEngine("127.0.0.1") as healthy, \
            WireEngine("127.0.0.1", reply_timeout_s=reply_timeout_s) as writer:
        src = torch.randint(0, 256, (big,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        dst = torch.zeros(small, dtype=torch.uint8)
        writer.register(src)
        healthy.register(dst)
        stuck = [writer.write_async(stalled.session_id, [src.data_ptr()], [0x10000], [big])
                 for _ in range(stalled_writes)]
        time.sleep(0.3)  # the stalled writes have filled their sockets and block
        batch = writer.write_async(healthy.session_id, [src.data_ptr()], [dst.data_ptr()], [small])
        writer.wait(batch, timeout_s=60)
        pending, failed = [], {}
        for ticket in stuck:
            try:
                pending.append(not writer.poll(ticket))
            except TransferError as error:  # over already: it failed
                pending.append(False)
                failed[ticket] = str(error)
        assert torch.equal(dst, src[:small])
        errors = []
        for ticket in stuck:
            if ticket in failed:
                errors.append(failed[ticket])
                continue
            with pytest.raises(TransferError) as caught:
                writer.wait(ticket, timeout_s=60)
            errors.append(str(caught.value))
    return pending, errors


def test_writes_to_a_healthy_peer_do_not_wait_for_a_stalled_one():
    """2 x WRITERS_PER_PEER 16 MiB writes to a peer that stopped reading, then one to a healthy
    peer: the healthy one runs at once, not queued behind them (2 s reply timeout each), and the
    stalled ones still fail: with the write timeout, at most WRITERS_PER_PEER at a time, or unsent
    once they waited for their turn as long as that (the queue's bound)."""
    pending, errors = healthy_write_ahead(2 * WRITERS_PER_PEER, 2.0)
    assert pending == [True] * 2 * WRITERS_PER_PEER, "the healthy write waited for stalled writes to end"
    assert len(errors) == 2 * WRITERS_PER_PEER
    for error in errors[:WRITERS_PER_PEER]:
        assert "failed: write: timed out after 2 s without progress" in error, error
    for error in errors[WRITERS_PER_PEER:]:
        assert ("failed: write: timed out after 2 s without progress" in error
                or re.search(r"not started: it waited \d+\.\d s in the queue of that peer's writes \(queue_timeout_s=2\)",
                             error)), error


def _under_way(writer: WireEngine, ticket: int) -> bool:
    """Whether the write_async batch is still in flight (False once it ended, in failure too)."""
    try:
        return not writer.poll(ticket)
    except TransferError:
        return False


def test_writers_per_peer_sets_how_many_writes_to_one_peer_run_at_once():
    """Two 16 MiB writes to a stalled peer with a 2 s reply timeout: with writers_per_peer=2 both
    are under way at once, each on its own connection, and both time out; one writer would open the
    second connection only once the first write had timed out. Zero is refused."""
    with pytest.raises(ValueError, match="writers_per_peer must be at least 1"):
        WireEngine("127.0.0.1", writers_per_peer=0)
    big = 16 << 20
    with StalledPeer() as stalled, WireEngine("127.0.0.1", reply_timeout_s=2.0, writers_per_peer=2) as writer:
        src = torch.zeros(big, dtype=torch.uint8)
        writer.register(src)
        stuck = [writer.write_async(stalled.session_id, [src.data_ptr()], [0x10000], [big]) for _ in range(2)]
        stalled.sock.settimeout(30)
        taken = []  # kept open, never read
        while len(taken) < len(stuck):
            try:
                taken.append(stalled.sock.accept()[0])
            except TimeoutError:
                break
        # The second write's connection came while the first write was still under way: one writer would
        # have opened it (if at all) only once the first had timed out.
        in_flight = [_under_way(writer, ticket) for ticket in stuck]
        assert len(taken) == 2 and in_flight == [True, True], (
            f"the two writes to one peer ran one after the other: {len(taken)} connection(s), in flight {in_flight}")
        for ticket in stuck:
            with pytest.raises(TransferError, match="timed out after 2 s without progress"):
                writer.wait(ticket, timeout_s=60)
        for sock in taken:
            sock.close()


def test_writer_pool_caps_each_peer():
    """Pure logic: six blocked jobs of peer A run two at a time (the first two submitted first), and a
    job of peer B runs at once although A's queue is longer than the cap; shutdown waits for all."""
    pool = _WriterPool("test-writers", per_peer=2, total=8)
    gate = threading.Event()
    lock = threading.Lock()
    order: list[str] = []
    running = {"a": 0, "a_peak": 0}

    def job_a(i: int) -> int:
        with lock:
            running["a"] += 1
            running["a_peak"] = max(running["a_peak"], running["a"])
            order.append(f"a{i}")
        gate.wait(10)
        with lock:
            running["a"] -= 1
        return i

    try:
        futures_a = [pool.submit("a", job_a, i) for i in range(6)]
        future_b = pool.submit("b", lambda: "b done")
        assert future_b.result(timeout=5) == "b done"
        assert wait_for(lambda: len(order) == 2, 5)
        time.sleep(0.1)
        assert sorted(order) == ["a0", "a1"] and running["a"] == 2  # capped: the other four wait
        gate.set()
        assert [f.result(timeout=10) for f in futures_a] == list(range(6))
        assert sorted(order) == [f"a{i}" for i in range(6)] and running["a_peak"] == 2
    finally:
        gate.set()
        pool.shutdown()
    with pytest.raises(RuntimeError, match="test-writers is shut down"):
        pool.submit("a", job_a, 9)


def test_writer_pool_runs_one_peers_jobs_in_order():
    """With one writer per peer, a peer's jobs run strictly in submission order while another
    peer's jobs interleave with them."""
    pool = _WriterPool("ordered", per_peer=1, total=4)
    seen: dict[str, list[int]] = {"a": [], "b": []}

    def job(key: str, i: int) -> None:
        time.sleep(0.002)  # long enough for the other peer's job to run meanwhile
        seen[key].append(i)

    try:
        futures = [pool.submit(key, job, key, i) for i in range(20) for key in ("a", "b")]
        for future in futures:
            future.result(timeout=10)
    finally:
        pool.shutdown()
    assert seen == {"a": list(range(20)), "b": list(range(20))}


def test_writer_pool_total_cap_still_serves_every_peer():
    """With the total cap reached by one peer's running jobs, a second peer's job waits for a thread,
    then runs; a job that raises reports through its future."""
    pool = _WriterPool("capped", per_peer=2, total=2)
    gate = threading.Event()
    started = threading.Semaphore(0)

    def blocked_job() -> bool:
        started.release()
        return gate.wait(10)

    try:
        blocked = [pool.submit("a", blocked_job) for _ in range(2)]
        assert started.acquire(timeout=5) and started.acquire(timeout=5)  # both threads are taken
        other = pool.submit("b", lambda: 1 / 0)
        time.sleep(0.1)
        assert not other.done()
        gate.set()
        with pytest.raises(ZeroDivisionError):
            other.result(timeout=5)
        assert all(f.result(timeout=5) for f in blocked)
    finally:
        gate.set()
        pool.shutdown()


def test_writer_pool_shares_per_peer_among_busy_peers(monkeypatch):
    """Pure logic: a lone peer runs per_peer (4) jobs at once; once a second peer has jobs too they
    share the 4, two each, and each peer's later jobs keep to that; once the first is done the
    other runs four again; threads that find nothing to do for IDLE_S leave. (Sixteen threads over four peers measured slower than four.)"""
    monkeypatch.setattr(_WriterPool, "IDLE_S", 0.3)
    pool = _WriterPool("shared", per_peer=4, total=16)
    gates = {"a": threading.Event(), "b": threading.Event()}
    lock = threading.Lock()
    running = {"a": 0, "b": 0}
    peaks = {"a": [], "b": []}

    def job(key: str) -> None:
        with lock:
            running[key] += 1
            peaks[key].append(running[key])
        gates[key].wait(10)
        with lock:
            running[key] -= 1

    try:
        first_a = [pool.submit("a", job, "a") for _ in range(4)]
        assert wait_for(lambda: running["a"] == 4, 5)  # alone: the whole per_peer
        later_a = [pool.submit("a", job, "a") for _ in range(4)]
        futures_b = [pool.submit("b", job, "b") for _ in range(4)]
        assert wait_for(lambda: running["b"] == 2, 5)
        time.sleep(0.1)
        assert running == {"a": 4, "b": 2}  # a's running jobs are not cut short; b gets its share
        gates["a"].set()
        for future in first_a + later_a:
            future.result(timeout=10)
        assert max(peaks["a"][4:]) <= 2, peaks["a"]  # a's later jobs ran two at a time beside b
        assert wait_for(lambda: running["b"] == 4, 5), running  # a is done: b alone may run all four
        gates["b"].set()
        for future in futures_b:
            future.result(timeout=10)
        assert wait_for(lambda: not pool._threads, 5), f"{len(pool._threads)} idle threads did not leave"
        assert pool.submit("a", lambda: "again").result(timeout=5) == "again"  # a new thread starts
    finally:
        gates["a"].set()
        gates["b"].set()
        pool.shutdown()


def _thread_names() -> list[str]:
    """The OS names of this process's threads."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:
            pass  # it ended meanwhile
    return names


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc/self/task on this host")
def test_the_wire_paths_threads_carry_names():
    """The listener's accept and connection threads and the writers are named epd-wire-*, so top -H
    and bench's CPU split (which counts them as the transport) tell them apart from ours."""
    with WireEngine("127.0.0.1") as receiver, WireEngine("127.0.0.1") as sender:
        src = torch.arange(4096, dtype=torch.uint8)
        dst = torch.zeros(4096, dtype=torch.uint8)
        sender.register(src)
        receiver.register(dst)
        sender.wait(sender.write_async(receiver.session_id, [src.data_ptr()], [dst.data_ptr()], [4096]), 30)
        assert torch.equal(dst, src)
        names = _thread_names()
    for name in ("epd-wire-accept", "epd-wire-conn", "epd-wire-write"):
        assert name in names, names

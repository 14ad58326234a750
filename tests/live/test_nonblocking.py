"""The prefill SessionManager never blocks the scheduler loop that calls it.

SPEC.md section 7 and the README ("Using it from an engine") promise that receive(),
a handle's poll()/failure, clear(), add_region()/remove_region() and stats() return
promptly whatever the peers do. Each test below builds one adverse condition from real
parts (real ZMQ sockets, hand-rolled hostile HTTP servers, the real bootstrap server,
Mooncake `tcp` on 127.0.0.1), drives the manager from the test's thread as a scheduler
loop would, and records the worst wall time of every call in that thread, less any
garbage collection that ran meanwhile (it stops every thread; its worst is reported), the
time the thread spent preempted, and any stall of the whole host that a separate meter
process saw (a VM paused by its hypervisor stops everything; its longest is reported). The bound
(CALL_BOUND_S) is generous: it catches a call that waits on the network, a queue of
checksums or a look-up (the tests' look-ups time out after a second or more), not a
loaded host. The manager's two locks are wrapped in probes that record the longest any
thread held them, since a lock the I/O thread holds across a slow step is how a caller's
call would come to block.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from live_helpers import LIVE, MOONCAKE_MISSING, junk_pusher, wait_until

pytestmark = LIVE

HOST = "127.0.0.1"
#: The worst any one call in the caller's thread may take (a blocking bug shows a second or more).
CALL_BOUND_S = 0.5
#: The longest the I/O thread may hold a lock the caller's thread also takes.
HOLD_BOUND_S = 0.1
#: A small destination: one row of 64 bytes at the buffer's start (rooms may share it).
ROW = 64
#: scenario -> call -> worst seconds, printed at the end of each test (run with -s to see).
WORST: dict[str, dict[str, float]] = {}


# ------------------------------------------------------------------ measuring


class GcPauses:
    """Garbage collections while installed, as spans: a collection stops every thread, the caller's too."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.monotonic()
        else:
            end = time.monotonic()
            GC_SPANS.append((self._start, end))
            self.worst = max(self.worst, end - self._start)


#: (start, end) of each garbage collection in the current test. A step's time is judged less
#: the collections that ran during it when its worst is read, not when it ends: the thread
#: that ran a long collection may lose the GIL inside this very callback, before the span is
#: filed, and the step it stalled end first.
GC_SPANS: list[tuple[float, float]] = []


@pytest.fixture(autouse=True)
def gc_pauses():
    """Records GC pauses per test, so a spike in a call can be told apart from the library's doing."""
    tracker = GcPauses()
    GC_SPANS.clear()
    if STALLS is not None:
        STALLS.spans.clear()  # each test reports its own
    gc.callbacks.append(tracker)
    yield tracker
    gc.callbacks.remove(tracker)


_SCHED = threading.local()


def runq_wait() -> float:
    """Seconds this thread has spent runnable but not running (preempted), from the kernel's
    schedstat; 0 where the kernel does not keep it. A thread preempted on a loaded host is
    not the library's doing; one that sleeps (blocks on I/O or a lock) is not counted here."""
    fd = getattr(_SCHED, "fd", None)
    if fd is None:
        try:
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            fd = -1
        _SCHED.fd = fd
    if fd < 0:
        return 0.0
    return int(os.pread(fd, 128, 0).split()[1]) / 1e9


#: A separate process that sleeps 1 ms at a time and prints each span in which it did not
#: run for STALL_GAP_S or more (CLOCK_MONOTONIC is the same clock in every process).
_METER = """
import sys, time
gap = float(sys.argv[1])
while True:
    before = time.monotonic()
    time.sleep(0.001)
    after = time.monotonic()
    if after - before > gap:
        print(before + 0.001, after, flush=True)
"""
#: A 1 ms sleep that lasts this long means the host (a VM paused by its hypervisor, say) ran nothing of ours.
STALL_GAP_S = 0.02


class HostStalls:
    """The spans in which the host stalled, seen from outside the test's process: a step that was
    slow only because the whole machine stopped is not the library's doing. It is measured by
    another process, so a lock held across blocking I/O, or a call that blocks holding the GIL,
    is never explained away by it."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._proc = subprocess.Popen([sys.executable, "-c", _METER, str(STALL_GAP_S)],
                                      stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, name="host-stalls", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            start, end = map(float, line.split())
            self.spans.append((start, end))

    def longest(self) -> float:
        return max((e - s for s, e in self.spans), default=0.0)

    def settle(self) -> None:
        """Gives the meter time to report a stall that ended just now."""
        time.sleep(5 * STALL_GAP_S)

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._reader.join(5)


STALLS: HostStalls | None = None


@pytest.fixture(scope="module", autouse=True)
def host_stalls():
    """Meters host stalls while this module's tests run."""
    global STALLS
    STALLS = HostStalls()
    yield STALLS
    STALLS.close()
    STALLS = None


def paused(start: float, end: float) -> float:
    """Seconds of [start, end] in which garbage collection or a host stall stopped our threads
    (the union of both kinds of span, so a stall during a collection counts once)."""
    spans = list(GC_SPANS) + (list(STALLS.spans) if STALLS is not None else [])
    clipped = sorted((max(start, s), min(end, e)) for s, e in spans if s < end and e > start)
    total, reach = 0.0, start
    for s, e in clipped:
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


class Slowest:
    """The slowest of one kind of step. Steps over SUSPECT_S keep their span, so that GC pauses
    and host stalls (both filed a little later) are taken out of them when the worst is read."""

    #: Steps faster than this are kept as one running maximum.
    SUSPECT_S = 0.02

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._fast, self._fast_by = 0.0, ""
        self._suspects: list[tuple[float, float, float, str]] = []

    def add(self, took: float, start: float, end: float, by: str) -> None:
        """One step that took `took` seconds (already less the time its thread was preempted) in [start, end]."""
        if took > self.SUSPECT_S:
            self._suspects.append((took, start, end, by))
        elif took > self._fast:
            self._fast, self._fast_by = took, by

    def worst(self) -> tuple[float, str]:
        """The longest step less the GC pauses and host stalls during it, and who took it."""
        best = (self._fast, self._fast_by)
        for took, start, end, by in self._suspects:
            ours = max(0.0, took - paused(start, end))
            best = max(best, (ours, by))
        return best


class Latencies:
    """The worst wall time of each kind of call made through it, per thread (less GC pauses,
    time the calling thread spent preempted, and host stalls)."""

    def __init__(self, scenario: str) -> None:
        self.scenario = scenario
        self.slowest: dict[str, Slowest] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Calls fn(*args, **kwargs), timing it under `name`; exceptions pass through."""
        start, preempted_before = time.monotonic(), runq_wait()
        try:
            return fn(*args, **kwargs)
        finally:
            # Blocking shows as sleep; time preempted (a loaded host) is not ours, nor are GC
            # pauses (Slowest takes those out when the worst is read).
            end = time.monotonic()
            took = end - start - (runq_wait() - preempted_before)
            with self._lock:
                self.counts[name] = self.counts.get(name, 0) + 1
                self.slowest.setdefault(name, Slowest()).add(took, start, end, name)

    @property
    def worst(self) -> dict[str, float]:
        """Each kind of call's worst time, host stalls taken out."""
        return {name: slowest.worst()[0] for name, slowest in self.slowest.items()}

    def check(self, bound: float = CALL_BOUND_S, settled: bool = False, **extra: float) -> None:
        """Records the figures and fails when any call took longer than `bound` (`settled`: the
        caller already gave the stall meter its time)."""
        if STALLS is not None:
            if not settled:
                STALLS.settle()
            extra = {**extra, "(longest host stall)": STALLS.longest()}
        worst = self.worst
        figures = {**worst, **extra}
        tracker = next((cb for cb in gc.callbacks if isinstance(cb, GcPauses)), None)
        if tracker is not None:
            figures["(longest GC pause)"] = tracker.worst
        WORST[self.scenario] = figures
        shown = ", ".join(f"{k} {v * 1000:.1f} ms (x{self.counts.get(k, 1)})" for k, v in sorted(figures.items()))
        print(f"\n[nonblocking] {self.scenario}: {shown}")
        slow = {k: round(v, 4) for k, v in worst.items() if v > bound}
        assert not slow, f"{self.scenario}: calls in the caller's thread slower than {bound}s: {slow}"


class HoldProbe:
    """Stands in for a threading.Lock and records the longest hold and the thread that held it
    (wall time less GC pauses, time the holder spent preempted, and host stalls)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._since = threading.local()
        self.slowest = Slowest()

    @property
    def worst(self) -> float:
        return self.slowest.worst()[0]

    @property
    def worst_by(self) -> str:
        return self.slowest.worst()[1]

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._inner.acquire(blocking, timeout)
        if got:
            self._since.t = (time.monotonic(), runq_wait())
        return got

    def release(self) -> None:
        # A hold spans a slow step only while the holder runs or sleeps: time it spent
        # preempted by other threads (a loaded CI host) and in GC pauses does not count.
        since, preempted_before = self._since.t
        end = time.monotonic()
        held = end - since - (runq_wait() - preempted_before)
        self._inner.release()
        self.slowest.add(held, since, end, threading.current_thread().name)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def probe_locks(manager: Any) -> tuple[HoldProbe, HoldProbe]:
    """Wraps the driver's lock (core, rooms, sends) and the manager's regions lock (before any room
    exists) in hold probes."""
    driver = manager._driver
    lock, regions = HoldProbe(driver._lock), HoldProbe(manager._regions_lock)
    driver._lock, manager._regions_lock = lock, regions
    return lock, regions


def check_holds(lat: Latencies, lock: HoldProbe, regions: HoldProbe) -> None:
    """Fails on a lock held across a slow step (the figures are in the scenario's line)."""
    assert lock.worst < HOLD_BOUND_S, f"{lat.scenario}: the driver's lock held {lock.worst:.3f}s by {lock.worst_by}"
    assert regions.worst < HOLD_BOUND_S, \
        f"{lat.scenario}: _regions_lock held {regions.worst:.3f}s by {regions.worst_by}"


def test_pauses_are_the_union_of_gc_and_host_stall_spans_within_the_step():
    """Pure logic of the meter: overlapping kinds of pause count once, clipped to the step."""
    GC_SPANS[:] = [(1.0, 3.0)]
    STALLS.spans[:] = [(2.0, 4.0), (10.0, 11.0)]
    assert paused(0.0, 5.0) == pytest.approx(3.0)
    assert paused(2.5, 3.5) == pytest.approx(1.0)
    assert paused(5.0, 9.0) == 0.0


def test_a_gc_span_filed_after_the_step_ended_is_still_taken_out_but_a_slow_step_is_not():
    """The collection that stalled a step may be filed after the step's own end (its thread can
    lose the GIL inside the GC callback); the worst is read later, so it is taken out then."""
    GC_SPANS.clear()
    STALLS.spans.clear()
    stalled, slow = Slowest(), Slowest()
    stalled.add(0.18, 100.0, 100.18, "held across a collection")
    slow.add(0.18, 200.0, 200.18, "held across a slow step")
    GC_SPANS.append((100.0, 100.176))  # filed after both steps ended
    assert stalled.worst()[0] == pytest.approx(0.004)
    assert slow.worst() == (pytest.approx(0.18), "held across a slow step")


# ------------------------------------------------------------------ real parts


@pytest.fixture(scope="module")
def engine():
    """The prefill side's Mooncake engine (tcp on loopback)."""
    if MOONCAKE_MISSING:
        pytest.skip(MOONCAKE_MISSING)
    from transfer.engine import Engine

    with Engine(HOST, "tcp") as eng:
        yield eng


class Prefill:
    """A SessionManager over a small registered buffer, its locks probed, for one scenario."""

    def __init__(self, engine: Any, scenario: str, *, nbytes: int = 1 << 16, deadline_s: float = 30.0,
                 lookup_timeout_s: float = 1.0, buffer: Any = None) -> None:
        import torch

        from transfer.receiver import SessionManager

        self.buffer = buffer if buffer is not None else torch.zeros(nbytes, dtype=torch.uint8)
        self.manager = SessionManager(engine, 0, 1, 1, buffer=self.buffer, host=HOST, deadline_s=deadline_s,
                                      lookup_timeout_s=lookup_timeout_s)
        self.lock, self.regions_lock = probe_locks(self.manager)
        self.lat = Latencies(scenario)
        self.handles: dict[int, Any] = {}
        # A per-item buffer to add and remove as a scheduler might.
        self.extra = torch.zeros(ROW, dtype=torch.uint8)

    def receive(self, room: int, bootstrap: str, rows: int = 1, hidden: int = ROW) -> Any:
        """One timed receive() of `rows` x `hidden` bytes at the buffer's start."""
        handle = self.lat.call("receive", self.manager.receive, room, bootstrap, self.buffer.data_ptr(),
                               rows, hidden, "torch.uint8")
        self.handles[room] = handle
        return handle

    def poll(self, handle: Any) -> Any:
        """A timed poll() and failure read, as a scheduler loop does each turn."""
        status = self.lat.call("poll", handle.poll)
        self.lat.call("failure", lambda: handle.failure)
        return status

    def turn(self, rooms: list[int] | None = None, *, closed: bool = False) -> int:
        """One scheduler turn: poll the rooms (all by default), stats(), add and remove a region (on a
        `closed` manager, add_region() raises); terminal count."""
        from transfer.errors import UsageError
        from transfer.status import is_terminal

        self.lat.call("(control: an empty call)", lambda: None)
        done = 0
        for room in self.handles if rooms is None else rooms:
            done += is_terminal(self.poll(self.handles[room]))
        self.lat.call("stats", self.manager.stats)
        if closed:
            with pytest.raises(UsageError, match=r"^session manager is closed: its close\(\) ran \(called, or its with "
                                                   r"block ended\); start a new SessionManager to receive more$"):
                self.lat.call("add_region", self.manager.add_region, self.extra)
            return done
        regions = self.lat.call("add_region", self.manager.add_region, self.extra)
        self.lat.call("remove_region", self.manager.remove_region, regions)
        return done

    def clear(self, room: int) -> None:
        """A timed clear() of a room received through this object."""
        self.lat.call("clear", self.handles.pop(room).clear)

    def check(self, holds: bool = True, **extra: float) -> None:
        """Checks every call's worst time, then (unless `holds` is False) the locks' longest holds."""
        if STALLS is not None:
            STALLS.settle()
        extra = {"(driver lock held)": self.lock.worst, "(_regions_lock held)": self.regions_lock.worst, **extra}
        self.lat.check(settled=True, **extra)
        if holds:
            check_holds(self.lat, self.lock, self.regions_lock)

    def close(self) -> float:
        """Closes the manager; returns how long close() took."""
        start = time.monotonic()
        self.manager.close()
        return time.monotonic() - start

    def __enter__(self) -> Prefill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostileHTTP:
    """A TCP server that plays a broken bootstrap server.

    modes: "silent" reads the request and never answers; "drip" answers one byte every
    50 ms, never finishing; "slow503" answers `503` after `delay` seconds.
    """

    def __init__(self, mode: str, delay: float = 0.5) -> None:
        self.mode, self.delay = mode, delay
        self._listener = socket.socket()
        self._listener.bind((HOST, 0))
        self._listener.listen(64)
        self._listener.settimeout(0.05)
        self.address = f"{HOST}:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.accepted = 0
        self._acceptor = threading.Thread(target=self._accept, name=f"hostile-{mode}", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            self._conns.append(conn)
            worker = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(worker)
            worker.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(0.05)
            try:
                conn.recv(4096)  # the request (one recv is all a GET takes here)
            except TimeoutError:
                pass
            if self.mode == "slow503":
                self._stop.wait(self.delay)
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
                return
            answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{" + b" " * 999
            sent = 0
            while not self._stop.wait(0.05):
                if self.mode == "drip" and sent < len(answer):
                    conn.sendall(answer[sent : sent + 1])
                    sent += 1
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._acceptor.join(5)
        for worker in self._threads:
            worker.join(5)
        self._listener.close()

    def __enter__(self) -> HostileHTTP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FullBacklog:
    """A listener that never accepts, its backlog filled: connections to it hang, as to an unreachable host."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind((HOST, 0))
        self._listener.listen(0)
        self.address = f"{HOST}:{self._listener.getsockname()[1]}"
        self._fillers = []
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            try:
                filler.connect(self._listener.getsockname())
            except BlockingIOError:
                pass
            self._fillers.append(filler)
        time.sleep(0.1)

    def close(self) -> None:
        for sock in self._fillers:
            sock.close()
        self._listener.close()

    def __enter__(self) -> FullBacklog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class StalledPeer:
    """A raw TCP listener that accepts and never reads nor speaks: an encode rank whose process hangs."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind((HOST, 0))
        self._listener.listen(16)
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="stalled-peer", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self._conns.append(self._listener.accept()[0])
            except (TimeoutError, OSError):
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self._conns:
            conn.close()
        self._listener.close()


@contextmanager
def encode_route(kind: str) -> Iterator[tuple[str, Any]]:
    """A real bootstrap server whose encode rank 0 is `kind`: "reading" (a ZMQ PULL that queues
    everything), "dead" (a closed port) or "stalled" (accepts, never reads); yields (address, peer)."""
    import zmq

    from transfer.bootstrap import BootstrapClient, BootstrapServer

    peer: Any = None
    with BootstrapServer(HOST, 0) as server:
        if kind == "reading":
            peer = zmq.Context.instance().socket(zmq.PULL)
            peer.setsockopt(zmq.LINGER, 0)
            peer.setsockopt(zmq.RCVHWM, 0)  # libzmq buffers every ask; no Python thread in the way
            port = peer.bind_to_random_port(f"tcp://{HOST}")
        elif kind == "dead":
            port = closed_port()
        else:
            peer = StalledPeer()
            port = peer.port
        BootstrapClient(server.address, timeout=2.0).register_rank(1, 1, HOST, port, 0)
        try:
            yield server.address, peer
        finally:
            if peer is not None:
                peer.close()


FLOOD = """
import sys, time, zmq
port, seconds, first = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
sock = zmq.Context.instance().socket(zmq.PUSH)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.SNDHWM, 0)
sock.connect(f"tcp://127.0.0.1:{port}")
end, n = time.monotonic() + seconds, 0
while time.monotonic() < end:
    for _ in range(500):
        sock.send_multipart([str(first + n).encode(), b"5", b"0"])  # Success for a room nobody asked for
        n += 1
print(n, flush=True)
"""


@contextmanager
def status_flood(port: int, seconds: float) -> Iterator[subprocess.Popen]:
    """A process pushing Success statuses for unknown rooms at `port` as fast as it can for `seconds`."""
    proc = subprocess.Popen([sys.executable, "-c", FLOOD, str(port), str(seconds), str(10**15)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def terminal(handle: Any) -> bool:
    from transfer.status import is_terminal

    return is_terminal(handle.poll())


# ------------------------------------------------------------------ bootstrap trouble


@pytest.mark.parametrize("mode", ["silent", "drip", "refused", "full_backlog"])
def test_a_bootstrap_that_never_answers_costs_the_caller_nothing(engine, mode):
    """Rooms whose bootstrap accepts and never answers, drips bytes, refuses, or hangs in connect:
    every call stays prompt, every room fails with a reason naming the bootstrap, in bounded time."""
    from transfer.status import TransferPoll

    if mode in ("silent", "drip"):
        server: Any = HostileHTTP(mode)
        address = server.address
    elif mode == "full_backlog":
        server = FullBacklog()
        address = server.address
    else:
        server, address = None, f"{HOST}:{closed_port()}"
    try:
        with Prefill(engine, f"bootstrap {mode}", lookup_timeout_s=1.0) as pre:
            end = time.monotonic() + 1.5
            room = 0
            while time.monotonic() < end:  # a scheduler loop: a few new rooms a turn, polls, stats
                for _ in range(5):
                    room += 1
                    pre.receive(room, address)
                pre.turn()
                time.sleep(0.005)
            assert wait_until(lambda: pre.turn() == len(pre.handles), 10.0), "rooms did not all conclude"
            for handle in pre.handles.values():
                assert handle.poll() == TransferPoll.Failed
                assert f"bootstrap {address}" in handle.failure, handle.failure
            for r in list(pre.handles):
                pre.clear(r)
            pre.check()
    finally:
        if server is not None:
            server.close()


def test_a_slow_erroring_bootstrap_does_not_hold_up_other_rooms(engine):
    """A bootstrap answering 503 after 2 s for 20 queued rooms must not delay a healthy room's
    Success (its status already queued) until it answers: the caller's calls stay prompt either way."""
    from transfer.frames import status_frames
    from transfer.status import TransferPoll

    with encode_route("reading") as (good, _), HostileHTTP("slow503", delay=2.0) as bad, \
            Prefill(engine, "slow 503 bootstrap vs a healthy room", lookup_timeout_s=5.0) as pre:
        healthy = pre.receive(1, good)
        assert wait_until(lambda: pre.poll(healthy) == TransferPoll.WaitingForInput, 5.0)
        for room in range(100, 120):
            pre.receive(room, bad.address)
        pusher = junk_pusher(HOST, pre.manager.status_port)
        try:
            time.sleep(0.1)  # the I/O thread is inside the first slow look-up now
            sent = time.monotonic()
            pusher.send_multipart(status_frames(1, TransferPoll.Success, 0))
            wait_until(lambda: pre.turn() == len(pre.handles), 20.0)
            concluded = healthy._state.concluded_at
            waited = (concluded if concluded is not None else time.monotonic()) - sent
        finally:
            pusher.close(0)
        pre.check(**{"healthy room's Success handled after": waited})
        assert healthy.poll() == TransferPoll.Success
        # Its Success was handled while the slow bootstrap's look-up was still under way, not after it ended.
        slow = [pre.handles[room]._state.concluded_at for room in range(100, 120)]
        assert all(at > concluded for at in slow), "the healthy room's Success waited behind the slow look-up"


# ------------------------------------------------------------------ encode rank trouble


def test_a_dead_encode_rank_costs_the_caller_nothing_and_its_rooms_expire(engine):
    """The bootstrap names an encode rank whose port is closed: asks queue in ZMQ, calls stay
    prompt, and every room fails at its deadline with a reason that names the encode rank."""
    from transfer.status import TransferPoll

    with encode_route("dead") as (address, _), \
            Prefill(engine, "dead encode rank (port closed)", deadline_s=1.5) as pre:
        for room in range(1, 301):
            pre.receive(room, address)
            if room % 50 == 0:
                pre.turn()
        assert wait_until(lambda: pre.turn() == len(pre.handles), 15.0), "rooms did not expire"
        for handle in pre.handles.values():
            assert handle.poll() == TransferPoll.Failed
            assert "encode rank 0 at 127.0.0.1:" in handle.failure, handle.failure
        for room in list(pre.handles):
            pre.clear(room)
        pre.check()


def test_an_encode_rank_that_never_reads_fills_the_queue_without_blocking(engine):
    """An encode rank that accepts and never reads (nor completes ZMQ's handshake): past the
    bound on asks waiting for it (ZMQ's high-water mark, or the manager's own queue) receive()
    still returns at once, the rooms over the bound fail promptly with a reason naming the
    encode rank, and those within it keep waiting."""
    from transfer._io import STATUS_HWM
    from transfer.status import is_terminal

    with encode_route("stalled") as (address, peer), \
            Prefill(engine, "encode rank never reads (queue bound reached)", deadline_s=60.0) as pre:
        pre.receive(1, address)
        time.sleep(0.3)  # room 1's look-up is done: the route is cached
        total = STATUS_HWM + 600
        for room in range(2, total + 1):
            pre.receive(room, address)
            if room % 500 == 0:
                pre.turn([room])
        over = list(range(STATUS_HWM + 200, total + 1))
        assert wait_until(lambda: all(terminal(pre.handles[r]) for r in over), 10.0), "rooms over the bound hang"
        reasons = {pre.handles[r].failure for r in over}
        assert all(r and f"encode rank 0 at {HOST}:{peer.port}" in r for r in reasons), reasons
        within = range(1, STATUS_HWM - 200)
        assert not any(is_terminal(pre.handles[r].poll()) for r in within), \
            {pre.handles[r].failure for r in within if is_terminal(pre.handles[r].poll())}
        pre.turn(list(range(1, total + 1, 7)))
        for room in list(pre.handles):
            pre.clear(room)
        pre.check()


def test_asks_flushed_when_encode_ranks_come_up_do_not_hold_the_callers_receive(engine):
    """Three encode ranks are down while 4000 rooms each wait for them; they come up at once and
    the I/O thread sends the 12 000 waiting asks. Meanwhile receive() for a fourth, healthy encode
    rank (route cached, so it sends from the caller's thread under the driver's lock) stays prompt."""
    import zmq

    from transfer.bootstrap import BootstrapClient, BootstrapServer
    from transfer.status import TransferPoll

    ports = [closed_port() for _ in range(3)]
    servers = [BootstrapServer(HOST, 0) for _ in ports]
    peers: list[Any] = []
    try:
        for server, port in zip(servers, ports):
            BootstrapClient(server.address, timeout=2.0).register_rank(1, 1, HOST, port, 0)
        with encode_route("reading") as (good, _), \
                Prefill(engine, "asks flushed as 3 encode ranks come up (12 000 waiting)", deadline_s=60.0) as pre:
            first = pre.receive(1, good)
            assert wait_until(lambda: pre.poll(first) == TransferPoll.WaitingForInput, 5.0)
            room = 10
            for server in servers:
                for _ in range(4000):
                    room += 1
                    pre.receive(room, server.address)
            waiting = list(range(11, room + 1))
            assert wait_until(lambda: pre.manager._driver.core.asks.waiting((HOST, ports[-1])) == 4000, 30.0), \
                "the asks did not queue for the ranks that are down"
            time.sleep(0.3)
            assert not any(terminal(pre.handles[r]) for r in waiting), "rooms for a rank that is down failed early"
            # Measure from here: the flush alone.
            pre.lat = Latencies(pre.lat.scenario)
            pre.lock.slowest.reset()
            pre.regions_lock.slowest.reset()
            for port in ports:
                peer = zmq.Context.instance().socket(zmq.PULL)
                peer.setsockopt(zmq.LINGER, 0)
                peer.setsockopt(zmq.RCVHWM, 0)
                peer.bind(f"tcp://{HOST}:{port}")
                peers.append(peer)
            end = time.monotonic() + 2.0
            extra = 100_000
            while time.monotonic() < end:
                extra += 1
                pre.receive(extra, good)
                time.sleep(0.0005)
            assert wait_until(lambda: all(pre.handles[r].poll() == TransferPoll.WaitingForInput
                                          for r in waiting[::50]), 10.0), "the waiting asks were not sent"
            for r in list(pre.handles):
                pre.clear(r)
            pre.check()
    finally:
        for peer in peers:
            peer.close(0)
        for server in servers:
            server.close()


# ------------------------------------------------------------------ status floods, many rooms


def test_a_flood_of_statuses_for_unknown_rooms_costs_the_caller_nothing(engine):
    """Another process pushes Success for unknown rooms as fast as it can: calls stay prompt and
    a real room's Success, pushed in the middle of the flood, still concludes."""
    from transfer.frames import status_frames
    from transfer.status import TransferPoll

    with encode_route("reading") as (address, _), \
            Prefill(engine, "status flood for unknown rooms", deadline_s=30.0) as pre:
        first = pre.receive(1, address)
        assert wait_until(lambda: pre.poll(first) == TransferPoll.WaitingForInput, 5.0)
        pusher = junk_pusher(HOST, pre.manager.status_port)
        try:
            with status_flood(pre.manager.status_port, 3.0) as flood:
                time.sleep(0.5)  # the flood is running
                room, sent = 1, []
                end = time.monotonic() + 2.0
                while time.monotonic() < end:
                    for _ in range(10):
                        room += 1
                        pre.receive(room, address)
                        pusher.send_multipart(status_frames(room, TransferPoll.Success, 0))
                        sent.append(room)
                    pre.turn(sent[-10:])
                    time.sleep(0.002)
                flood.wait(10)
                flooded = int(flood.stdout.read().strip() or 0)
            assert flooded > 10_000, f"the flood process sent only {flooded} statuses"
            assert wait_until(lambda: all(pre.handles[r].poll() == TransferPoll.Success for r in sent), 10.0), \
                "rooms' Success statuses were lost in the flood"
        finally:
            pusher.close(0)
        for r in list(pre.handles):
            pre.clear(r)
        pre.check(**{"flood statuses sent": flooded / 1000})


def test_ten_thousand_rooms_outstanding_then_expiring_at_once(engine):
    """10 000 rooms asked for, then all past their deadline within a moment: receive(), poll()
    and stats() stay prompt while the I/O thread fails them all, and clear() of each too."""
    from transfer.status import TransferPoll

    count = 10_000
    with encode_route("reading") as (address, _), \
            Prefill(engine, "10 000 rooms outstanding, expiring at once", deadline_s=3.0) as pre:
        start = time.monotonic()
        for room in range(1, count + 1):
            pre.receive(room, address)
        asked_in = time.monotonic() - start
        rooms = list(pre.handles)
        window = 0
        extra = count
        end = time.monotonic() + 30.0
        while time.monotonic() < end:
            # The scheduler polls a window of its rooms per turn and keeps taking new ones.
            batch = rooms[window : window + 500]
            window = (window + 500) % count
            pre.turn(batch)
            extra += 1
            pre.receive(extra, address)
            if all(terminal(pre.handles[r]) for r in rooms[::97]) and all(terminal(pre.handles[r]) for r in rooms):
                break
        else:
            pytest.fail("10 000 rooms did not all expire within 30 s")
        failed = sum(pre.handles[r].poll() == TransferPoll.Failed for r in rooms)
        assert failed == count
        for room in list(pre.handles):
            pre.clear(room)
        # Holds are reported, not asserted: the flush test below pins the lock's holds.
        pre.check(holds=False, **{"10 000 receives took": asked_in})


# ------------------------------------------------------------------ the I/O thread busy


def test_checksums_of_large_items_do_not_block_the_caller(engine):
    """Success statuses with checksums for 256 MiB items keep the I/O thread summing for seconds;
    receive(), poll(), stats() and clear() (also of rooms being verified) stay prompt, and the
    rooms left alone conclude Success (their bytes match)."""
    import torch

    from transfer import wire
    from transfer.frames import status_frames
    from transfer.status import TransferPoll

    nbytes = 256 << 20
    buffer = torch.arange(nbytes // 8, dtype=torch.int64).view(torch.uint8)
    expected = wire.layer_sum(buffer.data_ptr(), nbytes)
    hidden = 1 << 20
    with encode_route("reading") as (address, _), \
            Prefill(engine, "I/O thread busy checksumming 256 MiB items", buffer=buffer, deadline_s=60.0) as pre:
        big = list(range(1, 121))
        for room in big:
            pre.receive(room, address, rows=nbytes // hidden, hidden=hidden)
        assert wait_until(lambda: all(pre.handles[r].poll() == TransferPoll.WaitingForInput for r in big), 10.0)
        pusher = junk_pusher(HOST, pre.manager.status_port)
        try:
            started = time.monotonic()
            for room in big:
                pusher.send_multipart(status_frames(room, TransferPoll.Success, 0, [expected]))
            small, cleared = 1000, []
            while not all(terminal(pre.handles[r]) for r in big if r in pre.handles):
                small += 1
                pre.receive(small, address)
                pre.turn([small, *big[::10]])
                victim = big[len(cleared) * 6 + 3] if len(cleared) * 6 + 3 < len(big) else None
                if victim is not None and victim in pre.handles:
                    pre.clear(victim)  # cleared while the I/O thread may be summing it
                    cleared.append(victim)
                assert time.monotonic() - started < 60.0, "checksums did not finish within 60 s"
                time.sleep(0.002)
            busy = time.monotonic() - started
        finally:
            pusher.close(0)
        kept = [r for r in big if r not in cleared]
        assert all(pre.handles[r].poll() == TransferPoll.Success for r in kept), \
            {r: pre.handles[r].failure for r in kept if pre.handles[r].poll() != TransferPoll.Success}
        for room in list(pre.handles):
            pre.clear(room)
        pre.check(**{"I/O thread busy checksumming for": busy})
        assert busy > 0.5, f"the checksums took only {busy:.2f}s: the scenario did not load the I/O thread"


def test_clear_from_another_thread_while_rooms_expire_and_conclude(engine):
    """A second thread clears rooms as they conclude (Success pushed, or expired) while the
    scheduler thread receives and polls: neither thread's calls wait on the other or on I/O."""
    from transfer.frames import status_frames
    from transfer.status import TransferPoll

    with encode_route("reading") as (address, _), \
            Prefill(engine, "concurrent clear() from another thread", deadline_s=0.5) as pre:
        other = Latencies("concurrent clear() (the clearing thread)")
        shared: list[Any] = []
        shared_lock = threading.Lock()
        stop = threading.Event()
        cleared = [0]

        def clearer() -> None:
            while not stop.is_set() or shared:
                with shared_lock:
                    batch, shared[:] = list(shared), []
                for handle in batch:
                    if other.call("poll", handle.poll) in (TransferPoll.Success, TransferPoll.Failed):
                        other.call("clear", handle.clear)
                        cleared[0] += 1
                    else:
                        with shared_lock:
                            shared.append(handle)
                time.sleep(0.001)

        thread = threading.Thread(target=clearer, name="clearer", daemon=True)
        thread.start()
        pusher = junk_pusher(HOST, pre.manager.status_port)
        try:
            room = 0
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                for _ in range(20):
                    room += 1
                    handle = pre.receive(room, address)
                    if room % 2:
                        pusher.send_multipart(status_frames(room, TransferPoll.Success, 0))
                    with shared_lock:
                        shared.append(handle)
                pre.turn([room])
                time.sleep(0.002)
            stop.set()
            thread.join(15)
            assert not thread.is_alive(), "the clearing thread did not finish"
        finally:
            stop.set()
            pusher.close(0)
        assert cleared[0] == room, f"{cleared[0]} of {room} rooms cleared"
        assert len(pre.manager._driver.rooms) == 0
        pre.handles.clear()
        other.check()
        pre.check()


# ------------------------------------------------------------------ close() in the middle of it all


def test_close_while_everything_happens_is_bounded_and_concludes_every_room(engine, caplog):
    """close() with a look-up hanging on a silent bootstrap, 3000 rooms waiting on an encode rank
    and a status flood running: close() returns within one look-up's bound, every handle then
    reads Failed, and calls on handles and receive() after close stay prompt."""
    import logging

    from transfer.status import TransferPoll

    caplog.set_level(logging.ERROR, logger="transfer")

    timeout = 1.0
    with encode_route("reading") as (address, _), HostileHTTP("silent") as silent:
        pre = Prefill(engine, "close() during hanging look-ups, 3000 rooms, flood", lookup_timeout_s=timeout)
        try:
            for room in range(1, 3001):
                pre.receive(room, address)
            with status_flood(pre.manager.status_port, 5.0):
                for room in range(5001, 5011):
                    pre.receive(room, silent.address)
                assert wait_until(lambda: silent.accepted > 0, 5.0), "the look-up never reached the silent server"
                pre.turn()
                took = pre.close()
        finally:
            pre.close()
        assert all(handle.poll() == TransferPoll.Failed for handle in pre.handles.values())
        assert {pre.handles[r].failure for r in range(1, 3001)} == {"session manager closed"}
        pre.turn(closed=True)
        with pytest.raises(RuntimeError, match="closed"):
            pre.lat.call("receive after close", pre.manager.receive, 99_999, address, pre.buffer.data_ptr(),
                         1, ROW, "torch.uint8")
        for room in list(pre.handles):
            pre.clear(room)
        pre.lat.check(**{"close()": took})
        # Nothing outlasted close()'s bounds: the I/O thread stopped, the lock was free, and the look-up under
        # way ended at its own timeout (close() gives it that plus 1 s), else close() logs what it left.
        left = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name == "transfer.receiver"]
        assert left == [], left


class _SlowTensor:
    """A destination tensor whose data_ptr() waits for `go`: the caller's thread paused inside receive()."""

    def __init__(self, real: Any, entered: threading.Event, go: threading.Event) -> None:
        self._real, self._entered, self._go = real, entered, go
        self.shape, self.dtype = real.shape, real.dtype

    def is_contiguous(self) -> bool:
        return True

    def dim(self) -> int:
        return 2

    def data_ptr(self) -> int:
        self._entered.set()
        self._go.wait(10)
        return self._real.data_ptr()


def test_a_receive_racing_close_raises_or_concludes_and_touches_no_other_file(engine):
    """A receive() already inside the manager when another thread closes it: it must raise
    'closed' (or return a handle that reads Failed), and write nothing to file descriptors the
    manager no longer owns."""
    import torch

    from transfer.status import is_terminal

    with encode_route("reading") as (address, _):
        pre = Prefill(engine, "receive() racing close()")
        entered, go = threading.Event(), threading.Event()
        dst = _SlowTensor(pre.buffer[:ROW].view(1, ROW), entered, go)
        result: dict[str, Any] = {}

        def scheduler() -> None:
            try:
                result["handle"] = pre.manager.receive(1, address, dst)
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
                result["error"] = exc

        thread = threading.Thread(target=scheduler, name="scheduler", daemon=True)
        thread.start()
        try:
            assert entered.wait(5), "receive() never reached the destination"
            pre.close()
            # Descriptors the manager let go of are the lowest free ones: a new pipe takes them.
            r, w = os.pipe()
            os.set_blocking(r, False)
            go.set()
            thread.join(5)
            assert not thread.is_alive(), "receive() hung after close()"
            try:
                stray = os.read(r, 16)
            except BlockingIOError:
                stray = b""
            os.close(r)
            os.close(w)
        finally:
            go.set()
            pre.close()
        assert stray == b"", f"receive() after close() wrote {stray!r} into an unrelated pipe"
        error = result.get("error")
        if error is not None:
            assert isinstance(error, RuntimeError) and "closed" in str(error), repr(error)
        else:
            handle = result["handle"]
            assert wait_until(lambda: is_terminal(handle.poll()), 2.0), \
                f"a room received during close() stays {handle.poll().name} forever"
        assert torch is not None

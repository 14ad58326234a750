"""The two engine back-ends against hostile peers: transfer.engine (Mooncake, protocol tcp) and transfer.wire_engine.

The "stalled peer" is a real engine in another process that we stop with SIGSTOP: its sockets
stay open and it reads nothing, as a wedged or paused process would; SIGCONT lets it catch up,
and then its landed bytes show whether our side read memory it had already given back."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
from live_helpers import wait_until

from transfer import engine as engine_module
from transfer.engine import Engine, TransferError
from transfer.wire_engine import WireEngine


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import mooncake.engine  # noqa: F401
    _MOONCAKE_MISSING = ""
except ImportError as _error:
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"

#: Big enough that a stopped peer leaves most of it unsent (loopback buffers hold ~30 MB).
STALL_BYTES = 64 << 20

# A peer in its own process: one engine, one registered destination, commands on stdin.
_PEER = r"""
import sys, torch
sys.path.insert(0, sys.argv[3])
kind, n = sys.argv[1], int(sys.argv[2])
if kind == "mooncake":
    from transfer.engine import Engine
    engine = Engine("127.0.0.1", protocol="tcp")
else:
    from transfer.wire_engine import WireEngine
    engine = WireEngine("127.0.0.1")
dst = torch.zeros(n, dtype=torch.uint8)
engine.register(dst)
print(engine.session_id, dst.data_ptr(), flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "counts":  # how many bytes of each value landed
        values, counts = torch.unique(dst, return_counts=True)
        print(" ".join(f"{int(v)}:{int(c)}" for v, c in zip(values, counts)), flush=True)
    elif command == "zero":
        dst.zero_()
        print("ok", flush=True)
    elif command == "quit":
        break
engine.close()
"""


class StoppablePeer:
    """A real engine in a child process that the test can stop (SIGSTOP) and resume."""

    def __init__(self, kind: str, nbytes: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PEER, kind, str(nbytes), REPO],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     stderr=subprocess.DEVNULL)
        self.session_id, addr = self._line(60).split()
        self.addr = int(addr)
        self.stopped = False

    def _line(self, timeout: float) -> str:
        """One answer line, within timeout seconds."""
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            raise RuntimeError(f"peer process gave no answer within {timeout}s")
        return box[0].strip()

    def ask(self, command: str) -> str:
        """Sends a command and returns its answer."""
        self.resume()
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line(60)

    def counts(self) -> dict[int, int]:
        """How many bytes of each value the peer's destination holds."""
        return {int(v): int(c) for v, c in (pair.split(":") for pair in self.ask("counts").split())}

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        if self.stopped:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.stopped = False

    def close(self) -> None:
        self.resume()
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def mooncake_peer():
    """A Mooncake engine in another process with STALL_BYTES registered."""
    if _MOONCAKE_MISSING:
        pytest.skip(_MOONCAKE_MISSING)
    peer = StoppablePeer("mooncake", STALL_BYTES)
    yield peer
    peer.close()


@pytest.fixture
def stalled_mooncake(mooncake_peer):
    """The Mooncake peer, zeroed; the test stops it (after its handshake); resumed afterwards whatever happens."""
    assert mooncake_peer.ask("zero") == "ok"
    yield mooncake_peer
    mooncake_peer.resume()


def _handshake_then_stop(writer: Engine, src: torch.Tensor, peer: StoppablePeer) -> None:
    """Writes the source's first KiB, then stops the peer (a stopped peer never answers Mooncake's handshake)."""
    writer.write(peer.session_id, [src.data_ptr()], [peer.addr], [1024])
    peer.stop()


@pytest.fixture
def wire_peer():
    """A wire engine in another process with STALL_BYTES registered."""
    peer = StoppablePeer("wire", STALL_BYTES)
    yield peer
    peer.close()


def _mooncake(**kwargs) -> Engine:
    return Engine("127.0.0.1", protocol="tcp", **kwargs)


def _filled(n: int, value: int) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.uint8)


def _in_thread(target) -> tuple[threading.Thread, list]:
    """Runs target() in a daemon thread; the list gets ("ok", result) or ("raised", exception)."""
    outcome: list = []

    def body() -> None:
        try:
            outcome.append(("ok", target()))
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            outcome.append(("raised", exc))

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_mooncake_bad_destination_is_refused_before_any_buffer_goes_out():
    """Every destination is checked before any buffer goes out: a bad one in the second buffer
    (negative, past 2**64, or a range wrapping past it) is a ValueError naming the session, and
    the first buffer never lands untracked."""
    with _mooncake() as writer, _mooncake() as reader:
        src = torch.arange(4096, dtype=torch.int64).to(torch.uint8) | 1  # no zero byte
        dst = torch.zeros(8192, dtype=torch.uint8)
        writer.register(src)
        reader.register(dst)
        s, d = src.data_ptr(), dst.data_ptr()
        for bad in (-1, 1 << 64, (1 << 64) - 8):
            with pytest.raises(ValueError, match=re.escape(f"write to {reader.session_id}: destination ")):
                writer.write_async(reader.session_id, [s, s + 100], [d, bad], [100, 16])
            with pytest.raises(ValueError, match="not a range of the 64-bit address space"):
                writer.write(reader.session_id, [s], [bad], [16])
        time.sleep(0.2)
        assert not dst.any(), "a buffer of a refused write landed"
        # The engine still works and tracks nothing stale.
        writer.write(reader.session_id, [s], [d], [4096])
        assert torch.equal(dst[:4096], src)


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_mooncake_registration_refuses_ranges_outside_64_bits():
    """A range that wraps past 2**64, or a negative address, is a ValueError naming it (Mooncake
    itself would register the one and raise pybind's bare TypeError for the other)."""
    with _mooncake() as engine:
        for addr, length in (((1 << 64) - 8, 16), (-4096, 16), (1 << 64, 16), (0, 16)):
            with pytest.raises(ValueError, match=re.escape(f"cannot register address {addr:#x} with length")):
                engine.register(addr, length)
        assert engine.registered() == {}


class _PausingTE:
    """Delegates to the real Mooncake TransferEngine; the first batch submission waits for a go.

    Instrumentation, not a fake: every call reaches the real engine, later."""

    def __init__(self, real) -> None:
        self._real = real
        self.paused = threading.Event()
        self.go = threading.Event()

    def batch_transfer_async_write(self, *args):
        if not self.paused.is_set():
            self.paused.set()
            self.go.wait(30)
        return self._real.batch_transfer_async_write(*args)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_mooncake_close_waits_for_a_write_being_submitted():
    """close() waits for a write that is between its checks and filing its ticket: it must not
    unregister the sources, let their tensors go or drop the engine while that write goes on."""
    with _mooncake() as reader:
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        reader.register(dst)
        writer = _mooncake()
        src = _filled(1 << 20, 5)
        writer.register(src)
        gate = writer._te = _PausingTE(writer._te)
        writing, write_outcome = _in_thread(
            lambda: writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [1 << 20]))
        assert gate.paused.wait(30)
        closing, close_outcome = _in_thread(writer.close)
        closing.join(1.0)
        returned_early = not closing.is_alive()
        gate.go.set()
        writing.join(60)
        closing.join(60)
        assert not writing.is_alive() and not closing.is_alive()
        assert not returned_early, "close() returned while a write was being submitted"
        assert write_outcome == [("ok", None)], write_outcome
        assert close_outcome == [("ok", None)], close_outcome
        assert torch.equal(dst, src)


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_mooncake_ticket_settled_by_close_still_tells_its_owner():
    """close() settles the tickets in flight without dropping them: the owner's next poll() reads
    the landed write's outcome (once), not 'unknown write ticket'."""
    with _mooncake() as reader:
        dst = torch.zeros(8 << 20, dtype=torch.uint8)
        reader.register(dst)
        writer = _mooncake()
        src = _filled(8 << 20, 6)
        writer.register(src)
        ticket = writer.write_async(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [8 << 20])
        writer.close()
        assert writer.poll(ticket) is True
        assert torch.equal(dst, src)
        with pytest.raises(TransferError, match=f"unknown write ticket {ticket}"):
            writer.poll(ticket)  # settled once only


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_mooncake_write_after_close_began_is_refused_cleanly(monkeypatch):
    """A write that passed its checks just before close() checks again when filing its ticket:
    it is refused with the engine's name, nothing is written, and close() completes."""
    paused, go = threading.Event(), threading.Event()
    checked = engine_module.check_batch

    def pausing(*args):
        """Waits after validating the first batch: the moment close() may come in between."""
        batch = checked(*args)
        if not paused.is_set():
            paused.set()
            go.wait(30)
        return batch

    monkeypatch.setattr(engine_module, "check_batch", pausing)  # what write_async validates its batch with
    with _mooncake() as reader:
        dst = torch.zeros(4096, dtype=torch.uint8)
        reader.register(dst)
        writer = Engine("127.0.0.1", protocol="tcp")
        src = _filled(4096, 3)
        writer.register(src)
        writing, outcome = _in_thread(
            lambda: writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [4096]))
        assert paused.wait(30)
        closing, close_outcome = _in_thread(writer.close)
        closing.join(30)
        go.set()
        writing.join(30)
        assert close_outcome == [("ok", None)]
        assert len(outcome) == 1 and outcome[0][0] == "raised", outcome
        error = outcome[0][1]
        assert isinstance(error, TransferError) and f"engine {writer.session_id} is closed" in str(error), repr(error)
        time.sleep(0.2)
        assert not dst.any()


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_mooncake_write_to_a_stopped_peer_settles_at_the_transfer_timeout(stalled_mooncake, monkeypatch):
    """Mooncake's non-blocking status call has no deadline: wait() (and write()) to a peer that
    stopped reading would block for as long as the peer stays stopped. The ticket fails at
    MC_TRANSFER_TIMEOUT, as the module promises, naming the peer, and its source stays registered
    (refused by unregister()) until Mooncake is done reading it."""
    peer = stalled_mooncake
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")  # Mooncake's minimum
    with _mooncake() as writer:
        src = _filled(STALL_BYTES, 7)
        writer.register(src)
        _handshake_then_stop(writer, src, peer)
        started = time.monotonic()
        waiting, outcome = _in_thread(
            lambda: writer.write(peer.session_id, [src.data_ptr()], [peer.addr], [STALL_BYTES]))
        waiting.join(5 + 10)
        elapsed = time.monotonic() - started
        settled = not waiting.is_alive()
        if settled:
            with pytest.raises(TransferError, match="still being read by a write to " + re.escape(peer.session_id)):
                writer.unregister(src.data_ptr())
        peer.resume()
        waiting.join(60)
        assert settled, f"write() to a stopped peer still blocked after {elapsed:.1f}s (MC_TRANSFER_TIMEOUT=5)"
        assert elapsed >= 4.5  # not before its transfer timeout
        kind, error = outcome[0]
        assert kind == "raised" and isinstance(error, TransferError), outcome
        assert f"write to {peer.session_id} failed (still in flight after the transfer timeout of 5s" in str(error)
        # Once the peer caught up, Mooncake settles the batch and the region can go.

        def unregistered() -> bool:
            try:
                writer.unregister(src.data_ptr())
                return True
            except TransferError:
                return False

        assert wait_until(unregistered, 60, 0.05)
        assert peer.counts() == {7: STALL_BYTES}


def _writer_of_a_stopped_peer(peer: StoppablePeer, monkeypatch) -> tuple[Engine, torch.Tensor]:
    """A Mooncake engine with a 5 s transfer timeout and a registered source of 9s, that wrote to
    `peer` before stopping it."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    writer = _mooncake()
    src = _filled(STALL_BYTES, 9)
    writer.register(src)
    _handshake_then_stop(writer, src, peer)
    return writer, src


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_mooncake_close_is_bounded_with_a_stopped_peer(stalled_mooncake, monkeypatch):
    """close() waits for the tickets in flight only up to the transfer timeout (a peer that stopped
    reading would keep it forever), then destroys the transport before letting the registered
    tensors go."""
    peer = stalled_mooncake
    writer, src = _writer_of_a_stopped_peer(peer, monkeypatch)
    kept = weakref.ref(src)
    writer.write_async(peer.session_id, [src.data_ptr()], [peer.addr], [STALL_BYTES])
    del src  # only the engine keeps it alive now
    started = time.monotonic()
    closing, outcome = _in_thread(writer.close)
    closing.join(5 + 10)
    elapsed = time.monotonic() - started
    bounded = not closing.is_alive()
    peer.resume()
    closing.join(60)
    assert bounded, f"close() still waiting after {elapsed:.1f}s for a peer that stopped reading"
    assert outcome == [("ok", None)]
    assert kept() is None and writer.registered() == {}


def _second_close_waits_for_the_first(writer, peer) -> None:
    """close() from a second thread while the first waits for a write to the stopped `peer`: the
    second returns only once the memory is released, never while a peer may still write into it."""
    first, first_outcome = _in_thread(writer.close)
    try:
        assert wait_until(lambda: writer.closed, 10)
        second, second_outcome = _in_thread(writer.close)
        second.join(60)
        assert second_outcome == [("ok", None)]
        assert writer.registered() == {}, "a close() returned with the engine's memory still registered"
    finally:
        peer.resume()
        first.join(60)
    assert first_outcome == [("ok", None)]


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_mooncake_a_second_close_returns_once_the_first_released_the_memory(stalled_mooncake, monkeypatch):
    peer = stalled_mooncake
    writer, src = _writer_of_a_stopped_peer(peer, monkeypatch)
    writer.write_async(peer.session_id, [src.data_ptr()], [peer.addr], [STALL_BYTES])
    _second_close_waits_for_the_first(writer, peer)


def test_wire_a_second_close_returns_once_the_first_released_the_memory(wire_peer):
    wire_peer.stop()
    writer = WireEngine(reply_timeout_s=3.0)
    src = _filled(STALL_BYTES, 4)
    writer.register(src)
    writer.write_async(wire_peer.session_id, [src.data_ptr()], [wire_peer.addr], [STALL_BYTES])
    _second_close_waits_for_the_first(writer, wire_peer)


def _unregister_during_a_stalled_write(writer, src, peer) -> None:
    """Writes `src` (filled with 7s) to the stopped `peer`, tries to unregister it mid-write and
    reuse it, resumes the peer: the engine must have refused, and only the 7s may have landed."""
    ticket = writer.write_async(peer.session_id, [src.data_ptr()], [peer.addr], [STALL_BYTES])
    time.sleep(0.5)
    assert not writer.poll(ticket)
    try:
        writer.unregister(src.data_ptr())
        refused = None
        src.fill_(1)  # the memory is the caller's again: it reuses it
    except TransferError as exc:
        refused = str(exc)
    peer.resume()
    writer.wait(ticket, timeout_s=60)
    counts = peer.counts()
    assert refused is not None, f"unregister() returned while the write was in flight; the peer got {counts}"
    assert f"is still being read by a write to {peer.session_id} in flight" in refused
    assert counts == {7: STALL_BYTES}
    writer.unregister(src.data_ptr())  # settled: now it goes
    assert writer.registered() == {}


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_mooncake_unregister_refuses_a_source_still_being_read(stalled_mooncake):
    """unregister() refuses a source region (and keeps the tensor alive for it) while a write
    still reads it: bytes the caller writes afterwards never reach the peer."""
    peer = stalled_mooncake
    with _mooncake() as writer:
        src = _filled(STALL_BYTES, 7)
        writer.register(src)
        _handshake_then_stop(writer, src, peer)
        _unregister_during_a_stalled_write(writer, src, peer)


def test_wire_writes_work_with_descriptors_past_1024():
    """In a process with many sockets open, descriptors >= FD_SETSIZE (which select() refuses with
    a bare ValueError) still carry writes, and idle connections are reused."""
    with WireEngine() as writer, WireEngine() as reader:
        src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        dst = torch.zeros(1 << 16, dtype=torch.uint8)
        writer.register(src)
        reader.register(dst)
        padding = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        try:
            for i in range(3):
                writer.write(reader.session_id, [src.data_ptr() + i], [dst.data_ptr() + i], [1000 * (i + 1)])
                assert torch.equal(dst[i:i + 1000 * (i + 1)], src[i:i + 1000 * (i + 1)])
        finally:
            for fd in padding:
                os.close(fd)
        assert writer.stats()["connections_opened"] == 1


def test_wire_idle_connections_to_departed_peers_are_dropped():
    """A peer that went away (restarted on another port) does not keep its idle connection in the
    pool for the engine's lifetime: no socket stays in CLOSE_WAIT per departed peer."""
    with WireEngine() as writer, WireEngine() as live:
        src = _filled(4096, 2)
        writer.register(src)
        dst = torch.zeros(4096, dtype=torch.uint8)
        live.register(dst)
        fds_before = len(os.listdir("/proc/self/fd"))
        for _ in range(6):
            with WireEngine() as peer:
                landing = torch.zeros(4096, dtype=torch.uint8)
                peer.register(landing)
                writer.write(peer.session_id, [src.data_ptr()], [landing.data_ptr()], [4096])
                assert torch.equal(landing, src)
        writer.write(live.session_id, [src.data_ptr()], [dst.data_ptr()], [4096])
        assert torch.equal(dst, src)
        assert writer.stats()["idle_connections"] == 1
        # Only the connection to the live peer is left: our end and the listener's.
        assert len(os.listdir("/proc/self/fd")) <= fds_before + 2


def test_wire_idle_connections_to_peers_that_never_hung_up_go_after_the_idle_bound():
    """A peer that went away without closing its connections (its host gone, or the process frozen: no
    FIN ever comes, so the connection never looks hung up) does not keep its idle connection for the
    engine's lifetime: one idle past idle_timeout_s is closed when the next connection is opened."""
    peers = [StoppablePeer("wire", 4096) for _ in range(2)]
    try:
        with WireEngine(idle_timeout_s=1.0) as writer, WireEngine() as live:
            src = _filled(4096, 3)
            writer.register(src)
            dst = torch.zeros(4096, dtype=torch.uint8)
            live.register(dst)
            fds_before = len(os.listdir("/proc/self/fd"))
            for peer in peers:
                writer.write(peer.session_id, [src.data_ptr()], [peer.addr], [4096])
                peer.stop()
            assert writer.stats()["idle_connections"] == 2
            time.sleep(1.1)  # past the idle bound, counted from each transfer's start
            writer.write(live.session_id, [src.data_ptr()], [dst.data_ptr()], [4096])
            assert torch.equal(dst, src)
            assert writer.stats()["idle_connections"] == 1
            # Only the connection to the live peer is left: our end and the listener's.
            assert len(os.listdir("/proc/self/fd")) <= fds_before + 2
    finally:
        for peer in peers:
            peer.close()


def test_wire_peer_that_stops_reading_costs_one_reply_timeout(wire_peer, monkeypatch):
    """After a send timed out, the sender reads an answer only when one is waiting: it does not wait
    a second full reply timeout for an answer a peer which stopped reading never sends."""
    from transfer import wire

    answers_read = []
    read_frame = wire.read_frame

    def noted_read_frame(*args, **kwargs):
        answers_read.append(args)
        return read_frame(*args, **kwargs)

    monkeypatch.setattr(wire, "read_frame", noted_read_frame)
    wire_peer.stop()
    with WireEngine(reply_timeout_s=3.0) as writer:
        src = _filled(STALL_BYTES, 4)
        writer.register(src)
        with pytest.raises(TransferError) as caught:
            writer.write(wire_peer.session_id, [src.data_ptr()], [wire_peer.addr], [STALL_BYTES])
    assert f"write to {wire_peer.session_id} failed: write: timed out after 3 s without progress" in str(caught.value)
    # Nothing was waiting on the connection, so no read of an answer began (each would wait a reply timeout).
    assert answers_read == [], f"{len(answers_read)} answer read(s) after the send timed out"


class PeerPort:
    """A loopback port whose first connection a thread hands to `_handle` (each wait on it bounded
    by `conn_timeout`) until close()."""

    def __init__(self, rcvbuf: int = 0, conn_timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.session_id = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conn_timeout = conn_timeout
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        self.sock.settimeout(30)
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(self.conn_timeout)
            try:
                self._handle(conn)
            except OSError:
                return

    def _handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


class DribblingPeer(PeerPort):
    """A port that accepts and then reads 16 KiB every 20 ms (at most about 0.8 MB/s) through a 16 KiB
    receive buffer: progress well within every reply timeout, never an answer."""

    def __init__(self) -> None:
        super().__init__(rcvbuf=16384, conn_timeout=1.0)
        self.read = 0
        self.thread.start()

    def _handle(self, conn: socket.socket) -> None:
        while not self.stop.is_set():
            data = conn.recv(16384)
            if not data:
                return
            self.read += len(data)
            time.sleep(0.02)


def test_wire_peer_that_reads_slower_than_the_least_rate_is_given_up_at_its_bound():
    """A peer that reads a little just inside every reply timeout cannot hold a writer (and close())
    for as long as the transfer takes at its pace: the write phase has the reply timeout plus its
    bytes at the least rate."""
    peer = DribblingPeer()
    nbytes, rate = 32 << 20, 32 << 20
    try:
        with WireEngine(reply_timeout_s=2.0, min_rate_bps=rate) as writer:
            src = _filled(nbytes, 3)
            writer.register(src)
            started = time.monotonic()
            with pytest.raises(TransferError) as caught:
                writer.write(peer.session_id, [src.data_ptr()], [0x10000], [nbytes])
            elapsed = time.monotonic() - started
    finally:
        peer.close()
    message = str(caught.value)
    assert re.search(r"write: the peer took \d+ of \d+ bytes in [\d.]+ s, behind the least rate of "
                     rf"{rate} bytes/s; transfer stopped", message), message
    assert peer.read < nbytes
    # The bound is 2 s + 1 s of bytes at the least rate (the peer's own pace would take about 40 s, and the
    # write would land): not cut before it.
    assert elapsed >= 2.9, f"took {elapsed:.1f} s for a bound of 3 s"


class AnsweringPeer(PeerPort):
    """A port that takes one transfer whole (frames up to FIRST) and then runs `answer(conn, stop)`."""

    def __init__(self, answer) -> None:
        from transfer import wire

        super().__init__()
        self._wire = wire
        self.answer = answer
        self.thread.start()

    def _handle(self, conn: socket.socket) -> None:
        while self._wire.read_frame(conn)[0] != self._wire.FIRST:
            pass
        self.answer(conn, self.stop)


def _write_to(peer: AnsweringPeer, **engine_args) -> tuple[str, bool]:
    """(what a 64-byte write to the peer raised, whether close() after it returned, within 30 s, while
    the peer was still at it)."""
    writer = WireEngine(**engine_args)
    try:
        src = _filled(64, 8)
        writer.register(src)
        with pytest.raises(TransferError) as caught:
            writer.write(peer.session_id, [src.data_ptr()], [0x10000], [64])
    finally:
        closing = threading.Thread(target=writer.close, daemon=True)
        closing.start()
        closing.join(30)
        closed = not closing.is_alive()
        peer.close()
    return str(caught.value), closed


def test_wire_peer_that_dribbles_its_answer_is_given_up_at_its_bound():
    """An answer announced as 4001 bytes, one byte every 0.3 s (within every reply timeout): the
    answer gets the reply timeout plus its most bytes (64 KiB) at the least rate, 1.25 s here."""
    def dribble(conn, stop):
        conn.sendall((4002).to_bytes(4, "little"))
        while not stop.wait(0.3):
            conn.sendall(b"\x14")

    message, closed = _write_to(AnsweringPeer(dribble), reply_timeout_s=1.0, min_rate_bps=256 * 1024)
    assert "read: the frame did not come whole within 1.25 s; read stopped" in message, message
    assert closed, "close() waited on the peer still dribbling its answer"


def test_wire_peer_announcing_an_answer_over_64_kib_is_refused_before_it_is_read():
    def huge(conn, stop):
        conn.sendall((32 << 20).to_bytes(4, "little") + b"\x15")
        stop.wait(10)

    # Refused for its size, not read: reading it would end in the reply timeout (5 s) or the peer's close.
    message, _ = _write_to(AnsweringPeer(huge), reply_timeout_s=5.0)
    assert "read: frame payload of 33554431 bytes exceeds the limit of 65536 bytes" in message, message


def test_wire_peer_refusing_with_a_long_reason_is_quoted_in_part():
    def refuse(conn, stop):
        from transfer import wire

        wire.write_frame(conn, wire.ERROR, wire.Msg({"room": 1}, b"why " * 5000).encode())
        stop.wait(5)

    message, _ = _write_to(AnsweringPeer(refuse), reply_timeout_s=5.0)
    assert "refused by the peer: why why" in message and "... (20000 bytes)" in message, message[:300]
    assert len(message) < 1000, len(message)


def test_wire_refused_transfer_still_reports_the_peers_reason(wire_peer):
    """The early-answer path still reads the listener's ERROR when our send fails after it."""
    with WireEngine() as writer:
        src = _filled(STALL_BYTES, 4)
        writer.register(src)
        wrong = wire_peer.addr + STALL_BYTES - 4096  # runs past the peer's region
        with pytest.raises(TransferError, match="refused by the peer: .*is not inside registered memory"):
            writer.write(wire_peer.session_id, [src.data_ptr()], [wrong], [STALL_BYTES])
    assert wire_peer.counts() == {0: STALL_BYTES}


def test_wire_batch_finished_before_close_still_tells_its_owner():
    """close() keeps the batches it settled: an owner polling a write that landed reads its outcome
    (once), not 'batch N is unknown'."""
    with WireEngine() as reader:
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        reader.register(dst)
        writer = WireEngine()
        src = _filled(1 << 20, 6)
        writer.register(src)
        batch = writer.write_async(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [1 << 20])
        # Under way before close() (a batch still queued then fails as closed, by design).
        assert wait_until(lambda: reader.stats()["bytes_received"] == 1 << 20, 30)
        writer.close()
        assert writer.poll(batch) is True
        assert torch.equal(dst, src)
        with pytest.raises(TransferError, match=f"batch {batch} is unknown"):
            writer.poll(batch)  # settled once only


def test_wire_unregister_refuses_a_source_still_being_read(wire_peer):
    """unregister() refuses a source while write_async still streams it: bytes the caller writes
    afterwards never reach the peer."""
    with WireEngine(reply_timeout_s=60) as writer:
        src = _filled(STALL_BYTES, 7)
        writer.register(src)
        wire_peer.stop()
        _unregister_during_a_stalled_write(writer, src, wire_peer)


def test_wire_unregister_refuses_a_source_whose_write_is_still_queued(wire_peer):
    """A write_async() queued behind another to the same peer reads its source once it runs:
    unregister() refuses that source while it waits, so memory registered again at the same
    address (the caller reusing it) is never what reaches the peer."""
    ahead_bytes, queued_bytes = STALL_BYTES - (1 << 20), 1 << 20
    with WireEngine(writers_per_peer=1, reply_timeout_s=60) as writer:
        ahead, queued_src = _filled(ahead_bytes, 4), _filled(queued_bytes, 7)
        writer.register(ahead)
        writer.register(queued_src)
        wire_peer.stop()
        first = writer.write_async(wire_peer.session_id, [ahead.data_ptr()], [wire_peer.addr], [ahead_bytes])
        queued = writer.write_async(wire_peer.session_id, [queued_src.data_ptr()], [wire_peer.addr + ahead_bytes],
                                    [queued_bytes])
        time.sleep(0.5)
        assert not writer.poll(queued)
        try:
            writer.unregister(queued_src.data_ptr())
            refused = None
            queued_src.fill_(1)  # the memory is the caller's again: it reuses it, registered anew
            writer.register(queued_src)
        except TransferError as exc:
            refused = str(exc)
        wire_peer.resume()
        writer.wait(first, timeout_s=60)
        writer.wait(queued, timeout_s=60)
        counts = wire_peer.counts()
    assert refused is not None, f"unregister() returned while a write of that source was queued; the peer got {counts}"
    assert f"is still being read by a write to {wire_peer.session_id} in flight" in refused
    assert counts == {4: ahead_bytes, 7: queued_bytes}


def test_wire_writes_queued_behind_a_stopped_peer_fail_unsent_at_their_bound(wire_peer):
    """A write_async() batch that waited in its peer's queue past queue_timeout_s fails without sending a
    byte: writes queued behind a peer that stopped reading neither wait a reply timeout each for their
    turn nor land whenever the peer comes back, long after their rooms were given up."""
    size = 16 << 20
    wire_peer.stop()
    # Small chunks, so that whatever a write left in the socket buffers is whole chunks that land on resume.
    with WireEngine(writers_per_peer=1, reply_timeout_s=3.0, queue_timeout_s=1.0, chunk_bytes=1 << 16) as writer:
        sources = [_filled(size, value) for value in (1, 2, 3)]
        for source in sources:
            writer.register(source)
        batches = [writer.write_async(wire_peer.session_id, [source.data_ptr()], [wire_peer.addr + i * size], [size])
                   for i, source in enumerate(sources)]
        outcomes = []
        for batch in batches:
            try:
                writer.wait(batch, timeout_s=60)
                outcomes.append("landed")
            except TransferError as exc:
                outcomes.append(str(exc))
        wire_peer.resume()
        time.sleep(1.0)  # the peer's listener copies what the stalled write left buffered
        counts = wire_peer.counts()
    assert "timed out after 3 s without progress" in outcomes[0]
    for outcome in outcomes[1:]:
        assert re.search(rf"write to {wire_peer.session_id} not started: it waited \d+\.\d s in the queue of "
                         r"that peer's writes \(queue_timeout_s=1\)", outcome), outcome
    # Failed "not started" (above), not sent in turn: none waited a reply timeout of its own.
    assert set(counts) <= {0, 1}, f"bytes of writes that had waited past their bound landed: {counts}"

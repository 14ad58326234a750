"""The `wire` data path: the Engine interface over the framed wire of SPEC.md section 9.

It needs no Mooncake wheel and no RDMA stack: a native listener (native/wire_listener.c,
pthreads, never the GIL) receives transfers on a TCP port, checks every destination
against the regions registered with it and every chunk's checksum, and only then copies
the bytes into place. The sender streams straight from the source memory: one native
call (``_native.wire_transfer``) checksums and writes a whole transfer and reads its
answer in a single release of the GIL, a transfer of one chunk being one gather write.

Session id: ``host:port`` of the receiver's listener (advertised in the registration
and TransferInfo frames exactly like a Mooncake session id). Never a wildcard such as ``0.0.0.0``:
there a peer on another host would connect to its own host, so an engine refuses to start on one
(ConfigError) and a sender to connect to one (EngineError).

One transfer (one ``write()`` call) on a connection
---------------------------------------------------
1. PREFILL (kind 3), payload a Msg (sorted ``key=value`` lines, blank line, empty body)::

       bytes<i>=<decimal>   length of layer i, for i in 0..layers-1
       layers=<decimal>     how many layers follow, 1..16
       ptr=<decimal>        destination of layer 0 (must equal ptr0)
       ptr<i>=<decimal>     destination address of layer i (u64, decimal)
       room=<decimal>       the transfer's id, echoed in the answer (a per-engine counter)
       row_bytes=<decimal>  bytes of one layer-0 row
       rows=<decimal>       rows of every layer (u32); rows * row_bytes must equal bytes0,
                            and every other layer's bytes must be a multiple of rows

   A layer is one ``(src, dst, length)`` entry of the write: layer 0 the embedding rows,
   layer 1 the deepstack rows. Zero-length entries are left out before the message is built.
   The listener refuses the transfer before reading any data when the header is not one
   ``Msg.decode`` takes (``PREFILL: a message that is not UTF-8`` / ``PREFILL: a header line
   without '=': "<line>"``), a field is missing or not a u64 as ``Msg.number`` reads it
   (``PREFILL: missing <k>`` / ``PREFILL: <k>: not a number``), a layer announces
   0 bytes (``PREFILL: layer <i> announces 0 bytes; every layer must carry some``: an empty
   transfer would need no registered destination), the geometry does not add up, or a
   destination ``[ptr<i>, ptr<i> + bytes<i>)`` wraps or is not wholly
   inside one registered region (``layer <i>: destination [0x.., 0x..) (N bytes) is not
   inside registered memory``).
2. LAYER frames (kind 10), in layer order, each carrying the next chunk of its layer:
   u32 LE layer, u32 LE rows, u64 LE layer_sum of the chunk, then 1..chunk_limit bytes
   (4 MiB by default). A chunk lands at ``ptr<i>`` plus the bytes of that layer received
   so far. The listener reads each chunk into a per-connection bounce buffer, checks its
   size against the chunk limit and the layer's remaining bytes (before reading it), its
   layer index and rows, and its checksum, then copies it under the region table's read
   lock (so ``unregister()`` waits for a copy in progress and no copy starts after it).
3. FIRST (kind 11), empty payload, after exactly the announced bytes.

Answer: RESULT (kind 20) Msg ``bytes=<total>``, ``room=<room>``, empty body; the
connection stays open for the next transfer. Or ERROR (kind 21) Msg ``room=<room>`` (absent
when the PREFILL could not be read) whose body is the reason as UTF-8 text; the listener
then drops the connection. The sender reads an answer of at most 64 KiB (``MAX_ANSWER``;
a longer one is refused before it is read), within the reply timeout plus 64 KiB at the
least rate in all (``read: the frame did not come whole within T s; read stopped``), and
quotes at most 512 characters of an ERROR's reason. Bytes of earlier chunks of a failed
transfer may have landed (inside registered memory only); the room fails as a whole.

Connections: the sender keeps idle connections per peer session and reuses them; a
connection the peer closed is noticed before reuse, and whenever a new connection is opened
the idle ones of every session whose peer hung up are closed (a peer that restarted on
another port never takes its old ones back; live peers keep theirs), and so are those whose
last transfer began more than ``idle_timeout_s`` ago (a peer whose host went away, or that froze,
never hangs up; a live listener with the same bound has closed its end of them by then); a write that fails on a reused connection before any byte of it
was accepted, or because the peer closed that connection without a word (as a listener that
evicts or times out an idle connection does, which can land just after the check before
reuse), is sent again once on a fresh one, within what the first send left of the reply timeout (its connect
included): the copies go to the same destinations, so a second send lands the same bytes. Readiness is asked with poll(), never
select(), which refuses descriptors past 1023 in a process with many sockets open.
The listener closes a fresh connection that sends nothing for the first-byte bound
(``first_byte_timeout_s``, 10 s by default, never more than the idle timeout) with an ERROR
``read: nothing received within T s of connecting (the first-byte bound); connection closed``
and counts it in ``stats()["silent"]``; a connection that carried a transfer keeps the idle
timeout. When all ``max_connections`` are taken, a new connection closes the one furthest
behind the listener's least rate (an idle one: idle longest) among those that may go: one
that has sent nothing since it connected at any age (it holds nothing), any other once it is
``evict_after_s`` behind (1 s by default), never one whose bytes are already waiting; counted
in ``stats()["evicted"]``. So idle, silent or dribbling connections never keep new senders
out, even silent ones opened faster than ``max_connections`` a second; only when none may go
is it answered "listener busy" (always, with a negative ``evict_after_s``).
A transfer closed that way is answered ERROR ``read: closed by the listener for a new
connection: ...`` (an idle connection is just closed).

write_async(): each peer session has its own FIFO queue, and a batch's sources count as read from
the moment it is queued (unregister() refuses them until it is over, as for a write under way).
A lone busy peer runs at most
``writers_per_peer`` (``WRITERS_PER_PEER``, 4, by default) of its writes at once; peers with
writes queued or running share that many, at least one each (``MAX_WRITERS`` threads in
all). So a peer that stops reading holds only its own writers, each for at most the reply
timeout, while writes to other peers go on; one that reads, but slower than the least rate
(``min_rate_bps``, 256 KiB/s by default, the listener's bound too), fails the write once the
reply timeout plus the transfer's bytes at that rate have passed: ``write: the peer took S of
T bytes in E s, behind the least rate of R bytes/s; transfer stopped``. A batch whose turn in its
peer's queue comes more than ``queue_timeout_s`` (the reply timeout by default) after it was
queued fails then without sending a byte (``write to <session> not started: it waited W s in the
queue of that peer's writes ...``), so writes queued behind a peer that stopped reading neither
wait a reply timeout for each write ahead of them nor start, and land, whenever that peer comes
back. Its turn comes when a write ahead of it ends, so it fails no sooner than that: behind a
peer that stopped reading, after the reply timeout, whatever a shorter ``queue_timeout_s`` says.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from transfer import _io, _native, wire
from transfer._forks import forks
from transfer._resolve import connect_within
from transfer.config import check_seconds
from transfer.core.failure import printable
from transfer.core.registrations import Registrations
from transfer.engine import RegisteredMemory, _buffer_span, check_batch
from transfer.errors import ConfigError, EngineError, UsageError
from transfer.ports import PortSpec, bind_port, is_wildcard, listen_error

log = logging.getLogger(__name__)

#: Data bytes per LAYER frame, and the listener's bounce-buffer size by default.
CHUNK_BYTES = 4 << 20
MAX_CONNECTIONS = 4096  # the native listener's bound on its connection slots
#: The least rate of a transfer, both ways (bytes/s): far below any real link, yet a peer that
#: reads or sends slower than this cannot hold a connection or a writer thread for long.
MIN_RATE_BPS = 256 * 1024
#: How long a transfer in runs before the least rate applies, in receive timeouts.
RATE_GRACE_TIMEOUTS = 2
#: Idle connections kept per peer session; more are closed when they come back.
IDLE_PER_SESSION = 8
#: write_async() batches of a lone busy peer that run at once (more wait in its queue), shared
#: among the peers with writes (at least one each), by default (WireEngine(writers_per_peer=)
#: sets it per engine). More than one hides the wait for a transfer's reply behind the next
#: transfer's bytes; a few are enough for that, and each more is a thread competing for the cores.
WRITERS_PER_PEER = 4
#: Threads that carry write_async() batches in all, so that writes to different peers overlap.
MAX_WRITERS = 64


_U32_MAX = 2**32 - 1
#: How much of a peer's ERROR reason is kept (the listener's own are at most 512 bytes).
_REASON_MAX = 512

#: What a peer that does not speak the wire (a Mooncake engine, an HTTP server) most likely is.
_NOT_A_LISTENER = ("the peer does not answer as a wire listener: is it a Mooncake engine or another server? "
                   "both sides must use the same protocol")


def _split_session(session_id: str) -> tuple[str, int]:
    """('host', port) from 'host:port' (an IPv6 host may be bracketed; the port in 1..65535)."""
    host, sep, port = session_id.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not host:
        raise EngineError(f"session id {session_id!r} is not host:port")
    # A peer's session id: int() gets only the significant digits, so leading zeros read as the port and
    # a part of more than 4300 digits never meets int()'s own limit (a ValueError).
    digits = port.lstrip("0")
    if len(digits) > 5 or not 1 <= int(digits or "0") <= 65535:
        # getaddrinfo would take it modulo 65536 and write to another listener.
        raise EngineError(f"session id {session_id!r}: port {port} is outside 1..65535")
    if is_wildcard(host):
        # Connecting there reaches a listener on this host, which may take bytes meant for the peer.
        raise EngineError(f"session id {session_id!r} names a wildcard address, not the peer's: "
                          f"its engine must be started with the IP address peers reach it on")
    return host.strip("[]"), int(digits)


def _check_advertised(hostname: str) -> None:
    """ConfigError for a wildcard hostname: the session id built from it is where peers connect."""
    if isinstance(hostname, str) and is_wildcard(hostname):
        raise ConfigError(f"hostname {hostname!r} is a wildcard address: peers connect to the session id "
                          f"(hostname:port), and there it would name their own host; give this node's IP address "
                          f"(the one peers reach it on)")


class _Refused(Exception):
    """The peer answered ERROR: the reason is its message."""


def _reason(body: bytes) -> str:
    """An ERROR's body as the reason a room's failure and the logs carry: printable text (a peer's
    newline or terminal escape must not forge a log line), cut to _REASON_MAX."""
    reason = body.decode("utf-8", "replace") or "no reason given"
    if len(reason) > _REASON_MAX:
        reason = f"{reason[:_REASON_MAX]}... ({len(body)} bytes)"
    return printable(reason)


#: What the listener's ERROR says when its read of a transfer's bytes timed out (wire_listener.c).
_PEER_READ_TIMED_OUT = "timed out waiting for the peer"


def _failure_words(exc: BaseException) -> tuple[str, str]:
    """How a failed write reads: the verb for `exc` (a refusal only where the peer refused the transfer, not where
    its read of our bytes timed out) and a hint that follows the sizes ("" when none)."""
    if isinstance(exc, _Refused):
        if _PEER_READ_TIMED_OUT in str(exc):
            return ("timed out at the peer", "; the peer stopped waiting for the rest of its bytes, which did not "
                                             "reach it within its receive timeout: was the link down, or this "
                                             "sender held up?")
        return "refused by the peer", ""
    if isinstance(exc, TimeoutError) or (isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT):
        return "failed", "; the peer did not answer in time: was the link down, or is the peer stopped or wedged?"
    if isinstance(exc, OSError) and (exc.errno in (errno.ECONNRESET, errno.EPIPE) or "connection closed" in str(exc)):
        return "failed", "; the peer closed the connection mid-transfer: did its receiver stop or close?"
    return "failed", ""


class _Conn:
    """One TCP connection to a peer's listener."""

    def __init__(self, session_id: str, timeout_s: float, connect_timeout_s: float) -> None:
        """Connects to session_id's listener; OSError naming the connect when it fails."""
        host, port = _split_session(session_id)
        try:
            self.sock = connect_within(host, port, time.monotonic() + connect_timeout_s)
        except OSError as exc:
            said = f"connect to {host}:{port}: {exc.strerror or exc} (connect_timeout_s={connect_timeout_s:g})"
            raise (type(exc)(said) if exc.errno is None else type(exc)(exc.errno, said)) from None
        self.sock.settimeout(timeout_s)  # the idle bound of every frame read and write
        self.fresh = True
        self.used_at = 0.0  # when its last transfer started (monotonic), set as it goes back to the pool

    def stale(self) -> bool:
        """True when the peer spoke or hung up while the connection sat idle."""
        try:
            return self.peer_spoke()
        except (OSError, ValueError):
            return True

    def peer_spoke(self) -> bool:
        """True when an answer (an early ERROR) or a hang-up is waiting to be read."""
        poller = select.poll()  # select() fails outright on a descriptor past FD_SETSIZE (1024)
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def hung_up(self) -> bool:
        """True when the peer closed the connection without an answer: only its end is left to read."""
        try:
            if not self.peer_spoke():
                return False
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True  # reset

    def close(self) -> None:
        """Closes the socket."""
        try:
            self.sock.close()
        except OSError:
            pass


class _WriterPool:
    """Threads for write_async(): a FIFO queue per key (a peer session), and total threads in all.

    At most per_peer of a lone key's jobs run at once; keys with jobs queued or running share
    per_peer (at least one each). A free thread serves the keys in turn. So a peer that stopped
    reading holds only its share of the threads (each for a reply timeout), and writes to
    healthy peers do not wait behind it.

    Each job wakes at most one parked thread, and a thread that finishes a job takes the next
    itself: no job wakes a herd of threads that mostly find nothing to do."""

    #: How long a thread with nothing to take waits for a job before it leaves: threads outlive
    #: their job, so that a run of writes does not start a thread for each.
    IDLE_S = 2.0

    def __init__(self, name: str, per_peer: int, total: int) -> None:
        """An empty pool; threads start on demand and leave after IDLE_S with nothing to take."""
        if per_peer < 1 or total < 1:
            raise ConfigError(f"{name}: per_peer {per_peer} and total {total} must be at least 1")
        self.name = name
        self.per_peer = per_peer
        self.total = total
        self._lock = threading.Lock()
        self._left = threading.Condition(self._lock)  # shutdown() waits here for the threads to go
        self._queues: dict[str, deque] = {}  # keys with waiting jobs, in the order they are served
        self._running: dict[str, int] = {}
        self._threads: set[threading.Thread] = set()
        self._parked: list[threading.Lock] = []  # parked threads' wake locks, held while they sleep
        self._waking = 0  # threads started or woken that have not looked for a job yet
        self._ids = itertools.count(1)
        self._closed = False

    def submit(self, key: str, fn: Callable[..., Any], *args: Any) -> Future:
        """Queues fn(*args) behind key's earlier jobs; its Future."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise UsageError(f"{self.name} is shut down")
            queue = self._queues.setdefault(key, deque())
            queue.append((future, fn, args))
            try:
                self._fill()
            except RuntimeError:  # out of threads: the caller hears it, and no job waits on a phantom
                queue.pop()
                if not queue:
                    del self._queues[key]
                raise
        return future

    def _cap(self) -> int:
        """How many jobs of one key may run now: per_peer shared among the keys with jobs
        queued or running, at least one each (lock held)."""
        busy = len(self._queues.keys() | self._running.keys())
        return max(1, self.per_peer // busy) if busy > 1 else self.per_peer

    def _fill(self) -> None:
        """Wakes (or starts) one thread for each job that may start now and has none coming (lock held)."""
        cap = self._cap()
        startable = sum(min(len(queue), cap - self._running.get(key, 0))
                        for key, queue in self._queues.items() if self._running.get(key, 0) < cap)
        for _ in range(startable - self._waking):
            if self._parked:
                self._parked.pop().release()
            elif len(self._threads) < self.total:
                thread = threading.Thread(target=self._work, name=f"{self.name}-{next(self._ids)}", daemon=True)
                self._threads.add(thread)
                try:
                    thread.start()
                except RuntimeError:
                    self._threads.discard(thread)
                    raise
            else:
                return  # every thread is busy: the first to finish takes the next job
            self._waking += 1

    def _take(self) -> tuple[str, Future, Callable[..., Any], tuple] | None:
        """The next job of the first key below its cap (that key then goes last); lock held."""
        cap = self._cap()
        for key, queue in self._queues.items():
            if self._running.get(key, 0) < cap:
                future, fn, args = queue.popleft()
                del self._queues[key]
                if queue:
                    self._queues[key] = queue  # re-inserted last: the keys take turns
                self._running[key] = self._running.get(key, 0) + 1
                return key, future, fn, args
        return None

    def _next_job(self, wake: threading.Lock) -> tuple[str, Future, Callable[..., Any], tuple] | None:
        """A job to run, parking up to IDLE_S while there is none; None: leave (lock held)."""
        while True:
            job = self._take()
            if job is not None or self._closed:
                return job
            self._parked.append(wake)
            self._lock.release()
            try:
                woken = wake.acquire(timeout=self.IDLE_S)
            finally:
                self._lock.acquire()
            if not woken and wake in self._parked:  # nobody woke it: idle for IDLE_S
                self._parked.remove(wake)
                return self._take()
            if not woken:  # woken just after its wait ran out: the lock is free again
                wake.acquire()
            self._waking -= 1

    def _work(self) -> None:
        """A thread: runs jobs until it finds none for IDLE_S (or the pool is shut down)."""
        _io.name_this_thread("epd-wire-write")  # for top -H, and bench's CPU split (the transport's side)
        me = threading.current_thread()
        wake = threading.Lock()
        wake.acquire()  # held while parked; a waker releases it
        with self._lock:
            self._waking -= 1
            try:
                while (job := self._next_job(wake)) is not None:
                    key, future, fn, args = job
                    self._lock.release()
                    try:
                        if future.set_running_or_notify_cancel():
                            try:
                                result = fn(*args)
                            except BaseException as exc:  # noqa: BLE001 - the Future carries it to wait()
                                future.set_exception(exc)
                            else:
                                future.set_result(result)
                    finally:
                        self._lock.acquire()
                        self._running[key] -= 1
                        if not self._running[key]:
                            del self._running[key]
                            if self._queues:  # one key fewer shares per_peer: the others may run more
                                try:
                                    self._fill()
                                except RuntimeError:  # no thread to start: this one takes the next job
                                    pass
            finally:
                self._threads.discard(me)
                self._left.notify_all()

    def shutdown(self) -> None:
        """Refuses new jobs and waits until every queued one has run and every thread has left."""
        me = threading.current_thread()
        with self._lock:
            self._closed = True
            while self._parked:  # parked threads take what is left, then leave
                self._parked.pop().release()
                self._waking += 1
            while self._threads - {me}:
                self._left.wait()


def _listen_error(host: str, port: int, error: OSError) -> Exception:
    """A failed bind of the wire listener, naming its address and what to do: PortsInUse (errno kept, so
    a range passes the port over) for a port in use, ConfigError for an address not of this host or a
    name that does not resolve, ListenError (errno kept) for any other error."""
    unresolved = f"wire listener: cannot resolve {host}: "
    if not error.errno and str(error).startswith(unresolved):  # the rest is the resolver's reason
        return listen_error("wire listener", host, port,
                            socket.gaierror(socket.EAI_NONAME, str(error).removeprefix(unresolved)))
    if not error.errno:
        return error  # not the bind's: the accept thread did not start
    return listen_error("wire listener", host, port, OSError(error.errno, os.strerror(error.errno)))


class WireEngine(RegisteredMemory):
    """The Engine interface over the framed wire: a native listener plus pooled sender connections."""

    protocol = "wire"
    protocol_reason = "requested"
    _lock: threading.Condition  # also what its writes wait on

    def __init__(self, hostname: str = "127.0.0.1", port: PortSpec = 0, *, recv_timeout_s: float = 30.0,
                 idle_timeout_s: float = 300.0, reply_timeout_s: float = 60.0,
                 connect_timeout_s: float = 10.0, chunk_bytes: int = CHUNK_BYTES,
                 max_connections: int = 64, first_byte_timeout_s: float | None = None,
                 writers_per_peer: int = WRITERS_PER_PEER, evict_after_s: float = 1.0,
                 min_rate_bps: float = MIN_RATE_BPS, queue_timeout_s: float | None = None) -> None:
        """Starts the listener on hostname:port (0: any free port; a range such as `(30000, 30100)`
        or `"30000-30100"`: its first free one, `PortsInUse` when none is); chunk_bytes is both the LAYER
        size we send and the largest we accept, so peers must agree on it. A fresh connection
        that sends nothing for first_byte_timeout_s (None: the listener's 10 s; never more than
        idle_timeout_s) is closed; with every connection slot taken, one that has sent nothing
        yet, or else one evict_after_s behind the least rate, is closed for a new one (negative
        evict_after_s: none). min_rate_bps (0: none) is that least rate both ways: a transfer in
        must keep it after a grace, and a transfer out must be taken within reply_timeout_s plus
        its bytes at it, whatever pace the peer reads at. writers_per_peer: write_async() batches
        to a lone busy peer that run at once, each on a connection of its own; busy peers share
        that many (at least one each); one that waited in its peer's queue for longer than
        queue_timeout_s (None: reply_timeout_s) fails without sending anything."""
        _check_advertised(hostname)
        if int(writers_per_peer) < 1:
            raise ConfigError(f"writers_per_peer must be at least 1, got {writers_per_peer}")
        largest = wire.MAX_PAYLOAD - wire.LAYER_HEADER
        if not 1 <= int(chunk_bytes) <= largest:
            raise ConfigError(f"chunk_bytes must be within 1..{largest} (a LAYER frame's payload), got {chunk_bytes}")
        if not 1 <= int(max_connections) <= MAX_CONNECTIONS:
            raise ConfigError(f"max_connections must be within 1..{MAX_CONNECTIONS}, got {max_connections}")
        if not (math.isfinite(float(min_rate_bps)) and float(min_rate_bps) >= 0):
            raise ConfigError(f"min_rate_bps must be a finite number of bytes/s (0: no bound), got {min_rate_bps}")
        self.min_rate_bps = float(min_rate_bps)
        if not math.isfinite(float(evict_after_s)):
            raise ConfigError(f"evict_after_s must be a finite number of seconds (negative: no eviction for "
                              f"slowness), got {evict_after_s}")
        for name, value in (("recv_timeout_s", recv_timeout_s), ("idle_timeout_s", idle_timeout_s),
                            ("reply_timeout_s", reply_timeout_s), ("connect_timeout_s", connect_timeout_s)):
            check_seconds(name, value)
        if first_byte_timeout_s is not None:
            check_seconds("first_byte_timeout_s", first_byte_timeout_s)
        self.queue_timeout_s = check_seconds("queue_timeout_s",
                                             reply_timeout_s if queue_timeout_s is None else queue_timeout_s)
        self.writers_per_peer = int(writers_per_peer)
        self.hostname = hostname
        self.chunk_bytes = int(chunk_bytes)
        self.reply_timeout_s = reply_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = float(idle_timeout_s)
        self.rate_grace_s = RATE_GRACE_TIMEOUTS * float(recv_timeout_s)
        def listen(number: int) -> Any:
            try:
                return _native.wire_listen(
                    hostname, number, float(recv_timeout_s), float(idle_timeout_s), self.chunk_bytes,
                    int(max_connections),
                    first_byte_timeout=-1.0 if first_byte_timeout_s is None else float(first_byte_timeout_s),
                    evict_after=float(evict_after_s), min_rate=self.min_rate_bps, rate_grace=self.rate_grace_s)
            except OSError as error:
                raise _listen_error(hostname, number, error) from None

        self._listener = bind_port(port, listen, f"wire listener on {hostname}")
        self.port = _native.wire_listener_port(self._listener)
        self.rpc_port = self.port
        self.session_id = f"{hostname}:{self.port}"
        self._lock = threading.Condition()
        self._regions = Registrations()
        self._adding: dict[int, int] = {}
        self._registrations = self._lock
        self._owners: dict[int, Any] = {}  # keeps registered tensors alive
        self._idle: dict[str, list[_Conn]] = {}
        self._rooms = itertools.count(1)
        self._reading: dict[int, tuple[str, list[tuple[int, int]]]] = {}  # writes in flight: session, sources
        self._write_ids = itertools.count(1)
        self._closed = False
        self._released = False  # close() closed the connections and the listener
        self._releasing = threading.Lock()
        self._sent = {"connections_opened": 0, "writes": 0, "bytes_sent": 0, "write_failures": 0, "retries": 0}
        self._batches: dict[int, Future] = {}
        self._batch_ids = itertools.count(1)
        self._writers: _WriterPool | None = None
        self._forks = forks()
        log.debug("wire engine %s listening", self.session_id)

    # -- memory -----------------------------------------------------------

    def _region_span(self, buf: Any, length: int | None) -> tuple[int, int]:
        """(address, length) of a contiguous host tensor, or of an int address with a length."""
        device = getattr(buf, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise EngineError(f"the wire path is host-only: cannot register a tensor on {device} "
                                f"(use protocol tcp or rdma for device memory)")
        return _buffer_span(buf, length)

    def _add_region(self, addr: int, nbytes: int) -> None:
        """Lets peers write into a host tensor or address range."""
        try:
            _native.wire_add_region(self._listener, addr, nbytes)
        except ValueError as exc:
            raise EngineError(f"registering 0x{addr:x} length {nbytes} on {self.session_id}: {exc}") from None

    def _remove_region(self, addr: int) -> str | None:
        """Stops accepting writes into the region; waits for a copy into it in progress."""
        _native.wire_remove_region(self._listener, addr)
        return None

    def late_write_s(self, nbytes: int) -> float:
        """The longest a transfer of `nbytes` into this engine's memory may go on landing once it started:
        the listener's grace before its least rate applies, then the bytes at that rate (no bound without
        one). What a receive pool's default quarantine adds to when a late write may start."""
        if self.min_rate_bps <= 0:
            return math.inf
        return self.rate_grace_s + nbytes / self.min_rate_bps

    # -- writes -----------------------------------------------------------

    def write(self, session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
              lengths: Sequence[int], rows: int | None = None) -> None:
        """Write every (src, dst, length) to the peer as one transfer; blocks until it answers.

        rows (default 1) is the row count the PREFILL announces: every length must be a
        multiple of it. Raises EngineError naming the session and the sizes; UsageError in a process
        forked from the one that started the engine."""
        self._check_process()
        srcs, dsts, lens = self._batch(session_id, src_addrs, dst_addrs, lengths)
        if not lens:
            return
        rows = 1 if rows is None else int(rows)
        if not 1 <= rows <= _U32_MAX:
            raise ConfigError(f"write to {session_id}: rows {rows} is outside the PREFILL's 1..{_U32_MAX}")
        if any(n % rows for n in lens):
            raise ConfigError(f"write to {session_id}: lengths {lens} are not multiples of rows {rows}")
        self._write_filed(self._enter(session_id, srcs, lens), session_id, srcs, dsts, lens, rows)

    def _write_filed(self, token: int, session_id: str, srcs: list[int], dsts: list[int], lens: list[int],
                     rows: int) -> None:
        """write()'s transfer, its sources filed under `token` (let go of here, however it ends)."""
        try:
            self._write_with_retry(session_id, srcs, dsts, lens, rows)
        except (_Refused, OSError, wire.MsgError, EngineError) as exc:
            with self._lock:
                self._sent["write_failures"] += 1
            what, hint = _failure_words(exc)
            raise EngineError(f"write to {session_id} {what}: {exc} ({len(lens)} buffer(s), "
                              f"{sum(lens)} bytes, first destination 0x{dsts[0]:x}+{lens[0]}){hint}") from None
        finally:
            self._leave(token)

    def write_async(self, session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
                    lengths: Sequence[int]) -> int:
        """Start write() on the peer's writer queue (at most its share of writers_per_peer
        run at once); returns a batch id for wait() (0: nothing to write). Its sources count as
        read from here on, queued or not: unregister() refuses them until the batch is over.
        UsageError in a process forked from the one that started the engine."""
        self._check_process()
        srcs, dsts, lens = self._batch(session_id, src_addrs, dst_addrs, lengths)
        if not lens:
            return 0
        with self._lock:
            self._check_open()
            if self._writers is None:
                self._writers = _WriterPool(f"wire-write-{self.port}", self.writers_per_peer, MAX_WRITERS)
            token = self._enter(session_id, srcs, lens)
            try:
                future = self._writers.submit(session_id, self._write_queued, token, time.monotonic(), session_id,
                                              srcs, dsts, lens)
            except BaseException:
                self._leave(token)
                raise
            batch_id = next(self._batch_ids)
            self._batches[batch_id] = future
        return batch_id

    def _write_queued(self, token: int, queued_at: float, session_id: str, srcs: list[int], dsts: list[int],
                      lens: list[int]) -> None:
        """A write_async() batch once a writer takes it: fails unsent if the engine closed meanwhile, or if it
        waited past queue_timeout_s (behind writes to a peer that stopped reading, each taking a reply timeout:
        it would start, and land, arbitrarily late)."""
        def what() -> str:
            return f"({len(lens)} buffer(s), {sum(lens)} bytes, first destination 0x{dsts[0]:x}+{lens[0]})"

        try:
            waited = time.monotonic() - queued_at
            with self._lock:
                if self._closed:  # counted like any failed write: stats() after close() tells the whole story
                    self._sent["write_failures"] += 1
                    raise EngineError(f"write to {session_id} not started: wire engine {self.session_id} was "
                                      f"closed while it waited in the queue of that peer's writes ({waited:.1f} s); "
                                      f"nothing of it was sent: send it again on an open engine {what()}")
            if waited > self.queue_timeout_s:
                with self._lock:
                    self._sent["write_failures"] += 1
                raise EngineError(f"write to {session_id} not started: it waited {waited:.1f} s in the queue of that "
                                  f"peer's writes (queue_timeout_s={self.queue_timeout_s:g}), behind writes to it "
                                  f"still under way: is the peer reading? {what()}")
        except BaseException:
            self._leave(token)
            raise
        self._write_filed(token, session_id, srcs, dsts, lens, 1)

    def poll(self, batch_id: int) -> bool:
        """Whether the batch from write_async is over, without blocking; EngineError if it failed."""
        if batch_id == 0:
            return True
        with self._lock:
            future = self._batches.get(batch_id)
        if future is None:
            raise EngineError(f"batch {batch_id} is unknown on {self.session_id}")
        if not future.done():
            return False
        self.wait(batch_id)
        return True

    def wait(self, batch_id: int, timeout_s: float | None = None) -> None:
        """Block until the batch from write_async completes; EngineError if it failed or is unknown,
        UsageError in a process forked from the one that started the engine (nothing there would end it)."""
        self._check_process()
        if batch_id == 0:
            return
        with self._lock:
            future = self._batches.get(batch_id)
        if future is None:
            raise EngineError(f"batch {batch_id} is unknown on {self.session_id}")
        try:
            future.result(timeout_s)
        except FutureTimeout:
            raise EngineError(f"batch {batch_id} on {self.session_id} still in flight after {timeout_s}s") from None
        finally:
            if future.done():
                with self._lock:
                    self._batches.pop(batch_id, None)

    def _write_with_retry(self, session_id: str, srcs: list[int], dsts: list[int], lens: list[int],
                          rows: int) -> None:
        """One transfer; on a reused connection that failed before the peer took any byte, or that the
        peer closed without an answer, it is sent once more on a fresh connection (`_send_again`)."""
        room = next(self._rooms)
        conn = self._checkout(session_id)
        started = time.monotonic()
        try:
            self._transfer(conn, room, srcs, dsts, lens, rows)
        except _SendAgain as exc:
            conn.close()
            if conn.fresh:
                raise exc.cause from None
            conn = self._send_again(session_id, room, srcs, dsts, lens, rows, started, exc.cause)
        except BaseException:
            conn.close()
            raise
        self._checkin(session_id, conn, started)

    def _send_again(self, session_id: str, room: int, srcs: list[int], dsts: list[int], lens: list[int],
                    rows: int, started: float, cause: OSError) -> _Conn:
        """The transfer once more, on a fresh connection, within what the first send (from `started`) left
        of the reply timeout, so both together keep the one transfer's bound; with nothing left, the first
        send's error (`cause`) stands. Returns the connection, for reuse."""
        def left() -> float:
            return self.reply_timeout_s - (time.monotonic() - started)

        budget = left()
        if budget <= 0:
            raise cause from None
        # The connect, too, gets no more than what is left: a peer whose accept queue is full (frozen, or
        # not accepting) leaves it hanging for all of connect_timeout_s.
        try:
            conn = self._open(session_id, min(self.connect_timeout_s, budget))
        except TimeoutError:
            if budget >= self.connect_timeout_s:
                raise
            said = (f"{cause}; sent again on a fresh connection, which did not connect within the {budget:.2f} s "
                    f"left of reply_timeout_s={self.reply_timeout_s:g}")
            error = OSError(said)
            error.errno = cause.errno  # what the first send met (a reset, a broken pipe) still tells the story
            raise error from None
        try:
            remaining = left()
            if remaining <= 0:
                raise cause from None
            with self._lock:
                self._sent["retries"] += 1
            conn.sock.settimeout(remaining)
            self._transfer(conn, room, srcs, dsts, lens, rows)
        except _SendAgain as again:
            conn.close()
            raise again.cause from None
        except BaseException:
            conn.close()
            raise
        conn.sock.settimeout(self.reply_timeout_s)
        return conn

    def _transfer(self, conn: _Conn, room: int, srcs: list[int], dsts: list[int], lens: list[int],
                  rows: int) -> None:
        """PREFILL, the LAYER chunks, FIRST, then the answer: one native call, one GIL release."""
        msg = wire.Msg({"room": room, "layers": len(lens), "rows": rows, "row_bytes": lens[0] // rows,
                        "ptr": dsts[0]})
        for i, (dst, n) in enumerate(zip(dsts, lens)):
            msg.set(f"ptr{i}", dst).set(f"bytes{i}", n)
        fd, timeout = wire.endpoint(conn.sock)
        try:
            complete, (kind, payload, _) = _native.wire_transfer(fd, msg.encode(), tuple(zip(srcs, lens)), rows,
                                                                 self.chunk_bytes, timeout, self.min_rate_bps)
        except OSError as exc:
            stage = getattr(exc, "stage", None)
            if stage == "prefill" or (stage in ("data", "answer") and not conn.fresh and conn.hung_up()):
                raise _SendAgain(exc) from None
            if stage == "data":
                self._raise_answer(conn, room, exc)
            if stage == "answer" and "exceeds the limit" in str(exc):
                raise EngineError(f"{exc} ({_NOT_A_LISTENER})") from None
            raise
        self._judge(kind, payload, room, sum(lens) if complete else None)
        if not complete:
            raise EngineError(f"the peer answered before the transfer was complete (kind {kind})")
        conn.fresh = False
        with self._lock:
            self._sent["writes"] += 1
            self._sent["bytes_sent"] += sum(lens)

    def _raise_answer(self, conn: _Conn, room: int, cause: OSError | None) -> None:
        """The peer stopped us mid-transfer: raise its ERROR reason if it sent one, else cause."""
        if cause is not None and not conn.peer_spoke():
            # A peer that refused us has said so by the time our send fails; one that merely
            # stopped reading would keep us another reply timeout waiting for nothing.
            raise cause
        try:
            kind, payload, _ = wire.read_frame(conn.sock, _native.MAX_ANSWER, self.min_rate_bps)
        except OSError:
            if cause is not None:
                raise cause from None
            raise
        self._judge(kind, payload, room, None)
        raise EngineError(f"the peer answered before the transfer was complete (kind {kind})")

    @staticmethod
    def _judge(kind: int, payload: bytes, room: int, total: int | None) -> None:
        """Raises unless the answer is a RESULT for this room (with total bytes when given): _Refused
        for this room's ERROR (or one naming no room: the peer could not read our PREFILL),
        EngineError for anything else."""
        if kind not in (wire.RESULT, wire.ERROR):
            raise EngineError(f"the peer answered with frame kind {kind}, expected RESULT or ERROR "
                              f"({_NOT_A_LISTENER})")
        name = "RESULT" if kind == wire.RESULT else "ERROR"
        try:
            answer = wire.Msg.decode(payload)
        except wire.MsgError as exc:
            said = printable(str(exc))  # the decoder's words quote the peer's line (64 bytes), controls and all
            if kind == wire.ERROR:  # its reason is still what the peer said
                body = payload.partition(b"\n\n")[2]
                raise _Refused(f"{_reason(body)} (its header unreadable: {said})") from None
            raise EngineError(f"the peer's RESULT ({len(payload)} bytes) is not a Msg: {said}") from None
        try:
            named = answer.number("room") if kind == wire.RESULT or "room" in answer else room
            if named != room:
                raise EngineError(f"the peer's {name} names room {named}, not room {room}"
                                  + (f": {_reason(answer.body)}" if kind == wire.ERROR else ""))
            if kind == wire.ERROR:
                raise _Refused(_reason(answer.body))
            if total is not None and answer.number("bytes") != total:
                raise EngineError(f"the peer's RESULT for room {room} says {answer.get('bytes')} bytes, not {total}")
        except wire.MsgError as exc:
            raise EngineError(f"the peer's {name} for room {room}: {exc}") from None

    # -- connections ------------------------------------------------------

    def _open(self, session_id: str, connect_timeout_s: float | None = None) -> _Conn:
        """A fresh connection to the peer, connected within connect_timeout_s (None: the engine's), first
        dropping idle ones whose peers hung up or that sat idle past idle_timeout_s."""
        self._prune_idle()
        conn = _Conn(session_id, self.reply_timeout_s,
                     self.connect_timeout_s if connect_timeout_s is None else connect_timeout_s)
        with self._lock:
            self._sent["connections_opened"] += 1
        return conn

    def _checkout(self, session_id: str) -> _Conn:
        """An idle connection to the peer that is still good, or a new one."""
        while True:
            with self._lock:
                idle = self._idle.get(session_id)
                conn = idle.pop() if idle else None
            if conn is None:
                return self._open(session_id)
            if not conn.stale():
                return conn
            conn.close()  # the peer restarted or timed the connection out

    def _prune_idle(self) -> None:
        """Closes idle connections of any session whose peer hung up, and those idle past idle_timeout_s
        (a peer whose host went away, or that froze, never hangs up: its connections would stay for the
        engine's lifetime); forgets sessions left with none."""
        dead: list[_Conn] = []
        oldest = time.monotonic() - self.idle_timeout_s
        with self._lock:
            for session_id in list(self._idle):
                alive: list[_Conn] = []
                for conn in self._idle[session_id]:
                    (dead if conn.used_at < oldest or conn.stale() else alive).append(conn)
                if alive:
                    self._idle[session_id] = alive
                else:
                    del self._idle[session_id]
        for conn in dead:
            conn.close()

    def _checkin(self, session_id: str, conn: _Conn, started: float) -> None:
        """Returns a healthy connection for reuse; `started`: when the transfer it carried began."""
        conn.used_at = started
        with self._lock:
            idle = self._idle.setdefault(session_id, [])
            if self._closed or len(idle) >= IDLE_PER_SESSION:
                conn.close()
            else:
                idle.append(conn)

    def _batch(self, session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
               lengths: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """Validates a batch, drops zero-length entries, checks sources lie in registered memory."""
        srcs, dsts, lens = check_batch(session_id, src_addrs, dst_addrs, lengths)
        if len(lens) > 16:
            raise ConfigError(f"write to {session_id}: {len(lens)} buffers; one transfer carries at most 16")
        with self._lock:
            self._check_open()
            self._check_sources(session_id, srcs, lens)
        return srcs, dsts, lens

    def _check_sources(self, session_id: str, srcs: list[int], lens: list[int]) -> None:
        """Refuses a source outside registered memory (lock held): it would be read through a raw pointer."""
        for src, n in zip(srcs, lens):
            if self._regions.holding(src, n) is None:
                raise EngineError(f"write to {session_id}: source 0x{src:x} length {n} is not "
                                    f"inside memory registered on {self.session_id}")

    # -- figures and lifecycle ---------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The listener's counters (accepted, refused, active, transfers_received,
        transfers_refused, too_slow, silent, evicted, bytes_received, regions, port, last_error) and the sender's
        (connections_opened, writes, bytes_sent, write_failures, retries, idle_connections)."""
        out: dict[str, Any]
        with self._lock:
            out = dict(self._sent)
            out["idle_connections"] = sum(len(v) for v in self._idle.values())
        listener = _native.wire_listener_stats(self._listener)
        # The listener's names, made unambiguous next to the sender's.
        renames = {"bytes": "bytes_received", "transfers": "transfers_received", "failures": "transfers_refused"}
        out.update({renames.get(k, k): v for k, v in listener.items()})
        # A refusal's reason may quote a peer's PREFILL header line (at most 64 bytes, controls and all):
        # the peer was answered with it as it is; whoever reads or logs the figures gets it printable.
        out["last_error"] = printable(out["last_error"])
        return out

    def _check_process(self) -> None:
        """UsageError in a process forked from the one that started the engine: its listener's threads and
        its writers are the parent's, and its pooled connections are shared with the parent, whose
        transfers on them a write here would interleave with."""
        if self._forks != forks():
            raise UsageError(f"wire engine {self.session_id} was made before this process (pid {os.getpid()}) was "
                             f"forked from its parent: its listener, writer threads and connections are the "
                             f"parent's, so nothing here would carry its writes or land its peers' bytes; make a "
                             f"WireEngine in this process")

    def _check_open(self) -> None:
        """Raise when the engine was closed (caller holds the lock)."""
        if self._closed:
            raise EngineError(f"wire engine {self.session_id} is closed: its close() ran; start a new engine (and new "
                              f"pools and managers on it) to register or write more")

    def _enter(self, session_id: str, srcs: list[int], lens: list[int]) -> int:
        """Files a write in flight with its sources: close() waits for it, unregister() refuses them."""
        with self._lock:
            self._check_open()
            self._check_sources(session_id, srcs, lens)  # again: an unregister() may have come since _batch
            token = next(self._write_ids)
            self._reading[token] = (session_id, list(zip(srcs, lens)))
        return token

    def _leave(self, token: int) -> None:
        """A write finished: nothing reads its sources any more."""
        with self._lock:
            del self._reading[token]
            self._lock.notify_all()

    def _reader_of(self, addr: int, nbytes: int) -> str | None:
        """A write in flight whose sources overlap the region, described (lock held)."""
        for session_id, sources in self._reading.values():
            if any(src < addr + nbytes and addr < src + n for src, n in sources):
                return f"a write to {session_id} in flight"
        return None

    def close(self) -> None:
        """Waits for writes in flight (each bounded by the timeouts), closes every connection,
        stops and joins the listener's threads and frees its port; idempotent. A close() while
        another is under way returns when that one did; one cut short (a stop signal's exception) is
        finished by the next. In a process forked from the one that started
        the engine it only closes that process's copies of the engine's descriptors, at once: the writes,
        threads and connections are the parent's, which go on."""
        if self._forks != forks():
            self._close_copies()
            return
        self._close_once()

    def _close_copies(self) -> None:
        """close() in a forked child: closes the child's copies of the pooled connections and of the
        listener's descriptors (the parent's stay open), taking no lock a parent's thread may have held
        at the fork and waiting for none of the parent's threads."""
        for conns in list(self._idle.values()):
            for conn in list(conns):
                conn.close()
        _native.wire_listener_close(self._listener)

    def _release(self) -> None:
        """close()'s work: settle the writes, close the connections and the listener; again after a close cut
        short, what is left of it."""
        with self._lock:
            self._wait_for_registrations()
            writers, self._writers = self._writers, None
        if writers is not None:
            writers.shutdown()  # queued batches fail fast: the engine is closed
        with self._lock:
            while self._reading:
                self._lock.wait()
            idle = [c for conns in self._idle.values() for c in conns]
            self._idle.clear()
            # Finished batches stay filed: an owner polling one after close() learns how it ended.
        for conn in idle:
            conn.close()
        _native.wire_listener_close(self._listener)
        with self._lock:
            self._regions.clear()
            self._owners.clear()

    def __enter__(self) -> WireEngine:
        """Context-manager entry."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on exit."""
        self.close()


class _SendAgain(Exception):
    """A transfer failed before the peer accepted any of its bytes, or on a reused connection the
    peer had closed: sending it again on a fresh connection lands the same bytes."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


#: This module's name for EngineError before transfer.errors existed; code that imports it keeps working.
TransferError = EngineError

__all__ = ["CHUNK_BYTES", "MAX_WRITERS", "WRITERS_PER_PEER", "EngineError", "TransferError", "WireEngine"]

"""The prefill side's driver: the thread, sockets, clock and bootstrap look-ups around a PrefillCore.

One I/O thread sleeps in zmq.Poller (poll(2) underneath, so any descriptor number
works) on the status socket's descriptor, a waker and the sockets to encode ranks that
have asks waiting; it feeds statuses, look-up results and ticks to the core and carries
out the actions. Bootstrap look-ups run on a few look-up threads of their own, so a slow
server delays only the rooms that wait on it. The caller's receive() steps the core
too, under the same lock, and sends a room's ask itself when its route is cached:
that saves a thread hand-off per room. Every step under the lock is non-blocking;
checksums run outside it.

The caller's poll(), concluded() and wait() read the status socket themselves (see
`progress`): while the caller came by within CALLER_LEASE_S, or a wait() watches the
socket, the I/O thread leaves the socket's descriptor alone, so a status wakes no
thread but the caller's. ZMQ sockets are not thread-safe: every call on the status
socket (a receive, which also takes the socket's pending commands) is made under the
lock, and both threads only ever sleep on its descriptor, a plain pipe that signals
"look again" once a receive found the socket empty.
"""

from __future__ import annotations

import logging
import math
import os
import select
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import zmq

from transfer import _forks, _io
from transfer.bootstrap import BootstrapClient, BootstrapError, BootstrapNoRoute
from transfer.core.failure import Failure, FailureKind
from transfer.core.prefill import (
    MAX_ENCODE_SOCKETS,
    Advance,
    Announce,
    Conclude,
    Disconnect,
    LookUpParallel,
    LookUpRoute,
    MemorySafe,
    Overturn,
    PrefillCore,
    RoomSpec,
    SendAsk,
    SendCancel,
    Verify,
    Warn,
    checksum_failed_detail,
)
from transfer.core.quarantine import AwaitingConfirmation, Fate, fate_of
from transfer.core.unread import unread
from transfer.core.wake import sleep_plan
from transfer.errors import UsageError
from transfer.frames import UnreadableChecksum, WireError, parse_cancel_reply, parse_failure_reason, parse_status
from transfer.metrics import Metrics
from transfer.ports import PortSpec
from transfer.status import RoomTable, TransferPoll

__all__ = ["DRAIN_BATCH", "LOOKUP_THREADS", "PrefillDriver", "Room"]

log = logging.getLogger("transfer.receiver")

#: What a call on a closed session manager raises (only its close() closes one a caller still holds).
MANAGER_CLOSED = ("session manager is closed: its close() ran (called, or its with block ended); start a new "
                  "SessionManager to receive more")

#: Statuses handled per turn of the I/O thread: a peer pushing faster than we drain must
#: not keep the thread from asks, deadlines and close().
DRAIN_BATCH = 1024

#: Look-ups that may run at once (each on its own thread, started when needed): a server
#: that stalls holds one of them, not the rooms of other servers.
LOOKUP_THREADS = 4

#: Rooms failed on their deadline per turn: 10 000 expiring at once must not hold the lock
#: (and the caller's receive()) for the whole lot; the next turn comes at once.
EXPIRE_BATCH = 256

#: How long close() waits for the I/O thread to stop. Nothing in its turn blocks (look-ups
#: run elsewhere), so this is generous; past it the thread is left its sockets.
STOP_WAIT_S = 5.0

#: How long a socket closed right after a cancel was queued on it may take to send it.
CANCEL_FLUSH_MS = 1000

#: Cleared rooms remembered until their encode rank confirms their cancel, or their
#: quarantine bound passes (oldest forgotten first: their slots then wait out the pool's
#: quarantine).
MAX_AWAITING_SAFE = 65536

#: A socket to an encode address with nothing under way is closed once unused this long (a
#: room there later connects afresh), so encode ranks that came and went hold no sockets.
ASK_IDLE_S = 60.0

#: How long after the caller last read the status socket (poll(), concluded()) it is
#: still trusted to come back for it: the I/O thread leaves the socket to the caller
#: meanwhile, waking only to look whether it did. A caller gone quiet delays a status
#: by at most this much.
CALLER_LEASE_S = 0.005

#: How often the I/O thread looks whether a caller that sleeps on the status socket in
#: wait() is still there: statuses that come after it left wait at most this much.
WAITER_LOOK_S = 0.02

#: The longest a waiting caller sleeps on the status socket before it looks again.
WAIT_SLICE_S = 1.0

#: Statuses handled per hold of the lock, by either thread.
STATUSES_PER_HOLD = 64

#: A caller's poll() reads the status socket at most this often: a scheduler loop that
#: polls many handles in one step reads it once.
PROGRESS_EVERY_S = 50e-6

#: How often the sockets to encode ranks are checked for lost connections while idle,
#: so their reports do not pile up in ZMQ (a send checks its socket's first anyway).
MONITOR_PERIOD_S = 1.0

#: ZMQ sockets, and about as many descriptors, one encode rank's connection costs: its PUSH
#: socket, the monitor's pair and its connection.
SOCKETS_PER_ENCODE_RANK = 3


def encode_socket_limit(wanted: int = MAX_ENCODE_SOCKETS) -> int:
    """`wanted` connections to encode ranks, cut to a quarter of the descriptors this process may open
    and of the ZMQ context's sockets."""
    return max(1, _io.status_connection_limit(wanted * SOCKETS_PER_ENCODE_RANK) // SOCKETS_PER_ENCODE_RANK)


@dataclass(eq=False)
class Room:
    """One room as its handle sees it: when it started and concluded, and its pool slot."""

    room: int
    started_at: float
    nbytes: int  # embedding and deepstack bytes, counted when it succeeds
    lease: Any = None
    token: int = 0
    concluded_at: float | None = None
    succeeded: bool = False
    #: No encode rank writes into the room's memory any more (its cancel was confirmed, or
    #: it never asked one); `on_safe` runs when that becomes known after clear().
    memory_safe: bool = False
    on_safe: Any = None
    asked_at: float | None = None  # its ask first left for the encode rank
    status_at: float | None = None  # the encode rank's status for it was read

    def stage_times(self) -> tuple[tuple[str, float | None], ...]:
        """When its ask left, its status came and it concluded (driver clock; None where not reached)."""
        return ("asked", self.asked_at), ("status", self.status_at), ("concluded", self.concluded_at)


class PrefillDriver:
    """Owns the I/O thread, the status socket, the sockets to encode ranks, the look-up threads and the clock."""

    def __init__(
        self,
        engine_rank: int,
        tp_size: int,
        dp_size: int,
        *,
        host: str,
        status_port: PortSpec,
        session_id: str,
        deadline_s: float,
        lookup_timeout_s: float,
        integrity: bool,
        metrics: Metrics,
        pool: Any = None,
        quarantine_s: float = float("inf"),
    ) -> None:
        self.engine_rank = engine_rank
        self._forks = _forks.count  # see check_process
        self.clock = time.monotonic
        self.metrics = metrics
        self.pool = pool
        self.lookup_timeout_s = lookup_timeout_s
        self.table = RoomTable()
        self.conclusions = _io.Conclusions()
        self.rooms: dict[int, Room] = {}  # changed under _lock
        # Cleared rooms until their cancel is confirmed, or `quarantine_s` passed since the clear (their memory is
        # safe then, confirmed or not).
        self._awaiting_safe: AwaitingConfirmation[Room] = AwaitingConfirmation(quarantine_s, MAX_AWAITING_SAFE)
        self._status_sock, self.status_port = _io.pull_socket(host, status_port,
                                                              f"prefill rank {engine_rank}'s status socket")
        self._status_fd = self._status_sock.fileno()  # the socket's FD option
        wakers: list[_io.Waker] = []
        try:
            self.core = PrefillCore(engine_rank, tp_size, dp_size, host=host, status_port=self.status_port,
                                    session_id=session_id, deadline_s=deadline_s, integrity=integrity,
                                    max_sockets=encode_socket_limit())
            for _ in range(2):
                wakers.append(_io.Waker())
        except BaseException:  # out of descriptors: nothing is left open
            for waker in wakers:
                waker.close()
            self._status_sock.close(0)
            raise
        # The I/O thread's, and the one that wakes a caller sleeping on the status socket.
        self._waker, self._watch_waker = wakers
        # Guards the core, the rooms and every send on the sockets to encode ranks. Held
        # only for non-blocking steps.
        self._lock = threading.Lock()
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}
        self._used_at: dict[tuple[str, int], float] = {}  # when each socket last sent something
        self._monitors: dict[tuple[str, int], zmq.Socket] = {}
        # Registered for POLLOUT: the I/O thread polls them outside the lock, so no other thread
        # uses them (changed under the lock, by the I/O thread or once it stopped).
        self._watching: dict[zmq.Socket, tuple[str, int]] = {}
        self._resync = False  # an ask was refused off the I/O thread: it must watch that socket
        self._wake_at = 0.0  # work due before this wakes the I/O thread (sleep_plan())
        self._results: deque[tuple] = deque()  # look-up results for the I/O thread
        self._verifies: deque[Verify] = deque()  # checksums a caller's poll handed to the I/O thread
        self._cancels_out: deque[SendCancel] = deque()  # cancels a caller's clear() handed to the I/O thread
        self._caller_at = -CALLER_LEASE_S  # when the caller last read the status socket
        self._watcher: int | None = None  # the thread whose wait() sleeps on the status socket
        self._watch = threading.Lock()  # held by that thread; _watch_waker wakes it when a room concludes elsewhere
        self._watch_woken = False  # its last sleep saw the watch waker readable (held under _watch)
        # close() and a wait() holding _watch agree here on who closes the status socket and the watch waker:
        # close() once no wait() holds _watch, else that wait() as it lets go (`_status_left`). Reentrant: a
        # signal's handler may close the manager on a waiting thread inside its hold.
        self._watch_exit = threading.RLock()
        self._status_left = False
        self._statuses_left = False  # a drain stopped with statuses still queued
        # The last read of the status socket found it empty (its descriptor signals whatever comes since); false
        # from the start of each read, so a read that raised leaves it false.
        self._drained = False
        self._ticked_at = self.clock()  # when the I/O thread last ticked the core
        self._watch_poller = select.poll()  # used by the thread that holds _watch
        self._watch_poller.register(self._status_fd, select.POLLIN)
        self._watch_poller.register(self._watch_waker.fileno(), select.POLLIN)
        self._lookups = _LookUps(f"epd-pre{engine_rank}-boot", lookup_timeout_s, self.clock, self._deliver,
                                 LOOKUP_THREADS)
        self._stopping = False
        # close() and the I/O thread agree here on who closes the sockets: close() once the
        # thread stopped, else the thread itself when it finally does.
        self._exit_lock = threading.Lock()
        self._exited = False
        self._abandoned = False
        self._closed = False  # a close() ran to its end
        self.failure: str | None = None  # why the I/O thread stopped on its own
        self._complaints = _io.ThrottledLog(log)  # about statuses peers sent
        self._failures = _io.ThrottledLog(log)  # rooms that failed, per kind
        self._poller = zmq.Poller()
        self._thread = threading.Thread(target=self._run, name=f"epd-prefill-{engine_rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ commands

    def receive(self, record: Room, spec: RoomSpec) -> None:
        """Files the room and starts it; the caller's thread sends its ask when the route is cached. The caller
        checked the process first (check_process(): SessionManager.receive() does, before it leases a slot)."""
        room = spec.room
        if not self._lock.acquire(True, _io.LOCK_WAIT_S):
            raise UsageError(MANAGER_CLOSED if self._stopping else self._held_text("receive()"))
        try:
            if self._stopping:
                raise UsageError(MANAGER_CLOSED)
            if self.failure is not None:
                raise UsageError(f"session manager's I/O thread stopped after an error ({self.failure}; its traceback "
                                 f"is logged): close() the manager and start a new one")
            now = self.clock()
            record.token, actions = self.core.receive(now, spec)  # refuses a room number held (nothing filed)
            counted = False
            try:
                self.rooms[room] = record
                # Counted before anything concludes it (the actions may): no scrape sees it concluded, not started.
                self.metrics.inc("rooms_started_total")
                counted = True
                # The plain start, a lone ask on a socket the caller may use now: sent as _carry() would send it
                # (the room enters the table there).
                if len(actions) == 1 and type(actions[0]) is SendAsk:
                    verifies = self._ask_plain(now, actions[0], record)
                else:
                    self.table.start(room, TransferPoll.Bootstrapping)
                    verifies = self._carry(now, actions)
            except BaseException:  # the caller gets the error and no handle: leave nothing behind
                self.core.clear(now, room, record.token)
                if self.rooms.get(room) is record:
                    del self.rooms[room]
                self.table.clear(room)
                if counted and record.concluded_at is None:  # counted started, so counted concluded too
                    self.metrics.inc("rooms_failed_total", reason=FailureKind.OTHER.value)
                raise
            wake = self._must_wake()
        finally:
            self._lock.release()
        for verify in verifies:  # none in practice: a Verify follows a status
            self._verify(verify)
        if wake:
            self._waker.wake()

    def clear(self, record: Room) -> bool | None:
        """Forgets the room; whether it had succeeded, or None when it was not held (nor is it in a
        forked child: the room, its lock and its encode rank's socket are the parent's)."""
        if self._forks != _forks.count:  # self.forked, without its call
            return None
        if not self._lock.acquire(True, _io.LOCK_WAIT_S):
            if self._stopping:  # close() failed the rooms without it, and takes their slots back
                return None
            raise UsageError(self._held_text("clear()"))
        try:
            room, rooms = record.room, self.rooms
            if room not in rooms or rooms[room] is not record:  # rooms.get(), without its call (_lock held)
                return None
            now = self.clock()
            actions, safe = self.core.abandon_or_let_go(now, room, record.token)
            if actions:  # a cancel: its room's status, as it stands before they are carried out
                succeeded = self.table.get(room) == TransferPoll.Success
                self._carry(now, actions)
                safe = self.core.let_go(now, room, record.token)
            if safe:
                record.memory_safe = True
            del self.rooms[room]
            status = self.table.clear(room)
            if not actions:  # nothing moved its status since abandon(): the one it left with
                succeeded = status == TransferPoll.Success
            unconcluded = record.concluded_at is None
            if unconcluded:  # given up before it concluded: its quarantine bound runs from here
                record.concluded_at = now
            # A room that succeeded is never quarantined (fate_of()): asked only of one that did not.
            if not succeeded and fate_of(succeeded=False, memory_safe=record.memory_safe,
                                         confirmable=True) is Fate.QUARANTINE_UNTIL_CONFIRMED:
                self._awaiting_safe.add(record.token, now, record)
            if self._awaiting_safe.rooms:  # else none to let go of
                self._forget_unconfirmed(now)
            cancels = bool(self._cancels_out)
            if unconcluded:  # last: a count that raises leaves the room forgotten in full
                self.metrics.inc("rooms_failed_total", reason=FailureKind.CLEARED.value)
        finally:
            self._lock.release()
        if unconcluded:
            self._tell_waiters()  # a wait() on it from another thread returns
        if cancels:
            self._waker.wake()
        return succeeded

    def _forget_unconfirmed(self, now: float) -> None:
        """Lets go of cleared rooms whose quarantine passed unconfirmed (lock held): their memory's own
        quarantine ends by itself, and their `on_safe` would keep the pool's slot alive."""
        for record in self._awaiting_safe.expire(now):
            record.on_safe = None

    def when_safe(self, record: Room, on_safe: Callable[[], None]) -> None:
        """Runs `on_safe` once the cleared room's memory is known safe (at once when it already is). UsageError
        when the lock stays held past LOCK_WAIT_S: `on_safe` never runs (the memory waits out its quarantine)."""
        if not self._lock.acquire(True, _io.LOCK_WAIT_S):
            if self._stopping:  # closed: no confirmation is heard any more, the memory waits out its quarantine
                return
            raise UsageError(self._held_text("clear()", "the room is forgotten, and its pool slot waits out its "
                                                        "quarantine bound"))
        try:
            if not record.memory_safe:
                record.on_safe = on_safe
                return
        finally:
            self._lock.release()
        on_safe()

    def _held_text(self, call: str, left: str = "nothing was done") -> str:
        """Why a caller's `call` gave up waiting for _lock (`left`: what that leaves), and what to do. Its
        holders take it only for non-blocking steps: one that keeps it LOCK_WAIT_S is stuck."""
        return (f"prefill rank {self.engine_rank}'s session manager: {call} waited {_io.LOCK_WAIT_S:g}s for its "
                f"lock, which its steps hold for microseconds, and gave up; {left}. Inside the manager now: "
                f"{_io.threads_inside(lambda obj: obj is self)}. A step stuck there (a device, engine or log "
                f"handler call that does not return) holds every room: close() the manager (it returns within "
                f"close_timeout_s, failing its rooms) and start a new one")

    def progress(self) -> None:
        """Handles the statuses queued, on the caller's thread (poll(), concluded()); never blocks.

        The checksums they call for go to the I/O thread: a scheduler's step does not
        wait for them.
        """
        if self.clock() - self._caller_at < PROGRESS_EVERY_S:
            return  # a loop polling many handles reads the socket once
        self.check_process()
        if not self._lock.acquire(blocking=False):
            return  # the I/O thread is stepping the core: it reads the socket on this turn
        try:
            taken = self._take_as_caller()
            if taken is None:
                return
            verifies, more = taken
            self._verifies.extend(verifies)
            wake = more or bool(verifies) or self._must_wake()
        finally:
            self._lock.release()
        if wake:
            self._waker.wake()

    def wait(self, record: Room, timeout: float) -> None:
        """Blocks until the room concludes, at most `timeout` seconds.

        The first thread to wait sleeps on the status socket itself and handles what
        comes (checksums included: it is waiting anyway; those its timeout leaves go to the
        I/O thread), so a status wakes it directly rather than the I/O thread and then it;
        other waiters wait for a conclusion.
        """
        if self._forks != _forks.count:  # check_process()'s test, its call only to refuse
            self.check_process()
        if record.concluded_at is not None:
            return  # as the loop below returns at once, without reading the clock
        deadline = self.clock() + timeout
        remaining = timeout  # deadline less the clock, read last; each turn's end reads it again
        while record.concluded_at is None:
            if remaining <= 0:
                return
            if self._stopping or self.failure is not None:
                self.conclusions.wait(record, remaining)
                return
            if not self._watch.acquire(blocking=False):
                self.conclusions.wait(record, min(remaining, CALLER_LEASE_S))
                remaining = deadline - self.clock()
                continue
            try:
                if self._stopping:
                    continue  # close() got here first: the watch waker may be closed
                self._watcher = threading.get_ident()
                self._watch_turns(record, remaining, deadline)
            finally:
                self._watcher = None
                now = self._caller_at = self.clock()  # a scheduler's next poll usually follows at once
                remaining = deadline - now
                with self._watch_exit:
                    self._watch.release()
                    left, self._status_left = self._status_left, False
                if left:  # close() gave up waiting for this wait(): its sockets are this thread's to close
                    self._close_status()

    def _watch_turns(self, record: Room, remaining: float, ends: float) -> None:
        """The turns of a waiting caller, `remaining` seconds before the wait `ends` (on the clock), while it holds
        _watch: each handles what is queued, then sleeps on the socket. It returns where wait()'s loop would not
        start another turn (the room concluded, the wait is over, closing or failed), and where the lock stays
        held past the wait's own bound (a stuck I/O thread); a turn that found more queued, or a sleep that
        ended, is followed by the next turn in the same hold of _watch.

        The first turn does not read the socket where the last read found it empty (`_drained`): its descriptor
        then signals whatever came since, so that turn's sleep ends at once for a status already queued, and the
        next turn reads it."""
        first = True
        while True:
            # Before looking: a conclusion from now on wakes the sleep below.
            self._watch_waker.drain(self._watch_woken)
            self._watch_woken = False
            if not self._lock.acquire(timeout=remaining):
                return  # held past the wait's own bound (a stuck I/O thread): wait() returns
            try:
                taken = self._take_as_caller(read=not (first and self._drained))
                if taken is None:
                    return
                verifies, more = taken
                first = False
                wake = self._must_wake()
            finally:
                self._lock.release()
            if wake:
                self._waker.wake()
            for i, verify in enumerate(verifies):
                if self.clock() >= ends:  # the wait is over: the I/O thread checks the rest
                    self._verifies.extend(verifies[i:])
                    self._waker.wake()
                    break
                try:
                    self._verify(verify)
                except BaseException:
                    # A stop signal's exception (KeyboardInterrupt) in this wait(): the statuses were taken off
                    # the socket, so the I/O thread checks these rooms (a check done again changes nothing).
                    self._verifies.extend(verifies[i:])
                    self._waker.wake()
                    raise
            if record.concluded_at is not None:
                return
            if not more:
                # The socket's descriptor signals only after a receive found it empty, as the one above (or,
                # on the first turn, the last one) did; a conclusion elsewhere (a deadline, a look-up, close())
                # signals the watch waker.
                waker = self._watch_waker.fileno()
                woken = False
                for fd, _ in self._watch_poller.poll(
                        math.ceil(max(0.0, min(ends - self.clock(), WAIT_SLICE_S)) * 1000)):
                    woken = woken or fd == waker  # any(), without its call and its generator's
                self._watch_woken = woken
                if record.concluded_at is not None:
                    return
            # wait()'s loop, which would start the next turn: closing or failed, it waits for the conclusion
            # without the socket (the watch waker may be closed); past the wait's end, it returns.
            if self._stopping or self.failure is not None:
                return
            remaining = ends - self.clock()
            if remaining <= 0:
                return

    @property
    def forked(self) -> bool:
        """Whether this process was forked from the one that made this driver (which holds its sockets and
        its I/O thread)."""
        return self._forks != _forks.count

    def check_process(self) -> None:
        """UsageError in a process forked from the one that made this driver: its sockets are the parent's
        (ZMQ's calls on them fail there, for ever, as interrupted) and its I/O thread did not come along."""
        if self._forks != _forks.count:  # self.forked, without its call
            raise UsageError(f"prefill rank {self.engine_rank}'s session manager was made before this process "
                             f"(pid {os.getpid()}) was forked from its parent: its sockets and I/O thread are the "
                             f"parent's; make a SessionManager in this process")

    def _take_as_caller(self, read: bool = True) -> tuple[list[Verify], bool] | None:
        """The caller's thread handles the statuses queued, as progress() and wait() do (_lock held):
        the checksums they call for and whether more are queued, or None once stopping or failed. With
        `read` false the socket is left as it is (nothing taken, none said to be left)."""
        if self._stopping or self.failure is not None:
            return None
        self._caller_at = self.clock()
        return self._take_statuses(STATUSES_PER_HOLD) if read else ([], False)

    def _must_wake(self) -> bool:
        """Whether a step off the I/O thread left it work it would not wake for by itself (_lock held)."""
        return self._resync or self.core.wakes_before(self._wake_at)

    def _run_on_safe(self, record: Room) -> None:
        on_safe, record.on_safe = record.on_safe, None
        if on_safe is not None:
            try:
                on_safe()
            except Exception:  # noqa: BLE001 - the pool's bookkeeping must not stop the I/O thread
                log.exception("room %d: freeing its memory after its cancel was confirmed failed", record.room)

    def close(self, reason: str = "session manager closed", close_by: float = math.inf) -> None:
        """Fails rooms still open, stops the threads and closes the sockets, unless the I/O thread is stuck.

        Returns by `close_by` (time.monotonic()) whatever happens: a thread still busy then (the I/O
        thread, a caller's wait() inside a checksum, a look-up thread waiting for its server) is left
        to end alone, its sockets with it, and one error line names it. A close that raised before
        its end (a stop signal's exception, KeyboardInterrupt, while it waited) is finished by the next
        one; once a close ended, the next returns at once."""
        if self._closed:
            return
        started = time.monotonic()
        self._lookups.stop()  # a look-up answered from now on delivers nothing
        # receive() files rooms under the lock: none is filed after this. A thread stuck while
        # holding it keeps receive() out anyway, so close() goes on without it.
        locked = self._lock.acquire(timeout=_io.seconds_left(close_by, STOP_WAIT_S))
        try:
            self._stopping = True
        finally:
            if locked:
                self._lock.release()
        self._waker.wake()
        self._thread.join(timeout=_io.seconds_left(close_by, STOP_WAIT_S))
        with self._exit_lock:
            # A thread an earlier close left stuck closes the sockets itself, whenever it stopped.
            stuck = self._abandoned = self._abandoned or not self._exited
        # Held by no thread once the I/O thread stopped, unless one is stuck inside a step.
        held = not stuck and self._lock.acquire(
            timeout=-1 if math.isinf(close_by) else _io.seconds_left(close_by, math.inf))
        failure = Failure(FailureKind.CLOSED, reason)
        if not held:
            # It may be inside the core, the lock or a socket: leave all three to it (the I/O thread
            # closes the sockets when it stops) and conclude the rooms through the thread-safe table.
            what = ("the I/O thread did not stop within %.1fs of close(); it keeps its sockets until it does"
                    if stuck else "a thread held the session manager's lock for %.1fs of close(); its sockets stay "
                    "open")
            log.error("prefill rank %d: " + what + ", and its rooms fail now", self.engine_rank,
                      time.monotonic() - started)
            for record in list(self.rooms.values()):
                self._conclude(self.clock(), Conclude(record.room, record.token, failure))
        else:
            try:
                now = self.clock()
                self._carry(now, self.core.close(now, failure))
                cancelled = self._send_cancels_left()
                self.core.forget_rooms()
            finally:
                self._lock.release()
            self._close_sockets(cancelled, close_by)
        still = self._lookups.join(_io.seconds_left(close_by, self.lookup_timeout_s + 1.0))
        if still:
            log.error("prefill rank %d: closing left %d bootstrap look-ups still under way after %.1fs (%s); "
                      "their threads end at their look-up timeout (%gs), delivering nothing%s", self.engine_rank,
                      len(still), time.monotonic() - started, ", ".join(map(_lookup_text, still[:8])) +
                      (f" and {len(still) - 8} more" if len(still) > 8 else ""), self.lookup_timeout_s,
                      "" if math.isinf(close_by) else "; raise close_timeout_s (EPD_CLOSE_TIMEOUT_S) to wait for them")
        for throttled in (self._complaints, self._failures):
            throttled.flush()  # the counts of warnings left out that no later one will tell
        self._closed = True

    def _send_cancels_left(self) -> set[tuple[str, int]]:
        """Sends the cancels handed to the I/O thread and not sent yet (_lock held; only once it stopped,
        so no other thread uses those sockets); returns the addresses of the sockets they were queued on."""
        queued = set()
        while self._cancels_out:
            cancel = self._cancels_out.popleft()
            if cancel.addr in self._sockets:
                queued.add(cancel.addr)
            self._carry(self.clock(), self._send_cancel(cancel))
        return queued

    def _close_sockets(self, cancelled: Collection[tuple[str, int]] = (), close_by: float = math.inf) -> None:
        """Closes every socket and the wakers; only once the I/O thread stopped. The sockets to the encode
        addresses in `cancelled` get CANCEL_FLUSH_MS to send the cancels queued on them (ZMQ's I/O thread
        sends them: this does not wait). A caller's wait() still inside a turn at `close_by` (a checksum
        that does not return), or the one a signal's handler closing the manager interrupted on this very
        thread (it cannot return before this does), keeps the status socket and its waker: it sleeps on
        their descriptors, and closes them as it returns."""
        # A waiting caller sleeps on the status socket's descriptor; the rooms' conclusions woke it.
        inside = self._watcher == threading.get_ident()  # never true of the I/O thread
        watched = not inside and self._watch.acquire(
            timeout=-1 if math.isinf(close_by) else _io.seconds_left(close_by, math.inf))
        if not watched:
            with self._watch_exit:  # a wait() that let go meanwhile left the sockets here; else it takes them
                watched = self._watch.acquire(blocking=False)
                self._status_left = not watched
        try:
            with self._lock:
                if watched:
                    self._status_sock.close(0)
                for addr in list(self._sockets):
                    self._disconnect(addr, CANCEL_FLUSH_MS if addr in cancelled else 0)
            if watched:
                self._watch_waker.close()
            else:
                self._watch_waker.wake()  # an interrupted sleep on it ends once the handler returns
                if not inside:
                    log.error("prefill rank %d: a wait() on a room did not return by close's bound; it closes the "
                              "status socket when it does", self.engine_rank)
        finally:
            if watched:
                self._watch.release()
        self._waker.close()

    def _close_status(self) -> None:
        """Closes the status socket and the watch waker that _close_sockets() left to a wait(), as it lets go."""
        with self._lock:
            self._status_sock.close(0)
        self._watch_waker.close()

    def sockets(self) -> list[zmq.Socket]:
        """The status socket and the open sockets to encode ranks."""
        with self._lock:
            return [self._status_sock, *self._sockets.values()]

    # --------------------------------------------------------- the I/O thread

    def _run(self) -> None:
        _io.name_this_thread(f"epd-pre{self.engine_rank}-io")
        poller = self._poller
        poller.register(self._waker.fileno(), zmq.POLLIN)
        watching = False  # the status socket's descriptor is in the poller
        monitors_read_at = self.clock()
        try:
            while not self._stopping:
                timeout_ms, watch = self._sleep_plan()
                if watch != watching:
                    if watch:
                        poller.register(self._status_fd, zmq.POLLIN)
                    else:
                        poller.unregister(self._status_fd)
                    watching = watch
                events = dict(poller.poll(timeout_ms))
                if self._waker.fileno() in events:
                    self._waker.drain()
                    self._take_results()
                    if self._cancels_out:
                        with self._lock:
                            while self._cancels_out:
                                self._carry(self.clock(), self._send_cancel(self._cancels_out.popleft()))
                while self._verifies:
                    self._verify(self._verifies.popleft())
                # Left to the caller, the socket is still read on every turn: a status
                # that came just before a room's deadline counts before the deadline does.
                if self._status_fd in events or not watching or self._statuses_left:
                    self._drain_statuses()
                for sock, flags in events.items():
                    if flags & zmq.POLLOUT and sock in self._watching:
                        self._step(lambda now, addr=self._watching[sock]: self.core.writable(now, addr))
                self._step(self._tick)
                if self.clock() - monitors_read_at >= MONITOR_PERIOD_S:
                    monitors_read_at = self.clock()
                    self._read_monitors()
                    with self._lock:
                        self._forget_unconfirmed(self.clock())
                    if self.pool is not None:
                        self.pool.poll()  # graces and quarantines end while no room is received, too
                self._watch_writable()
        except Exception as exc:  # without this thread no room would ever conclude
            log.exception("prefill rank %d: the I/O thread failed; failing its rooms", self.engine_rank)
            self.failure = f"{type(exc).__name__}: {exc}"
            with self._lock:
                now = self.clock()
                self._carry(now, self.core.fail_all(now, Failure(FailureKind.CLOSED,
                                                                 f"session manager stopped: {self.failure}")))
        finally:
            with self._exit_lock:
                self._exited = True
                abandoned = self._abandoned
            if abandoned:
                self._close_sockets()

    def _sleep_plan(self) -> tuple[int, bool]:
        """How long the I/O thread may sleep (until the core's next wakeup, at most 1 s), and whether
        it watches the status socket meanwhile (not while the caller reads it)."""
        with self._lock:
            timeout_ms, watch, self._wake_at = sleep_plan(
                self.clock(), self.core.next_wakeup(), waiter=self._watcher is not None, caller_at=self._caller_at,
                lease_s=CALLER_LEASE_S, look_s=WAITER_LOOK_S, busy=self._statuses_left or bool(self._verifies))
        return timeout_ms, watch

    def _tick(self, now: float) -> list:
        """The core's tick (_lock held). Statuses that came before a room's deadline count: when some
        may still be unread (this thread was held up past the tick's time, its process stopped, or the
        last drain left some queued; ZMQ's own I/O thread may not even have handed them over yet), the
        core gives the next turns a moment to read them."""
        late = unread(now, self.core.next_wakeup(), self._statuses_left, self._ticked_at)
        self._ticked_at = now
        return self.core.tick(now, EXPIRE_BATCH, unread=late)

    # event(now): typed loosely because the lambdas bind loop values as defaults, which mypy cannot infer.
    def _step(self, event: Callable[..., list]) -> None:
        """Feeds one event to the core under the lock, then runs the checksums it asked for."""
        with self._lock:
            now = self.clock()
            verifies = self._carry(now, event(now))
        for verify in verifies:
            self._verify(verify)

    def _deliver(self, result: tuple) -> None:
        """A look-up thread's result, for the I/O thread."""
        self._results.append(result)
        self._waker.wake()

    def _take_results(self) -> None:
        core = self.core
        while self._results:
            kind, *args = self._results.popleft()
            if kind == "parallel":
                self._step(lambda now, a=args: core.parallel_resolved(now, *a))
            elif kind == "route":
                self._step(lambda now, a=args: core.route_resolved(now, *a))
            elif kind == "missing":
                self._step(lambda now, a=args: core.route_missing(now, *a))
            else:
                self._step(lambda now, a=args: core.lookup_failed(now, *a))

    def _drain_statuses(self) -> None:
        """Handles the statuses queued, at most DRAIN_BATCH of them (the loop comes back at once for the rest)."""
        for _ in range(0, DRAIN_BATCH, STATUSES_PER_HOLD):
            with self._lock:
                if self._stopping:
                    return
                verifies, more = self._take_statuses(STATUSES_PER_HOLD)
            for verify in verifies:
                self._verify(verify)
            if not more:
                return

    def _take_statuses(self, limit: int) -> tuple[list[Verify], bool]:
        """Handles up to `limit` queued statuses (_lock held); the checksums to run, and whether more may wait.

        The Successes that settle lanes (transfer.core.lane) are read and matched natively, many a
        call; each other status goes through the core's general rules, in the order they came."""
        verifies: list[Verify] = []
        core = self.core
        left = limit
        self._drained = False
        while left > 0:
            settled, frames, empty = _io.take_statuses(self._status_sock, core.lanes, left)
            now = self.clock()
            # The message that ended the call, if any, counts as one read: handled below, or discarded for its
            # size (a peer pushing only such messages must not hold the lock for as long as it pushes).
            left -= len(settled) + 1
            if settled:
                verifies += self._settle_lanes(now, settled)
            if frames is not None:
                verifies += self._take_status(now, frames)
            if empty:
                self._statuses_left = False
                self._drained = True
                return verifies, False
        self._statuses_left = True
        return verifies, True

    def _settle_lanes(self, now: float, settled: list[int]) -> list[Verify]:
        """The Successes that settled the lanes of `settled` through the core, carried out (_lock held); the
        checksums to run.

        The core's plain answer, a Conclude Success of each room (told as the rooms' tokens: core.lanes_succeeded()),
        is carried out for the rooms together: what _stamp_status() and _carry() do one room at a time, with one
        hold of the table's lock, one update of the metrics and one wake-up of the waiters. Any other answer (a
        lane that outlived its plain case) goes through them."""
        tokens, actions = self.core.lanes_succeeded(now, settled)
        if actions:
            self._stamp_status(now, actions)
            return self._carry(now, actions)
        rooms = self.rooms
        records: list[Room] = []
        for room, token in zip(settled, tokens):
            record = rooms[room] if room in rooms else None  # rooms.get(), without its call (_lock held)
            if record is not None and record.token == token:
                if record.status_at is None:  # _stamp_status()
                    record.status_at = now
                records.append(record)
        if records:
            self._succeed(now, records)
        return []

    def _succeed(self, now: float, records: list[Room]) -> None:
        """_conclude() of a Conclude Success of each room of `records` (held under its token), together."""
        left = self.table.succeed([record.room for record in records])
        if left:  # some concluded already (by close(), without _lock): the others only
            records = [record for record in records if record.room not in left]
            if not records:
                return
        nbytes = 0
        for record in records:
            nbytes += record.nbytes
        try:
            # _io.count_concluded() of each Success, at once.
            self.metrics.inc_all_observing({"rooms_succeeded_total": len(records), "bytes_received_total": nbytes},
                                           "room_latency_seconds", [now - record.started_at for record in records])
        finally:  # concluded in the table, however the count went (see _conclude)
            for record in records:
                record.concluded_at = now
                record.succeeded = True
                # memory_safe stays: a lane's room was asked and is neither verified nor given up, so the core does
                # not hold its memory safe (PrefillCore.safe() is False); nor does a Success's memory_safe count (its
                # readers take succeeded first, and an Overturn sets it).
            self._tell_waiters()

    def _take_status(self, now: float, frames: list[bytes]) -> list[Verify]:
        """One status (or cancel answer) through the core's general rules (_lock held); the checksums to run."""
        unreadable = None  # a checksum part (ours, SPEC.md 8) that does not parse
        reason = None  # why the encode side failed the room (ours, SPEC.md 8)
        try:
            answer = parse_cancel_reply(frames)
            if answer is not None:
                return self._carry(now, self.core.cancel_answered(now, answer.room, answer.rank, answer.answer))
            room, status, rank, sums = parse_status(frames)
            if status is TransferPoll.Failed and len(frames) > 3:
                reason = parse_failure_reason(frames)
        except UnreadableChecksum as exc:
            room, status, rank, sums, unreadable = exc.room, exc.status, exc.rank, (), str(exc)
        except WireError as exc:
            self._complaints.warning(str(exc), "dropped a malformed status (%d parts): %s", len(frames), exc)
            return []
        actions = self.core.status(now, room, status, rank, sums, unreadable, reason)
        self._stamp_status(now, actions)
        return self._carry(now, actions)

    def _stamp_status(self, now: float, actions: list) -> None:
        """Notes when the status that settles a room (concludes it, or has it verified) was read."""
        for action in actions:
            if type(action) is Conclude or type(action) is Verify:
                rooms = self.rooms
                record = rooms[action.room] if action.room in rooms else None  # rooms.get(), without its call
                if record is not None and record.token == action.token and record.status_at is None:
                    record.status_at = now

    def _verify(self, verify: Verify) -> None:
        """Compares the landed bytes with the sender's checksums, outside the lock. Once closing, nothing
        more is checked: close() fails the room, and the thread that checks (the I/O thread, a waiting
        caller) gets on to stopping instead of working through the checksums taken before."""
        core, room, token = self.core, verify.room, verify.token
        for what, region, addr, nbytes, expected in verify.checks:
            if self._stopping:
                return
            try:
                landed = self._checksum(region, addr, nbytes)
            except Exception as exc:  # e.g. a device error while checking: this room only
                log.exception("room %d: checksumming its landed %s failed", room, what)
                failure = Failure(FailureKind.OTHER, checksum_failed_detail(room, what, addr, nbytes, verify.where,
                                                                            exc))
                self._step(lambda now: core.fail(now, room, token, failure))
                return
            if landed != expected:
                self._step(lambda now: core.checksum_mismatched(now, room, token, what, expected, landed))
                return
        self._step(lambda now: core.checksum_verified(now, room, token))

    def _checksum(self, region: Any, addr: int, nbytes: int) -> int:
        return _io.checksum(region, addr, nbytes)

    def _read_monitors(self) -> None:
        """Reads every encode socket's drop reports, so an idle one's do not pile up in ZMQ, and
        closes the sockets that sent nothing for ASK_IDLE_S with nothing under way there, and those
        the core let go while this thread polled them (see `_carry`)."""
        with self._lock:
            now = self.clock()
            for addr, monitor in list(self._monitors.items()):
                if not self.core.connected(addr):
                    self._disconnect(addr)
                    continue
                if _io.dropped(monitor):
                    self._carry(now, self.core.connection_dropped(now, addr))  # look-ups, or its own close
                if now - self._used_at.get(addr, now) >= ASK_IDLE_S and self.core.idle(addr, now):
                    self.core.connection_closed(now, addr)
                    self._disconnect(addr)

    def _watch_writable(self) -> None:
        """Polls for POLLOUT exactly the sockets that have asks waiting (I/O thread only)."""
        with self._lock:
            self._resync = False
            waiting = self.core.asks.addresses()
        for addr in [addr for addr in waiting if addr not in self._sockets]:
            # Queued behind a look-up's first batch with no socket yet: sending makes one.
            self._step(lambda now, addr=addr: self.core.writable(now, addr))
        with self._lock:
            wanted = {self._sockets[addr]: addr for addr in self.core.asks.addresses() if addr in self._sockets}
            for sock in [s for s in self._watching if s not in wanted]:
                self._poller.unregister(sock)
                del self._watching[sock]
            for sock, addr in wanted.items():
                if sock not in self._watching:
                    self._poller.register(sock, zmq.POLLOUT)
                    self._watching[sock] = addr

    # ---------------------------------------------------------------- actions

    def _carry(self, now: float, actions: list) -> list[Verify]:
        """Carries out the core's actions in order (_lock held); returns the checksums to run after it."""
        core = self.core
        work = list(actions)
        verifies: list[Verify] = []
        refused: dict[tuple[str, int], list] = {}
        dropped: set[tuple[str, int]] = set()
        # The addresses whose drop reports this carry read: a dict used as a set, filed by key without set.add()'s call.
        checked: dict[tuple[str, int], None] = {}
        i = 0  # actions carried out so far
        for action in work:  # a list's iterator also takes what is appended to the list meanwhile
            i += 1
            kind = type(action)
            if kind is SendAsk or kind is Announce:
                work += self._push(now, action, refused, dropped, checked)
            elif kind is Conclude:
                self._conclude(now, action)
            elif kind is Overturn:
                self._overturn(action)
            elif kind is Advance:
                record = self.rooms.get(action.room)
                if record is not None and record.token == action.token:
                    self.table.update(action.room, action.status)
            elif kind is Verify:
                verifies.append(action)
            elif kind is LookUpParallel or kind is LookUpRoute:
                self._lookups.submit(action)
            elif kind is SendCancel:
                if threading.current_thread() is self._thread:
                    work += self._send_cancel(action)
                else:  # the I/O thread may be polling that socket, which is not thread-safe
                    self._cancels_out.append(action)
            elif kind is MemorySafe:
                self._memory_safe(action)
            elif kind is Disconnect:
                sock = self._sockets.get(action.addr)
                if threading.current_thread() is self._thread or sock is None or sock not in self._watching:
                    self._disconnect(action.addr, CANCEL_FLUSH_MS if action.flush else 0)
                # Else the I/O thread may be polling it: it closes it at its next look at the monitors,
                # unless a room connected to the same address again meanwhile (then it serves that room).
            elif kind is Warn:
                self._complaints.warning(action.key, "%s", action.message)
            if refused and i == len(work):
                # The asks a socket did not take wait in the core, in order; after a lost
                # connection their route is looked up again (they move if their rank did), and
                # they go out behind a fresh registration.
                for addr, held in refused.items():
                    work += core.refused(now, addr, held)
                    if addr in dropped:
                        work += core.connection_dropped(now, addr)
                    elif threading.current_thread() is not self._thread:
                        self._resync = True
                refused.clear()
                dropped.clear()
        return verifies

    def _push(self, now: float, action: Announce | SendAsk, refused: dict, dropped: set, checked: dict) -> list:
        """Sends a registration or a TransferInfo unless its socket cannot take it now."""
        addr = action.addr
        if addr in refused:
            refused[addr].append(action)
            return []
        if self._stopping:
            # Closing. A close() that could not take the lock from a thread stuck holding it (this one, back now)
            # failed the rooms through the table and let go of their memory, quarantined from then with no cancel
            # sent: an ask leaving now could have a write land past that quarantine. Nothing is offered any more.
            return []
        if type(action) is SendAsk and not self.core.asking(action.room, action.token):
            return []  # concluded or cleared since the ask was made: its memory is not ours to offer
        sockets = self._sockets
        sock = sockets[addr] if addr in sockets else None  # sockets.get(addr), without its call
        if sock is None:
            try:
                sock = _io.push_socket(*addr, immediate=True, reconnect_max_ms=_io.STATUS_RECONNECT_MAX_MS)
            except zmq.ZMQError as exc:
                return self.core.connect_failed(now, addr, str(exc))
            try:
                monitor = _io.watch_drops(sock)
            except zmq.ZMQError as exc:  # out of sockets or descriptors: this rank's rooms fail, not the thread
                sock.close(0)
                return self.core.connect_failed(now, addr, f"cannot watch its connection: {exc}")
            self._sockets[addr] = sock
            self._monitors[addr] = monitor
            self._used_at[addr] = now
        elif ((sock in self._watching or (self._cancels_out and any(cancel.addr == addr
                                                                    for cancel in self._cancels_out)))
              and threading.current_thread() is not self._thread):
            # Off the I/O thread, which may be polling it, or has a cancel to send on it first (an ask for
            # the room again must not overtake it): the ask waits with those queued there, for it to send.
            # (The thread is asked last: the two tests before it, free of calls, rarely hold.)
            refused[addr] = [action]
            return []
        elif addr not in checked and _io.dropped(self._monitors[addr]):
            # Its encode rank may have restarted, there or elsewhere: looked up again below.
            dropped.add(addr)
            refused[addr] = [action]
            return []
        checked[addr] = None
        sent_at = self.clock()  # before: the encode rank cannot have it earlier
        self._used_at[addr] = sent_at
        try:
            self._send(sock, action)
        except zmq.Again:
            refused[addr] = [action]
            return []
        except Exception as exc:  # one ask's failure must not stop the others
            log.exception("asking %s:%d for room %d failed", addr[0], addr[1], action.room)
            return self.core.unsent(now, action, Failure(
                FailureKind.OTHER, f"room {action.room}: asking for it failed: {type(exc).__name__}: {exc}"))
        if type(action) is SendAsk:
            self.table.update(action.room, TransferPoll.WaitingForInput)
            rooms = self.rooms
            record = rooms[action.room] if action.room in rooms else None  # rooms.get(), without its call
            if record is not None and record.token == action.token and record.asked_at is None:
                record.asked_at = sent_at
        return []

    def _ask_plain(self, now: float, action: SendAsk, record: Room) -> list[Verify]:
        """Starts `record`'s room in the table and carries out `[action]`, the ask core.receive() just made for
        it, with what table.start(room, Bootstrapping) and _carry() would do (_lock held, off the I/O thread);
        the checksums to run after it.

        The ask is not re-checked with core.asking(): nothing ran since the core made it. Where its socket is
        the plain one (open, not polled by the I/O thread, no cancel queued for it) and the manager is not
        closing (close() may have given the room up while a count held this call), it is sent here, and the
        room enters the table at WaitingForInput: what start() and then update() leave, and no one reads the
        table for the room in between (its handle is not out yet). A drop report, a full queue or a failed
        send is handed on to the core as _carry() hands it on, the room started at Bootstrapping first."""
        addr, room = action.addr, action.room
        sockets = self._sockets
        if addr not in sockets or self._cancels_out or sockets[addr] in self._watching or self._stopping:
            # A socket to open, one a cancel may have to go on first, or one the I/O thread may be polling; or
            # closing, which _push() refuses.
            self.table.start(room, TransferPoll.Bootstrapping)
            return self._carry(now, [action])
        sock = sockets[addr]
        if _io.dropped(self._monitors[addr]):
            # _carry(): the ask waits in the core, behind a look-up of its route
            self.table.start(room, TransferPoll.Bootstrapping)
            return self._carry(now, [*self.core.refused(now, addr, [action]), *self.core.connection_dropped(now, addr)])
        sent_at = self.clock()  # before: the encode rank cannot have it earlier
        self._used_at[addr] = sent_at
        try:
            _io.send_ask(sock, action.info)  # _send() of a SendAsk, without its call
        except zmq.Again:
            self.table.start(room, TransferPoll.Bootstrapping)
            self._resync = True  # _carry() off the I/O thread: it must watch that socket
            return self._carry(now, self.core.refused(now, addr, [action]))
        except Exception as exc:  # as _push(): the room fails, not the caller's call
            self.table.start(room, TransferPoll.Bootstrapping)
            log.exception("asking %s:%d for room %d failed", addr[0], addr[1], room)
            return self._carry(now, self.core.unsent(now, action, Failure(
                FailureKind.OTHER, f"room {room}: asking for it failed: {type(exc).__name__}: {exc}")))
        self.table.start(room, TransferPoll.WaitingForInput)
        if record.asked_at is None:  # the room's record, just filed under the ask's token
            record.asked_at = sent_at
        return []

    def _send(self, sock: zmq.Socket, action: Announce | SendAsk) -> None:
        """Queues the action's frames on the socket without blocking (zmq.Again when it cannot take them)."""
        # Both types are final: the type tells them apart, without isinstance()'s call.
        if type(action) is SendAsk:
            _io.send_ask(sock, action.info)
        else:
            _io.send_frames(sock, action.frames)

    def _disconnect(self, addr: tuple[str, int], linger_ms: int = 0) -> None:
        """Closes the socket to `addr` and what watches it (I/O thread or close())."""
        self._used_at.pop(addr, None)
        sock = self._sockets.pop(addr, None)
        if sock is None:
            return
        if self._watching.pop(sock, None) is not None:
            self._poller.unregister(sock)
        _io.close_watched(sock, self._monitors.pop(addr, None), linger_ms)

    def _send_cancel(self, action: SendCancel) -> list:
        """Queues a cancel on the socket the room was asked on; one it cannot take now is not sent
        (the room's memory then waits out the quarantine bound), and the core is told so.

        A socket whose connection dropped since its last ask (each ask reads the drop reports
        first) may already be connected afresh, where the cancel could overtake the ask it
        cancels: it is not sent there, and the core hears of the drop."""
        sock = self._sockets.get(action.addr)
        if sock is not None and _io.dropped(self._monitors[action.addr]):
            # The drop first: an ask the unsent cancel lets go then goes on the fresh connection, behind a
            # fresh registration.
            now = self.clock()
            return [*self.core.connection_dropped(now, action.addr),
                    *self.core.cancel_unsent(now, action.room, action.rank, action.token)]
        if sock is not None:  # else closed since: the cancel would have no connection to go on
            try:
                _io.send_frames(sock, action.frames)
                return []
            except zmq.Again:
                if action.unasked:
                    return []  # it awaits no answer: its memory was never offered
                self._complaints.warning("cancel not sent", "room %d: the socket to %s:%d cannot take its cancel "
                                         "now; its memory is safe only after the quarantine bound", action.room,
                                         *action.addr)
            except zmq.ZMQError as exc:
                log.warning("room %d: sending its cancel failed: %s", action.room, exc)
        return self.core.cancel_unsent(self.clock(), action.room, action.rank, action.token)

    def _memory_safe(self, action: MemorySafe) -> None:
        """The encode rank confirmed the room's cancel: its memory is the caller's again."""
        record = self.rooms.get(action.room)
        if record is None or record.token != action.token:
            record = self._awaiting_safe.confirmed(action.token)
            if record is None:
                return
        record.memory_safe = True
        if record.on_safe is not None:
            self._run_on_safe(record)

    def _conclude(self, now: float, action: Conclude) -> None:
        """Concludes the room in the table once; counts and logs it."""
        record = self.rooms.get(action.room)  # one read: close() concludes here without _lock when it is stuck
        if record is None or record.token != action.token:
            return
        failure = action.failure
        if not self.table.conclude(action.room, TransferPoll.Success if failure is None else TransferPoll.Failed,
                                   failure):
            return
        success_counts: dict[str, float] | None = None
        if failure is None:
            success_counts = {"bytes_received_total": record.nbytes}
            if action.unverified:
                success_counts["rooms_unverified_total"] = 1
        try:
            _io.count_concluded(self.metrics, self._failures, action.room, failure is None, failure,
                                now - record.started_at, success_counts)
        finally:  # the room concluded in the table, however the count went: its record says so, its waiters return
            record.concluded_at = now
            record.succeeded = failure is None
            record.memory_safe = record.memory_safe or self.core.safe(action.room, action.token)
            self._tell_waiters()

    def _tell_waiters(self) -> None:
        """Wakes the callers waiting for conclusions (the watching one through its waker)."""
        self.conclusions.notify()
        watcher = self._watcher
        if watcher is not None and watcher != threading.get_ident():
            self._watch_waker.wake()

    def _overturn(self, action: Overturn) -> None:
        """A room concluded Success is Failed now (its encode rank said so since); counts and logs it."""
        record = self.rooms.get(action.room)
        if record is None or record.token != action.token or not self.table.overturn(action.room, action.failure):
            return
        try:
            self.metrics.inc("rooms_failed_after_success_total")
            self._failures.warning(action.failure.kind, "room %d failed after its Success: %s", action.room,
                                   action.failure.detail)
        finally:  # Failed in the table, however the count went (see _conclude)
            record.succeeded = False
            record.memory_safe = True  # its write was over when it was told Success: no quarantine
            self._tell_waiters()


def _lookup_text(action: LookUpParallel | LookUpRoute) -> str:
    """A look-up as a log line names it."""
    if type(action) is LookUpRoute:
        return f"encode rank {action.key[2]} (dp group {action.key[1]}) at bootstrap {action.bootstrap_addr}"
    return f"the parallel sizes at bootstrap {action.bootstrap_addr}"


class _LookUps:
    """Bootstrap look-ups on up to `threads` threads, started as needed; results go to `deliver`.

    One server's look-ups run on all but one of the threads at most (its others wait, in order): a server
    that stalls with a look-up on each of them leaves a thread to the other servers' look-ups."""

    def __init__(self, name: str, timeout_s: float, clock: Callable[[], float], deliver: Callable[[tuple], None],
                 threads: int) -> None:
        self._name = name
        self._timeout_s = timeout_s
        self._clock = clock
        self._deliver = deliver
        self._max = threads
        self._jobs: deque[Any] = deque()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._stopping = False
        self._busy: dict[int, Any] = {}  # the look-up each thread is inside, by thread id
        self._per_server = max(1, threads - 1)  # look-ups under way (in _busy) one server may have
        self._throttled = _io.ThrottledLog(log)

    def submit(self, action: LookUpParallel | LookUpRoute) -> None:
        """Queues a look-up; never blocks, never raises for want of a thread: with none to run it (the process
        cannot start one), the look-up fails at once, naming why."""
        with self._cond:
            if self._stopping:
                return
            self._jobs.append(action)
            # An idle thread takes one job when it next runs: each job queued needs one of its own.
            if len(self._jobs) > self._idle and len(self._threads) < self._max:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # the process's or the system's thread limit
                    self._unstarted(action, exc)
                    return
                self._threads.append(thread)
            else:
                self._cond.notify()

    def _unstarted(self, action: LookUpParallel | LookUpRoute, exc: RuntimeError) -> None:
        """No thread could be started for `action`, just queued (_cond held): the running threads take it after
        their look-ups under way (each bounded), or with none running it fails now."""
        if self._threads:
            self._cond.notify()
            self._throttled.warning("no thread", "cannot start another bootstrap look-up thread (%s): %s waits "
                                    "for one of the %d running", exc, _lookup_text(action), len(self._threads))
            return
        self._jobs.pop()  # the one just queued: no thread will take it
        detail = (f"cannot start a thread to look it up ({type(exc).__name__}: {exc}): this process is at its "
                  f"thread limit; raise it (ulimit -u, the container's pids limit) or run fewer threads")
        key = action.key if type(action) is LookUpRoute else None
        self._deliver(("failed", action.bootstrap_addr, key, detail, 0.0))

    def stop(self) -> None:
        """No look-up starts, and none is delivered, once this returned."""
        with self._cond:
            self._stopping = True
            self._jobs.clear()
            self._cond.notify_all()

    def join(self, timeout: float) -> list[LookUpParallel | LookUpRoute]:
        """Waits up to `timeout` for the threads to end (stop() first); the look-ups still under way then
        (each bounded by its own timeout, after which its thread ends)."""
        with self._cond:
            threads = list(self._threads)
        ends = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, ends - time.monotonic()))
        with self._cond:
            return list(self._busy.values())

    def close(self, timeout: float) -> list[LookUpParallel | LookUpRoute]:
        """Stops the threads; one inside a look-up gets until `timeout` (its own is bounded too). Returns the
        look-ups still under way then."""
        self.stop()
        return self.join(timeout)

    def _next(self) -> int | None:
        """Where the oldest job queued whose server has a thread left to it is (_cond held), if any."""
        if not self._busy:
            return 0 if self._jobs else None
        serving = Counter(action.bootstrap_addr for action in self._busy.values())
        for i, action in enumerate(self._jobs):
            if serving[action.bootstrap_addr] < self._per_server:
                return i
        return None

    def _work(self) -> None:
        _io.name_this_thread(self._name)
        me = threading.get_ident()
        while True:
            with self._cond:
                self._idle += 1
                self._cond.wait_for(lambda: self._stopping or self._next() is not None)
                self._idle -= 1
                if self._stopping:
                    return
                at = self._next()  # found by wait_for() under this same hold of _cond
                if at is None:
                    continue
                action = self._jobs[at]
                del self._jobs[at]
                self._busy[me] = action
            result = self._look_up(action)
            with self._cond:  # held while delivering: nothing is delivered once stop() returned
                del self._busy[me]
                self._cond.notify_all()  # a job of that server's may be taken now
                if self._stopping:
                    return
                self._deliver(result)

    def _look_up(self, action: LookUpParallel | LookUpRoute) -> tuple:
        """One look-up, as the event tuple the I/O thread feeds to the core."""
        addr = action.bootstrap_addr
        key = action.key if type(action) is LookUpRoute else None
        started = self._clock()
        try:
            client = BootstrapClient(addr, timeout=self._timeout_s)
            if key is None:
                return ("parallel", addr, *client.parallel_info())
            ip, port, instance = client.registration(key[2], key[1])
            return ("route", key, (ip, port), instance)
        except BootstrapNoRoute as exc:  # an answer: the server has no such route
            return ("missing", key, str(exc))
        except BootstrapError as exc:
            detail = str(exc)
        except Exception as exc:  # a malformed address, say: this look-up's rooms only
            detail = f"{type(exc).__name__}: {exc}"
        return ("failed", addr, key, detail, self._clock() - started)

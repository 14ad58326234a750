"""The encode side: a sender pool that writes each item's row shards into the prefill
ranks that asked for it (SPEC.md sections 5, 6 and 8).

One thread does all of it: it owns the PULL socket, files registrations and
TransferInfos, parks items until their whole fanout asked, validates the set,
submits each receiver's shard as an asynchronous batch the moment the set is
complete, polls the batches in flight, and pushes each receiver's status without
ever blocking. Measured on two cores, one such thread beats an I/O thread feeding
writer threads: every hand-off between threads cost a wake-up on a busy core, and
the Mooncake threads that move the bytes need those cores.

A receiver that asked is told Failed as soon as nothing will serve it, since a peer
has no deadline of its own: its room was cleared before the whole fanout asked (and
not sent again within CLEARED_GRACE_S), the room already has MAX_RECEIVERS_PER_ROOM receivers, or its write
could not start within the bootstrap timeout of the room's first ask (nor can it once
that much time passed with the fanout still incomplete).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from transfer import _io
from transfer.bootstrap import BootstrapClient
from transfer.frames import (
    MAX_REGIONS_PER_SESSION,
    Registration,
    TransferInfo,
    WireError,
    check_parallel,
    check_region,
    check_room,
    dtype_size,
    is_registration,
    parse_registration,
    status_frames,
    validate_fanout,
)
from transfer.metrics import Metrics, reason_label
from transfer.status import RoomTable, TransferPoll, is_terminal

log = logging.getLogger("transfer.sender")

#: Writes in flight are polled after a sleep growing from POLL_MIN_S to POLL_MAX_S, cut
#: short by any request (250 us measured better than 50 us on loopback: fewer wake-ups
#: competing for the cores).
POLL_MIN_S = 250e-6
POLL_MAX_S = 1e-3

#: Prefill sessions whose regions are remembered (MAX_REGIONS_PER_SESSION each); the one
#: least recently registered or written to is forgotten first.
MAX_SESSIONS = 4096

#: Rooms asked for whose item (or rest of the fanout) has not come yet, and receivers per
#: such room: past these, a peer asking for rooms nobody sends would only eat memory, so
#: the oldest parked ask is told Failed (and an extra receiver of a room is dropped).
MAX_PARKED_ASKS = 16384
MAX_RECEIVERS_PER_ROOM = 1024

#: Requests filed per round of the pool's thread before it turns to its writes: a peer that
#: sends without pause must not keep the thread (its writes, sweep and close()) waiting.
MAX_REQUESTS_PER_ROUND = 256

#: Bytes of parked asks held in all (their text parts plus a fixed cost each): past it, the
#: oldest parked ask is told Failed. MAX_PARKED_ASKS * MAX_RECEIVERS_PER_ROOM asks of up to
#: a control message each would otherwise be a terabyte a peer could make us hold.
MAX_PARKED_BYTES = 64 << 20
ASK_OVERHEAD_BYTES = 512  # measured: a parked TransferInfo with short text parts takes about 500 bytes

#: A room cleared before its whole fanout asked has its parked asks told Failed this long
#: after the clear, so a caller that clears and sends the room again at once (a retry)
#: keeps them for the new item whichever way its two calls meet the pool's thread.
CLEARED_GRACE_S = 0.1

#: How long the statuses close() pushes may take to leave once the pool is closed.
CLOSE_LINGER_MS = 1000

#: After a write to a prefill session failed slowly, later writes to it fail at once for this
#: long (or until it registers again): each batch to a dead peer costs Mooncake a
#: reconnect timeout, and the pool's one thread must not spend that while other rooms wait.
DEAD_SESSION_S = 5.0

#: Only a failure that took this long marks its session dead: a peer that refuses one
#: write (a bad destination, say) answers within milliseconds and stays usable.
DEAD_AFTER_S = 0.25

#: A submission that itself held the pool's thread, failing after `t` seconds, pauses its
#: session for DEAD_STALL_FACTOR * t (at most DEAD_SESSION_MAX_S) instead. Measured: a peer
#: that accepts connections and never answers Mooncake's handshake blocks the submission
#: for 60 s inside Mooncake's lock, and every other write with it; one that keeps asking
#: would otherwise stall all receivers 60 s out of every 65.
DEAD_STALL_FACTOR = 4.0
DEAD_SESSION_MAX_S = 600.0

#: How long close() waits for writes already submitted: past Mooncake's own transfer
#: timeout (30 s by default, measured against a stopped peer).
CLOSE_WAIT_S = 60.0


@dataclass
class _Item:
    """One room's source rows, its receivers once they asked, and its progress."""

    room: int
    src: _io.Region
    span: int
    hidden: int
    dtype: str
    row_bytes: int
    deepstack: _io.Region | None
    deepstack_row_bytes: int
    ready_event: Any
    started_at: float
    release: Any = None  # callable that drops a temporary source registration
    receivers: list[TransferInfo] = field(default_factory=list)
    pending: int = 0
    failed: bool = False
    succeeded: bool = False  # every receiver was served: nothing may tell them Failed any more
    concluded_at: float | None = None
    asked_at: float = 0.0  # when the room's first ask came (set at dispatch): bounds its writes' wait

    def ready(self) -> bool:
        """Whether the source rows may be read: no ready event, or it completed.

        An event with query() (a CUDA event) is polled so the pool's thread never
        blocks on a producer; any other event is waited for with synchronize().
        """
        event = self.ready_event
        if event is not None:
            if hasattr(event, "query"):
                if not event.query():
                    return False
            else:
                event.synchronize()
            self.ready_event = None
        return True


@dataclass
class _Write:
    """A receiver's shard write that was submitted and not yet waited for."""

    item: _Item
    info: TransferInfo
    batch: int  # the engine's batch id; 0 when the write already completed
    nbytes: int
    sums: tuple[int, ...]
    submitted_at: float


@dataclass
class _Asks:
    """TransferInfos that arrived for a room, by session id, and when the first came."""

    first_at: float
    infos: dict[str, TransferInfo] = field(default_factory=dict)
    nbytes: int = 0  # what its infos cost, counted against MAX_PARKED_BYTES


class SendHandle(_io.RoomHandle):
    """One room's progress on the encode side: poll(), failure, latency_s, wait(), clear()."""

    def __init__(self, pool: SenderPool, item: _Item) -> None:
        super().__init__(pool._table, item, pool._conclusions, pool._items.get)
        self._pool = pool

    def clear(self) -> None:
        """Forgets a concluded room (an unconcluded one is failed first)."""
        self._pool._forget(self._state)


class SenderPool:
    """An encode rank's sending side."""

    def __init__(
        self,
        engine: Any,
        engine_rank: int,
        tp_size: int,
        dp_size: int,
        bootstrap_addr: str,
        *,
        host: str | None = None,
        port: int = 0,
        token: str | None = None,
        bootstrap_timeout_s: float = 120.0,
        register_timeout_s: float = 30.0,
        integrity: bool = True,
        depth: int = 32,
        metrics: Metrics | None = None,
    ) -> None:
        check_parallel(engine_rank, tp_size, dp_size)
        self.engine = engine
        self.engine_rank = engine_rank
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.host = host or engine.hostname
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.integrity = integrity
        self.depth = max(1, depth)
        # Slots one prefill session may hold: all but a quarter (at least one) of `depth`, so
        # one that stopped reading (its writes in flight until Mooncake's transfer timeout,
        # 30 s by default) leaves slots for every other receiver meanwhile.
        self._session_slots = max(1, self.depth - max(1, self.depth // 4))
        self.metrics = metrics or Metrics("epd_encode")

        self._table = RoomTable()
        self._conclusions = _io.Conclusions()
        self._items: dict[int, _Item] = {}  # sent by the caller, not yet cleared
        self._asks: dict[int, _Asks] = {}  # TransferInfos waiting for their whole fanout or item
        self._parked_bytes = 0  # what the parked asks cost in all (owned by the pool's thread)
        # Receive regions each prefill session announced, newest last (bounded).
        self._sessions: dict[str, list[Registration]] = {}
        self._lock = threading.Lock()
        self._new_items: list[_Item] = []
        # (room, when) of items cleared before any receiver was attached: the pool's thread
        # tells the receivers parked for them Failed (the asks are its own to touch) once
        # CLEARED_GRACE_S passed; _clears_due holds those it took and has not handled yet.
        self._cleared: list[tuple[int, float]] = []
        self._clears_due: deque[tuple[int, float]] = deque()
        self._waker = _io.Waker()
        self._stopping = False  # the thread stops (close(), or a failure of its own)
        self._closed = False
        self._temp_sources: dict[int, int] = {}  # address -> refcount of registrations we made
        self._unreleased: set[int] = set()  # ours at refcount 0 that the engine would not drop yet
        self._temp_lock = threading.Lock()
        self._dead_sessions: dict[str, tuple[float, float]] = {}  # session id -> (failed at, paused until)
        self._complaints = _io.ThrottledLog(log)  # about requests peers sent
        self._failures = _io.ThrottledLog(log)  # rooms that failed, per kind of reason

        self._pull, self.port = _io.pull_socket(self.host, port)
        self._pull_fd = self._pull.getsockopt(zmq.FD)
        self._statuses = _io.Pushers()
        # Receivers' writes whose room is complete, waiting for a free slot in flight or
        # for their item's ready event (owned by the pool's thread).
        self._waiting: deque[tuple[_Item, TransferInfo]] = deque()
        self._queued: Counter[str] = Counter()  # entries of _waiting per session
        self.metrics.gauge_fn("queue_depth", lambda: len(self._waiting))
        self.metrics.gauge_fn("statuses_dropped", lambda: self._statuses.dropped)
        self.metrics.gauge_fn("parked_rooms", self._parked_rooms)

        self._thread = threading.Thread(target=self._run, name=f"epd-encode-{engine_rank}", daemon=True)
        self._thread.start()
        try:
            BootstrapClient(bootstrap_addr, token=token).register_rank(
                tp_size, dp_size, self.host, self.port, engine_rank, retry_for=register_timeout_s
            )
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------- caller side

    def send(
        self,
        room: int,
        src: Any,
        deepstack: Any = None,
        *,
        span: int | None = None,
        hidden: int | None = None,
        dtype: str | None = None,
        deepstack_hidden: int | None = None,
        ready_event: Any = None,
    ) -> SendHandle:
        """Offers `room`'s rows to the prefill ranks that ask for it; never blocks on them.

        `src` is a tensor `[span, hidden]` on any device, or a raw address with `span`,
        `hidden` and `dtype`; `deepstack` likewise `[span, hidden * k]` (raw: give
        `deepstack_hidden`). `ready_event` (e.g. a CUDA event) must complete before the
        first byte is read; the pool polls it (query()), never blocking the caller.
        """
        if self._stopping:
            raise self._stopped_error()
        check_room(room)
        region, span, hidden, dtype = _source(src, span, hidden, dtype)
        row_bytes = hidden * dtype_size(dtype)
        ds_region, ds_row_bytes = None, 0
        if deepstack is not None:
            ds_region, ds_span, ds_hidden, ds_dtype = _source(deepstack, span, deepstack_hidden, dtype)
            if ds_span != span or ds_dtype != dtype:
                raise ValueError(f"room {room}: deepstack rows {ds_span} x {ds_dtype} != item rows {span} x {dtype}")
            ds_row_bytes = ds_hidden * dtype_size(ds_dtype)
        item = _Item(room, region, span, hidden, dtype, row_bytes, ds_region, ds_row_bytes, ready_event, time.monotonic())
        # Registered before the item is published: a TransferInfo may dispatch it at once.
        item.release = self._hold_registered(region, ds_region)
        with self._lock:
            # Looked at under the lock close() sets it under: an item published here is
            # one close() will fail, and the waker is still open for the wake-up.
            if self._stopping:
                refused: Exception | None = self._stopped_error()
            elif room in self._items:
                refused = ValueError(f"room {room} is already being sent; clear() it first")
            else:
                refused = None
                self._items[room] = item
                self._table.start(room, TransferPoll.WaitingForInput)
                self._new_items.append(item)
                self._waker.wake()
        if refused is not None:
            if item.release is not None:
                item.release()
            raise refused
        self.metrics.inc("rooms_started_total")
        return SendHandle(self, item)

    def _stopped_error(self) -> RuntimeError:
        """Why send() is refused once the pool's thread stopped."""
        return RuntimeError("sender pool is closed" if self._closed else
                            "sender pool's thread stopped after an error (see the log)")

    def concluded(self) -> list[int]:
        """Rooms that reached Success or Failed since the last call, oldest first, each once.

        Never blocks; a room cleared before it was handed out is left out.
        """
        return self._table.take_concluded()

    def stats(self) -> dict:
        """A plain snapshot of counters, histograms and gauges."""
        return self.metrics.snapshot()

    def _parked_rooms(self) -> int:
        """Items sent whose receivers have not all asked yet (a scrape may come from any thread)."""
        with self._lock:
            return sum(1 for item in self._items.values() if not item.receivers and not item.failed)

    def close(self) -> None:
        """Fails rooms still in flight and parked asks, joins the thread, closes sockets, drops temporary registrations.

        Writes already submitted are waited for first, at most CLOSE_WAIT_S, so no source
        is released while the engine may still read it. Writes still in flight after that
        (an engine whose transfer timeout is longer) are logged, and their rooms fail
        without releasing anything the engine may still be reading.
        """
        with self._lock:  # send() publishes items under it: none slips in after the snapshot below
            if self._closed:
                return
            self._closed = self._stopping = True
        self._waker.wake()
        self._thread.join(timeout=CLOSE_WAIT_S)
        stuck = self._thread.is_alive()
        if stuck:
            log.error("sender pool of encode rank %d: writes still in flight after %gs; failing their rooms, "
                      "keeping temporary source registrations and sockets until they settle",
                      self.engine_rank, CLOSE_WAIT_S)
        with self._lock:
            items = list(self._items.values())
        # The thread touches neither queue any more (a stuck one only settles what it submitted):
        # a room cleared while its writes waited for a slot is only found there, and receivers
        # of parked asks would otherwise never hear (a peer has no deadline of its own).
        items = list({id(item): item for item in [*items, *(item for item, _ in self._waiting)]}.values())
        for asks in self._asks.values():
            self._tell_failed(asks.infos.values())
        self._asks.clear()
        self._parked_bytes = 0
        for item in items:
            if stuck:
                item.release = None  # the engine may still read it: leak it rather than free it
            else:
                with self._lock:
                    item.pending = 0  # the thread settled every write it submitted; the rest never started
            self._fail(item, "sender pool closed")
            self._release_when_idle(item)
        if not stuck:
            self._retry_releases()  # registrations an abandoned write held, if the engine let go since
            self._pull.close(0)
            self._statuses.close(linger_ms=CLOSE_LINGER_MS)  # the Failed statuses just pushed still go out
            self._waker.close()

    def __enter__(self) -> SenderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------- registrations

    def _hold_registered(self, *regions: _io.Region | None):
        """Registers source regions that lie outside registered memory; returns their release.

        A region inside one of our temporary registrations holds that one (another room's
        rows, say), so it stays registered until every room reading from it is done. If
        one region cannot be registered, those already held are released before raising.
        """
        held: list[int] = []

        def release() -> None:
            with self._temp_lock:
                for addr in held:
                    self._temp_sources[addr] -= 1
                    if not self._temp_sources[addr]:
                        self._drop_temporary(addr)

        try:
            for region in regions:
                if region is None or region.nbytes == 0:
                    continue
                with self._temp_lock:
                    base = self._registered_base(region)
                    if base is None:
                        self.engine.register(region.tensor if region.tensor is not None else region.addr,
                                             region.nbytes)
                        base = region.addr
                    elif base not in self._temp_sources:
                        continue  # inside the caller's own registration
                    self._temp_sources[base] = self._temp_sources.get(base, 0) + 1
                    held.append(base)
        except BaseException:
            release()
            raise
        return release if held else None

    def _drop_temporary(self, addr: int) -> None:
        """Unregisters one of ours no room holds any more (_temp_lock held).

        The engine refuses while a write it gave up on (a peer that stopped reading)
        still reads the memory: the registration then stays ours, at refcount 0, and
        the sweep tries again, so the caller's memory is released once the engine lets go.
        """
        try:
            self.engine.unregister(addr)
        except Exception as exc:  # noqa: BLE001 - the room concludes either way
            if addr in self.engine.registered():
                if addr not in self._unreleased:
                    log.warning("keeping the temporary registration of %#x for now: %s", addr, exc)
                    self._unreleased.add(addr)
                return
            log.warning("dropping the temporary registration of %#x failed: %s", addr, exc)  # e.g. engine closed
        del self._temp_sources[addr]
        self._unreleased.discard(addr)

    def _retry_releases(self) -> None:
        """Tries again to drop the temporary registrations the engine would not let go of."""
        with self._temp_lock:
            for addr in list(self._unreleased):
                if self._temp_sources.get(addr) == 0:
                    self._drop_temporary(addr)
                else:
                    self._unreleased.discard(addr)  # held again: its next release tries

    def _registered_base(self, region: _io.Region) -> int | None:
        """Start of a registered region that holds `region` wholly (the caller's before ours), or None."""
        bases = [a for a, n in self.engine.registered().items() if a <= region.addr and region.end <= a + n]
        return next((a for a in bases if a not in self._temp_sources), bases[0] if bases else None)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        """Serves requests, starts writes and settles them, until close()."""
        _io.name_this_thread(f"epd-enc{self.engine_rank}")
        in_flight: list[_Write] = []
        delay = POLL_MIN_S
        next_sweep = time.monotonic() + 0.5
        more_requests = False  # the last round left requests queued (the socket's FD will not signal them)
        try:
            while not self._stopping:
                busy = bool(in_flight or self._waiting)
                if more_requests:
                    timeout = 0.0
                else:
                    wake_at = next_sweep
                    if self._clears_due:
                        wake_at = min(wake_at, self._clears_due[0][1] + CLEARED_GRACE_S)
                    timeout = delay if busy else max(0.0, wake_at - time.monotonic())
                woken = self._sleep(timeout)
                # The flag saves a system call per loop; the pipe's readability covers a
                # wake() caught between setting the flag and writing its byte.
                if (woken or self._waker.pending()) and self._waker.drain():
                    with self._lock:
                        new, self._new_items = self._new_items, []
                        cleared, self._cleared = self._cleared, []
                    for item in new:
                        self._maybe_dispatch(item.room)
                    self._clears_due.extend(cleared)
                more_requests = self._drain_requests()
                self._start_waiting(in_flight)
                if in_flight:
                    remaining = self._settle_ready(in_flight)
                    delay = POLL_MIN_S if len(remaining) < len(in_flight) else min(2 * delay, POLL_MAX_S)
                    in_flight[:] = remaining
                elif self._waiting:  # only writes held by their ready events: back off as for writes
                    delay = min(2 * delay, POLL_MAX_S)
                now = time.monotonic()
                while self._clears_due and now >= self._clears_due[0][1] + CLEARED_GRACE_S:
                    self._fail_cleared_asks(*self._clears_due.popleft())
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + 0.5
        except Exception as exc:  # a bug here must not leave rooms hanging silently
            log.exception("the sender pool's thread failed; failing its rooms")
            with self._lock:  # as in close(): send() publishes no item after this
                self._stopping = True
                items = list(self._items.values())
            for item in items:
                self._fail(item, f"sender pool stopped: {type(exc).__name__}: {exc}")
        # Closing: settle what was submitted before any source can be released.
        while in_flight:
            in_flight[:] = self._settle_ready(in_flight)
            if in_flight:
                time.sleep(POLL_MAX_S)

    def _sleep(self, timeout: float) -> bool:
        """Waits until a request or a wake-up arrives, or `timeout` seconds passed; True if woken.

        select() rather than zmq's poller, whose whole-millisecond timeouts are too
        coarse for polling writes. ZMQ's FD only signals that the socket's state may
        have changed: the loop sleeps only after a drain that found the socket empty,
        so a message queued since then has signalled the FD.
        """
        readable, _, _ = select.select([self._pull_fd, self._waker.fileno()], [], [], timeout)
        return self._waker.fileno() in readable

    def _drain_requests(self) -> bool:
        """Files up to MAX_REQUESTS_PER_ROUND queued requests; True when more may be queued."""
        for _ in range(MAX_REQUESTS_PER_ROUND):
            frames = _io.recv_frames(self._pull)
            if frames is None:
                return False
            self._file_request(frames)
        return True

    def _file_request(self, frames: list[bytes]) -> None:
        """Files one registration or TransferInfo; a complete fanout starts its room's writes.

        An ask past MAX_RECEIVERS_PER_ROOM for its room is told Failed and not kept.
        """
        try:
            if is_registration(frames):
                self._file_registration(parse_registration(frames))
                return
            info = TransferInfo.from_frames(frames)
        except WireError as exc:
            self._complaints.warning(str(exc), "dropped a malformed request (%d parts): %s", len(frames), exc)
            return
        asks = self._asks.get(info.room)
        if asks is None:
            if len(self._asks) >= MAX_PARKED_ASKS:
                self._evict_oldest_ask()
            asks = self._asks[info.room] = _Asks(time.monotonic())
        elif len(asks.infos) >= MAX_RECEIVERS_PER_ROOM and info.session_id not in asks.infos:
            # Told, not just dropped: the receiver has no deadline of its own to give up by.
            self._complaints.warning("receivers", "room %d: more than %d receivers asked; telling %s Failed",
                                     info.room, MAX_RECEIVERS_PER_ROOM, info.session_id[:64])
            self._tell_failed([info])
            return
        replaced = asks.infos.get(info.session_id)
        asks.infos[info.session_id] = info
        cost = _ask_cost(info) - (_ask_cost(replaced) if replaced is not None else 0)
        asks.nbytes += cost
        self._parked_bytes += cost
        while self._parked_bytes > MAX_PARKED_BYTES and len(self._asks) > 1:
            self._evict_oldest_ask()
        self._maybe_dispatch(info.room)

    def _take_asks(self, room: int) -> _Asks | None:
        """Removes and returns the room's parked asks (None when there are none)."""
        asks = self._asks.pop(room, None)
        if asks is not None:
            self._parked_bytes -= asks.nbytes
        return asks

    def _evict_oldest_ask(self) -> None:
        """Tells the receivers of the oldest parked ask Failed and forgets it (too many parked)."""
        room = next(iter(self._asks))
        asks = self._take_asks(room)
        self._complaints.warning("parked", "room %d: %d rooms (%d bytes of asks) were asked for and not served yet; "
                                 "failing the oldest ask", room, len(self._asks) + 1, self._parked_bytes + asks.nbytes)
        self._tell_failed(asks.infos.values())

    def _maybe_dispatch(self, room: int) -> None:
        """Starts the room's writes once the item is here and its whole fanout asked.

        Asks for a room that already failed are answered Failed at once: nothing will
        serve them, and a peer has no deadline of its own. The item keeps when the room's
        first ask came, which bounds how long its writes may wait to start.
        """
        asks = self._asks.get(room)
        if asks is None:
            return
        with self._lock:
            item = self._items.get(room)
        if item is None or (item.receivers and not item.failed):
            return  # no item yet, or the room is served: these wait for its next send
        fanout = next(iter(asks.infos.values())).fanout
        if len(asks.infos) < fanout and not item.failed:
            return  # the rest of the fanout has not asked yet
        self._take_asks(room)
        infos = sorted(asks.infos.values(), key=lambda i: (i.row_start, i.session_id))
        if not self._attach(item, infos):
            self._tell_failed(infos)
            return
        waited = time.monotonic() - asks.first_at
        if waited > self.bootstrap_timeout_s:
            # No write may start this late after the first ask (_start_waiting): say why here,
            # not later as a wait for a write slot that never happened. The sweep usually fails
            # such a room first; this covers a fanout completed between two sweeps.
            self._failures.warning("late fanout", "room %d: its whole fanout of %d asked only %.1fs after its first "
                                   "ask, past the bootstrap timeout %gs; failing it", room, fanout, waited,
                                   self.bootstrap_timeout_s)
            self._fail(item, f"receiver never registered within {self.bootstrap_timeout_s:g}s")  # SPEC 6's text
            return
        reason = validate_fanout(item.span, item.hidden, item.dtype, item.deepstack is not None, infos, fanout)
        if reason is None:
            reason = self._check_regions(item, infos)
        if reason is not None:
            self._fail(item, reason)
            return
        with self._lock:
            if self._items.get(room) is item:
                self._table.update(room, TransferPoll.Transferring)
        item.pending = len(infos)
        item.asked_at = asks.first_at  # _start_waiting's bound on each write's wait counts from here
        self._waiting.extend((item, info) for info in infos)
        self._queued.update(info.session_id for info in infos)

    def _file_registration(self, reg: Registration) -> None:
        """Remembers a session's announced regions; a repeat of the same region replaces it.

        A registration from a new status endpoint is a new session manager on that
        engine: the regions its predecessor announced are forgotten, so memory it
        freed is never again an accepted destination.
        """
        self._dead_sessions.pop(reg.session_id, None)  # it is back (or restarted): try again
        regs = self._sessions.pop(reg.session_id, [])
        self._sessions[reg.session_id] = regs  # now the most recently registered
        if len(self._sessions) > MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]
        regs[:] = [
            r for r in regs
            if r.embedding_base != reg.embedding_base and (r.endpoint, r.port) == (reg.endpoint, reg.port)
        ]
        regs.append(reg)
        del regs[:-MAX_REGIONS_PER_SESSION]

    def _check_regions(self, item: _Item, infos: list[TransferInfo]) -> str | None:
        """SPEC 8: every destination must lie inside a region its session announced with lengths."""
        for info in infos:
            regs = self._sessions.pop(info.session_id, None)
            if regs is None:
                continue  # a peer that never announced lengths: written as the peers do
            self._sessions[info.session_id] = regs  # in use: the last to be forgotten
            reasons = [check_region(info, reg, item.row_bytes, item.deepstack_row_bytes) for reg in regs]
            if reasons and all(reasons):
                return reasons[-1]
        return None

    def _sweep(self, now: float) -> None:
        """Fails items whose receivers never all asked, and asks whose item never came; retries releases.

        An item is parked from its send() or from its room's first ask, whichever came
        first: past the bootstrap timeout of that ask no write of it may start any more
        (_start_waiting), so the receivers that asked are told Failed now rather than at
        the item's own timeout.
        """
        if self._unreleased:
            self._retry_releases()
        limit = self.bootstrap_timeout_s
        with self._lock:
            unserved = [i for i in self._items.values() if not i.receivers and not i.failed]
        parked = [i for i in unserved if now - self._parked_since(i) > limit]
        for item in parked:
            asks = self._take_asks(item.room)
            infos = list(asks.infos.values()) if asks else []
            if self._attach(item, infos):
                self._fail(item, f"receiver never registered within {limit:g}s")  # SPEC 6's text
            else:
                self._tell_failed(infos)  # cleared meanwhile: its failure could not name them
        for room in [r for r, a in self._asks.items() if now - a.first_at > limit]:
            with self._lock:
                known = room in self._items
            if known:
                continue
            asks = self._take_asks(room)
            log.warning("room %d: no item sent within %gs for %d receiver(s); telling them Failed", room, limit, len(asks.infos))
            self._tell_failed(asks.infos.values())
        # A dead session is skipped until its pause ends; older entries only take memory.
        for session, (_, until) in list(self._dead_sessions.items()):
            if now >= until:
                self._dead_sessions.pop(session, None)

    def _parked_since(self, item: _Item) -> float:
        """When an unserved item started waiting for its fanout: its send(), or its room's first ask if earlier."""
        asks = self._asks.get(item.room)
        return item.started_at if asks is None else min(item.started_at, asks.first_at)

    # ---------------------------------------------------------------- writes

    def _start_waiting(self, in_flight: list[_Write]) -> None:
        """Submits waiting writes, oldest first, while fewer than `depth` are in flight.

        Measured on two cores: overlapping many submitted batches from one thread beats
        threads blocked in synchronous writes, and polling completions with a short
        sleep beats Mooncake's own wait, which spins a whole core. A write whose item's
        ready event has not completed waits without holding up the others, for at most
        the bootstrap timeout after send() or after the room's first ask, whichever ends
        first. One session holds at most its share of the slots; its further writes wait
        without holding up other sessions' writes. A
        write about to start when the bootstrap timeout has passed since its room's
        first ask (it waited that long for a slot or its ready event) fails the room
        instead: the receiver is told Failed rather than written to ever later.
        """
        if not self._waiting or len(in_flight) >= self.depth:
            return  # the common case, every turn of the loop: nothing to count
        limit = self.bootstrap_timeout_s
        now = time.monotonic()
        held: list[tuple[_Item, TransferInfo]] = []
        per_session = Counter(write.info.session_id for write in in_flight)
        # Sessions that may start a write now: none, and the queue is not even looked at.
        open_sessions = {s for s in self._queued if per_session[s] < self._session_slots}
        while self._waiting and len(in_flight) < self.depth and open_sessions:
            item, info = self._waiting.popleft()
            session = info.session_id
            if not item.failed and session not in open_sessions:
                held.append((item, info))  # its session has its share in flight: others go first
                continue
            try:
                ready = item.failed or item.ready()
            except Exception as exc:  # noqa: BLE001 - a broken event fails its room only
                self._fail(item, f"room {item.room}: waiting for its ready event failed: {exc}")
                ready = True  # _start_write now just counts this receiver out
            if not ready and now - item.started_at > limit:
                self._fail(item, f"room {item.room}: its ready event did not complete within {limit:g}s")
                ready = True
            # Checked before a write held by its ready event is put back too: it can never
            # start past this bound, so its receivers are told now, not at send() + the timeout.
            if not item.failed and now - item.asked_at > limit:
                self._fail(item, f"room {item.room}: its write for {session[:64]} waited {now - item.asked_at:.1f}s "
                                 f"since the room's first ask for a free write slot or its ready event, "
                                 f"past the bootstrap timeout {limit:g}s; not started")
                ready = True
            if not ready:
                held.append((item, info))
                continue
            self._queued[session] -= 1
            if not self._queued[session]:
                del self._queued[session]
                open_sessions.discard(session)
            write = self._start_write(item, info)
            if write is not None:
                in_flight.append(write)
                per_session[session] += 1
                if per_session[session] >= self._session_slots:
                    open_sessions.discard(session)
        self._waiting.extendleft(reversed(held))

    def _settle_ready(self, in_flight: list[_Write]) -> list[_Write]:
        """Settles the writes that completed; returns those still in flight, in order.

        A session's writes complete in the order they were submitted, so polling stops
        at each session's first unfinished write: one status call per busy receiver
        per round, not one per write in flight.
        """
        busy: set[str] = set()
        remaining = []
        for write in in_flight:
            session = write.info.session_id
            if session in busy or not self._settled(write):
                busy.add(session)
                remaining.append(write)
        return remaining

    def _start_write(self, item: _Item, info: TransferInfo) -> _Write | None:
        """Submits one receiver's shard (embedding and deepstack in one batch) without waiting."""
        if item.failed:
            self._receiver_done(item, info)
            return None
        dead = self._dead_sessions.get(info.session_id)
        if dead is not None and time.monotonic() < dead[1]:
            ago = time.monotonic() - dead[0]
            self._fail(item, f"write to {info.session_id} (room {item.room}) skipped: a write to it failed {ago:.1f}s ago")
            self._receiver_done(item, info)
            return None
        submitted_at = None
        try:
            srcs = [item.src.addr + info.row_start * item.row_bytes]
            dsts = [info.embedding_ptr]
            lengths = [info.rows * item.row_bytes]
            if item.deepstack is not None:
                srcs.append(item.deepstack.addr + info.row_start * item.deepstack_row_bytes)
                dsts.append(info.deepstack_ptr)
                lengths.append(info.rows * item.deepstack_row_bytes)
            submitted_at = time.monotonic()
            batch = self._submit(info.session_id, srcs, dsts, lengths)
        except Exception as exc:  # noqa: BLE001 - any failure concludes the room
            self._write_failed(item, info, exc, submitted_at, blocked=True)
            self._receiver_done(item, info)  # nothing of it is in flight
            return None
        # The checksums are computed while the batch is on the wire. If that fails the
        # room fails, and the write is still tracked until the engine is done with it.
        sums: tuple[int, ...] = ()
        if self.integrity:
            try:
                regions = (item.src, item.deepstack)
                sums = tuple(_io.checksum(region, s, n) for region, s, n in zip(regions, srcs, lengths))
            except Exception as exc:  # noqa: BLE001 - e.g. a device error: this room only
                self._fail(item, f"room {item.room}: checksumming its rows for {info.session_id} failed: {exc}")
        return _Write(item, info, batch, sum(lengths), sums, submitted_at)

    def _submit(self, session_id: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
        """Starts a batch write; engines without an async API write synchronously here (id 0)."""
        write_async = getattr(self.engine, "write_async", None)
        if write_async is None:
            self.engine.write(session_id, srcs, dsts, lengths)
            return 0
        return write_async(session_id, srcs, dsts, lengths)

    def _settled(self, write: _Write) -> bool:
        """Whether the write is over; if so, pushes its receiver's status (or fails the room)."""
        item, info = write.item, write.info
        try:
            if write.batch:
                poll = getattr(self.engine, "poll", None)
                if poll is None:
                    self.engine.wait(write.batch)
                elif not poll(write.batch):
                    return False
        except Exception as exc:  # noqa: BLE001 - any failure concludes the room
            self._write_failed(item, info, exc, write.submitted_at)
            self._receiver_done(item, info)
            return True
        self.metrics.inc("bytes_written_total", write.nbytes)
        if not item.failed:
            self._push_status(info, TransferPoll.Success, write.sums)
        self._receiver_done(item, info)
        return True

    def _write_failed(self, item: _Item, info: TransferInfo, exc: Exception, submitted_at: float | None,
                      blocked: bool = False) -> None:
        """Fails the room; a failure that took long (a dead peer) also marks its session dead.

        `blocked`: the submission itself failed, holding the pool's thread all along.
        """
        now = time.monotonic()
        took = 0.0 if submitted_at is None else now - submitted_at
        if took >= DEAD_AFTER_S:
            pause = DEAD_SESSION_S
            if blocked and took * DEAD_STALL_FACTOR > pause:
                pause = min(DEAD_SESSION_MAX_S, took * DEAD_STALL_FACTOR)
                self._failures.warning(
                    "stall", "submitting a write to %s held the sender pool's thread (and every other write) for "
                    "%.1fs before failing: a peer that accepts connections but never answers the engine's "
                    "handshake? Writes to it fail at once for the next %.0fs, or until it registers again",
                    info.session_id[:64], took, pause)
            self._dead_sessions[info.session_id] = (now, now + pause)
        self._fail(item, f"write to {info.session_id} (room {item.room}) failed: {exc}")

    def _receiver_done(self, item: _Item, info: TransferInfo) -> None:
        """One receiver's write is over (settled, failed or skipped): nothing of it is in flight."""
        with self._lock:
            item.pending -= 1
            last = item.pending == 0
            succeeded = item.succeeded = last and not item.failed
        if succeeded:
            self._conclude(item, TransferPoll.Success)
        elif last:
            self._release_when_idle(item)  # a failed room's sources, once the engine is done with them

    def _release_when_idle(self, item: _Item) -> None:
        """Drops the item's temporary source registrations once none of its writes waits or is in flight."""
        with self._lock:
            if item.pending:
                return
            release, item.release = item.release, None
        if release is not None:
            release()

    def _push_status(self, info: TransferInfo, status: TransferPoll, sums: tuple[int, ...] = ()) -> None:
        frames = status_frames(info.room, status, self.engine_rank, sums)
        self._statuses.send(info.endpoint, info.port, frames)

    def _tell_failed(self, infos) -> None:
        """Pushes Failed to receivers whose asks no item will serve."""
        for info in infos:
            self._push_status(info, TransferPoll.Failed)

    def _attach(self, item: _Item, infos: list[TransferInfo]) -> bool:
        """Makes `infos` the item's receivers, unless it failed first (then the caller tells them).

        Under the lock _fail reads the receivers under: a clear() from the caller's thread
        either sees them (and tells them) or comes first (and this says so).
        """
        with self._lock:
            if item.failed:
                return False
            item.receivers = infos
            return True

    def _fail(self, item: _Item, reason: str) -> None:
        """Fails the room once and tells every receiver that asked for it; a room already served is left alone."""
        with self._lock:
            if item.failed or item.succeeded:
                return  # a Failed after their Success would undo it (Failed is sticky on the wire)
            item.failed = True
            receivers = list(item.receivers)
        self._tell_failed(receivers)
        self._conclude(item, TransferPoll.Failed, reason)

    def _conclude(self, item: _Item, status: TransferPoll, reason: str | None = None) -> None:
        with self._lock:
            live = self._items.get(item.room) is item and not is_terminal(self._table.get(item.room))
            if live:
                if status == TransferPoll.Failed:
                    self._table.fail(item.room, reason or "failed")
                else:
                    self._table.update(item.room, status)
        self._release_when_idle(item)
        if not live:
            return
        if status == TransferPoll.Success:
            self.metrics.inc("rooms_succeeded_total")
            self.metrics.observe("room_latency_seconds", time.monotonic() - item.started_at)
        else:
            label = reason_label(reason or "")
            self.metrics.inc("rooms_failed_total", reason=label)
            self._failures.warning(label, "room %d failed: %s", item.room, reason)
        item.concluded_at = time.monotonic()
        self._conclusions.notify()

    def _forget(self, item: _Item) -> None:
        """Fails the item unless it concluded, then forgets it (called from the caller's thread).

        An item cleared before any receiver was attached leaves the asks parked for it
        (part of a fanout) unanswered: the pool's thread is handed the room to tell them
        Failed, as it is handed new items.
        """
        with self._lock:  # this item's own entry: the room may have been sent again since
            live = self._items.get(item.room) is item and not is_terminal(self._table.get(item.room))
        if live:
            self._fail(item, "cleared before it concluded")
        with self._lock:
            if self._items.get(item.room) is item:
                del self._items[item.room]
                self._table.clear(item.room)
                if not item.receivers and not self._stopping:  # once stopped, close() tells the parked asks
                    self._cleared.append((item.room, time.monotonic()))
                    self._waker.wake()

    def _fail_cleared_asks(self, room: int, cleared_at: float) -> None:
        """Tells the receivers parked for a room cleared unserved Failed, unless it was sent again.

        Only asks parked before the clear were the cleared item's: a room whose first
        ask came later, or one sent again since (a retry, which they now wait for), keeps
        its asks for the room's next send.
        """
        asks = self._asks.get(room)
        if asks is None or asks.first_at > cleared_at:
            return
        with self._lock:
            if room in self._items:
                return
        self._take_asks(room)
        fanout = next(iter(asks.infos.values())).fanout
        sessions = ", ".join(s[:64] for s in sorted(asks.infos)[:3]) + (", ..." if len(asks.infos) > 3 else "")
        self._failures.warning("cleared", "room %d: the caller cleared it before its whole fanout asked (%d of %d "
                               "prefill ranks asked: %s); telling them Failed. Are the other ranks of the fanout "
                               "running and routed to this encode rank, or was the room cleared too early?",
                               room, len(asks.infos), fanout, sessions)
        self._tell_failed(asks.infos.values())


def _ask_cost(info: TransferInfo) -> int:
    """What a parked ask costs against MAX_PARKED_BYTES: its peer-sized text parts and a fixed part."""
    return len(info.endpoint) + len(info.session_id) + len(info.dtype) + ASK_OVERHEAD_BYTES


def _source(src: Any, span: int | None, hidden: int | None, dtype: str | None) -> tuple[_io.Region, int, int, str]:
    """(region, span, hidden, dtype) of a source tensor `[span, hidden]` or raw pointer."""
    if isinstance(src, int):
        if span is None or hidden is None or dtype is None:
            raise ValueError("a raw source pointer needs span, hidden and dtype")
        return _io.Region(src, span * hidden * dtype_size(dtype)), span, hidden, dtype
    if not hasattr(src, "data_ptr"):
        raise TypeError(f"src must be a torch tensor or a pointer, got {type(src).__name__}")
    if src.dim() != 2:
        raise ValueError(f"source must be 2-D [span, hidden], got shape {tuple(src.shape)}")
    region = _io.as_region(src)
    return region, int(src.shape[0]), int(src.shape[1]), str(src.dtype)

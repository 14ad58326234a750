"""The prefill side: a session manager that asks encode ranks for items and tracks
their rooms (SPEC.md sections 5, 7 and 8).

`receive()` and `poll()` run on the engine's scheduler thread and never block on
the network. Bootstrap look-ups, registrations, status reads, checksum checks and
deadlines happen on one I/O thread that sleeps in zmq.Poller; once a room's encode
rank is known (its route cached, its region announced), `receive()` pushes the
room's TransferInfo itself with a non-blocking send, saving a thread hand-off per room.

Asks travel only over a live connection (ZMQ_IMMEDIATE): while an encode rank is not
connected they wait, in order, in the manager, which drops a room cleared meanwhile,
and a connection that dropped gets the registration again before its next room.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from transfer import _io
from transfer.bootstrap import BootstrapClient, BootstrapError
from transfer.frames import (
    MAX_REGIONS_PER_SESSION,
    TransferInfo,
    UnreadableChecksum,
    WireError,
    check_parallel,
    check_room,
    dtype_size,
    parse_status,
    registration_frames,
)
from transfer.metrics import Metrics, reason_label
from transfer.status import RoomTable, TransferPoll, is_terminal

log = logging.getLogger("transfer.receiver")

ENCODE_FAILED = "encode failed to send embedding"

#: After a bootstrap look-up failed and that took a while (a timeout, or an error
#: answered slowly), rooms that would look that server up fail at once for
#: UNREACHABLE_RETRY_S instead of each spending as long on the I/O thread, whose other
#: rooms (statuses, deadlines) would wait behind them. A quick failure (a server not up
#: yet refusing) costs little, so every room still tries.
UNREACHABLE_RETRY_S = 1.0
SLOW_FAILURE_S = 0.25

#: Asks the I/O thread handles per turn (and per ASK_TURN_S at most), and asks waiting for
#: a connection it sends per turn: between turns it reads statuses, runs deadlines and
#: sends what waited, and the caller's receive() never waits on a long batch.
ASK_BATCH = 256
ASK_TURN_S = 0.02

#: Statuses handled per turn of the I/O thread: a peer pushing faster than we drain must
#: not keep the thread from asks, deadlines and close().
DRAIN_BATCH = 1024

#: An encode rank keeps only the newest MAX_REGIONS_PER_SESSION regions each session
#: announced. A region is announced again once this many others were announced after it,
#: leaving the rest of that window for rooms already asked for to be written.
REANNOUNCE_AFTER = MAX_REGIONS_PER_SESSION // 2

#: Asks (registrations and TransferInfos) waiting, in order, for their encode rank's
#: connection. The sockets to encode ranks queue nothing while disconnected (see
#: _io.push_socket's `immediate`): ZMQ would hand such a queue to whoever listens at the
#: address next, rooms cleared meanwhile included. Ours drops cleared rooms instead.
#: Past this many for one encode rank, new rooms for it fail at once.
MAX_UNSENT_ASKS = 4096


@dataclass
class _Room:
    """What the I/O thread knows about one room this rank asked for."""

    room: int
    bootstrap_addr: str
    embedding_ptr: int
    rows: int
    hidden: int
    dtype: str
    row_bytes: int
    row_start: int
    span: int
    deepstack_ptr: int
    deepstack_nbytes: int
    started_at: float
    deadline: float
    encode_rank: int | None = None
    encode_addr: tuple[str, int] | None = None
    route_key: tuple[str, int, int] | None = None
    regions: RegionSet | None = None
    lease: Any = None  # the pool slot (or fallback buffer) the rows land in, when pooled
    # Not deepstack_ptr != 0: an empty shard's tensor slice has data_ptr() 0.
    has_deepstack: bool = False
    concluded_at: float | None = None
    unsent: bool = False  # its TransferInfo waits for the encode rank's connection
    asked_on: Any = None  # the socket its TransferInfo went to (or waits for)
    asked_at: float = 0.0  # when it was handed to that socket

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def where(self) -> str:
        """The encode rank this room waits on, for failure reasons."""
        if self.encode_rank is None:
            return f"its encode rank (bootstrap {self.bootstrap_addr})"
        host, port = self.encode_addr or ("?", 0)
        return f"encode rank {self.encode_rank} at {host}:{port}"


class ReceiveHandle(_io.RoomHandle):
    """One room's progress as the scheduler loop sees it: poll(), failure, latency_s, wait(), clear()."""

    def __init__(self, manager: SessionManager, room: _Room, rows: Any = None, deepstack: Any = None) -> None:
        super().__init__(manager._table, room, manager._conclusions, manager._rooms.get)
        self._manager = manager
        #: With a pool: the leased `[span, hidden]` rows (this rank's shard lands in its
        #: rows; the others are for reassembly) and likewise the deepstack rows.
        self.rows = rows
        self.deepstack = deepstack

    def clear(self, event: Any = None) -> None:
        """Forgets the room; a status that still arrives for it is ignored.

        A pooled room gives its slot back here: after a Success once `event` (the
        copy-out's CUDA event, if any) completed; otherwise into quarantine, since a
        late one-sided write may still land in it.
        """
        self._manager._forget(self._state, event)


class SessionManager:
    """A prefill rank's receiving side: registration, TransferInfos, statuses, deadlines."""

    def __init__(
        self,
        engine: Any,
        engine_rank: int,
        tp_size: int,
        dp_size: int = 1,
        *,
        buffer: Any = None,
        deepstack_buffer: Any = None,
        pool: Any = None,
        host: str | None = None,
        status_port: int = 0,
        deadline_s: float = 60.0,
        bootstrap_timeout_s: float = 2.0,
        integrity: bool = True,
        metrics: Metrics | None = None,
    ) -> None:
        check_parallel(engine_rank, tp_size, dp_size)
        self.engine = engine
        self.engine_rank = engine_rank
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.deadline_s = deadline_s
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.integrity = integrity
        self.host = host or engine.hostname
        if not self.host.isascii():
            raise ValueError(f"host {self.host!r} must be ASCII: it goes on the wire in every TransferInfo")
        self.metrics = metrics or Metrics("epd_prefill")

        if (buffer is None) == (pool is None):
            raise ValueError("give the session manager either a registered `buffer` or a `pool` of receive slots")
        self._owned: list[int] = []
        self.pool = pool
        if pool is not None:
            # Slots hold embedding and deepstack rows alike: one region serves both.
            self.buffer = self.deepstack_buffer = pool.region
        else:
            self.buffer = self._register(buffer)
            self.deepstack_buffer = self._register(deepstack_buffer) if deepstack_buffer is not None else None
        # Every destination lies in one of these announced (embedding, deepstack) region
        # pairs; the first is the main buffer, the rest are added for per-item buffers.
        self._region_sets: list[RegionSet] = [RegionSet(self.buffer, self.deepstack_buffer)]

        self._table = RoomTable()
        self._conclusions = _io.Conclusions()
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()
        self._asks: deque[_Room] = deque()
        self._deadlines: list[tuple[float, int, _Room]] = []  # under _lock
        self._wake_at = 0.0  # when the I/O thread next wakes by itself (under _lock)
        self._waker = _io.Waker()
        self._stopping = False
        self._failure: str | None = None  # why the I/O thread stopped on its own (under _lock)
        self._complaints = _io.ThrottledLog(log)  # about statuses peers sent
        self._failures = _io.ThrottledLog(log)  # rooms that failed, per kind of reason

        # Caches filled by the I/O thread; receive() reads them for its direct asks.
        # _send_lock serialises every push to an encode rank and every change to the
        # routes and announcements, so a direct ask never overtakes its registration.
        self._parallel: dict[str, tuple[int, int]] = {}
        self._routes: dict[tuple[str, int, int], tuple[str, int]] = {}
        self._announced: dict[tuple[str, int, int], _Announcements] = {}  # per route key
        self._encode_sockets: dict[tuple[str, int], zmq.Socket] = {}
        # Per encode address, asks its socket could not take yet: (room, fanout). Changed by
        # the I/O thread only.
        self._unsent: dict[tuple[str, int], deque[tuple[_Room, int]]] = {}
        # Per encode address, what reports its socket's lost connections (_io.watch_drops):
        # a rank restarted there knows nothing of what was announced to its predecessor.
        self._monitors: dict[tuple[str, int], zmq.Socket] = {}
        self._monitors_read_at = 0.0  # I/O thread only
        self._send_lock = threading.Lock()
        self._poller = zmq.Poller()  # the I/O thread's
        # Bootstrap servers that did not answer: address -> (when, why). I/O thread only.
        self._unreachable: dict[str, tuple[float, str]] = {}

        self._status_sock, self.status_port = _io.pull_socket(self.host, status_port)
        self.metrics.gauge_fn("rooms_in_flight", lambda: len(self._rooms))
        if pool is not None:
            self.metrics.gauge_fn("quarantined_slots", lambda: pool.stats()["quarantined"])
            self.metrics.gauge_fn("fallback_bytes", lambda: pool.stats()["fallback_bytes"])
        self._thread = threading.Thread(target=self._run, name=f"epd-prefill-{engine_rank}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- caller side

    def receive(
        self,
        room: int,
        bootstrap_addr: str,
        dst: Any = None,
        rows: int | None = None,
        hidden: int | None = None,
        dtype: str | None = None,
        row_start: int = 0,
        span: int | None = None,
        deepstack_dst: Any = None,
        deepstack_hidden: int | None = None,
    ) -> ReceiveHandle:
        """Asks the encode rank behind `bootstrap_addr` for this rank's rows of `room`.

        `dst` is a tensor `[rows, hidden]` (geometry taken from it) or a raw address with
        `rows`, `hidden` and `dtype`; it must lie inside the registered `buffer`. `span` is
        the item's full row count (default: `rows`, an identity receive). Never blocks.

        With a `pool` and no `dst`, the manager leases a slot for the item's full span
        (`rows`, `hidden`, `dtype` and, with deepstack, `deepstack_hidden` given) and
        this rank's shard lands in its rows `[row_start, row_start + rows)`.
        """
        if self._stopping:
            raise RuntimeError("session manager is closed")
        check_room(room)
        lease = full = full_ds = None
        if dst is None:
            lease, full, full_ds = self._lease(room, rows, hidden, dtype, row_start, span, deepstack_hidden)
            dst = full[row_start : row_start + rows]
            deepstack_dst = full_ds[row_start : row_start + rows] if full_ds is not None else None
            try:
                return self._receive(room, bootstrap_addr, dst, None, None, None, row_start, span, deepstack_dst,
                                     lease, full, full_ds)
            except BaseException:
                # fail(), not release(): if its TransferInfo went out before the error, a write
                # may still land in the slot, which quarantine keeps from the next room.
                lease.fail()
                self._drop_lease_region(lease)
                raise
        return self._receive(room, bootstrap_addr, dst, rows, hidden, dtype, row_start, span, deepstack_dst)

    def _receive(self, room, bootstrap_addr, dst, rows, hidden, dtype, row_start, span, deepstack_dst,
                 lease=None, full=None, full_ds=None) -> ReceiveHandle:
        """receive() once the destination is known."""
        ptr, rows, hidden, dtype = _destination(dst, rows, hidden, dtype)
        row_bytes = hidden * dtype_size(dtype)
        span = rows if span is None else span
        if not (0 <= row_start and row_start + rows <= span):
            raise ValueError(f"room {room}: shard [{row_start}, {row_start + rows}) outside the item's span {span}")
        ds_ptr, ds_nbytes = 0, 0
        if deepstack_dst is not None:
            ds = _io.as_region(deepstack_dst)
            ds_ptr, ds_nbytes = ds.addr, ds.nbytes
        regions = self._regions_for(room, ptr, rows * row_bytes, ds_ptr, ds_nbytes, deepstack_dst is not None)
        now = time.monotonic()
        state = _Room(
            room, bootstrap_addr, ptr, rows, hidden, dtype, row_bytes, row_start, span,
            ds_ptr, ds_nbytes, started_at=now, deadline=now + self.deadline_s,
        )
        state.regions = regions
        state.lease = lease
        state.has_deepstack = deepstack_dst is not None
        with self._lock:
            if self._stopping:  # close() ran since receive() looked
                raise RuntimeError("session manager is closed")
            if self._failure is not None:
                raise RuntimeError(f"session manager's I/O thread stopped after an error: {self._failure}")
            if room in self._rooms:
                raise ValueError(f"room {room} is already being received; clear() it first")
            self._rooms[room] = state
            self._table.start(room, TransferPoll.Bootstrapping)
        self.metrics.inc("rooms_started_total")
        try:
            asked = self._ask_from_cache(state)
        except BaseException:
            with self._lock:  # the caller gets the error and no handle: leave nothing behind
                del self._rooms[room]
                self._table.clear(room)
            raise
        with self._lock:
            if asked:  # only its deadline is left for the I/O thread
                heapq.heappush(self._deadlines, (state.deadline, state.room, state))
                wake = state.deadline < self._wake_at
            else:
                self._asks.append(state)
                wake = True
        if wake:
            self._waker.wake()
        return ReceiveHandle(self, state, full, full_ds)

    def _lease(self, room, rows, hidden, dtype, row_start, span, deepstack_hidden):
        """Leases a pool slot for the item's full span; returns (lease, rows view, deepstack view)."""
        import torch

        if self.pool is None:
            raise ValueError(f"room {room}: no dst given and the manager has no pool")
        if rows is None or hidden is None or dtype is None:
            raise ValueError(f"room {room}: a pooled receive needs rows, hidden and dtype")
        span = rows if span is None else span
        torch_dtype = getattr(torch, dtype.removeprefix("torch."))
        nbytes = span * hidden * dtype_size(dtype)
        ds_nbytes = span * (deepstack_hidden or 0) * dtype_size(dtype)
        lease = self.pool.lease_or_fallback(nbytes + ds_nbytes)
        flat = lease.view((nbytes + ds_nbytes,), torch.uint8)
        full = flat[:nbytes].view(torch_dtype).view(span, hidden)
        full_ds = flat[nbytes:].view(torch_dtype).view(span, deepstack_hidden) if deepstack_hidden else None
        if lease.is_fallback:
            self.add_region(lease.region, lease.region)
        return lease, full, full_ds

    def _drop_lease_region(self, lease: Any) -> None:
        if lease.is_fallback:
            with self._lock:
                self._region_sets = [r for r in self._region_sets if r.embedding is not lease.region]

    def add_region(self, embedding: Any, deepstack: Any = None) -> RegionSet:
        """Adds registered memory outside the main buffer as a destination (e.g. a per-item buffer).

        The region is announced to each encode rank, before the first room that lands in it,
        with a registration of its own (our extension: peers keep writing as before).
        """
        regions = RegionSet(_io.as_region(embedding), _io.as_region(deepstack) if deepstack is not None else None)
        with self._lock:
            self._region_sets.append(regions)
        return regions

    def remove_region(self, regions: RegionSet) -> None:
        """Stops accepting destinations in a region added with add_region()."""
        with self._lock:
            if regions in self._region_sets[1:]:
                self._region_sets.remove(regions)

    def _regions_for(self, room: int, ptr: int, nbytes: int, ds_ptr: int, ds_nbytes: int, has_ds: bool) -> RegionSet:
        """The announced region pair that holds the destination, or a ValueError naming it."""
        with self._lock:
            sets = list(self._region_sets)
        for regions in sets:
            if not regions.embedding.contains(ptr, nbytes):
                continue
            if has_ds and (regions.deepstack is None or not regions.deepstack.contains(ds_ptr, ds_nbytes)):
                continue
            return regions
        ds = f" and deepstack [{ds_ptr:#x}, +{ds_nbytes})" if has_ds else ""
        raise ValueError(
            f"room {room}: destination [{ptr:#x}, +{nbytes}){ds} is outside every registered receive "
            f"buffer (main buffer [{self.buffer.addr:#x}, +{self.buffer.nbytes}))"
        )

    def concluded(self) -> list[int]:
        """Rooms that reached Success or Failed since the last call, oldest first, each once.

        Never blocks. For scheduler loops with many rooms outstanding: look at these
        rooms' handles instead of polling every handle each step. A room cleared before
        it was handed out is left out.
        """
        return self._table.take_concluded()

    def stats(self) -> dict:
        """A plain snapshot of counters, histograms and gauges."""
        return self.metrics.snapshot()

    def close(self) -> None:
        """Fails rooms still in flight, stops the I/O thread, closes sockets, unregisters owned memory."""
        with self._lock:  # receive() files rooms under it: none is filed after this
            if self._stopping:
                return
            self._stopping = True
        self._waker.wake()
        # The I/O thread's longest step is one room's bootstrap look-up (two requests).
        self._thread.join(timeout=2 * self.bootstrap_timeout_s + 5)
        stuck = self._thread.is_alive()
        self._fail_rooms("session manager closed")
        if stuck:
            # Its sockets are its own: closing them under it could crash the process.
            log.error("prefill rank %d: the I/O thread did not stop; leaving its sockets open", self.engine_rank)
        else:
            self._status_sock.close(0)
            with self._send_lock:
                for addr, sock in self._encode_sockets.items():
                    _io.close_watched(sock, self._monitors.pop(addr, None))
                self._encode_sockets.clear()
                self._unsent.clear()
            self._waker.close()
        for addr in self._owned:
            try:
                self.engine.unregister(addr)
            except Exception as exc:  # noqa: BLE001 - closing must go on
                log.warning("unregistering %#x failed: %s", addr, exc)
        self._owned.clear()

    def __enter__(self) -> SessionManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- internals

    def _register(self, buf: Any) -> _io.Region:
        """Registers `buf` with the engine unless it already lies in registered memory."""
        region = _io.as_region(buf)
        for addr, nbytes in self.engine.registered().items():
            if addr <= region.addr and region.end <= addr + nbytes:
                return region
        self.engine.register(region.tensor if region.tensor is not None else region.addr, region.nbytes)
        self._owned.append(region.addr)
        return region

    def _forget(self, state: _Room, event: Any = None) -> None:
        """Drops the room; hands a pooled slot back (Success) or to quarantine (anything else)."""
        with self._lock:
            if self._rooms.get(state.room) is not state:
                return
            succeeded = self._table.get(state.room) == TransferPoll.Success
            del self._rooms[state.room]
            self._table.clear(state.room)
        if state.lease is not None:
            lease, state.lease = state.lease, None
            if succeeded:
                lease.release(event)
            else:
                lease.fail()
            self._drop_lease_region(lease)

    def _conclude(self, state: _Room, status: TransferPoll, reason: str | None = None) -> None:
        """Moves a room to a terminal status once; later statuses for it change nothing."""
        with self._lock:
            if self._rooms.get(state.room) is not state or is_terminal(self._table.get(state.room)):
                return
            if status == TransferPoll.Failed:
                self._table.fail(state.room, reason or "failed")
            else:
                self._table.update(state.room, status)
        if status == TransferPoll.Success:
            self.metrics.inc("rooms_succeeded_total")
            self.metrics.inc("bytes_received_total", state.nbytes + state.deepstack_nbytes)
            self.metrics.observe("room_latency_seconds", time.monotonic() - state.started_at)
        else:
            label = reason_label(reason or "")
            self.metrics.inc("rooms_failed_total", reason=label)
            self._failures.warning(label, "room %d failed: %s", state.room, reason)
        state.concluded_at = time.monotonic()
        self._conclusions.notify()

    def _run(self) -> None:
        _io.name_this_thread(f"epd-pre{self.engine_rank}-io")
        poller = self._poller
        poller.register(self._status_sock, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(self._next_timeout_ms()))
                if any(flags & zmq.POLLOUT for flags in events.values()):
                    self._flush_unsent()  # before new asks, which queue behind these
                if self._waker.fileno() in events:
                    self._waker.drain()
                    self._serve_asks()
                if self._status_sock in events:
                    self._drain_statuses()
                now = time.monotonic()
                self._expire(now)
                if now - self._monitors_read_at >= 1.0:
                    self._read_monitors(now)
                    if self.pool is not None:
                        self.pool.poll()  # graces and quarantines end while no room is received, too
        except Exception as exc:  # without this thread no room would ever conclude
            log.exception("prefill rank %d: the I/O thread failed; failing its rooms", self.engine_rank)
            with self._lock:
                self._failure = f"{type(exc).__name__}: {exc}"
            self._fail_rooms(f"session manager stopped: {self._failure}")

    def _read_monitors(self, now: float) -> None:
        """Reads the drop reports of every encode socket, so an idle one's do not pile up in ZMQ."""
        self._monitors_read_at = now
        for addr in list(self._monitors):
            with self._send_lock:
                self._note_drops(addr)

    def _fail_rooms(self, reason: str) -> None:
        """Concludes every room still held Failed with `reason`."""
        with self._lock:
            states = list(self._rooms.values())
        for state in states:
            self._conclude(state, TransferPoll.Failed, reason)

    def _next_timeout_ms(self) -> int:
        """How long the I/O thread may sleep: until the earliest deadline, at most 1 s."""
        with self._lock:
            timeout_ms = 1000
            if self._deadlines:
                timeout_ms = max(0, min(1000, int((self._deadlines[0][0] - time.monotonic()) * 1000) + 1))
            self._wake_at = time.monotonic() + timeout_ms / 1000
        return timeout_ms

    def _serve_asks(self) -> None:
        """Asks for up to ASK_BATCH queued rooms; wakes itself for the next turn when more wait."""
        turn_ends = time.monotonic() + ASK_TURN_S
        for _ in range(ASK_BATCH):
            if self._stopping:
                return
            if time.monotonic() > turn_ends:
                break
            with self._lock:
                if not self._asks:
                    return
                state = self._asks.popleft()
                if self._rooms.get(state.room) is not state:
                    continue  # cleared before we got to it: nothing to ask for
                heapq.heappush(self._deadlines, (state.deadline, state.room, state))
            if time.monotonic() >= state.deadline:
                # Asking now would only have it expire at once, on a socket that then looks silent.
                self._conclude(state, TransferPoll.Failed,
                               f"room {state.room}: its deadline of {self.deadline_s:g}s passed before it could be "
                               f"asked for (the session manager's I/O thread was behind)")
                continue
            down = self._unreachable.get(state.bootstrap_addr)
            if down is not None:
                ago = time.monotonic() - down[0]
                if ago < UNREACHABLE_RETRY_S:
                    self._conclude(state, TransferPoll.Failed, f"bootstrap {state.bootstrap_addr}: {down[1]} "
                                   f"({ago:.1f}s ago; not asked again for {UNREACHABLE_RETRY_S:g}s)")
                    continue
                del self._unreachable[state.bootstrap_addr]
            started = time.monotonic()
            try:
                self._ask(state)
            except BootstrapError as exc:
                now = time.monotonic()
                if now - started >= SLOW_FAILURE_S:
                    self._unreachable[state.bootstrap_addr] = (now, f"{exc} (after {now - started:.1f}s)")
                self._conclude(state, TransferPoll.Failed, f"bootstrap {state.bootstrap_addr}: {exc}")
            except _AskFailed as exc:
                self._conclude(state, TransferPoll.Failed, str(exc))
            except Exception as exc:  # one room's ask must not stop the others
                log.exception("room %d: asking for it failed", state.room)
                self._conclude(state, TransferPoll.Failed,
                               f"room {state.room}: asking for it failed: {type(exc).__name__}: {exc}")
        self._waker.wake()  # more asks wait: the next turn comes after the poller's

    def _route_key(self, state: _Room, encode_tp: int, encode_dp: int) -> tuple[int, tuple[str, int, int]]:
        """(fanout, route key) of the room's encode rank (SPEC.md section 5); sets state.encode_rank."""
        local_tp = self.tp_size // self.dp_size
        if local_tp % encode_tp:
            raise _AskFailed(f"prefill local tp {local_tp} is not a multiple of encode tp {encode_tp}")
        fanout = local_tp // encode_tp
        state.encode_rank = (self.engine_rank % local_tp) // fanout
        state.route_key = (state.bootstrap_addr, state.room % encode_dp, state.encode_rank)
        return fanout, state.route_key

    def _ask(self, state: _Room) -> None:
        """Resolves the room's encode rank and sends the registration (once) and its TransferInfo."""
        encode_tp, encode_dp = self._parallel_info(state.bootstrap_addr)
        fanout, key = self._route_key(state, encode_tp, encode_dp)
        route = self._routes.get(key)
        if route is None:
            client = BootstrapClient(state.bootstrap_addr, timeout=self.bootstrap_timeout_s)
            route = client.route(state.encode_rank, key[1])
            with self._send_lock:
                self._routes[key] = route
        state.encode_addr = route
        with self._send_lock:
            sock = self._encode_sockets.get(route)
            if sock is None:
                try:
                    sock = self._encode_sockets[route] = _io.push_socket(*route, immediate=True)
                except zmq.ZMQError as exc:
                    self._routes.pop(key, None)  # the next room looks the rank up afresh
                    raise _AskFailed(f"encode rank {state.encode_rank} at {route[0]}:{route[1]} (from bootstrap "
                                     f"{state.bootstrap_addr}): cannot connect: {exc}") from None
                self._monitors[route] = _io.watch_drops(sock)
            self._send_or_queue(route, sock, state, fanout)

    def _send_or_queue(self, addr: tuple[str, int], sock: zmq.Socket, state: _Room, fanout: int) -> None:
        """Sends the room's ask now, or queues it behind those waiting for the encode rank's
        connection (I/O thread, _send_lock held)."""
        state.asked_on, state.asked_at = sock, time.monotonic()
        queue = self._unsent.get(addr)
        if queue is None:
            if self._send_ask(addr, sock, state, fanout):
                return
            queue = self._unsent[addr] = deque()
            self._poller.register(sock, zmq.POLLOUT)
        elif len(queue) >= MAX_UNSENT_ASKS:
            raise _AskFailed(f"{state.where()} is not taking requests ({len(queue)} asks already wait for it)")
        queue.append((state, fanout))
        state.unsent = True

    def _send_ask(self, addr: tuple[str, int], sock: zmq.Socket, state: _Room, fanout: int) -> bool:
        """Pushes the room's TransferInfo, its regions' registration first unless this connection
        carried it already (_send_lock held); False when the socket cannot take them now."""
        self._note_drops(addr)
        announced = self._announced.setdefault(state.route_key, _Announcements())
        regions = state.regions
        if not announced.holds(regions.embedding) and self._rooms.get(state.room) is state:
            ds = regions.deepstack
            frames = registration_frames(
                self.host, self.status_port, self.engine.session_id,
                regions.embedding.addr, ds.addr if ds else 0,
                regions.embedding.nbytes, ds.nbytes if ds else 0,
            )
            try:
                _io.send_frames(sock, frames)
            except zmq.Again:
                return False
            announced.add(regions.embedding)
        return self._send_info(sock, state, fanout)

    def _note_drops(self, addr: tuple[str, int]) -> None:
        """Forgets what was announced to the encode rank at `addr` once its connection dropped
        (_send_lock held): a rank restarted there never heard it, and what was still queued
        for the old connection died with it."""
        monitor = self._monitors.get(addr)
        if monitor is not None and _io.dropped(monitor):
            for key, route in self._routes.items():
                if route == addr:
                    self._announced.pop(key, None)

    def _flush_unsent(self) -> None:
        """Sends, in order, up to ASK_BATCH asks that waited for a connection, as far as the
        sockets take them; the poller calls again while a socket with more can take them.

        _send_lock is taken per ask, so the caller's receive() never waits on the batch.
        """
        budget = ASK_BATCH
        for addr in list(self._unsent):
            while budget > 0:
                with self._send_lock:
                    queue = self._unsent.get(addr)
                    if not queue:
                        break
                    sock = self._encode_sockets[addr]
                    state, fanout = queue[0]
                    try:
                        if not self._send_ask(addr, sock, state, fanout):
                            break
                    except Exception as exc:  # one ask's failure must not stop the others
                        log.exception("sending a queued ask to %s:%d failed", *addr)
                        self._conclude(state, TransferPoll.Failed,
                                       f"room {state.room}: asking for it failed: {type(exc).__name__}: {exc}")
                    queue.popleft()
                    budget -= 1
                    state.unsent = False
                    if not queue:
                        del self._unsent[addr]
                        self._poller.unregister(sock)

    def _ask_from_cache(self, state: _Room) -> bool:
        """Asks from the caller's thread when everything is cached; False leaves it to the I/O thread.

        The I/O thread alone looks routes up, announces regions and reports failures;
        this only sends the TransferInfo once the route is known and the room's region
        was announced on that same socket since its last lost connection.
        """
        parallel = self._parallel.get(state.bootstrap_addr)
        if parallel is None:
            return False
        try:
            fanout, key = self._route_key(state, *parallel)
        except _AskFailed:
            return False
        regions = state.regions
        with self._send_lock:
            route = self._routes.get(key)
            sock = self._encode_sockets.get(route) if route is not None else None
            if sock is None or self._stopping or route in self._unsent:
                return False  # asks waiting for a connection go first, in order
            self._note_drops(route)
            announced = self._announced.get(key)
            if announced is None or not announced.holds(regions.embedding):
                return False
            state.encode_addr, state.asked_on, state.asked_at = route, sock, time.monotonic()
            # Not taken now (no connection): the I/O thread queues it.
            return self._send_info(sock, state, fanout)

    def _send_info(self, sock: zmq.Socket, state: _Room, fanout: int) -> bool:
        """Pushes the room's TransferInfo unless it was cleared or concluded meanwhile (_send_lock
        held); False when the socket cannot take it now."""
        info = TransferInfo(
            room=state.room, endpoint=self.host, port=self.status_port, session_id=self.engine.session_id,
            embedding_ptr=state.embedding_ptr, deepstack_ptr=state.deepstack_ptr, rows=state.rows,
            hidden=state.hidden, dtype=state.dtype, has_deepstack=state.has_deepstack,
            fanout=fanout, row_start=state.row_start, span=state.span,
        )
        frames = info.to_frames()
        # Under _lock, so a clear() (say, during a slow look-up) comes wholly before or after:
        # a room given up is never asked for, since its memory is the caller's again.
        with self._lock:
            if self._rooms.get(state.room) is not state or is_terminal(self._table.get(state.room)):
                return True  # nothing to send any more
            try:
                _io.send_frames(sock, frames)
            except zmq.Again:
                return False
            self._table.update(state.room, TransferPoll.WaitingForInput)
        return True

    def _parallel_info(self, bootstrap_addr: str) -> tuple[int, int]:
        info = self._parallel.get(bootstrap_addr)
        if info is None:
            client = BootstrapClient(bootstrap_addr, timeout=self.bootstrap_timeout_s)
            info = self._parallel[bootstrap_addr] = client.parallel_info()
        return info

    def _drain_statuses(self) -> None:
        """Handles the statuses queued, at most DRAIN_BATCH of them (the poller calls again for the rest)."""
        for _ in range(DRAIN_BATCH):
            frames = _io.recv_frames(self._status_sock)
            if frames is None:
                return
            unreadable = None  # a checksum part (ours, SPEC.md 8) that does not parse
            try:
                room, status, rank, sums = parse_status(frames)
            except UnreadableChecksum as exc:
                room, status, rank, sums, unreadable = exc.room, exc.status, exc.rank, (), str(exc)
            except WireError as exc:
                self._complaints.warning(str(exc), "dropped a malformed status (%d parts): %s", len(frames), exc)
                continue
            with self._lock:
                state = self._rooms.get(room)
            if state is None:
                log.debug("status %s for unknown room %d ignored", status.name, room)
                continue
            if state.encode_rank is not None and rank != state.encode_rank:
                self._complaints.warning(("rank", rank), "room %d: status from encode rank %d, expected %d; ignored",
                                         room, rank, state.encode_rank)
                continue
            if unreadable and status == TransferPoll.Success and self.integrity:
                # Not dropped (the room would wait out its deadline for nothing) nor taken unverified.
                self._conclude(state, TransferPoll.Failed,
                               f"room {room}: Success from {state.where()} came with a checksum part that "
                               f"does not parse ({unreadable}), so the landed bytes cannot be verified")
                continue
            try:
                self._on_status(state, status, sums)
            except Exception as exc:  # e.g. a device error while checking: this room only
                log.exception("room %d: handling its status failed", room)
                self._conclude(state, TransferPoll.Failed,
                               f"room {room}: handling its status failed: {type(exc).__name__}: {exc}")

    def _on_status(self, state: _Room, status: TransferPoll, sums: tuple[int, ...]) -> None:
        if status == TransferPoll.Failed:
            self._conclude(state, TransferPoll.Failed, f"{ENCODE_FAILED} ({state.where()})")
        elif status == TransferPoll.Success:
            mismatch = self._verify(state, sums) if self.integrity else None
            if mismatch:
                self._conclude(state, TransferPoll.Failed, mismatch)
            else:
                self._conclude(state, TransferPoll.Success)
        else:
            with self._lock:
                if self._rooms.get(state.room) is state:
                    self._table.update(state.room, status)

    def _verify(self, state: _Room, sums: tuple[int, ...]) -> str | None:
        """Compares the landed bytes with the sender's checksums (none sent: unverified)."""
        regions = state.regions
        checks = [("embedding", regions.embedding, state.embedding_ptr, state.nbytes)]
        if state.deepstack_ptr and regions.deepstack is not None:
            checks.append(("deepstack", regions.deepstack, state.deepstack_ptr, state.deepstack_nbytes))
        for (what, region, addr, nbytes), expected in zip(checks, sums):
            landed = _io.checksum(region, addr, nbytes)
            if landed != expected:
                return (
                    f"checksum mismatch: room {state.room}, prefill rank {self.engine_rank}, {what} "
                    f"from {state.where()}: sent {expected}, landed {landed}"
                )
        return None

    def _expire(self, now: float) -> None:
        """Fails rooms past their deadline; drops the entries of rooms that concluded."""
        if len(self._deadlines) > 2 * len(self._rooms) + 1024:
            # Concluded rooms' entries would otherwise wait out their whole deadline here.
            with self._lock:
                self._deadlines = [
                    entry for entry in self._deadlines
                    if self._rooms.get(entry[1]) is entry[2] and not is_terminal(self._table.get(entry[1]))
                ]
                heapq.heapify(self._deadlines)
        while True:
            with self._lock:
                if not self._deadlines or self._deadlines[0][0] > now:
                    return
                _, _, state = heapq.heappop(self._deadlines)
                live = self._rooms.get(state.room) is state and not is_terminal(self._table.get(state.room))
            if not live:
                continue
            # The encode rank may have restarted elsewhere, its node with other sizes: look
            # both up afresh next time.
            never_sent: deque = deque()
            with self._send_lock:
                # Only the socket this room was asked on went silent, and only if the room
                # waited on it a while (one asked late says little, and tearing the socket down
                # for each such room would cost every later room a look-up and a connection).
                # One replaced since came with a fresh look-up; its rooms keep their deadlines.
                sock = self._encode_sockets.get(state.encode_addr)
                waited = time.monotonic() - state.asked_at
                if sock is not None and sock is state.asked_on and waited >= self.deadline_s / 2:
                    self._parallel.pop(state.bootstrap_addr, None)
                    self._routes.pop(state.route_key, None)
                    self._announced.pop(state.route_key, None)
                    # A fresh socket, and nothing of this one's queue (expired rooms' asks,
                    # whose memory may be reused by then) reaches a rank restarted there.
                    del self._encode_sockets[state.encode_addr]
                    never_sent = self._unsent.pop(state.encode_addr, never_sent)
                    if never_sent:
                        self._poller.unregister(sock)
                    _io.close_watched(sock, self._monitors.pop(state.encode_addr, None))
            if state.unsent:
                reason = (f"no connection to {state.where()} within {self.deadline_s:g}s: room {state.room} "
                          f"was never asked for (is the encode rank running?)")
            else:
                reason = f"no status from {state.where()} within {self.deadline_s:g}s for room {state.room}"
            self._conclude(state, TransferPoll.Failed, reason)
            # The rooms queued behind it wait on the same silent rank: they fail now, unasked.
            for other, _ in never_sent:
                if other is not state:
                    self._conclude(other, TransferPoll.Failed,
                                   f"{other.where()} went silent: room {state.room} had no answer within "
                                   f"{self.deadline_s:g}s, and room {other.room} was never asked for")


@dataclass(frozen=True, eq=False)
class RegionSet:
    """An announced pair of receive regions: embedding rows and (optionally) deepstack rows."""

    embedding: _io.Region
    deepstack: _io.Region | None = None


class _Announcements:
    """The regions one encode rank was told of, filed as it files them: newest last, bounded."""

    def __init__(self) -> None:
        self.count = 0  # announcements made
        self.regions: dict[int, tuple[int, int]] = {}  # addr -> (length, its announcement's count)

    def holds(self, region: _io.Region) -> bool:
        """Whether the encode rank still holds `region` with room to spare (REANNOUNCE_AFTER)."""
        entry = self.regions.get(region.addr)
        return entry is not None and entry[0] == region.nbytes and self.count - entry[1] < REANNOUNCE_AFTER

    def add(self, region: _io.Region) -> None:
        """Records an announcement of `region`; it replaces one at the same address."""
        self.count += 1
        self.regions.pop(region.addr, None)
        self.regions[region.addr] = (region.nbytes, self.count)
        while len(self.regions) > MAX_REGIONS_PER_SESSION:
            del self.regions[next(iter(self.regions))]


class _AskFailed(Exception):
    """A room could not be asked for; its message is the room's failure reason."""


def _destination(dst: Any, rows: int | None, hidden: int | None, dtype: str | None) -> tuple[int, int, int, str]:
    """(pointer, rows, hidden, dtype) of a destination tensor or raw pointer."""
    if isinstance(dst, int):
        if rows is None or hidden is None or dtype is None:
            raise ValueError("a raw destination pointer needs rows, hidden and dtype")
        return dst, rows, hidden, dtype
    if not hasattr(dst, "data_ptr"):
        raise TypeError(f"dst must be a torch tensor or a pointer, got {type(dst).__name__}")
    if not dst.is_contiguous():
        raise ValueError(f"destination of shape {tuple(dst.shape)} is not contiguous")
    if dst.dim() == 2:
        t_rows, t_hidden = dst.shape
    elif hidden:
        t_rows, t_hidden = dst.numel() // hidden, hidden
    else:
        raise ValueError("a destination that is not 2-D needs `hidden`")
    t_dtype = str(dst.dtype)
    for name, given, actual in (("rows", rows, t_rows), ("hidden", hidden, t_hidden), ("dtype", dtype, t_dtype)):
        if given is not None and given != actual:
            raise ValueError(f"{name} {given} disagrees with the destination tensor's {actual}")
    return dst.data_ptr(), int(t_rows), int(t_hidden), t_dtype

"""The prefill side: a session manager that asks encode ranks for items and tracks
their rooms (SPEC.md sections 5, 7 and 8).

This is the public face: validation, destinations and receive slots, handles. The
room rules live in transfer.core.prefill (PrefillCore); the thread, sockets, clock
and bootstrap look-ups in transfer.drive.prefill (PrefillDriver). `receive()` and
`poll()` run on the engine's scheduler thread and never block on the network: once a
room's encode rank is known (its route cached, its region announced), `receive()`
pushes the room's TransferInfo itself with a non-blocking send.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transfer import _io, config, frames
from transfer._forks import free_in_child
from transfer.bootstrap import checked_address, split_address
from transfer.core.prefill import ENCODE_FAILED, RoomSpec
from transfer.core.prefill_breaker import UNREACHABLE_RETRY_S
from transfer.core.quarantine import Fate, fate_of, reusable
from transfer.drive.prefill import MANAGER_CLOSED, PrefillDriver, Room
from transfer.errors import ConfigError, ConfigTypeError, EngineError, FallbackLimitError, SlotError, UsageError
from transfer.frames import (
    DTYPE_BYTES,
    check_parallel,
    check_room,
    dtype_size,
    normalize_dtype,
    scalar_ints,
    size_problem,
)
from transfer.interfaces import EventLike, TransferEngineLike
from transfer.metrics import Metrics, MetricsClaim, declare_role
from transfer.ports import PortSpec, parse_ports
from transfer.status import TransferPoll

if TYPE_CHECKING:
    import torch

    from transfer.buffers import ReceivePool, Slot

__all__ = ["ENCODE_FAILED", "UNREACHABLE_RETRY_S", "ReceiveHandle", "RegionSet", "SessionManager"]

log = logging.getLogger("transfer.receiver")

# Engines that have a session manager. An encode rank knows a prefill rank by its engine's
# session: a second manager on the same engine would replace the first's regions there.
# Each maps to its manager's (engine rank, id).
_managed_engines: weakref.WeakKeyDictionary[TransferEngineLike, tuple[int, int]] = weakref.WeakKeyDictionary()
# Reentrant: a collection inside a hold of it (on whichever thread allocates) may run the finalizer of a
# manager dropped in a reference cycle, which takes it too.
_managed_lock = free_in_child(threading.RLock())
# Engines whose session manager was dropped without close() and is being closed: set once it is.
_closing_engines: weakref.WeakKeyDictionary[TransferEngineLike, threading.Event] = weakref.WeakKeyDictionary()
#: Seconds a new session manager waits for the close of one dropped on its engine.
DROPPED_CLOSE_WAIT_S = 30.0
# Guards each room's `lease` while it is taken back, by clear() or close().
_leases_lock = free_in_child(threading.Lock())
# The torch.dtype of each wire dtype name a pooled receive() leased rows of (torch is imported at the first).
_torch_dtypes: dict[str, torch.dtype] = {}


def _await_dropped_manager(engine: TransferEngineLike) -> None:
    """Waits (DROPPED_CLOSE_WAIT_S at most) for the close of a session manager dropped on `engine`, which
    still holds the engine and the memory it registered there."""
    with _managed_lock:
        closing = _closing_engines.get(engine)
    if closing is not None:
        closing.wait(DROPPED_CLOSE_WAIT_S)


def _refuse_shared_engine(engine: TransferEngineLike) -> None:
    """ConfigError when `engine` already has an open session manager (lock held)."""
    holder = _managed_engines.get(engine)
    if holder is not None:
        rank = holder[0]
        raise ConfigError(f"engine {engine.session_id} already has a session manager (engine rank {rank}): "
                          f"encode ranks know a prefill rank by its engine's session, so each session "
                          f"manager needs an engine of its own")


def _check_memory(engine: TransferEngineLike, buffer: torch.Tensor | tuple[int, int] | None,
                  pool: ReceivePool | None) -> None:
    """ConfigError unless a session manager is given exactly one of a registered `buffer` and a `pool`, and
    the pool is open and registered with the manager's `engine`."""
    if (buffer is None) == (pool is None):
        raise ConfigError("give the session manager either a registered `buffer` or a `pool` of receive slots")
    if pool is not None and pool.engine is not engine:
        raise ConfigError("the pool's memory is registered with another engine than the manager's: "
                          "encode ranks could not write into it")
    if pool is not None and pool.closed:
        raise ConfigError(f"the receive pool at {pool.region.addr:#x} is closed: its slots are gone; give the "
                          f"session manager an open ReceivePool (close a pool only after its manager)")


def pool_gauges(metrics: Metrics | MetricsClaim, pool: ReceivePool) -> None:
    """The receive pool's gauges: read-only, so a scrape (on its thread) queries no event and unregisters no
    fallback; the manager's thread and receive() poll the pool."""
    metrics.gauge_fn("quarantined_slots", lambda: pool.stats(poll=False)["quarantined"])
    metrics.gauge_fn("fallback_bytes", lambda: pool.stats(poll=False)["fallback_bytes"])


class ReceiveHandle(_io.RoomHandle[Room]):
    """One room's progress as the scheduler loop sees it: poll(), failure, failure_kind, latency_s, wait(), clear()."""

    def __init__(self, manager: SessionManager, room: Room, rows: torch.Tensor | None = None,
                 deepstack: torch.Tensor | None = None, shard: tuple[int, int] = (0, 0)) -> None:
        driver = manager._driver
        # RoomHandle.__init__(driver.table, room, driver.conclusions, driver.rooms.get)'s fields, without its call
        self._table, self._state, self._conclusions = driver.table, room, driver.conclusions
        self._held = driver.rooms.get
        self.room = room.room
        self._manager = manager
        #: With a pool: the leased `[span, hidden]` rows (this rank's shard lands in its
        #: rows; the others are for reassembly) and likewise the deepstack rows.
        self.rows = rows
        self.deepstack = deepstack
        #: `(row_start, rows)`: the rows of the item this rank asked for (for ShardedItem).
        self.shard = shard

    def __del__(self) -> None:
        # Only clear() gives the room (and its pool slot) back before the manager closes: a handle
        # dropped without it is a leak until then.
        try:
            if self._current() and not self._manager._closed:
                what = "its pool slot" if self._state.lease is not None else "its room number"
                warnings.warn(f"room {self.room}'s handle was dropped without clear(): the session manager "
                              f"keeps the room and {what} until it closes", ResourceWarning, stacklevel=2)
        except Exception:  # noqa: BLE001 - nothing may escape a finalizer
            pass

    def poll(self) -> TransferPoll:
        """The room's status right now; never blocks (reads the statuses that came, on this thread)."""
        if self._state.concluded_at is None:
            self._manager._driver.progress()
        return super().poll()

    def wait(self, timeout: float) -> TransferPoll:
        """Blocks up to `timeout` seconds for a terminal status (for tools and tests, not scheduler loops)."""
        timeout = config.check_seconds("timeout", timeout, zero_ok=True)
        held, room, state = self._held, self.room, self._state
        if held(room) is state:  # _current(): a cleared room will not conclude for this handle
            self._manager._driver.wait(state, timeout)
        # RoomHandle.poll(), without its calls, and without _read()'s look before the read: a room forgotten is
        # never held again, so one held after the read was held while it was read.
        status = self._table.get(room)
        return TransferPoll.Failed if status is None or held(room) is not state else status

    @property
    def retry_at(self) -> float | None:
        """Where the room failed because its bootstrap server is paused, when that pause ends (on time.monotonic's
        clock), else None (also once cleared). A look-up that failed slowly (a timeout, an error answered
        slowly) pauses its server for UNREACHABLE_RETRY_S: that look-up's rooms fail, and so do the rooms
        received meanwhile, at once, all of kind bootstrap. Receiving the room again from then may succeed."""
        failure = self._read(self._table.failure)
        return None if failure is None else failure.retry_at

    @property
    def safe_to_reuse(self) -> bool:
        """Whether no encode rank will write into this room's memory any more.

        True once it succeeded; at once when no encode rank was ever asked; once the
        encode rank confirmed the cancel sent when the room was given up (its deadline,
        or clear() before a terminal status); otherwise only after the quarantine bound
        (the pool's, else buffers.default_quarantine_s() of the engine for the room's bytes) from
        its conclusion. Poll it after clear() too: a confirmation may come later.
        """
        record, manager = self._state, self._manager
        return reusable(succeeded=record.succeeded, memory_safe=record.memory_safe, concluded_at=record.concluded_at,
                        now=manager._driver.clock(), quarantine_s=manager.quarantine_of(record.nbytes))

    def clear(self, event: EventLike | None = None) -> None:
        """Forgets the room; a status that still arrives for it is ignored.

        A room given up on before a terminal status has its encode rank told (a cancel).
        A pooled room gives its slot back here: after a Success once `event` (the
        copy-out's CUDA event, if any) completed, and likewise when its memory is already
        safe (see `safe_to_reuse`); otherwise into quarantine, since a late one-sided write
        may still land in it, until the encode rank confirms the cancel.

        UsageError when a thread of the manager stays stuck holding its lock for
        transfer._io.LOCK_WAIT_S (the text names it): the room is kept for a clear() again
        (held only once the room was forgotten: its slot waits out its quarantine bound), unless
        the manager is closed (then this returns: close() gave the room up).
        """
        if event is not None and not callable(getattr(event, "query", None)):
            raise ConfigTypeError(f"room {self._state.room}: event must have query() (e.g. a torch.cuda.Event); "
                                  f"got {type(event).__name__}")
        self._manager._forget(self._state, event)


class SessionManager:
    """A prefill rank's receiving side: registration, TransferInfos, statuses, deadlines."""

    def __init__(
        self,
        engine: TransferEngineLike,
        engine_rank: int,
        tp_size: int,
        dp_size: int = 1,
        *,
        buffer: torch.Tensor | tuple[int, int] | None = None,
        deepstack_buffer: torch.Tensor | tuple[int, int] | None = None,
        pool: ReceivePool | None = None,
        host: str | None = None,
        status_port: PortSpec = 0,
        deadline_s: float | None = None,
        lookup_timeout_s: float | None = None,
        integrity: bool = True,
        metrics: Metrics | None = None,
        bootstrap_timeout_s: float | None = None,
        close_timeout_s: float | None = None,
    ) -> None:
        """`deadline_s` (default: EPD_DEADLINE_S, else 60 s) bounds each room; `lookup_timeout_s`
        (default: EPD_LOOKUP_TIMEOUT_S, else 2 s) each bootstrap look-up; `close_timeout_s` (default:
        EPD_CLOSE_TIMEOUT_S, else 10 s) the whole close(), see there. `bootstrap_timeout_s` is
        the deprecated name of `lookup_timeout_s`. Raises ConfigError for a bad argument or variable,
        ConfigTypeError for an argument of the wrong type (a rank or size that is not an int, a
        port that is not an int, pair or string, an `integrity` that is not True or False, an `engine`
        that is not one).
        """
        engine_rank, tp_size, dp_size = check_parallel(engine_rank, tp_size, dp_size)
        lookup_timeout_s = config.renamed("SessionManager", "bootstrap_timeout_s", bootstrap_timeout_s,
                                          "lookup_timeout_s", lookup_timeout_s)
        deadline_s = config.resolve("EPD_DEADLINE_S", deadline_s)
        lookup_timeout_s = config.resolve("EPD_LOOKUP_TIMEOUT_S", lookup_timeout_s)
        close_timeout_s = config.resolve("EPD_CLOSE_TIMEOUT_S", close_timeout_s)
        integrity = config.check_flag("SessionManager", "integrity", integrity)
        parse_ports(status_port)  # a bad setting fails before any memory is registered
        config.check_engine("SessionManager", engine)
        if getattr(engine, "closed", False):
            # No write could land in its memory: every room would fail only at its deadline.
            raise EngineError(f"engine {engine.session_id} is closed: give the session manager an open engine")
        _await_dropped_manager(engine)
        with _managed_lock:
            _refuse_shared_engine(engine)
        self.engine = engine
        self.engine_rank = engine_rank
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.deadline_s = deadline_s
        self.lookup_timeout_s = lookup_timeout_s
        self.close_timeout_s = close_timeout_s
        self.integrity = integrity
        self.host = host or engine.hostname
        if not self.host.isascii():
            raise ConfigError(f"host {self.host!r} must be ASCII: it goes on the wire in every TransferInfo")
        self.host = _io.peer_address(self.host, "host")
        self.metrics = metrics or Metrics("epd_prefill")
        declare_role(self.metrics, "prefill", engine_rank)

        _check_memory(engine, buffer, pool)
        # Its close lets go of the metrics; a manager that never starts, at once.
        release_metrics = self.metrics.claim(f"the session manager of prefill rank {engine_rank}")
        self._release_metrics = release_metrics
        self._owned: list[int] = []
        self.pool = pool
        self.deepstack_buffer: _io.Region | None
        try:
            if pool is not None:
                # Slots hold embedding and deepstack rows alike: one region serves both.
                self.buffer = self.deepstack_buffer = pool.region
            elif buffer is not None:
                self.buffer = self._register(buffer)
                self.deepstack_buffer = self._register(deepstack_buffer) if deepstack_buffer is not None else None
            self._driver = PrefillDriver(
                engine_rank, tp_size, dp_size, host=self.host, status_port=status_port,
                session_id=engine.session_id, deadline_s=deadline_s, lookup_timeout_s=lookup_timeout_s,
                integrity=integrity, metrics=self.metrics, pool=pool, quarantine_s=self.quarantine_s,
            )
        except BaseException:
            self._unregister_owned()  # no manager is returned whose close() would
            release_metrics()
            raise
        # Every destination lies in one of these announced (embedding, deepstack) region
        # pairs; the first is the main buffer, the rest are added for per-item buffers.
        # A list once published here is never changed: each change, under _regions_lock, publishes a new one,
        # so a reader takes the attribute once, without the lock or a copy.
        self._region_sets: list[RegionSet] = [RegionSet(self.buffer, self.deepstack_buffer, leased=pool is not None)]
        self._regions_lock = threading.Lock()
        self._closed = False
        self._closing = threading.RLock()  # a second close() returns once the first is done
        self._closing_here = False  # a close() is under way (on the thread holding _closing)
        self.status_port = self._driver.status_port
        # Holds what closing needs, never the manager: a manager dropped without close() is closed by it.
        self._dropped = weakref.finalize(self, _close_dropped, self._driver, engine, (engine_rank, id(self)),
                                         self._owned, f"prefill rank {engine_rank} (status port {self.status_port})",
                                         release_metrics, close_timeout_s)
        self._dropped.atexit = False  # at exit the daemon threads go with the process
        rooms = self._driver.rooms
        # Through the claim: they leave the metrics with it, at close (a set that outlives the
        # manager neither reads its closed parts nor keeps its pool's memory).
        release_metrics.gauge_fn("rooms_in_flight", lambda: len(rooms))
        core = self._driver.core
        release_metrics.gauge_fn("cancels_set_aside", lambda: core.cancels_set_aside)
        if pool is not None:
            pool_gauges(release_metrics, pool)
        self._claim_engine()

    def _claim_engine(self) -> None:
        """Files the engine as this manager's; where another thread's manager claimed it since __init__
        looked, closes this manager and raises that ConfigError (see `_refuse_shared_engine`)."""
        refused: ConfigError | None = None
        with _managed_lock:
            try:
                _refuse_shared_engine(self.engine)
            except ConfigError as exc:
                refused = exc
            else:
                _managed_engines[self.engine] = (self.engine_rank, id(self))
        if refused is not None:
            self.close()  # outside the lock, which closing takes
            raise refused

    @property
    def bootstrap_timeout_s(self) -> float:
        """Deprecated name of `lookup_timeout_s`."""
        warnings.warn("SessionManager.bootstrap_timeout_s is deprecated: use lookup_timeout_s", DeprecationWarning,
                      stacklevel=2)
        return self.lookup_timeout_s

    # ----------------------------------------------------------- caller side

    def receive(
        self,
        room: int,
        bootstrap_addr: str,
        dst: torch.Tensor | int | None = None,
        rows: int | None = None,
        hidden: int | None = None,
        dtype: torch.dtype | str | None = None,
        row_start: int = 0,
        span: int | None = None,
        deepstack_dst: torch.Tensor | tuple[int, int] | None = None,
        deepstack_hidden: int | None = None,
    ) -> ReceiveHandle:
        """Asks the encode rank behind `bootstrap_addr` for this rank's rows of `room`.

        `dst` is a tensor `[rows, hidden]` (geometry taken from it) or a raw address with
        `rows`, `hidden` and `dtype` (ints, or numpy or torch integer scalars, as the sizes may
        be); it must lie inside the registered `buffer`. `span` is
        the item's full row count (default: `rows`, an identity receive). Never blocks.

        With a `pool` and no `dst`, the manager leases a slot for the item's full span
        (`rows`, `hidden`, `dtype` and, with deepstack, `deepstack_hidden` given) and
        this rank's shard lands in its rows `[row_start, row_start + rows)`. `dtype` is a
        `torch.dtype`, `"bfloat16"` or `"torch.bfloat16"`.

        A `deepstack_dst` given with `dst` holds exactly `rows` deepstack rows: with
        `deepstack_hidden`, `rows * deepstack_hidden` elements of `dtype`; without it, its
        bytes are a whole number of rows of whole elements. Its row bytes go with the ask,
        and an encode rank of ours refuses the room (nothing written) when its item's
        deepstack rows are another width.

        UsageError, nothing filed, when a thread of the manager stays stuck holding its lock
        (held only for non-blocking steps) for transfer._io.LOCK_WAIT_S; the text names it.
        """
        if self._closed:
            raise UsageError(MANAGER_CLOSED)
        # In a forked child, before a pool slot is leased: a lock held at the fork stays held there.
        self._driver.check_process()
        room = check_room(room)
        dst, rows, hidden, row_start, span, deepstack_hidden = scalar_ints(dst, rows, hidden, row_start, span,
                                                                          deepstack_hidden)
        dtype_name = normalize_dtype(dtype) if dtype is not None else None
        if dst is None:
            if deepstack_dst is not None:
                raise ConfigError(f"room {room}: deepstack_dst given with no dst: a pooled receive leases its "
                                  f"deepstack rows with the item's (give deepstack_hidden), a receive into "
                                  f"deepstack_dst needs dst too")
            # Before a slot is leased, so a room number in flight takes none (nor a fallback buffer); the
            # core refuses it again, under the driver's lock, when it files the room.
            self._driver.core.refuse_held(room)
            lease, full, full_ds, ptr, deepstack_dst = self._lease(room, rows, hidden, dtype_name, row_start, span,
                                                                   deepstack_hidden)
            # The slot's shard as a pointer: its geometry is the one just checked and leased for.
            return self._receive(room, bootstrap_addr, ptr, rows=rows, hidden=hidden, dtype=dtype_name,
                                 row_start=row_start, span=span, deepstack_dst=deepstack_dst,
                                 deepstack_hidden=deepstack_hidden, lease=lease, full=full, full_ds=full_ds)
        if deepstack_hidden and deepstack_dst is None:
            raise ConfigError(f"room {room}: deepstack_hidden given with dst but no deepstack_dst to receive into")
        return self._receive(room, bootstrap_addr, dst, rows=rows, hidden=hidden, dtype=dtype_name,
                             row_start=row_start, span=span, deepstack_dst=deepstack_dst,
                             deepstack_hidden=deepstack_hidden)

    def _receive(self, room: int, bootstrap_addr: str, dst: torch.Tensor | int, *, rows: int | None = None,
                 hidden: int | None = None, dtype: str | None = None, row_start: int, span: int | None,
                 deepstack_dst: torch.Tensor | tuple[int, int] | None, deepstack_hidden: int | None,
                 lease: Slot | None = None, full: torch.Tensor | None = None,
                 full_ds: torch.Tensor | None = None) -> ReceiveHandle:
        """receive() once the destination is known; a lease is given back if it raises."""
        record = None
        try:
            record, spec = self._room(room, bootstrap_addr, dst, rows=rows, hidden=hidden, dtype=dtype,
                                      row_start=row_start, span=span, deepstack_dst=deepstack_dst,
                                      deepstack_hidden=deepstack_hidden, lease=lease)
            self._driver.receive(record, spec)
            return ReceiveHandle(self, record, full, full_ds, (row_start, spec.rows))
        except BaseException:
            if record is not None and self._driver.rooms.get(room) is record:
                # Filed and kept (what raised came later): cleared as clear() would, its slot to its fate.
                self._forget(record)
            elif lease is not None:
                # Once the driver filed the room (its token), its ask may have left and a write may
                # still land in the slot. The driver forgot the room: no confirmation is heard for it.
                never_asked = record is None or not record.token
                self._give_back(lease, fate_of(succeeded=False, memory_safe=never_asked, confirmable=False))
            raise

    def _room(self, room: int, bootstrap_addr: str, dst: torch.Tensor | int, *, rows: int | None,
              hidden: int | None, dtype: str | None, row_start: int, span: int | None,
              deepstack_dst: torch.Tensor | tuple[int, int] | None, deepstack_hidden: int | None,
              lease: Slot | None) -> tuple[Room, RoomSpec]:
        """The room's record and spec, its destinations checked."""
        if lease is not None and type(dst) is int and rows is not None and hidden is not None and dtype is not None:
            ptr = dst  # a leased shard's address and geometry, as _destination() returns them, without its calls
        else:
            ptr, rows, hidden, dtype = _destination(dst, rows, hidden, dtype)
        span = rows if span is None else span
        if lease is None:  # a leased slot's was checked before it was leased
            _check_geometry(room, rows, hidden, span, row_start)
        # A malformed address is the caller's error, not a room failed later.
        if type(bootstrap_addr) is str:
            checked_address(bootstrap_addr)
        else:
            split_address(bootstrap_addr)  # names what it got, or takes a str subclass as it is
        row_bytes = hidden * DTYPE_BYTES[dtype]  # dtype_size() of a name normalize_dtype() gave, with no call
        ds_ptr, ds_nbytes, ds_row_bytes = 0, 0, None
        if deepstack_dst is not None:
            ds = _io.as_region(deepstack_dst)
            ds_ptr, ds_nbytes = ds.addr, ds.nbytes
            ds_row_bytes = _deepstack_row_bytes(room, deepstack_dst, ds_nbytes, rows, dtype, deepstack_hidden)
        sets = self._region_sets  # never changed once published (see __init__)
        main, nbytes = sets[0], rows * row_bytes
        emb = main.embedding
        if lease is not None and not lease.is_fallback:
            # A pool slot lies in the pool's region, the main set's, which stays first: where _regions_for() finds it.
            regions = main
        elif (lease is None and deepstack_dst is None and len(sets) == 1 and not main.leased
              and emb.addr <= ptr and ptr + nbytes <= emb.addr + emb.nbytes):
            # Rows inside the main buffer, no other set and no pool memory to keep out of: what _regions_for()
            # finds first, without its calls.
            regions = main
        else:
            regions = self._regions_for(room, ptr, nbytes, ds_ptr, ds_nbytes, deepstack_dst is not None,
                                        leased=lease is not None)
        spec = RoomSpec(room, bootstrap_addr, ptr, rows, hidden, dtype, row_bytes, row_start, span, regions,
                        ds_ptr, ds_nbytes, deepstack_dst is not None, ds_row_bytes)
        # Room(room, started_at, nbytes, lease), by position: keywords cost a match each.
        record = Room(room, self._driver.clock(), rows * row_bytes + ds_nbytes, lease)
        return record, spec

    def _lease(self, room: int, rows: int | None, hidden: int | None, dtype: str | None, row_start: int,
               span: int | None, deepstack_hidden: int | None,
               ) -> tuple[Slot, torch.Tensor, torch.Tensor | None, int, torch.Tensor | None]:
        """Leases a pool slot for the item's full span; returns the lease, its rows and deepstack views, and
        this rank's shard of each (of the rows, its address)."""
        pool = self.pool
        if pool is None:
            raise ConfigError(f"room {room}: no dst given and the manager has no pool")
        if rows is None or hidden is None or dtype is None:
            raise ConfigError(f"room {room}: a pooled receive needs rows, hidden and dtype")
        span = rows if span is None else span
        _check_geometry(room, rows, hidden, span, row_start, deepstack_hidden or 0)
        if dtype in _torch_dtypes:  # torch is imported by then: the first pooled receive() of the dtype did
            torch_dtype = _torch_dtypes[dtype]
        else:
            import torch

            torch_dtype = _torch_dtypes[dtype] = getattr(torch, dtype.removeprefix("torch."))
        size = DTYPE_BYTES[dtype]  # dtype_size() of a name normalize_dtype() gave, with no call
        nbytes, ds_nbytes = span * hidden * size, span * (deepstack_hidden or 0) * size
        full: torch.Tensor | None = None
        try:
            if deepstack_hidden:
                lease = pool.lease_or_fallback(nbytes + ds_nbytes)
            else:  # the slot's rows, cut by the pool where it keeps rows of this geometry (else viewed below)
                lease, full = pool.lease_rows(nbytes, span, hidden, torch_dtype)
        except SlotError:
            if self._closed:  # close() came after receive() looked, and the pool's close after it
                raise UsageError(MANAGER_CLOSED) from None
            raise
        except FallbackLimitError as exc:
            uncleared = sum(1 for record in list(self._driver.rooms.values())
                            if record.lease is not None and record.concluded_at is not None)
            if uncleared:
                raise FallbackLimitError(f"{exc}; {uncleared} of the leases belong to rooms that concluded and were "
                                         f"never cleared: call clear() on their handles") from None
            raise
        try:
            if deepstack_hidden:
                import torch

                flat = lease.view((nbytes + ds_nbytes,), torch.uint8)
                full = flat[:nbytes].view(torch_dtype).view(span, hidden)
                full_ds = flat[nbytes:].view(torch_dtype).view(span, deepstack_hidden)
            else:  # the same rows as the slot's first nbytes viewed as bytes, then as the dtype, then shaped
                if full is None:
                    full = lease.view((span, hidden), torch_dtype)
                full_ds = None
            if lease.is_fallback:
                with self._regions_lock:
                    self._region_sets = [*self._region_sets, RegionSet(lease.region, lease.region, leased=True)]
        except BaseException:  # nothing was asked for it: its memory is safe
            self._give_back(lease, fate_of(succeeded=False, memory_safe=True, confirmable=False))
            raise
        # The rows view the lease's first bytes (Slot.view()), at its address: a shard's begin row_start rows in.
        # An empty one's pointer is torch's for an empty tensor.
        ptr = lease.addr + row_start * hidden * size if rows else full[row_start:row_start].data_ptr()
        return lease, full, full_ds, ptr, full_ds[row_start:row_start + rows] if full_ds is not None else None

    def _give_back(self, lease: Slot, fate: Fate, event: EventLike | None = None) -> None:
        """Gives a lease to its fate (see `_settle`). A fallback's region record goes first: once
        released, the buffer may serve another room at once."""
        if lease.is_fallback:
            with self._regions_lock:
                self._region_sets = [r for r in self._region_sets if r.embedding is not lease.region]
        _settle(lease, fate, event)

    def add_region(self, embedding: torch.Tensor | tuple[int, int] | _io.Region,
                   deepstack: torch.Tensor | tuple[int, int] | _io.Region | None = None) -> RegionSet:
        """Adds registered memory outside the main buffer as a destination (e.g. a per-item buffer).

        The region is announced to each encode rank, before the first room that lands in it,
        with a registration of its own (our extension, docs/protocol.md section 8; a peer that does not
        read it writes wherever the TransferInfo points).
        """
        if self._closed:
            raise UsageError(MANAGER_CLOSED)
        regions = RegionSet(self._receive_region(embedding),
                            self._receive_region(deepstack) if deepstack is not None else None)
        with self._regions_lock:
            self._region_sets = [*self._region_sets, regions]
        return regions

    def remove_region(self, regions: RegionSet) -> None:
        """Stops accepting destinations in a region added with add_region()."""
        with self._regions_lock:
            if regions in self._region_sets[1:]:
                sets = list(self._region_sets)
                sets.remove(regions)
                self._region_sets = sets

    def _regions_for(self, room: int, ptr: int, nbytes: int, ds_ptr: int, ds_nbytes: int, has_ds: bool,
                     leased: bool = False) -> RegionSet:
        """The announced region pair that holds the destination, or a ConfigError naming it. A destination
        not `leased` from the pool must not touch the pool's memory, which the pool leases to other rooms."""
        sets = self._region_sets  # never changed once published (see __init__)
        if not leased:
            for regions in sets:
                pool_memory = regions.embedding
                if regions.leased and (pool_memory.overlaps(ptr, nbytes) or
                                       (has_ds and pool_memory.overlaps(ds_ptr, ds_nbytes))):
                    raise ConfigError(
                        f"room {room}: destination [{ptr:#x}, +{nbytes}) lies in the receive pool's memory "
                        f"[{pool_memory.addr:#x}, +{pool_memory.nbytes}), which the pool leases to one room at a "
                        f"time: give rows, hidden and dtype without dst and the manager leases a slot")
        for regions in sets:
            if not regions.embedding.contains(ptr, nbytes):
                continue
            if has_ds and (regions.deepstack is None or not regions.deepstack.contains(ds_ptr, ds_nbytes)):
                continue
            return regions
        if has_ds and all(regions.deepstack is None for regions in sets):
            raise ConfigError(f"room {room}: a deepstack destination was given, but this session manager has no "
                              f"deepstack receive buffer: pass deepstack_buffer= or add_region(embedding, deepstack)")
        ds = f" and deepstack [{ds_ptr:#x}, +{ds_nbytes})" if has_ds else ""
        raise ConfigError(
            f"room {room}: destination [{ptr:#x}, +{nbytes}){ds} is outside every registered receive "
            f"buffer (main buffer [{self.buffer.addr:#x}, +{self.buffer.nbytes}))"
        )

    def concluded(self) -> list[int]:
        """Rooms that reached Success or Failed since the last call, oldest first, each once (a room
        told Failed after its Success, another receiver of it having failed, comes again as Failed).

        Never blocks. For scheduler loops with many rooms outstanding: look at these
        rooms' handles instead of polling every handle each step. A room cleared before
        it was handed out is left out.
        """
        self._driver.progress()
        return self._driver.table.take_concluded()

    def stats(self) -> list[dict]:
        """Every metric sample as a flat row {name, type, labels, value} (see transfer.metrics.Metrics.snapshot)."""
        return self.metrics.snapshot()

    def close(self) -> None:
        """Fails rooms still in flight, stops the I/O thread, closes sockets, unregisters owned memory;
        returns within `close_timeout_s`.

        Its rooms are given up as clear() gives them up: each encode rank asked for one not
        yet known safe is sent its cancel, which its socket gets a moment to send after it
        is closed (close() waits for no answer). Every pool slot its rooms still lease goes
        back as clear() gives it: freed when no write can land in it any more (see
        ReceiveHandle.safe_to_reuse), quarantined otherwise; a handle's `rows` are the
        pool's again once this returned. What is still busy at `close_timeout_s` is left to
        end alone, and one error line names it: bootstrap look-ups still waiting for their
        server (each ends at `lookup_timeout_s`, delivering nothing), an I/O thread stuck
        inside a step (its rooms fail here; if it ever returns, it asks for none of them and
        closes its sockets). In a process forked from the one that made the manager, it only
        marks the manager closed: what it would close is the parent's. A close that raised before
        its end (a stop signal's exception, KeyboardInterrupt, while it waited) is finished by a
        close() again, or by the manager's collection.
        """
        close_by = time.monotonic() + self.close_timeout_s
        with self._closing:
            # Closed, or a close under way on this very thread (a signal's handler called this inside it).
            if self._closed and (not self._dropped.alive or self._closing_here):
                return
            self._closed = True
            if self._driver.forked:  # its thread, sockets and registrations are the parent's, not this child's
                self._dropped.detach()
                return
            self._closing_here = True
            try:
                _close(self._driver, self.engine, (self.engine_rank, id(self)), self._owned,
                       self._release_metrics, close_by)
            finally:
                self._closing_here = False
            self._dropped.detach()  # only once closed: one dropped after a close that raised still closes
            # Its rooms' fallbacks are the pool's again: a closed manager keeps no record of them, so their
            # memory goes when the pool lets go of them, not with this manager.
            with self._regions_lock:
                main = self._region_sets[0]
                self._region_sets = [main, *(r for r in self._region_sets[1:] if not r.leased)]

    def _unregister_owned(self) -> None:
        """Unregisters the memory this manager registered."""
        _unregister(self.engine, self._owned)

    def __enter__(self) -> SessionManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- internals

    def _register(self, buf: torch.Tensor | tuple[int, int]) -> _io.Region:
        """Registers `buf` with the engine unless it already lies in registered memory."""
        region = self._receive_region(buf)
        for addr, nbytes in self.engine.registered().items():
            if addr <= region.addr and region.end <= addr + nbytes:
                return region
        self.engine.register(region.tensor if region.tensor is not None else region.addr, region.nbytes)
        self._owned.append(region.addr)
        return region

    def _receive_region(self, buf: torch.Tensor | tuple[int, int] | _io.Region) -> _io.Region:
        """The region of receive memory; ConfigError for memory given by address that this process could not
        read the checksums of, or could not read at all (`_io.raw_memory_problem`)."""
        region = _io.as_region(buf)
        if region.tensor is None and region.nbytes:
            cuda = _io.cuda_present()
            problem = _io.raw_memory_problem(lambda: _io.host_readable(region.addr, region.nbytes), cuda=cuda,
                                             integrity=self.integrity)
            if problem is not None:
                remedy = ("pass the tensor (its device says where to read it), or use integrity=False" if cuda
                          else "pass the tensor, or the address of memory this process holds")
                raise ConfigError(f"receive buffer [{region.addr:#x}, +{region.nbytes}) {problem}: {remedy}")
        return region

    @property
    def quarantine_s(self) -> float:
        """How long after a failed room a late write may still land in its memory: in a pool's slot, or
        without a pool in the least memory (`quarantine_of()` says it for a room's own bytes)."""
        return self.quarantine_of(0)

    def quarantine_of(self, nbytes: int) -> float:
        """How long after a failed room of `nbytes` a late write may still land in its memory."""
        if self.pool is not None:
            return self.pool.quarantine_of(nbytes)
        from transfer.buffers import default_quarantine_s

        return default_quarantine_s(self.engine, nbytes)

    def _forget(self, record: Room, event: EventLike | None = None) -> None:
        """Drops the room and gives its pool slot, if any, to its fate (transfer.core.quarantine): freed
        (after `event`), or quarantined until the encode rank confirms the room's cancel."""
        error: BaseException | None = None
        try:
            succeeded = self._driver.clear(record)
        except BaseException as exc:
            if self._driver.forked or self._driver.rooms.get(record.room) is record:
                raise  # nothing forgotten: a clear() again forgets it
            succeeded, error = record.succeeded, exc  # forgotten before the error: the slot still goes to its fate
        if succeeded is None:  # cleared already
            return
        # A room's lease is only ever taken from it: one read None stays None, with no slot to take under the lock.
        lease = None if record.lease is None else _take_lease(record)
        if lease is not None:
            if succeeded and event is None and not lease.is_fallback:
                # fate_of() frees a room that succeeded, without a copy-out, at once (Fate.FREE): released without its call.
                lease.release(None)
            else:
                # Read after clear(): a confirmation heard meanwhile makes the memory safe already.
                fate = fate_of(succeeded=succeeded, memory_safe=record.memory_safe, confirmable=True,
                               copy_out=event is not None)
                if fate is Fate.FREE and not lease.is_fallback:
                    lease.release(None)  # _give_back() of a slot free at once, without its call and _settle()'s
                else:
                    self._give_back(lease, fate, event)
                if fate is Fate.QUARANTINE_UNTIL_CONFIRMED:
                    self._driver.when_safe(record, lease.end_quarantine)
        if error is not None:
            raise error


def _close(driver: PrefillDriver, engine: TransferEngineLike, claim: tuple[int, int], owned: list[int],
           release_metrics: Callable[[], None] | None = None, close_by: float = math.inf) -> None:
    """Closes a session manager's parts: the driver (by `close_by`, time.monotonic()), the memory it
    registered, then its claim on the engine (a new manager there finds no memory of this one still
    registered); lets go of its metrics. A close that raised before it unregistered that memory (a stop
    signal's exception) keeps the claim: the memory is the next close's to unregister, and a manager made
    there meanwhile would lose what it registered of it then."""
    if release_metrics is not None:
        release_metrics()
    try:
        driver.close(close_by=close_by)
        for record in list(driver.rooms.values()):
            lease = _take_lease(record)
            if lease is not None:  # the driver closed: no confirmation is heard any more
                _settle(lease, fate_of(succeeded=record.succeeded, memory_safe=record.memory_safe, confirmable=False))
        _unregister(engine, owned)
    finally:
        if not owned:
            with _managed_lock:
                if _managed_engines.get(engine) == claim:
                    del _managed_engines[engine]


def _take_lease(record: Room) -> Slot | None:
    """The room's pool slot, taken from it once (clear() and close() may race for it), or None."""
    with _leases_lock:
        lease, record.lease = record.lease, None
    return lease


def _settle(lease: Slot, fate: Fate, event: EventLike | None = None) -> None:
    """Carries out a slot's fate: quarantines it, or frees it (after `event` for FREE_AFTER_COPY)."""
    if fate is Fate.FREE:  # the common fate, told without the quarantined property's call
        lease.release(None)
    elif fate.quarantined:
        lease.fail()
    else:
        lease.release(event if fate is Fate.FREE_AFTER_COPY else None)


def _close_dropped(driver: PrefillDriver, engine: TransferEngineLike, claim: tuple[int, int], owned: list[int],
                   name: str, release_metrics: Callable[[], None] | None = None,
                   close_timeout_s: float = math.inf) -> None:
    """A SessionManager was dropped without close(): says so, and closes it on a thread of its own
    (the collection may run on any thread, the I/O thread too, which closing joins). A forked child's
    copy is the parent's manager: nothing of it is this process's to close."""
    if driver.forked:
        return
    warnings.warn(f"session manager of {name} was dropped without close(): closing it", ResourceWarning)
    closed = threading.Event()
    with _managed_lock:
        _closing_engines[engine] = closed

    def close() -> None:
        try:
            _close(driver, engine, claim, owned, release_metrics, time.monotonic() + close_timeout_s)
        finally:
            with _managed_lock:
                if _closing_engines.get(engine) is closed:
                    del _closing_engines[engine]
            closed.set()

    threading.Thread(target=close, name=f"epd-prefill-{claim[0]}-close", daemon=True).start()


def _unregister(engine: TransferEngineLike, owned: list[int]) -> None:
    """Unregisters the memory a manager registered (`owned`, emptied as it goes: a close interrupted on
    the way leaves the rest to the next)."""
    while owned:
        try:
            engine.unregister(owned[0])
        except Exception as exc:  # noqa: BLE001 - closing must go on
            log.warning("unregistering %#x failed: %s", owned[0], exc)
        del owned[0]


@dataclass(frozen=True, eq=False)
class RegionSet:
    """An announced pair of receive regions: embedding rows and (optionally) deepstack rows."""

    embedding: _io.Region
    deepstack: _io.Region | None = None
    #: The pool's memory (its slots, or a fallback buffer): only a pooled receive() writes there.
    leased: bool = False



def _check_geometry(room: int, rows: int, hidden: int, span: int, row_start: int, deepstack_hidden: int = 0) -> None:
    """ConfigError unless every size is a non-negative integer (hidden a positive one) and the shard
    lies inside the item's span."""
    if not (type(rows) is int and type(hidden) is int and type(span) is int and type(row_start) is int
            and type(deepstack_hidden) is int and rows >= 0 and hidden >= 1 and span >= 0 and row_start >= 0
            and deepstack_hidden >= 0):  # else the first size that is not one, named
        for name, value, least in (("rows", rows, 0), ("hidden", hidden, 1), ("span", span, 0),
                                   ("row_start", row_start, 0), ("deepstack_hidden", deepstack_hidden, 0)):
            problem = size_problem(name, value, least)
            if problem:
                raise ConfigError(f"room {room}: {problem}")
    if row_start + rows > span:
        raise ConfigError(f"room {room}: shard [{row_start}, {row_start + rows}) outside the item's span {span}")


def _deepstack_row_bytes(room: int, deepstack_dst: Any, nbytes: int, rows: int, dtype: str,
                         deepstack_hidden: int | None) -> int | None:
    """The bytes of one row of a deepstack destination of `nbytes` bytes that holds `rows` rows; ConfigError
    unless it holds exactly that. None only for an empty shard whose width nothing tells (no
    `deepstack_hidden`, not a 2-D tensor): nothing is written there."""
    size = dtype_size(dtype)
    problem = None if deepstack_hidden is None else size_problem("deepstack_hidden", deepstack_hidden, 1)
    if problem:
        raise ConfigError(f"room {room}: {problem}")
    _check_deepstack_tensor(room, deepstack_dst, rows, dtype, deepstack_hidden)
    if deepstack_hidden is not None:
        row_bytes = deepstack_hidden * size
        if nbytes != rows * row_bytes:
            raise ConfigError(f"room {room}: deepstack destination of {nbytes} bytes does not hold {rows} rows of "
                              f"deepstack_hidden {deepstack_hidden} x {dtype} ({rows * row_bytes} bytes)")
        return row_bytes
    if rows == 0:
        shape = getattr(deepstack_dst, "shape", None)
        if shape is not None and len(shape) == 2:
            return int(shape[1]) * int(deepstack_dst.element_size())
        return None
    row_bytes, odd = divmod(nbytes, rows)
    if odd or row_bytes % size or not row_bytes:
        raise ConfigError(f"room {room}: deepstack destination of {nbytes} bytes is not {rows} rows of whole "
                          f"{dtype} elements (give deepstack_hidden to say its width)")
    return row_bytes


def _check_deepstack_tensor(room: int, deepstack_dst: Any, rows: int, dtype: str,
                            deepstack_hidden: int | None) -> None:
    """ConfigError for a deepstack destination tensor that is not `rows` rows of the item's `dtype` (deepstack
    rows share the item's element type, which the wire does not carry for them)."""
    t_dtype = getattr(deepstack_dst, "dtype", None)
    if t_dtype is None:
        return  # an (address, bytes) pair: its bytes are all there is to check
    if normalize_dtype(t_dtype) != dtype:
        raise ConfigError(f"room {room}: deepstack destination dtype {normalize_dtype(t_dtype)} != item dtype {dtype} "
                          f"(deepstack rows are of the item's dtype)")
    if deepstack_dst.dim() == 2:
        t_rows, t_hidden = (int(n) for n in deepstack_dst.shape)
        if t_rows != rows or (deepstack_hidden is not None and t_hidden != deepstack_hidden):
            hidden = "" if deepstack_hidden is None else f" of deepstack_hidden {deepstack_hidden}"
            raise ConfigError(f"room {room}: deepstack destination of shape {tuple(deepstack_dst.shape)} is not "
                              f"{rows} rows{hidden}")


def _destination(dst: torch.Tensor | int, rows: int | None, hidden: int | None,
                 dtype: str | None) -> tuple[int, int, int, str]:
    """(pointer, rows, hidden, dtype) of a destination tensor or raw pointer."""
    tensor: Any = dst  # a tensor, unless it is an int (returned before it is read as one)
    if (type(tensor) is frames.torch_tensor and tensor.ndim == 2 and tensor.is_contiguous() and not tensor.is_neg()
            and not tensor.is_conj()):
        t_rows, t_hidden = tensor.shape  # a plain contiguous 2-D tensor, with fewer calls: what the checks below find
    else:
        if isinstance(dst, int):
            if rows is None or hidden is None or dtype is None:
                raise ConfigError("a raw destination pointer needs rows, hidden and dtype")
            return dst, rows, hidden, dtype
        if not hasattr(dst, "data_ptr"):
            raise ConfigTypeError(f"dst must be a torch tensor or a pointer, got {type(dst).__name__}")
        if not dst.is_contiguous():
            raise ConfigError(f"destination of shape {tuple(dst.shape)} is not contiguous")
        _io.refuse_lazy_view(dst)
        if dst.dim() == 2:
            t_rows, t_hidden = dst.shape
        elif hidden:
            if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1 or dst.numel() % hidden:
                raise ConfigError(f"a destination of {dst.numel()} elements is no whole number of rows of hidden "
                                  f"{hidden!r}")
            t_rows, t_hidden = dst.numel() // hidden, hidden
        else:
            raise ConfigError("a destination that is not 2-D needs `hidden`")
    t_dtype = normalize_dtype(tensor.dtype)
    for name, given, actual in (("rows", rows, t_rows), ("hidden", hidden, t_hidden), ("dtype", dtype, t_dtype)):
        if given is not None and given != actual:
            raise ConfigError(f"{name} {given} disagrees with the destination tensor's {actual}")
    return tensor.data_ptr(), int(t_rows), int(t_hidden), t_dtype

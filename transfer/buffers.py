"""Receive slots registered once for the engine's lifetime.

Registering memory per request is slow, and re-registering a recycled address
while a sender still caches the old registration breaks RDMA connections. A
ReceivePool allocates one region (host or CUDA), registers it once, and cuts it
into fixed-size slots that are leased per item and returned when the rows were
copied out:

- `release(event)` with a CUDA event (anything with `.query() -> bool`) frees the
  slot only once the event completed; events are checked lazily by `lease()` and
  `poll()`, never waited on.
- `fail()` (the room failed) quarantines the slot for `quarantine_s`, as long as an
  encode rank may still serve the room's ask (QUARANTINE_S), because a late one-sided
  write may still land in it; `end_quarantine()` ends that early once the encode rank
  confirmed that nothing more will be written (its cancel, docs/protocol.md 8), after the
  pool's close() too, where it lets the memory held back for that room go with the pool.
- an item too big for a slot, or an exhausted pool, gets a fallback buffer: the smallest
  idle one in its grace that holds it (registered already), else one registered for it;
  a fallback is deregistered once it has been idle for `grace_s`.
  The bytes fallbacks hold at once (live, awaiting events, in grace or quarantined)
  are capped by `max_fallback_bytes`; past it `lease_or_fallback()` raises
  FallbackLimitError, leaving nothing allocated or registered.

Every state change goes through one lock, so release() may come from another
thread than lease(). The engine's register() and unregister() run outside it (a new
fallback's bytes are reserved under it first, and counted live or given back after), so
no release, lease or end_quarantine() waits on a registration. Time comes from an
injectable `clock` (tests fake it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypedDict, TypeVar

import torch

from transfer import config
from transfer._forks import free_in_child
from transfer._io import Region
from transfer.errors import ConfigError, ConfigTypeError, FallbackLimitError, SlotError
from transfer.interfaces import EventLike, TransferEngineLike

log = logging.getLogger(__name__)

__all__ = ["FALLBACK_FLOOR_BYTES", "SLOT_ALIGN", "FallbackLimitError", "PoolStats", "ReceivePool", "Slot", "SlotError"]

#: Slot sizes are multiples of this, so a view of any dtype starts aligned.
SLOT_ALIGN = 16

#: Default quarantine of a failed room's slot: until no late write of the room can land.
#: An encode rank keeps an ask whose item has not come for its fanout timeout (120 s by
#: default) and serves it when the item comes, however long ago the prefill rank gave the
#: room up; that item's write may then wait another fanout timeout (counted from send())
#: for its ready event, and the write itself lasts up to Mooncake's transfer timeout (30 s
#: by default). 10 s spare on top; encode ranks with a fanout timeout T need a pool with
#: quarantine_s >= 2 T + the transfer timeout. Our own encode ranks start no write later than
#: T after the room's first ask, so T + the transfer timeout would do against them; the
#: default stays sized for encode ranks that bound a ready event's wait from send() only.
QUARANTINE_S: float = config.setting("EPD_QUARANTINE_S").default

#: QUARANTINE_S less Mooncake's transfer timeout: how long after a room was given up a late write of it
#: may still start (two fanout timeouts, 10 s spare).
LATE_START_S: float = QUARANTINE_S - 30.0


def default_quarantine_s(engine: TransferEngineLike, nbytes: int) -> float:
    """The quarantine `nbytes` of `engine`'s memory need when none is set: QUARANTINE_S, or longer when the
    engine bounds how long a write into its memory may go on landing once it started
    (`engine.late_write_s(nbytes)`, the wire path's listener) and that bound is longer than Mooncake's
    transfer timeout."""
    late_write_s = getattr(engine, "late_write_s", None)
    if late_write_s is None:
        return QUARANTINE_S
    return max(QUARANTINE_S, LATE_START_S + float(late_write_s(nbytes)))

#: The default cap on fallback bytes is the pool's own size, but at least this. The pool is
#: what the operator sized for the rank's load, so fallbacks (outliers and bursts) at most
#: double the registered memory that was planned for; the floor lets a pool sized for typical
#: items still take a few outliers (32k rows of hidden 4096 in bf16 are 256 MiB). Without a
#: cap, a burst of failing rooms with big items, each kept QUARANTINE_S, could hold any amount.
FALLBACK_FLOOR_BYTES = 1 << 30

# max_fallback_bytes' default: computed from the pool's size (None means unbounded).
_AUTO: Any = object()

# Slot handle states.
_LEASED = "leased"
_RELEASED = "released"
_FAILED = "failed"


def _query(event: EventLike) -> bool | None:
    """event.query(), or None when the query itself failed (the copy's fate is unknown)."""
    try:
        return bool(event.query())
    except Exception as exc:  # e.g. a sticky CUDA error: quarantine rather than reuse or leak
        log.warning("querying copy-out event %r failed (%s); quarantining its buffer", event, exc)
        return None


class PoolStats(TypedDict):
    """ReceivePool.stats(): slot counts, and the fallback buffers' counts, bytes and cap."""

    slots: int
    free: int
    leased: int
    pending_events: int
    quarantined: int
    fallbacks_live: int  # buffers registered: in use, awaiting an event, quarantined or idle in their grace
    fallbacks_total: int  # items that fell back (to a buffer registered for them, or an idle one taken again)
    fallback_bytes: int
    max_fallback_bytes: int | None


# Memory of closed pools that a failed room's late write may still land in, or a copy-out still read:
# (clock, deadline, region, the copy-out's event or None, the quarantines it waits for or None). Unregistered,
# but kept allocated until its quarantine ends (its bound passed, or end_quarantine() ended every quarantine it
# waits for) or its copy-out completed, so no new pool or fallback registered with the engine (nor any other
# allocation) gets its address meanwhile: a late write would land in memory leased to a new room, a copy-out
# would read another tensor's bytes.
_Held = tuple[Callable[[], float], float, Region, EventLike | None, set[int] | None]
_held: list[_Held] = []
_held_lock = free_in_child(threading.Lock())
#: Quarantine and grace entry numbers, unique over every pool: a closed pool's hold names the quarantines it waits for.
_entry_numbers = itertools.count()



def _hold(clock: Callable[[], float], deadline: float, region: Region, event: EventLike | None = None,
          quarantines: set[int] | None = None) -> None:
    """Keeps `region` allocated until `clock()` reaches `deadline`, or `event` (a copy-out's) completed, or every
    quarantine numbered in `quarantines` ended early (_end_held)."""
    with _held_lock:
        _held.append((clock, deadline, region, event, quarantines))


def _end_held(seq: int) -> None:
    """A closed pool's quarantine `seq` ended early: memory held only for quarantines that all ended goes."""
    gone: list[_Held] = []
    with _held_lock:
        kept: list[_Held] = []
        for entry in _held:
            quarantines = entry[4]
            if quarantines is not None and seq in quarantines:
                quarantines.discard(seq)
                if not quarantines:
                    gone.append(entry)
                    continue
            kept.append(entry)
        _held[:] = kept
    gone.clear()  # the memory goes here, outside the lock


def _copied(event: EventLike | None) -> bool:
    """Whether a copy-out's event completed (False when none is given, or its query fails)."""
    if event is None:
        return False
    try:
        return bool(event.query())
    except Exception:  # noqa: BLE001 - a copy whose fate is unknown keeps its memory until the deadline
        return False


def _let_go_of_held() -> None:
    """Frees the memory of closed pools whose quarantine ended or whose copy-out completed."""
    if not _held:  # the usual case, read without the lock: every lease() polls
        return
    gone: list[_Held] = []
    with _held_lock:
        kept: list[_Held] = []
        for entry in _held:
            (gone if entry[0]() >= entry[1] or _copied(entry[3]) else kept).append(entry)
        _held[:] = kept
    gone.clear()  # the memory goes here, outside the lock


# A quarantine entry (deadline, seq, slot number) or a grace entry (deadline, seq, region, quarantined).
_Entry = TypeVar("_Entry", tuple[float, int, int], tuple[float, int, Region, bool])


def _remove_entry(heap: list[_Entry], seq: int) -> bool:
    """Removes the heap's entry numbered `seq`; whether there was one."""
    for i, entry in enumerate(heap):
        if entry[1] == seq:
            heap[i] = heap[-1]
            heap.pop()
            heapq.heapify(heap)
            return True
    return False


class Slot:
    """One lease: a slot of the pool (or a fallback buffer) until release() or fail()."""

    __slots__ = ("_offset", "_pool", "_quarantine_seq", "_state", "addr", "index", "is_fallback", "nbytes",
                 "region")

    def __init__(self, pool: ReceivePool, region: Region, offset: int, nbytes: int,
                 index: int, is_fallback: bool) -> None:
        self.addr = region.addr + offset
        self.nbytes = nbytes
        self.region = region
        self.is_fallback = is_fallback
        self.index = index  # slot number in the pool; -1 for a fallback
        self._pool = pool
        self._state = _LEASED
        self._offset = offset
        self._quarantine_seq: int | None = None  # its entry while quarantined

    @property
    def leased(self) -> bool:
        """Whether this handle still owns its memory (neither released nor failed)."""
        return self._state == _LEASED

    def view(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The slot's first bytes as a tensor of `shape` and `dtype` (shares the slot's memory)."""
        if self._state != _LEASED:  # _check_leased()'s test: its call only to refuse
            self._check_leased("view")
        shape = tuple(shape)
        for n in shape:
            if type(n) is not int:  # a shape of exact ints is kept as it is (int() of each is itself)
                shape = tuple([int(n) for n in shape])
                break
        count, dims = 1, 0
        for n in shape:
            if n < 0:
                raise ConfigError(f"{self._name()}: negative dimension in shape {shape}")
            count *= n
            dims += 1
        if type(dtype) is not torch.dtype:
            raise ConfigTypeError(f"{self._name()}: dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        need = count * dtype.itemsize
        if need > self.nbytes:
            raise ConfigError(f"{self._name()}: shape {shape} of {dtype} needs {need} bytes, "
                             f"the slot holds {self.nbytes}")
        if dims == 2 and not self.is_fallback:
            # A slot starting on a row boundary of the pool's rows of this width and dtype (kept, for the last
            # geometry asked): those rows, sliced; the same elements, offset, shape and strides as below.
            rows, width = shape
            kept = self._pool._rows
            if kept is None or kept[0] is not dtype or kept[1] != width:
                kept = self._pool._rows_of(dtype, width)
            row_bytes = kept[2]
            if row_bytes and not self._offset % row_bytes:
                first = self._offset // row_bytes
                return kept[3][first : first + rows]
        # A slot's bytes are cut from the pool's byte view of its region (made once), a fallback's from its own.
        flat = self.region.tensor.reshape(-1).view(torch.uint8) if self.is_fallback else self._pool._bytes
        return flat[self._offset : self._offset + need].view(dtype).view(shape)

    def release(self, event: EventLike | None = None) -> None:
        """Returns the slot once its rows were copied out (after `event.query()` is True, if given)."""
        self._pool._on_release(self, event)  # moves it to released, as _transition() does, in the same hold

    def fail(self) -> None:
        """The room failed: quarantine the slot (a late one-sided write may still land in it)."""
        self._transition(_FAILED, "fail")
        self._pool._on_fail(self)

    def end_quarantine(self) -> None:
        """No late write can land in this failed slot any more: it is free (a fallback starts its grace) now.

        After the pool's close() it is accepted, as release() and fail() are then: the memory is no longer held
        back for this room (a closed pool's region once every quarantined slot of it ended) and goes with the
        pool. A handle not quarantined (never failed, or its quarantine over) changes nothing."""
        self._pool._on_safe(self)

    def _transition(self, state: str, what: str) -> None:
        """Moves a leased handle to `state`; any second move is a SlotError."""
        with self._pool._lock:
            if self._state != _LEASED:
                raise self._moved_again(what)
            self._state = state

    def _moved_again(self, what: str) -> SlotError:
        """The SlotError of a second move (`what`: release or fail) of a handle no longer leased."""
        return SlotError(f"{self._name()}: {what}() after it was already {self._state}")

    def _check_leased(self, what: str) -> None:
        """Refuses access through a handle that gave its memory back."""
        if self._state != _LEASED:
            raise SlotError(f"{self._name()}: {what}() after it was {self._state}")

    def _name(self) -> str:
        """'slot 3 at 0x...' or 'fallback buffer at 0x...', for errors."""
        if self.is_fallback:
            return f"fallback buffer at {self.addr:#x} ({self.nbytes} bytes)"
        return f"slot {self.index} at {self.addr:#x}"

    def __repr__(self) -> str:
        """Name and state, for logs."""
        return f"Slot({self._name()}, {self._state})"


class ReceivePool:
    """One registered receive region cut into equal slots, leased per item."""

    def __init__(self, engine: TransferEngineLike, nbytes: int, slot_bytes: int, *, device: str = "cpu",
                 quarantine_s: float | None = None, grace_s: float | None = None,
                 max_fallback_bytes: int | None = _AUTO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Allocates `nbytes` on `device`, registers them once with `engine`, cuts `slot_bytes` slots.

        `quarantine_s` (default: EPD_QUARANTINE_S, else `default_quarantine_s()` of the engine for a
        slot, and for each fallback its own size) holds a failed room's slot back; `grace_s`
        (default: EPD_FALLBACK_GRACE_S, else 30 s) keeps an idle fallback.
        `max_fallback_bytes` caps the bytes fallback buffers hold at once (default: the
        larger of `nbytes` and FALLBACK_FLOOR_BYTES; None: unbounded; 0: no fallbacks).
        Raises ConfigError for a slot size that is not a positive multiple of SLOT_ALIGN or
        does not fit the pool, and whatever the engine's register() raises.
        """
        _let_go_of_held()  # before allocating: a closed pool's memory whose quarantine ended goes first
        for name, value in (("nbytes", nbytes), ("slot_bytes", slot_bytes),
                            ("max_fallback_bytes", 0 if max_fallback_bytes in (None, _AUTO) else max_fallback_bytes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        config.check_engine("ReceivePool", engine, ("register", "unregister"))
        if slot_bytes <= 0 or slot_bytes % SLOT_ALIGN:
            raise ConfigError(f"slot_bytes must be a positive multiple of {SLOT_ALIGN}, got {slot_bytes}")
        if nbytes < slot_bytes:
            raise ConfigError(f"pool of {nbytes} bytes cannot hold one slot of {slot_bytes} bytes")
        self._quarantine_set = quarantine_s is not None or config.is_set("EPD_QUARANTINE_S")
        quarantine_s = config.resolve("EPD_QUARANTINE_S", quarantine_s)
        grace_s = config.resolve("EPD_FALLBACK_GRACE_S", grace_s)
        if max_fallback_bytes is _AUTO:
            max_fallback_bytes = max(int(nbytes), FALLBACK_FLOOR_BYTES)
        elif max_fallback_bytes is not None:
            if max_fallback_bytes < 0:
                raise ConfigError(f"max_fallback_bytes must be >= 0 or None, got {max_fallback_bytes}")
            max_fallback_bytes = int(max_fallback_bytes)
        self.max_fallback_bytes: int | None = max_fallback_bytes
        self.engine = engine
        self.slot_bytes = int(slot_bytes)
        self.slots = int(nbytes) // self.slot_bytes
        try:
            tensor = torch.empty(int(nbytes), dtype=torch.uint8, device=torch.device(device))
        except (RuntimeError, AssertionError) as exc:  # a device this torch cannot use (CUDA on a CPU build)
            raise ConfigError(f"cannot allocate the pool's {nbytes} bytes on device {device!r}: {exc}") from None
        # "cuda" names the current device of the thread that made the pool: its fallbacks, made on whichever
        # thread leases them, go where its memory went.
        self.device = str(tensor.device)
        self.quarantine_s = float(quarantine_s) if self._quarantine_set else default_quarantine_s(engine, slot_bytes)
        self.grace_s = float(grace_s)
        self._clock = clock
        self._lock = threading.Lock()
        engine.register(tensor)
        self.region = Region(tensor.data_ptr(), int(nbytes), self.device, tensor)
        self._bytes = tensor.reshape(-1).view(torch.uint8)  # the region's bytes, which its slots' views cut
        # (dtype, width, row bytes, the region's whole rows of `width` elements of `dtype`): see _rows_of().
        self._rows: tuple[torch.dtype, int, int, torch.Tensor] | None = None
        self._closed = False
        # Free slot numbers, oldest-returned first: spreads reuse over the whole pool.
        self._free: deque[int] = deque(range(self.slots))
        self._leased = 0
        # Released with an event not yet completed: [(slot handle, event)].
        self._pending: list[tuple[Slot, EventLike]] = []
        # Quarantined slots and fallbacks in their grace: heaps of (deadline, seq, ...); a
        # fallback's entry ends with whether it was quarantined (for the cap's error text).
        self._quarantine: list[tuple[float, int, int]] = []
        self._graces: list[tuple[float, int, Region, bool]] = []
        self._fallbacks: dict[int, Region] = {}  # registered fallback buffers, addr -> region
        self._fallbacks_total = 0
        # Bytes of the fallbacks in _fallbacks plus those being allocated (reserved first,
        # so two threads cannot both pass the cap).
        self._fallback_bytes = 0
        self._retired: list[Region] = []  # fallbacks close() unregistered; freed with the pool
        self._seq = _entry_numbers

    def _rows_of(self, dtype: torch.dtype, width: int) -> tuple[torch.dtype, int, int, torch.Tensor]:
        """The region's whole rows of `width` elements of `dtype` as one 2-D tensor (no rows for a width of 0),
        kept for the next Slot.view() of that geometry; a slot's rows are a slice of it."""
        row_bytes = width * dtype.itemsize
        whole = self._bytes[: self.region.nbytes - self.region.nbytes % row_bytes] if row_bytes else self._bytes[:0]
        kept = (dtype, width, row_bytes, whole.view(dtype).view(-1, width) if row_bytes else whole)
        self._rows = kept  # one assignment: a thread reading it sees one geometry whole
        return kept

    # -- leasing ------------------------------------------------------------

    def lease(self, nbytes: int) -> Slot | None:
        """A free slot for an item of `nbytes`, or None (too big or exhausted); never blocks."""
        if nbytes < 0:
            raise ConfigError(f"cannot lease a negative size ({nbytes} bytes)")
        if _held:  # poll()'s first step: _let_go_of_held()'s own first test, without its call
            _let_go_of_held()
        freed = False
        while True:
            with self._lock:
                # poll()'s own test under this hold: with nothing to free (the usual case) the slot is taken
                # in the same hold, else once _free_due() (poll()'s work past its first step) did its work.
                if freed or self._closed or not (self._pending or self._quarantine or self._graces):
                    if self._closed:  # _check_open(), without its call
                        raise self._closed_error()
                    if nbytes > self.slot_bytes or not self._free:
                        return None
                    index = self._free.popleft()
                    self._leased += 1
                    break
            self._free_due()
            freed = True
        return Slot(self, self.region, index * self.slot_bytes, self.slot_bytes, index, False)

    def lease_or_fallback(self, nbytes: int) -> Slot:
        """A slot, or a fallback buffer: an idle one that holds `nbytes`, or one registered for this item.

        Raises FallbackLimitError when that buffer would take the fallbacks past
        max_fallback_bytes even after retiring what poll() can and the idle fallbacks.
        """
        slot = self.lease(nbytes)
        if slot is not None:
            return slot
        return self._fallback(nbytes)

    def lease_rows(self, nbytes: int, rows: int, width: int, dtype: torch.dtype) -> tuple[Slot, torch.Tensor | None]:
        """lease_or_fallback(nbytes), and its first `rows` rows of `width` elements of `dtype` where a pool slot
        holds them as Slot.view((rows, width), dtype) gives them and without its call: a slice of the rows kept
        for the last geometry viewed. None where they are not kept (another geometry, a fallback): view() them.
        `rows` and `width` are non-negative ints and `nbytes` holds the rows (a pooled receive() checked them)."""
        slot = self.lease(nbytes)
        if slot is None:
            return self._fallback(nbytes), None
        kept = self._rows
        if kept is None or kept[0] is not dtype or kept[1] != width or not kept[2] or slot._offset % kept[2]:
            return slot, None
        first = slot._offset // kept[2]
        try:
            return slot, kept[3][first : first + rows]  # view()'s own cut of kept rows
        except BaseException:  # nothing was asked for it: the slot is free again, as the caller's failure frees it
            slot.release()
            raise

    def _fallback(self, nbytes: int) -> Slot:
        """lease_or_fallback() once lease() found no slot: an idle fallback buffer, or one registered."""
        # Mooncake refuses empty regions; a zero-byte item still gets a (1-byte) buffer.
        size = max(int(nbytes), 1)
        region = self._idle_fallback(size)
        if region is not None:
            return Slot(self, region, 0, int(nbytes), -1, True)
        if not self._reserve(size):
            # lease() polled already, but events may have completed and graces ended since
            # (or another thread released): what that poll frees is tried before refusing.
            slot = self.lease(nbytes)
            if slot is not None:
                return slot
            if not (self._reserve(size) or self._reserve_retiring_idle(size)):
                raise FallbackLimitError(self._over_cap(int(nbytes)))
        region = self._register_fallback(size)
        log.debug("fallback buffer of %d bytes at %#x (pool slots %d bytes, %d free)",
                  nbytes, region.addr, self.slot_bytes, len(self._free))
        return Slot(self, region, 0, int(nbytes), -1, True)

    def _register_fallback(self, size: int) -> Region:
        """Allocates and registers a fallback of `size` bytes, reserved already, and counts it live.

        The registration (milliseconds over RDMA) runs outside the lock, so releases, other
        leases and end_quarantine() go on meanwhile; the reservation keeps the cap. A failure
        gives the reservation back; a close() meanwhile unregisters the buffer again and
        raises SlotError, as for a pool closed before the call.
        """
        try:
            with self._lock:
                self._check_open()
            tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.engine.register(tensor)
        except BaseException:
            self._unreserve(size)
            raise
        region = Region(tensor.data_ptr(), tensor.numel(), self.device, tensor)
        with self._lock:
            closed = self._closed
            if closed:  # close() zeroed the count, this reservation included; the memory goes with the pool
                self._retired.append(region)
            else:
                self._fallbacks[region.addr] = region
                self._fallbacks_total += 1
        if closed:
            self._unregister(region)
            raise self._closed_error()
        return region

    def _idle_fallback(self, size: int) -> Region | None:
        """Takes the smallest fallback in its grace (not quarantined) of at least `size` bytes, if any."""
        with self._lock:
            self._check_open()
            idle = [entry for entry in self._graces if not entry[3] and entry[2].nbytes >= size]
            if not idle:
                return None
            entry = min(idle, key=lambda e: e[2].nbytes)
            _remove_entry(self._graces, entry[1])
            self._fallbacks_total += 1
            return entry[2]

    def _reserve_retiring_idle(self, size: int) -> bool:
        """Counts `size` more fallback bytes after dropping idle fallbacks (in their grace, not
        quarantined), largest first, if that makes them fit under the cap; False (nothing dropped,
        nothing counted) if it does not."""
        with self._lock:
            self._check_open()
            if self.max_fallback_bytes is None:
                self._fallback_bytes += size
                return True
            excess = self._fallback_bytes + size - self.max_fallback_bytes
            retired: list[tuple[int, Region]] = []
            for _, seq, region, quarantined in sorted(self._graces, key=lambda e: -e[2].nbytes):
                if excess <= 0:
                    break
                if not quarantined:
                    retired.append((seq, region))
                    excess -= region.nbytes
            if excess > 0:
                return False
            for seq, region in retired:
                _remove_entry(self._graces, seq)
                del self._fallbacks[region.addr]
                self._fallback_bytes -= region.nbytes
            self._fallback_bytes += size
        for _, region in retired:
            self._unregister(region)
        return True

    def _reserve(self, size: int) -> bool:
        """Counts `size` more fallback bytes if the cap allows; False (nothing counted) if not."""
        with self._lock:
            self._check_open()
            cap = self.max_fallback_bytes
            if cap is not None and self._fallback_bytes + size > cap:
                return False
            self._fallback_bytes += size
            return True

    def _unreserve(self, size: int) -> None:
        """Gives back a reservation whose buffer never came to be."""
        with self._lock:
            if not self._closed:  # close() zeroed the count, reservations included
                self._fallback_bytes -= size

    def _over_cap(self, nbytes: int) -> str:
        """FallbackLimitError's text: what was asked, what fallbacks hold and why, what to do."""
        with self._lock:
            now = self._clock()
            pending = sum(1 for slot, _ in self._pending if slot.is_fallback)
            quarantined = sum(1 for entry in self._graces if entry[3])
            in_grace = len(self._graces) - quarantined
            live = len(self._fallbacks) - pending - len(self._graces)
            held, cap = self._fallback_bytes, self.max_fallback_bytes
            soonest = f"; the next retires in {max(0.0, self._graces[0][0] - now):.1f}s" if self._graces else ""
            if nbytes > self.slot_bytes:
                why = f"the item is bigger than a slot ({self.slot_bytes} bytes)"
                fix = f"size the pool's slots to at least {nbytes} bytes"
            else:
                why = (f"all {self.slots} slots are taken ({self._leased} leased, {len(self._quarantine)} "
                       f"quarantined, {len(self._pending) - pending} awaiting copy-out events)")
                fix = f"size the pool larger (more than {self.slots} slots of {self.slot_bytes} bytes)"
        return (f"receive pool at {self.region.addr:#x}: a fallback buffer of {nbytes} bytes would take "
                f"fallbacks past max_fallback_bytes={cap}: they hold {held} bytes in {len(self._fallbacks)} "
                f"buffers ({live} live, {pending} awaiting copy-out events, {in_grace} in grace, "
                f"{quarantined} quarantined after failed rooms{soonest}), and {why}; "
                f"{fix}, or raise max_fallback_bytes (None: unbounded)")

    # -- returns (called by Slot) -----------------------------------------------

    def _on_release(self, slot: Slot, event: EventLike | None) -> None:
        """Releases a handle (SlotError unless it was leased): free now, or once its event completed."""
        with self._lock:
            if slot._state != _LEASED:
                raise slot._moved_again("release")
            slot._state = _RELEASED
            if not slot.is_fallback:
                self._leased -= 1
                if event is None:  # _settle() of a slot, which needs no clock
                    self._free.append(slot.index)
                    return
            now = self._clock()
            if event is None:
                self._settle(slot, now)
                return
            try:
                done = self._settle_if_done(slot, event, now)
            except BaseException:  # an interrupt inside the event's query(): the copy is not known to be done
                self._await_copy(slot, event, now)
                raise
            if not done:
                self._await_copy(slot, event, now)

    def _await_copy(self, slot: Slot, event: EventLike, now: float) -> None:
        """Keeps a released handle until its copy-out event completed (lock held): pending, or after close()
        held apart from the pool."""
        if self._closed:  # given back after close(): its memory outlives the pool until the copy is done
            _hold(self._clock, now + self.quarantine_of(slot.nbytes), slot.region, event)
        else:
            self._pending.append((slot, event))

    def _on_fail(self, slot: Slot) -> None:
        """A failed handle: quarantine (slot) or the longer of grace and quarantine (fallback)."""
        with self._lock:
            if not slot.is_fallback:
                self._leased -= 1
            self._quarantine_handle(slot, self._clock())

    def _quarantine_handle(self, slot: Slot, now: float) -> None:
        """Park a slot for quarantine_s, a fallback for the longer of grace and quarantine (lock held)."""
        seq = slot._quarantine_seq = next(self._seq)
        if slot.is_fallback:
            deadline = now + max(self.grace_s, self.quarantine_of(slot.nbytes))
            heapq.heappush(self._graces, (deadline, seq, slot.region, True))
        else:
            deadline = now + self.quarantine_s
            heapq.heappush(self._quarantine, (deadline, seq, slot.index))
        if self._closed:  # a lease given back after close(): its memory outlives the pool until then
            _hold(self._clock, deadline, slot.region, quarantines={seq})

    def quarantine_of(self, nbytes: int) -> float:
        """How long memory of `nbytes` leased from this pool is held back after a failed room: a slot's
        `quarantine_s`; a larger fallback's by its own size when no quarantine was set."""
        if self._quarantine_set or nbytes <= self.slot_bytes:
            return self.quarantine_s
        return default_quarantine_s(self.engine, nbytes)

    def _on_safe(self, slot: Slot) -> None:
        """Ends a quarantined handle's quarantine (its entry only: the slot may have been leased again since)."""
        with self._lock:
            seq, slot._quarantine_seq = slot._quarantine_seq, None
            if seq is None:
                return
            closed = self._closed
            if not closed:
                removed = _remove_entry(self._graces, seq) if slot.is_fallback else _remove_entry(self._quarantine, seq)
                if removed:
                    self._settle(slot, self._clock())
        if closed:  # its memory outlives the pool for this quarantine no longer
            _end_held(seq)

    def _settle_if_done(self, slot: Slot, event: EventLike, now: float) -> bool:
        """Settles a released handle whose copy-out event completed, or quarantines it when querying the
        event failed (lock held); False while the event is still pending."""
        done = _query(event)
        if done is None:
            self._quarantine_handle(slot, now)
        elif done:
            self._settle(slot, now)
        return done is not False

    def _settle(self, slot: Slot, now: float) -> None:
        """Copy-out done: a slot is free again, a fallback starts its grace (lock held)."""
        if slot.is_fallback:
            heapq.heappush(self._graces, (now + self.grace_s, next(self._seq), slot.region, False))
        else:
            self._free.append(slot.index)

    # -- housekeeping -------------------------------------------------------------

    def poll(self) -> None:
        """Frees slots whose event completed or quarantine ended, drops fallbacks past their grace."""
        if _held:  # _let_go_of_held()'s own first test, without its call
            _let_go_of_held()
        self._free_due()

    def _free_due(self) -> None:
        """poll() of this pool's own slots and fallbacks: what is due is freed."""
        expired: list[Region] = []
        with self._lock:
            if self._closed or not (self._pending or self._quarantine or self._graces):
                return  # nothing to free (the usual case: every lease polls)
            now = self._clock()
            if self._pending:
                pending, waiting = self._pending, []
                try:
                    for i, (slot, event) in enumerate(pending):
                        if not self._settle_if_done(slot, event, now):
                            waiting.append((slot, event))
                except BaseException:
                    # An interrupt inside an event's query(): the handles settled before it stay settled and
                    # leave the list (settled again, a slot would be free twice), that one and the rest wait on.
                    self._pending = waiting + pending[i:]
                    raise
                self._pending = waiting
            while self._quarantine and self._quarantine[0][0] <= now:
                self._free.append(heapq.heappop(self._quarantine)[2])
            while self._graces and self._graces[0][0] <= now:
                region = heapq.heappop(self._graces)[2]
                if self._fallbacks.pop(region.addr, None) is not None:
                    self._fallback_bytes -= region.nbytes
                expired.append(region)
        for region in expired:
            self._unregister(region)

    def stats(self, *, poll: bool = True) -> PoolStats:
        """Counts after a poll(): free, leased, pending_events, quarantined slots; live and total
        fallbacks, the bytes they hold and their cap (max_fallback_bytes, None when unbounded).

        `poll=False` reads the counts as they stand, doing none of poll()'s work (querying
        copy-out events, unregistering fallbacks past their grace): what a metrics scrape, on
        a thread of its own, reads; the owner's next poll() or lease brings them up to date.

        Open or closed, free + leased + pending_events + quarantined == slots. Once closed the pool
        holds nothing back: `leased` counts the slot leases not given back yet and every other slot
        counts free; pending_events, quarantined, fallbacks_live and fallback_bytes read 0 (the
        memory a copy-out or a failed room's late write may still touch is kept apart from the
        pool, until the copy completed or the quarantine ended).
        """
        if poll:
            self.poll()
        with self._lock:
            if self._closed:
                return {
                    "slots": self.slots,
                    "free": self.slots - self._leased,
                    "leased": self._leased,
                    "pending_events": 0,
                    "quarantined": 0,
                    "fallbacks_live": 0,
                    "fallbacks_total": self._fallbacks_total,
                    "fallback_bytes": 0,
                    "max_fallback_bytes": self.max_fallback_bytes,
                }
            return {
                "slots": self.slots,
                "free": len(self._free),
                "leased": self._leased,
                "pending_events": sum(1 for slot, _ in self._pending if not slot.is_fallback),
                "quarantined": len(self._quarantine),
                "fallbacks_live": len(self._fallbacks),
                "fallbacks_total": self._fallbacks_total,
                "fallback_bytes": self._fallback_bytes,
                "max_fallback_bytes": self.max_fallback_bytes,
            }

    # -- lifecycle -------------------------------------------------------------------

    def _check_open(self) -> None:
        """Raise when the pool was closed (caller holds the lock)."""
        if self._closed:
            raise self._closed_error()

    def _closed_error(self) -> SlotError:
        return SlotError(f"receive pool at {self.region.addr:#x} is closed: its slots are gone; close a pool only "
                         f"after the session manager that leases from it, or make a new one")

    def _unregister(self, region: Region) -> None:
        """Deregister one region, logging (not raising) when the engine refuses."""
        try:
            self.engine.unregister(region.addr)
        except Exception as exc:  # the engine may already be closed; nothing left to undo
            log.warning("unregistering %#x (%d bytes) failed: %s", region.addr, region.nbytes, exc)

    @property
    def closed(self) -> bool:
        """Whether close() was called: its slots are gone and its memory unregistered."""
        return self._closed

    def close(self) -> None:
        """Unregisters the pool region and every live fallback buffer (their memory lives as
        long as the pool object, and memory quarantined after a failed room, or given back
        failed after close(), until its quarantine ends: no later registration with the engine
        gets its address while a late write may land there, or end_quarantine() ended the quarantines
        of all the failed rooms it held; and memory a copy-out whose event is still pending reads,
        given back before or after close(), until the event completed or the quarantine bound passed;
        the first pool made or polled after that frees it); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held = [(deadline, region, {seq}) for deadline, seq, region, quarantined in self._graces if quarantined]
            if self._quarantine:
                held.append((max(deadline for deadline, _, _ in self._quarantine), self.region,
                             {seq for _, seq, _ in self._quarantine}))
            for deadline, region, quarantines in held:
                _hold(self._clock, deadline, region, quarantines=quarantines)
            if held:
                log.info("receive pool at %#x closed with memory quarantined after failed rooms: it stays "
                         "allocated (unregistered) for up to %.1fs more, until a late write can no longer land "
                         "there (freed by the next pool made or polled after that) or end_quarantine() ended "
                         "those rooms' quarantines", self.region.addr,
                         max(deadline for deadline, _, _ in held) - self._clock())
            now = self._clock()
            for slot, event in self._pending:  # copy-outs still reading: their memory stays until they are done
                _hold(self._clock, now + self.quarantine_of(slot.nbytes), slot.region, event)
            regions = [self.region, *self._fallbacks.values()]
            # Unregistered, but freed only with the pool, like its own region: a copy-out
            # whose event is pending may still read a fallback.
            self._retired = list(self._fallbacks.values())
            self._fallbacks.clear()
            self._fallback_bytes = 0
            self._pending.clear()
            self._quarantine.clear()
            self._graces.clear()
        for region in regions:
            self._unregister(region)

    def __enter__(self) -> ReceivePool:
        """Context-manager entry."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on exit."""
        self.close()

    def __repr__(self) -> str:
        """Geometry and occupancy, for logs."""
        return (f"ReceivePool({self.slots} x {self.slot_bytes} bytes on {self.device} at "
                f"{self.region.addr:#x}, {len(self._free)} free)")

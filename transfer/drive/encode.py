"""The encode side's driver: one thread that owns the request socket, the engine's writes
and the clock, pushes the statuses, feeds EncodeCore its events and carries out its actions.

One thread rather than an I/O thread feeding writer threads: every hand-off between
threads costs a wake-up on a busy core, and the Mooncake threads that move the bytes
need those cores. The caller's thread only posts commands (an item offered, a room
cleared, close), registers the sources send() finds outside registered memory, and reads
the room book. The status sockets are _io.Pushers': their own thread ("epd-status") sends
the statuses that waited for a connection to come up, and closes idle ones.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from transfer import _forks, _io
from transfer.core.encode import (
    Conclude,
    Count,
    EncodeCore,
    Offer,
    Progress,
    PushStatus,
    Release,
    StartWrite,
    Warn,
)
from transfer.core.failure import Failure, FailureKind
from transfer.core.polls import PollSchedule
from transfer.core.sources import SourceCounts
from transfer.core.unread import LATE_TICK_S, unread
from transfer.errors import EngineError, UsageError
from transfer.frames import (
    TransferInfo,
    WireError,
    cancel_reply_frames,
    is_cancel,
    is_registration,
    parse_cancel,
    parse_registration,
    status_frames,
)
from transfer.interfaces import TransferEngineLike
from transfer.metrics import Metrics
from transfer.ports import PortSpec
from transfer.status import RoomTable, TransferPoll, is_terminal

log = logging.getLogger("transfer.sender")

#: The defaults of SenderPool's poll_min_s and poll_max_s: writes in flight are polled on
#: a PollSchedule between them, and at once when a request wakes the driver.
POLL_MIN_S = 100e-6
POLL_MAX_S = 1e-3

#: Descriptors select() can watch (FD_SETSIZE).
SELECT_FD_LIMIT = 1024

#: Requests filed per round before the thread turns to its writes: a peer that sends
#: without pause must not keep the thread (its writes, sweep and close()) waiting.
MAX_REQUESTS_PER_ROUND = 256

#: How long the statuses pushed while closing may take to leave once the pool is closed.
CLOSE_LINGER_MS = 1000

#: How long a thread that stopped after an error waits for writes already submitted, when no close()
#: bounds it (close_by): past Mooncake's own transfer timeout (30 s by default), by which the engine
#: has given up on a peer that stopped reading.
CLOSE_WAIT_S = 60.0

#: What closing keeps of its close_by for itself once it stops waiting for writes: failing the rooms,
#: pushing their Failed statuses (CLOSE_LINGER_MS) and closing the sockets.
CLOSE_AFTER_WRITES_S = CLOSE_LINGER_MS / 1000 + 0.5

#: How often registrations the engine would not drop yet are tried again.
RETRY_RELEASES_S = 0.5

#: The most temporary source registrations dropped in one engine call (SourceRegistry.flush), and in one turn of
#: a serving driver, which drops those its turn let go of at the turn's end.
DROP_BATCH = 1024


def _some(items: list, most: int) -> str:
    """The first `most` items, comma-separated, and how many more there are."""
    text = ", ".join(map(str, items[:most])) or "none"
    return text + (f" and {len(items) - most} more" if len(items) > most else "")


class RoomState:
    """One send of a room as its caller's handle sees it (the core's token for it)."""

    __slots__ = ("asked_at", "concluded_at", "release", "room", "started_at", "submitted_at", "writing_at")

    def __init__(self, room: int, started_at: float, release: Any = None) -> None:
        self.room = room
        self.started_at = started_at
        self.asked_at: float | None = None
        self.writing_at: float | None = None
        self.submitted_at: float | None = None  # the engine's submission call for its last write so far returned
        self.concluded_at: float | None = None
        self.release = release  # drops the temporary source registrations made for it

    def stage_times(self) -> tuple[tuple[str, float | None], ...]:
        """When the first prefill rank asked, when its writes were queued (the whole fanout
        asked), when the engine's submission call for its last write returned, and when it
        concluded (driver clock; None where not reached)."""
        return (("asked", self.asked_at), ("writing", self.writing_at), ("submitted", self.submitted_at),
                ("concluded", self.concluded_at))


class RoomBook:
    """The rooms the caller sent and has not cleared, their table, and the one place they conclude.

    Shared by the caller's thread (send, clear, reads) and the driver's (conclusions),
    under one lock; nothing here touches a socket or the engine.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.lock = threading.Lock()
        self.held: dict[int, RoomState] = {}
        self.table = RoomTable()
        self.conclusions = _io.Conclusions()
        self.metrics = metrics
        self.failures = _io.ThrottledLog(log)  # rooms that failed, per kind
        self.stopping = False  # no send() is accepted (closing, or the driver failed)
        self.closed = False
        self.failure: str | None = None  # why the driver failed, if it did

    def conclude(self, state: RoomState, status: TransferPoll, failure: Failure | None, at: float) -> bool:
        """Concludes the room if `state` is still its current send and open; True only for the call that did."""
        # concluded_at is set only below, once the table concluded the room: this send is over (a clear() of
        # a room that concluded, mostly), and the table would refuse it again.
        if state.concluded_at is not None:
            return False
        with self.lock:
            if self.held.get(state.room) is not state or not self.table.conclude(state.room, status, failure):
                return False
            state.concluded_at = at
        try:
            _io.count_concluded(self.metrics, self.failures, state.room, status is TransferPoll.Success, failure,
                                at - state.started_at)
        finally:
            self.conclusions.notify()  # the room concluded, however the count went: its waiters return
        return True

    def progress(self, state: RoomState, status: TransferPoll, asked_at: float, at: float) -> None:
        """Moves an open room on (Transferring, its writes queued at `at`), if `state` is still its current send."""
        with self.lock:
            if self.held.get(state.room) is state:
                self.table.update(state.room, status)
                state.asked_at, state.writing_at = asked_at, at

    def fail_open(self, failure: Failure, at: float, wait: float = -1) -> None:
        """Fails every open room (the driver is gone; nobody else will conclude them).

        With the lock held by another thread past `wait` seconds (a send() stuck inside the caller's metrics,
        which holds it: clear() and send() wait behind it), the rooms are failed through the table, which
        is thread-safe, without it. A count that raises (the caller's metrics) fails no room less: the
        first such error is raised once every open room failed and its waiters were told."""
        error: Exception | None = None  # the first count that raised: every room fails all the same
        if not self.lock.acquire(timeout=wait):
            for state in list(self.held.values()):
                if state.concluded_at is None and self.table.conclude(state.room, TransferPoll.Failed, failure):
                    state.concluded_at = at
                    try:
                        _io.count_concluded(self.metrics, self.failures, state.room, False, failure,
                                            at - state.started_at)
                    except Exception as exc:  # noqa: BLE001 - raised once the other rooms failed too
                        error = error or exc
                    finally:
                        self.conclusions.notify()
        else:
            try:
                states = list(self.held.values())
            finally:
                self.lock.release()
            for state in states:
                if not is_terminal(self.table.get(state.room)):
                    try:
                        self.conclude(state, TransferPoll.Failed, failure, at)
                    except Exception as exc:  # noqa: BLE001 - raised once the other rooms failed too
                        error = error or exc
        if error is not None:
            raise error

    def parked(self) -> int:
        """Rooms sent whose receivers have not all asked yet (a scrape may come from any thread)."""
        with self.lock:
            rooms = list(self.held)
        return sum(1 for room in rooms if self.table.get(room) is TransferPoll.WaitingForInput)


@dataclass
class _EngineSources:
    """What every SourceRegistry on one engine shares: the counts, their lock, the registration under way, and
    the holds of closed pools that writes they abandoned still read."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: SourceCounts = field(default_factory=SourceCounts)
    registering: threading.Lock = field(default_factory=threading.Lock)  # taken by callers only, never by a driver
    pending: int | None = None  # the base being registered and not yet counted
    #: Our registrations no room holds any more, in the order they were let go of, to drop in the next batch
    #: (SourceRegistry.flush); one held again meanwhile is skipped there.
    dropping: dict[int, None] = field(default_factory=dict)
    #: [batches still read from, bases held]: let go of by any registry's retry() once the engine is done with
    #: every one of those writes (see SourceRegistry.leave_to_engine).
    abandoned: list[tuple[set[int], tuple[int, ...]]] = field(default_factory=list)


# Engine -> the source registrations its sender pools share. Weakly keyed, and nothing in a
# value refers to its engine, so an entry goes with its engine.
_engine_sources: weakref.WeakKeyDictionary[Any, _EngineSources] = weakref.WeakKeyDictionary()
_engine_sources_lock = _forks.free_in_child(threading.Lock())


def _sources_of(engine: Any) -> _EngineSources:
    """The counts every sender pool on `engine` shares; a set of its own for an engine that cannot be a weak key."""
    with _engine_sources_lock:
        try:
            shared = _engine_sources.get(engine)
            if shared is None:
                shared = _engine_sources[engine] = _EngineSources()
        except TypeError:  # not weakly referenceable or not hashable (None, in a test of the driver alone)
            return _EngineSources()
    return shared


class SourceRegistry:
    """Registers source regions that lie outside registered memory, counted per registration.

    send() holds them on the caller's thread; the driver releases them once the core
    says nothing reads them any more, and once it stopped, whatever its rooms still hold
    (release_all(): writes still in flight excepted). The driver's releases leave the
    registrations no room holds to flush(), which unregisters up to DROP_BATCH in one engine call. Every registry on one engine shares
    its counts: a region registered for one pool's send stays registered while a room of
    any pool on that engine reads it, and one the caller registered is never unregistered here.
    `lock` guards the counts and is never held across a registration (slow for a large
    region over RDMA): the drivers' releases do not wait for one. It is held across a
    deregistration (the last hold of a temporary registration let go), so a send() that
    holds a region meanwhile waits for that. Callers register one region at a time, under
    `_registering`.
    """

    def __init__(self, engine: TransferEngineLike) -> None:
        self.engine = engine
        self._shared = _sources_of(engine)
        self.lock = self._shared.lock
        self.counts = self._shared.counts
        self._registering = self._shared.registering
        #: Our registrations no room holds any more, waiting for flush() (every registry's on the engine).
        self.due = self._shared.dropping
        self._holds: dict[int, tuple[int, ...]] = {}  # this registry's holds not let go of yet: key -> bases
        self._keys = itertools.count(1)
        # The engine's own look-ups (transfer.core.registrations), where it has them: one each, where a snapshot
        # of every registration grows with the temporary ones held for the rooms waiting for their receivers.
        self._holding: Callable[[int, int], tuple[int, int] | None] | None = getattr(
            engine, "registration_holding", None)
        self._overlapping: Callable[[int, int], tuple[int, int] | None] | None = getattr(
            engine, "registration_overlapping", None)

    def hold(self, *regions: _io.Region | None) -> Callable[..., None] | None:
        """Holds each region's registration (registering it if needed); returns their release, or None.

        The release lets go once, however often it is called (release_all() may have let go
        already), and drops the registrations no room holds any more at once; `later=True` (the
        driver's) leaves them to the next flush(), which drops many in one engine call. If one
        region cannot be registered, or a stop signal's exception lands while they are filed, those
        already held are released before raising.
        """
        held: list[int] = []
        key = next(self._keys)  # what the holds are filed under, once all are held

        def undo() -> None:
            if not held:
                return
            if not self.lock.acquire(True, _io.LOCK_WAIT_S):
                log.error("keeping %d source registrations held for a send() that failed: the book of source "
                          "registrations stayed held; they go with the engine", len(held))
                return
            try:
                self._holds.pop(key, None)  # filed already (an interrupt right after): let go of here, once
                self._let_go(held)
                self._drop_many(self._take_dropping(held))
            finally:
                self.lock.release()

        try:
            for region in regions:
                if region is None or region.nbytes == 0:
                    continue
                found, base = self._hold_registered(region)
                if not found:
                    with self._registering:
                        found, base = self._hold_registered(region)  # another caller may have registered it
                        if not found:
                            extent = self._extent(region)
                            self._refuse_overlap(extent)
                            base = self._register(extent)
                if base is not None:
                    held.append(base)
            if not held:
                return None
            # Filed in the same try: a stop signal's exception while this waits for the lock (a deregistration
            # holds it) lets go of what is held, which no release would otherwise ever reach.
            with self.lock:
                self._holds[key] = tuple(held)
        except BaseException:
            undo()
            raise
        return functools.partial(self._release, key)

    def _release(self, key: int, later: bool = False) -> None:
        """Lets go of one hold, unless it was let go of already; drops the registrations no room holds any
        more now, or with the next flush() when `later`. When `lock` stays held past LOCK_WAIT_S (a
        deregistration that does not return) the hold is kept, for release_all() at the pool's close."""
        if not self.lock.acquire(True, _io.LOCK_WAIT_S):
            log.error("keeping a room's source registrations for now: the engine's book of source registrations "
                      "stayed held for %gs (inside it: %s); the sender pool's close lets go of them",
                      _io.LOCK_WAIT_S, _io.threads_inside(lambda obj: getattr(obj, "lock", None) is self.lock))
            return
        try:
            bases = self._holds.pop(key, None)
            if bases is not None:
                self._let_go(bases)
                if not later:
                    self._drop_many(self._take_dropping(bases))
        finally:
            self.lock.release()

    def _let_go(self, bases: Iterable[int]) -> None:
        """One hold fewer on each base; those no room holds any more are due to be dropped (lock held)."""
        for base in bases:
            if self.counts.release(base):
                self._shared.dropping[base] = None

    @property
    def dropping(self) -> int:
        """How many registrations no room holds wait for flush() (read without the lock: a hint)."""
        return len(self._shared.dropping)

    def flush(self, most: int | None = None, until: float = math.inf, clock: Callable[[], float] = time.monotonic,
              ) -> int:
        """Unregisters the registrations no room holds any more (of every registry on the engine), DROP_BATCH to
        an engine call: at most `most`, and none started once `clock()` plus the last batch's time passes
        `until`; returns how many are left to a later flush().

        The last let go of go first, the order in which Mooncake drops them fastest."""
        spent = 0.0
        done = 0
        while self._shared.dropping and (most is None or done < most):
            if clock() + spent > until:
                break
            started = clock()
            with self.lock:
                size = DROP_BATCH if most is None else min(DROP_BATCH, most - done)
                batch = list(itertools.islice(reversed(self._shared.dropping), size))
                done += len(batch)
                self._drop_many(self._take_dropping(batch))
            spent = clock() - started
        return len(self._shared.dropping)

    def _take_dropping(self, bases: Iterable[int]) -> list[int]:
        """Takes `bases` off the registrations due to be dropped; those of them no room holds again (lock held)."""
        due = []
        for base in bases:
            if base in self._shared.dropping:
                del self._shared.dropping[base]
                if self.counts.idle(base):
                    due.append(base)
        return due

    def release_all(self, reads: Iterable[tuple[int, int]] = ()) -> int:
        """Lets go of every hold this registry made that was not let go of yet, but those around
        memory a write may still read (`reads`: (address, bytes) pairs); returns how many it let go.
        The registrations no room holds any more then wait for flush().

        For a driver that stopped: the rooms it will never release any more. Only this
        registry's own holds go, so a source another pool on the engine still sends stays
        registered; a hold let go of here is not let go of again by its own release.
        """
        with self.lock:
            if not self._holds:
                return 0
            registered = self.engine.registered()
            reads = list(reads)
            let_go = 0
            for key, bases in list(self._holds.items()):
                if any(addr < base + registered.get(base, 0) and base < addr + nbytes
                       for base in bases for addr, nbytes in reads):
                    continue
                del self._holds[key]
                self._let_go(bases)
                let_go += 1
        return let_go

    @property
    def holding(self) -> int:
        """Holds this registry made that were not let go of yet."""
        with self.lock:
            return len(self._holds)

    def _extent(self, region: _io.Region) -> _io.Region:
        """What to register for `region`: the whole storage of its tensor, so that every view of it
        sent meanwhile (overlapping ones too, which the engine would refuse to register apart)
        shares the one registration; the region alone where some of that storage is registered
        already, or it has no tensor."""
        tensor = region.tensor
        if tensor is None:
            return region
        storage = tensor.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if (start, nbytes) == (region.addr, region.nbytes):
            return region
        if self._registered_across(start, nbytes) is not None:
            return region
        import torch  # a region has a tensor only where torch is loaded

        whole = tensor.new_empty(0, dtype=torch.uint8).set_(storage)
        return _io.Region(start, nbytes, region.device, whole)

    def _refuse_overlap(self, region: _io.Region) -> None:
        """EngineError when `region` overlaps a registration without lying inside it: the engine would
        refuse to register it (no byte is registered twice), naming neither that registration nor a way out.
        One of ours that no room holds any more, waiting for flush(), is dropped here instead."""
        with self.lock:
            found = self._registered_across(region.addr, region.nbytes)
            while found is not None and found[0] in self._shared.dropping and self.counts.idle(found[0]):
                self._drop_many(self._take_dropping([found[0]]))
                if self.counts.is_ours(found[0]):
                    break  # the engine kept it (a write it gave up on still reads it)
                found = self._registered_across(region.addr, region.nbytes)
            if found is None:
                return
            base, size = found
            whose = ("a temporary registration held for another room's source" if self.counts.is_ours(base)
                     else "the caller's own")
        raise EngineError(f"source {region.addr:#x} ({region.nbytes} bytes) overlaps memory already registered at "
                          f"{base:#x} ({size} bytes, {whose}) without lying inside it, and no byte can be "
                          f"registered twice: register one region that holds the whole source before sending it "
                          f"(engine.register), or send a copy of it (.clone())")

    def _hold_registered(self, region: _io.Region) -> tuple[bool, int | None]:
        """Holds our registration around `region`: (True, its base); (True, None) inside the
        caller's own; (False, None) when none is registered.

        The registration another caller is making is left out until it is counted: it would
        pass for the caller's own, which no room holds. EngineError when `lock` stays held past
        LOCK_WAIT_S (a deregistration that does not return): nothing is held then.
        """
        if not self.lock.acquire(True, _io.LOCK_WAIT_S):
            raise EngineError(self._held_text(region))
        try:
            if self._holding is not None:
                found = self._holding(region.addr, region.nbytes)
                # Registered regions are disjoint: none but the one registered under way holds the region then.
                base = None if found is None or found[0] == self._shared.pending else found[0]
            else:
                registered = self.engine.registered()
                if self._shared.pending is not None:
                    registered.pop(self._shared.pending, None)
                base = self.counts.base_for(region.addr, region.end, registered)
            if base is None:
                return False, None
            if not self.counts.is_ours(base):
                return True, None
            self.counts.hold(base)
            return True, base
        finally:
            self.lock.release()

    def _held_text(self, region: _io.Region) -> str:
        """Why holding `region` gave up waiting for `lock`, and what to do."""
        return (f"source {region.addr:#x} ({region.nbytes} bytes): waited {_io.LOCK_WAIT_S:g}s for the engine's "
                f"book of source registrations, held all that time (its holders take it for bookkeeping and for "
                f"the engine's deregistration of a temporary registration, engine.unregister); nothing was sent. "
                f"Inside it now: {_io.threads_inside(lambda obj: getattr(obj, 'lock', None) is self.lock)}. An "
                f"engine call that does not return there holds every send() on the engine: check the engine's "
                f"device, close() the sender pool (it returns within close_timeout_s) and the engine")

    def _registered_across(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """(base, length) of a registration sharing a byte with [addr, addr + nbytes), or None."""
        if self._overlapping is not None:
            return self._overlapping(addr, nbytes)
        end = addr + nbytes
        return next(((a, n) for a, n in self.engine.registered().items() if a < end and addr < a + n), None)

    def _register(self, region: _io.Region) -> int:
        """Registers `region` outside the lock and holds it (_registering held); returns its base."""
        with self.lock:
            self._shared.pending = region.addr
        try:
            self.engine.register(region.tensor if region.tensor is not None else region.addr, region.nbytes)
        except BaseException:
            with self.lock:
                self._shared.pending = None
            raise
        with self.lock:
            self._shared.pending = None
            self.counts.hold(region.addr)
        return region.addr

    def _drop_many(self, bases: list[int]) -> None:
        """Unregisters ours no room holds any more (lock held): in one engine call where the engine has
        unregister_many, else one each.

        The engine refuses while a write it gave up on still reads the memory: the
        registration then stays ours at refcount 0 and is retried.
        """
        if not bases:
            return
        many = getattr(self.engine, "unregister_many", None)
        if many is None or len(bases) == 1:
            for base in bases:
                self._drop(base)
            return
        try:
            problems = many(bases)
        except Exception as exc:  # noqa: BLE001 - e.g. the engine closed: nothing was let go
            problems = dict.fromkeys(bases, str(exc))
        if not problems:
            for base in bases:
                self.counts.dropped(base)
            return
        registered = self.engine.registered()
        failed = []
        for base in bases:
            problem = problems.get(base)
            if problem is not None and base in registered:
                if self.counts.kept(base):
                    log.warning("keeping the temporary registration of %#x for now: %s", base, problem)
                continue
            if problem is not None:
                failed.append(problem)
            self.counts.dropped(base)
        if failed:
            log.warning("dropping %d temporary source registrations failed: %s", len(failed), _some(failed, 1))

    def _drop(self, base: int) -> None:
        """Unregisters one of ours no room holds any more (lock held); see _drop_many."""
        try:
            self.engine.unregister(base)
        except Exception as exc:  # noqa: BLE001 - the room concludes either way
            if base in self.engine.registered():
                if self.counts.kept(base):
                    log.warning("keeping the temporary registration of %#x for now: %s", base, exc)
                return
            log.warning("dropping the temporary registration of %#x failed: %s", base, exc)  # e.g. engine closed
        self.counts.dropped(base)

    def leave_to_engine(self, writes: Iterable[tuple[int, Iterable[tuple[int, int]]]]) -> int:
        """For a driver that stopped with writes still in flight that nothing polls any more (`writes`: their
        engine batches and the (address, bytes) each reads): hands this registry's holds around memory they
        read to the book every registry on the engine shares; returns how many it handed over.

        The next retry() of any registry on the engine (another pool's driver, every RETRY_RELEASES_S) lets
        go of each once the engine answered poll() for every write that reads it (over, or failed: the
        engine's unregister() refuses memory a failed write may still read); the engine's close takes the rest.
        """
        writes = [(batch, tuple(reads)) for batch, reads in writes if batch]
        if not writes or getattr(self.engine, "poll", None) is None:
            return 0
        with self.lock:
            registered = self.engine.registered()
            handed = 0
            for key, bases in list(self._holds.items()):
                batches = {batch for batch, reads in writes for addr, nbytes in reads for base in bases
                           if addr < base + registered.get(base, 0) and base < addr + nbytes}
                if batches:
                    del self._holds[key]
                    self._shared.abandoned.append((batches, bases))
                    handed += 1
        return handed

    def retry(self) -> None:
        """Tries again to drop the registrations the engine would not let go of, and lets go of the holds
        closed pools left to writes they abandoned, once the engine is done with those (leave_to_engine)."""
        over = self._abandoned_over() if self._shared.abandoned else []
        with self.lock:
            let_go = [base for bases in over for base in bases]
            self._let_go(let_go)
            self._drop_many(self._take_dropping(let_go) + self.counts.retry())

    def _abandoned_over(self) -> list[tuple[int, ...]]:
        """Takes the abandoned holds whose writes the engine is done with off the shared book; their bases.

        The engine is asked outside the lock (send() takes it); an entry leaves the book under it, so
        registries retrying at once never let go of one twice.
        """
        poll = self.engine.poll  # type: ignore[attr-defined]  # only such engines' holds are handed over
        with self.lock:
            entries = list(self._shared.abandoned)
        for batches, _ in entries:
            for batch in list(batches):
                try:
                    over = poll(batch)
                except Exception:  # noqa: BLE001 - failed (or forgotten once over): unregister() judges the rest
                    over = True
                if over:
                    batches.discard(batch)
        with self.lock:
            done = [entry for entry in self._shared.abandoned if not entry[0]]
            self._shared.abandoned[:] = [entry for entry in self._shared.abandoned if entry[0]]
        return [bases for _, bases in done]


@dataclass(eq=False)  # one write, told apart from another by identity (the book removes it by that)
class _Flight:
    """A write submitted to the engine and not yet settled."""

    wid: int
    batch: int  # the engine's batch id; 0 when the write already completed
    session: str
    nbytes: int
    checksums: tuple[int, ...]
    submitted_at: float
    srcs: tuple[int, ...] = ()  # the sources it reads, and their lengths
    lengths: tuple[int, ...] = ()

    @property
    def reads(self) -> Iterator[tuple[int, int]]:
        """(address, bytes) of the sources it reads."""
        return zip(self.srcs, self.lengths)


class EncodeDriver:
    """The thread that serves one EncodeCore: requests in, writes out, statuses pushed."""

    def __init__(self, core: EncodeCore, engine: TransferEngineLike, engine_rank: int, host: str, port: PortSpec,
                 book: RoomBook, sources: SourceRegistry, metrics: Metrics, *, integrity: bool = True,
                 poll_min_s: float = POLL_MIN_S, poll_max_s: float = POLL_MAX_S, clock=time.monotonic,
                 sleep=time.sleep) -> None:
        self.core = core
        self.engine = engine
        self._write_async = getattr(engine, "write_async", None)  # None: the engine writes synchronously
        self.engine_rank = engine_rank
        self._forks = _forks.count  # see check_process
        self.book = book
        self.sources = sources
        self.metrics = metrics
        self.integrity = integrity
        self.polls = PollSchedule(poll_min_s, poll_max_s)
        self.clock = clock
        self._pause = sleep  # between the polls of the writes closing waits for
        self.commands: deque[tuple] = deque()  # posted by the caller's thread, taken by the driver's
        self._taking = True  # whether the thread will still take commands (under the room book's lock)
        self.waker = _io.Waker()
        try:
            self.pull, self.port = _io.pull_socket(host, port, f"encode rank {engine_rank}'s request socket")
        except BaseException:
            self.waker.close()
            raise
        self.statuses = _io.Pushers(on_dropped=lambda count: metrics.inc("statuses_dropped_total", count))
        # Each with a line budget of its own: a peer flooding malformed requests silences none of the core's.
        self._complaints = _io.ThrottledLog(log)  # about requests peers sent
        self._warnings = _io.ThrottledLog(log)  # the core's
        self._flights: list[_Flight] = []
        self._select_fds: list[int] | None = None  # what a sub-millisecond wait watches, when select() can
        self._fds = (-1, -1)  # the waker's and the request socket's descriptors, once the thread runs
        self._stop = False
        self.close_by: float | None = None  # when close() stops waiting for the thread (driver clock)
        self._close_reserve = CLOSE_AFTER_WRITES_S  # what of the close's time the writes leave to the rest
        self.thread = threading.Thread(target=self._run, name=f"epd-encode-{engine_rank}", daemon=True)

    # ------------------------------------------------------ the caller's side

    @property
    def forked(self) -> bool:
        """Whether this process was forked from the one that made this driver (which holds its thread, its
        sockets and the pool's bootstrap route)."""
        return self._forks != _forks.count

    def check_process(self) -> None:
        """UsageError in a process forked from the one that made this driver: no thread here would serve
        what it is given, and the prefill ranks ask the parent."""
        if self._forks != _forks.count:  # self.forked, without its call
            raise UsageError(f"encode rank {self.engine_rank}'s sender pool was made before this process "
                             f"(pid {os.getpid()}) was forked from its parent: its thread, sockets and bootstrap "
                             f"route are the parent's; make a SenderPool in this process")

    def start(self) -> None:
        self.thread.start()

    def offer(self, offer: Offer) -> None:
        """Hands the driver an item; wakes it only when the item may start or conclude something now.

        An item none of whose receivers asked yet only waits in the core, so it waits in
        the queue instead, for the turn its first ask wakes the driver for (a turn takes
        the queue before the requests), or the next one. Nothing is lost to a race: this
        queues the item before looking at the core, and the driver parks an ask before it
        looks at the queue, so either this sees the ask (and wakes the driver) or the
        driver sees the item.
        """
        self.commands.append(("offer", offer))
        if self.core.expects(offer.room):
            self.waker.wake()

    def post(self, *command: object, wake: bool = True) -> None:
        """Hands the driver a command (('clear', room, state)) and wakes it, unless it may wait for
        the driver's next turn (at most the core's next wake-up away when the pool is idle).

        Called under the room book's lock. Once the thread takes no more commands (it
        stopped: closed, or failed) nothing is queued: its close let go of every item and
        of the sources no write in flight reads, so a clear has nothing left to do.
        """
        if not self._taking:
            return
        self.commands.append(command)
        if wake:
            self.waker.wake()

    @property
    def stop_asked(self) -> bool:
        """Whether stop() was called."""
        return self._stop

    def stop(self, close_by: float | None = None) -> None:
        """Asks the thread to settle its writes, fail what is left and close its sockets, by `close_by`
        (driver clock) when given: writes still in flight CLOSE_AFTER_WRITES_S before it (half the time
        left, where that is less) are abandoned."""
        if close_by is not None:
            self._close_reserve = min(CLOSE_AFTER_WRITES_S, max(0.0, close_by - self.clock()) / 2)
            self.close_by = close_by
        self._stop = True
        self.waker.wake()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        """The thread: serves until stopped; however it ends (in setting up too), it closes."""
        try:
            _io.name_this_thread(f"epd-enc{self.engine_rank}")
            poller = select.poll()
            poller.register(self.pull.fileno(), select.POLLIN)  # the socket's FD option
            poller.register(self.waker.fileno(), select.POLLIN)
            self._fds = (self.waker.fileno(), self.pull.fileno())
            self._select_fds = list(self._fds) if max(self._fds) < SELECT_FD_LIMIT else None
            polls = self.polls
            sources = self.sources
            # The core's `busy` (writes wait for a slot or a ready event), read off its scheduler without the
            # property's call.
            scheduler = self.core.scheduler
            dropping = sources.due  # read each turn without a call: the registrations no room holds any more
            more_requests = False  # the last round left requests queued (the socket's FD will not signal them)
            next_retry = self.clock() + RETRY_RELEASES_S
            while not self._stop:
                busy = bool(self._flights) or scheduler.waiting > 0
                # Only this thread changes the core: its wake-up holds until the sleep is over.
                due = self.core.next_wakeup()
                if more_requests or self.commands:
                    timeout = 0.0
                else:
                    now = self.clock()
                    timeout = polls.sleep_s(now) if busy else max(0.0, due - now)
                    if dropping:  # more than one turn's batch was let go of: the next turn drops more
                        timeout = 0.0
                woken, asked = self._sleep(poller, timeout)
                # The flag saves a system call per loop; the pipe's readability covers a
                # wake() caught between setting the flag and writing its byte.
                if woken or self.waker.pending():
                    self.waker.drain()
                now = self.clock()
                if now - due >= LATE_TICK_S:
                    # Held up past the tick's time: the asks that came meanwhile are read below, and
                    # the core judges them with its rules held back, as asks that may have come in time.
                    self._carry(self.core.tick(now, unread=True))
                if self.commands:
                    self._take_commands()
                # A socket drained empty signals its descriptor for whatever comes next: one
                # that stayed quiet has nothing new, and a turn that only polls writes skips it.
                if asked or more_requests:
                    more_requests = self._drain_requests()
                now = self.clock()
                due = self.core.next_wakeup()
                if scheduler.waiting or now >= due:
                    # Asks that came before a room's time-out count: when some may still be unread,
                    # the core gives the next rounds a moment to read them.
                    self._carry(self.core.tick(now, unread=unread(now, due, more_requests)))
                if self._flights:
                    self._settle()
                elif scheduler.waiting:  # only writes held by their ready events: back off as for writes
                    polls.idle()
                if now >= next_retry:
                    sources.retry()
                    next_retry = now + RETRY_RELEASES_S
                if dropping:  # what this turn's rooms let go of, in one engine call
                    sources.flush(DROP_BATCH)
        except BaseException as exc:  # a bug here must not leave rooms hanging silently
            log.exception("the sender pool's thread failed; failing its rooms")
            self._failed(f"sender pool stopped: {type(exc).__name__}: {exc}")
        finally:
            self._close()

    def _sleep(self, poller: select.poll, timeout: float) -> tuple[bool, bool]:
        """Waits for a request, a wake-up or `timeout` seconds; whether the waker's pipe and the
        request socket's descriptor are readable (the latter True when not known).

        poll() counts whole milliseconds, so a shorter wait (writes in flight) goes
        through select(), which counts microseconds and still returns as soon as a
        request or a wake-up comes: an ask that completes a room's fanout starts its
        writes at once instead of after the sleep. Descriptors past select()'s range
        check once and sleep. ZMQ's FD only signals that the socket's state may have
        changed: the loop sleeps only after a drain that found the socket empty, so a
        message queued since then has signalled the FD.
        """
        waker, pull = self._fds
        if 0 < timeout < 1e-3:
            if self._select_fds is not None:
                readable, _, _ = select.select(self._select_fds, (), (), timeout)
                return waker in readable, pull in readable
            if not poller.poll(0):
                time.sleep(timeout)
            return True, True
        woken = asked = False
        for fd, _ in poller.poll(math.ceil(timeout * 1e3)):
            if fd == waker:
                woken = True
            if fd == pull:
                asked = True
        return woken, asked

    def _take_commands(self) -> None:
        """Files the commands posted (items sent, rooms cleared) with the core and carries its answers."""
        self._carry(self._answer_commands())

    def _answer_commands(self) -> list:
        """Files the commands posted so far with the core, in order; its answers, not yet carried."""
        actions: list = []
        while self.commands:
            command = self.commands.popleft()
            now = self.clock()
            if command[0] == "offer":
                actions += self.core.offer(command[1], now)
            else:
                _, room, state = command
                actions += self.core.clear(room, state, now)
        return actions

    def _drain_requests(self) -> bool:
        """Files up to MAX_REQUESTS_PER_ROUND queued requests, in order; True when more may be queued.

        Plain asks come parsed in one native call (`_io.take_asks`); any other message (a
        registration, a cancel, a malformed one) stops that call and goes `_request`.
        """
        left = MAX_REQUESTS_PER_ROUND
        while left > 0:
            asks, frames, empty = _io.take_asks(self.pull, left)
            left -= len(asks) + 1  # the message that ended the call, if any: one read, filed or discarded
            for info in asks:
                answer = self.core.ask(info, self.clock())
                if answer:  # none for an ask that leaves its room's fanout incomplete
                    self._carry(answer)
            if frames is not None:
                self._request(frames)
            if empty:
                return False
        return True

    def _request(self, frames: list[bytes]) -> None:
        """Files one request that is not a plain ask; a malformed one is logged and dropped."""
        try:
            if is_registration(frames):
                reg = parse_registration(frames)
                # A receiver that (re)announced itself gets a fresh status connection: statuses
                # queued for a predecessor at the same address never reach it.
                self.statuses.expect(reg.endpoint, reg.port)
                self._carry(self.core.registration(reg, self.clock()))
                return
            if is_cancel(frames):
                cancel = parse_cancel(frames)
                # A clear() posted meanwhile reaches the core first, as for a write.
                self._take_commands()
                self._carry(self.core.cancel(cancel, self.clock()))
                return
            info = TransferInfo.from_frames(frames)
        except WireError as exc:
            self._complaints.warning(str(exc), "dropped a malformed request (%d parts): %s", len(frames), exc)
            return
        self._carry(self.core.ask(info, self.clock()))

    # --------------------------------------------------------------- actions

    def _carry(self, actions: list) -> None:
        """Carries out the core's actions, and those its answers to them bring, in order.

        `actions` (the core's answer, this call's to use up) takes those answers in place: a list's
        loop goes on to what was put after its place, at the end or right after it. A count that raises
        (the caller's metrics) stops none of the actions after it (the Failed statuses and releases of the
        other rooms): the first such error is raised once they are carried out.
        """
        error: Exception | None = None
        for at, action in enumerate(actions):
            kind = type(action)
            if kind is PushStatus:
                if action.cancel is None:
                    failure = action.failure
                    frames = status_frames(action.room, action.status, self.engine_rank, action.checksums,
                                           None if failure is None else (failure.kind.value, failure.detail))
                else:
                    frames = cancel_reply_frames(action.room, self.engine_rank, action.cancel)
                self.statuses.send(action.endpoint, action.port, frames)
            elif kind is StartWrite:
                if self.commands:
                    # A clear() posted meanwhile reaches the core before any byte is written: the
                    # answers come first, then this write, in this loop (a burst of items does not nest).
                    actions[at + 1:at + 1] = [*self._answer_commands(), action]
                    continue
                answer = self._start(action)
                if answer:  # mostly none: the write went out
                    actions.extend(answer)
            elif kind is Conclude:
                try:
                    self.book.conclude(action.token, action.status, action.failure, action.at)
                except Exception as exc:  # noqa: BLE001 - its count's: the room concluded, and waiters were told
                    error = error or exc
            elif kind is Progress:
                self.book.progress(action.token, action.status, action.asked_at, action.at)
            elif kind is Release:
                release, action.token.release = action.token.release, None
                if release is not None:
                    release(later=True)  # dropped with others in one engine call (the turn's flush)
            elif kind is Warn:
                self._warnings.warning(action.key, action.message, *action.args)
            elif kind is Count:
                try:
                    self.metrics.inc(action.metric, reason=action.reason)
                except Exception as exc:  # noqa: BLE001 - raised once the rest is carried out
                    error = error or exc
        if error is not None:
            raise error

    def _start(self, write: StartWrite) -> list:
        """Submits one receiver's shard without waiting; returns the core's answer when it did not start."""
        if not self.core.wants(write.wid):
            return self.core.write_skipped(write.wid, self.clock())
        submitted_at = self.clock()
        write_async = self._write_async
        try:
            if write_async is not None:
                batch = write_async(write.session_id, write.srcs, write.dsts, write.lengths)
            else:  # an engine without an async API writes synchronously here (batch 0: nothing to poll)
                self.engine.write(write.session_id, write.srcs, write.dsts, write.lengths)
                batch = 0
        except Exception as exc:  # noqa: BLE001 - any failure concludes the room
            now = self.clock()
            return self.core.write_failed(write.wid, str(exc), now - submitted_at, now, blocking=True)
        if write.token is not None:
            write.token.submitted_at = self.clock()
        # The checksums are computed while the batch is on the wire. If that fails the
        # room fails, and the write is still tracked until the engine is done with it.
        checksums: tuple[int, ...] = ()
        answer: list = []
        if self.integrity:
            try:
                checksums = tuple(_io.checksum(region, addr, n)
                                  for region, addr, n in zip(write.sources, write.srcs, write.lengths))
            except Exception as exc:  # noqa: BLE001 - e.g. a device error: this room only
                answer = self.core.checksum_failed(write.wid, str(exc), self.clock())
        nbytes = write.nbytes
        self.polls.started(nbytes, submitted_at)
        self._flights.append(_Flight(write.wid, batch, write.session_id, nbytes, checksums, submitted_at,
                                     write.srcs, write.lengths))
        return answer

    def _settle(self) -> bool:
        """Settles the writes that completed; True when any did.

        A session's writes mostly complete in the order they were submitted, so polling
        stops at each session's first unfinished write: one status call per busy receiver
        per round, not one per write in flight; a later write that finished first is seen
        once those before it are. A write leaves the book of writes in
        flight only once the engine is done with it: if telling the core about one
        raises, the others are still listed, so closing waits for them and keeps the
        sources they read.
        """
        busy: set[str] = set()
        settled = False
        poll = getattr(self.engine, "poll", None)  # looked up each round: None for an engine that only waits
        for flight in list(self._flights):  # writes started meanwhile wait for the next round
            if flight.session in busy:
                continue
            if self._settled(flight, poll):
                settled = True
            else:
                busy.add(flight.session)
        self.polls.polled(settled, len(busy))
        return settled

    def _settled(self, flight: _Flight, poll: Callable[[int], bool] | None) -> bool:
        """Whether the write is over (`poll`: the engine's, None to wait for it); if so, takes it off the
        writes in flight and tells the core."""
        failed: str | None = None
        try:
            if flight.batch:
                if poll is None:
                    self.engine.wait(flight.batch)
                elif not poll(flight.batch):
                    return False
        except Exception as exc:  # noqa: BLE001 - any failure concludes the room
            failed = str(exc)
        self._flights.remove(flight)  # the engine is done with it, whatever the core makes of it
        now = self.clock()
        if failed is not None:
            self._carry(self.core.write_failed(flight.wid, failed, now - flight.submitted_at, now))
        else:
            try:
                self.metrics.inc("bytes_written_total", flight.nbytes)
            finally:  # the write is over however its count went (the caller's metrics): the core hears of it
                self._carry(self.core.write_done(flight.wid, flight.checksums, now))
        return True

    def _writes_deadline(self, deadline: float) -> float:
        """`deadline`, or earlier where a close() bounds the thread (close_by, which it may set meanwhile)."""
        close_by = self.close_by
        return deadline if close_by is None else min(deadline, close_by - self._close_reserve)

    def _wait_for_writes(self, deadline: float) -> None:
        """Settles the writes in flight until none is left or `deadline` passes (closing; see _writes_deadline).

        A failure while settling one (the core or the room book raising) is logged once
        and the wait goes on: each such failure comes after its write left the book, so
        the others are still waited for, and their sources kept until they are over.
        """
        logged = False
        while self._flights and self.clock() < self._writes_deadline(deadline):
            before = len(self._flights)
            try:
                if self._settle():
                    continue
            except Exception:
                if not logged:
                    log.exception("sender pool of encode rank %d: settling a write failed while closing; waiting "
                                  "for the others all the same", self.engine_rank)
                    logged = True
                if len(self._flights) < before:
                    continue
            self._pause(self.polls.max_s)

    # --------------------------------------------------------------- closing

    def _failed(self, detail: str) -> None:
        """The loop failed: no send is accepted, and every open room fails with `detail`."""
        with self.book.lock:
            self.book.stopping = True
            self.book.failure = detail
        now = self.clock()
        try:
            self.core.stop_writes()
            # _close() settles the writes in flight next: each room is released once its writes are over.
            self._carry(self.core.close(now, detail, give_up_writes=False))
        except Exception:
            log.exception("the encode core could not fail its rooms; failing them in the room book")
        self.book.fail_open(Failure(FailureKind.CLOSED, detail), now)

    def _abandon(self, waited: float) -> str:
        """Logs the writes still in flight that closing gives up on after `waited` seconds; the failure
        detail of their rooms."""
        writing = self.core.writing()
        rooms = sorted({room for room, _ in writing})
        sessions = sorted({flight.session for flight in self._flights})
        log.error("sender pool of encode rank %d: closing abandoned %d writes (%d bytes) still in flight after "
                  "%.1fs to %s, of rooms %s; their rooms fail, and the temporary registrations of the sources they "
                  "read stay until the engine is done with those writes (then the next sender pool on it drops "
                  "them) or closes", self.engine_rank,
                  len(self._flights), sum(flight.nbytes for flight in self._flights), waited, _some(sessions, 8),
                  _some(rooms, 20))
        remedy = ("check that prefill rank, or raise close_timeout_s (EPD_CLOSE_TIMEOUT_S) to wait longer"
                  if self.close_by is not None else "check that prefill rank")
        return (f"sender pool closed with this room's write still in flight after {waited:.1f}s (its receiver "
                f"stopped reading: a prefill rank stopped, wedged or unreachable?); the write was abandoned, and "
                f"its bytes may still land; {remedy}")

    def release_sources(self, until: float = math.inf) -> None:
        """Lets go of the pool's source registrations that no room releases any more, but those
        writes still in flight read (the thread stopped, or never settled them): those go to the
        engine's shared book, let go of once the engine is done with the writes
        (SourceRegistry.leave_to_engine). Unregisters those no room holds, in batches, until
        `until` (driver clock): the rest stay registered, due to be dropped by the next
        flush of any sender pool on the engine (its driver's next retry) or by the engine's close.

        The core releases every room once nothing reads it; after the thread failed, the
        rooms it lost on the way (an item it never filed, actions it never carried out)
        would otherwise hold their registrations for the engine's life. Idempotent.
        """
        try:
            let_go = self.sources.release_all(read for flight in self._flights for read in flight.reads)
            # Nothing polls the writes left in flight any more: what they read goes once the engine is done.
            self.sources.leave_to_engine((flight.batch, flight.reads) for flight in self._flights)
            self.sources.flush(until=until, clock=self.clock)
        except Exception:
            log.exception("sender pool of encode rank %d: dropping its temporary source registrations failed",
                          self.engine_rank)
            return
        if let_go:
            log.info("sender pool of encode rank %d: let go of the temporary source registrations of %d rooms its "
                     "stopped thread never released", self.engine_rank, let_go)

    def _close(self) -> None:
        """Settles what was submitted (until close_by less its reserve (stop()), at most CLOSE_WAIT_S), fails
        the rest (naming the writes abandoned), lets go of every room's
        sources but those writes still in flight read, closes the sockets (whatever failed before)."""
        try:
            self._close_rooms()
        finally:
            for what, close in (("request socket", lambda: self.pull.close(0)),
                                # the Failed statuses just pushed still go out
                                ("status sockets", lambda: self.statuses.close(linger_ms=self._linger_ms())),
                                ("waker", self.waker.close)):
                try:
                    close()
                except Exception:
                    log.exception("sender pool of encode rank %d: closing its %s failed", self.engine_rank, what)
            for throttled in (self._complaints, self._warnings, self.book.failures):
                throttled.flush()  # the counts of warnings left out that no later one will tell

    def _linger_ms(self) -> int:
        """How long the statuses pushed while closing may take to leave: CLOSE_LINGER_MS, cut to what is
        left before close_by."""
        if self.close_by is None:
            return CLOSE_LINGER_MS
        return max(0, min(CLOSE_LINGER_MS, int((self.close_by - self.clock()) * 1000)))

    def _close_rooms(self) -> None:
        started = self.clock()
        deadline = started + CLOSE_WAIT_S
        try:
            self.core.stop_writes()
            self._take_commands()
        except Exception:
            log.exception("closing the sender pool's driver failed")
        self._wait_for_writes(deadline)
        try:
            self._take_commands()
            stuck = self._abandon(self.clock() - started) if self._flights else None
            self._carry(self.core.close(self.clock(), stuck=stuck))
        except Exception:
            log.exception("closing the sender pool's driver failed")
        with self.book.lock:  # send() and clear() post under it: nothing is queued after this
            self.book.stopping = True
            self._taking = False
            dropped = sum(command[0] == "offer" for command in self.commands)
            self.commands.clear()  # items never filed (the core raised) go, their memory with them
        if dropped:
            log.warning("sender pool of encode rank %d: dropped %d items its stopped thread never filed",
                        self.engine_rank, dropped)
        try:
            self.book.fail_open(Failure(FailureKind.CLOSED, "sender pool closed"), self.clock())
        finally:  # however the rooms' counts went (the caller's metrics): the sources go all the same
            # The sockets close next, their linger cut to what is left before close_by.
            self.release_sources(math.inf if self.close_by is None else self.close_by - self._close_reserve / 2)
            if not self._flights:
                self.sources.retry()  # registrations an abandoned write held, if the engine let go since

"""The encode side: a sender pool that writes each item's row shards into the prefill
ranks that asked for it (SPEC.md sections 5, 6 and 8).

This is the public face: argument checks, source registration, and commands to the
driver (transfer.drive.encode), whose one thread owns the sockets, the engine calls
and the clock, and feeds the room rules (transfer.core.encode) their events.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transfer import _io, config
from transfer.bootstrap import BootstrapClient
from transfer.core import breaker as _breaker
from transfer.core.encode import EncodeCore, Offer
from transfer.core.failure import CLEARED, Failure, FailureKind
from transfer.core.parked import ParkedAsks
from transfer.core.regions import MAX_SESSIONS
from transfer.drive.encode import EncodeDriver, RoomBook, RoomState, SourceRegistry
from transfer.errors import BootstrapNoRoute, ConfigError, ConfigTypeError, EngineError, UsageError
from transfer.frames import (
    DTYPE_BYTES,
    MAX_REGIONS_PER_SESSION,
    check_parallel,
    check_room,
    dtype_size,
    normalize_dtype,
    scalar_int,
    scalar_ints,
    size_problem,
)
from transfer.interfaces import EventLike, TransferEngineLike
from transfer.metrics import Metrics, declare_role
from transfer.ports import PortSpec
from transfer.status import TransferPoll

if TYPE_CHECKING:
    import torch

__all__ = ["DEAD_AFTER_S", "DEAD_SESSION_MAX_S", "DEAD_SESSION_S", "DEAD_STALL_FACTOR", "MAX_REGIONS_PER_SESSION",
           "MAX_SESSIONS", "SendHandle", "SenderPool"]

log = logging.getLogger("transfer.sender")

#: After a write to a prefill session failed slowly (DEAD_AFTER_S or longer), later writes
#: to it fail at once for DEAD_SESSION_S, or until it registers again, a write to it lands, or
#: (once, unless that write was a stall) it asks again; a submission that held the thread for
#: `t` seconds pauses it DEAD_STALL_FACTOR * t (at most DEAD_SESSION_MAX_S).
DEAD_SESSION_S = _breaker.PAUSE_S
DEAD_AFTER_S = _breaker.SLOW_AFTER_S
DEAD_STALL_FACTOR = _breaker.STALL_FACTOR
DEAD_SESSION_MAX_S = _breaker.MAX_PAUSE_S

#: How long close() gives the bootstrap server to drop this rank's route (one attempt).
UNREGISTER_TIMEOUT_S = 1.0

#: How often, on average, a registered pool asks the bootstrap server whether it still lists the pool's
#: route, and registers again where the server has none for this rank (it restarted and lost its routes).
#: Each wait is drawn from [0.5, 1.5] x this (route_check_wait), so pools started together ask apart.
ROUTE_CHECK_S = 5.0

#: After a check that failed (no answer, an HTTP error such as 503 for too many connections from one
#: address, a registration again refused), the next comes after about this long, doubled for each failed
#: check in a row up to ROUTE_CHECK_S (route_check_wait).
ROUTE_RETRY_S = 0.5

#: How long one such check (a look-up, and a registration where one is due) may take.
ROUTE_CHECK_TIMEOUT_S = 2.0

#: A registration again that keeps failing the same way (a server restarted with another token answers
#: 401 at every check) is logged once per this many seconds, with a count of the checks left out.
ROUTE_REFUSED_LOG_S = 300.0


def route_check_wait(failures: int, rng: random.Random) -> float:
    """Seconds a pool's route keeper waits before its next check, after `failures` checks in a row that
    failed (0: the last one settled, or none ran yet): uniformly in [0.5, 1.5] x ROUTE_CHECK_S, or, after
    failed checks, x ROUTE_RETRY_S * 2 ** (failures - 1) up to ROUTE_CHECK_S. The draw keeps pools started
    together (the ranks of one host) from asking the server at the same moments; the shorter waits ask a
    server that was busy (503) or restarting again within a second or so, not a whole period later."""
    base = ROUTE_CHECK_S if failures <= 0 else min(ROUTE_RETRY_S * 2.0 ** min(failures - 1, 32), ROUTE_CHECK_S)
    return base * rng.uniform(0.5, 1.5)


class SendHandle(_io.RoomHandle[RoomState]):
    """One room's progress on the encode side: poll(), failure, latency_s, wait(), clear()."""

    def __init__(self, pool: SenderPool, state: RoomState) -> None:
        super().__init__(pool._table, state, pool._book.conclusions, pool._book.held.get)
        self._pool = pool

    def __del__(self) -> None:
        # Only clear() lets the pool drop the room's item before it closes: a handle dropped without it is a leak.
        try:
            if self._current() and not self._pool._book.closed:
                warnings.warn(f"room {self.room}'s handle was dropped without clear(): the sender pool keeps the "
                              f"room and its source until it closes", ResourceWarning, stacklevel=2)
        except Exception:  # noqa: BLE001 - nothing may escape a finalizer
            pass

    def clear(self) -> None:
        """Forgets a concluded room (an unconcluded one is failed first).

        The pool's thread lets go of a served room's item on its next turn: at once on a
        busy pool, within half a second on an idle one. In a process forked from the one that
        made the pool it does nothing: the room is the parent's.
        """
        self._pool._forget(self._state)


class SenderPool:
    """An encode rank's sending side."""

    def __init__(
        self,
        engine: TransferEngineLike,
        engine_rank: int,
        tp_size: int,
        dp_size: int,
        bootstrap_addr: str,
        *,
        host: str | None = None,
        port: PortSpec = 0,
        token: str | None = None,
        fanout_timeout_s: float | None = None,
        register_timeout_s: float | None = None,
        integrity: bool = True,
        depth: int | None = None,
        max_parked_bytes: int | None = None,
        metrics: Metrics | None = None,
        bootstrap_timeout_s: float | None = None,
        poll_min_s: float | None = None,
        poll_max_s: float | None = None,
        close_timeout_s: float | None = None,
    ) -> None:
        """Registers this rank with the bootstrap server, blocking up to `register_timeout_s`.

        Defaults come from the environment (README, Configuration): `fanout_timeout_s`
        EPD_FANOUT_TIMEOUT_S (120 s), `register_timeout_s` EPD_REGISTER_TIMEOUT_S (30 s), `depth`
        EPD_SEND_DEPTH (32), `max_parked_bytes` EPD_MAX_PARKED_BYTES (64 MiB), `poll_min_s` and
        `poll_max_s` EPD_POLL_MIN_S and EPD_POLL_MAX_S (100 us and 1 ms: writes in flight are
        polled at most every poll_min_s, at that gap while a write of at most 1 MiB is new,
        otherwise at doubling waits up to poll_max_s; transfer.core.polls), `close_timeout_s`
        EPD_CLOSE_TIMEOUT_S (10 s: what close() takes at most, see there).
        `bootstrap_timeout_s` is the deprecated name of `fanout_timeout_s`. Raises ConfigError
        for a bad argument or variable, ConfigTypeError for an argument of the wrong type (a rank
        or size that is not an int, a port that is not an int, pair or string, an `integrity`
        that is not True or False, an `engine` that is not one), EngineError for an engine already closed,
        BootstrapError when the registration fails.
        """
        engine_rank, tp_size, dp_size = check_parallel(engine_rank, tp_size, dp_size)
        fanout_timeout_s = config.renamed("SenderPool", "bootstrap_timeout_s", bootstrap_timeout_s,
                                          "fanout_timeout_s", fanout_timeout_s)
        fanout_timeout_s = config.resolve("EPD_FANOUT_TIMEOUT_S", fanout_timeout_s)
        register_timeout_s = config.resolve("EPD_REGISTER_TIMEOUT_S", register_timeout_s)
        depth = config.resolve("EPD_SEND_DEPTH", depth)
        max_parked_bytes = config.resolve("EPD_MAX_PARKED_BYTES", max_parked_bytes)
        poll_min_s = config.resolve("EPD_POLL_MIN_S", poll_min_s)
        poll_max_s = config.resolve("EPD_POLL_MAX_S", poll_max_s)
        close_timeout_s = config.resolve("EPD_CLOSE_TIMEOUT_S", close_timeout_s)
        config.check_polls("SenderPool", poll_min_s, poll_max_s)
        integrity = config.check_flag("SenderPool", "integrity", integrity)
        bootstrap = BootstrapClient(bootstrap_addr, token=token)  # the address and token, checked before any start
        config.check_engine("SenderPool", engine)
        if getattr(engine, "closed", False):
            # Its route would send prefill ranks to a pool none of whose writes can start.
            raise EngineError(f"engine {engine.session_id} is closed: give the sender pool an open engine")
        self.engine = engine
        self.engine_rank = engine_rank
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.host = _io.peer_address(host or engine.hostname, "host")
        self.fanout_timeout_s = fanout_timeout_s
        self.register_timeout_s = register_timeout_s
        self.integrity = integrity
        self.depth = depth
        self.max_parked_bytes = max_parked_bytes
        self.poll_min_s = poll_min_s
        self.poll_max_s = poll_max_s
        self.close_timeout_s = close_timeout_s
        self.metrics = metrics or Metrics("epd_encode")
        declare_role(self.metrics, "encode", engine_rank)

        self._cuda: bool | None = None  # whether this process can hold CUDA memory, once a raw source asks
        self._readable: dict[tuple[int, int], bool] = {}  # registrations holding raw sources: host memory?

        # Its close lets go of the metrics; a pool that never starts, at once.
        release_metrics = self.metrics.claim(f"the sender pool of encode rank {engine_rank}")
        try:
            self._book = RoomBook(self.metrics)
            self._table = self._book.table
            self._sources = SourceRegistry(engine)
            self._core = EncodeCore(fanout_timeout_s=fanout_timeout_s, depth=depth,
                                    parked=ParkedAsks(max_bytes=max_parked_bytes), now=time.monotonic())
            self._driver = EncodeDriver(self._core, engine, engine_rank, self.host, port, self._book, self._sources,
                                        self.metrics, integrity=integrity, poll_min_s=poll_min_s,
                                        poll_max_s=poll_max_s)
            self.port = self._driver.port
            self._thread = self._driver.thread
            # The metrics (which the driver holds) read the parts, never the pool: a pool dropped
            # without close() is collected, and its finalizer closes it.
            core = self._core
            # Through the claim: they leave the metrics with it, at close.
            release_metrics.gauge_fn("queue_depth", lambda: core.writes_to_start)
            release_metrics.gauge_fn("parked_rooms", self._book.parked)
            self._driver.start()
            # The instance names this pool's registration: its withdrawal leaves a successor's at the same port alone.
            book = self._book  # the route reads the book, never the pool (its finalizer needs it collected)
            self._route = _Route(bootstrap_addr, token, tp_size, dp_size, self.host, self.port, engine_rank,
                                 secrets.token_hex(16), serving=lambda: not book.stopping)
            self._dropped = weakref.finalize(self, _close_dropped, self._book, self._driver, self._route,
                                             release_metrics, close_timeout_s)
        except BaseException:
            release_metrics()
            raise
        self._release_metrics = release_metrics
        self._dropped.atexit = False  # at exit the daemon threads go with the process
        self._register(bootstrap, register_timeout_s)

    def _register(self, bootstrap: BootstrapClient, register_timeout_s: float) -> None:
        """Lists the started pool's route at the bootstrap server, retrying up to `register_timeout_s`, and
        keeps it listed (`_Route.keep`). A refusal, or a stop signal's exception (KeyboardInterrupt), closes
        the pool, withdrawing the route where the server may list it, and is raised."""
        try:
            bootstrap.register_rank(self.tp_size, self.dp_size, self.host, self.port, self.engine_rank,
                                    retry_for=register_timeout_s, instance=self._route.instance)
            self._route.listed = True
            self._route.keep()
        except BaseException:
            # A server that refused every attempt lists no route of this pool's: close() withdraws none.
            self._route.listed = bootstrap.may_have_registered
            self.close()
            raise

    @property
    def bootstrap_timeout_s(self) -> float:
        """Deprecated name of `fanout_timeout_s`."""
        warnings.warn("SenderPool.bootstrap_timeout_s is deprecated: use fanout_timeout_s", DeprecationWarning,
                      stacklevel=2)
        return self.fanout_timeout_s

    # ----------------------------------------------------------- caller side

    def send(
        self,
        room: int,
        src: torch.Tensor | int,
        deepstack: torch.Tensor | int | None = None,
        *,
        span: int | None = None,
        hidden: int | None = None,
        dtype: str | None = None,
        deepstack_hidden: int | None = None,
        ready_event: EventLike | None = None,
    ) -> SendHandle:
        """Offers `room`'s rows to the prefill ranks that ask for it; never blocks on them.

        `src` is a tensor `[span, hidden]` on any device, or a raw address with `span`,
        `hidden` and `dtype` (ints, or numpy or torch integer scalars); `deepstack` likewise
        `[span, hidden * k]` (raw: give `deepstack_hidden`). `ready_event` (e.g. a CUDA event) must complete before the
        first byte is read; the pool polls it (query()) once the room's whole fanout asked, never blocking the
        caller. One that has not completed within `fanout_timeout_s` of the send fails the room, as one whose
        query() raises does at that first poll (the failure names the error).

        Nothing is copied: the rows are read where they are once every receiver asked, which may be long
        after this returns, so leave them unchanged until the room concluded. The pool keeps the tensors
        given alive until the room is cleared or the pool closed: the caller may drop its own references
        at once (memory given by raw address is the caller's to keep).

        EngineError, nothing sent, when the engine's book of source registrations stays held for
        transfer._io.LOCK_WAIT_S (a deregistration by a pool's thread that does not return); the text
        names the thread.
        """
        self._driver.check_process()
        if self._book.stopping:
            raise self._stopped_error()
        room = check_room(room)
        if ready_event is not None and not callable(getattr(ready_event, "query", None)):
            # The pool's one thread polls it: an event it could only wait on would hold every room.
            raise ConfigTypeError(f"room {room}: ready_event must have query() (e.g. a torch.cuda.Event); "
                                  f"got {type(ready_event).__name__}")
        region, span, hidden, dtype = _source(src, span, hidden, dtype)
        if region.tensor is None:  # a raw pointer
            region = self._raw_source(room, region)
        row_bytes = hidden * DTYPE_BYTES[dtype]  # dtype_size() of a name _source() gave, with no call
        ds_region, ds_row_bytes = None, 0
        if deepstack is not None:
            deepstack = scalar_int(deepstack)
            # A raw deepstack pointer takes the item's rows and dtype; a tensor has its own, compared below.
            raw = isinstance(deepstack, int)
            ds_region, ds_span, ds_hidden, ds_dtype = _source(deepstack, span if raw else None, deepstack_hidden,
                                                              dtype if raw else None, name="deepstack")
            if raw:
                ds_region = self._raw_source(room, ds_region)
            if ds_span != span or ds_dtype != dtype:
                raise ConfigError(f"room {room}: deepstack rows {ds_span} x {ds_dtype} != item rows {span} x {dtype}: "
                                  f"give deepstack one row per item row, in the item's dtype")
            ds_row_bytes = ds_hidden * dtype_size(ds_dtype)
        if room in self._book.held:  # before registering anything; looked at again where the item is published
            raise _busy_room(room)
        state = RoomState(room, time.monotonic())
        # Registered before the item is published: a TransferInfo may dispatch it at once.
        state.release = self._hold_registered(region, ds_region)
        counted = False
        try:
            offer = Offer(room, state, region.addr, span, hidden, dtype, row_bytes,
                          None if ds_region is None else ds_region.addr, ds_row_bytes, ready_event, (region, ds_region))
            with self._book.lock:
                # Looked at under the lock close() sets it under: an item published here is
                # one the driver will serve or fail.
                if self._book.stopping:
                    refused: Exception | None = self._stopped_error()
                elif room in self._book.held:
                    refused = _busy_room(room)
                else:
                    refused = None
                    self._book.held[room] = state
                    self._table.start(room, TransferPoll.WaitingForInput)
                    # Counted before the driver has the item: no scrape sees the room concluded, or its writes
                    # queued or written, before it counts the room started.
                    self.metrics.inc("rooms_started_total")
                    counted = True
                    self._driver.offer(offer)
            if refused is None:
                return SendHandle(self, state)
        except BaseException as exc:
            try:
                self._withdraw(state, counted, exc)
            except Exception as count_error:  # noqa: BLE001 - the withdrawal's count (the caller's metrics)
                # The room is withdrawn all the same: the caller gets the send's own error (a stop signal's
                # exception its handler waits for), not the count's.
                log.warning("room %d: counting the withdrawn send as failed raised %r", room, count_error)
            raise
        if state.release is not None:
            state.release()
        raise refused

    def _withdraw(self, state: RoomState, counted: bool, exc: BaseException) -> None:
        """Undoes a send() that raised before its caller had the handle: the room number is free again and
        the item's sources are let go of (by the driver, once no write reads them, if it may have the item);
        a room counted started concludes Failed, naming the error."""
        book = self._book
        try:
            if counted:
                book.conclude(state, TransferPoll.Failed,
                              Failure(FailureKind.OTHER, f"send() raised {exc!r} before returning the room's "
                                                         f"handle; the room was withdrawn"), time.monotonic())
        finally:
            with book.lock:
                published = book.held.get(state.room) is state
                if published:
                    del book.held[state.room]
                    self._table.clear(state.room)
                    # After the item, if offer() queued it: the core fails it, and releases its sources once
                    # nothing reads them; one it never filed it releases at once (EncodeCore.clear). A thread
                    # that takes no more commands let go of every hold at its close.
                    self._driver.post("clear", state.room, state)
            if not published and state.release is not None:  # nothing but this call holds its sources
                state.release()

    def _raw_source(self, room: int, region: _io.Region) -> _io.Region:
        """A raw source pointer's region: on the device of the registered tensor around it, else host memory.

        A pointer is refused where reading it would kill the process: memory it cannot read,
        unless a CUDA device exists and integrity is off (GPU memory, which only Mooncake reads).
        """
        if self._cuda is None:
            self._cuda = _io.cuda_present()
        owner = None
        if self.integrity:
            owner_of = getattr(self.engine, "owner_of", None)
            owner = owner_of(region.addr, region.nbytes) if owner_of is not None else None
        return raw_source_region(room, region, owner, readable=lambda: self._host_readable(region),
                                 cuda=self._cuda, integrity=self.integrity)

    def _host_readable(self, region: _io.Region) -> bool:
        """Whether the region is readable host memory; looked up once per registration that holds it."""
        holding = getattr(self.engine, "registration_holding", None)
        span = (holding(region.addr, region.nbytes) if holding is not None
                else next(((base, size) for base, size in self.engine.registered().items()
                           if base <= region.addr and region.end <= base + size), None))
        if span is None:
            return _io.host_readable(region.addr, region.nbytes)
        readable = self._readable.get(span)
        if readable is None:  # another send() may clear the cache meanwhile: the answer is kept here
            if len(self._readable) >= _READABLE_REGISTRATIONS:
                self._readable.clear()
            readable = self._readable[span] = _io.host_readable(*span)
        return readable

    def _hold_registered(self, *regions: _io.Region | None) -> Callable[[], None] | None:
        """Registers source regions outside registered memory; returns their release (or None)."""
        return self._sources.hold(*regions)

    def _stopped_error(self) -> UsageError:
        """Why send() is refused once the pool's thread stopped."""
        if self._book.closed:
            return UsageError("sender pool is closed: its close() ran (called, or its with block ended); "
                              "start a new SenderPool to send more")
        return UsageError(f"sender pool's thread stopped after an error ({self._book.failure}; its traceback is "
                          f"logged): close() the pool and start a new one")

    def _forget(self, state: RoomState) -> None:
        """Fails the room unless it concluded, then forgets it; the driver tells its receivers (once its
        thread stopped, it held on to nothing of the room and is posted nothing). Not in a forked child: the
        room and the book's lock are the parent's (a lock held at the fork stays held there)."""
        if self._driver.forked:
            return
        book = self._book
        # Concluded here, not by the core, so the handle reads Failed at once; the core's own
        # conclusion of this room then finds it concluded (and no longer held) and does nothing.
        try:
            book.conclude(state, TransferPoll.Failed, CLEARED, time.monotonic())
        finally:  # forgotten however the conclusion's count went: its number is free again
            with book.lock:
                if book.held.get(state.room) is state:
                    del book.held[state.room]
                    served = self._table.clear(state.room) is TransferPoll.Success  # the status it had
                    # A room served in full leaves nothing to tell anyone: the driver drops it on its
                    # next turn, without a wake-up of its own.
                    self._driver.post("clear", state.room, state, wake=not served)

    def concluded(self) -> list[int]:
        """Rooms that reached Success or Failed since the last call, oldest first, each once.

        Never blocks; a room cleared before it was handed out is left out. UsageError in a process
        forked from the one that made the pool (its rooms are the parent's).
        """
        self._driver.check_process()
        return self._table.take_concluded()

    def stats(self) -> list[dict]:
        """Every metric sample as a flat row {name, type, labels, value} (see transfer.metrics.Metrics.snapshot)."""
        return self.metrics.snapshot()

    def close(self) -> None:
        """Withdraws this rank's route from the bootstrap server, fails rooms still in flight and parked asks,
        joins the thread, closes sockets, drops temporary registrations; returns within `close_timeout_s`.

        The route goes first (at most UNREGISTER_TIMEOUT_S, after a registration again of the route
        under way, at most ROUTE_CHECK_TIMEOUT_S; a server that does not answer, or
        a peer's that knows no DELETE, leaves it listed, which is logged; a pool whose registration
        the server refused, or never reached, withdraws nothing), so prefill ranks
        stop being sent here before the socket closes. Writes already submitted are waited
        for next, until CLOSE_AFTER_WRITES_S before `close_timeout_s` runs out; those still in
        flight then (a receiver that stopped reading) are abandoned: their rooms fail saying so,
        the log names them, and the sources they read stay registered until the engine is done
        with those writes (then a sender pool on the engine, made before or after, drops the
        temporary registrations among them) or closes. Once the thread stopped (closed, or stopped
        by an error before), the pool holds no item's source, its room cleared or not; the temporary
        registrations no room holds are dropped in batches until shortly before `close_timeout_s`, and
        those left then (logged at info, with their count) stay registered until the next sender
        pool on the engine drops them, or the engine closes. A thread
        still stuck at `close_timeout_s` (inside an engine call) is left to finish alone: its rooms
        fail here, and it closes its own sockets and registrations if it ever returns. So is a caller's
        thread that holds the pool's room book for half of `close_timeout_s` (a send() inside the caller's
        metrics exporter): the open rooms fail without it. In a process
        forked from the one that made the pool, it closes nothing: the route, thread and sockets are
        the parent's. A close that raised before it asked the thread to stop (a stop signal's exception,
        KeyboardInterrupt, while it waited for the bootstrap server) is finished by a close() again, or by
        the pool's collection.
        """
        if not self._driver.forked:
            _close(self._book, self._driver, self._route, self._release_metrics, self.close_timeout_s)
        self._dropped.detach()  # only once closed: one dropped after a close that raised still closes

    def __enter__(self) -> SenderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Route:
    """Where an encode rank registered, with what: what its close asks the bootstrap server to forget."""

    bootstrap_addr: str
    token: str | None
    world_size: int
    dp_size: int
    host: str
    port: int
    engine_rank: int
    instance: str | None = None  # the nonce its PUT carried: its DELETE removes only that registration
    #: Whether the server may list the route: it took the registration, or may have (an attempt went
    #: unanswered); set once the registration is over. Only a listed route is withdrawn.
    listed: bool = False
    #: Whether the pool still serves (its thread did not stop after an error): only then is the route kept.
    serving: Callable[[], bool] = lambda: True
    #: Set when the pool closes: the keeper stops (before the route is withdrawn).
    closing: threading.Event = field(default_factory=threading.Event)
    #: Held by the close that withdraws the route and asks the pool's thread to stop; reentrant, for a
    #: close() that a signal's handler calls inside another on the same thread.
    closer: threading.RLock = field(default_factory=threading.RLock)
    keeper: threading.Thread | None = None
    #: Held by the keeper from its look at `closing` to the end of its registration again: what a
    #: closing pool waits for (a look-up under way it does not wait for).
    registering: threading.Lock = field(default_factory=threading.Lock)
    #: Its failed registrations again, by kind of error: not one line per check.
    refusals: _io.ThrottledLog = field(default_factory=lambda: _io.ThrottledLog(log, ROUTE_REFUSED_LOG_S))
    #: Draws the keeper's waits (route_check_wait); seeded from the OS, so each pool's differ.
    rng: random.Random = field(default_factory=random.Random)

    def keep(self) -> None:
        """Starts the thread that registers the route again wherever the bootstrap server lost it."""
        self.keeper = threading.Thread(target=self._keep, name=f"epd-encode-{self.engine_rank}-route", daemon=True)
        self.keeper.start()

    def _keep(self) -> None:
        failures = 0
        while not self.closing.wait(route_check_wait(failures, self.rng)):
            failures = 0 if self.check() else failures + 1

    def check(self) -> bool:
        """Registers this rank again if the server answers that it has no route for it; whether the check
        settled (False: no answer, an answer other than a route or 404, or the registration again failed;
        the next check comes sooner, see route_check_wait).

        A server that lists another endpoint or instance for the rank is left alone (never fought
        over). Once the rank has no route (that instance withdrew, or the server restarted), this pool
        registers again: it still serves its rank's requests, and a route to it beats none; only its
        close() takes it off the server. A pool whose thread stopped (its sends refused, its request
        socket closed) is not registered again."""
        if not self.serving():
            return True
        group = self.world_size // self.dp_size
        client = BootstrapClient(self.bootstrap_addr, timeout=ROUTE_CHECK_TIMEOUT_S, token=self.token)
        try:
            client.registration(self.engine_rank % group, self.engine_rank // group)
            return True
        except BootstrapNoRoute:
            pass
        except Exception as exc:  # noqa: BLE001 - unreachable, busy or odd: asked again soon
            log.debug("sender pool of encode rank %d: checking its route at bootstrap %s: %s", self.engine_rank,
                      self.bootstrap_addr, exc)
            return False
        with self.registering:
            if self.closing.is_set():
                return True
            try:
                # Only where the rank is still unlisted: another instance may have registered since the look-up.
                if not client.register_rank(self.world_size, self.dp_size, self.host, self.port, self.engine_rank,
                                            retry_for=0, instance=self.instance, only_if_absent=True):
                    return True
            except Exception as exc:  # noqa: BLE001 - tried again soon
                self.refusals.warning(type(exc), "sender pool of encode rank %d: bootstrap %s lists no route for "
                                      "it (restarted?), and registering again failed: %s", self.engine_rank,
                                      self.bootstrap_addr, exc)
                return False
        log.warning("sender pool of encode rank %d: bootstrap %s listed no route for it (restarted?): registered "
                    "%s:%d again", self.engine_rank, self.bootstrap_addr, self.host, self.port)
        return True

    def stop_keeping(self, deadline: float = math.inf) -> None:
        """Stops the keeper, waiting for a registration again under way (bounded, and by `deadline`), so none
        follows the withdrawal. A look-up under way is not waited for: its thread ends once it is answered or
        times out (ROUTE_CHECK_TIMEOUT_S), registering nothing."""
        self.closing.set()
        if self.keeper is not None and self.keeper is not threading.current_thread():
            if self.registering.acquire(timeout=_io.seconds_left(deadline, ROUTE_CHECK_TIMEOUT_S + 1.0)):
                self.registering.release()
        self.refusals.flush()  # how many failed registrations again went unlogged

    def unregister(self, deadline: float = math.inf) -> None:
        """DELETE /route for this rank, once, within UNREGISTER_TIMEOUT_S (and by `deadline`, though never in
        less than a millisecond); logs what came of it, never raises."""
        timeout = max(1e-3, _io.seconds_left(deadline, UNREGISTER_TIMEOUT_S))
        try:
            client = BootstrapClient(self.bootstrap_addr, timeout=timeout, token=self.token)
            removed = client.unregister_rank(self.world_size, self.dp_size, self.host, self.port, self.engine_rank,
                                             timeout=timeout, instance=self.instance)
        except Exception as exc:  # noqa: BLE001 - best effort: closing goes on whatever the server did
            log.info("sender pool of encode rank %d: its route to %s:%d may stay listed at bootstrap %s (prefill "
                     "ranks sent there wait out their deadlines): %s", self.engine_rank, self.host, self.port,
                     self.bootstrap_addr, exc)
            return
        log.debug("sender pool of encode rank %d: bootstrap %s %s its route to %s:%d", self.engine_rank,
                  self.bootstrap_addr, "dropped" if removed else "kept another registration (or none) as", self.host,
                  self.port)


def _close(book: RoomBook, driver: EncodeDriver, route: _Route,
           release_metrics: Callable[[], None] | None = None,
           close_timeout_s: float = config.setting("EPD_CLOSE_TIMEOUT_S").default) -> None:
    """Closes a sender pool's driver, its route withdrawn first (see SenderPool.close), and lets go of its
    metrics (another pool may record into them); returns within `close_timeout_s`."""
    engine_rank = route.engine_rank
    deadline = time.monotonic() + close_timeout_s
    # send() publishes items under the book's lock: none slips in after this. A thread holding it for half the
    # close's time is stuck (a send() inside the caller's metrics): the close goes on without it, and the send
    # it is inside publishes its item to a driver that fails it.
    locked = book.lock.acquire(timeout=_io.seconds_left(deadline, min(_io.LOCK_WAIT_S, close_timeout_s / 2)))
    try:
        book.closed = book.stopping = True
    finally:
        if locked:
            book.lock.release()
    if release_metrics is not None:
        release_metrics()
    # The close that asks the thread to stop; one that raised before it did (a stop signal's exception
    # while it withdrew the route) leaves the withdrawal and the stop to the next.
    first = False
    if route.closer.acquire(timeout=_io.seconds_left(deadline, close_timeout_s)):
        try:
            if not driver.stop_asked:
                first = True
                route.stop_keeping(deadline)
                if route.listed:
                    route.unregister(deadline)
                driver.stop(deadline)  # on the driver's clock, which a pool's driver shares (time.monotonic)
        finally:
            route.closer.release()
    thread = driver.thread
    # A later close() waits as long as the first may: its caller may close the engine next.
    if thread.ident is not None and thread is not threading.current_thread():
        thread.join(timeout=_io.seconds_left(deadline, close_timeout_s))
    if thread.ident is not None and not thread.is_alive():
        driver.release_sources(deadline)  # those of a thread that stopped before it let go of them (idempotent)
        left = driver.sources.dropping
        if first and left:
            log.info("sender pool of encode rank %d: closing left %d temporary source registrations no room holds "
                     "registered, for want of time (close_timeout_s %gs): the next sender pool on the engine drops "
                     "them, or the engine's close()", engine_rank, left, close_timeout_s)
    if first and thread.is_alive() and not locked:
        # The thread waits for the book's lock too: it closes once the stuck holder lets go.
        log.error("sender pool of encode rank %d: a thread held its room book through close_timeout_s %gs "
                  "(EPD_CLOSE_TIMEOUT_S): a send() inside the caller's metrics?; failing its rooms, leaving its "
                  "sockets and temporary source registrations to its thread, which closes them once that thread "
                  "lets go", engine_rank, close_timeout_s)
        book.fail_open(Failure(FailureKind.CLOSED, f"sender pool closed while a thread held its room book for "
                                                   f"close_timeout_s {close_timeout_s:g}s (EPD_CLOSE_TIMEOUT_S): a "
                                                   f"send() stuck inside the caller's metrics?"), time.monotonic(),
                       wait=0.0)
    elif first and thread.is_alive():
        log.error("sender pool of encode rank %d: its thread was still inside an engine call at close_timeout_s "
                  "%gs (EPD_CLOSE_TIMEOUT_S); failing its rooms, leaving its sockets and temporary source "
                  "registrations to it", engine_rank, close_timeout_s)
        book.fail_open(Failure(FailureKind.CLOSED, f"sender pool closed with its thread stuck inside an engine "
                                                   f"call for close_timeout_s {close_timeout_s:g}s "
                                                   f"(EPD_CLOSE_TIMEOUT_S): a prefill rank stopped or "
                                                   f"unreachable?"), time.monotonic())


def _busy_room(room: int) -> ConfigError:
    """Why send() refuses a room the pool still holds."""
    return ConfigError(f"room {room} is already being sent; clear() it first")


def _close_dropped(book: RoomBook, driver: EncodeDriver, route: _Route,
                   release_metrics: Callable[[], None] | None = None,
                   close_timeout_s: float = config.setting("EPD_CLOSE_TIMEOUT_S").default) -> None:
    """A SenderPool was dropped without close(): says so, and closes it on a thread of its own
    (the collection may run on any thread, the pool's own too, which closing joins). A forked child's
    copy is the parent's pool: nothing of it is this process's to close."""
    if driver.forked:
        return
    engine_rank = route.engine_rank
    warnings.warn(f"sender pool of encode rank {engine_rank} (port {route.port}) was dropped without close(): "
                  f"closing it", ResourceWarning)
    threading.Thread(target=_close, args=(book, driver, route, release_metrics, close_timeout_s),
                     name=f"epd-encode-{engine_rank}-close", daemon=True).start()


def _source(src: torch.Tensor | int, span: int | None, hidden: int | None, dtype: str | None, *,
            name: str = "src") -> tuple[_io.Region, int, int, str]:
    """(region, span, hidden, dtype) of a source tensor `[span, hidden]` or raw pointer; `name` is the
    argument it was given as ("src", or "deepstack", whose `hidden` is `deepstack_hidden`)."""
    noun, hidden_name = ("source", "hidden") if name == "src" else (name, f"{name}_hidden")
    src = scalar_int(src)
    span, hidden = scalar_ints(span, hidden)
    if isinstance(src, int):
        if span is None or hidden is None or dtype is None:
            needs = "span, hidden and dtype" if name == "src" else hidden_name
            raise ConfigError(f"a raw {noun} pointer needs {needs}")
        for arg, value, least in (("span", span, 0), (hidden_name, hidden, 1)):
            problem = size_problem(arg, value, least)
            if problem:
                raise ConfigError(f"a raw {noun}'s {problem}")
        dtype = normalize_dtype(dtype)  # the wire's spelling, which every ask carries
        return _io.Region(src, span * hidden * dtype_size(dtype)), span, hidden, dtype
    if not hasattr(src, "data_ptr"):
        raise ConfigTypeError(f"{name} must be a torch tensor or a pointer, got {type(src).__name__}")
    if str(src.layout) != "torch.strided":
        raise ConfigError(f"{noun} is a {src.layout} tensor, whose values are not rows in memory: "
                          f"pass {name}.to_dense()")
    device = src.device
    if device.type == "meta":
        raise ConfigError(f"{noun} is on device meta, which holds no memory: pass a tensor on the cpu or a cuda device")
    shape = src.shape
    if len(shape) != 2:
        raise ConfigError(f"{noun} must be 2-D [span, {hidden_name}], got shape {tuple(shape)}")
    t_span, t_hidden, t_dtype = int(shape[0]), int(shape[1]), normalize_dtype(src.dtype)
    if t_hidden < 1:
        raise ConfigError(f"{noun} of shape {tuple(src.shape)} has no columns: no receiver can ask for it")
    for arg, given, actual in (("span", span, t_span), (hidden_name, hidden, t_hidden),
                               ("dtype", None if dtype is None else normalize_dtype(dtype), t_dtype)):
        if given is not None and given != actual:
            raise ConfigError(f"{arg} {given} disagrees with the {noun} tensor's {actual}")
    if not src.is_contiguous():
        raise ConfigError(f"{noun} of shape {tuple(src.shape)} and strides {tuple(src.stride())} is not contiguous: "
                          f"its rows are not one span of memory; pass {name}.contiguous()")
    _io.refuse_lazy_view(src)
    # What _io.as_region() makes of it, its checks done above: a contiguous 2-D tensor's bytes.
    region = _io.Region(src.data_ptr(), t_span * t_hidden * DTYPE_BYTES[t_dtype], str(device), src)
    return region, t_span, t_hidden, t_dtype


#: Registrations whose readability a pool remembers (raw sources on a CUDA host).
_READABLE_REGISTRATIONS = 256


def raw_source_region(room: int, region: _io.Region, owner: Any, *, readable: Callable[[], bool], cuda: bool,
                      integrity: bool) -> _io.Region:
    """`region` (a raw source pointer's) on the device of `owner`, the registered tensor around it, if any;
    else host memory, or ConfigError where it may not be that (`_io.raw_memory_problem`)."""
    if owner is not None and hasattr(owner, "data_ptr"):
        import torch

        offset = region.addr - owner.data_ptr()
        flat = owner.reshape(-1).view(torch.uint8)[offset : offset + region.nbytes]
        return _io.Region(region.addr, region.nbytes, str(owner.device), flat)
    problem = _io.raw_memory_problem(readable, cuda=cuda, integrity=integrity)
    if problem is None:
        return region
    remedy = ("pass the tensor, register the tensor that holds it, or use integrity=False" if cuda
              else "pass the tensor, or the address of memory this process holds")
    raise ConfigError(f"room {room}: raw source pointer {region.addr:#x} ({region.nbytes} bytes) {problem}: {remedy}")

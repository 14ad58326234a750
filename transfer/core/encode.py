"""The encode side's room rules as a pure state machine (SPEC.md sections 5, 6 and 8).

`EncodeCore` takes events, each with `now` (monotonic seconds), and returns actions
for its driver to carry out; it never touches a thread, a socket, the engine or a
clock. Events: an item offered, a room cleared, a registration, TransferInfo or
cancel received (parsed already), a write completed, failed or skipped, a tick, close.
Actions: start a write, push a status, advance or conclude a room, release a source,
and warnings for the throttled log.

A receiver that asked is told Failed as soon as nothing will serve it, since a peer
has no deadline of its own: its room was cleared before the whole fanout asked (and
not sent again within CLEARED_GRACE_S), the room already has its maximum of
receivers, or its write could not start within the fanout timeout of the room's
first ask (nor can it once that much time passed with the fanout still incomplete).

A receiver that gave up on a room sends a cancel (our extension): its parked ask
or queued write is dropped and the room concludes Failed (`cancelled`), never
Success. Its answer says whether the receiver's memory is safe now (nothing was or
will be written) or a write was already in flight; then a second answer follows
once that write is over. A receiver that failed a room before asking for it sends an
unasked cancel: the room's fanout cannot complete, so its item fails at once (or when
it comes), telling the receivers that asked Failed instead of holding them for the
fanout timeout; it is not answered (see `_unasked`).

A receiver may give a room up and ask for it again at once (cancel, then ask). An
item that comes within REASK_GRACE_S of the cancel of a parked ask waits the rest of
that grace for the receiver's new ask and is written to it; without one, the cancel
fails it then. A new ask for a room that the receiver's own cancel failed is told
Failed at once, saying so. A served item is never written again: a new ask for a
room served before its cancel came waits for the room's next send, like any ask.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Set
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, NamedTuple, TypeVar

from transfer.core.bounded import BySession, Filed, forget_before, remember
from transfer.core.breaker import Breaker
from transfer.core.destinations import DestinationBook, Held
from transfer.core.failure import CLEARED, Failure, FailureKind, without_room
from transfer.core.parked import Asks, ParkedAsks
from transfer.core.regions import RegionBook
from transfer.core.scheduler import WriteScheduler
from transfer.core.unread import UNREAD_GRACE_S, UnreadGrace
from transfer.frames import (Cancel, CancelAnswer, Registration, TransferInfo, host_text, receiver_text,
                             validate_fanout)
from transfer.status import TransferPoll

__all__ = ["CLEARED_GRACE_S", "REASK_GRACE_S", "SWEEP_S", "UNREAD_GRACE_S", "Conclude", "Count", "EncodeCore",
           "Offer", "Progress", "PushStatus", "Release", "StartWrite", "Warn"]

_T = TypeVar("_T", bound=Filed)

#: A room cleared before its whole fanout asked has its parked asks told Failed this long
#: after the clear, so a caller that clears and sends the room again at once (a retry)
#: keeps them for the new item.
CLEARED_GRACE_S = 0.1

#: An item sent within this long of a receiver's cancel of its parked ask waits the rest of it for that
#: receiver's new ask (it gave the room up and asks again at once); the cancel fails the item only then.
REASK_GRACE_S = 0.1

#: How often unserved items and asks are swept for the fanout timeout.
SWEEP_S = 0.5

#: Rooms remembered as cancelled before their item came, and rooms whose asks were told Failed
#: for want of their item (each at most this many, oldest forgotten first), so the item fails at
#: once when it comes instead of waiting for the fanout timeout.
MAX_CANCELLED_ROOMS = 4096

#: Failed writes remembered by (room, receiver session) for a cancel that comes after the failure:
#: their bytes may still land, so such a cancel is not confirmed. Kept this long (past the
#: receive pool's default quarantine of 280 s, which bounds the late landing on the other side),
#: and at most this many (oldest forgotten first, warned): until a forgotten one's time is up, no
#: cancel is confirmed, since it may be that write's.
FAILED_WRITES_KEPT_S = 300.0
MAX_FAILED_WRITES = 4096

#: How long a failed write's destination stays held from other rooms of its session after the failure,
#: since its bytes may still land there: a failed write's peer goes on applying the bytes it had
#: received (over tcp, those in its socket when the initiator gave up; Mooncake's acknowledged framing,
#: 0.3.12 on, makes only a Success mean "applied"), and a write our own transfer timeout gave up on is
#: still in Mooncake's hands. The receive pool's default quarantine (EPD_QUARANTINE_S, 280 s),
#: which bounds the late landing our prefill ranks wait out: they hold a failed room's slot that long
#: from when they hear of the failure, so this hold refuses no slot of theirs handed out again (unless
#: their own deadline failed the room before the write failed), and a receiver without a quarantine of
#: its own (a peer's) gets the same bound. At most MAX_QUARANTINED_RANGES ranges are held so (the
#: oldest let go first past it, warned).
FAILED_WRITE_QUARANTINE_S = 280.0
MAX_QUARANTINED_RANGES = 2 * MAX_FAILED_WRITES

#: Status endpoints whose latest session is remembered (least recently seen forgotten
#: first): a new session at a known endpoint is a restarted prefill rank.
MAX_ENDPOINTS = 4096


#: The sessions of a room's receivers being served, when it has none.
_NO_SESSIONS: frozenset[str] = frozenset()

#: The order a room's receivers are kept in.
_BY_ROWS = attrgetter("row_start", "session_id")


def _grace_over(cancelled_at: float, now: float) -> bool:
    """Whether REASK_GRACE_S passed since a receiver's cancel: an item then waits no more for its new ask.

    Read as next_wakeup() computes the grace's end (the sum, not the difference, which may round below the
    grace): a tick at the wake-up the grace asked for ends it."""
    return now >= cancelled_at + REASK_GRACE_S


@dataclass
class Offer:
    """An item the caller offers: where its rows are and how they are shaped.

    `token` is the caller's own object for this room (its identity tells a room sent
    again apart); `sources` are opaque to the core and come back with each write (for
    checksums); `ready_event` is polled with query().
    """

    room: int
    token: Any
    src_addr: int
    span: int
    hidden: int
    dtype: str
    row_bytes: int
    deepstack_addr: int | None = None
    deepstack_row_bytes: int = 0
    ready_event: Any = None
    sources: tuple = ()


# ---------------------------------------------------------------- actions

# The actions a room makes every time (a write, its status, the room's progress, conclusion and release) are frozen
# dataclasses whose __init__ sets the generated one's fields in one store of the instance's __dict__, where the
# generated one pays one object.__setattr__ a field.
_set_attribute = object.__setattr__


@dataclass(frozen=True, init=False)
class StartWrite:
    """Submit one receiver's shard (embedding, and deepstack when present) as one batch."""

    wid: int
    room: int
    session_id: str
    srcs: tuple[int, ...]
    dsts: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int  # sum(lengths)
    sources: tuple = ()
    token: Any = None  # the send's, as Progress and Conclude carry it: its stages are stamped on it

    def __init__(self, wid: int, room: int, session_id: str, srcs: tuple[int, ...], dsts: tuple[int, ...],
                 lengths: tuple[int, ...], nbytes: int, sources: tuple = (), token: Any = None) -> None:
        _set_attribute(self, "__dict__", {"wid": wid, "room": room, "session_id": session_id, "srcs": srcs,
                                          "dsts": dsts, "lengths": lengths, "nbytes": nbytes, "sources": sources,
                                          "token": token})


@dataclass(frozen=True, init=False)
class PushStatus:
    """Push a status to a receiver's status endpoint."""

    endpoint: str
    port: int
    room: int
    status: TransferPoll
    checksums: tuple[int, ...] = ()
    cancel: CancelAnswer | None = None  # set on a cancel's answer (then the status is Failed)
    failure: Failure | None = None  # why, on a Failed status (sent in its reason parts, docs/protocol.md 8)

    def __init__(self, endpoint: str, port: int, room: int, status: TransferPoll, checksums: tuple[int, ...] = (),
                 cancel: CancelAnswer | None = None, failure: Failure | None = None) -> None:
        _set_attribute(self, "__dict__", {"endpoint": endpoint, "port": port, "room": room, "status": status,
                                          "checksums": checksums, "cancel": cancel, "failure": failure})


@dataclass(frozen=True, init=False)
class Progress:
    """The room moved on (its whole fanout asked and writes are queued)."""

    room: int
    token: Any
    status: TransferPoll
    asked_at: float  # its first ask
    at: float  # its last ask, or the item when that came later

    def __init__(self, room: int, token: Any, status: TransferPoll, asked_at: float, at: float) -> None:
        _set_attribute(self, "__dict__", {"room": room, "token": token, "status": status, "asked_at": asked_at,
                                          "at": at})


@dataclass(frozen=True, init=False)
class Conclude:
    """The room concluded: Success, or Failed with a Failure."""

    room: int
    token: Any
    status: TransferPoll
    failure: Failure | None
    at: float

    def __init__(self, room: int, token: Any, status: TransferPoll, failure: Failure | None, at: float) -> None:
        _set_attribute(self, "__dict__", {"room": room, "token": token, "status": status, "failure": failure,
                                          "at": at})


@dataclass(frozen=True, init=False)
class Release:
    """Nothing reads the room's sources any more: drop what was registered for them."""

    room: int
    token: Any

    def __init__(self, room: int, token: Any) -> None:
        _set_attribute(self, "__dict__", {"room": room, "token": token})


@dataclass(frozen=True)
class Warn:
    """A warning for the log, throttled by `key`."""

    key: str
    message: str
    args: tuple = ()


@dataclass(frozen=True)
class Count:
    """Count one event a peer caused in the metric `metric`, labelled with `reason`."""

    metric: str
    reason: str


# ---------------------------------------------------------------- state


@dataclass(eq=False)
class _Room:
    """One offered item and its progress."""

    offer: Offer
    offered_at: float
    receivers: list[TransferInfo] = field(default_factory=list)
    pending: int = 0  # receivers whose write is queued or in flight
    queued: dict[_Job, None] = field(default_factory=dict)  # those whose write waits for a slot, in order
    failed: bool = False
    failure: Failure | None = None  # why it failed, told to every receiver
    succeeded: bool = False  # every receiver was served: nothing may tell them Failed any more
    orphans: list[TransferInfo] = field(default_factory=list)  # shards whose receiver restarted before served
    orphaned_at: float | None = None  # when its last orphan's receiver restarted: its successor's wait starts there
    served: set[str] = field(default_factory=set)  # sessions told Success (a restart after that orphans nothing)
    released: bool = False
    cancelled_by: dict[str, float] = field(default_factory=dict)  # session whose cancel failed it -> cancelled at
    late: bool = False  # failed as the late item of asks already told Failed for want of it

    @property
    def room(self) -> int:
        return self.offer.room

    def ready(self) -> bool:
        """Whether the source may be read: no ready event, or it completed (polled with query())."""
        event = self.offer.ready_event
        if event is not None:
            if not event.query():
                return False
            self.offer.ready_event = None
        return True


@dataclass(eq=False)
class _CancelWait:
    """A cancel answered too late: answered again once the last of the writes it found in flight is over,
    confirmed only if none of them failed (a failed write's bytes may still land)."""

    cancel: Cancel
    left: int
    failed: bool = False


@dataclass(eq=False)
class _Job:
    """One receiver's write of one room, and the destination ranges it holds until it is over."""

    room: _Room
    info: TransferInfo
    ranges: tuple[Held, ...] = ()  # its destinations, as the destination book holds them
    regions_checked: int = -1  # the region book's version when its destination was checked
    waits: list[_CancelWait] = field(default_factory=list)  # cancels that came while it was in flight
    unwanted: bool = False  # queued, and will never start (counted in EncodeCore._unwanted_waiting)


class _CancelledAsk(NamedTuple):
    """A receiver's cancel of its parked ask before the room's item came: the item fails when it comes."""

    session: str
    cancelled_at: float

    @property
    def filed_at(self) -> float:
        return self.cancelled_at


class _TimedOutAsks(NamedTuple):
    """A room's asks told Failed for want of its item: an item sent after that fails at once, as late."""

    asked: str  # how much of its fanout asked, for the late item's failure
    first_at: float
    told_at: float

    @property
    def filed_at(self) -> float:
        return self.told_at


class _ClearedFailure(NamedTuple):
    """A room a receiver's cancel failed, or that failed as a late item or for want of its fanout, and that the
    caller cleared since: a new ask for it is told why, unless the room is sent again meanwhile."""

    failure: Failure
    cancelled_by: dict[str, float]  # the sessions whose cancel failed it -> when
    cleared_at: float

    @property
    def filed_at(self) -> float:
        return self.cleared_at


class _HeldItem(NamedTuple):
    """An item sent within REASK_GRACE_S of its receiver's cancel, waiting for that receiver's new ask."""

    session: str
    cancelled_at: float
    room: _Room


def _one_session(entry: _CancelledAsk | _HeldItem) -> tuple[str]:
    """The receiver whose cancel an entry remembers."""
    return (entry.session,)


def _cancelling_sessions(entry: _ClearedFailure) -> Iterable[str]:
    """The receivers whose cancels failed a cleared room."""
    return entry.cancelled_by


def _host(session: str) -> str:
    """The host part of a Mooncake session id (host:rpc_port)."""
    return session.rpartition(":")[0] or session


def _asked(asks: Asks | None) -> str:
    """How much of a room's fanout asked, for a failure a human reads."""
    if asks is None:
        return "no prefill rank asked"
    return f"{len(asks.infos)} of {asks.fanout} prefill ranks asked"


def _late_item(room: int, late_s: float, limit: float, asked: str) -> str:
    """Why an item sent past the fanout timeout after its room's first ask fails; `asked` says who asked."""
    return (f"room {room}: its item was sent {late_s:.1f}s after its first ask, past the fanout timeout "
            f"{limit:g}s ({asked})")


def _late_ask(room: int, failure: Failure) -> Failure:
    """What an ask is told that came after its room's item waited out its fanout and was cleared."""
    return Failure(FailureKind.FANOUT_TIMEOUT,
                   f"room {room}: its item was sent but failed, and was cleared, before this ask came "
                   f"({without_room(room, failure.detail)}): a prefill rank must ask within the encode side's "
                   f"fanout_timeout_s of the item's send")


def _reask_failure(room: int, failure: Failure, cancelled_by: dict[str, float], session: str,
                   now: float) -> Failure:
    """What a new ask of `session` for a room that failed with `failure` is told: that failure, or, when that
    receiver's own cancel failed it (`cancelled_by`: session -> when), that the cancel came first."""
    at = cancelled_by.get(session)
    if at is None:
        return failure
    return Failure(FailureKind.CANCELLED,
                   f"room {room}: receiver {receiver_text(session)} asked for it again {now - at:.3f}s after its "
                   f"own cancel had failed the room's item ({without_room(room, failure.detail)}): the item is not "
                   f"sent again by itself. Send the room again, or keep an ask until it concludes instead of "
                   f"clearing it and asking again (a new ask within {REASK_GRACE_S:g}s of the cancel, before the "
                   f"item comes, is served)")


class EncodeCore:
    """An encode rank's room rules: parked asks, fanout assembly, checks, scheduling, conclusions."""

    def __init__(self, *, fanout_timeout_s: float = 120.0, depth: int = 32,
                 parked: ParkedAsks | None = None, regions: RegionBook | None = None,
                 breaker: Breaker | None = None, now: float = 0.0) -> None:
        self.fanout_timeout_s = fanout_timeout_s
        self.parked = ParkedAsks() if parked is None else parked
        self.regions = RegionBook() if regions is None else regions
        self.breaker = Breaker() if breaker is None else breaker
        self.scheduler = WriteScheduler(depth, fanout_timeout_s)
        self._rooms: dict[int, _Room] = {}  # offered, not yet cleared
        self._unserved: set[int] = set()  # offered rooms waiting for asks (all, or restarted ranks'), not failed
        self._writes: dict[int, _Job] = {}  # started, not yet over
        # Queued writes that will never start (their room failed, or their receiver was superseded): they stay in
        # the scheduler's queue until a pick drops them, and no pick runs while every slot is in flight.
        self._unwanted_waiting = 0
        # Of writes queued or in flight, and of failed writes in their quarantine.
        self._destinations = DestinationBook(quarantine_limit=MAX_QUARANTINED_RANGES)
        self._endpoints: dict[tuple[str, int], str] = {}  # status endpoint -> its latest session
        self._endpoint_of: dict[str, tuple[str, int]] = {}  # session -> the status endpoint it registered last
        self._next_wid = 1
        self._clears_due: deque[tuple[int, float, int]] = deque()  # (room, cleared at, asks parked then) to fail
        # These three are found by session too: a superseded session's entries go without a scan of the rest.
        self._cancelled: BySession[int, _CancelledAsk] = BySession(_one_session)
        self._asks_timed_out: dict[int, _TimedOutAsks] = {}
        self._cleared_failures: BySession[int, _ClearedFailure] = BySession(_cancelling_sessions)
        self._reasks_due: deque[tuple[TransferInfo, float]] = deque()  # new asks for those, and when they came
        self._held: BySession[int, _HeldItem] = BySession(_one_session)
        self._failed_writes: dict[tuple[int, str], float] = {}  # (room, session) -> when a write to it failed
        self._failed_forgotten_at = float("-inf")  # when the newest failed write the bound forgot failed
        self._next_sweep = now + SWEEP_S
        self._unread = UnreadGrace()  # holds the rules for want of an ask while asks may be unread
        self._closed = False
        self._close_detail = ""
        self._writes_stopped = False
        self._out: list = []

    # ------------------------------------------------------------ events

    def offer(self, offer: Offer, now: float) -> list:
        """The caller sent an item: park it, or start its writes if its whole fanout asked."""
        old = self._rooms.get(offer.room)
        if old is not None:  # the caller clears before sending again; a stale one is failed, not kept
            self._fail_with(old, CLEARED, now)
            self._unserved.discard(old.room)
        room = self._rooms[offer.room] = _Room(offer, now)
        if self._closed:  # sent while the driver was closing: nothing will serve it
            self._fail(room, FailureKind.CLOSED, self._close_detail, now)
            return self._out_take()
        # Each book looked at only when it holds anything: nearly always all three are empty.
        if self._cleared_failures.entries:
            self._cleared_failures.pop(offer.room, None)
        timed_out = self._recent(self._asks_timed_out.pop(offer.room, None), now) if self._asks_timed_out else None
        cancelled = self._recent(self._cancelled.pop(offer.room, None), now) if self._cancelled.entries else None
        if cancelled is not None and _grace_over(cancelled.cancelled_at, now):
            self._fail_cancelled_item(room, cancelled.session, cancelled.cancelled_at, now)
            return self._flush(now)
        if timed_out is not None and cancelled is None and self.parked.get(offer.room) is None:
            room.late = True
            self._fail(room, FailureKind.OTHER, _late_item(room.room, now - timed_out.first_at, self.fanout_timeout_s,
                                                           f"{timed_out.asked}, told Failed "
                                                           f"{now - timed_out.told_at:.1f}s ago"), now)
            return self._flush(now)
        if cancelled is not None:  # its receiver may be asking for it again right now: the item waits for it
            self._held[offer.room] = _HeldItem(cancelled.session, cancelled.cancelled_at, room)
        self._unserved.add(offer.room)
        self._dispatch(offer.room, now, room=room)
        return self._flush(now)

    def clear(self, room: int, token: Any, now: float) -> list:
        """The caller forgot a room: fail it unless it concluded; its unserved asks fail after a grace.

        A token the core never filed (a send() that raised after queueing its clear, before or
        without its item) has its sources released at once: no write of this core reads them.
        """
        held = self._rooms.get(room)
        if held is None or held.offer.token is not token:
            if held is None and not self._closed:
                self._out.append(Release(room, token))
            return self._flush(now)
        del self._rooms[room]
        self._unserved.discard(room)
        self._fail_with(held, CLEARED, now)
        if (held.cancelled_by or held.late) and held.failure is not None:
            remember(self._cleared_failures, room, _ClearedFailure(held.failure, dict(held.cancelled_by), now),
                     MAX_CANCELLED_ROOMS)
        elif held.failure is not None and held.failure.kind is FailureKind.FANOUT_TIMEOUT:
            # A receiver that asks from now on came too late for the item: told so, not parked to its deadline.
            remember(self._cleared_failures, room, _ClearedFailure(_late_ask(room, held.failure), {}, now),
                     MAX_CANCELLED_ROOMS)
        if not held.receivers and not self._closed:
            asks = self.parked.get(room)
            self._clears_due.append((room, now, 0 if asks is None else len(asks.infos)))
        return self._flush(now)

    def registration(self, reg: Registration, now: float) -> list:
        """A prefill session announced a region; it is also back, so its breaker resets.

        A rank announces itself before its first ask, so a new session registering at a
        known status endpoint is the rank restarted there: it supersedes the old one.
        """
        refused = self.regions.register(reg)
        if refused is not None:
            self._warn("registration without lengths", "%s", refused)
            self._out.append(Count("registrations_refused_total", "no_lengths"))
            return self._flush(now)
        self.breaker.reset(reg.session_id)
        self._note_endpoint(reg.endpoint, reg.port, reg.session_id, now)
        return self._flush(now)

    def ask(self, info: TransferInfo, now: float) -> list:
        """A receiver asked for a room: park it; a complete fanout with its item starts the writes.

        A new session asking for what a parked rank asked for is that rank restarted:
        it supersedes its predecessor (see `_supersede`).
        """
        if self.breaker.tripped:  # it reaches us: a pause after a slow failure may end
            self.breaker.heard_from(info.session_id, now)
        if info.fanout > self.parked.max_receivers:
            # No room takes that many receivers: it would wait out the fanout timeout.
            self._warn("receivers", "room %d: %s asked with fanout %d, more than the %d receivers a room may have",
                       info.room, receiver_text(info.session_id), info.fanout, self.parked.max_receivers)
            self._tell_failed([info], Failure(FailureKind.GEOMETRY, f"room {info.room}: asked with fanout "
                                                                    f"{info.fanout}, more than the "
                                                                    f"{self.parked.max_receivers} receivers a room "
                                                                    f"may have"))
            return self._flush(now)
        room = self._rooms.get(info.room)
        if room is None and self._recent(self._cleared_failures.get(info.room), now) is not None:
            # A receiver's cancel failed the room's item, or it came late, and the caller has cleared it since:
            # parked like any ask, this one is told why after CLEARED_GRACE_S unless the caller sends the room
            # again meanwhile (a retry).
            self._reasks_due.append((info, now))
        if room is not None and not room.failed and info.session_id not in room.served and info in room.receivers:
            # A copy of an ask its room is writing now (the message came twice): parked, it would wait
            # for the room's next send and be told Failed when none came.
            self._warn("repeated ask", "room %d: %s asked again for the write under way; ignoring the copy",
                       info.room, receiver_text(info.session_id))
            return self._flush(now)
        # Only a room whose whole fanout asked (parked, or being written) has a shard to supersede by.
        asks = self.parked.get(info.room)
        predecessor = (self._predecessor_by_shard(info) if (asks is not None and len(asks.infos) >= asks.fanout)
                       or (room is not None and room.receivers) else None)
        if predecessor is not None:
            self._supersede(predecessor, info.session_id, "shard",
                            f"asking for room {info.room}'s shard (rows {info.row_start}+{info.rows} of fanout "
                            f"{info.fanout}) it had asked for", now)
        admission = self.parked.add(info, now)
        if admission.refused:
            self._warn("receivers", "room %d: more than %d receivers asked; telling %s Failed",
                       info.room, self.parked.max_receivers, receiver_text(info.session_id))
            self._tell_failed([info], Failure(FailureKind.GEOMETRY, f"room {info.room}: more than "
                                                                    f"{self.parked.max_receivers} receivers asked"))
            return self._flush(now)
        if self._cancelled.entries or self._held.entries:  # else no cancel of this ask's room is remembered
            self._forget_cancel(info)
        for asks in admission.evicted:
            self._warn("parked", "room %d: %d rooms (%d bytes of asks) were asked for and not served yet; "
                       "failing the oldest ask", asks.room, len(self.parked) + 1, self.parked.nbytes + asks.nbytes)
            failure = Failure(FailureKind.OTHER, f"room {asks.room}: dropped unserved, the oldest of more than "
                                                 f"{len(self.parked)} rooms asked for and not served yet")
            self._tell_failed(asks.infos.values(), failure)
            evicted = self._rooms.get(asks.room)
            if evicted is not None and asks.room in self._unserved:  # sent: told Failed, its ranks ask no more
                self._fail_with(evicted, failure, now)
        for dropped in admission.dropped:
            self._drop_over_share(dropped, now)
        # An ask before its item has nothing to start: _dispatch() would find no room (only offer() and
        # clear() file and forget one, never an ask's rules, so `room` is still the one filed).
        if room is not None:
            self._dispatch(info.room, now, asked=info, room=room)
        return self._flush(now)

    def _drop_over_share(self, dropped: TransferInfo, now: float) -> None:
        """Tells a receiver whose oldest parked ask made room for its newest (past its share of the parked asks)
        Failed; a room sent and waiting for that ask fails with it, since that rank asks no more."""
        share = self.parked.session_rooms
        self._warn("parked share", "room %d: %s has more than %d rooms (or %d bytes of asks) asked for and not "
                   "served yet, its share of this encode rank's; failing its oldest ask. Is that prefill rank "
                   "routed to the right encode rank, and are the rooms it asks for sent here?", dropped.room,
                   receiver_text(dropped.session_id), share, self.parked.session_bytes)
        failure = Failure(FailureKind.OTHER, f"room {dropped.room}: dropped unserved, the oldest of more than "
                                             f"{share} rooms (or {self.parked.session_bytes} bytes of asks) receiver "
                                             f"{receiver_text(dropped.session_id)} asked for and that were not "
                                             f"served yet")
        self._tell_failed([dropped], failure)
        room = self._rooms.get(dropped.room)
        if room is not None and dropped.room in self._unserved:
            self._fail_with(room, failure, now)
            self._dispatch(dropped.room, now)  # tells the rest of its fanout parked for it Failed

    def cancel(self, cancel: Cancel, now: float) -> list:
        """A receiver gave up on a room: nothing more is written into its memory for it, if that can still hold.

        Its parked ask or queued write is dropped and the room fails (`cancelled`); the
        receiver is answered confirmed at once, or, when its write is already in flight
        (the engine cannot take it back), too late now and confirmed once it is over.
        """
        if cancel.unasked:
            self._unasked(cancel.room, cancel.session_id, now)
            return self._flush(now)
        room_number, session = cancel.room, cancel.session_id
        # Every write into that receiver for the room number: an earlier send's may still fly
        # beside the current one's.
        flying = [job for job in self._writes.values()
                  if job.room.room == room_number and job.info.session_id == session]
        detail = f"room {room_number}: receiver {receiver_text(session)} cancelled it"
        for job in flying:
            self._spare(job.room, session)
            self._fail_by_cancel(job.room, session, detail + " while its write was in flight", now)
        self._cancel_unstarted(room_number, session, detail, now)
        self._first_cancel_answer(cancel, flying, now)
        return self._flush(now)

    def _unasked(self, room_number: int, session: str, now: float) -> None:
        """A receiver failed the room before asking for it (an unasked cancel): the room's fanout cannot
        complete. Its item fails now, telling the receivers parked for it Failed, or, not sent yet, when it
        comes (unless that receiver asks for the room meanwhile: `_forget_cancel`). Nothing is done where
        anything of that receiver's is under way for the room number (a parked ask or a write: an earlier
        ask's, whose own rules hold), nor to a room being written to a fanout without it or over already.
        Not answered: its sender awaits no answer (its memory was never offered)."""
        if any(job.room.room == room_number and job.info.session_id == session for job in self._writes.values()):
            return
        asks = self.parked.get(room_number)
        if asks is not None and session in asks.infos:
            return
        room = self._rooms.get(room_number)
        if room is None:
            remember(self._cancelled, room_number, _CancelledAsk(session, now), MAX_CANCELLED_ROOMS)
            return
        if room.failed or room.succeeded or room.receivers:
            return
        self._fail_by_cancel(room, session, f"room {room_number}: receiver {receiver_text(session)} failed it "
                                            f"before asking for it, so its whole fanout will not ask", now)
        self._dispatch(room_number, now)  # tells the receivers parked for it Failed

    def _cancel_unstarted(self, room_number: int, session: str, detail: str, now: float) -> None:
        """Drops the cancelling receiver's parked ask and fails the room the cancel is for, unless nothing of
        it is left to stop (a write in flight, which `cancel` failed already, or a room served in full); a
        cancel before the room's item came is remembered, and the item fails when it comes."""
        room = self._rooms.get(room_number)
        asks = self.parked.get(room_number)
        parked = asks is not None and session in asks.infos
        if parked:  # its ask, for the room being sent or for its next send
            self.parked.drop_ask(room_number, session)
        if parked and room is not None and session in room.served:
            # Told Success, it asked again for the room's next send: the cancel is that ask's (one for
            # the served ask would have come before it, on the same connection).
            return
        if room is not None and not room.succeeded and any(info.session_id == session for info in room.receivers):
            # A room served in full keeps its receivers: a later ask under its number waits for its next send.
            self._spare(room, session)
            when = (" after its own write landed, before the room's other writes were over" if session in room.served
                    else " before its write started")
            self._fail_by_cancel(room, session, detail + when, now)
        elif parked and room is None:  # the item may still come: it fails then, unless this receiver asks again
            remember(self._cancelled, room_number, _CancelledAsk(session, now), MAX_CANCELLED_ROOMS)
        elif parked and room is not None:
            self._fail_by_cancel(room, session, detail + " before its whole fanout asked", now)
            self._dispatch(room_number, now)  # tells the rest of its fanout Failed

    def _forget_cancel(self, info: TransferInfo) -> None:
        """The receiver asks again for a room it cancelled before its item came: the cancel fails the item no
        more (the item to come, or the one waiting for this ask)."""
        cancelled = self._cancelled.get(info.room)
        if cancelled is not None and cancelled.session == info.session_id:
            del self._cancelled[info.room]
        held = self._held.get(info.room)
        if held is not None and held.session == info.session_id:
            del self._held[info.room]

    def _recent(self, entry: _T | None, now: float) -> _T | None:
        """A remembered `entry` while within the fanout timeout of when it was filed, else None: the sweep
        forgets it only at its next round."""
        return entry if entry is not None and now - entry.filed_at <= self.fanout_timeout_s else None

    def _fail_by_cancel(self, room: _Room, session: str, detail: str, now: float, at: float | None = None) -> None:
        """Fails the room for a receiver's cancel (that came `at`, else now); when that cancel is what fails
        it, the room keeps whose it was, and a new ask of that receiver is told so (`_reask_failure`)."""
        if not room.failed and not room.succeeded:
            room.cancelled_by[session] = now if at is None else at
        self._fail(room, FailureKind.CANCELLED, detail, now)

    def _fail_cancelled_item(self, room: _Room, session: str, at: float, now: float) -> None:
        """Fails an item whose receiver cancelled its parked ask before the item came and did not ask again."""
        self._fail_by_cancel(room, session, f"room {room.room}: receiver {receiver_text(session)} cancelled it "
                                           f"{room.offered_at - at:.1f}s before the item was sent", now, at)
        self._dispatch(room.room, now)  # tells the other receivers parked for it Failed

    def _fail_unclaimed_held(self, now: float) -> None:
        """Fails the held items whose REASK_GRACE_S ran out with no new ask of their receiver."""
        for number, (session, at, room) in list(self._held.items()):
            if not _grace_over(at, now):
                continue
            del self._held[number]
            if self._rooms.get(number) is room and not room.failed and not room.receivers:  # still unserved
                self._fail_cancelled_item(room, session, at, now)

    def _tell_reask(self, info: TransferInfo, asked_at: float) -> None:
        """Tells the receiver of ask `info` (that came `asked_at`) for a room a receiver's cancel failed, or that
        came late, and the caller cleared since, why it is not served: its own cancel, or the room's failure;
        unless the room was sent again or that ask is no longer parked."""
        cleared = self._cleared_failures.get(info.room)
        asks = self.parked.get(info.room)
        if cleared is None or info.room in self._rooms or asks is None or asks.infos.get(info.session_id) is not info:
            return  # sent again, or the ask was taken or replaced (its own turn comes) meanwhile
        self.parked.drop_ask(info.room, info.session_id)
        self._tell_failed([info], _reask_failure(info.room, cleared.failure, cleared.cancelled_by, info.session_id,
                                                 asked_at))

    def _reask_failure(self, room: _Room, info: TransferInfo, now: float) -> Failure | None:
        """What a new ask for a failed room is told: why it failed, or, when that receiver's own cancel failed
        it, that the cancel came first."""
        if room.failure is None:
            return None
        return _reask_failure(room.room, room.failure, room.cancelled_by, info.session_id, now)

    def _first_cancel_answer(self, cancel: Cancel, flying: list[_Job], now: float) -> None:
        """Answers a cancel: too late while writes it found are in flight (a second answer follows once
        they are over), write failed when a recent write to it failed, else confirmed."""
        if flying:
            wait = _CancelWait(cancel, len(flying))
            for job in flying:
                job.waits.append(wait)
            self._answer_cancel(cancel, CancelAnswer.TOO_LATE)
        elif self._write_failed_for(cancel.room, cancel.session_id, now) and cancel.reads_write_failed:
            self._answer_cancel(cancel, CancelAnswer.WRITE_FAILED)  # its bytes may still land
        else:
            self._answer_cancel(cancel, CancelAnswer.CONFIRMED)

    def _write_failed_for(self, room: int, session: str, now: float) -> bool:
        """Whether a write of the room to the session failed recently enough that its bytes may still land
        (also while one the bound forgot may have been that write)."""
        self._forget_failed_writes(now)
        return (room, session) in self._failed_writes or now - self._failed_forgotten_at <= FAILED_WRITES_KEPT_S

    def _forget_failed_writes(self, now: float) -> None:
        """Forgets the failed writes whose bytes can no longer land, and past MAX_FAILED_WRITES the oldest
        others, saying so: until their time is up, every cancel is told its write failed."""
        failed = self._failed_writes
        while failed:
            oldest = next(iter(failed.items()))
            if now - oldest[1] <= FAILED_WRITES_KEPT_S:
                break
            del failed[oldest[0]]
        forgotten = None
        while len(failed) > MAX_FAILED_WRITES:
            forgotten = next(iter(failed.items()))
            del failed[forgotten[0]]
        if forgotten is None:
            return
        (room, session), self._failed_forgotten_at = forgotten
        self._warn("failed writes forgotten", "more than %d writes failed within %gs: the oldest, of room %d to %s, "
                   "is forgotten while its bytes may still land, so every cancel is answered write failed until "
                   "%gs after it failed (its receiver's memory waits out its quarantine)",
                   MAX_FAILED_WRITES, FAILED_WRITES_KEPT_S, room, receiver_text(session), FAILED_WRITES_KEPT_S)

    @staticmethod
    def _serves(job: _Job) -> bool:
        """Whether the job's receiver is still one its room answers (not spared: cancelled or superseded)."""
        for info in job.room.receivers:
            if info is job.info:
                return True
        return False

    def _spare(self, room: _Room, session: str) -> None:
        """Leaves a cancelling receiver out of the room's Failed pushes: its answer says it all, and a plain
        Failed could reach the retry it may already have asked for under the same room number. Its queued
        writes will never start (`_unwanted`)."""
        room.receivers = [info for info in room.receivers if info.session_id != session]
        for job in room.queued:
            if job.info.session_id == session:
                self._count_unwanted(job)

    def _count_unwanted(self, job: _Job) -> None:
        """Counts a queued write that will never start out of `writes_to_start`, once."""
        if not job.unwanted:
            job.unwanted = True
            self._unwanted_waiting += 1

    def wants(self, wid: int) -> bool:
        """Whether a started write should still be submitted (its room has not failed meanwhile, and its
        receiver was not superseded)."""
        job = self._writes.get(wid)
        if job is None or job.room.failed:
            return False
        for info in job.room.receivers:  # not self._unwanted(job), without its call: asked once a write
            if info is job.info:
                return True
        return False

    def _unwanted(self, job: _Job) -> bool:
        """Whether a write not submitted yet should never be: its room failed, or its receiver restarted
        (a write into the dead process's memory would serve nobody)."""
        if job.room.failed:
            return True
        for info in job.room.receivers:  # not self._serves(job), without its call: a pick asks twice a write
            if info is job.info:
                return False
        return True

    def write_skipped(self, wid: int, now: float) -> list:
        """A write was not submitted after all (its room failed first)."""
        job = self._writes.pop(wid, None)
        if job is not None:
            self.scheduler.finished(job.info.session_id)
            self._job_over(job)
            self._job_done(job, now)
        return self._flush(now)

    def write_done(self, wid: int, checksums: tuple[int, ...], now: float) -> list:
        """A write landed: its receiver is told Success (with the checksums) unless the room failed."""
        job = self._writes.pop(wid, None)
        if job is not None:
            room, info = job.room, job.info
            self.scheduler.finished(info.session_id)
            if self.breaker.tripped or self.breaker.revived:  # else no key for a success to reset
                self.breaker.succeeded(info.session_id)
            if not room.failed:
                for receiver in room.receivers:  # self._serves(job), without its call
                    if receiver is info:  # then self._push(), without its call
                        self._out.append(PushStatus(info.endpoint, info.port, info.room, TransferPoll.Success,
                                                    tuple(checksums), None, None))
                        room.served.add(info.session_id)
                        break
            self.regions.served(info.session_id)  # its engine took a write: evicted after those never served
            if job.waits:  # cancels that came while it flew: _job_over answers them
                self._job_over(job)
            self._job_done(job, now)
        # self._flush(now), without its call: the writes its slot lets start, then the answer.
        if self.scheduler.waiting:
            self._pump(now)
        out, self._out = self._out, []
        return out

    def write_failed(self, wid: int, error: str, took: float, now: float, *, blocking: bool = False) -> list:
        """A write failed after `took` seconds; a slow failure (a dead peer) opens its session's breaker.

        `blocking`: the submission itself failed, holding the driver all along.
        """
        job = self._writes.pop(wid, None)
        if job is None:
            return self._flush(now)
        session = job.info.session_id
        self.scheduler.finished(session)
        trip = self.breaker.failed(session, took, now, blocking=blocking, detail=error)
        if trip is not None and trip.stalled:
            self._warn("stall", "submitting a write to %s held the sender pool's thread (and every other write) "
                       "for %.1fs before failing: a peer that accepts connections but never answers the engine's "
                       "handshake? Writes to it fail at once for the next %.0fs, or until it registers again",
                       receiver_text(session), took, trip.until - now)
        failed = self._failed_writes
        failed.pop((job.room.room, session), None)  # filed again as the newest
        failed[job.room.room, session] = now
        if len(failed) > MAX_FAILED_WRITES:
            self._forget_failed_writes(now)
        # Its bytes may still land: no other room writes there until the quarantine passed.
        early = self._destinations.quarantine(session, job.ranges, now + FAILED_WRITE_QUARANTINE_S)
        if early:
            first = early[0]
            self._warn("destinations let go", "more than %d failed writes' destinations held: room %d's [%#x, %#x) "
                       "at receiver %s is let go %.0fs before its quarantine ends, and another room may be written "
                       "there while that write's bytes may still land", self._destinations.quarantine_limit,
                       first.room, first.start, first.end, receiver_text(first.session), first.until - now)
        job.ranges = ()
        if self._serves(job):  # a superseded session's failure is not its room's
            self._fail(job.room, FailureKind.WRITE,
                       f"write to {receiver_text(session)} (room {job.room.room}) failed: {error}", now)
        self._job_over(job, failed=True)
        self._job_done(job, now)
        return self._flush(now)

    def checksum_failed(self, wid: int, error: str, now: float) -> list:
        """Checksumming a write's rows failed: its room fails (the write stays tracked until it is over)."""
        job = self._writes.get(wid)
        if job is not None and self._serves(job):
            self._fail(job.room, FailureKind.CHECKSUM,
                       f"room {job.room.room}: checksumming its rows for {receiver_text(job.info.session_id)} "
                       f"failed: {error}", now)
        return self._flush(now)

    def tick(self, now: float, unread: bool = False) -> list:
        """Time passed: cleared rooms' grace, writes waiting for a slot or a ready event, the sweep.

        `unread`: asks may wait unread in the driver's socket (it was held up past this
        tick's time, or left requests queued). Asks that came before a room's time-out
        count: the rules that conclude rooms for want of an ask wait UNREAD_GRACE_S for
        the driver to read them, once in a row (writes waiting still start meanwhile).
        """
        self.scheduler.new_turn()
        if self._unread.holds(now, unread, self._rules_due()):
            return self._flush(now)
        while self._clears_due and now >= self._clears_due[0][1] + CLEARED_GRACE_S:
            self._fail_cleared_asks(*self._clears_due.popleft())
        while self._reasks_due and now >= self._reasks_due[0][1] + CLEARED_GRACE_S:
            self._tell_reask(*self._reasks_due.popleft())
        if self._held.entries:
            self._fail_unclaimed_held(now)
        self._destinations.expire(now)
        if now >= self._next_sweep:
            self._sweep(now)
            self._next_sweep = now + SWEEP_S
        return self._flush(now)

    def writing(self) -> list[tuple[int, str]]:
        """(room, receiver's session) of each write in flight, oldest first."""
        return [(job.room.room, job.info.session_id) for job in self._writes.values()]

    def stop_writes(self) -> None:
        """No write starts from now on (closing: those in flight settle first)."""
        self._writes_stopped = True

    def close(self, now: float, detail: str = "sender pool closed", *, give_up_writes: bool = True,
              stuck: str | None = None) -> list:
        """Fails every open room and parked ask, and lets go of every item; writes still in flight keep
        their rooms' source registrations.

        Writes waiting for a slot never start. A room whose write is still in flight
        (the engine may read its rows) concludes Failed without a Release, with `stuck` as its
        failure's detail when given; unless `give_up_writes` is False: the driver still settles
        them, and each room is then released once its last write is over.
        """
        if stuck is not None:
            for job in self._writes.values():
                self._fail(job.room, FailureKind.CLOSED, stuck, now)
        self._closed = True
        self._close_detail = detail
        self._clears_due.clear()
        self._reasks_due.clear()
        self._cleared_failures.clear()
        self._held.clear()
        for asks in self.parked.take_all():
            self._tell_failed(asks.infos.values(), Failure(FailureKind.CLOSED, f"room {asks.room}: {detail}"))
        for room in list(self._rooms.values()):
            self._fail(room, FailureKind.CLOSED, detail, now)
        for job in self.scheduler.take_all():  # every room is failed now: these only count out
            self._job_done(job, now)
        if give_up_writes:
            # Rooms whose writes are in flight: the engine may still read their sources, so none is released
            # (their registrations stay, and the engine keeps what it reads alive); nothing settles them now.
            for job in self._writes.values():
                job.room.released = True
            self._writes.clear()
        self._unserved.clear()
        # Nothing serves a room any more: the items (and the sources they hold) are let go. Writes left to
        # settle (not `give_up_writes`) keep their rooms through their jobs.
        self._rooms.clear()
        return self._out_take()

    # ------------------------------------------------------------ successors

    def _note_endpoint(self, endpoint: str, port: int, session: str, now: float) -> None:
        """Remembers the session registered at a status endpoint; a new one there supersedes the one before.

        Only one process at a time can bind a status endpoint.
        """
        key = (endpoint, port)
        moved_from = self._endpoint_of.pop(session, None)
        if moved_from is not None and moved_from != key and self._endpoints.get(moved_from) == session:
            # Its manager was made again on another port: whoever binds the old one next is someone else.
            del self._endpoints[moved_from]
        previous = self._endpoints.pop(key, None)
        if previous is not None and self._endpoint_of.get(previous) == key:
            del self._endpoint_of[previous]
        self._endpoints[key] = session
        self._endpoint_of[session] = key
        if len(self._endpoints) > MAX_ENDPOINTS:
            oldest = next(iter(self._endpoints))
            forgotten = self._endpoints.pop(oldest)
            if self._endpoint_of.get(forgotten) == oldest:
                del self._endpoint_of[forgotten]
        if previous is not None and previous != session:
            self._supersede(previous, session, "status_endpoint",
                            f"at the same status endpoint {host_text(endpoint)}:{port}", now)

    def _predecessor_by_shard(self, info: TransferInfo) -> str | None:
        """The session a new session's ask replaces, or None.

        The room's whole fanout already asked (its asks are parked, or its writes are
        being served) and one of them asked for this very shard: only that rank,
        restarted, asks for it again, and it restarts on its own host: a session on
        another host asking for that shard (a stray ask, another prefill instance's room
        under the same number) supersedes nobody, and the room refuses it on its receiver
        count. When several ranks of the host asked for the same shard (the full span, or
        empty shards), none is guessed either.
        """
        asks = self.parked.get(info.room)
        if asks is not None and len(asks.infos) >= asks.fanout:
            fanout, rivals = asks.fanout, list(asks.infos.values())
        else:
            room = self._rooms.get(info.room)
            if room is None or room.failed or room.succeeded or not room.receivers:
                return None
            fanout, rivals = len(room.receivers) + len(room.orphans), room.receivers
        if info.fanout != fanout or any(rival.session_id == info.session_id for rival in rivals):
            return None
        shard, host = (info.row_start, info.rows, info.fanout, info.span), _host(info.session_id)
        same = [i.session_id for i in rivals
                if (i.row_start, i.rows, i.fanout, i.span) == shard and _host(i.session_id) == host]
        return same[0] if len(same) == 1 else None

    def _supersede(self, old: str, new: str, reason: str, how: str, now: float) -> None:
        """A restarted rank's new session replaces its old one: the old one's parked asks are dropped.

        They are not told Failed: the process that made them is gone, and its status
        endpoint may be its successor's, which would take that Failed for its retry. Its
        writes still queued never start; those in flight go on, but tell it nothing either,
        Success or Failed, for the same reason. A room not yet served waits for the
        successor's ask for that shard (`orphans`); one it was served in already is done.
        """
        for room in self._rooms.values():
            if not room.succeeded and any(info.session_id == old for info in room.receivers):
                if not room.failed and old not in room.served:
                    # Its shard waits for the successor's ask, within the fanout timeout from now.
                    room.orphans += [info for info in room.receivers if info.session_id == old]
                    room.orphaned_at = now
                    self._unserved.add(room.room)
                self._spare(room, old)
        for cancels in (self._cancelled, self._held):  # its cancels do not fail its successor's retries
            for number in cancels.of(old):
                del cancels[number]
        for number in self._cleared_failures.of(old):
            del self._cleared_failures[number]  # nor do those of rooms the caller cleared since
        dropped = self.parked.drop_session(old)
        self.regions.forget(old, f"session {receiver_text(new)} {how} superseded it")
        self.breaker.reset(old)
        self._warn("successor", "session %s %s supersedes session %s (a restarted prefill rank): %d parked asks of "
                   "the predecessor dropped", receiver_text(new), how, receiver_text(old), len(dropped))
        self._out.append(Count("sessions_superseded_total", reason))

    # ------------------------------------------------------------ queries

    def next_wakeup(self) -> float:
        """When the core next needs a tick (writes waiting are the driver's to poll: see `busy`)."""
        return self._unread.defer(self._rules_due())  # held back by a tick with asks maybe unread

    def _rules_due(self) -> float:
        """When the earliest of the rules that conclude rooms for want of an ask comes due: the sweep, a
        cleared room's grace, a cancel's."""
        due = self._next_sweep
        if self._clears_due:
            due = min(due, self._clears_due[0][1] + CLEARED_GRACE_S)
        if self._reasks_due:
            due = min(due, self._reasks_due[0][1] + CLEARED_GRACE_S)
        if self._held.entries:
            for held in self._held.values():  # items sent right after a cancel: MAX_CANCELLED_ROOMS at most
                due = min(due, held.cancelled_at + REASK_GRACE_S)
        return due

    def expects(self, room: int) -> bool:
        """Whether an item for `room` would do more now than wait for its asks: some are parked, a
        cancel or asks told Failed wait for it, or the core is closed (then it fails at once).

        Only reads (a dict look-up each), so the caller's thread may ask it without the
        driver's lock: see EncodeDriver.offer for why a stale answer loses nothing.
        """
        return (self._closed or self.parked.get(room) is not None or room in self._cancelled
                or room in self._asks_timed_out)

    @property
    def busy(self) -> bool:
        """Whether writes wait for a slot or a ready event (a tick may start them)."""
        return self.scheduler.waiting > 0

    @property
    def waiting(self) -> int:
        """Writes waiting to start."""
        return self.scheduler.waiting

    @property
    def writes_to_start(self) -> int:
        """Writes waiting to start that still may (the queue_depth gauge): `waiting`, less those that will
        never start and wait for a pick to drop them (safe to read from another thread: never below 0)."""
        return max(0, self.scheduler.waiting - self._unwanted_waiting)

    @property
    def parked_rooms(self) -> int:
        """Offered rooms waiting for receivers to ask: not all asked yet, or one restarted (safe to read from
        another thread)."""
        return len(self._unserved)

    def rooms(self) -> list[int]:
        """Offered rooms not yet cleared."""
        return list(self._rooms)

    def in_flight(self) -> int:
        """Writes started and not yet over."""
        return len(self._writes)

    # ------------------------------------------------------------ rules

    def _dispatch(self, room_number: int, now: float, asked: TransferInfo | None = None,
                  room: _Room | None = None) -> None:
        """Starts the room's writes once the item is here and its whole fanout asked.

        Asks for a room that already failed are answered Failed at once: nothing will
        serve them. A room already served keeps later asks parked for its next send. A
        room some of whose receivers restarted before they were served (`orphans`) takes
        their successors' asks once one came for each, and writes their shards only.

        `asked`: the ask just parked, when that is what called. The asks parked before it
        agreed on the fanout (each was held to the others when it came, or when the item
        did), so it alone is held to one of them: an ask costs the same however many of
        its room's receivers asked before it, and the fanout is sorted once, when complete.

        `room`: the room filed under `room_number`, when the caller holds it already (None: looked up here).
        """
        asks = self.parked.get(room_number)
        if asks is None:
            return
        if room is None:
            room = self._rooms.get(room_number)
        if room is None or room.succeeded or (room.receivers and not room.failed and not room.orphans):
            return  # a served room's sources may be released: later asks wait for its next send
        # Read before the newcomers' asks are dropped below.
        fanout, first_at, last_at = asks.fanout, asks.first_at, asks.last_at
        kept = [] if room.failed else room.receivers  # being served: their asks wait for the next send
        sessions: Set[str] = {info.session_id for info in kept} if kept else _NO_SESSIONS
        if not room.failed:
            if asked is not None and not kept:
                # The first ask's fanout is the room's (asks.fanout): a later ask that agrees with it agrees,
                # and the first ask parked alone agrees with itself.
                if asked.fanout != fanout or (asked.session_id == asks.first and len(asks.infos) > 1):
                    self._check_fanouts_agree(room, asks, [asked], now)
            else:
                self._check_fanouts_agree(room, asks, [*kept, *asks.infos.values()], now)
        if not room.failed:
            asked_all = len(kept) + sum(1 for s in asks.infos if s not in sessions) if kept else len(asks.infos)
            if asked_all < fanout:
                return
        newcomers = sorted(asks.infos.values() if not kept else
                           (info for info in asks.infos.values() if info.session_id not in sessions), key=_BY_ROWS)
        if sessions:  # the asks of receivers being served stay parked for the room's next send
            for info in newcomers:
                self.parked.drop_ask(room_number, info.session_id)
        else:
            self.parked.take(room_number)
        if room.failed:
            for info in newcomers:
                self._tell_failed([info], self._reask_failure(room, info, now))
            return
        infos = sorted(kept + newcomers, key=_BY_ROWS) if kept else newcomers
        room.receivers = infos
        room.orphans = []
        self._unserved.discard(room_number)
        offer = room.offer
        ranges = self._ranges(newcomers, offer)
        # Within the fanout timeout of its first ask nothing came too late: _fanout_too_late()'s first test.
        if ((now - first_at > self.fanout_timeout_s
             and self._fanout_too_late(room, fanout, first_at, last_at, len(infos), now))
                or self._refused(room, infos, newcomers, ranges, fanout, now)):
            return
        if not kept:
            self._out.append(Progress(room_number, offer.token, TransferPoll.Transferring, first_at, now))
        # A fanout let in past its time-out while the rules were held back: its writes' wait starts now.
        self._queue_writes(room, newcomers, ranges, first_at if now - first_at <= self.fanout_timeout_s else now,
                           now)

    def _check_fanouts_agree(self, room: _Room, asks: Asks, infos: list[TransferInfo], now: float) -> None:
        """Asks that disagree on the fanout would wait for ranks that do not exist: fails the room at once."""
        parked = iter(asks.infos.values())
        first = next(parked)
        if len(infos) == 1 and infos[0] is first:  # the first ask, asked again: held to the next one
            first = next(parked, first)
        fanout = first.fanout
        odd = next((info for info in infos if info.fanout != fanout), None)
        if odd is not None:
            self._fail(room, FailureKind.GEOMETRY, f"room {room.room}: receiver {receiver_text(odd.session_id)} "
                                                   f"asked with fanout {odd.fanout}, receiver "
                                                   f"{receiver_text(first.session_id)} with fanout {fanout}", now)

    def _fanout_too_late(self, room: _Room, fanout: int, first_at: float, last_at: float, asked: int,
                         now: float) -> bool:
        """Fails the room if its whole fanout asked, or its item came, only after the fanout timeout: no
        write may start this late after the first ask (said here, not later as a wait for a write slot).

        While a late tick holds the rules back (see tick's `unread`), an ask read is one that may have
        waited unread since before the time-out, and an item taken one the caller may have sent before
        it (waiting in the driver's queue meanwhile): the fanout it completes counts as in time, as an
        ask the held-back sweep lets in does."""
        limit = self.fanout_timeout_s
        waited = now - first_at
        if waited <= limit or self._unread.holding(now):
            return False
        if last_at - first_at <= limit:  # every rank asked in time: the item is what came late
            self._warn("late item", "room %d: its item was sent %.1fs after its first ask, past the fanout "
                       "timeout %gs; failing it", room.room, room.offered_at - first_at, limit)
            self._fail(room, FailureKind.OTHER, _late_item(room.room, room.offered_at - first_at, limit,
                                                           f"its whole fanout of {fanout} asked in time"), now)
            return True
        self._warn("late fanout", "room %d: its whole fanout of %d asked only %.1fs after its first ask, past "
                   "the fanout timeout %gs; failing it", room.room, fanout, waited, limit)
        self._fail(room, FailureKind.FANOUT_TIMEOUT, f"receiver never registered within {limit:g}s "
                                                     f"({asked} of {fanout} prefill ranks asked, the last "
                                                     f"{waited:.1f}s after the first)", now)
        return True

    def _refused(self, room: _Room, infos: list[TransferInfo], newcomers: list[TransferInfo],
                 ranges: list[list[tuple[int, int]]], fanout: int, now: float) -> bool:
        """Fails the room if its receivers' geometry, regions or destinations (`ranges`, each newcomer's
        `_ranges`) rule its writes out."""
        offer = room.offer
        has_deepstack = offer.deepstack_addr is not None
        reason = validate_fanout(offer.span, offer.hidden, offer.dtype, has_deepstack, infos, fanout,
                                 offer.deepstack_row_bytes if has_deepstack else None)
        kind = FailureKind.GEOMETRY
        if reason is None:
            reason, kind = self.regions.check(newcomers, offer.row_bytes, offer.deepstack_row_bytes), FailureKind.REGION
        if reason is None:
            reason = self._overlap(newcomers, ranges, now)
        if reason is None:
            return False
        self._fail(room, kind, reason, now)
        return True

    def _queue_writes(self, room: _Room, newcomers: list[TransferInfo], ranges: list[list[tuple[int, int]]],
                      first_at: float, now: float) -> None:
        """Queues a write of each newcomer's shard, holding its destination `ranges` (each newcomer's
        `_ranges`) until it is over (a superseded session's write may still be in flight); starts them at
        once where the pick that follows (`_flush`) would start them all."""
        room.pending += len(newcomers)
        version, hold, queued = self.regions.version, self._destinations.hold, room.queued
        number = room.offer.room
        jobs, sessions = [], []
        for info, spans in zip(newcomers, ranges):
            session = info.session_id
            job = _Job(room, info, hold(session, number, spans), version)
            queued[job] = None
            jobs.append(job)
            sessions.append(session)
        # Fresh jobs of a room not failed are wanted, an item without a ready event is ready, and `first_at` is
        # within the bound of `now`: a pick would start every one where the scheduler takes them all now.
        if (room.offer.ready_event is None and not self._closed and not self._writes_stopped
                and self.scheduler.start_now(sessions)):
            for job in jobs:
                self._start(job, now)
            return
        push = self.scheduler.push
        for job, session in zip(jobs, sessions):
            push(job, session, first_at)

    def _pump(self, now: float) -> None:
        """Starts the waiting writes that may start now."""
        if self._closed or self._writes_stopped or not self.scheduler.waiting:
            return
        # An item with no ready event (or one that completed) may be read: _ready()'s answer, without its call.
        picked = self.scheduler.pick(now, cancelled=self._unwanted,
                                     ready=lambda job: job.room.offer.ready_event is None or self._ready(job, now),
                                     expired=lambda job, waited: self._expired(job, waited, now))
        for job in picked.dropped:
            self._job_done(job, now)
        for job in picked.start:
            self._start(job, now)

    def _ready(self, job: _Job, now: float) -> bool:
        """Whether the job's rows may be read; a broken or overdue ready event fails its room."""
        room = job.room
        limit = self.fanout_timeout_s
        try:
            if room.ready():
                return True
        except Exception as exc:  # noqa: BLE001 - a broken event fails its room only
            self._fail(room, FailureKind.WRITE, f"room {room.room}: its ready event's query() raised {exc!r}", now)
            return True
        if now - room.offered_at > limit:
            self._fail(room, FailureKind.WRITE, f"room {room.room}: its ready event did not complete within "
                                                f"{limit:g}s", now)
            return True
        return False

    def _expired(self, job: _Job, waited: float, now: float) -> None:
        self._fail(job.room, FailureKind.WRITE,
                   f"room {job.room.room}: its write for {receiver_text(job.info.session_id)} waited {waited:.1f}s "
                   f"since the room's first ask for a free write slot or its ready event, past the fanout timeout "
                   f"{self.fanout_timeout_s:g}s; not started", now)

    def _paused_detail(self, session: str, room: int, since: float, now: float) -> str:
        """Why a write to `session`, paused by its breaker, was skipped: the failure, how long the pause
        lasts, what ends it and what to check."""
        why = self.breaker.detail(session)
        entry = self.breaker.entry(session)
        left = max(0.0, entry[1] - now) if entry is not None else 0.0
        peer = receiver_text(session)
        ends = "asks or registers again" if self.breaker.revivable(session) else "registers again"
        return (f"write to {peer} (room {room}) skipped: a write to it failed {now - since:.1f}s ago"
                + (f" ({why})" if why else "")
                + f"; writes to it fail at once for {left:.1f}s more, or until its prefill rank {ends}: "
                  f"is the prefill rank whose engine is {peer} still running, and that session's host and port "
                  f"reachable from this encode node?")

    def _start(self, job: _Job, now: float) -> None:
        """Emits one receiver's write, unless its session's breaker is open or its destination is no longer inside
        the regions its session announces (it registered again, or was superseded, while the write was queued)."""
        room, info = job.room, job.info
        if job in room.queued:
            del room.queued[job]
        offer = room.offer
        since = self.breaker.open_since(info.session_id, now) if self.breaker.tripped else None
        if since is not None:
            self._skip(job, FailureKind.WRITE, self._paused_detail(info.session_id, room.room, since, now), now)
            return
        outside = (None if job.regions_checked == self.regions.version
                   else self.regions.check([info], offer.row_bytes, offer.deepstack_row_bytes))
        if outside is not None:
            self._skip(job, FailureKind.REGION, f"{outside} (found as its queued write was to start)", now)
            return
        srcs: tuple[int, ...] = (offer.src_addr + info.row_start * offer.row_bytes,)
        dsts: tuple[int, ...] = (info.embedding_ptr,)
        nbytes = info.rows * offer.row_bytes
        lengths: tuple[int, ...] = (nbytes,)
        if offer.deepstack_addr is not None:
            srcs += (offer.deepstack_addr + info.row_start * offer.deepstack_row_bytes,)
            dsts += (info.deepstack_ptr,)
            lengths += (info.rows * offer.deepstack_row_bytes,)
            nbytes += lengths[1]
        wid, self._next_wid = self._next_wid, self._next_wid + 1
        self._writes[wid] = job
        self._out.append(StartWrite(wid, offer.room, info.session_id, srcs, dsts, lengths, nbytes, offer.sources,
                                    offer.token))

    def _skip(self, job: _Job, kind: FailureKind, detail: str, now: float) -> None:
        """Fails the room of a write that will not start, and lets go of its turn and destinations."""
        self.scheduler.finished(job.info.session_id)
        self._fail(job.room, kind, detail, now)
        self._job_done(job, now)

    def _job_done(self, job: _Job, now: float) -> None:
        """One receiver's write is over (settled, failed or skipped): its destinations are free, and its room
        may conclude once none of its writes is left."""
        room = job.room
        if job in room.queued:
            del room.queued[job]
        if job.unwanted:  # it left the scheduler's queue
            job.unwanted = False
            self._unwanted_waiting -= 1
        self._destinations.free(job.info.session_id, job.ranges)  # _free_ranges(job), without its call
        job.ranges = ()
        room.pending -= 1
        if not room.pending:
            self._writes_over(room, now)

    def _free_ranges(self, job: _Job) -> None:
        """Lets go of the job's destinations: it is over, or it will never start."""
        self._destinations.free(job.info.session_id, job.ranges)
        job.ranges = ()

    @staticmethod
    def _ranges(infos: list[TransferInfo], offer: Offer) -> list[list[tuple[int, int]]]:
        """The destination byte ranges [start, end) each receiver's write covers (empty ones left out)."""
        every = []
        for info in infos:
            length = info.rows * offer.row_bytes
            ranges = [(info.embedding_ptr, info.embedding_ptr + length)] if length > 0 else []
            if offer.deepstack_addr is not None:
                length = info.rows * offer.deepstack_row_bytes
                if length > 0:
                    ranges.append((info.deepstack_ptr, info.deepstack_ptr + length))
            every.append(ranges)
        return every

    def _overlap(self, infos: list[TransferInfo], ranges: list[list[tuple[int, int]]], now: float) -> str | None:
        """Why a receiver's destination overlaps another room's write of the same session still queued or
        in flight, or failed within its quarantine, or None: two rooms writing one range would leave
        either's rows torn."""
        self._destinations.expire(now)
        for info, spans in zip(infos, ranges):
            for start, end in spans:
                other = self._destinations.overlap(info.session_id, info.room, start, end)
                if other is None:
                    continue
                what = (f"room {info.room}: receiver {receiver_text(info.session_id)} destination "
                        f"[{start:#x}, {end:#x}) overlaps room {other.room}'s [{other.start:#x}, {other.end:#x})")
                if other.until is None:
                    return f"{what}, still in flight"
                failed_at = other.until - FAILED_WRITE_QUARANTINE_S
                return (f"{what}, whose write there failed {now - failed_at:.1f}s ago: its bytes may still land "
                        f"for {other.until - now:.1f}s more; give the room another destination, or ask again then")
        return None

    def _writes_over(self, room: _Room, now: float) -> None:
        """The last of the room's writes is over (settled, failed or skipped)."""
        if room.failed:
            self._release_when_idle(room)
        elif room.orphans:
            pass  # receivers restarted before served: the sources stay held for their successors' asks
        else:
            room.succeeded = True
            self._conclude(room, TransferPoll.Success, None, now)

    def _fail(self, room: _Room, kind: FailureKind, detail: str, now: float) -> None:
        """Fails the room once and tells every receiver it has; a room already served is left alone."""
        self._fail_with(room, Failure(kind, detail), now)

    def _fail_with(self, room: _Room, failure: Failure, now: float) -> None:
        """`_fail`, with the Failure made already."""
        if room.failed or room.succeeded:
            return  # a Failed after their Success would undo it (Failed is sticky on the wire)
        room.failed = True
        room.failure = failure
        # Its writes still waiting for a slot will never start: their receivers may reuse that memory now
        # (a cancel is confirmed at once), so the next room asking for it must not find it taken.
        for job in room.queued:
            self._free_ranges(job)
            self._count_unwanted(job)
        self._unserved.discard(room.room)
        self._tell_failed(room.receivers, room.failure)
        self._conclude(room, TransferPoll.Failed, room.failure, now)

    def _conclude(self, room: _Room, status: TransferPoll, failure: Failure | None, now: float) -> None:
        offer = room.offer  # its number read there, without the `room` property's call
        self._out.append(Conclude(offer.room, offer.token, status, failure, now))
        self._release_when_idle(room)

    def _release_when_idle(self, room: _Room) -> None:
        """Releases the room's sources once none of its writes waits or is in flight."""
        if room.pending or room.released:
            return
        room.released = True
        offer = room.offer  # its number read there, without the `room` property's call
        self._out.append(Release(offer.room, offer.token))

    def _fail_cleared_asks(self, room_number: int, cleared_at: float, asked_then: int) -> None:
        """Tells the receivers parked for a room cleared unserved Failed, unless it was sent again.

        Only asks parked before the clear were the cleared item's: a room whose first
        ask came later, or one sent again since (a retry), keeps its asks. The failure
        counts the asks parked at the clear (`asked_then`); those that came within the grace are named apart.
        """
        asks = self.parked.get(room_number)
        if asks is None or asks.first_at > cleared_at or room_number in self._rooms:
            return
        self.parked.take(room_number)
        asked = f"{asked_then} of {asks.fanout} prefill ranks asked"
        if len(asks.infos) > asked_then:
            asked += f"; {len(asks.infos) - asked_then} more since"
        sessions = (", ".join(receiver_text(s) for s in sorted(asks.infos)[:3])
                    + (", ..." if len(asks.infos) > 3 else ""))
        self._warn("cleared", "room %d: the caller cleared it before its whole fanout asked (%s: %s); telling them "
                   "Failed. Are the other ranks of the fanout running and routed to this encode rank, or was the "
                   "room cleared too early?", room_number, asked, sessions)
        self._tell_failed(asks.infos.values(), Failure(
            FailureKind.CLEARED, f"room {room_number}: the encode side cleared it before its whole fanout asked "
                                 f"({asked})"))

    def _sweep(self, now: float) -> None:
        """Fails items whose receivers never all asked, and asks whose item never came.

        An item is parked from its send or from its room's first ask, whichever came
        first: past the fanout timeout of that ask no write of it may start.
        """
        limit = self.fanout_timeout_s
        for number in list(self._unserved):
            room = self._rooms[number]
            asks = self.parked.get(number)
            since = room.offered_at if asks is None else min(room.offered_at, asks.first_at)
            if room.orphaned_at is not None:
                since = max(since, room.orphaned_at)
            if now - since > limit:
                taken = self.parked.take(number)
                if taken is not None:  # named in the room's failure with the receivers it had
                    sessions = {info.session_id for info in room.receivers}
                    room.receivers += [info for info in taken.infos.values() if info.session_id not in sessions]
                asked = _asked(taken)
                if room.orphans:  # its receivers all asked; some restarted before they were served
                    shards = ", ".join(f"rows {info.row_start}+{info.rows} of {receiver_text(info.session_id)}"
                                       for info in room.orphans[:3])
                    asked = (f"{len(room.orphans)} receiver(s) restarted before they were served and no successor "
                             f"asked for their shards: {shards}")
                self._fail(room, FailureKind.FANOUT_TIMEOUT, f"receiver never registered within {limit:g}s ({asked})",
                           now)
        for number in self.parked.older_than(now - limit):
            if number in self._rooms:
                continue
            taken = self.parked.take(number)
            if taken is None:
                continue
            self._warn("unserved", "room %d: no item sent within %gs for %d receiver(s); telling them Failed",
                       number, limit, len(taken.infos))
            self._tell_failed(taken.infos.values(), Failure(
                FailureKind.OTHER, f"room {number}: no item was sent for it within {limit:g}s of its first ask"))
            remember(self._asks_timed_out, number, _TimedOutAsks(_asked(taken), taken.first_at, now),
                     MAX_CANCELLED_ROOMS)
        forget_before(self._asks_timed_out, now - limit)
        forget_before(self._cancelled, now - limit)
        # Kept a grace longer: a re-ask it let in near the end is told once that grace passed.
        forget_before(self._cleared_failures, now - limit - CLEARED_GRACE_S)
        self.breaker.sweep(now)

    # ------------------------------------------------------------ output

    def _push(self, info: TransferInfo, status: TransferPoll, checksums: tuple[int, ...] = (),
              failure: Failure | None = None) -> None:
        self._out.append(PushStatus(info.endpoint, info.port, info.room, status, tuple(checksums), None, failure))

    def _answer_cancel(self, cancel: Cancel, answer: CancelAnswer) -> None:
        self._out.append(PushStatus(cancel.endpoint, cancel.port, cancel.room, TransferPoll.Failed, (), answer))
        self._out.append(Count("cancels_total", answer.name.lower()))

    def _job_over(self, job: _Job, *, failed: bool = False) -> None:
        """A write is over: a receiver that cancelled while it flew is answered once no other write that
        cancel found in flight is left: its memory is safe, or, if one of them failed, it may not be (the
        engine gave up on a write whose bytes may still land: the receiver waits out its quarantine).
        A receiver whose cancel did not say it reads that answer is told confirmed."""
        for wait in job.waits:
            wait.left -= 1
            wait.failed = wait.failed or failed
            if not wait.left:
                unsafe = wait.failed and wait.cancel.reads_write_failed
                self._answer_cancel(wait.cancel, CancelAnswer.WRITE_FAILED if unsafe else CancelAnswer.CONFIRMED)

    def _tell_failed(self, infos, failure: Failure | None) -> None:
        for info in infos:
            self._push(info, TransferPoll.Failed, (), failure)

    def _warn(self, key: str, message: str, *args: object) -> None:
        self._out.append(Warn(key, message, args))

    def _flush(self, now: float) -> list:
        if self.scheduler.waiting:  # else _pump() has no write to start
            self._pump(now)
        out, self._out = self._out, []
        return out

    def _out_take(self) -> list:
        out, self._out = self._out, []
        return out

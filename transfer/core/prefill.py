"""PrefillCore: a prefill rank's room rules as events in, actions out (SPEC.md sections 5, 7, 8).

No threads, sockets, engine calls or clock reads: every event carries `now`, and the
driver (transfer.drive.prefill) carries out the actions in the order they come:
look a route up, announce a region, send an ask, verify a checksum, conclude a room,
drop a connection. The rules kept here: bootstrap look-ups are cached and shared by
the rooms that wait on them, a server that failed slowly is not asked again for a
while, a route the server no longer has fails the rooms that could only be served
through it at once (`route_missing`; a dropped connection has the routes of the rooms
asked on it looked up, and again while they wait, so they fail once a successor registered:
`_orphaned`), a region is announced before the first ask that lands in it, asks wait in
order while their encode rank's socket cannot take them, statuses move rooms
(Failed sticky, a wrong encode rank ignored), and a room concludes once, at the
latest at its deadline (a Success its encode rank then says Failed is overturned).
Connections to encode ranks are bounded: one to an address its encode rank left is closed
when that is learnt, if nothing needs it (`_retire`), and at most `max_sockets` are kept
(`_make_room`).

A room given up on after its ask went out (its deadline, clear() before Success, or close())
gets a cancel (our extension) on the connection it was asked on, unless that connection
dropped since, its encode rank left a cancel unanswered CANCEL_SILENCE_S, or another
cancel of the room number still waits (see `_give_up`); the memory it offered
is safe to reuse (`MemorySafe`) at once when no encode rank was ever asked, or once
the encode rank confirms the cancel. Without either, only the caller's quarantine
bound makes it safe. A room asked for again while such a cancel is unanswered must
not take the earlier ask's status for its own (see `_ask`).

A room that fails before its ask went out gets an unasked cancel to its encode rank, where
that rank is known, ours, and connected (see `_unasked_cancel`): that rank would otherwise hold
the item, and the asks of the rest of the room's fanout, until its fanout timeout, and those
prefill ranks' rooms until their deadlines.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, final

from transfer.core.announce import AnnounceBook, Region
from transfer.core.ask_queue import AskQueues
from transfer.core.bounded import remember
from transfer.core.cancels import CANCEL_SILENCE_S, STALE_CANCEL_S, CancelBook
from transfer.core.failure import Failure, FailureKind
from transfer.core.prefill_breaker import BootstrapBreaker
from transfer.core.unread import UNREAD_GRACE_S, UnreadGrace
from transfer.errors import ConfigError
from transfer.frames import CancelAnswer, TransferInfo, cancel_frames, registration_frames
from transfer.status import TransferPoll

__all__ = [
    "ASK_BATCH",
    "CANCEL_SILENCE_S",
    "ENCODE_FAILED",
    "MAX_ENCODE_SOCKETS",
    "MAX_ROUTES",
    "MAX_SIZES",
    "QUEUED_LOOKUP_S",
    "STRANDED_LOOKUP_MAX_S",
    "STRANDED_LOOKUP_S",
    "Advance",
    "Announce",
    "Conclude",
    "Disconnect",
    "LookUpParallel",
    "LookUpRoute",
    "MemorySafe",
    "Overturn",
    "PrefillCore",
    "RoomSpec",
    "SendAsk",
    "SendCancel",
    "UNREAD_GRACE_S",
    "Verify",
    "Warn",
    "checksum_failed_detail",
]

ENCODE_FAILED = "encode failed to send embedding"

#: Asks waiting for a connection sent per `writable` event: the driver reads statuses
#: and runs deadlines between batches.
ASK_BATCH = 256

#: How long a room asked for again may wait for the answer to the cancel of its earlier ask,
#: from an encode rank not yet seen to answer cancels (a peer never answers: its ask then goes).
CANCEL_ANSWER_WAIT_S = 0.5

#: How long asks may wait for their encode rank's socket before its route is looked up again
#: (and again each time as long after): a rank restarted at another port leaves its old address
#: behind at the bootstrap server until it registers again, and no connection is ever made there.
QUEUED_LOOKUP_S = 2.0

#: How soon after the look-up a dropped connection made for the rooms asked on it their encode rank's
#: route is looked up again, and on while any of them is open (the wait doubles after each look-up, up
#: to STRANDED_LOOKUP_MAX_S: 1, 2, 4, 4, ... s): that look-up may have come before a successor
#: registered, and rooms asked of a process that went away fail only once the server names another
#: (`_orphaned`), not at their deadlines.
STRANDED_LOOKUP_S = 1.0
STRANDED_LOOKUP_MAX_S = 4.0

#: Bootstrap servers whose sizes, and encode ranks whose addresses, are remembered (past
#: these the oldest is forgotten, and looked up again if a room needs it).
MAX_SIZES = 1024
MAX_ROUTES = 16384

#: Connections (each a socket and its monitor in the driver) to encode ranks kept at most: past it the
#: least recently used with nothing under way is closed before a new one opens, and when every one has
#: something under way the room that needs another fails at once.
MAX_ENCODE_SOCKETS = 256

RouteKey = tuple[str, int, int]  # (bootstrap address, dp group, encode rank)
Address = tuple[str, int]


# --------------------------------------------------------------------- actions


@dataclass(frozen=True)
class LookUpParallel:
    """Ask the bootstrap server for the encode side's (tp, dp) sizes."""

    bootstrap_addr: str


@dataclass(frozen=True)
class LookUpRoute:
    """Ask the bootstrap server where one encode rank's request socket listens."""

    key: RouteKey

    @property
    def bootstrap_addr(self) -> str:
        return self.key[0]


# The actions a room makes every time are plain slotted dataclasses: a frozen one's
# __init__ costs a microsecond per field, on the caller's thread.


@final
@dataclass(slots=True)
class Announce:
    """Push a registration (the room's regions) to the encode rank at `addr`."""

    addr: Address
    room: int
    token: int
    route_key: RouteKey
    region: Region
    frames: list[bytes] = field(repr=False, compare=False)


@final
@dataclass(slots=True)
class SendAsk:
    """Push the room's TransferInfo to the encode rank at `addr`."""

    addr: Address
    room: int
    token: int
    info: TransferInfo


@dataclass(frozen=True)
class SendCancel:
    """Tell the encode rank at `addr` the room is given up: write nothing more into its memory; or (`unasked`)
    that the room failed before its ask went out, so its fanout will not complete (no answer is awaited)."""

    addr: Address
    room: int
    rank: int
    token: int
    frames: list[bytes] = field(repr=False, compare=False)
    unasked: bool = False


@dataclass(frozen=True)
class MemorySafe:
    """No encode rank writes into the memory the room (this token) offered any more."""

    room: int
    token: int


@dataclass(frozen=True)
class Verify:
    """Checksum the landed bytes: `checks` are (what, region, addr, nbytes, expected); `where` names the
    encode rank whose Success it checks, for failure reasons."""

    room: int
    token: int
    checks: tuple[tuple[str, Any, int, int, int], ...]
    where: str = "its encode rank"


@dataclass(slots=True)
class Advance:
    """Move the room to a non-terminal status the encode rank reported."""

    room: int
    token: int
    status: TransferPoll


@dataclass(slots=True)
class Conclude:
    """The room is over: Success when `failure` is None (`unverified`: the encode rank sent no checksum)."""

    room: int
    token: int
    failure: Failure | None = None
    unverified: bool = False


@dataclass(frozen=True)
class Overturn:
    """A room concluded Success was told Failed by its encode rank since: it is Failed now."""

    room: int
    token: int
    failure: Failure


@dataclass(frozen=True)
class Disconnect:
    """Close the socket to `addr`, dropping what it queued; the next ask opens a fresh one.

    `flush`: a cancel was just queued on it, so it is given a moment to go out first.
    """

    addr: Address
    flush: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class Warn:
    """A complaint about what a peer sent, throttled by `key`: the complaint's kind, never a value the
    peer chose (a peer varying it would get a throttled line, and a kind remembered, per message)."""

    key: str
    message: str


# ----------------------------------------------------------------------- rooms


@dataclass(slots=True, eq=False)
class RoomSpec:
    """What the caller asked for: the room, its bootstrap server and where its rows land.

    `regions` is the announced region pair holding the destination (its `embedding` and
    `deepstack` have `addr` and `nbytes`); the core only reads those and hands it back in
    Verify actions. `deepstack_row_bytes` is the bytes of one deepstack row of the
    destination's layout (None: not known, e.g. an empty shard given as raw memory); the
    ask carries it as part 13 when the room has deepstack.
    """

    room: int
    bootstrap_addr: str
    embedding_ptr: int
    rows: int
    hidden: int
    dtype: str
    row_bytes: int
    row_start: int
    span: int
    regions: Any
    deepstack_ptr: int = 0
    deepstack_nbytes: int = 0
    has_deepstack: bool = False
    deepstack_row_bytes: int | None = None


# A room's stages, in order; it may skip ahead to CONCLUDED from any of them. HELD: its ask waits
# for the answer to the cancel of an earlier ask of the room.
LOOKUP, HELD, QUEUED, ASKED, VERIFYING, CONCLUDED = "lookup", "held", "queued", "asked", "verifying", "concluded"


@dataclass(slots=True, eq=False)
class _Room:
    spec: RoomSpec
    token: int
    deadline: float
    room: int  # spec.room, read without a call
    stage: str = LOOKUP
    encode_rank: int | None = None
    fanout: int = 1
    route_key: RouteKey | None = None
    addr: Address | None = None
    conn: int = 0  # the connection it was asked on (or waits for)
    instance: str | None = None  # the registration of its encode rank it was asked of, where the server names it
    asked_at: float = 0.0
    outcome: Failure | None = None  # once concluded
    asked: bool = False  # its TransferInfo was handed to a socket at least once
    partly_verified: bool = False  # its Success carried checksums for some of its regions only
    given_up: bool = False  # given up on already: abandon() and _expire() send it no (further) cancel
    safe: bool = False  # no encode rank writes into its memory any more (known without a cancel)

    def where(self) -> str:
        """The encode rank this room waits on, for failure reasons."""
        if self.encode_rank is None:
            return f"its encode rank (bootstrap {self.spec.bootstrap_addr})"
        if self.addr is None:  # its route look-up had not answered
            return f"encode rank {self.encode_rank} (bootstrap {self.spec.bootstrap_addr})"
        host, port = self.addr
        return f"encode rank {self.encode_rank} at {host}:{port}"


@dataclass(slots=True, eq=False)
class _Stranded:
    """Rooms of one route asked on connections that dropped since, and when their route is next looked up."""

    addr: Address  # the address of the latest of those connections
    rooms: list[_Room]
    due: float
    every: float = STRANDED_LOOKUP_S  # the wait before the last look-up (it doubles after each)


def checksum_failed_detail(room: int, what: str, addr: int, nbytes: int, where: str, exc: BaseException) -> str:
    """Why a room failed when checksumming its landed `what` (embedding or deepstack) raised, and what to check."""
    return (f"room {room}: checksumming its landed {what} ({nbytes} bytes at {addr:#x}) to verify the Success from "
            f"{where} failed: {type(exc).__name__}: {exc}; the room is failed rather than taken unverified: is its "
            f"receive memory still allocated, and its device usable?")


def silent_room_detail(where: str, room: int, deadline_s: float, *, alive: bool, fanout: int,
                       quiet_s: float | None = None) -> str:
    """Why an asked room had no status by its deadline, and what to check: `alive` when its encode rank
    answered other rooms after this one was asked (so it ran then, and was not given this room's item);
    `quiet_s`, where given, the seconds since that rank's last answer, when they are half the deadline or more
    (it may have stopped since)."""
    head = f"no status from {where} within {deadline_s:g}s for room {room}"
    fanned = (f" Its encode rank also holds the item until all {fanout} prefill ranks of its fanout asked for it: "
              f"do they all run and ask?") if fanout > 1 else ""
    if alive and quiet_s is not None:
        return (f"{head}: that rank answered other rooms after this one was asked, and nothing in the {quiet_s:.3g}s "
                f"since its last answer: it may have stopped or wedged since (a stopped process, a debugger, a hung "
                f"device), or runs and was not given room {room}'s item: is it alive and serving, and did the encode "
                f"side call send() for room {room}, on that rank, under that number?{fanned}")
    if alive:
        return (f"{head}: that rank answered other rooms since, so it runs but was not given room {room}'s item: "
                f"did the encode side call send() for room {room}, on that rank, under that number?{fanned} "
                f"An item slower to encode than {deadline_s:g}s needs a larger deadline_s")
    return (f"{head}: nothing came from that rank since the room was asked: is it alive and serving, and did the "
            f"encode side call send() for room {room}?{fanned} A slow first contact or encode needs a larger "
            f"deadline_s")


class PrefillCore:
    """One prefill rank's rooms: receive, clear, look-up results, statuses, checksums and ticks."""

    def __init__(
        self,
        engine_rank: int,
        tp_size: int,
        dp_size: int,
        *,
        host: str,
        status_port: int,
        session_id: str,
        deadline_s: float = 60.0,
        integrity: bool = True,
        breaker: BootstrapBreaker | None = None,
        announcements: AnnounceBook | None = None,
        asks: AskQueues | None = None,
        ask_batch: int = ASK_BATCH,
        max_sockets: int = MAX_ENCODE_SOCKETS,
    ) -> None:
        self.engine_rank = engine_rank
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.host = host
        self.status_port = status_port
        self.session_id = session_id
        self.deadline_s = deadline_s
        self.integrity = integrity
        self.breaker = BootstrapBreaker() if breaker is None else breaker
        self.announcements = AnnounceBook() if announcements is None else announcements
        self.asks = AskQueues() if asks is None else asks
        self.ask_batch = ask_batch
        self.max_sockets = max_sockets
        self._rooms: dict[int, _Room] = {}
        # Counts the rooms cleared or concluded while their asks were queued: only that leaves an ask in a
        # queue whose room no longer waits there, so a full queue is pruned once after each, not per ask.
        self._let_go = 0
        self._pruned_at: dict[Address, int] = {}  # _let_go at each full queue's last prune
        self._tokens = 0
        self._deadlines: list[tuple[float, int, _Room]] = []
        self._parallel: dict[str, tuple[int, int]] = {}
        self._sizes_reread: set[str] = set()  # servers whose sizes a 404 had read again, that read not answered yet
        self._routes: dict[RouteKey, Address] = {}
        self._resolved: dict[RouteKey, Address] = {}  # where each route was last found, kept when forgotten
        self._instances: dict[RouteKey, str] = {}  # the registration each route was last found of (our servers say)
        self._gone: dict[RouteKey, Address] = {}  # routes the server no longer has: where each was last found
        self._probes: dict[RouteKey, Address] = {}  # routes looked up again: where their queued asks wait
        self._probed_at: dict[Address, float] = {}  # when the routes of asks waiting there were looked up again
        self._stranded: dict[RouteKey, _Stranded] = {}  # rooms asked on a dropped connection, per route
        self._stranded_next = float("inf")  # at most the earliest of their look-ups' due times
        self._awaiting_parallel: dict[str, list[_Room]] = {}
        self._awaiting_route: dict[RouteKey, list[_Room]] = {}
        self._conns: dict[Address, int] = {}  # the connection in use per encode address, least recently used first
        self._conn_serial = 0
        self.cancels = CancelBook(self._conns.get)  # awaiting answers, and what answers showed of each address
        self._answered_at: dict[Address, float] = {}  # when the current connection there last answered a room
        # (room, encode rank) -> (when, token) of an asked room given up with no cancel that holds back its
        # statuses: that ask may still be served, and its statuses look like a later ask's (`_unfenced`). Oldest
        # first, and only those given up within STALE_CANCEL_S, past which one no longer counts.
        self._unfenced_asks: dict[tuple[int, int], tuple[float, int]] = {}
        self._held: list[tuple[float, int, _Room]] = []  # (when its ask goes anyway, token, room), a heap
        self._unread = UnreadGrace()  # holds the rules for want of a status while statuses may be unread
        # Room -> the encode rank whose plain Success the driver may settle without status() (transfer.core.lane):
        # rooms asked in the plain case, until anything else happens to them. The driver reads it and takes a
        # room out as it settles one, then tells lanes_settled().
        self.lanes: dict[int, int] = {}

    # ------------------------------------------------------------ queries

    def __contains__(self, room: object) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def token(self, room: int) -> int | None:
        """The token of the room held under this number, or None."""
        state = self._rooms.get(room)
        return None if state is None else state.token

    def stage(self, room: int) -> str | None:
        """Where the room stands (lookup, held, queued, asked, verifying, concluded), or None."""
        state = self._rooms.get(room)
        return None if state is None else state.stage

    def asking(self, room: int, token: int) -> bool:
        """Whether the room's ask may go out now (held, not concluded, not waiting in a queue)."""
        rooms = self._rooms
        if room not in rooms:  # then read by key, without dict.get()'s call
            return False
        state = rooms[room]
        return state.token == token and state.stage == ASKED

    def waiting(self, addr: Address) -> int:
        """Asks waiting for `addr`'s socket to take them."""
        return self.asks.waiting(addr)

    def route(self, key: RouteKey) -> Address | None:
        """The cached route of an encode rank, or None."""
        return self._routes.get(key)

    def next_wakeup(self) -> float | None:
        """When tick() next has something to do (the earliest open room's deadline, held ask, asks
        waiting for a socket too long, or look-up for rooms asked on a dropped connection), or None."""
        rules = self._rules_due()
        held_until = self._unread.until  # held back by a tick with statuses maybe unread (UnreadGrace.defer())
        if held_until is not None:
            rules = held_until
        if not self.asks.queues and not self._stranded:
            return rules  # the plain case: no ask waits for a socket (heads() would find none), no room for a route
        heads = self.asks.heads(self._queued)
        if not heads and not self._stranded:
            return rules
        due = [self._recheck_due(addr, head) for addr, head in heads]
        if self._stranded:
            due.append(self._stranded_next)
        if rules is not None:
            due.append(rules)
        return min(due) if due else None

    def wakes_before(self, t: float) -> bool:
        """Whether next_wakeup() is before `t`. With no ask waiting for a socket, no room waiting for a route and
        no unread grace holding the rules, next_wakeup() is the rules' due time, no earlier than the tops of
        their heaps (an entry no longer due only leaves a heap, moving its top later): tops at `t` or later, or
        none, answer no without the entries that are no longer due being popped (next_wakeup() pops them)."""
        if self._unread.until is None and not self.asks.queues and not self._stranded:
            deadlines, held = self._deadlines, self._held
            if (not deadlines or deadlines[0][0] >= t) and (not held or held[0][0] >= t):
                return False
        wakeup = self.next_wakeup()
        return wakeup is not None and wakeup < t

    def _rules_due(self) -> float | None:
        """When the earliest of the rules that act for want of a status comes due (an open room's
        deadline, a held ask's wait for its cancel's answer), or None."""
        heap, rooms = self._deadlines, self._rooms
        while heap:
            state = heap[0][2]
            # _open(state), without its call, and the room read by key without dict.get()'s (rooms files no None)
            if state.room in rooms and rooms[state.room] is state and state.stage != CONCLUDED:
                break
            heapq.heappop(heap)
        held = self._held
        while held and not self._in(held[0][2], HELD):
            heapq.heappop(held)
        if not held:
            return heap[0][0] if heap else None
        return min(heap[0][0], held[0][0]) if heap else held[0][0]

    def deadline_entries(self) -> int:
        """Entries in the deadline heap (bounded by the open rooms, plus slack)."""
        return len(self._deadlines)

    # ------------------------------------------------------------- events

    def refuse_held(self, room: int) -> None:
        """ConfigError when a room of this number is held (received and not cleared yet)."""
        if room in self._rooms:
            raise ConfigError(f"room {room} is already being received; clear() it first")

    def receive(self, now: float, spec: RoomSpec) -> tuple[int, list]:
        """A room the caller asks for; returns its token and the actions to start it. Refused (ConfigError)
        while its number is held; a room that raises is not held."""
        room = spec.room
        if room in self._rooms:
            self.refuse_held(room)
        self._tokens += 1
        state = _Room(spec, self._tokens, now + self.deadline_s, room)
        self._rooms[room] = state
        heapq.heappush(self._deadlines, (state.deadline, state.token, state))
        try:
            return state.token, self._route(now, state)
        except BaseException:
            del self._rooms[room]
            raise

    def abandon(self, now: float, room: int, token: int) -> list:
        """The caller is about to clear the room: unless it succeeded, its encode rank is told to write nothing more."""
        state = self._rooms.get(room)
        if state is None or state.token != token or state.given_up:
            return []
        if state.stage == CONCLUDED and state.outcome is None:
            return []  # Success: the write is over
        # A Success whose bytes are not checked yet may be an earlier ask's under the same room
        # number (statuses name only the room), so the write this token asked for may still
        # come: such a room is cancelled like one still waiting.
        return self._give_up(now, state)

    def safe(self, room: int, token: int) -> bool:
        """Whether no encode rank writes into the room's memory any more, known without a cancel's answer."""
        state = self._rooms.get(room)  # one read: the driver's close() asks without its lock when that is stuck
        return state is not None and state.token == token and state.safe

    @property
    def pending_cancels(self) -> int:
        """Cancels sent and not yet confirmed."""
        return self.cancels.pending

    @property
    def cancels_set_aside(self) -> int:
        """Rooms whose cancels were set aside unanswered and still take late answers (safe to read from another
        thread); at MAX_GHOSTS no cancel is sent."""
        return len(self.cancels.ghosts)

    def cancel_answered(self, now: float, room: int, rank: int, answer: CancelAnswer) -> list:
        """An encode rank answered a cancel: its memory is safe once the answer is CONFIRMED.

        An encode rank answers its cancels for a room in the order they came, each with
        TOO_LATE (a write was in flight) then CONFIRMED or WRITE_FAILED (that write failed:
        its bytes may still land, so the memory waits out its quarantine), or CONFIRMED alone.
        """
        cancel = self.cancels.answered((room, rank), answer)
        if cancel is None:
            return []
        self._answered(now, cancel.addr, cancel.conn)
        safe = [MemorySafe(room, cancel.token)] if answer is CancelAnswer.CONFIRMED else []
        return [*safe, *self._release(now, room, rank)]

    def cancel_unsent(self, now: float, room: int, rank: int, token: int) -> list:
        """The socket did not take the room's cancel to encode rank `rank`: no answer will come for it
        (its memory waits out the quarantine), so it holds nothing back and says nothing of that
        rank's silence."""
        if self.cancels.unsent((room, rank), token) is None:
            return []
        return self._release(now, room, rank)

    def _set_aside(self, now: float, key: tuple[int, int]) -> list:
        """Sets every cancel of (room, encode rank) `key` aside as a ghost that takes their answers still to
        come; a held ask waiting for them goes."""
        self.cancels.set_aside(key)
        return self._release(now, *key)

    def clear(self, now: float, room: int, token: int | None = None) -> bool:
        """Forgets the room (its asks not yet sent never go out); False when it was not held."""
        state = self._rooms.get(room)
        if state is None or (token is not None and state.token != token):
            return False
        del self._rooms[room]
        self.lanes.pop(room, None)
        if state.stage == QUEUED:
            self._let_go += 1
        return True

    def let_go(self, now: float, room: int, token: int) -> bool:
        """safe() then clear() of the room held under `token`, with one look-up: whether no encode rank writes into
        its memory any more (known without a cancel's answer), False when it was not held."""
        state = self._rooms.get(room)
        if state is None or state.token != token:
            return False
        return self._forget(state)

    def abandon_or_let_go(self, now: float, room: int, token: int) -> tuple[list, bool | None]:
        """abandon(), and let_go() too where abandon() has nothing to carry out, with one look-up: abandon()'s
        actions and None (let_go() follows once they are carried out), or no actions and let_go()'s answer."""
        rooms = self._rooms
        state = rooms[room] if room in rooms else None  # rooms.get(), without its call
        if state is None or state.token != token:
            return [], False
        if state.given_up or (state.stage == CONCLUDED and state.outcome is None):  # abandon() has nothing to do
            return [], self._forget(state)
        actions = self._give_up(now, state)
        return (actions, None) if actions else ([], self.let_go(now, room, token))

    def _forget(self, state: _Room) -> bool:
        """let_go() of the room `state` held: whether its memory is safe."""
        room = state.room
        del self._rooms[room]
        if room in self.lanes:  # cleared before the driver settled its lane
            del self.lanes[room]
        if state.stage == QUEUED:
            self._let_go += 1
        return state.safe

    def parallel_resolved(self, now: float, bootstrap_addr: str, encode_tp: int, encode_dp: int) -> list:
        """The bootstrap server told the encode side's sizes. Sizes other than those known before (the encode
        side restarted resized) forget the routes found at that server: each was computed from the old ones."""
        self._sizes_reread.discard(bootstrap_addr)
        before = self._parallel.get(bootstrap_addr)
        if before is not None and before != (encode_tp, encode_dp):
            for key in [key for key in self._routes if key[0] == bootstrap_addr]:
                del self._routes[key]
        remember(self._parallel, bootstrap_addr, (encode_tp, encode_dp), MAX_SIZES)
        self.breaker.succeeded(bootstrap_addr)
        actions: list = []
        waiting = [state for state in self._awaiting_parallel.pop(bootstrap_addr, ()) if self._looking_up(state)]
        for i, state in enumerate(waiting):
            actions += self._route(now, state, defer=i >= self.ask_batch)
        return actions

    def route_resolved(self, now: float, key: RouteKey, addr: Address, instance: str | None = None) -> list:
        """The bootstrap server told where an encode rank listens (and, ours, which registration of it:
        `instance`): rooms waiting for that go, and asks that waited at another address for it
        (`_recheck`) move there, in their order. The connection to the address it was found at before is
        closed at once if nothing needs it (`_retire`). Rooms asked on a connection that dropped since
        of a registration that is not this one fail (`_orphaned`).

        A look-up made only for the asks and rooms of an address whose connection dropped since, that
        names that address again, tells nothing new of where the rank is (a rank restarting elsewhere
        has not registered yet): the route stays forgotten, and the next room looks it up again (as do
        the rooms asked there, while they wait: `_stranded_look_ups`)."""
        probed = self._probes.pop(key, None)
        waiting = [state for state in self._awaiting_route.pop(key, ()) if self._looking_up(state)]
        if probed != addr or key in self._routes or waiting:
            remember(self._routes, key, addr, MAX_ROUTES)
        self._gone.pop(key, None)
        before = self._resolved.get(key)
        remember(self._resolved, key, addr, MAX_ROUTES)
        if instance is not None:
            remember(self._instances, key, instance, MAX_ROUTES)
        else:
            self._instances.pop(key, None)
        self.breaker.succeeded(key[0])
        moved = [state for other in self.asks.addresses() if other != addr
                 for state in self.asks.remove(other, lambda queued: queued.route_key == key) if self._queued(state)]
        moved.sort(key=lambda state: (state.asked_at, state.token))  # oldest first, wherever each waited
        actions = self._orphaned(key, addr, instance)
        if key in self._stranded:
            self._still_stranded(key)  # a look-up for them, if any is left, comes when due
        actions += [action for old in dict.fromkeys((before, probed)) if old is not None and old != addr
                    for action in self._retire(now, old)]
        for i, state in enumerate(moved):
            actions += self._ask(now, state, addr, defer=i >= self.ask_batch)
        for i, state in enumerate(waiting):
            # Past a batch, the rest wait in the ask queue: the driver sends them a batch per turn.
            actions += self._ask(now, state, addr, defer=i >= self.ask_batch)
        return actions

    def _orphaned(self, key: RouteKey, addr: Address, instance: str | None) -> list:
        """Fails the rooms of `key` asked on a connection that dropped since, of an encode rank process the
        bootstrap server no longer names: it names `addr` now, and they were asked at another address (a
        process listens at one port), or of another registration (`instance`, where the server names it:
        a process restarted at the same address). No status will come for them. Their memory waits out
        the quarantine, as a room given up with no cancel does."""
        bootstrap, group, rank = key
        actions: list = []
        for state in sorted(self._rooms.values(), key=lambda state: state.token):
            if state.route_key != key or state.stage != ASKED or state.addr is None \
                    or self._conns.get(state.addr) == state.conn:
                continue
            moved = state.addr != addr
            if not moved and (instance is None or state.instance is None or state.instance == instance):
                continue
            engine_rank = rank if state.encode_rank is None else state.encode_rank
            now_at = f"now at {addr[0]}:{addr[1]}" if moved else f"a new process at {addr[0]}:{addr[1]}"
            actions += self._conclude(state, Failure(FailureKind.NO_CONNECTION, (
                f"encode rank {engine_rank} (dp group {group}) registered again at bootstrap {bootstrap}, {now_at}: "
                f"room {state.room} was asked of the one before at {state.addr[0]}:{state.addr[1]} and that "
                f"connection dropped, so no status will come for it; ask again (send the item to the new rank)")))
        return actions

    def lookup_failed(self, now: float, bootstrap_addr: str, key: RouteKey | None, detail: str,
                      took_s: float) -> list:
        """A look-up (of the sizes when `key` is None, else of a route) failed after `took_s`: the rooms
        waiting for it fail; asks waiting at the route's last address keep waiting there (the server
        said nothing of the route: `route_missing` is its answer that it has none). A slow failure
        pauses the server: the failures say until when (`retry_at`)."""
        paused = self.breaker.failed(bootstrap_addr, now, took_s, detail)
        if key is not None:
            self._probes.pop(key, None)
        else:
            self._sizes_reread.discard(bootstrap_addr)
        waiting = self._awaiting_parallel.pop(bootstrap_addr, ()) if key is None else self._awaiting_route.pop(key, ())
        failure = Failure(FailureKind.BOOTSTRAP, f"bootstrap {bootstrap_addr}: {detail}",
                          retry_at=now + self.breaker.retry_s if paused else None)
        return [action for state in waiting if self._looking_up(state) for action in self._conclude(state, failure)]

    def route_missing(self, now: float, key: RouteKey, detail: str) -> list:
        """The bootstrap server answered that no encode rank is registered under `key` (a 404; `detail`
        says so). An answer, not an unreachable server: its breaker stays shut for its other routes.

        The server's sizes are read again (one read at a time; no room waits for it, the sizes known
        serve meanwhile): a deployment restarted with other sizes has no such route any more, and
        rooms of the new sizes go elsewhere (`parallel_resolved`).

        Every room of that route that could only ever be served through a new registration fails
        now: those waiting for the look-up, asks waiting for a socket at the route's last address
        (never asked), held asks, and rooms asked on a connection that dropped since (nothing is
        left to answer them). A room asked on a connection still up keeps waiting: its encode rank
        may serve on with the server's table lost (a restarted server). Where the route was found
        before, the reason says the encode rank is no longer registered and where it was, and the
        address's socket is closed if nothing else needs it (`_retire`).
        """
        bootstrap, group, rank = key
        self.breaker.succeeded(bootstrap)
        probed = self._probes.pop(key, None)
        self._routes.pop(key, None)
        last = self._resolved.pop(key, None)
        if last is not None:
            remember(self._gone, key, last, MAX_ROUTES)
        else:
            last = self._gone.get(key)
        failing = [state for state in self._awaiting_route.pop(key, ()) if self._looking_up(state)]
        if last is not None or probed is not None:  # else no room can have an address for it
            failing += [state for state in self._rooms.values() if state.route_key == key and (
                state.stage in (QUEUED, HELD) or (state.stage == ASKED and state.addr is not None
                                                   and self._conns.get(state.addr) != state.conn))]
        queued_at = {state.addr for state in failing if state.stage == QUEUED}
        actions: list = []
        for state in sorted(failing, key=lambda state: state.token):
            if last is None:
                text = f"bootstrap {bootstrap}: {detail}"
            else:
                engine_rank = rank if state.encode_rank is None else state.encode_rank
                text = (f"encode rank {engine_rank} (dp group {group}) is no longer registered at bootstrap "
                        f"{bootstrap} (it was at {last[0]}:{last[1]}): its sender pool closed, or the bootstrap "
                        f"server restarted; room {state.room} ")
                text += ("was asked there and that connection dropped" if state.asked
                         else "was never asked for")
            actions += self._conclude(state, Failure(FailureKind.BOOTSTRAP, text))
        for addr in queued_at:
            self.asks.prune(addr, self._queued)
        if key in self._stranded:
            self._still_stranded(key)
        if bootstrap in self._parallel and bootstrap not in self._sizes_reread:
            self._sizes_reread.add(bootstrap)
            actions.append(LookUpParallel(bootstrap))
        for old in dict.fromkeys((last, probed)):
            if old is not None:
                actions += self._retire(now, old)
        return actions

    def refused(self, now: float, addr: Address, actions: list) -> list:
        """The socket to `addr` did not take these actions (in order): their asks wait for it."""
        rooms: list[_Room] = []
        for action in actions:
            if isinstance(action, Announce):
                self.announcements.withdraw(action.addr, action.region)
            state = self._rooms.get(action.room)
            if state is not None and state.token == action.token and state.stage == ASKED \
                    and (not rooms or rooms[-1] is not state):
                state.stage = QUEUED
                state.asked = False  # its ask never left: nothing will write for it yet
                self.lanes.pop(state.room, None)
                rooms.append(state)
        self.asks.put_back(addr, rooms)
        return []

    def writable(self, now: float, addr: Address) -> list:
        """The socket to `addr` can take more: the asks that waited go out, oldest first."""
        actions: list = []
        for state in self.asks.take(addr, self.ask_batch):
            if self._open(state) and state.stage == QUEUED:
                actions += self._emit_ask(state)
        return actions

    def connection_dropped(self, now: float, addr: Address) -> list:
        """The connection to `addr` was lost: its encode rank may have restarted, there or at another
        port, or be gone. The next room for it looks it up again, a rank restarted there hears every
        region again, and the routes of the asks that never left for it and of the rooms asked on that
        connection are looked up again too: asks move if the rank moved and wait where they are
        otherwise (a failed look-up fails none of them), rooms asked keep waiting for their statuses,
        and all of them fail at once if the server no longer has the route (`route_missing`). The rooms
        asked there have their routes looked up again while they wait (`_stranded_look_ups`): they fail
        once the server names a successor, at another address or under another registration (`_orphaned`).

        What follows goes on a fresh connection: a cancel sent before the drop may never be read,
        so it holds back no later ask's statuses (`status`), and a later cancel of the same room
        is not sent (`_give_up`). An address no route leads to any more is closed (`_retire`)."""
        dropped = self._conns.get(addr)
        if dropped is not None:
            self._conn_serial += 1
            self._conns[addr] = self._conn_serial
        self._answered_at.pop(addr, None)  # what the lost connection answered says nothing of the fresh one
        self.cancels.forget(addr, answering=True)  # a rank restarted there shows afresh whether it answers cancels
        self.announcements.forget(addr)
        self.asks.prune(addr, self._queued)
        asked = [] if dropped is None else [state for state in self._rooms.values() if state.stage == ASKED
                                            and state.addr == addr and state.conn == dropped and not state.given_up]
        actions = self._recheck(now, addr, [state.route_key for state in asked])
        self._strand(now, addr, asked)
        self._forget_routes_to(addr)
        return actions + self._retire(now, addr)

    def _strand(self, now: float, addr: Address, asked: list[_Room]) -> None:
        """Files the rooms asked on the connection to `addr` that just dropped: their routes are looked up
        again STRANDED_LOOKUP_S after the look-up the drop made, and on (`_stranded_look_ups`)."""
        fresh: set[RouteKey] = set()
        for state in asked:
            key = state.route_key
            if key is None:
                continue
            if key not in fresh:  # this drop looked the route up afresh: its waits start over
                fresh.add(key)
                earlier = self._stranded.get(key)
                self._stranded[key] = _Stranded(addr, [] if earlier is None else earlier.rooms,
                                                now + STRANDED_LOOKUP_S)
            self._stranded[key].rooms.append(state)
        if fresh:
            self._next_stranded_look_up()

    def _stranded_look_ups(self, now: float) -> list:
        """Looks up again the routes of rooms asked on a connection that dropped since, once due, while any
        of them is open: the look-up their drop made may have come before a successor registered, and they
        fail once the server names one at another address or under another registration (`_orphaned`,
        `route_missing`). One look-up of a route at a time; the wait doubles after each, up to
        STRANDED_LOOKUP_MAX_S, and a server not being asked now (`breaker`) is asked later."""
        actions: list = []
        for key, stranded in list(self._stranded.items()):
            if stranded.due > now or not self._still_stranded(key):
                continue
            if key in self._probes or self._awaiting_route.get(key) or self.breaker.refusal(key[0], now) is not None:
                stranded.due = now + stranded.every
                continue  # the look-up under way answers for them too, or their server is not asked now
            stranded.every = min(2 * stranded.every, STRANDED_LOOKUP_MAX_S)
            stranded.due = now + stranded.every
            self._probes[key] = stranded.addr
            actions.append(LookUpRoute(key))
        self._next_stranded_look_up()
        return actions

    def _next_stranded_look_up(self) -> None:
        """Notes when the next of `_stranded_look_ups` comes due (one forgotten since may make it early)."""
        self._stranded_next = min((stranded.due for stranded in self._stranded.values()), default=float("inf"))

    def _still_stranded(self, key: RouteKey) -> _Stranded | None:
        """The rooms of `key` asked on a dropped connection that are still open, or None (forgotten then)."""
        stranded = self._stranded.get(key)
        if stranded is None:
            return None
        stranded.rooms = [state for state in stranded.rooms if self._in(state, ASKED) and state.addr is not None
                          and self._conns.get(state.addr) != state.conn]
        if not stranded.rooms:
            del self._stranded[key]
            return None
        return stranded

    def _recheck(self, now: float, addr: Address, asked: Collection[RouteKey | None] = ()) -> list:
        """Looks up again the routes of the asks waiting at `addr` (route_resolved moves them if the
        rank moved), and the routes `asked` (of rooms asked there), unless their bootstrap server is
        not being asked now."""
        self._probed_at[addr] = now
        actions: list = []
        waiting = [state.route_key for state in self.asks.items(addr) if self._queued(state)]
        for key in dict.fromkeys([*waiting, *asked]):
            if key is None or key in self._probes or self.breaker.refusal(key[0], now) is not None:
                continue
            self._probes[key] = addr
            if not self._awaiting_route.get(key):  # else the look-up under way answers for both
                actions.append(LookUpRoute(key))
        return actions

    def _recheck_due(self, addr: Address, head: _Room) -> float:
        """When the asks waiting at `addr` (the oldest being `head`) have their routes looked up again."""
        return max(head.asked_at, self._probed_at.get(addr, head.asked_at)) + QUEUED_LOOKUP_S

    def idle(self, addr: Address, now: float) -> bool:
        """Whether nothing is under way at `addr`: no room held for it, no ask waiting, no cancel sent on
        its current connection within CANCEL_SILENCE_S still unanswered (one lost with an earlier
        connection, or left unanswered longer, will not be answered there)."""
        if self.asks.waiting(addr) or any(state.addr == addr for state in self._rooms.values()):
            return False
        return not self.cancels.awaited_at(addr, now)

    def connection_closed(self, now: float, addr: Address) -> list:
        """The driver closed its idle socket to `addr`: a room there later connects afresh and announces
        every region again."""
        self._forget_connection(addr)
        return []

    def connected(self, addr: Address) -> bool:
        """Whether a connection to `addr` is in use (the driver closes a socket to an address that has none)."""
        return addr in self._conns

    def _in_use(self, now: float) -> set[Address]:
        """The encode addresses whose sockets something still needs: asks waiting for them, a room asked on
        their current connection that may yet be cancelled there, or a cancel sent on it within
        CANCEL_SILENCE_S unanswered. Statuses come on the status socket; a room asked on an earlier
        connection is sent no cancel (`_give_up`)."""
        conns = self._conns
        busy = {addr for addr, _ in self.asks.heads(self._queued)}
        busy.update(state.addr for state in self._rooms.values() if state.addr is not None and state.asked
                    and not state.given_up and conns.get(state.addr) == state.conn
                    and not (state.stage == CONCLUDED and state.outcome is None))  # a Success: abandon() sends none
        busy.update(self.cancels.awaited_addresses(now))
        return busy

    def _close(self, addr: Address) -> list:
        """Closes the connection to `addr` (asks left in its queue are cleared rooms'): the next room there
        connects afresh."""
        self._forget_connection(addr)
        self.asks.drop(addr)
        return [Disconnect(addr)]

    def _retire(self, now: float, addr: Address) -> list:
        """Closes the connection to `addr` at once when no route leads there any more (each encode rank
        found there was last found elsewhere) and nothing needs its socket."""
        if addr not in self._conns or addr in self._resolved.values() or addr in self._in_use(now):
            return []
        return self._close(addr)

    def _make_room(self, now: float) -> list | None:
        """Room for one more connection under `max_sockets`: nothing to do, the least recently used one with
        nothing under way closed, or None when every one has something under way."""
        if len(self._conns) < self.max_sockets:
            return []
        busy = self._in_use(now)
        lru = next((addr for addr in self._conns if addr not in busy), None)
        return None if lru is None else self._close(lru)

    def _forget_connection(self, addr: Address) -> int | None:
        """Forgets the connection to `addr` (its announcements and its cancels' silence with it): the next
        room there connects afresh. Returns the connection forgotten, None if there was none."""
        self.announcements.forget(addr)
        conn = self._conns.pop(addr, None)
        self.cancels.forget(addr)
        self._answered_at.pop(addr, None)
        return conn

    def _answered(self, now: float, addr: Address | None, conn: int | None) -> None:
        """The encode rank at `addr` answered on connection `conn` (a status, a cancel's answer): it is
        alive there, whatever becomes of rooms it was never sent items for."""
        # self._conns.get(addr) == conn, read by key without its call (conn is no None)
        if addr is not None and conn is not None and addr in self._conns and self._conns[addr] == conn:
            self._answered_at[addr] = now

    def _forget_routes_to(self, addr: Address) -> None:
        """Forgets every route that leads to `addr`: the next room for those encode ranks looks them up again."""
        for key in [key for key, route in self._routes.items() if route == addr]:
            del self._routes[key]

    def connect_failed(self, now: float, addr: Address, detail: str) -> list:
        """No socket could be made for `addr`: its rooms fail, and the next room looks it up afresh."""
        self._forget_routes_to(addr)
        conn = self._forget_connection(addr)
        self.asks.drop(addr)
        actions: list = []
        for state in list(self._rooms.values()):
            if state.addr == addr and state.conn == conn and state.stage in (QUEUED, ASKED):
                state.asked = False  # no socket was ever made for this connection: its ask never left
                actions += self._conclude(state, Failure(
                    FailureKind.NO_CONNECTION,
                    f"encode rank {state.encode_rank} at {addr[0]}:{addr[1]} (from bootstrap "
                    f"{state.spec.bootstrap_addr}): cannot connect: {detail}"))
        return actions

    def status(self, now: float, room: int, status: TransferPoll, rank: int, sums: tuple[int, ...] = (),
               unreadable: str | None = None, reason: tuple[str, str] | None = None) -> list:
        """A status frame from an encode rank (parsed; `unreadable` when its checksum part is not).

        `reason`: the encode side's (kind, detail) a Failed status carried (our extension),
        bounded and printable already; it joins the failure's detail, whose kind stays
        `peer_failed` (the room failed over there, whatever the cause).
        """
        state = self._rooms.get(room)
        if state is None:
            return []  # unknown or cleared: stale
        if self.lanes:
            self.lanes.pop(room, None)  # whatever this status does, the room is not in the plain case any more
        ignored = self._ignored(state, status, rank)
        if ignored is not None:
            return ignored
        self._answered(now, state.addr, state.conn)
        if status is TransferPoll.Failed:
            detail = f"{ENCODE_FAILED} ({state.where()})"
            if reason is not None:
                detail += f": {reason[0]}: {reason[1]}"
            if state.stage == CONCLUDED:
                # Told Success, then Failed: another receiver of the room failed (section 6), so
                # this rank's rows are no use to the item. Its write is over, as its Success said:
                # nothing to cancel, and its memory is as safe as that Success left it.
                state.outcome = Failure(FailureKind.PEER_FAILED, f"{detail} (after its Success)")
                state.given_up = True
                return [Overturn(room, state.token, state.outcome)]
            return self._conclude(state, Failure(FailureKind.PEER_FAILED, detail))
        if status is not TransferPoll.Success:
            return [Advance(room, state.token, status)]
        return self._succeeded(now, state, sums, unreadable)

    def lanes_settled(self, now: float, rooms: list[int]) -> list:
        """Plain Successes the driver took out of `lanes` (transfer.core.lane), in the order they came: what
        status() would do with each (the room's encode rank answered; the room concludes Success)."""
        tokens, actions = self.lanes_succeeded(now, rooms)
        if actions:
            return actions
        return [Conclude(room, token) for room, token in zip(rooms, tokens)]

    def lanes_succeeded(self, now: float, rooms: list[int]) -> tuple[list[int], list]:
        """lanes_settled(), its plain answer told without its actions: where every room concludes Success (a
        Conclude Success each, the answer of a lane in its plain case), each room's token in order and no
        actions; else no tokens and lanes_settled()'s actions."""
        tokens: list[int] = []
        actions: list | None = None  # once a room is not in its plain case: every room's actions, in order
        held = self._rooms
        for room in rooms:
            state = held[room] if room in held else None  # held.get(room), without its call
            if state is None or state.stage != ASKED or state.given_up or state.encode_rank is None:
                if actions is None:  # the rooms before, each a Conclude Success
                    actions = [Conclude(done, token) for done, token in zip(rooms, tokens)]
                # A lane outlived its plain case: a bug of the lane rules. The general rules take the Success.
                actions.append(Warn("lane outlived", f"room {room}: settled in a lane it should no longer have "
                                                     f"had (stage {None if state is None else state.stage}); "
                                                     f"taken by the general status rules instead"))
                if state is not None and state.encode_rank is not None:
                    actions += self.status(now, room, TransferPoll.Success, state.encode_rank)
                continue
            addr, conns = state.addr, self._conns
            if addr is not None and addr in conns and conns[addr] == state.conn:  # _answered(), without its call
                self._answered_at[addr] = now
            # _conclude(state, None) of a room ASKED, without its call: one ASKED was asked (_emit_ask() sets both,
            # refused() unsets both), so its memory is not safe yet.
            if room in self.lanes:
                del self.lanes[room]
            state.stage = CONCLUDED
            state.outcome = None
            if actions is None:
                tokens.append(state.token)
            else:
                actions.append(Conclude(room, state.token))
        return ([], actions) if actions is not None else (tokens, [])

    def _ignored(self, state: _Room, status: TransferPoll, rank: int) -> list | None:
        """What to do instead of taking the status, when it is not the room's to take now: nothing,
        or a warning; None takes it."""
        room = state.room
        if state.stage == HELD:
            return []  # its earlier ask's (held for the cancel's answer): stale
        if state.stage in (VERIFYING, CONCLUDED) and (status is not TransferPoll.Failed or state.outcome is not None):
            return []  # its conclusion stands: only a Failed overturns a Success (SPEC.md section 3)
        if not state.asked:
            if self.cancels.holds((room, rank)):
                return []  # the cancelled earlier ask's, whose cancel's answers are still to come: stale
            # No encode rank has heard of this room from us yet: an earlier room's under the same number
            # (its manager's predecessor at this endpoint, or a send of it cleared since), or forged.
            # Keyed by the complaint alone: the rank is the peer's to choose, and a key per rank would let
            # a peer varying it take a throttled line (and a kind in memory) per status.
            return [Warn("status for a room not asked for",
                         f"room {room}: {status.name} from encode rank {rank} before this rank asked for the "
                         f"room; ignored")]
        if state.encode_rank is not None and rank != state.encode_rank:
            return [Warn("status from the wrong encode rank",
                         f"room {room}: status from encode rank {rank}, expected {state.encode_rank}; ignored")]
        if state.addr is not None and self.cancels.answers(state.addr) \
                and self.cancels.unanswered((room, rank), state.conn) is not None:
            # Our encode rank reads a cancel before any later ask on the same socket and answers it
            # before anything about that ask: this status is the cancelled ask's, as expected.
            return []
        return None

    def _unfenced(self, now: float, state: _Room) -> str | None:
        """Why a status for the room may be an earlier ask's of the same room number to the same encode rank
        (one its rank may still serve, into that ask's memory), or None: that ask was given up with no cancel,
        or its cancel is unanswered where it holds nothing back (on a connection dropped since, or from a rank
        not seen to answer cancels, which the room stopped waiting for), or was set aside."""
        if state.encode_rank is None:
            return None
        key = (state.room, state.encode_rank)
        earlier = self._unfenced_asks.get(key)
        if earlier is not None and earlier[1] != state.token and now - earlier[0] < STALE_CANCEL_S:
            return "was given up with no cancel (its connection had been dropped)"
        if self.cancels.ghost(key) or self.cancels.unanswered_anywhere(key):
            return "was cancelled and the encode rank has not answered that cancel"
        return None

    def _succeeded(self, now: float, state: _Room, sums: tuple[int, ...], unreadable: str | None) -> list:
        """A Success to take: concludes the room, or asks for the landed bytes' checksums first.

        A Success that may be an earlier ask's (`_unfenced`) is taken only once the checksums show its bytes
        landed in this ask's memory; without checksums to verify it, the room fails instead."""
        room = state.room
        unfenced = self._unfenced(now, state)
        if unfenced is not None and (not self.integrity or unreadable is not None or not sums):
            why = "integrity checks are off" if not self.integrity else "it carried no checksum to verify"
            return self._conclude(state, Failure(
                FailureKind.OTHER,
                f"room {room}: a Success from {state.where()} may be for an earlier ask of room {room}, which "
                f"{unfenced}, and {why}, so it cannot be told from one for this ask: failed rather than taken "
                f"over bytes that may not have landed. Ask for a room again under a new room number, or once "
                f"the earlier ask's cancel is answered"))
        if not self.integrity:
            return self._conclude(state, None)
        if unreadable is not None:
            # Not dropped (the room would wait out its deadline for nothing) nor taken unverified.
            return self._conclude(state, Failure(
                FailureKind.CHECKSUM,
                f"room {room}: Success from {state.where()} came with a checksum part that does not parse "
                f"({unreadable}), so the landed bytes cannot be verified"))
        spec = state.spec
        regions = spec.regions
        wanted = [("embedding", regions.embedding, spec.embedding_ptr, spec.rows * spec.row_bytes)]
        if spec.deepstack_ptr and regions.deepstack is not None:
            wanted.append(("deepstack", regions.deepstack, spec.deepstack_ptr, spec.deepstack_nbytes))
        checks = tuple([(*check, expected) for check, expected in zip(wanted, sums)])
        if not checks:  # the encode rank sent none: taken unverified, and counted so
            return self._conclude(state, None, unverified=True)
        state.partly_verified = len(checks) < len(wanted)  # the deepstack's is optional: counted unverified
        state.stage = VERIFYING
        return [Verify(room, state.token, checks, state.where())]

    def checksum_verified(self, now: float, room: int, token: int) -> list:
        """Every landed byte matched what the encode rank sent."""
        state = self._verifying(room, token)
        return [] if state is None else self._conclude(state, None, unverified=state.partly_verified)

    def checksum_mismatched(self, now: float, room: int, token: int, what: str, expected: int, landed: int) -> list:
        """The landed `what` (embedding or deepstack) differs from what the encode rank wrote."""
        state = self._verifying(room, token)
        if state is None:
            return []
        unfenced = self._unfenced(now, state)
        earlier = "" if unfenced is None else (
            f"; the Success may have been for an earlier ask of room {room}, which {unfenced}: that ask's "
            f"bytes land in its own memory, not this ask's (ask again under a new room number)")
        return self._conclude(state, Failure(
            FailureKind.CHECKSUM,
            f"checksum mismatch: room {room}, prefill rank {self.engine_rank}, {what} from {state.where()}: "
            f"sent {expected}, landed {landed}{earlier}"))

    def fail(self, now: float, room: int, token: int, failure: Failure) -> list:
        """Concludes one open room with `failure` (the driver could not carry out one of its actions)."""
        state = self._rooms.get(room)
        if state is None or state.token != token or not self._open(state):
            return []
        return self._conclude(state, failure)

    def unsent(self, now: float, action: Announce | SendAsk, failure: Failure) -> list:
        """The socket raised on `action` (it never left): its room fails with `failure`, its memory
        safe at once, and a registration is announced again before the next ask that needs it."""
        if isinstance(action, Announce):
            self.announcements.withdraw(action.addr, action.region)
        state = self._rooms.get(action.room)
        if state is None or state.token != action.token or not self._open(state):
            return []
        state.asked = False
        return self._conclude(state, failure)

    def fail_all(self, now: float, failure: Failure) -> list:
        """Concludes every open room with `failure` (closing, or the driver stopped)."""
        return [action for state in list(self._rooms.values()) if self._open(state)
                for action in self._conclude(state, failure)]

    def close(self, now: float, failure: Failure) -> list:
        """Closing: every open room concludes with `failure`, and every room held, concluded or not, is
        given up as clear() gives it up (`abandon`): a cancel to the encode rank of each one asked and
        not known safe, so nothing is written into its memory after the close."""
        actions = self.fail_all(now, failure)
        for state in list(self._rooms.values()):
            actions += self.abandon(now, state.room, state.token)
        return actions

    def forget_rooms(self) -> None:
        """Lets go of every room and of what waits on them; for a closed core, which no event reaches any
        more. A room's spec names its destination memory (a pool's fallback buffer): held here, it stays
        allocated for as long as the core lives. A clear() afterwards finds no room and does nothing."""
        self._rooms.clear()
        self._deadlines.clear()
        self._held.clear()
        self._awaiting_parallel.clear()
        self._awaiting_route.clear()
        self._stranded.clear()
        self._stranded_next = float("inf")
        self.asks = AskQueues(self.asks.limit)
        self.lanes.clear()

    def tick(self, now: float, limit: int | None = None, unread: bool = False) -> list:
        """Fails rooms past their deadline and lets held asks go whose earlier ask's cancel got no answer
        within CANCEL_ANSWER_WAIT_S, at most `limit` of them together (next_wakeup() says if more are
        due), and looks up again the encode ranks whose sockets took no ask for QUEUED_LOOKUP_S, and
        those with rooms asked on a connection that dropped (`_stranded_look_ups`).

        `unread`: statuses may wait unread in the driver's status socket (it was held up past this
        tick's time, or left statuses queued). Statuses, and answers to cancels, that came before a
        room's deadline count: the rules that act for want of one (deadlines, held asks, cancels set
        aside) wait UNREAD_GRACE_S for the driver to read them, once in a row (asks waiting for a
        socket, and rooms asked on a dropped connection, are still looked up again meanwhile).
        """
        actions: list = []
        due = self._rules_due()
        if not self._unread.holds(now, unread, due):
            actions += self._expire_due(now, limit)
        elif due is not None and due <= self._unread.ended:
            # Rules an earlier hold held, more than one tick's limit of them: not held again.
            actions += self._expire_due(now, limit, self._unread.ended)
        for addr in [addr for addr in self._probed_at if not self.asks.waiting(addr)]:
            del self._probed_at[addr]
        for addr, head in self.asks.heads(self._queued):
            if self._recheck_due(addr, head) <= now:
                actions += self._recheck(now, addr)
        if self._stranded and self._stranded_next <= now:
            actions += self._stranded_look_ups(now)
        return actions

    def _expire_due(self, now: float, limit: int | None, until: float | None = None) -> list:
        """tick()'s rules for want of a status: deadlines, held asks, stale cancels (at most `limit`);
        with `until`, only the deadlines and held asks due by then."""
        cutoff = now if until is None else until
        heap = self._deadlines
        if len(heap) > 2 * len(self._rooms) + 1024:
            # Concluded rooms' entries would otherwise wait out their whole deadline here.
            self._deadlines = heap = [entry for entry in heap if self._open(entry[2])]
            heapq.heapify(heap)
        actions: list = []
        expired = 0
        while heap and heap[0][0] <= cutoff and (limit is None or expired < limit):
            state = heapq.heappop(heap)[2]
            if self._open(state) and state.stage != VERIFYING:
                actions += self._expire(now, state)
                expired += 1
        held = self._held
        while held and held[0][0] <= cutoff and (limit is None or expired < limit):
            state = heapq.heappop(held)[2]
            if self._in(state, HELD):  # no answer came: the rank does not answer cancels
                actions += self._unhold(now, state)
                expired += 1
        if until is None:
            actions += self.cancels.set_aside_stale(now, limit, lambda key: self._release(now, *key))
        return actions

    # ---------------------------------------------------------- internals

    def _open(self, state: _Room) -> bool:
        """Whether `state` is still held and not concluded."""
        return self._rooms.get(state.spec.room) is state and state.stage != CONCLUDED

    def _in(self, state: _Room, stage: str) -> bool:
        """Whether `state` is still held and at `stage` (an event may have moved it on)."""
        return self._rooms.get(state.spec.room) is state and state.stage == stage

    def _queued(self, state: _Room) -> bool:
        """Whether `state` is held and its ask still waits for a socket."""
        return self._in(state, QUEUED)

    def _looking_up(self, state: _Room) -> bool:
        """Whether `state` is held and still waits for a look-up (a status may have moved it on)."""
        return self._in(state, LOOKUP)

    def _verifying(self, room: int, token: int) -> _Room | None:
        state = self._rooms.get(room)
        if state is None or state.token != token or state.stage != VERIFYING:
            return None
        return state

    def _conclude(self, state: _Room, failure: Failure | None, unverified: bool = False) -> list:
        if not state.asked or (state.stage == VERIFYING and failure is None):
            # Never asked, or its bytes verified (its write is over): nothing will write there. A Success
            # whose bytes do not match may be an earlier ask's under the same room number, so it is not.
            state.given_up = state.safe = True
        if state.stage == QUEUED:
            self._let_go += 1
        elif state.stage == ASKED and state.room in self.lanes:  # not when the driver settled it there
            del self.lanes[state.room]
        state.stage = CONCLUDED
        state.outcome = failure
        if failure is not None and not state.asked:
            return [Conclude(state.room, state.token, failure, unverified), *self._unasked_cancel(state)]
        return [Conclude(state.room, state.token, failure, unverified)]

    def _unasked_cancel(self, state: _Room) -> list:
        """The unasked cancel of a room that failed before its ask went out (our extension, docs/protocol.md 8).

        Its encode rank holds the item, and the asks of the other prefill ranks of its fanout, until the whole
        fanout asked: with this rank failing the room unasked, until the fanout timeout on that side, and the
        other ranks' rooms until their deadlines. So the room's encode rank is told, where it is known (the
        route looked up, or where it was last found), a connection to it is in use (none is made for this),
        it registered as one of ours (the bootstrap server named its registration: a peer's never is, and a
        peer would log each cancel as a malformed request), and no cancel of the room to that rank awaits
        answers (an encode rank of an earlier
        release answers this one as a plain cancel, which would be taken for that one's). No answer is awaited:
        the room's memory was never offered."""
        key, rank = state.route_key, state.encode_rank
        if key is None or rank is None or key not in self._instances:
            return []
        addr = self._routes.get(key) or self._resolved.get(key)
        if addr is None or addr not in self._conns or self.cancels.holds((state.room, rank)):
            return []
        frames = cancel_frames(state.room, self.host, self.status_port, self.session_id, unasked=True)
        return [SendCancel(addr, state.room, rank, state.token, frames, unasked=True)]

    def _give_up(self, now: float, state: _Room) -> list:
        """Tells the encode rank the room is given up, on the connection it was asked on.

        A room never asked has nothing to cancel. One whose connection was dropped
        since gets no cancel: a fresh connection could overtake what the old one
        delivered, so only the quarantine bound makes its memory safe. Nor does one while
        a cancel for the same room and encode rank number waits at another address, or on
        an earlier connection (a rank restarted there never answers that one).
        """
        if state.given_up:
            return []
        state.given_up = True
        self.lanes.pop(state.room, None)
        if not state.asked:
            state.safe = True
            return [MemorySafe(state.room, state.token)]
        actions = self._cancel(now, state)
        if not any(isinstance(action, SendCancel) for action in actions) and state.encode_rank is not None:
            # Nothing holds back what its encode rank may still tell of it: a later ask of the room takes care.
            unfenced = self._unfenced_asks
            while unfenced:  # filed oldest first; past STALE_CANCEL_S one no longer counts (_unfenced)
                oldest, (given_up_at, _) = next(iter(unfenced.items()))
                if now - given_up_at < STALE_CANCEL_S:
                    break
                del unfenced[oldest]
            remember(unfenced, (state.room, state.encode_rank), (now, state.token), MAX_ROUTES)
        return actions

    def _cancel(self, now: float, state: _Room) -> list:
        """The cancel of an asked room given up, when one may go (see `_give_up`)."""
        # A route (addr) is found only after the encode rank is known.
        if state.addr is None or state.encode_rank is None or self._conns.get(state.addr) != state.conn:
            return []
        if self.cancels.silent(state.addr, now):
            return []  # it answers none: the quarantine makes the memory safe, without a malformed frame there
        key = (state.room, state.encode_rank)
        if self.cancels.ghost(key):
            return []  # the answers still to come for cancels set aside would be taken for this one's
        full = self.cancels.full()
        if full is not None:
            return [Warn("ghosts", f"{full}: room {state.room} is sent no cancel, its memory waits out the quarantine")]
        if self.cancels.stranger(key, state.addr, state.conn):
            # Answers name only the room and the encode rank: another node's (or connection's) answer to
            # its own cancel would be taken for this one's. Without a cancel only the quarantine makes it safe.
            return []
        oldest = self.cancels.add(now, key, state.token, state.addr, state.conn)
        released = [] if oldest is None else self._set_aside(now, oldest)
        frames = cancel_frames(state.room, self.host, self.status_port, self.session_id, reads_write_failed=True)
        return [SendCancel(state.addr, state.room, state.encode_rank, state.token, frames), *released]

    def _release(self, now: float, room: int, rank: int) -> list:
        """The held ask of `room` for encode rank `rank` goes, unless a cancel before it is still unanswered."""
        state = self._rooms.get(room)
        if state is None or state.stage != HELD or state.encode_rank != rank:
            return []
        if self.cancels.unanswered((room, rank), self._conns.get(state.addr) if state.addr else None) is not None:
            return []
        return self._unhold(now, state)

    def _unhold(self, now: float, state: _Room) -> list:
        """A held ask waits no more: the room is routed and asked for afresh."""
        state.stage = LOOKUP
        return self._route(now, state)

    def _route(self, now: float, state: _Room, defer: bool = False) -> list:
        """Finds the room's encode rank, from the caches or by a look-up."""
        bootstrap = state.spec.bootstrap_addr
        # The caches hold no None: each is read by key once `in` found it, without dict.get()'s call.
        if bootstrap not in self._parallel:
            return self._look_up(now, state, bootstrap, None)
        encode_tp, encode_dp = self._parallel[bootstrap]
        local_tp = self.tp_size // self.dp_size
        if local_tp % encode_tp:
            return self._conclude(state, Failure(
                FailureKind.GEOMETRY, f"prefill local tp {local_tp} is not a multiple of encode tp {encode_tp}"))
        state.fanout = local_tp // encode_tp
        group, tp_rank = state.room % encode_dp, (self.engine_rank % local_tp) // state.fanout
        group_size = encode_tp // encode_dp
        if tp_rank >= group_size:  # the server files no rank there: a look-up of each room would only 404
            return self._conclude(state, Failure(
                FailureKind.GEOMETRY, f"prefill rank {self.engine_rank} pairs with encode tp rank {tp_rank} (local tp "
                                      f"{local_tp} over encode tp {encode_tp}), but each of the encode side's "
                                      f"{encode_dp} dp groups has {group_size} rank(s)"))
        # The server files engine rank e under (e // (E // D), e % (E // D)), and e is the rank its
        # statuses and cancel answers carry (SPEC.md sections 4.3 and 5).
        state.encode_rank = group * group_size + tp_rank
        key = state.route_key = (bootstrap, group, tp_rank)
        if key not in self._routes:
            return self._look_up(now, state, bootstrap, key)
        return self._ask(now, state, self._routes[key], defer)

    def _look_up(self, now: float, state: _Room, bootstrap: str, key: RouteKey | None) -> list:
        """Files the room behind a look-up, starting one unless one is under way."""
        paused = self.breaker.paused(bootstrap, now)
        if paused is not None:
            return self._conclude(state, Failure(FailureKind.BOOTSTRAP, f"bootstrap {bootstrap}: {paused[0]}",
                                                 retry_at=paused[1]))
        if key is None:
            waiting = self._awaiting_parallel.setdefault(bootstrap, [])
            action: Any = LookUpParallel(bootstrap)
        else:
            waiting = self._awaiting_route.setdefault(key, [])
            action = LookUpRoute(key)
        waiting.append(state)
        # One look-up a key: a route looked up again for asks waiting elsewhere answers these too, and sizes
        # read again after a 404 answer the rooms that wait for them since.
        under_way = key in self._probes if key is not None else bootstrap in self._sizes_reread
        return [action] if len(waiting) == 1 and not under_way else []

    def _ask(self, now: float, state: _Room, addr: Address, defer: bool = False) -> list:
        """Asks for the room now, or files it behind the asks waiting for the same socket
        (`defer`: files it anyway, past the queue's bound).

        An ask of a room whose earlier ask's cancel went out on the same connection and is not
        answered yet waits for that answer (for at most CANCEL_ANSWER_WAIT_S, from an encode
        rank not yet seen to answer cancels): a status that comes before it is the earlier
        ask's, and with the room not asked yet it concludes nothing. An encode rank known to
        answer cancels is asked at once; its statuses before the answer are dropped instead.
        """
        state.addr = addr
        key = (state.room, state.encode_rank)
        # unanswered() finds none for a key no cancel of which awaits answers: tested first, without a call.
        if state.encode_rank is not None and key in self.cancels.awaiting and not self.cancels.answers(addr):
            cancel = self.cancels.unanswered(key, self._conns.get(addr))
            if cancel is not None and now < cancel.sent_at + CANCEL_ANSWER_WAIT_S:
                state.stage = HELD
                heapq.heappush(self._held, (cancel.sent_at + CANCEL_ANSWER_WAIT_S, state.token, state))
                return []
        actions: list = []
        if addr not in self._conns:
            made = self._make_room(now)
            if made is None:
                return self._conclude(state, Failure(
                    FailureKind.NO_CONNECTION,
                    f"room {state.room}: not connecting to {state.where()}: this prefill rank already holds "
                    f"{self.max_sockets} sockets to encode ranks, its cap, each with rooms under way"))
            actions = made
        conns = self._conns
        if addr in conns:  # _conn_of(addr) of a connection in use, without its call: made the most recently used
            state.conn = conns[addr] = conns.pop(addr)
        else:
            state.conn = self._conn_of(addr)
        state.asked_at = now
        waiting = self.asks.waiting(addr) if addr in self.asks.queues else 0  # none waits there: no call
        if waiting and not defer and self.asks.full(addr) and self._pruned_at.get(addr) != self._let_go:
            # Rooms cleared while their asks waited leave them behind: only open ones hold a place.
            remember(self._pruned_at, addr, self._let_go, MAX_ENCODE_SOCKETS)
            waiting = self.asks.prune(addr, self._queued)
        if waiting or defer:
            if not defer and self.asks.full(addr):
                return actions + self._conclude(state, Failure(
                    FailureKind.NO_CONNECTION,
                    f"{state.where()} is not taking requests ({waiting} asks already wait for it)"))
            state.stage = QUEUED
            self.asks.push(addr, state)
            return actions
        return actions + self._emit_ask(state, conn_current=True)

    def _conn_of(self, addr: Address) -> int:
        """The connection in use to `addr` (a new one when there is none), now the most recently used."""
        conn = self._conns.pop(addr, None)
        if conn is None:
            self._conn_serial += 1
            conn = self._conn_serial
        self._conns[addr] = conn
        return conn

    def _emit_ask(self, state: _Room, conn_current: bool = False) -> list:
        """The room's registration (unless its encode rank holds the region) and its TransferInfo; the room
        gets a lane (`lanes`) when its Success can only be this ask's and is taken unchecked.
        `conn_current`: state.conn is the address's connection of now, made the most recently used already."""
        spec = state.spec
        addr, key = state.addr, state.route_key
        if addr is None or key is None:
            raise AssertionError(f"room {spec.room}: asked for before its encode rank's route was known")
        actions: list = []
        regions = spec.regions
        emb, ds = regions.embedding, regions.deepstack
        if not conn_current:
            state.conn = self._conn_of(addr)  # it goes on the address's connection of now, not of when it queued
        state.instance = self._instances[key] if key in self._instances else None  # .get(key), without its call
        region, lengths = (emb.addr, ds.addr if ds else 0), (emb.nbytes, ds.nbytes if ds else 0)
        if self.announcements.needs(addr, region, lengths):
            frames = registration_frames(self.host, self.status_port, self.session_id, *region, *lengths)
            self.announcements.announced(addr, region, lengths)
            actions.append(Announce(addr, spec.room, state.token, key, region, frames))
        # In field order, by position (room, endpoint, port, session_id, embedding_ptr, deepstack_ptr, rows, hidden,
        # dtype, has_deepstack, fanout, row_start, span, deepstack_row_bytes): keywords cost a match each.
        info = TransferInfo(spec.room, self.host, self.status_port, self.session_id, spec.embedding_ptr,
                            spec.deepstack_ptr, spec.rows, spec.hidden, spec.dtype, spec.has_deepstack, state.fanout,
                            spec.row_start, spec.span, spec.deepstack_row_bytes if spec.has_deepstack else None)
        actions.append(SendAsk(addr, spec.room, state.token, info))
        state.stage = ASKED
        state.asked = True
        if not self.integrity and state.encode_rank is not None and not state.given_up:
            # No earlier ask of the room number may still be told of (`_ignored`, `_unfenced`): none given up
            # without a cancel, even one STALE_CANCEL_S ago, nor one whose cancel awaits answers.
            asked, cancels = (spec.room, state.encode_rank), self.cancels
            # cancels.holds(asked), without its call.
            if asked not in self._unfenced_asks and asked not in cancels.awaiting and asked not in cancels.ghosts:
                self.lanes[spec.room] = state.encode_rank
        return actions

    def _expire(self, now: float, state: _Room) -> list:
        """The room's deadline passed: it fails, and a socket that went silent on it is dropped."""
        never_sent: list[_Room] = []
        addr = state.addr
        # On the socket it was asked on, ahead of anything that closes it.
        actions: list = self._give_up(now, state) if state.asked else []
        if state.stage == LOOKUP:
            failure = Failure(FailureKind.DEADLINE,
                              f"no status from {state.where()} within {self.deadline_s:g}s for room {state.room} "
                              f"(its bootstrap look-up had not answered)")
            return actions + self._conclude(state, failure)
        # Only the socket this room was asked on went silent, and only if the room waited on
        # it a while (one asked late says little, and tearing the socket down for each such
        # room would cost every later room a look-up and a connection) while the encode rank
        # answered nothing there since the room was asked, at least half the deadline ago (a rank
        # serving other rooms is alive: this room's item was never sent, and the rooms asked
        # there keep their socket and their cancels). One replaced since came with a fresh
        # look-up; its rooms keep their deadlines.
        half = self.deadline_s / 2
        answered = self._answered_at.get(addr) if addr is not None else None
        if (addr is not None and self._conns.get(addr) == state.conn and now - state.asked_at >= half
                and (answered is None or answered <= state.asked_at)):
            # The rooms asked on it whose deadlines passed too (this tick expires them next) are
            # given up first: their cancels go out ahead of the close, as this room's does.
            for other in self._rooms.values():
                if (other is not state and other.asked and other.addr == addr and other.conn == state.conn
                        and other.deadline <= now and self._open(other) and other.stage != VERIFYING):
                    actions += self._give_up(now, other)
            # The encode rank may have restarted elsewhere, its node with other sizes.
            self._parallel.pop(state.spec.bootstrap_addr, None)
            self._forget_routes_to(addr)
            self._forget_connection(addr)
            # Nothing of the old socket's queue (expired rooms' asks, whose memory may be
            # reused by then) may reach a rank restarted there, unless this room's cancel
            # follows it: then the socket gets a moment to deliver the cancel.
            actions.append(Disconnect(addr, flush=bool(actions)))
            never_sent = self.asks.drop(addr)
        if state.stage == HELD:
            failure = Failure(FailureKind.DEADLINE,
                              f"no answer from {state.where()} within {self.deadline_s:g}s to the cancel of an "
                              f"earlier ask of room {state.room}, which this one waited for: it was never asked for")
        elif state.stage == QUEUED:
            failure = Failure(FailureKind.NO_CONNECTION,
                              f"no connection to {state.where()} within {self.deadline_s:g}s: room {state.room} "
                              f"was never asked for (is the encode rank running?)")
        else:
            alive = answered is not None and answered > state.asked_at
            quiet_s = now - answered if answered is not None and now - answered >= half else None
            failure = Failure(FailureKind.DEADLINE, silent_room_detail(state.where(), state.room, self.deadline_s,
                                                                       alive=alive, fanout=state.fanout,
                                                                       quiet_s=quiet_s))
        actions += self._conclude(state, failure)
        # The rooms queued behind it wait on the same silent rank: they fail now, unasked.
        for other in never_sent:
            if other is not state and self._open(other):
                actions += self._conclude(other, Failure(
                    FailureKind.NO_CONNECTION,
                    f"{other.where()} went silent: room {state.room} had no answer within {self.deadline_s:g}s, "
                    f"and room {other.room} was never asked for"))
        return actions

"""Parked asks: TransferInfos waiting for their room's item or the rest of its fanout, bounded."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from transfer.frames import TransferInfo

__all__ = [
    "ASK_OVERHEAD_BYTES",
    "MAX_PARKED_ASKS",
    "MAX_PARKED_BYTES",
    "MAX_RECEIVERS_PER_ROOM",
    "Admission",
    "Asks",
    "ParkedAsks",
    "ask_cost",
    "session_share",
]

#: Rooms asked for whose item (or rest of the fanout) has not come yet, and receivers per
#: such room: past these, a peer asking for rooms nobody sends would only eat memory, so
#: the oldest parked ask is told Failed (and an extra receiver of a room is refused).
MAX_PARKED_ASKS = 16384
MAX_RECEIVERS_PER_ROOM = 1024

#: Bytes of parked asks held in all (their text parts plus a fixed cost each): past it the
#: oldest room's asks are evicted. MAX_PARKED_ASKS * MAX_RECEIVERS_PER_ROOM asks of up to a
#: control message each would otherwise be a terabyte a peer could make us hold.
MAX_PARKED_BYTES = 64 << 20
ASK_OVERHEAD_BYTES = 512  # a parked TransferInfo with short text parts takes about this much

#: Sessions whose latest ask's cost is kept (past it they are all forgotten, and computed again).
MAX_COSTS_KEPT = 4096


def session_share(bound: int) -> int:
    """What one receiver session may hold of a bound on parked asks (rooms or bytes): a quarter, at least 1.

    Past it its own oldest ask is dropped, never another's: one receiver asking for rooms
    this encode rank never sends (a misrouted prefill instance) fills the bound alone otherwise,
    and pushes out every other receiver's asks, failing their rooms.
    """
    return max(1, bound // 4)


def ask_cost(info: TransferInfo) -> int:
    """What a parked ask costs against the byte bound: its peer-sized text parts and a fixed part."""
    return len(info.endpoint) + len(info.session_id) + len(info.dtype) + ASK_OVERHEAD_BYTES


@dataclass(eq=False)
class Asks:
    """One room's parked TransferInfos, by session id, and when the first and the latest came.

    ParkedAsks keeps `fanout` and `first` current as asks come and go: the fanout the asks
    announce is the first one's (validation compares the rest), and `first` is that ask's
    session. `costs` holds what each parked ask counts against the byte bound (ask_cost).
    """

    room: int
    first_at: float
    infos: dict[str, TransferInfo] = field(default_factory=dict)
    nbytes: int = 0
    last_at: float = 0.0
    fanout: int = 0
    first: str = ""
    costs: dict[str, int] = field(default_factory=dict)

    def taken_out(self, session: str) -> None:
        """`session`'s ask left `infos`: the first ask's fanout is the next one's when it was the first."""
        if session == self.first and self.infos:
            info = next(iter(self.infos.values()))
            self.first, self.fanout = info.session_id, info.fanout


class Admission(NamedTuple):
    """What parking one ask did: whether it was refused, whole rooms evicted to make room, and the asking
    session's own oldest asks dropped to keep it within its share."""

    refused: bool = False
    evicted: Sequence[Asks] = ()
    dropped: Sequence[TransferInfo] = ()


_PARKED = Admission()  # parked, nothing refused, evicted or dropped: the common case
_REFUSED = Admission(refused=True)


@dataclass(eq=False)
class _Mine:
    """One session's parked asks: their rooms, in the order it asked, and their bytes."""

    rooms: dict[int, None] = field(default_factory=dict)
    nbytes: int = 0


class ParkedAsks:
    """Rooms' asks, oldest room first, bounded in rooms, receivers per room and bytes, and each session to its
    share of the rooms and bytes (session_share)."""

    def __init__(self, *, max_rooms: int | None = None, max_receivers: int | None = None,
                 max_bytes: int | None = None) -> None:
        """Bounds left out are the module's, read now (so a test or a deployment may set them)."""
        self.max_rooms = MAX_PARKED_ASKS if max_rooms is None else max_rooms
        self.max_receivers = MAX_RECEIVERS_PER_ROOM if max_receivers is None else max_receivers
        self.max_bytes = MAX_PARKED_BYTES if max_bytes is None else max_bytes
        self.session_rooms = session_share(self.max_rooms)
        self.session_bytes = session_share(self.max_bytes)
        self._rooms: dict[int, Asks] = {}
        # The dict's own get, which the method below only documents: one call on the rules' hot path.
        self.get = self._rooms.get  # type: ignore[method-assign,assignment]
        self._by_session: dict[str, _Mine] = {}  # the rooms each session has an ask parked in
        self.nbytes = 0
        # Session -> (endpoint, dtype, ask_cost) of its latest ask: its asks repeat both strings, and
        # equal strings have equal lengths, so the cost is read back without ask_cost()'s three len() calls.
        self._costs_of: dict[str, tuple[str, str, int]] = {}

    def add(self, info: TransferInfo, now: float) -> Admission:
        """Parks `info` for its room (a session's repeat replaces its earlier ask).

        A new receiver past max_receivers for its room is refused. A session past its
        share of the rooms or bytes drops its own oldest asks first (`dropped`); then a
        new room past max_rooms evicts the oldest room, and past max_bytes the oldest
        rooms go until the bound holds or only this room is left (`evicted`).
        """
        session = info.session_id
        room = info.room
        asks = self._rooms.get(room)
        if asks is not None and len(asks.infos) >= self.max_receivers and session not in asks.infos:
            return _REFUSED
        evicted: list[Asks] = []
        dropped: list[TransferInfo] = []
        mine = self._by_session.get(session)
        if mine is not None and room not in mine.rooms and len(mine.rooms) >= self.session_rooms:
            dropped.append(self._drop_oldest_of(session, mine))
            asks = self._rooms.get(room)  # an ask dropped may have been its room's last
        if asks is None:
            if len(self._rooms) >= self.max_rooms:
                evicted.append(self._evict_oldest())
            asks = self._rooms[room] = Asks(room, now, fanout=info.fanout, first=session)
        elif session == asks.first:  # its repeat keeps the first place
            asks.fanout = info.fanout
        if dropped or evicted:  # looked up again: what went may have been the session's last ask
            mine = self._by_session.get(session)
        if mine is None:
            mine = self._by_session[session] = _Mine()
        infos, costs = asks.infos, asks.costs
        infos[session] = info
        asks.last_at = now
        mine.rooms[room] = None
        costs_of = self._costs_of
        kept = costs_of[session] if session in costs_of else None
        if kept is not None and kept[0] == info.endpoint and kept[1] == info.dtype:
            cost = kept[2]
        else:
            cost = ask_cost(info)
            if len(costs_of) >= MAX_COSTS_KEPT:
                costs_of.clear()
            costs_of[session] = (info.endpoint, info.dtype, cost)
        costs[session], cost = cost, cost - (costs[session] if session in costs else 0)  # less its repeat's
        asks.nbytes += cost
        mine.nbytes += cost
        self.nbytes += cost
        while mine.nbytes > self.session_bytes and len(mine.rooms) > 1:
            dropped.append(self._drop_oldest_of(session, mine, keep=room))
        while self.nbytes > self.max_bytes and len(self._rooms) > 1:
            evicted.append(self._evict_oldest(keep=room))
        return Admission(False, evicted, dropped) if evicted or dropped else _PARKED

    def _drop_oldest_of(self, session: str, mine: _Mine, keep: int | None = None) -> TransferInfo:
        """Drops the session's oldest ask but the one in room `keep` (the one being parked)."""
        room = next(number for number in mine.rooms if number != keep)
        dropped = self.drop_ask(room, session)
        if dropped is None:
            raise AssertionError(f"room {room}: indexed for session {session!r} but not parked")
        return dropped

    def _evict_oldest(self, keep: int | None = None) -> Asks:
        """Takes the oldest room but `keep` (the one an ask is being parked in)."""
        room = next(number for number in self._rooms if number != keep)
        asks = self._rooms[room]
        self.take(room)
        return asks

    def take(self, room: int) -> Asks | None:
        """Removes and returns the room's asks (None when none are parked)."""
        asks = self._rooms.pop(room, None)
        if asks is not None:
            self.nbytes -= asks.nbytes
            by_session = self._by_session
            for session, cost in asks.costs.items():  # _unindex() of each, without a call each
                mine = by_session.get(session)
                if mine is not None:
                    if room in mine.rooms:
                        del mine.rooms[room]
                    mine.nbytes -= cost
                    if not mine.rooms:
                        del by_session[session]
        return asks

    def _unindex(self, session: str, room: int, cost: int) -> None:
        mine = self._by_session.get(session)
        if mine is not None:
            mine.rooms.pop(room, None)
            mine.nbytes -= cost
            if not mine.rooms:
                del self._by_session[session]

    def drop_session(self, session: str) -> list[TransferInfo]:
        """Removes every ask `session` has parked (a room left with none goes too); returns them."""
        dropped = []
        mine = self._by_session.pop(session, None)
        for room in sorted(() if mine is None else mine.rooms):
            asks = self._rooms[room]
            info = asks.infos.pop(session)
            cost = asks.costs.pop(session)
            asks.nbytes -= cost
            self.nbytes -= cost
            dropped.append(info)
            if not asks.infos:
                del self._rooms[room]
            else:
                asks.taken_out(session)
        return dropped

    def drop_ask(self, room: int, session: str) -> TransferInfo | None:
        """Removes one session's ask for one room (a room left with none goes too); returns it."""
        asks = self._rooms.get(room)
        info = None if asks is None else asks.infos.pop(session, None)
        if asks is None or info is None:
            return None
        cost = asks.costs.pop(session)
        asks.nbytes -= cost
        self.nbytes -= cost
        self._unindex(session, room, cost)
        if not asks.infos:
            del self._rooms[room]
        else:
            asks.taken_out(session)
        return info

    def has_session(self, session: str) -> bool:
        """Whether `session` has any ask parked."""
        return session in self._by_session

    def get(self, room: int) -> Asks | None:
        """The room's asks, left parked."""
        return self._rooms.get(room)

    def older_than(self, cutoff: float) -> list[int]:
        """Rooms whose first ask came before `cutoff`, oldest first."""
        return [room for room, asks in self._rooms.items() if asks.first_at < cutoff]

    def take_all(self) -> list[Asks]:
        """Removes and returns every room's asks."""
        rooms, self.nbytes = list(self._rooms.values()), 0
        self._rooms.clear()  # in place: `get` is this dict's own
        self._by_session.clear()
        return rooms

    def values(self) -> list[Asks]:
        """Every room's asks, oldest first (a copy of the list)."""
        return list(self._rooms.values())

    def rooms(self) -> list[int]:
        """Rooms with parked asks, oldest first."""
        return list(self._rooms)

    def __getitem__(self, room: int) -> Asks:
        return self._rooms[room]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._rooms))

    def __contains__(self, room: object) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

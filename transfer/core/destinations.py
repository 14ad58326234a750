"""Destination ranges held by writes queued or in flight, per receiver session.

Two rooms whose writes into one session's memory overlap would leave either's rows
torn, so a room's write is refused while another room's write still holds part of its
range. A write holds its ranges from the moment it is queued until it is over (or will
never start); a write of another send of the same room (a retry) is not another room.
A write that failed may still land (quarantine()): its ranges stay held until a time
the caller gives, and expire() lets go of them once it came.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["DestinationBook", "Held", "Overlap", "Quarantined"]


class Held(NamedTuple):
    """One range a write holds, as the book files it."""

    start: int
    end: int
    seq: int


# Held(start, end, seq) without the NamedTuple's Python __new__ in between: the same tuple of type Held.
_new_held = tuple.__new__


class Quarantined(NamedTuple):
    """A failed write's range in quarantine: whose, which room's, and until when."""

    session: str
    room: int
    start: int
    end: int
    until: float


class Overlap(NamedTuple):
    """Another room's held range that a new range overlaps."""

    room: int
    start: int
    end: int
    until: float | None = None  # a failed write's range: held until then (None: a write queued or in flight)


@dataclass(eq=False)
class _Session:
    """One session's held ranges, sorted, and an upper bound on their lengths (the longest held since this
    entry was made: it never shrinks)."""

    spans: list[tuple[int, int, int, int]] = field(default_factory=list)  # (start, end, seq, room number)
    longest: int = 0


class DestinationBook:
    """Each session's held ranges; a session holding none is forgotten.

    At most `quarantine_limit` ranges are quarantined at once: past it the oldest are let go
    first, so a flood of failing writes cannot grow the book without bound.
    """

    def __init__(self, quarantine_limit: int = 8192) -> None:
        self._sessions: dict[str, _Session] = {}
        self._next_seq = 1
        self.quarantine_limit = quarantine_limit
        # Quarantined ranges by seq, in the order they were quarantined: (session, range, until).
        self._quarantined: dict[int, tuple[str, Held, float]] = {}

    def hold(self, session: str, room: int, ranges: list[tuple[int, int]]) -> tuple[Held, ...]:
        """Files `room`'s [start, end) ranges for `session`; returns what free() lets go of later."""
        entry = self._sessions.get(session)
        if entry is None:
            entry = self._sessions[session] = _Session()
        held = []
        for start, end in ranges:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            bisect.insort(entry.spans, (start, end, seq, room))
            if end - start > entry.longest:
                entry.longest = end - start
            held.append(_new_held(Held, (start, end, seq)))
        return tuple(held)

    def free(self, session: str, held: tuple[Held, ...]) -> None:
        """Lets go of ranges hold() filed for `session`."""
        quarantined = self._quarantined
        # _free_one() of each range, with the session's entry looked up once: a range it no longer has is left.
        entry = self._sessions.get(session)
        for one in held:
            if quarantined:  # a range held by a write that failed may be among them
                quarantined.pop(one.seq, None)
            if entry is not None:
                spans = entry.spans
                index = bisect.bisect_left(spans, (one.start, one.end, one.seq))
                if index < len(spans) and spans[index][2] == one.seq:
                    del spans[index]
        if entry is not None and not entry.spans:
            del self._sessions[session]

    def _free_one(self, session: str, held: Held) -> int | None:
        """Lets go of one range hold() filed for `session`, if the book still has it; the room that held it."""
        entry = self._sessions.get(session)
        if entry is None:
            return None
        room = None
        index = bisect.bisect_left(entry.spans, (held.start, held.end, held.seq))
        if index < len(entry.spans) and entry.spans[index][2] == held.seq:
            room = entry.spans[index][3]
            del entry.spans[index]
        if not entry.spans:
            del self._sessions[session]
        return room

    def quarantine(self, session: str, held: tuple[Held, ...], until: float) -> list[Quarantined]:
        """Keeps ranges hold() filed for `session` held until `until` instead of letting go of them now (a failed
        write whose bytes may still land there); expire() lets go of them then. Returns the ranges let go of
        before their time to keep quarantine_limit, oldest first.

        Ranges are let go in the order they were quarantined, so `until` should not decrease from one call to
        the next (a fixed bound from a monotonic `now`): one that does is let go late, never early.
        """
        for one in held:
            self._quarantined[one.seq] = (session, one, until)
        early: list[Quarantined] = []
        while len(self._quarantined) > self.quarantine_limit:
            seq = next(iter(self._quarantined))
            oldest, one, ends = self._quarantined.pop(seq)
            room = self._free_one(oldest, one)
            if room is not None:
                early.append(Quarantined(oldest, room, one.start, one.end, ends))
        return early

    def expire(self, now: float) -> None:
        """Lets go of the quarantined ranges whose `until` came by `now`."""
        quarantined = self._quarantined
        while quarantined:
            seq, (session, one, until) = next(iter(quarantined.items()))
            if until > now:
                break
            del quarantined[seq]
            self._free_one(session, one)

    @property
    def quarantined(self) -> int:
        """Ranges held in quarantine."""
        return len(self._quarantined)

    def overlap(self, session: str, room: int, start: int, end: int) -> Overlap | None:
        """Another room's range held for `session` that [start, end) overlaps, or None (quarantined ranges
        whose time came count until expire() let go of them)."""
        entry = self._sessions.get(session)
        if entry is None:
            return None
        # Sorted by start: a range overlapping [start, end) starts before `end` and, being at
        # most `longest` long, after start - longest.
        index = bisect.bisect_left(entry.spans, (end,))
        while index > 0:
            index -= 1
            other_start, other_end, seq, other_room = entry.spans[index]
            if other_start <= start - entry.longest:
                break
            if other_end > start and other_room != room:
                quarantined = self._quarantined.get(seq)
                return Overlap(other_room, other_start, other_end, None if quarantined is None else quarantined[2])
        return None

    def __len__(self) -> int:
        """Sessions holding ranges."""
        return len(self._sessions)

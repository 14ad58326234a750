"""Destination ranges held by writes queued or in flight, per receiver session.

Two rooms whose writes into one session's memory overlap would leave either's rows
torn, so a room's write is refused while another room's write still holds part of its
range. A write holds its ranges from the moment it is queued until it is over (or will
never start); a write of another send of the same room (a retry) is not another room.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["DestinationBook", "Held", "Overlap"]


class Held(NamedTuple):
    """One range a write holds, as the book files it."""

    start: int
    end: int
    seq: int


class Overlap(NamedTuple):
    """Another room's held range that a new range overlaps."""

    room: int
    start: int
    end: int


@dataclass(eq=False)
class _Session:
    """One session's held ranges, sorted, and an upper bound on their lengths (the longest held since this
    entry was made: it never shrinks)."""

    spans: list[tuple[int, int, int, int]] = field(default_factory=list)  # (start, end, seq, room number)
    longest: int = 0


class DestinationBook:
    """Each session's held ranges; a session holding none is forgotten."""

    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}
        self._next_seq = 1

    def hold(self, session: str, room: int, ranges: list[tuple[int, int]]) -> tuple[Held, ...]:
        """Files `room`'s [start, end) ranges for `session`; returns what free() lets go of later."""
        entry = self._sessions.setdefault(session, _Session())
        held = []
        for start, end in ranges:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            bisect.insort(entry.spans, (start, end, seq, room))
            entry.longest = max(entry.longest, end - start)
            held.append(Held(start, end, seq))
        return tuple(held)

    def free(self, session: str, held: tuple[Held, ...]) -> None:
        """Lets go of ranges hold() filed for `session`."""
        entry = self._sessions.get(session)
        if entry is None:
            return
        for start, end, seq in held:
            del entry.spans[bisect.bisect_left(entry.spans, (start, end, seq))]
        if not entry.spans:
            del self._sessions[session]

    def overlap(self, session: str, room: int, start: int, end: int) -> Overlap | None:
        """Another room's range held for `session` that [start, end) overlaps, or None."""
        entry = self._sessions.get(session)
        if entry is None:
            return None
        # Sorted by start: a range overlapping [start, end) starts before `end` and, being at
        # most `longest` long, after start - longest.
        index = bisect.bisect_left(entry.spans, (end,))
        while index > 0:
            index -= 1
            other_start, other_end, _, other_room = entry.spans[index]
            if other_start <= start - entry.longest:
                break
            if other_end > start and other_room != room:
                return Overlap(other_room, other_start, other_end)
        return None

    def __len__(self) -> int:
        """Sessions holding ranges."""
        return len(self._sessions)

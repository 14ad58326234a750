"""What becomes of a room's receive memory once the caller lets the room go: freed, or quarantined.

An encode rank's one-sided write may still land in a room's memory after the room failed,
was cleared before a terminal status, or its session manager closed. The memory is safe
to hand out again once the room succeeded (its write was over when it was told so) or is
known safe (no encode rank was ever asked, or the encode rank confirmed the room's
cancel). Otherwise it is quarantined until the pool's quarantine bound passes, or until
the cancel's confirmation comes, where one can still be heard. Pure: a room's facts in,
its memory's fate out.
"""

from __future__ import annotations

from enum import Enum
from typing import Generic, TypeVar

__all__ = ["AwaitingConfirmation", "Fate", "fate_of", "reusable"]

T = TypeVar("T")


class Fate(Enum):
    """What happens to a let-go room's pool slot (or other receive memory)."""

    FREE = "free"  # no write can land in it: free at once
    FREE_AFTER_COPY = "free after copy-out"  # likewise, once the caller's copy-out event completed
    QUARANTINE = "quarantine"  # a late write may land in it: held back until the quarantine bound passes
    QUARANTINE_UNTIL_CONFIRMED = "quarantine until confirmed"  # likewise, freed early once the cancel is confirmed

    @property
    def quarantined(self) -> bool:
        """Whether the memory is held back from the next room."""
        return self in (Fate.QUARANTINE, Fate.QUARANTINE_UNTIL_CONFIRMED)


def fate_of(*, succeeded: bool, memory_safe: bool, confirmable: bool, copy_out: bool = False) -> Fate:
    """The fate of a let-go room's memory.

    `succeeded`: the room concluded Success (not overturned since); `memory_safe`: no
    encode rank writes there any more (never asked, or its cancel confirmed); `confirmable`:
    a confirmation of its cancel can still be heard (cleared while its session manager is
    open); `copy_out`: the caller gave the event its copy-out completes on.
    """
    if succeeded or memory_safe:
        return Fate.FREE_AFTER_COPY if copy_out else Fate.FREE
    return Fate.QUARANTINE_UNTIL_CONFIRMED if confirmable else Fate.QUARANTINE


def reusable(*, succeeded: bool, memory_safe: bool, concluded_at: float | None, now: float,
             quarantine_s: float) -> bool:
    """Whether no write can land in the room's memory at `now`: it succeeded or is known safe, or
    `quarantine_s` passed since it concluded (or was cleared unconcluded, at `concluded_at`)."""
    if succeeded or memory_safe:
        return True
    return concluded_at is not None and now - concluded_at >= quarantine_s


class AwaitingConfirmation(Generic[T]):
    """Rooms let go in quarantine until their cancel is confirmed, by token, oldest first.

    A room stays until its confirmation comes (`confirmed`) or `quarantine_s` passed since it
    was let go, when its memory's quarantine ends by itself and a confirmation would change
    nothing (`expire`); past `limit` rooms the oldest go first, so peers that never confirm
    cannot grow it.
    """

    def __init__(self, quarantine_s: float, limit: int) -> None:
        self.quarantine_s = quarantine_s
        self.limit = limit
        #: (when let go, room) by token, oldest first (read, never changed, outside).
        self.rooms: dict[int, tuple[float, T]] = {}

    def __len__(self) -> int:
        return len(self.rooms)

    def add(self, token: int, now: float, room: T) -> None:
        """Files a room let go at `now`, until its cancel is confirmed."""
        self.rooms[token] = (now, room)

    def confirmed(self, token: int) -> T | None:
        """The room whose cancel was confirmed, no longer awaited; None when it is not here."""
        entry = self.rooms.pop(token, None)
        return None if entry is None else entry[1]

    def expire(self, now: float) -> list[T]:
        """Forgets and returns the rooms whose quarantine passed at `now`, and the oldest past the limit."""
        rooms = self.rooms
        gone: list[T] = []
        while rooms:
            token, (let_go_at, room) = next(iter(rooms.items()))
            if now - let_go_at < self.quarantine_s and len(rooms) <= self.limit:
                break
            del rooms[token]
            gone.append(room)
        return gone

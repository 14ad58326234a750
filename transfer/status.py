"""TransferPoll and the room table: the monotone per-room state machine (SPEC.md section 3)."""

from __future__ import annotations

import threading
from enum import IntEnum

from transfer.core.failure import Failure, FailureKind

__all__ = ["RoomTable", "TransferPoll", "advance", "is_terminal"]


class TransferPoll(IntEnum):
    """A room's transfer status; the integer values travel on the wire."""

    Failed = 0
    Bootstrapping = 1
    Bootstrapped = 2
    WaitingForInput = 3
    Transferring = 4
    Success = 5


def advance(old: TransferPoll | None, new: TransferPoll) -> TransferPoll:
    """Return the status after `new` arrives in a room that was `old`: max, with Failed sticky."""
    # Members pass as they are (the table only holds members): the enum's call costs
    # a microsecond, and this runs several times per room under the table's lock.
    if type(new) is not TransferPoll:
        new = TransferPoll(new)
    if old is None:
        return new
    if type(old) is not TransferPoll:
        old = TransferPoll(old)
    # Failed overrides anything and nothing moves a room out of it.
    if old is TransferPoll.Failed or new is TransferPoll.Failed:
        return TransferPoll.Failed
    return new if new > old else old


# The table's fast paths compare members by identity: the table holds members only.
_FAILED, _SUCCESS = TransferPoll.Failed, TransferPoll.Success


def is_terminal(status: TransferPoll | None) -> bool:
    """True for the statuses a room concludes with (Failed, Success)."""
    if status is None:
        return False
    if type(status) is not TransferPoll:
        status = TransferPoll(status)
    return status is TransferPoll.Failed or status is TransferPoll.Success


class RoomTable:
    """Thread-safe map room -> status (+ first failure reason); unknown rooms are ignored on update.

    A room enters with `start` and leaves with `clear`. `update` and `fail` on a
    room that is not in the table do nothing and return None, because a status
    for a room we never started (or already concluded and cleared) is stale.
    Rooms that turn terminal are remembered, in order, until `take_concluded` hands
    them out or `clear` forgets them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[int, TransferPoll] = {}
        self._reason: dict[int, Failure] = {}
        self._concluded: dict[int, None] = {}  # an ordered set: terminal, not yet handed out

    def start(self, room: int, status: TransferPoll = TransferPoll.Bootstrapping) -> TransferPoll:
        """Begin tracking `room`; on a room already tracked this only advances it (Failed stays)."""
        statuses = self._status
        with self._lock:
            # A room not tracked takes a member as it is (advance(None, status) is status): no dict.get() call.
            if room not in statuses and type(status) is TransferPoll:
                statuses[room] = status
                return status
            now = advance(statuses.get(room), status)
            statuses[room] = now
            return now

    def update(self, room: int, status: TransferPoll, reason: Failure | str | None = None) -> TransferPoll | None:
        """Apply `status` to a known room and return its new status; None (ignored) for an unknown room.

        A plain-text `reason` is kept as a Failure of kind OTHER."""
        if reason is not None and isinstance(reason, str):
            reason = Failure(FailureKind.OTHER, reason)
        statuses = self._status
        with self._lock:
            if room not in statuses:
                return None
            old = statuses[room]  # a tracked room's, read by key without dict.get()'s call
            if type(status) is TransferPoll and status is not _FAILED and old is not _FAILED:
                now = status if status > old else old  # advance() of members, neither Failed, without its call
            else:
                now = advance(old, status)
            statuses[room] = now
            # is_terminal(now) and not is_terminal(old), of members
            if (now is _SUCCESS or now is _FAILED) and old is not _SUCCESS and old is not _FAILED:
                self._concluded[room] = None
            # The first reason is the cause; later ones are usually consequences.
            if now is TransferPoll.Failed and reason is not None and room not in self._reason:
                self._reason[room] = reason
            return now

    def fail(self, room: int, reason: Failure | str) -> TransferPoll | None:
        """Mark a known room Failed with `reason` (the first reason wins); None for an unknown room."""
        return self.update(room, TransferPoll.Failed, reason)

    def get(self, room: int) -> TransferPoll | None:
        """The room's status, or None when it is not tracked."""
        statuses = self._status
        with self._lock:
            return statuses[room] if room in statuses else None  # statuses.get(room), without its call

    def reason(self, room: int) -> str | None:
        """The room's first failure reason as text, or None."""
        with self._lock:
            failure = self._reason.get(room)
        return None if failure is None else failure.detail

    def failure(self, room: int) -> Failure | None:
        """The room's first failure (kind and detail), or None."""
        with self._lock:
            return self._reason.get(room)

    def conclude(self, room: int, status: TransferPoll, failure: Failure | None = None) -> bool:
        """Move a known, open room to Success or Failed; True only for the call that concluded it."""
        statuses = self._status
        with self._lock:
            if room not in statuses:  # then read by key, without dict.get()'s call
                return False
            old = statuses[room]
            if old is _SUCCESS or old is _FAILED:  # is_terminal(old), of a member
                return False
            # advance(old, status) of an open room and a terminal member is that member
            now = status if status is _SUCCESS or status is _FAILED else advance(old, status)
            statuses[room] = now
            if now is _SUCCESS or now is _FAILED:
                self._concluded[room] = None
                if now is _FAILED:
                    self._reason[room] = failure or Failure(FailureKind.OTHER, "failed")
                return True
            return False

    def succeed(self, rooms: list[int]) -> list[int]:
        """conclude(room, Success) of each of `rooms` in turn, under one hold of the lock: the rooms it did not
        conclude (unknown, or concluded already), in order; usually none."""
        statuses, concluded = self._status, self._concluded
        left = []
        with self._lock:
            for room in rooms:
                # As conclude() does: a known room not terminal yet turns Success.
                if room in statuses and statuses[room] is not _SUCCESS and statuses[room] is not _FAILED:
                    statuses[room] = _SUCCESS
                    concluded[room] = None
                else:
                    left.append(room)
        return left

    def overturn(self, room: int, failure: Failure) -> bool:
        """Move a room concluded Success to Failed (Failed overrides any state, SPEC.md section 3); True
        when it did. The room is reported by take_concluded() again."""
        with self._lock:
            if self._status.get(room) is not TransferPoll.Success:
                return False
            self._status[room] = TransferPoll.Failed
            self._reason[room] = failure
            self._concluded[room] = None
            return True

    def clear(self, room: int) -> TransferPoll | None:
        """Forget the room entirely (status and reason); returns the status it had (None for an unknown room,
        which this leaves as it is)."""
        statuses = self._status
        with self._lock:
            status = None
            if room in statuses:  # pop(room, None), without its call
                status = statuses[room]
                del statuses[room]
            if room in self._reason:  # a Failed room's: a Success has none
                del self._reason[room]
            if room in self._concluded:  # concluded, not handed out yet
                del self._concluded[room]
            return status

    def take_concluded(self) -> list[int]:
        """Rooms that turned Success or Failed since the last call, oldest first, each once."""
        with self._lock:
            rooms, self._concluded = list(self._concluded), {}
        return rooms

    def rooms(self) -> list[int]:
        """The tracked rooms, sorted."""
        with self._lock:
            return sorted(self._status)

    def __len__(self) -> int:
        with self._lock:
            return len(self._status)

    def __contains__(self, room: object) -> bool:
        with self._lock:
            return room in self._status

    def __repr__(self) -> str:
        with self._lock:
            return f"RoomTable({len(self._status)} rooms)"

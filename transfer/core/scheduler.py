"""The write scheduler: which receivers' writes may start now, oldest first.

At most `depth` writes are in flight; one session holds at most its share of them, so
one that stopped reading leaves slots for every other receiver. A write waits for its
item's ready event without holding up the others, and never starts once the bound has
passed since its room's first ask (its receiver is told Failed instead).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Picked", "WriteScheduler", "session_share"]


def session_share(depth: int) -> int:
    """Slots one session may hold: all but a quarter (at least one) of `depth`, at least one."""
    return max(1, depth - max(1, depth // 4))


@dataclass
class Picked:
    """Jobs leaving the queue: `start` take a slot each, `dropped` leave without one."""

    start: list[Any] = field(default_factory=list)
    dropped: list[Any] = field(default_factory=list)


class WriteScheduler:
    """A queue of write jobs, each with its session and its room's first ask, and the slots in flight."""

    def __init__(self, depth: int, bound_s: float, session_slots: int | None = None) -> None:
        self.depth = max(1, depth)
        self.bound_s = bound_s
        self.session_slots = session_share(self.depth) if session_slots is None else max(1, session_slots)
        self._waiting: deque[tuple[Any, Hashable, float]] = deque()
        self._queued: Counter[Hashable] = Counter()  # jobs waiting per session
        self._flying: Counter[Hashable] = Counter()  # jobs in flight per session
        self.in_flight = 0

    def push(self, job: Any, session: Hashable, asked_at: float) -> None:
        """Queues a write; `asked_at` is its room's first ask, from which the bound counts."""
        self._waiting.append((job, session, asked_at))
        self._queued[session] += 1

    def finished(self, session: Hashable) -> None:
        """A started job is over (settled or failed): its slot is free."""
        self.in_flight -= 1
        self._flying[session] -= 1
        if not self._flying[session]:
            del self._flying[session]

    def pick(self, now: float, *, cancelled: Callable[[Any], bool], ready: Callable[[Any], bool],
             expired: Callable[[Any, float], None]) -> Picked:
        """Takes the jobs that may start now, oldest first, while slots are free.

        `cancelled(job)`: its room failed, so it leaves without a slot. `ready(job)`: its
        source may be read (it may cancel the job instead). `expired(job, waited)` is
        called for a job past the bound since its room's first ask, ready or not, before
        it leaves: the caller fails its room there, so its siblings leave cancelled.
        """
        picked = Picked()
        if not self._waiting or self.in_flight >= self.depth:
            return picked
        open_sessions = {s for s in self._queued if self._flying[s] < self.session_slots}
        held: list[tuple[Any, Hashable, float]] = []
        while self._waiting and self.in_flight < self.depth and open_sessions:
            entry = self._waiting.popleft()
            job, session, asked_at = entry
            if not cancelled(job) and session not in open_sessions:
                held.append(entry)  # its session has its share in flight: others go first
                continue
            go = cancelled(job) or ready(job)
            if not cancelled(job) and now - asked_at > self.bound_s:
                expired(job, now - asked_at)
                go = True
            if not go:
                held.append(entry)
                continue
            self._queued[session] -= 1
            if not self._queued[session]:
                del self._queued[session]
                open_sessions.discard(session)
            if cancelled(job):
                picked.dropped.append(job)
                continue
            picked.start.append(job)
            self.in_flight += 1
            self._flying[session] += 1
            if self._flying[session] >= self.session_slots:
                open_sessions.discard(session)
        self._waiting.extendleft(reversed(held))
        return picked

    def take_all(self) -> list[Any]:
        """Removes and returns every waiting job."""
        jobs = [job for job, _, _ in self._waiting]
        self._waiting.clear()
        self._queued.clear()
        return jobs

    def queued(self, session: Hashable) -> int:
        """Jobs waiting for `session`."""
        return self._queued[session]

    def flying(self, session: Hashable) -> int:
        """Jobs in flight for `session`."""
        return self._flying[session]

    def __len__(self) -> int:
        """Jobs waiting."""
        return len(self._waiting)

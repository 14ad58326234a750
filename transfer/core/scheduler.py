"""The write scheduler: which receivers' writes may start now, sessions taking turns.

At most `depth` writes are in flight; one session holds at most its share of them, so
one that stopped reading leaves slots for every other receiver. Sessions take turns
(one start per visit, the session's oldest job whose item is ready first; one whose
item is not ready yet goes to the back of its session's queue, so a run of them never
holds up the ready jobs behind it), and the work spent on one
session is bounded per pick and per turn of the driver: a dead receiver's backlog of
thousands of writes is worked through a slice at a time while every other receiver's
writes keep starting. A write waits for its item's ready event without holding up the
others, and never starts once the bound has passed since its room's first ask (its
receiver is told Failed instead).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

__all__ = ["MAX_PICK_WORK", "SESSION_TURN_WORK", "VISIT_WORK", "Picked", "WriteScheduler", "session_share"]

#: Waiting jobs one pick looks at in all.
MAX_PICK_WORK = 256

#: Waiting jobs of one session looked at per turn (between two new_turn() calls): each
#: write that fails at once frees a slot for the next, so without it one turn would walk
#: a dead receiver's whole backlog.
SESSION_TURN_WORK = 64

#: Waiting jobs one visit to a session looks at before the next session's visit.
VISIT_WORK = 8


def session_share(depth: int) -> int:
    """Slots one session may hold: all but a quarter (at least one) of `depth`, at least one."""
    return max(1, depth - max(1, depth // 4))


@dataclass
class Picked:
    """Jobs leaving the queue: `start` take a slot each (in the order they were queued), `dropped` leave without one."""

    start: list[Any] = field(default_factory=list)
    dropped: list[Any] = field(default_factory=list)


@dataclass
class _Pick:
    """One pick's callbacks, clock and progress."""

    now: float
    cancelled: Callable[[Any], bool]
    ready: Callable[[Any], bool]
    expired: Callable[[Any, float], None]
    picked: Picked = field(default_factory=Picked)
    started: list[tuple[int, Any]] = field(default_factory=list)
    # Jobs (by sequence number) this pick looked at and sent to the back: the others it looked at left the
    # queues, so a job at a queue's front was looked at by this pick exactly when it is in here.
    seen: set[int] = field(default_factory=set)
    work: int = 0


_SEQ = itemgetter(0)  # a started entry's sequence number


class WriteScheduler:
    """Per-session queues of write jobs, each with its room's first ask, and the slots in flight."""

    def __init__(self, depth: int, bound_s: float, session_slots: int | None = None, *,
                 turn_work: int = SESSION_TURN_WORK) -> None:
        self.depth = max(1, depth)
        self.bound_s = bound_s
        self.session_slots = session_share(self.depth) if session_slots is None else max(1, session_slots)
        self.pick_work, self.turn_work, self.visit_work = MAX_PICK_WORK, turn_work, VISIT_WORK
        self._queues: dict[Hashable, deque[tuple[int, Any, float]]] = {}  # session -> (seq, job, asked at)
        self._ring: deque[Hashable] = deque()  # sessions with waiting jobs, the next to visit first
        # Jobs in flight per session, a session with none left out: a dict, whose del (unlike a Counter's)
        # is no Python call.
        self._flying: dict[Hashable, int] = {}
        self._turn: Counter[Hashable] = Counter()  # jobs looked at this turn per session
        self.waiting = 0  # jobs waiting (read it; the scheduler keeps it)
        self._seq = 0
        self.in_flight = 0

    def push(self, job: Any, session: Hashable, asked_at: float) -> None:
        """Queues a write; `asked_at` is its room's first ask, from which the bound counts."""
        queue = self._queues.get(session)
        if queue is None:
            queue = self._queues[session] = deque()
            self._ring.append(session)
        queue.append((self._seq, job, asked_at))
        self._seq += 1
        self.waiting += 1

    def start_now(self, sessions: Sequence[Hashable]) -> bool:
        """Takes a slot for one new job of each of `sessions` (all distinct) where push() and a pick would start
        them all at once, ready and wanted as they are: no job waits, the slots hold them all, and each
        session has a slot of its share free and work left this turn. Then counts them as that pick would
        (its sequence numbers, the slots, the turn's work) and returns True; else takes nothing and returns
        False, and the jobs go push().

        A pick visits the waiting sessions in turn and starts one job a visit; with no other job waiting
        it visits each of these once, starting its job, in the order they were pushed."""
        count = len(sessions)
        if self.waiting or self.in_flight + count > self.depth or count > self.pick_work:
            return False
        if count > 1 and len(set(sessions)) < count:
            return False  # a session named twice: how many of its jobs start is the pick's to say
        flying, turn = self._flying, self._turn
        for session in sessions:
            if ((session in flying and flying[session] >= self.session_slots)
                    or (session in turn and turn[session] >= self.turn_work)):
                return False
        for session in sessions:
            flying[session] = flying[session] + 1 if session in flying else 1
            turn[session] = turn[session] + 1 if session in turn else 1
        self.in_flight += count
        self._seq += count
        return True

    def finished(self, session: Hashable) -> None:
        """A started job is over (settled or failed): its slot is free."""
        self.in_flight -= 1
        flying = self._flying
        left = flying[session] - 1
        if left:
            flying[session] = left
        else:
            del flying[session]

    def new_turn(self) -> None:
        """The driver's next turn: every session may be looked at again."""
        self._turn.clear()

    def pick(self, now: float, *, cancelled: Callable[[Any], bool], ready: Callable[[Any], bool],
             expired: Callable[[Any, float], None]) -> Picked:
        """Takes the jobs that may start now while slots are free, sessions taking turns.

        `cancelled(job)`: its room failed, so it leaves without a slot (even from a
        session holding its share). `ready(job)`: its source may be read (it may cancel
        the job instead). `expired(job, waited)` is called for a job past the bound since
        its room's first ask, ready or not, before it leaves: the caller fails its room
        there, so its siblings leave cancelled.
        """
        pick = _Pick(now, cancelled, ready, expired)
        if not self.waiting or self.in_flight >= self.depth:
            return pick.picked
        progress = True
        while progress and pick.work < self.pick_work and self.in_flight < self.depth and self._ring:
            progress = False
            for _ in range(len(self._ring)):
                if pick.work >= self.pick_work or self.in_flight >= self.depth:
                    break
                session = self._ring[0]
                self._ring.rotate(-1)  # the next pick starts with the next session
                progress |= self._visit(session, pick)
        pick.started.sort(key=_SEQ)
        pick.picked.start = [job for _, job in pick.started]
        return pick.picked

    def _visit(self, session: Hashable, pick: _Pick) -> bool:
        """Looks at the session's oldest jobs: drops cancelled ones, starts at most one, sends
        those whose item is not ready to the back; True on any change or when jobs this pick
        has not looked at came to the front."""
        queue = self._queues[session]
        # The counts read with `in` first: a Counter's [] of a session it lacks calls Counter.__missing__
        # (and `flying`, a dict, has no such session).
        turn, flying = self._turn, self._flying
        turn_left = self.turn_work - turn[session] if session in turn else self.turn_work
        pick_left = self.pick_work - pick.work
        allowance = self.visit_work  # the least of the three, without min()'s call
        if turn_left < allowance:
            allowance = turn_left
        if pick_left < allowance:
            allowance = pick_left
        opened = session not in flying or flying[session] < self.session_slots
        held: list[tuple[int, Any, float]] = []
        looked, moved, started = 0, False, False
        while queue and looked < allowance:
            entry = queue[0]
            seq, job, asked_at = entry
            if seq in pick.seen:
                break  # round the whole queue: every job of it was looked at in this pick
            cancelled = pick.cancelled(job)
            if not cancelled and (not opened or started):
                break  # its session has its share in flight, or had its start of this visit: others go next
            queue.popleft()
            looked += 1
            if cancelled:
                pick.picked.dropped.append(job)
                moved = True
                continue
            go = pick.ready(job)
            if pick.now - asked_at > self.bound_s and not pick.cancelled(job):
                pick.expired(job, pick.now - asked_at)
                go = True
            if not go:
                held.append(entry)
                pick.seen.add(seq)
                continue
            moved = True
            if pick.cancelled(job):
                pick.picked.dropped.append(job)
                continue
            pick.started.append((seq, job))
            self.in_flight += 1
            flying[session] = flying[session] + 1 if session in flying else 1
            started = True  # cancelled jobs right behind it still leave
        unseen, taken = False, looked
        if held:  # sent to the back
            unseen = bool(queue) and queue[0][0] not in pick.seen
            queue.extend(held)
            taken -= len(held)
        self.waiting -= taken
        turn[session] = turn[session] + looked if session in turn else looked
        pick.work += looked
        if not queue:
            del self._queues[session]
            self._ring.pop()  # just rotated to the end
        return moved or unseen

    def take_all(self) -> list[Any]:
        """Removes and returns every waiting job, in the order they were queued."""
        entries = sorted((entry for queue in self._queues.values() for entry in queue), key=lambda e: e[0])
        self._queues.clear()
        self._ring.clear()
        self.waiting = 0
        return [job for _, job, _ in entries]

    def queued(self, session: Hashable) -> int:
        """Jobs waiting for `session`."""
        queue = self._queues.get(session)
        return len(queue) if queue is not None else 0

    def flying(self, session: Hashable) -> int:
        """Jobs in flight for `session`."""
        return self._flying.get(session, 0)

    def __len__(self) -> int:
        """Jobs waiting."""
        return self.waiting

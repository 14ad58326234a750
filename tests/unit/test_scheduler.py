"""The write scheduler: depth, per-session share, ready events, the bound from a room's first ask."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from transfer.core.scheduler import WriteScheduler, _Pick, session_share


@dataclass
class Job:
    name: str
    ready: bool = True
    cancelled: bool = False


def _pick(sched: WriteScheduler, now: float = 0.0, expired: list | None = None):
    def on_expired(job: Job, waited: float) -> None:
        job.cancelled = True  # the caller fails the room
        if expired is not None:
            expired.append((job.name, waited))

    return sched.pick(now, cancelled=lambda j: j.cancelled, ready=lambda j: j.ready, expired=on_expired)


def test_the_session_share_leaves_a_quarter_for_others():
    assert [session_share(d) for d in (1, 2, 4, 8, 32)] == [1, 1, 3, 6, 24]


def test_at_most_depth_start_oldest_first_and_a_finished_one_frees_a_slot():
    sched = WriteScheduler(depth=2, bound_s=10.0, session_slots=2)
    jobs = [Job(f"w{i}") for i in range(3)]
    for job in jobs:
        sched.push(job, "a", asked_at=0.0)
    assert [j.name for j in _pick(sched).start] == ["w0", "w1"] and sched.in_flight == 2
    assert _pick(sched).start == []
    sched.finished("a")
    assert [j.name for j in _pick(sched).start] == ["w2"] and len(sched) == 0


def test_a_session_whose_writes_in_flight_are_all_over_is_no_longer_held():
    sched = WriteScheduler(depth=4, bound_s=10.0)
    for session in "ab":
        sched.push(Job(f"{session}0"), session, asked_at=0.0)
        sched.push(Job(f"{session}1"), session, asked_at=0.0)
    assert len(_pick(sched).start) == 4
    sched.finished("a")
    assert sched.flying("a") == 1 and sched.flying("b") == 2
    sched.finished("a")
    assert sched.flying("a") == 0 and list(sched._flying) == ["b"]  # a book of the sessions ever written: unbounded


def test_a_session_at_its_share_lets_other_sessions_go_first():
    sched = WriteScheduler(depth=4, bound_s=10.0)  # share 3
    for i in range(5):
        sched.push(Job(f"a{i}"), "a", asked_at=0.0)
    sched.push(Job("b0"), "b", asked_at=0.0)
    assert [j.name for j in _pick(sched).start] == ["a0", "a1", "a2", "b0"]
    assert sched.flying("a") == 3 and sched.queued("a") == 2
    sched.finished("a")
    assert [j.name for j in _pick(sched).start] == ["a3"]


def test_a_job_whose_source_is_not_ready_waits_without_holding_up_others():
    sched = WriteScheduler(depth=4, bound_s=10.0)
    slow = Job("slow", ready=False)
    sched.push(slow, "a", asked_at=0.0)
    sched.push(Job("fast"), "b", asked_at=0.0)
    assert [j.name for j in _pick(sched).start] == ["fast"] and len(sched) == 1
    slow.ready = True
    assert _pick(sched, now=1.0).start == [slow]


def test_a_job_past_the_bound_from_its_rooms_first_ask_never_starts():
    sched = WriteScheduler(depth=1, bound_s=5.0)
    sched.push(Job("busy"), "a", asked_at=0.0)
    assert len(_pick(sched, now=0.0).start) == 1
    late, held = Job("late"), Job("held", ready=False)
    sched.push(late, "b", asked_at=0.0)
    sched.push(held, "c", asked_at=0.0)
    sched.finished("a")
    expired: list = []
    picked = _pick(sched, now=6.0, expired=expired)
    # Not ready and past the bound: told now, not when the ready event completes.
    assert picked.start == [] and picked.dropped == [late, held]
    assert expired == [("late", 6.0), ("held", 6.0)] and sched.in_flight == 0


def test_cancelled_jobs_leave_without_a_slot_even_when_their_session_is_full():
    sched = WriteScheduler(depth=2, bound_s=10.0, session_slots=1)
    sched.push(Job("a0"), "a", asked_at=0.0)
    gone = Job("a1", cancelled=True)
    sched.push(gone, "a", asked_at=0.0)
    sched.push(Job("b0"), "b", asked_at=0.0)
    picked = _pick(sched)
    assert [j.name for j in picked.start] == ["a0", "b0"] and picked.dropped == [gone]
    assert sched.queued("a") == 0


def test_take_all_empties_the_queue():
    sched = WriteScheduler(depth=1, bound_s=1.0)
    sched.push(Job("x"), "a", asked_at=0.0)
    assert [j.name for j in sched.take_all()] == ["x"] and len(sched) == 0 and sched.queued("a") == 0


WORK_BOUND = 256  # entries one pick may look at, whatever the backlog


def _counting_pick(sched: WriteScheduler, now: float = 0.0):
    """Picks once; returns what was picked and how many distinct jobs the pick looked at."""
    seen: set[int] = set()

    def cancelled(job: Job) -> bool:
        seen.add(id(job))
        return job.cancelled

    def ready(job: Job) -> bool:
        seen.add(id(job))
        return job.ready

    def expired(job: Job, waited: float) -> None:
        job.cancelled = True

    return sched.pick(now, cancelled=cancelled, ready=ready, expired=expired), len(seen)


def test_a_dead_sessions_backlog_costs_each_pick_a_bounded_look_and_a_healthy_write_starts_first():
    sched = WriteScheduler(depth=32, bound_s=120.0)  # a session's share: 24
    dead = [Job(f"d{i}") for i in range(6000)]
    for job in dead:
        sched.push(job, "dead", asked_at=0.0)
    assert len(_pick(sched).start) == 24  # in flight to a peer that no longer answers
    sched.push(Job("healthy"), "live", asked_at=1.0)
    picked, looked_at = _counting_pick(sched, now=1.0)
    assert [j.name for j in picked.start] == ["healthy"] and looked_at <= WORK_BOUND


def test_a_backlog_of_failed_rooms_leaves_in_bounded_picks_without_holding_up_a_healthy_write():
    sched = WriteScheduler(depth=32, bound_s=120.0)
    dead = [Job(f"d{i}") for i in range(6000)]
    for job in dead:
        sched.push(job, "dead", asked_at=0.0)
    _pick(sched)
    for job in dead:
        job.cancelled = True  # their rooms failed
    sched.push(Job("healthy"), "live", asked_at=1.0)
    picked, looked_at = _counting_pick(sched, now=1.0)
    assert [j.name for j in picked.start] == ["healthy"] and looked_at <= WORK_BOUND
    dropped, picks = len(picked.dropped), 1
    while len(sched):
        sched.new_turn()
        picked, looked_at = _counting_pick(sched, now=1.0)
        assert looked_at <= WORK_BOUND and picked.start == []
        dropped, picks = dropped + len(picked.dropped), picks + 1
    assert dropped == 6000 - 24 and sched.queued("dead") == 0


def test_sessions_take_turns_so_one_with_a_long_queue_does_not_go_first_with_every_slot():
    sched = WriteScheduler(depth=4, bound_s=10.0, session_slots=4)
    for i in range(8):
        sched.push(Job(f"a{i}"), "a", asked_at=0.0)
    sched.push(Job("b0"), "b", asked_at=0.0)
    assert sorted(j.name for j in _pick(sched).start) == ["a0", "a1", "a2", "b0"]


def test_jobs_whose_items_are_not_ready_do_not_hold_up_a_ready_one_behind_them():
    sched = WriteScheduler(depth=4, bound_s=10.0)
    waiting = [Job(f"w{i}", ready=False) for i in range(20)]
    for job in waiting:
        sched.push(job, "a", asked_at=0.0)
    sched.push(Job("ready"), "a", asked_at=0.0)
    picked, looked_at = _counting_pick(sched)
    assert [j.name for j in picked.start] == ["ready"] and looked_at == 21
    for job in waiting[:3]:
        job.ready = True
    sched.finished("a")
    sched.new_turn()
    # Their items ready now, the oldest start first, in the order they were queued.
    assert [j.name for j in _pick(sched, now=1.0).start] == ["w0", "w1", "w2"]


def test_a_pick_looks_at_each_job_whose_item_is_not_ready_at_most_once():
    sched = WriteScheduler(depth=4, bound_s=10.0, turn_work=1000)
    calls: list[str] = []
    for i in range(30):
        sched.push(Job(f"w{i}", ready=False), "a", asked_at=0.0)

    def ready(job: Job) -> bool:
        calls.append(job.name)
        return job.ready

    picked = sched.pick(0.0, cancelled=lambda j: j.cancelled, ready=ready, expired=lambda j, w: None)
    assert picked.start == [] and sorted(calls) == sorted(f"w{i}" for i in range(30)) and len(sched) == 30


class _LookedAtAll(WriteScheduler):
    """The pick as it reads with every job it looks at filed in `seen`, its held jobs always put back and its
    starts sorted by a lambda: what the scheduler's bookkeeping must stay equal to."""

    def pick(self, now, *, cancelled, ready, expired):
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
                self._ring.rotate(-1)
                progress |= self._visit(session, pick)
        pick.started.sort(key=lambda entry: entry[0])
        pick.picked.start = [job for _, job in pick.started]
        return pick.picked

    def _visit(self, session, pick):
        queue = self._queues[session]
        allowance = min(self.visit_work, self.turn_work - self._turn[session], self.pick_work - pick.work)
        opened = self._flying.get(session, 0) < self.session_slots
        held = []
        looked, moved, started = 0, False, False
        while queue and looked < allowance:
            entry = queue[0]
            seq, job, asked_at = entry
            if seq in pick.seen:
                break
            cancelled = pick.cancelled(job)
            if not cancelled and (not opened or started):
                break
            queue.popleft()
            pick.seen.add(seq)
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
                continue
            moved = True
            if pick.cancelled(job):
                pick.picked.dropped.append(job)
                continue
            pick.started.append((seq, job))
            self.in_flight += 1
            self._flying[session] = self._flying.get(session, 0) + 1
            started = True
        unseen = bool(held) and bool(queue) and queue[0][0] not in pick.seen
        queue.extend(held)
        taken = looked - len(held)
        self.waiting -= taken
        self._turn[session] += looked
        pick.work += looked
        if not queue:
            del self._queues[session]
            self._ring.pop()
        return moved or unseen


_SCHEDULER_STEPS = st.lists(st.one_of(
    st.tuples(st.just("push"), st.sampled_from("abc"), st.integers(0, 3), st.booleans(), st.booleans()),
    st.tuples(st.just("pick"), st.integers(0, 8)),
    st.tuples(st.just("finish"), st.sampled_from("abc")),
    st.tuples(st.just("turn")),
    st.tuples(st.just("flip"), st.integers(0, 40), st.sampled_from(["ready", "cancelled"])),
), max_size=60)


def _scheduler(cls: type[WriteScheduler], depth: int, slots: int, works: tuple[int, int, int]) -> WriteScheduler:
    """A scheduler of `cls` with `depth` slots, `slots` a session, and (pick, turn, visit) work bounds `works`."""
    sched = cls(depth, 4.0, slots)
    sched.pick_work, sched.turn_work, sched.visit_work = works
    return sched


def _push_step(sched: WriteScheduler, step: tuple, jobs: list[Job]) -> None:
    """A ("push", session, asked_at, ready, cancelled) step: a new job, named by its session and number."""
    _, session, asked_at, ready, cancelled = step
    jobs.append(Job(f"{session}{len(jobs)}", ready, cancelled))
    sched.push(jobs[-1], session, float(asked_at))


def _flip_step(step: tuple, jobs: list[Job]) -> None:
    """A ("flip", index, attribute) step: one of the jobs so far turns that attribute over."""
    if jobs:
        job = jobs[step[1] % len(jobs)]
        setattr(job, step[2], not getattr(job, step[2]))


@settings(max_examples=300, deadline=None)
@given(steps=_SCHEDULER_STEPS, depth=st.integers(1, 5), slots=st.integers(1, 4), works=st.tuples(
    st.integers(1, 6), st.integers(1, 6), st.integers(1, 4)))
def test_a_pick_starts_drops_and_asks_about_the_same_jobs_as_one_that_files_every_job_it_looks_at(
        steps, depth, slots, works):
    def run(sched: WriteScheduler) -> list:
        jobs: list[Job] = []
        flying: dict[str, int] = {}
        seen: list = []
        for step in steps:
            if step[0] == "push":
                _push_step(sched, step, jobs)
            elif step[0] == "pick":
                def cancelled(job: Job) -> bool:
                    seen.append(("cancelled", job.name))
                    return job.cancelled

                def ready(job: Job) -> bool:
                    seen.append(("ready", job.name))
                    return job.ready

                def expired(job: Job, waited: float) -> None:
                    seen.append(("expired", job.name, waited))
                    job.cancelled = True

                picked = sched.pick(float(step[1]), cancelled=cancelled, ready=ready, expired=expired)
                for job in picked.start:
                    flying[job.name[0]] = flying.get(job.name[0], 0) + 1
                seen.append(([j.name for j in picked.start], [j.name for j in picked.dropped]))
            elif step[0] == "finish":
                if flying.get(step[1]):
                    flying[step[1]] -= 1
                    sched.finished(step[1])
            elif step[0] == "turn":
                sched.new_turn()
            else:
                _flip_step(step, jobs)
            seen.append((sched.waiting, sched.in_flight, [sched.queued(s) for s in "abc"],
                         [sched.flying(s) for s in "abc"]))
        return seen

    assert run(_scheduler(WriteScheduler, depth, slots, works)) == run(_scheduler(_LookedAtAll, depth, slots, works))


def _counts(sched: WriteScheduler) -> tuple:
    """What a scheduler's later picks read: its counts, sessions in turn and queued jobs."""
    return (sched.waiting, sched.in_flight, sched._seq, dict(sched._flying), dict(sched._turn), list(sched._ring),
            {session: [(seq, job.name, at) for seq, job, at in queue] for session, queue in sched._queues.items()})


# A session holding its share of the slots; one whose work this turn is used up; one named twice, with one slot.
@example(steps=[], depth=5, slots=1, works=(6, 6, 4), new=["a", "a"])
@example(steps=[("push", "a", 0, True, False), ("pick", 0)], depth=5, slots=1, works=(6, 6, 4), new=["b", "a"])
@example(steps=[("push", "a", 0, True, False), ("pick", 0), ("finish", "a")], depth=5, slots=1, works=(6, 1, 4),
         new=["a"])
@settings(max_examples=300, deadline=None)
@given(steps=_SCHEDULER_STEPS, depth=st.integers(1, 5), slots=st.integers(1, 4), works=st.tuples(
    st.integers(1, 6), st.integers(1, 6), st.integers(1, 4)), new=st.lists(st.sampled_from("abcd"), max_size=4))
def test_start_now_takes_the_slots_of_new_jobs_only_where_a_pick_would_start_them_all(steps, depth, slots, works,
                                                                                      new):
    sched = _scheduler(WriteScheduler, depth, slots, works)
    jobs: list[Job] = []
    for step in steps:
        if step[0] == "push":
            _push_step(sched, step, jobs)
        elif step[0] == "pick":
            _pick(sched, float(step[1]))
        elif step[0] == "finish":
            if sched.flying(step[1]):
                sched.finished(step[1])
        elif step[0] == "turn":
            sched.new_turn()
        else:
            _flip_step(step, jobs)
    picked = copy.deepcopy(sched)
    before = _counts(sched)
    for session in new:  # ready and wanted, their room's first ask now
        picked.push(Job(f"new-{session}"), session, 8.0)
    started = _pick(picked, 8.0)
    if sched.start_now(list(new)):
        assert [job.name for job in started.start] == [f"new-{session}" for session in new] and not started.dropped
        assert _counts(sched) == _counts(picked)
    else:  # pushed instead, then picked
        assert _counts(sched) == before
        assert new == [] or [job.name for job in started.start] != [f"new-{session}" for session in new] or \
            before[0] > 0 or len(set(new)) < len(new)

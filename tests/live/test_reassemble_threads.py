"""transfer.reassemble called from two threads of each rank on one process group (gloo, 127.0.0.1).

Two ranks run in separate processes; in each, two threads call reassemble() on the same
group with distinct batches. The threads' collectives are steered by wrapping
torch.distributed.all_reduce in the rank processes: where the calls are not taken one at
a time per group, rank 0 issues thread B's agreement before thread A's while rank 1
issues A's first, so A's batch meets B's on the peer. Every rank rebuilds the true rows
of every item from the room number alone and compares the bytes. Every wait is bounded:
the group's timeout, a bound on each wait between the threads, and a deadline on the
rank processes.
"""

from __future__ import annotations

import datetime
import threading

import gloo_ranks
import torch
import torch.distributed as dist
from gloo_ranks import seen
from sharded_rows import destination, original, same_bytes

from transfer.reassemble import ShardedItem, agree, reassemble

GROUP_TIMEOUT_S = 20
TURN_TIMEOUT_S = 5  # the timeout of the group whose turn one thread holds on purpose
STEP_S = 30  # bound on each wait between the two threads of a rank
HOLD_S = 3  # how long rank 0's thread A waits for thread B's agreement to be issued first
JOIN_S = 150

BATCH_A = [(1, 10, 0), (2, 7, 2), (3, 64, 0)]  # (room, span, deepstack columns per hidden)
BATCH_B = [(11, 9, 1), (12, 1, 0), (13, 33, 0), (14, 5, 3)]


def build(batch: list[tuple[int, int, int]], rank: int, size: int) -> list[tuple[ShardedItem, torch.Tensor,
                                                                                torch.Tensor | None]]:
    """(item holding this rank's shard, its true rows, its true deepstack rows or None) per room."""
    out = []
    for room, span, k in batch:
        rows = original(room, span, torch.bfloat16)
        ds = original(room + 500, span, torch.bfloat16, 6 * k) if k else None
        item = ShardedItem(room, destination(rows, rank, size), True,
                           destination(ds, rank, size) if ds is not None else None)
        out.append((item, rows, ds))
    return out


def call(name: str, batch: list[tuple[int, int, int]], rank: int, size: int, group, found: dict) -> None:
    """reassemble() one batch on this thread; record the flags (or what it raised) and whether the bytes are true."""
    built = build(batch, rank, size)
    before = [(item.full.clone(), None if item.deepstack is None else item.deepstack.clone()) for item, _, _ in built]
    try:
        flags, raised = reassemble([b[0] for b in built], group), None
    except Exception as exc:  # noqa: BLE001 - what it raises is the observation
        flags, raised = None, f"{type(exc).__name__}: {exc}"
    exact = [same_bytes(item.full, rows) and (ds is None or same_bytes(item.deepstack, ds))
             for item, rows, ds in built]
    untouched = [same_bytes(item.full, full) and (ds is None or same_bytes(item.deepstack, ds))
                 for (item, _, _), (full, ds) in zip(built, before)]
    found[name] = {"flags": flags, "raised": raised, "exact": exact, "untouched": untouched}


class Steered:
    """Wraps dist.all_reduce in this process so each thread's first agreement is issued in a chosen order."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.a_inside = threading.Event()  # thread A is in its first collective (holding the group's turn)
        self.b_issued = threading.Event()  # thread B's first all-reduce is issued
        self.waited_for_b = None
        self._real = dist.all_reduce
        self._first = {"A": True, "B": True}

    def __enter__(self) -> Steered:
        dist.all_reduce = self._all_reduce
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._real

    def _all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = threading.current_thread().name
        first, self._first[name] = self._first.get(name, False), False
        if not first or async_op:
            return self._real(tensor, op=op, group=group, async_op=async_op)
        if name == "A" and self.rank == 0:
            self.a_inside.set()
            self.waited_for_b = self.b_issued.wait(HOLD_S)  # B's first, unless B must wait for A's turn
            return self._real(tensor, op=op, group=group)
        work = self._real(tensor, op=op, group=group, async_op=True)  # issued now, in this order
        (self.a_inside if name == "A" else self.b_issued).set()
        work.wait()
        return None


def two_threads(rank: int, size: int) -> dict:
    """Threads A and B reassemble distinct batches on the world group, B starting while A is in its collective."""
    found: dict = {}
    with Steered(rank) as steered:
        a = threading.Thread(target=call, args=("A", BATCH_A, rank, size, None, found), name="A")
        a.start()
        started = steered.a_inside.wait(STEP_S)
        b = threading.Thread(target=call, args=("B", BATCH_B, rank, size, None, found), name="B")
        b.start()
        a.join(GROUP_TIMEOUT_S * 4)
        b.join(GROUP_TIMEOUT_S * 4)
    found["a_started_first"] = started
    found["b_issued_while_a_waited"] = steered.waited_for_b
    found["joined"] = not a.is_alive() and not b.is_alive()
    # The group is usable afterwards: one more agreement meets the peer's.
    found["after"] = agree([True], None)
    return found


def turn_held_past_the_timeout(rank: int, size: int) -> dict:
    """Thread A holds the group's turn (its agreement steered to wait) until thread B's call gave up waiting."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TURN_TIMEOUT_S))
    found: dict = {}
    a_inside, b_done = threading.Event(), threading.Event()
    real = dist.all_reduce

    def hold(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if threading.current_thread().name == "A" and not a_inside.is_set():
            a_inside.set()
            found["b_done_while_held"] = b_done.wait(STEP_S + TURN_TIMEOUT_S)
        return real(tensor, op=op, group=group, async_op=async_op)

    def b_call() -> None:
        try:
            call("B", BATCH_B, rank, size, group, found)
        finally:
            b_done.set()

    dist.all_reduce = hold
    try:
        a = threading.Thread(target=call, args=("A", BATCH_A, rank, size, group, found), name="A")
        a.start()
        a_inside.wait(STEP_S)
        b = threading.Thread(target=b_call, name="B")
        b.start()
        b.join(STEP_S + TURN_TIMEOUT_S * 2)
        a.join(STEP_S + TURN_TIMEOUT_S * 4)
    finally:
        dist.all_reduce = real
    return found


def run_ranks(scenario: str, folder) -> list[dict]:
    """Each of two ranks' observations; fails naming a rank that crashed or never reported."""
    return seen(gloo_ranks.run_ranks(__name__, scenario, 2, folder, group_timeout_s=GROUP_TIMEOUT_S, join_s=JOIN_S))


def test_two_threads_of_each_rank_reassembling_on_one_group_take_turns_and_rebuild_every_row(tmp_path):
    for rank, seen in enumerate(run_ranks("two_threads", tmp_path)):
        assert seen["a_started_first"] and seen["joined"], (rank, seen)
        for name, batch in (("A", BATCH_A), ("B", BATCH_B)):
            assert seen[name]["raised"] is None, (rank, name, seen[name])
            assert seen[name]["flags"] == [True] * len(batch), (rank, name, seen[name])
            assert all(seen[name]["exact"]), (rank, name, seen[name])
        if rank == 0:  # B's agreement waited for A's call to end: it was not issued while A held the turn
            assert seen["b_issued_while_a_waited"] is False, seen
        assert seen["after"] == [True], (rank, seen)


def test_a_call_that_waits_out_the_groups_timeout_for_its_turn_raises_and_the_holder_completes(tmp_path):
    for rank, seen in enumerate(run_ranks("turn_held_past_the_timeout", tmp_path)):
        assert seen["b_done_while_held"], (rank, seen)
        raised = seen["B"]["raised"] or ""
        assert raised.startswith("UsageError: reassemble: another thread of this process was in reassemble() "
                                 f"or agree() on the same group for the group's whole timeout ({TURN_TIMEOUT_S} s)"), \
            (rank, seen["B"])
        assert "Make the calls on a group from one thread (or order the threads)" in raised, raised
        assert all(seen["B"]["untouched"]), (rank, seen["B"])  # nothing of B's batch was written
        assert seen["A"]["raised"] is None and seen["A"]["flags"] == [True] * len(BATCH_A), (rank, seen["A"])
        assert all(seen["A"]["exact"]), (rank, seen["A"])

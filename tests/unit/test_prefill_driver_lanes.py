"""The prefill driver's lane Successes (`PrefillDriver._settle_lanes`): the core's plain answer, a Conclude
Success of each room the native intake settled, carried out for the rooms together leaves what carrying it
out one room at a time (`_stamp_status()` then `_carry()`) leaves: the room table, the metrics, each room's
record. A real PrefillCore, room table and Metrics; the driver is made without its I/O thread and sockets,
which these steps never touch (the intake's settled rooms are handed in as lane_take hands them over)."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st
from prefill_rooms import asked, status_driver

from transfer.core.failure import Failure, FailureKind
from transfer.core.prefill import Conclude
from transfer.drive.prefill import PrefillDriver, Room
from transfer.status import TransferPoll


class OneByOne(PrefillDriver):
    """The general carrying of the core's answer to the lanes' Successes, one action at a time."""

    def _settle_lanes(self, now: float, settled: list[int]) -> list:
        actions = self.core.lanes_settled(now, settled)
        self._stamp_status(now, actions)
        return self._carry(now, actions)


def driver(kind: type[PrefillDriver]) -> PrefillDriver:
    """A driver of `kind` with what its status steps use, and no thread or socket."""
    return status_driver(kind)


# What happens to a room before its lane's Success is read: nothing; its status already stamped; concluded
# Failed by close() without the lock; given up (its lane ended, and a lane_take that settles it all the same).
BEFORE = st.sampled_from(["plain", "plain", "plain", "stamped", "closed", "outlived"])


@st.composite
def schedules(draw) -> tuple[list[tuple[int, str, float, int]], list[list[int]]]:
    """Rooms (number, what happens first, start, bytes) and the batches their Successes are settled in."""
    numbers = draw(st.lists(st.integers(0, 9), min_size=1, max_size=7, unique=True))
    rooms = [(room, draw(BEFORE), draw(st.sampled_from([0.0, 0.1, 0.25])), draw(st.integers(0, 1 << 33)))
             for room in numbers]
    order = draw(st.permutations(numbers))
    batches, i = [], 0
    while i < len(order):
        size = draw(st.integers(1, len(order) - i))
        batches.append(list(order[i:i + size]))
        i += size
    return rooms, batches


def run(kind: type[PrefillDriver], rooms: list[tuple[int, str, float, int]], batches: list[list[int]]) -> tuple:
    d = driver(kind)
    records = {}
    for room, before, started, nbytes in rooms:
        token = asked(d.core, room, started)
        records[room] = d.rooms[room] = Room(room, started, nbytes, token=token)
        d.table.start(room, TransferPoll.Bootstrapping)
        if before == "stamped":
            records[room].status_at = 0.5
        elif before == "closed":
            d._conclude(0.6, Conclude(room, token, Failure(FailureKind.CLOSED, "session manager closed")))
        elif before == "outlived":
            d.core.abandon(0.6, room, token)
    d.table.take_concluded()
    now, verifies = 1.0, []
    for batch in batches:
        for room in batch:
            d.core.lanes.pop(room, None)  # as lane_take takes a room out of lanes as it settles it
        verifies.append(d._settle_lanes(now, batch))
        now += 0.125
    table = [(room, d.table.get(room), d.table.failure(room)) for room in sorted(records)]
    kept = [(room, r.concluded_at, r.succeeded, r.memory_safe, r.status_at) for room, r in sorted(records.items())]
    return verifies, table, d.table.take_concluded(), kept, d.metrics.snapshot(), sorted(d.core.lanes)


@given(schedules())
@example(([(1, "plain", 0.0, 10), (2, "plain", 0.1, 20), (3, "plain", 0.25, 30)], [[1, 2, 3]]))
@example(([(1, "closed", 0.0, 10), (2, "plain", 0.1, 20)], [[1, 2]]))
@example(([(1, "plain", 0.0, 10), (2, "outlived", 0.1, 20), (3, "plain", 0.25, 30)], [[1, 2, 3]]))
def test_lane_successes_concluded_together_leave_what_carrying_them_one_by_one_leaves(schedule):
    rooms, batches = schedule
    assert run(PrefillDriver, rooms, batches) == run(OneByOne, rooms, batches)


def test_a_batch_of_plain_successes_concludes_each_room_counted_once():
    rooms = [(1, "plain", 0.0, 10), (2, "plain", 0.5, 20)]
    verifies, table, concluded, kept, snapshot, lanes = run(PrefillDriver, rooms, [[2, 1]])
    assert verifies == [[]] and lanes == []
    assert table == [(1, TransferPoll.Success, None), (2, TransferPoll.Success, None)] and concluded == [2, 1]
    assert kept == [(1, 1.0, True, False, 1.0), (2, 1.0, True, False, 1.0)]
    counts = {row["name"]: row["value"] for row in snapshot if row["type"] == "counter"}
    assert counts["epd_prefill_rooms_succeeded_total"] == 2 and counts["epd_prefill_bytes_received_total"] == 30

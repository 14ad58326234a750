"""The room table under real threads: two calls on one room, interleaved inside the table's
critical section wherever its lock does not keep them apart (tests/live/lock_races.py)."""

from __future__ import annotations

import pytest
from lock_races import PausingDict, Race, WatchedLock, run_racers

from transfer.status import RoomTable, TransferPoll


P = TransferPoll


def _raced(monkeypatch, race: Race, room: int, *statuses: TransferPoll) -> RoomTable:
    """A table holding `room` (moved through `statuses`), whose lock and status dict let `race` pause its racers."""
    table = RoomTable()
    table.start(room)
    for status in statuses:
        table.update(room, status)
    monkeypatch.setattr(table, "_lock", WatchedLock(table._lock, race))
    monkeypatch.setattr(table, "_status", PausingDict(table._status, race))
    return table


@pytest.mark.parametrize("status", [P.Success, P.Failed])
def test_room_table_two_threads_concluding_one_room_only_one_concludes_it(monkeypatch, status):
    """conclude() is True only for the call that concluded the room. Each thread, once it read
    the room's status, waits there until the other is inside too (no lock: both saw the room
    open, and both are told they concluded it) or blocked on the table's lock."""
    for room in range(5):
        race = Race()
        table = _raced(monkeypatch, race, room)
        concluded = run_racers(race, {name: lambda: table.conclude(room, status) for name in ("one", "other")})
        assert race.inside() == {"one", "other"}  # both got to the check
        assert sorted(concluded.values()) == [False, True], concluded
        assert table.get(room) is status
        assert table.take_concluded() == [room]


def test_room_table_a_failure_racing_a_success_leaves_the_room_failed(monkeypatch):
    """Failed overrides any state (SPEC.md section 3), whichever update comes last. The Success
    thread, once it read the room's status, waits there until the Failed one is done (no lock:
    its write, from the status it read before, overwrites Failed) or blocked on the table's lock."""
    for room in range(5):
        race = Race(patient=["success"])
        table = _raced(monkeypatch, race, room, P.Transferring)
        now = run_racers(race, {"failure": lambda: table.update(room, P.Failed, "the write failed"),
                                "success": lambda: table.update(room, P.Success)})
        assert race.inside() == {"failure", "success"}  # both got to the check
        assert now["failure"] is P.Failed, now
        assert table.get(room) is P.Failed
        assert table.reason(room) == "the write failed"
        assert table.take_concluded() == [room]


@pytest.mark.parametrize("status", [P.Success, P.Failed])
def test_room_table_succeed_racing_a_conclude_of_the_same_room_only_one_concludes_it(monkeypatch, status):
    """succeed() (the lanes' Successes of one read, concluded together) and conclude() (close() failing the room
    without the driver's lock, or another Success) on one room: only one concludes it, and its status stays."""
    for room in range(5):
        race = Race()
        table = _raced(monkeypatch, race, room)
        done = run_racers(race, {"succeed": lambda: table.succeed([room]),
                                 "conclude": lambda: table.conclude(room, status)})
        assert race.inside() == {"succeed", "conclude"}  # both got to the check
        succeeded = done["succeed"] == []  # it left no room unconcluded
        assert succeeded != done["conclude"], done
        assert table.get(room) is (P.Success if succeeded else status)
        assert table.take_concluded() == [room]

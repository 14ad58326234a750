"""TransferPoll values, the monotone FSM with sticky Failed, and the room table (SPEC.md 3, 7)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transfer.core.failure import Failure, FailureKind
from transfer.status import RoomTable, TransferPoll, advance, is_terminal


P = TransferPoll


def test_wire_values():
    assert {p.name: int(p) for p in P} == {
        "Failed": 0, "Bootstrapping": 1, "Bootstrapped": 2, "WaitingForInput": 3, "Transferring": 4, "Success": 5}
    assert P(5) is P.Success


@pytest.mark.parametrize(
    "old, new, expected",
    [
        (None, P.Bootstrapping, P.Bootstrapping),
        (None, P.Failed, P.Failed),
        (P.Bootstrapping, P.Transferring, P.Transferring),
        (P.Transferring, P.Bootstrapped, P.Transferring),  # never moves down
        (P.Success, P.Bootstrapping, P.Success),
        (P.Success, P.Failed, P.Failed),  # Failed overrides even Success
        (P.Failed, P.Success, P.Failed),  # and nothing resurrects it
        (P.Failed, P.Bootstrapping, P.Failed),
        (P.WaitingForInput, P.WaitingForInput, P.WaitingForInput),
        (P.Bootstrapped, 5, P.Success),  # plain wire integers are accepted
    ],
)
def test_advance_table(old, new, expected):
    result = advance(old, new)
    assert result is expected


@given(st.lists(st.sampled_from(list(P)), min_size=1, max_size=30))
def test_advance_sequence_is_max_unless_failed(seq):
    state = None
    for status in seq:
        state = advance(state, status)
    assert state is (P.Failed if P.Failed in seq else max(seq))


def test_is_terminal():
    assert [p for p in P if is_terminal(p)] == [P.Failed, P.Success]
    assert not is_terminal(None)
    assert is_terminal(0) and is_terminal(5) and not is_terminal(4)


def test_room_table_monotone():
    table = RoomTable()
    assert table.start(1) is P.Bootstrapping
    assert table.update(1, P.Transferring) is P.Transferring
    assert table.update(1, P.Bootstrapped) is P.Transferring
    assert table.get(1) is P.Transferring
    assert table.update(1, P.Success) is P.Success
    assert table.update(1, P.WaitingForInput) is P.Success
    assert table.reason(1) is None


def test_room_table_failed_is_sticky_and_first_reason_wins():
    table = RoomTable()
    table.start(3, P.WaitingForInput)
    assert table.fail(3, "encode failed to send embedding") is P.Failed
    assert table.fail(3, "a later consequence") is P.Failed
    assert table.update(3, P.Success) is P.Failed
    assert table.update(3, P.Failed, "yet another") is P.Failed
    assert table.get(3) is P.Failed
    assert table.reason(3) == "encode failed to send embedding"
    # start on a known room only advances it: it does not reset a failure.
    assert table.start(3) is P.Failed


def test_room_table_failed_without_reason_then_reason():
    table = RoomTable()
    table.start(4)
    assert table.update(4, P.Failed) is P.Failed
    assert table.reason(4) is None
    table.fail(4, "deadline passed waiting for encode rank 0")
    assert table.reason(4) == "deadline passed waiting for encode rank 0"


def test_room_table_reason_ignored_unless_failed():
    table = RoomTable()
    table.start(5)
    table.update(5, P.Transferring, "not a failure")
    assert table.reason(5) is None


def test_room_table_ignores_unknown_rooms():
    table = RoomTable()
    assert table.update(9, P.Success) is None
    assert table.fail(9, "stale") is None
    assert table.get(9) is None and table.reason(9) is None
    assert 9 not in table and len(table) == 0


def test_room_table_clear_forgets():
    table = RoomTable()
    table.start(1)
    table.start(2)
    table.fail(2, "boom")
    assert table.rooms() == [1, 2] and len(table) == 2 and 2 in table
    table.clear(2)
    assert table.get(2) is None and table.reason(2) is None and 2 not in table
    assert table.rooms() == [1] and len(table) == 1
    table.clear(2)  # no-op
    # A cleared room id can be used again from scratch.
    assert table.start(2) is P.Bootstrapping
    assert table.reason(2) is None
    assert table.update(2, P.Success) is P.Success


def test_room_table_rooms_sorted():
    table = RoomTable()
    for room in (30, 1, 7):
        table.start(room)
    assert table.rooms() == [1, 7, 30]
    assert "3 rooms" in repr(table)


def test_room_table_overturns_a_success_to_failed_once_and_reports_it_again():
    table = RoomTable()
    table.start(1)
    table.conclude(1, TransferPoll.Success)
    assert table.take_concluded() == [1]
    failure = Failure(FailureKind.PEER_FAILED, "told Failed after its Success")
    assert table.overturn(1, failure) and table.get(1) is TransferPoll.Failed and table.failure(1) == failure
    assert table.take_concluded() == [1]
    assert not table.overturn(1, failure) and not table.overturn(2, failure)
    table.start(3)
    assert not table.overturn(3, failure) and table.get(3) is not TransferPoll.Failed, "only a Success is overturned"


class _ModelTable:
    """RoomTable's rules spelled with advance() and is_terminal() on a plain dict, for the table to match."""

    def __init__(self) -> None:
        self.status: dict[int, TransferPoll] = {}
        self.reason: dict[int, Failure] = {}
        self.concluded: dict[int, None] = {}

    def start(self, room, status):
        self.status[room] = now = advance(self.status.get(room), status)
        return now

    def update(self, room, status, reason):
        if isinstance(reason, str):
            reason = Failure(FailureKind.OTHER, reason)
        old = self.status.get(room)
        if old is None:
            return None
        self.status[room] = now = advance(old, status)
        if is_terminal(now) and not is_terminal(old):
            self.concluded[room] = None
        if now is P.Failed and reason is not None and room not in self.reason:
            self.reason[room] = reason
        return now

    def conclude(self, room, status, failure):
        old = self.status.get(room)
        if old is None or is_terminal(old):
            return False
        self.status[room] = now = advance(old, status)
        if is_terminal(now):
            self.concluded[room] = None
            if now is P.Failed:
                self.reason[room] = failure or Failure(FailureKind.OTHER, "failed")
        return is_terminal(now)

    def clear(self, room):
        status = self.status.get(room)
        for held in (self.status, self.reason, self.concluded):
            held.pop(room, None)
        return status

    def take_concluded(self):
        rooms, self.concluded = list(self.concluded), {}
        return rooms


_STATUSES = st.one_of(st.sampled_from(list(P)), st.integers(0, 5))
_TABLE_OPS = st.lists(st.one_of(
    st.tuples(st.just("start"), st.integers(0, 3), _STATUSES),
    st.tuples(st.just("update"), st.integers(0, 3), _STATUSES, st.sampled_from([None, "why", "other"])),
    st.tuples(st.just("conclude"), st.integers(0, 3), _STATUSES,
              st.sampled_from([None, Failure(FailureKind.DEADLINE, "late")])),
    st.tuples(st.just("clear"), st.integers(0, 3)),
    st.tuples(st.just("take"),),
), max_size=40)


@given(_TABLE_OPS)
def test_room_table_fast_paths_match_advance_and_is_terminal(ops):
    """start(), update() and conclude() compare members by identity instead of calling advance() and
    is_terminal() where they can: every answer, status, reason and conclusion is the same. clear() answers
    the status get() gave just before it."""
    table, model = RoomTable(), _ModelTable()
    for op in ops:
        kind, args = op[0], op[1:]
        if kind == "take":
            assert table.take_concluded() == model.take_concluded()
            continue
        got, want = getattr(table, kind)(*args), getattr(model, kind)(*args)
        assert got == want and type(got) is type(want)
        for room in range(4):
            assert table.get(room) is model.status.get(room)
            assert table.failure(room) == model.reason.get(room)
    assert table.take_concluded() == model.take_concluded()


@given(st.dictionaries(st.integers(0, 5), st.sampled_from(list(P)), max_size=6),
       st.lists(st.integers(0, 7), max_size=8))
def test_succeed_concludes_each_room_as_conclude_success_does_in_turn(statuses, rooms):
    """succeed() is conclude(room, Success) of each room in turn, under one hold of the lock: unknown rooms,
    terminal ones and a room named twice included; the same rooms left unconcluded, statuses, reasons and order."""
    together, one_by_one = RoomTable(), RoomTable()
    for table in (together, one_by_one):
        for room, status in statuses.items():
            table.start(room, status)
        table.take_concluded()
    left = [room for room in rooms if not one_by_one.conclude(room, P.Success)]
    assert together.succeed(rooms) == left
    for room in range(8):
        assert (together.get(room), together.failure(room)) == (one_by_one.get(room), one_by_one.failure(room))
    assert together.take_concluded() == one_by_one.take_concluded()

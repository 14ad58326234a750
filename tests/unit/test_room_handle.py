"""A room handle's reads (poll, failure, failure_kind, a receive handle's wait) once its room is cleared and its
number reused."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transfer import config
from transfer._io import Conclusions, RoomHandle
from transfer.core.failure import Failure, FailureKind
from transfer.receiver import ReceiveHandle
from transfer.status import RoomTable, TransferPoll


@dataclass
class State:
    room: int
    started_at: float = 0.0
    concluded_at: float | None = None


class ReusingTable(RoomTable):
    """A room table in which room 7 is cleared and taken by a new room during the next read: the new
    room succeeds, or with `failing`, fails."""

    def __init__(self, held: dict[int, State]) -> None:
        super().__init__()
        self.held = held
        self.armed = False
        self.failing = False

    def _reuse(self, room: int) -> None:
        if self.armed:
            self.armed = False
            self.clear(room)
            self.held[room] = State(room)
            self.start(room)
            if self.failing:
                self.fail(room, Failure(FailureKind.DEADLINE, "the new room's deadline"))
            else:
                self.update(room, TransferPoll.Success)

    def get(self, room: int) -> TransferPoll | None:
        self._reuse(room)
        return super().get(room)

    def reason(self, room: int) -> str | None:
        self._reuse(room)
        return super().reason(room)

    def failure(self, room: int) -> Failure | None:
        self._reuse(room)
        return super().failure(room)


def _handle() -> tuple[RoomHandle, ReusingTable]:
    held: dict[int, State] = {}
    table = ReusingTable(held)
    held[7] = State(7)
    table.start(7, TransferPoll.Transferring)
    return RoomHandle(table, held[7], Conclusions(), held.get), table


def test_a_poll_that_a_reuse_of_the_room_number_overtakes_reports_the_room_cleared():
    handle, table = _handle()
    table.armed = True
    assert handle.poll() is TransferPoll.Failed
    assert table.get(7) is TransferPoll.Success  # the new room's, not this handle's


@pytest.mark.parametrize("read", [lambda handle: handle.failure, lambda handle: handle.failure_kind],
                         ids=["failure", "failure_kind"])
def test_a_failure_read_that_a_reuse_of_the_room_number_overtakes_reports_none(read):
    handle, table = _handle()
    table.armed = table.failing = True
    assert read(handle) is None
    assert table.failure(7) == Failure(FailureKind.DEADLINE, "the new room's deadline")  # the new room's


def test_a_read_of_a_room_still_held_reports_it():
    handle, table = _handle()
    assert handle.poll() is TransferPoll.Transferring
    table.fail(7, Failure(FailureKind.CHECKSUM, "checksum mismatch"))
    assert handle.poll() is TransferPoll.Failed
    assert handle.failure == "checksum mismatch" and handle.failure_kind is FailureKind.CHECKSUM


class StrictHandle(RoomHandle):
    """RoomHandle.wait() as it reads without its shortcut for a concluded room: every held room waits."""

    def wait(self, timeout: float) -> TransferPoll:
        timeout = config.check_seconds("timeout", timeout, zero_ok=True)
        if self._current():
            self._conclusions.wait(self._state, timeout)
        return self.poll()


@given(status=st.sampled_from(TransferPoll), concluded=st.booleans(), held=st.booleans(), cleared=st.booleans())
def test_a_wait_on_a_concluded_room_answers_as_a_wait_through_the_conclusions_would(status, concluded, held, cleared):
    answers = []
    for kind in (StrictHandle, RoomHandle):
        rooms: dict[int, State] = {}
        table = RoomTable()
        state = rooms[7] = State(7, concluded_at=2.0 if concluded else None)
        table.start(7, status)
        handle = kind(table, state, Conclusions(), rooms.get)
        if cleared:
            table.clear(7)
        if not held:
            rooms[7] = State(7)  # the number reused by another room
        answers.append(handle.wait(0))
    assert answers[0] is answers[1]


class _Driver:
    """What a ReceiveHandle reads of its manager's driver; wait() returns at once, as for a concluded room."""

    def __init__(self, table: RoomTable, rooms: dict) -> None:
        self.table, self.rooms, self.conclusions = table, rooms, Conclusions()
        self.waits = 0

    def wait(self, record: object, timeout: float) -> None:
        self.waits += 1


@given(status=st.sampled_from(TransferPoll), held=st.booleans(), cleared=st.booleans(), reused=st.booleans(),
       failing=st.booleans())
def test_a_receive_handles_wait_answers_as_a_poll_after_the_wait_would(status, held, cleared, reused, failing):
    """ReceiveHandle.wait() reads the room's status with one look at whether it is held, after the read: the
    answer poll() gives (Failed once the room is cleared, or its number reused, before or during the read)."""
    answers, waits = [], []
    for kind in ("receive", "poll"):
        rooms: dict[int, State] = {}
        table = ReusingTable(rooms)
        state = rooms[7] = State(7)
        table.start(7, status)
        driver = _Driver(table, rooms)
        handle = ReceiveHandle(SimpleNamespace(_driver=driver), state)  # type: ignore[arg-type]
        if cleared:
            table.clear(7)
        if not held:
            rooms[7] = State(7)  # the number reused by another room
        table.armed, table.failing = reused, failing
        if kind == "receive":
            answers.append(handle.wait(0))
        else:
            if handle._current():
                driver.wait(state, 0)
            answers.append(RoomHandle.poll(handle))
        waits.append(driver.waits)
        handle._manager = SimpleNamespace(_closed=True)  # its finalizer warns of no clear() otherwise
    assert answers[0] is answers[1] and waits[0] == waits[1]

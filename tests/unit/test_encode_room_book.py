"""The encode side's room book: one conclusion per send of a room, counted and logged by failure kind."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transfer import _io
from transfer._io import RoomHandle
from transfer.core.failure import Failure, FailureKind
from transfer.drive.encode import RoomBook, RoomState
from transfer.metrics import Metrics, total
from transfer.status import TransferPoll


def _book_with(*rooms: int) -> tuple[RoomBook, list[RoomState]]:
    book = RoomBook(Metrics("test"))
    states = []
    for room in rooms:
        state = RoomState(room, started_at=1.0)
        book.held[room] = state
        book.table.start(room, TransferPoll.WaitingForInput)
        states.append(state)
    return book, states


def _failed(book: RoomBook) -> dict:
    return {row["labels"]["reason"]: row["value"] for row in book.metrics.snapshot()
            if row["name"] == "test_rooms_failed_total"}


def test_a_room_concludes_once_and_counts_under_its_kind():
    book, (state,) = _book_with(1)
    failure = Failure(FailureKind.FANOUT_TIMEOUT, "receiver never registered within 120s")
    assert book.conclude(state, TransferPoll.Failed, failure, at=3.0)
    assert not book.conclude(state, TransferPoll.Failed, Failure(FailureKind.CLEARED, "cleared"), at=4.0)
    assert not book.conclude(state, TransferPoll.Success, None, at=4.0)
    assert _failed(book) == {"fanout_timeout": 1}
    assert book.table.failure(1) == failure and book.table.reason(1) == "receiver never registered within 120s"
    assert state.concluded_at == 3.0 and book.table.take_concluded() == [1]


def test_a_success_observes_the_rooms_latency():
    book, (state,) = _book_with(1)
    assert book.conclude(state, TransferPoll.Success, None, at=1.25)
    snapshot = book.metrics.snapshot()
    assert total(snapshot, "test_rooms_succeeded_total") == 1
    assert total(snapshot, "test_room_latency_seconds_sum") == 0.25


def test_an_older_send_of_the_room_concludes_nothing_of_the_room_sent_again():
    book, (state,) = _book_with(1)
    stale = RoomState(1, started_at=0.0)
    assert not book.conclude(stale, TransferPoll.Failed, Failure(FailureKind.WRITE, "late"), at=2.0)
    book.progress(stale, TransferPoll.Transferring, 0.5, 1.5)
    assert book.table.get(1) is TransferPoll.WaitingForInput and stale.concluded_at is None
    assert stale.writing_at is None
    book.progress(state, TransferPoll.Transferring, 0.5, 1.5)
    assert book.table.get(1) is TransferPoll.Transferring


def test_a_rooms_stages_are_seconds_from_its_send_in_order():
    book, (state,) = _book_with(1)
    handle = RoomHandle(book.table, state, book.conclusions, book.held.get)
    assert handle.stages == {} and handle.started_at == 1.0
    book.progress(state, TransferPoll.Transferring, 0.75, 1.5)  # asked before the item was sent
    assert handle.stages == {"asked": -0.25, "writing": 0.5}
    state.submitted_at = 1.75  # stamped by the driver as the engine's submission call returns
    book.conclude(state, TransferPoll.Success, None, at=2.25)
    assert list(handle.stages.items()) == [("asked", -0.25), ("writing", 0.5), ("submitted", 0.75),
                                           ("concluded", 1.25)]


def test_parked_counts_rooms_still_waiting_for_their_receivers():
    book, states = _book_with(1, 2, 3)
    book.progress(states[0], TransferPoll.Transferring, 1.0, 1.0)
    book.conclude(states[1], TransferPoll.Failed, Failure(FailureKind.GEOMETRY, "hidden"), at=2.0)
    assert book.parked() == 1


def test_fail_open_fails_every_open_room_and_leaves_concluded_ones(caplog):
    book, states = _book_with(1, 2, 3)
    book.conclude(states[0], TransferPoll.Success, None, at=2.0)
    with caplog.at_level(logging.WARNING, logger="transfer.sender"):
        book.fail_open(Failure(FailureKind.CLOSED, "sender pool closed"), at=3.0)
    assert [book.table.get(r) for r in (1, 2, 3)] == [TransferPoll.Success, TransferPoll.Failed, TransferPoll.Failed]
    assert _failed(book) == {"closed": 2}
    # The failure log is throttled by kind: two rooms closed at once, one line.
    assert len([m for m in caplog.messages if "failed: sender pool closed" in m]) == 1


def test_fail_open_past_its_wait_for_a_lock_someone_holds_fails_the_open_rooms_through_the_table():
    """The lock held (a send() stuck inside the caller's metrics holds it): the rooms still fail, once each,
    counted, and their waiters are told."""
    book, states = _book_with(1, 2, 3)
    book.conclude(states[0], TransferPoll.Success, None, at=2.0)
    book.conclusions = notified = _Notified()  # type: ignore[assignment]
    with book.lock:  # as the stuck send holds it
        book.fail_open(Failure(FailureKind.CLOSED, "sender pool closed"), at=3.0, wait=0.0)
    assert [book.table.get(r) for r in (1, 2, 3)] == [TransferPoll.Success, TransferPoll.Failed, TransferPoll.Failed]
    assert [state.concluded_at for state in states] == [2.0, 3.0, 3.0]
    assert _failed(book) == {"closed": 2}
    assert notified.times == 2
    book.fail_open(Failure(FailureKind.CLOSED, "sender pool closed"), at=4.0)
    assert _failed(book) == {"closed": 2}, "a room failed without the lock was failed again"


def test_a_failure_that_names_its_room_is_logged_with_the_room_once(caplog):
    # validate_fanout's reasons start with the room: the log names it once, never "room 0 failed: room 0: ...".
    book, (state,) = _book_with(0)
    failure = Failure(FailureKind.GEOMETRY, "room 0: receiver 127.0.0.1:15018 hidden 32 != item hidden 64")
    with caplog.at_level(logging.WARNING, logger="transfer.sender"):
        assert book.conclude(state, TransferPoll.Failed, failure, at=2.0)
    assert caplog.messages == ["room 0 failed: receiver 127.0.0.1:15018 hidden 32 != item hidden 64"]
    assert book.table.reason(0) == failure.detail  # callers and peers get the reason whole


class _RefusingMetrics(Metrics):
    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        raise RuntimeError("exporter down")


class _Notified:
    def __init__(self) -> None:
        self.times = 0

    def notify(self) -> None:
        self.times += 1


def test_a_conclusion_whose_count_raises_still_wakes_the_waiters():
    book = RoomBook(_RefusingMetrics("test"))
    state = RoomState(1, started_at=1.0)
    book.held[1] = state
    book.table.start(1, TransferPoll.WaitingForInput)
    book.conclusions = notified = _Notified()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="exporter down"):
        book.conclude(state, TransferPoll.Failed, Failure(FailureKind.CLEARED, "cleared"), at=2.0)
    assert notified.times == 1 and state.concluded_at == 2.0 and book.table.get(1) is TransferPoll.Failed


class _StrictBook(RoomBook):
    """RoomBook.conclude() as it reads without its shortcut for a send concluded already."""

    def conclude(self, state: RoomState, status: TransferPoll, failure: Failure | None, at: float) -> bool:
        with self.lock:
            if self.held.get(state.room) is not state or not self.table.conclude(state.room, status, failure):
                return False
            state.concluded_at = at
        try:
            _io.count_concluded(self.metrics, self.failures, state.room, status is TransferPoll.Success, failure,
                                at - state.started_at)
        finally:
            self.conclusions.notify()
        return True


_STEPS = st.lists(st.one_of(
    st.tuples(st.just("conclude"), st.integers(0, 2), st.sampled_from([TransferPoll.Success, TransferPoll.Failed,
                                                                         TransferPoll.Transferring])),
    st.tuples(st.just("progress"), st.integers(0, 2), st.just(TransferPoll.Transferring)),
    st.tuples(st.just("clear"), st.integers(0, 2), st.none()),
    st.tuples(st.just("send"), st.integers(0, 2), st.none())), max_size=12)


@given(steps=_STEPS)
def test_a_conclusion_of_a_send_concluded_already_answers_as_the_book_would(steps):
    """The book's shortcut for a send that concluded (a clear() of a served room) against the full rule, over
    sends, progress, conclusions and clears of a few rooms, an older send of a room concluded again too."""
    outcomes = []
    for kind in (_StrictBook, RoomBook):
        book = kind(Metrics("test"))
        sends: list[RoomState] = []
        answers = []
        for at, (step, pick, status) in enumerate(steps):
            if step == "send" or not sends:
                state = RoomState(pick, started_at=float(at))
                book.held[pick] = state
                book.table.clear(pick)
                book.table.start(pick, TransferPoll.WaitingForInput)
                sends.append(state)
                continue
            state = sends[pick % len(sends)]
            if step == "conclude":
                failure = None if status is TransferPoll.Success else Failure(FailureKind.CLEARED, f"step {at}")
                answers.append(book.conclude(state, status, failure, at=float(at)))
            elif step == "progress":
                book.progress(state, status, asked_at=float(at), at=float(at))
            elif book.held.get(state.room) is state:
                del book.held[state.room]
                book.table.clear(state.room)
        rows = sorted((row["name"], sorted(row["labels"].items()), row["value"]) for row in book.metrics.snapshot())
        outcomes.append((answers, [s.concluded_at for s in sends], {room: (book.table.get(room), book.table.failure(room))
                         for room in range(3)}, book.table.take_concluded(), rows))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("wait", [-1, 0.0], ids=["lock_free", "lock_held"])
def test_fail_open_whose_counts_raise_still_fails_every_open_room_and_wakes_the_waiters(wait):
    """The caller's metrics refuse every count (an exporter that is down): each open room still concludes
    Failed and its waiters are told, whether the lock is free or a stuck send() holds it; the count's error
    is raised after."""
    book, states = _book_with(1, 2, 3)
    book.metrics = _RefusingMetrics("test")
    book.conclusions = notified = _Notified()  # type: ignore[assignment]
    held = book.lock.acquire() if wait == 0.0 else False
    try:
        with pytest.raises(RuntimeError, match="exporter down"):
            book.fail_open(Failure(FailureKind.CLOSED, "sender pool closed"), at=3.0, wait=wait)
    finally:
        if held:
            book.lock.release()
    assert [book.table.get(r) for r in (1, 2, 3)] == [TransferPoll.Failed] * 3
    assert [state.concluded_at for state in states] == [3.0] * 3
    assert notified.times == 3

"""transfer.core.cancels: the prefill side's cancels awaiting answers, the ghosts set aside, and each encode
address's answering and silence clock."""

from __future__ import annotations

import pytest

import transfer.core.cancels as cancels
from transfer.core.cancels import CANCEL_SILENCE_S, STALE_CANCEL_S, CancelBook
from transfer.frames import CancelAnswer

CONFIRMED, TOO_LATE, WRITE_FAILED = CancelAnswer.CONFIRMED, CancelAnswer.TOO_LATE, CancelAnswer.WRITE_FAILED
A, B = ("10.0.0.1", 17000), ("10.0.0.2", 17000)


@pytest.fixture
def conns() -> dict:
    return {A: 1, B: 1}


@pytest.fixture
def book(conns) -> CancelBook:
    return CancelBook(conns.get)


def test_a_keys_cancels_are_answered_in_the_order_sent_each_too_late_then_last(book):
    book.add(0.0, (7, 0), token=1, addr=A, conn=1)
    book.add(0.1, (7, 0), token=2, addr=A, conn=1)
    assert book.pending == 2
    assert book.answered((7, 0), TOO_LATE).token == 1
    assert book.answered((7, 0), TOO_LATE).token == 2
    assert book.answered((7, 0), TOO_LATE) is None  # both heard already
    assert book.answered((7, 0), CONFIRMED).token == 1
    assert book.answered((7, 0), WRITE_FAILED).token == 2
    assert book.pending == 0 and not book.holds((7, 0))
    assert book.answered((7, 0), CONFIRMED) is None


def test_keys_are_apart(book):
    book.add(0.0, (7, 0), token=1, addr=A, conn=1)
    book.add(0.0, (7, 1), token=2, addr=B, conn=1)
    book.add(0.0, (8, 0), token=3, addr=A, conn=1)
    assert book.answered((7, 1), CONFIRMED).token == 2
    assert book.answered((8, 0), CONFIRMED).token == 3
    assert book.holds((7, 0)) and not book.holds((7, 1)) and book.pending == 1


def test_the_silence_clock_runs_from_the_first_unanswered_cancel_until_an_answer(book):
    book.add(1.0, (7, 0), token=1, addr=A, conn=1)
    book.add(3.0, (8, 0), token=2, addr=A, conn=1)
    assert not book.silent(A, 1.0 + CANCEL_SILENCE_S - 0.001)
    assert book.silent(A, 1.0 + CANCEL_SILENCE_S)
    assert not book.silent(B, 100.0)
    book.answered((8, 0), TOO_LATE)
    assert not book.silent(A, 100.0) and book.answers(A)
    book.add(50.0, (9, 0), token=3, addr=A, conn=1)
    assert not book.silent(A, 100.0), "a rank seen to answer cancels is never taken for silent"


def test_a_cancel_the_socket_did_not_take_restarts_the_clock_from_the_next_one_sent_on_the_connection(book, conns):
    book.add(1.0, (7, 0), token=1, addr=A, conn=1)
    book.add(2.0, (8, 0), token=2, addr=A, conn=1)
    assert book.unsent((7, 0), token=1).token == 1
    assert book.unsent((7, 0), token=1) is None
    assert not book.silent(A, 2.0 + CANCEL_SILENCE_S - 0.001) and book.silent(A, 2.0 + CANCEL_SILENCE_S)
    conns[A] = 2  # the second went on a connection since lost: it says nothing of the fresh one
    book.add(9.0, (9, 0), token=3, addr=A, conn=2)
    book.unsent((9, 0), token=3)
    assert not book.silent(A, 100.0)


def test_a_cancel_the_socket_did_not_take_is_the_one_of_its_token_never_an_earlier_one_of_the_key(book):
    """Two asks of room 7 cancelled in turn: the socket refusing the second cancel must drop that one only, or
    the first (which the rank did read) would lose its answer and the room's memory be taken for safe or lost."""
    book.add(0.0, (7, 0), token=1, addr=A, conn=1)
    book.add(0.1, (7, 0), token=2, addr=A, conn=1)
    assert book.unsent((7, 0), token=2).token == 2
    assert book.pending == 1 and book.answered((7, 0), CONFIRMED).token == 1
    book.add(0.2, (8, 0), token=3, addr=A, conn=1)
    book.answered((8, 0), TOO_LATE)
    assert book.unsent((8, 0), token=3) is None, "heard already: it was taken"


def test_forgetting_a_connection_stops_its_clock_and_with_answering_what_it_showed(book):
    book.add(0.0, (7, 0), token=1, addr=A, conn=1)
    book.add(0.0, (8, 0), token=2, addr=A, conn=1)
    book.answered((8, 0), CONFIRMED)
    book.add(1.0, (9, 0), token=3, addr=A, conn=1)
    book.forget(A)
    assert book.answers(A) and not book.silent(A, 100.0)
    book.forget(A, answering=True)
    assert not book.answers(A)


def test_cancels_elsewhere_make_a_key_a_stranger_to_another_address_or_connection(book):
    assert not book.stranger((7, 0), A, 1)
    book.add(0.0, (7, 0), token=1, addr=A, conn=1)
    assert not book.stranger((7, 0), A, 1)
    assert book.stranger((7, 0), B, 1) and book.stranger((7, 0), A, 2)


def test_unanswered_is_the_newest_cancel_on_that_connection_not_heard_yet(book):
    book.add(0.0, (7, 0), token=1, addr=A, conn=1)
    book.add(0.1, (7, 0), token=2, addr=A, conn=2)
    assert book.unanswered((7, 0), 1).token == 1 and book.unanswered((7, 0), 2).token == 2
    book.answered((7, 0), TOO_LATE)
    assert book.unanswered((7, 0), 1) is None and book.unanswered((7, 0), 3) is None


def test_cancels_awaited_at_an_address_count_only_recent_unanswered_ones_on_its_current_connection(book, conns):
    book.add(0.0, (7, 0), token=1, addr=A, conn=1)
    book.add(0.0, (7, 1), token=2, addr=B, conn=1)
    assert book.awaited_at(A, 1.0) and book.awaited_addresses(1.0) == {A, B}
    book.answered((7, 1), TOO_LATE)
    assert not book.awaited_at(B, 1.0) and book.awaited_addresses(1.0) == {A}
    assert book.awaited_addresses(CANCEL_SILENCE_S) == set()
    conns[A] = 2
    assert not book.awaited_at(A, 1.0)


def test_stale_cancels_on_a_lost_connection_become_ghosts_that_take_their_late_answers(book, conns):
    book.add(0.0, (7, 0), token=1, addr=A, conn=1)
    book.add(0.0, (8, 0), token=2, addr=B, conn=1)
    conns[A] = 2  # A's connection was lost; B's is still in use
    released: list = []
    assert book.set_aside_stale(STALE_CANCEL_S - 0.001, None, lambda key: released.append(key) or []) == []
    assert book.set_aside_stale(STALE_CANCEL_S, None, lambda key: released.append(key) or ["go"]) == ["go"]
    assert released == [(7, 0)] and book.ghost((7, 0)) and book.holds((7, 0)) and book.pending == 1
    assert book.answered((7, 0), TOO_LATE) is None and book.ghost((7, 0))
    assert book.answered((7, 0), CONFIRMED) is None and not book.holds((7, 0))
    assert not book.ghost((8, 0)) and book.holds((8, 0)), "looked at again later: its connection is in use"


def test_stale_cancels_are_set_aside_at_most_limit_a_call(book, conns):
    for room in range(5):
        book.add(0.0, (room, 0), token=room + 1, addr=A, conn=1)
    conns[A] = 2
    released: list = []
    book.set_aside_stale(STALE_CANCEL_S, 2, lambda key: released.append(key) or [])
    assert released == [(0, 0), (1, 0)] and book.pending == 3


def test_past_the_pending_bound_the_oldest_key_is_named_for_setting_aside(book, monkeypatch):
    monkeypatch.setattr(cancels, "MAX_PENDING_CANCELS", 2)
    assert book.add(0.0, (7, 0), token=1, addr=A, conn=1) is None
    assert book.add(0.0, (8, 0), token=2, addr=A, conn=1) is None
    assert book.add(0.0, (9, 0), token=3, addr=A, conn=1) == (7, 0)
    book.set_aside((7, 0))
    assert book.pending == 2 and book.ghost((7, 0))


def test_past_the_ghost_bound_no_cancel_may_be_sent(book, monkeypatch):
    monkeypatch.setattr(cancels, "MAX_GHOSTS", 2)
    for room in (7, 8):
        book.add(0.0, (room, 0), token=room, addr=A, conn=1)
        assert book.full() is None
        book.set_aside((room, 0))
    assert book.full() == "2 cancels set aside still await answers (at most 2)"
    book.answered((7, 0), CONFIRMED)
    assert book.full() is None


def test_past_its_bound_the_book_forgets_the_address_heard_from_longest_ago_and_keeps_learning(monkeypatch):
    monkeypatch.setattr(cancels, "MAX_ANSWERING", 3)
    addrs = [("10.0.1.%d" % i, 17000) for i in range(5)]
    conns = dict.fromkeys(addrs, 1)
    book = CancelBook(conns.get)

    def heard(room: int, addr: tuple[str, int]) -> None:
        book.add(float(room), (room, 0), token=room, addr=addr, conn=1)
        assert book.answered((room, 0), CONFIRMED).token == room

    for room, addr in enumerate(addrs[:3]):
        heard(room, addr)
    heard(3, addrs[0])  # heard again: the most recent now, addrs[1] the oldest
    heard(4, addrs[3])
    assert [book.answers(addr) for addr in addrs] == [True, False, True, True, False]
    heard(5, addrs[4])
    assert [book.answers(addr) for addr in addrs] == [True, False, False, True, True]


def test_answered_cancels_are_let_go_of_so_the_book_keeps_about_twice_those_awaited(book, conns):
    for room in range(10_000):
        book.add(room * 1e-3, (room, 0), token=room + 1, addr=A, conn=1)
        if room % 10:  # nine in ten answered at once
            assert book.answered((room, 0), CONFIRMED).token == room + 1
    assert book.pending == 1000
    assert book.kept <= 2 * book.pending + 64, "answered cancels kept for STALE_CANCEL_S grow with those sent"
    conns[A] = 2  # the connection was lost: those still awaited go stale and are set aside, oldest first
    released: list = []
    book.set_aside_stale(10.0 + STALE_CANCEL_S, None, lambda key: released.append(key) or [])
    assert released == [(room, 0) for room in range(0, 10_000, 10)] and book.pending == 0


def test_a_key_set_aside_with_two_cancels_stays_a_ghost_until_both_last_answers_came(book):
    """A room asked twice of one encode rank may have two cancels out when its key is set aside: the first last
    answer is the earlier ask's, and the later ask may still write into the room's memory, so the key must hold
    (its memory not safe) until the second last answer too."""
    book.add(0.0, (7, 0), token=1, addr=A, conn=1)
    book.add(0.1, (7, 0), token=2, addr=A, conn=1)
    book.set_aside((7, 0))
    assert book.ghost((7, 0)) and book.pending == 0
    assert book.answered((7, 0), TOO_LATE) is None and book.ghost((7, 0)), "a TOO_LATE is no last answer"
    assert book.answered((7, 0), CONFIRMED) is None
    assert book.ghost((7, 0)) and book.holds((7, 0)), "one last answer of two still to come"
    assert book.answered((7, 0), WRITE_FAILED) is None
    assert not book.ghost((7, 0)) and not book.holds((7, 0))

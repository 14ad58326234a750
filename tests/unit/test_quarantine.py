"""The quarantine rule: what becomes of a let-go room's memory, when it is safe to reuse, and the book of
rooms awaiting their cancel's confirmation."""

from __future__ import annotations

import itertools

import pytest

from transfer.core.quarantine import AwaitingConfirmation, Fate, fate_of, reusable

FREE, FREE_AFTER_COPY, QUARANTINE, UNTIL_CONFIRMED = (Fate.FREE, Fate.FREE_AFTER_COPY, Fate.QUARANTINE,
                                                      Fate.QUARANTINE_UNTIL_CONFIRMED)


@pytest.mark.parametrize("confirmable", [True, False])
def test_a_room_that_succeeded_is_freed_at_once_or_after_its_copy_out(confirmable):
    assert fate_of(succeeded=True, memory_safe=False, confirmable=confirmable) is FREE
    assert fate_of(succeeded=True, memory_safe=False, confirmable=confirmable, copy_out=True) is FREE_AFTER_COPY


@pytest.mark.parametrize("confirmable", [True, False])
def test_a_room_whose_memory_is_known_safe_is_freed_though_it_failed(confirmable):
    """Never asked, or its cancel confirmed: no encode rank writes there any more."""
    assert fate_of(succeeded=False, memory_safe=True, confirmable=confirmable) is FREE
    assert fate_of(succeeded=False, memory_safe=True, confirmable=confirmable, copy_out=True) is FREE_AFTER_COPY


@pytest.mark.parametrize("copy_out", [True, False])
def test_a_cleared_room_not_known_safe_is_quarantined_until_its_cancel_is_confirmed(copy_out):
    assert fate_of(succeeded=False, memory_safe=False, confirmable=True, copy_out=copy_out) is UNTIL_CONFIRMED


@pytest.mark.parametrize("copy_out", [True, False])
def test_a_room_not_known_safe_whose_confirmation_cannot_come_waits_out_the_quarantine(copy_out):
    """Its session manager closed, or its receive() raised once the room was filed (the driver forgot it)."""
    assert fate_of(succeeded=False, memory_safe=False, confirmable=False, copy_out=copy_out) is QUARANTINE


def test_exactly_the_rooms_neither_succeeded_nor_known_safe_are_quarantined():
    for succeeded, memory_safe, confirmable, copy_out in itertools.product([False, True], repeat=4):
        fate = fate_of(succeeded=succeeded, memory_safe=memory_safe, confirmable=confirmable, copy_out=copy_out)
        assert fate.quarantined is not (succeeded or memory_safe), (succeeded, memory_safe, confirmable, copy_out)


def test_only_the_two_quarantines_hold_the_memory_back():
    assert [fate for fate in Fate if fate.quarantined] == [QUARANTINE, UNTIL_CONFIRMED]


@pytest.mark.parametrize("succeeded, memory_safe", [(True, False), (False, True)])
def test_memory_that_succeeded_or_is_known_safe_is_reusable_before_it_even_concluded(succeeded, memory_safe):
    assert reusable(succeeded=succeeded, memory_safe=memory_safe, concluded_at=None, now=0.0, quarantine_s=280.0)


def test_memory_of_a_room_still_under_way_is_not_reusable():
    assert not reusable(succeeded=False, memory_safe=False, concluded_at=None, now=1e9, quarantine_s=280.0)


def test_memory_not_known_safe_is_reusable_once_the_quarantine_passed_since_it_concluded():
    facts = dict(succeeded=False, memory_safe=False, concluded_at=10.0, quarantine_s=280.0)
    assert not reusable(now=289.9, **facts)
    assert reusable(now=290.0, **facts)


def test_a_confirmed_room_leaves_the_book_once():
    book: AwaitingConfirmation[str] = AwaitingConfirmation(quarantine_s=5.0, limit=10)
    book.add(7, 100.0, "room 7")
    assert book.confirmed(7) == "room 7"
    assert book.confirmed(7) is None and len(book) == 0


def test_a_confirmation_for_a_token_never_filed_finds_nothing():
    book: AwaitingConfirmation[str] = AwaitingConfirmation(quarantine_s=5.0, limit=10)
    book.add(1, 100.0, "room 1")
    assert book.confirmed(2) is None and len(book) == 1


def test_rooms_expire_when_their_quarantine_passed_and_not_before():
    book: AwaitingConfirmation[str] = AwaitingConfirmation(quarantine_s=5.0, limit=10)
    book.add(1, 100.0, "first")
    book.add(2, 102.0, "second")
    assert book.expire(104.999) == []
    assert book.expire(105.0) == ["first"]
    assert book.confirmed(1) is None  # a confirmation after the quarantine changes nothing
    assert book.expire(106.0) == [] and book.expire(107.0) == ["second"] and len(book) == 0


def test_past_the_limit_the_oldest_go_first_whatever_their_age():
    book: AwaitingConfirmation[int] = AwaitingConfirmation(quarantine_s=float("inf"), limit=2)
    for token in range(4):
        book.add(token, 100.0 + token, token)
    assert book.expire(104.0) == [0, 1]
    assert [book.confirmed(token) for token in range(4)] == [None, None, 2, 3]


def test_an_infinite_quarantine_keeps_rooms_until_confirmed():
    book: AwaitingConfirmation[int] = AwaitingConfirmation(quarantine_s=float("inf"), limit=10)
    book.add(3, 0.0, 3)
    assert book.expire(1e12) == [] and book.confirmed(3) == 3

"""The quarantine rule: what becomes of a let-go room's memory, and when it is safe to reuse."""

from __future__ import annotations

import itertools

import pytest

from transfer.core.quarantine import Fate, fate_of, reusable

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

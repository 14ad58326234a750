"""When a driver's tick may find messages unread (transfer.core.unread.unread), and the hold both cores
keep on their rules meanwhile (UnreadGrace)."""

from __future__ import annotations

from transfer.core.unread import LATE_TICK_S, UNREAD_GRACE_S, UnreadGrace, unread


def test_a_tick_is_late_once_it_comes_late_tick_s_past_its_time_or_its_drain_left_messages_queued():
    assert not unread(10.0, None, queued=True), "nothing due: nothing to hold"
    assert not unread(9.9, 10.0, queued=True), "not due yet"
    assert not unread(10.0 + LATE_TICK_S / 2, 10.0, queued=False)
    assert unread(10.0 + LATE_TICK_S, 10.0, queued=False)
    assert unread(10.0, 10.0, queued=True)


def test_a_backlog_the_driver_goes_through_a_batch_a_turn_is_not_lateness():
    # Due long ago, but the driver ticked a moment ago: it is working through what is due, not held up.
    assert not unread(20.0, 10.0, queued=False, since=20.0 - LATE_TICK_S / 2)
    assert unread(20.0, 10.0, queued=False, since=20.0 - LATE_TICK_S)


def test_a_hold_lasts_the_grace_and_its_end_is_when_the_next_tick_is_needed():
    grace = UnreadGrace()
    assert grace.defer(12.0) == 12.0 and grace.defer(None) is None
    assert grace.holds(15.0, True, due=11.0)
    assert grace.defer(11.0) == 15.0 + UNREAD_GRACE_S and grace.defer(None) == 15.0 + UNREAD_GRACE_S
    assert grace.holds(15.0 + UNREAD_GRACE_S / 2, False, due=11.0)
    assert not grace.holds(15.0 + UNREAD_GRACE_S, True, due=11.0), "once in a row"
    assert grace.ended == 15.0 + UNREAD_GRACE_S, "rules due by then were held once already"
    assert grace.defer(11.0) == 11.0
    assert grace.holds(15.5, True, due=11.0), "a later late tick may hold them again"


def test_a_hold_is_on_from_the_late_tick_until_its_grace_ends():
    grace = UnreadGrace()
    assert not grace.holding(5.0)
    assert grace.holds(5.0, True, 4.0)
    assert grace.holding(5.0) and grace.holding(5.0 + UNREAD_GRACE_S / 2)
    assert not grace.holding(5.0 + UNREAD_GRACE_S)

"""The sender pool's poll schedule: a backoff, and the shortest gap while short writes are new."""

from __future__ import annotations

import pytest

from transfer.core.polls import SHORT_WRITE_BYTES, SHORT_WRITE_S, PollSchedule

MIN_S, MAX_S = 100e-6, 1e-3
LONG = SHORT_WRITE_BYTES + 1


def test_a_long_write_backs_off_from_min_to_max_and_starts_over_once_one_is_done():
    schedule = PollSchedule(MIN_S, MAX_S)
    schedule.started(LONG, now=0.0)
    sleeps = [schedule.sleep_s(0.0)]
    for _ in range(5):
        schedule.polled(found_done=False, waited_on=1)
        sleeps.append(schedule.sleep_s(0.0))
    assert sleeps == pytest.approx([100e-6, 200e-6, 400e-6, 800e-6, 1e-3, 1e-3])
    schedule.polled(found_done=True, waited_on=1)
    assert schedule.sleep_s(0.0) == pytest.approx(MIN_S)


def test_a_short_write_is_polled_at_the_shortest_gap_for_its_first_moments_then_backs_off():
    schedule = PollSchedule(MIN_S, MAX_S)
    schedule.started(SHORT_WRITE_BYTES, now=1.0)
    for _ in range(5):
        schedule.polled(found_done=False, waited_on=1)
        assert schedule.sleep_s(1.0 + SHORT_WRITE_S / 2) == pytest.approx(MIN_S)
    # Still in flight past SHORT_WRITE_S (a stopped receiver): the backoff, grown meanwhile.
    assert schedule.sleep_s(1.0 + SHORT_WRITE_S) == pytest.approx(MAX_S)
    schedule.started(LONG, now=1.01)
    assert schedule.sleep_s(1.01) == pytest.approx(MAX_S)  # a long write starts no short phase


def test_short_writes_to_several_receivers_keep_one_check_per_min_gap_but_never_wait_past_the_backoff():
    schedule = PollSchedule(MIN_S, MAX_S)
    schedule.started(128 << 10, now=0.0)
    schedule.polled(found_done=False, waited_on=4)
    assert schedule.sleep_s(0.0) == pytest.approx(2 * MIN_S)  # the backoff's 200 us is below 4 x 100 us
    schedule.polled(found_done=False, waited_on=3)
    assert schedule.sleep_s(0.0) == pytest.approx(3 * MIN_S)
    schedule.polled(found_done=True, waited_on=0)
    assert schedule.sleep_s(0.0) == pytest.approx(MIN_S)


def test_a_long_first_poll_is_kept_for_short_writes_too():
    """poll_min_s is the shortest gap there is: a deployment that sets 20 ms gets no 100 us polls."""
    schedule = PollSchedule(0.02, 0.08)
    schedule.started(4096, now=0.0)
    assert schedule.sleep_s(0.0) == pytest.approx(0.02)


def test_writes_held_by_their_ready_events_back_off_like_long_writes():
    schedule = PollSchedule(MIN_S, MAX_S)
    schedule.idle()
    schedule.idle()
    assert schedule.sleep_s(0.0) == pytest.approx(4 * MIN_S)

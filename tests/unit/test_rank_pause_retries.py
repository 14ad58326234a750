"""A prefill rank of `epd-transfer rank` and `demo` asks again for a room that failed because its bootstrap server
was paused (handle.retry_at), once the pause is over, a few times at most and within what is left of the rank:
harness.pause_retry_wait."""

from __future__ import annotations

from transfer.harness import PAUSE_RETRIES, pause_retry_wait


def test_a_room_failed_by_a_pause_is_asked_for_again_once_the_pause_is_over():
    assert pause_retry_wait(retry_at=11.0, retries=0, now=10.25, left_s=60.0) == 0.75
    assert pause_retry_wait(retry_at=11.0, retries=0, now=12.0, left_s=60.0) == 0.0, "a pause over: at once"


def test_a_room_failed_for_anything_else_stays_failed():
    assert pause_retry_wait(retry_at=None, retries=0, now=10.0, left_s=60.0) is None


def test_a_room_is_asked_for_again_a_bounded_number_of_times():
    assert pause_retry_wait(retry_at=11.0, retries=PAUSE_RETRIES - 1, now=10.0, left_s=60.0) == 1.0
    assert pause_retry_wait(retry_at=11.0, retries=PAUSE_RETRIES, now=10.0, left_s=60.0) is None


def test_a_pause_that_outlasts_the_rank_is_not_waited_out():
    assert pause_retry_wait(retry_at=11.0, retries=0, now=10.0, left_s=0.5) is None
    assert pause_retry_wait(retry_at=11.0, retries=0, now=10.0, left_s=1.0) is None
    assert pause_retry_wait(retry_at=11.0, retries=0, now=10.0, left_s=1.5) == 1.0

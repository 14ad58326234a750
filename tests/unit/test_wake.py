"""The prefill I/O thread's sleep plan (transfer.core.wake.sleep_plan), and the rule a step on another
thread wakes it by: work due before what the plan answers for (the driver's `_must_wake()`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from transfer.core.wake import IDLE_SLEEP_MS, sleep_plan

LEASE_S, LOOK_S = 0.005, 0.02
NOW = 1000.0


def plan(wakeup: float | None, *, waiter: bool = False, caller_at: float = float("-inf"),
         busy: bool = False) -> tuple[int, bool, float]:
    return sleep_plan(NOW, wakeup, waiter=waiter, caller_at=caller_at, lease_s=LEASE_S, look_s=LOOK_S, busy=busy)


def wakes_for(due: float, covers: float) -> bool:
    """The driver's `_must_wake()` rule, for a step that leaves work due at `due`."""
    return due < covers


def test_an_idle_thread_sleeps_a_second_watching_the_socket_and_a_room_due_sooner_wakes_it():
    timeout_ms, watch, covers = plan(None)
    assert (timeout_ms, watch) == (IDLE_SLEEP_MS, True) and covers == NOW + 1.0
    assert wakes_for(NOW + 0.25, covers) and not wakes_for(NOW + 60.0, covers)


def test_a_sleep_planned_for_a_wakeup_ends_just_after_it_and_that_wakeup_needs_no_wake_up():
    timeout_ms, _, covers = plan(NOW + 0.2504)
    assert timeout_ms == 251, "rounded up: it wakes after the work comes due, not just before"
    assert covers == NOW + 0.2504
    assert not wakes_for(NOW + 0.2504, covers), "a step that left the same wakeup behind"
    assert not wakes_for(NOW + 0.5, covers), "a later one: the thread replans when it wakes"
    assert wakes_for(NOW + 0.25, covers), "an earlier one"


def test_a_caller_holding_the_socket_or_waiting_on_it_bounds_the_sleep_and_what_it_answers_for():
    timeout_ms, watch, covers = plan(NOW + 0.5, caller_at=NOW - 0.0015)
    assert (timeout_ms, watch) == (4, False) and covers == NOW + 0.004
    assert wakes_for(NOW + 0.003, covers) and not wakes_for(NOW + 0.005, covers)
    timeout_ms, watch, covers = plan(NOW + 0.5, waiter=True)
    assert (timeout_ms, watch) == (20, False) and covers == NOW + 0.02
    timeout_ms, _, covers = plan(NOW + 0.5, busy=True)
    assert timeout_ms == 0 and covers == NOW


@given(wakeup=st.one_of(st.none(), st.floats(NOW - 2, NOW + 3, allow_nan=False)),
       waiter=st.booleans(), caller_ago=st.floats(0, 0.01, allow_nan=False), busy=st.booleans(),
       due=st.floats(NOW - 2, NOW + 3, allow_nan=False))
def test_a_wake_up_is_sent_exactly_when_the_thread_would_otherwise_be_late(wakeup, waiter, caller_ago, busy, due):
    timeout_ms, _, covers = plan(wakeup, waiter=waiter, caller_at=NOW - caller_ago, busy=busy)
    wakes_at = NOW + timeout_ms / 1000
    assert 0 <= timeout_ms <= IDLE_SLEEP_MS and covers <= wakes_at
    if wakes_for(due, covers):
        assert due < wakes_at, "woken for work it would have woken for in time by itself"
    else:
        assert wakes_at <= max(due, NOW) + 0.001 + 1e-9, "left asleep past the plan's own rounding"
    if wakeup is not None:
        assert not wakes_for(wakeup, covers) or wakeup > NOW + IDLE_SLEEP_MS / 1000 or timeout_ms < \
            int((wakeup - NOW) * 1000) + 1, "the wakeup the sleep was planned for woke it again"

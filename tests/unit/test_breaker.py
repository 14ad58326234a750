"""The breaker: slow failures pause a key, quick ones do not, stalls scale the pause."""

from __future__ import annotations

import copy

from hypothesis import given
from hypothesis import strategies as st

from transfer.core.breaker import Breaker


def test_a_quick_failure_leaves_the_key_usable():
    breaker = Breaker(pause_s=5.0, slow_after_s=0.25)
    assert breaker.failed("peer", took=0.01, now=100.0) is None
    assert breaker.open_since("peer", 100.0) is None and "peer" not in breaker


def test_a_slow_failure_pauses_the_key_until_its_time_is_up():
    breaker = Breaker(pause_s=5.0, slow_after_s=0.25)
    trip = breaker.failed("peer", took=1.0, now=100.0)
    assert trip is not None and (trip.failed_at, trip.until, trip.stalled) == (100.0, 105.0, False)
    assert breaker.open_since("peer", 104.9) == 100.0
    assert breaker.open_since("peer", 105.0) is None
    assert breaker.open_since("other", 101.0) is None


def test_a_blocking_stall_scales_the_pause_up_to_the_cap():
    breaker = Breaker(pause_s=5.0, slow_after_s=0.25, stall_factor=4.0, max_pause_s=600.0)
    trip = breaker.failed("peer", took=60.0, now=0.0, blocking=True)
    assert trip.stalled and trip.until == 240.0
    assert breaker.failed("peer", took=1000.0, now=0.0, blocking=True).until == 600.0
    # Not blocking: an asynchronous failure held nobody, so the plain pause applies.
    assert breaker.failed("peer", took=60.0, now=0.0).until == 5.0


def test_reset_reopens_the_key_and_sweep_forgets_expired_keys():
    breaker = Breaker(pause_s=5.0)
    breaker.failed(("10.0.0.9", 1), took=1.0, now=0.0)
    breaker.failed(("10.0.0.9", 2), took=1.0, now=10.0)
    assert breaker.next_expiry() == 5.0
    breaker.sweep(6.0)
    assert ("10.0.0.9", 1) not in breaker and ("10.0.0.9", 2) in breaker and len(breaker) == 1
    breaker.reset(("10.0.0.9", 2))
    assert breaker.open_since(("10.0.0.9", 2), 11.0) is None and len(breaker) == 0
    assert breaker.next_expiry() is None


def test_a_bounded_breaker_forgets_the_oldest_failure_first():
    breaker = Breaker(pause_s=100.0, slow_after_s=0.0, max_keys=2)
    for i, key in enumerate(("a", "b", "c")):
        breaker.failed(key, took=1.0, now=float(i), detail=f"{key} timed out")
    assert "a" not in breaker and breaker.open_since("c", 2.5) == 2.0
    assert breaker.detail("b") == "b timed out" and breaker.detail("a") is None


def test_a_bounded_breaker_sweeps_finished_pauses_before_evicting():
    breaker = Breaker(pause_s=1.0, slow_after_s=0.0, max_keys=2)
    breaker.failed("old", took=1.0, now=0.0)
    breaker.failed("live", took=1.0, now=5.0)
    breaker.failed("new", took=1.0, now=5.5)
    assert "old" not in breaker and "live" in breaker and "new" in breaker


def test_a_word_from_the_key_ends_its_pause_once_until_a_call_to_it_succeeds():
    breaker = Breaker(pause_s=5.0, slow_after_s=0.25, max_pause_s=600.0)
    breaker.failed("peer", took=10.0, now=100.0)
    assert breaker.revivable("peer") and breaker.heard_from("peer", 101.0)
    assert breaker.open_since("peer", 101.0) is None and "peer" not in breaker
    assert not breaker.heard_from("peer", 102.0), "nothing left to end"
    # Failing slowly again after that: the word did not mean it works, so it waits the pause out.
    breaker.failed("peer", took=10.0, now=112.0)
    assert not breaker.revivable("peer") and not breaker.heard_from("peer", 113.0)
    assert breaker.open_since("peer", 116.9) == 112.0 and breaker.open_since("peer", 117.0) is None
    breaker.failed("peer", took=10.0, now=130.0)
    assert not breaker.heard_from("peer", 131.0)
    breaker.succeeded("peer")  # a call landed: the pause ends, and the next one may end with a word again
    assert breaker.open_since("peer", 131.0) is None
    breaker.failed("peer", took=10.0, now=140.0)
    assert breaker.heard_from("peer", 141.0)


def test_a_stall_or_an_expired_pause_is_not_ended_by_a_word_and_old_revivals_are_forgotten():
    breaker = Breaker(pause_s=5.0, slow_after_s=0.25, stall_factor=4.0, max_pause_s=600.0)
    breaker.failed("staller", took=60.0, now=0.0, blocking=True)
    assert not breaker.heard_from("staller", 1.0), "a peer that never answers a handshake still talks"
    assert breaker.open_since("staller", 1.0) == 0.0
    breaker.failed("peer", took=1.0, now=0.0)
    assert not breaker.heard_from("peer", 5.0) and breaker.open_since("peer", 5.0) is None
    breaker.failed("peer", took=1.0, now=10.0)
    assert breaker.heard_from("peer", 11.0)
    breaker.sweep(610.9)
    breaker.failed("peer", took=1.0, now=611.0)
    assert not breaker.revivable("peer"), "revived 600 s ago less a moment: a repeat"
    breaker.sweep(611.0)
    breaker.failed("peer", took=1.0, now=612.0)
    assert breaker.revivable("peer"), "its revival forgotten, it may end its pause with a word again"



def test_revivals_are_bounded_by_max_keys_the_oldest_forgotten_first():
    """A revival (a word ended a key's pause) makes the key's next slow failure wait its pause out; peers that
    come and go by the thousand must not grow that memory past `max_keys`, so the oldest revival goes first and
    that key may again end a pause with a word."""
    breaker = Breaker(pause_s=5.0, slow_after_s=0.25, max_keys=2)
    for now, key in enumerate("abc"):
        breaker.failed(key, took=1.0, now=float(now))
        assert breaker.heard_from(key, now + 0.5)
    breaker.failed("a", took=1.0, now=10.0)
    breaker.failed("b", took=1.0, now=10.0)
    assert breaker.revivable("a"), "its revival was the oldest of three, past max_keys: forgotten"
    assert not breaker.revivable("b"), "its revival is still remembered: a repeat waits its pause out"

_KEYS = st.sampled_from("abc")


#: A breaker's events in any order: failures fast and slow, words heard, successes, resets, sweeps, time.
_STEPS = st.lists(st.one_of(
    st.tuples(st.just("failed"), _KEYS, st.sampled_from([0.01, 1.0, 10.0]), st.booleans()),
    st.tuples(st.just("heard_from"), _KEYS), st.tuples(st.just("succeeded"), _KEYS), st.tuples(st.just("reset"), _KEYS),
    st.tuples(st.just("sweep"),), st.tuples(st.just("wait"), st.sampled_from([1.0, 6.0, 700.0])),
), max_size=30)


def _stepped(steps):
    """A breaker taken through `steps`, yielding it and the clock after each."""
    breaker = Breaker(pause_s=5.0, slow_after_s=0.25, max_keys=2)
    now = 0.0
    for step in steps:
        if step[0] == "failed":
            breaker.failed(step[1], step[2], now, blocking=step[3])
        elif step[0] == "wait":
            now += step[1]
        elif step[0] == "sweep":
            breaker.sweep(now)
        elif step[0] == "heard_from":
            breaker.heard_from(step[1], now)
        else:
            getattr(breaker, step[0])(step[1])
        yield breaker, now


@given(_STEPS)
def test_tripped_holds_every_key_paused_or_revivable_so_that_an_empty_one_means_none_is(steps):
    for breaker, now in _stepped(steps):
        assert breaker.tripped == {key: breaker.entry(key) for key in "abc" if breaker.entry(key) is not None}
        for key in "abc":
            if key not in breaker.tripped:  # what the encode core skips asking while tripped is empty
                assert breaker.open_since(key, now) is None and not breaker.revivable(key)


@given(_STEPS)
def test_while_tripped_and_revived_are_empty_a_success_changes_nothing(steps):
    """What the encode core's write_done skips: succeeded() with no key paused and none revived."""
    for breaker, now in _stepped(steps):
        if not breaker.tripped and not breaker.revived:
            before = copy.deepcopy(vars(breaker))
            for key in "abc":
                breaker.succeeded(key)
            assert vars(breaker) == before

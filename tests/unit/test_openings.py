"""The openings: a new peer's writes wait for its probe, within a bound, and never behind another peer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.core.openings import Openings, Verdict


def test_a_new_session_is_probed_once_and_its_writes_wait_for_the_answer():
    openings = Openings(open_timeout_s=5.0)
    verdict, probe, why = openings.admit("peer", 100.0)
    assert verdict is Verdict.PROBE and probe.session == "peer" and probe.started == 100.0 and why == ""
    again, same, _ = openings.admit("peer", 101.0)
    assert again is Verdict.WAIT and same is probe and openings.probing() == 1
    assert openings.verdict(probe, 104.9) == (Verdict.WAIT, "")


def test_a_reply_opens_the_session_and_releases_its_writes():
    openings = Openings(open_timeout_s=5.0)
    _, probe, _ = openings.admit("peer", 100.0)
    openings.answered(probe, True, 100.01)
    assert openings.verdict(probe, 100.02) == (Verdict.GO, "")
    assert openings.is_open("peer") and openings.probing() == 0
    assert openings.admit("peer", 200.0) == (Verdict.GO, None, "")


def test_writes_to_a_peer_that_never_answers_fail_at_the_bound_naming_the_stall():
    openings = Openings(open_timeout_s=5.0)
    _, probe, _ = openings.admit("peer", 100.0)
    verdict, why = openings.verdict(probe, 105.1)
    assert verdict is Verdict.REFUSE
    assert "did not answer within 5s" in why and "stopped" in why and "every write" in why
    # While that probe is still out (Mooncake holds it up to 60 s), later writes fail at once, no second probe.
    verdict, same, why = openings.admit("peer", 130.0)
    assert verdict is Verdict.REFUSE and same is probe and "probed 30.0s ago" in why
    assert openings.probing() == 1


def test_a_peer_that_answers_after_the_bound_is_open_again_but_the_writes_that_waited_stay_failed():
    openings = Openings(open_timeout_s=5.0)
    _, probe, _ = openings.admit("peer", 100.0)
    openings.answered(probe, True, 140.0)
    assert openings.verdict(probe, 140.0)[0] is Verdict.REFUSE
    assert openings.admit("peer", 141.0) == (Verdict.GO, None, "")


def test_a_quick_refusal_lets_the_waiting_writes_go_to_mooncake_and_the_next_write_probes_again():
    """An older Mooncake peer without probes, or a closed port, refuses at once: Mooncake's own
    handshake with it is as quick, so its verdict is Mooncake's to give."""
    openings = Openings(open_timeout_s=5.0)
    _, probe, _ = openings.admit("peer", 100.0)
    openings.answered(probe, False, 100.001)
    assert openings.verdict(probe, 100.002) == (Verdict.GO, "")
    assert not openings.is_open("peer")
    verdict, second, _ = openings.admit("peer", 100.003)
    assert verdict is Verdict.PROBE and second is not probe


def test_a_late_failure_leaves_the_session_closed_for_a_fresh_probe():
    openings = Openings(open_timeout_s=5.0)
    _, probe, _ = openings.admit("peer", 100.0)
    openings.answered(probe, False, 160.0)
    assert openings.verdict(probe, 160.0)[0] is Verdict.REFUSE
    verdict, fresh, _ = openings.admit("peer", 161.0)
    assert verdict is Verdict.PROBE and fresh is not probe and fresh.started == 161.0


def test_one_silent_peer_does_not_hold_another_peers_writes():
    openings = Openings(open_timeout_s=5.0)
    openings.opened("healthy")
    _, silent, _ = openings.admit("silent", 100.0)
    assert openings.admit("healthy", 100.5) == (Verdict.GO, None, "")
    verdict, other, _ = openings.admit("new", 101.0)
    assert verdict is Verdict.PROBE and other is not silent


def test_probes_in_flight_are_bounded():
    openings = Openings(open_timeout_s=5.0, max_probing=2)
    openings.admit("a", 0.0)
    openings.admit("b", 0.0)
    verdict, probe, why = openings.admit("c", 1.0)
    assert verdict is Verdict.REFUSE and probe is None and "at most 2 at once" in why
    assert openings.admit("a", 1.0)[0] is Verdict.WAIT  # sessions already probed keep waiting
    assert openings.admit("healthy", 1.0)[0] is Verdict.REFUSE
    openings.opened("healthy")
    assert openings.admit("healthy", 1.0)[0] is Verdict.GO


def test_open_sessions_are_bounded_oldest_first_and_a_forgotten_one_is_probed_again():
    openings = Openings(max_open=2)
    for name in ("a", "b", "c"):
        openings.opened(name)
    assert [openings.is_open(n) for n in ("a", "b", "c")] == [False, True, True]
    openings.opened("b")  # used again: now the newest
    openings.opened("d")
    assert [openings.is_open(n) for n in ("b", "c", "d")] == [True, False, True]
    openings.forget("d")
    assert openings.admit("d", 0.0)[0] is Verdict.PROBE


def test_a_wait_that_spans_a_hold_up_of_the_probers_own_process_gets_its_bound_again_once():
    """The probe went out at 100, the prober's process was stopped from 100.01 to 108 (its first poll since then
    says so): the peer is not refused for that; it answers once the process runs again and its writes go."""
    openings = Openings(open_timeout_s=5.0)
    _, probe, _ = openings.admit("peer", 100.0)
    assert openings.verdict(probe, 100.01) == (Verdict.WAIT, "")
    assert openings.verdict(probe, 108.0)[0] is Verdict.REFUSE  # what the same wait is without a hold-up
    assert openings.verdict(probe, 108.0, held_up=7.99) == (Verdict.WAIT, "")
    assert openings.verdict(probe, 108.001) == (Verdict.WAIT, "")  # the polls after it keep that discount
    openings.answered(probe, True, 108.002)
    assert openings.verdict(probe, 108.003) == (Verdict.GO, "") and openings.is_open("peer")


def test_a_reply_read_late_for_a_hold_up_of_the_probers_own_process_lets_the_writes_go():
    """The probe's own thread ran first after the resume: the reply it read counts as in time once a poll
    says the process was held up meanwhile."""
    openings = Openings(open_timeout_s=5.0)
    _, probe, _ = openings.admit("peer", 100.0)
    openings.answered(probe, True, 108.0)
    assert openings.verdict(probe, 108.001, held_up=7.99) == (Verdict.GO, "")


def test_a_silent_peer_is_refused_within_a_bound_of_the_hold_up_s_end_and_a_second_hold_up_gets_nothing():
    openings = Openings(open_timeout_s=5.0)
    _, probe, _ = openings.admit("peer", 100.0)
    assert openings.verdict(probe, 130.0, held_up=29.0)[0] is Verdict.WAIT  # 1 s of its wait counts
    assert openings.verdict(probe, 134.0)[0] is Verdict.WAIT
    verdict, why = openings.verdict(probe, 134.5, held_up=0.3)  # held up again: not given more
    assert verdict is Verdict.REFUSE and "probed 34.5s ago, 29.0s of which this process was held up" in why
    # A hold-up that came before the probe went out is none of its wait's.
    _, other, _ = openings.admit("other", 100.0)
    assert openings.verdict(other, 106.0, held_up=0.5)[0] is Verdict.REFUSE


@settings(max_examples=300)
@given(st.integers(1, 4), st.lists(st.tuples(st.sampled_from(["opened", "forget"]), st.sampled_from("abcdef")),
                                   max_size=40))
def test_open_sessions_are_the_most_recently_opened_up_to_the_bound(max_open, steps):
    """Whatever the order of openings and forgettings (a session opened again among them), the open ones are
    the `max_open` most recently opened and not forgotten since."""
    openings = Openings(max_open=max_open)
    model: list[str] = []  # oldest first
    for op, session in steps:
        getattr(openings, op)(session)
        if session in model:
            model.remove(session)
        if op == "opened":
            model.append(session)
            del model[:-max_open]
    assert [session for session in "abcdef" if openings.is_open(session)] == sorted(model)


def test_a_stale_probes_second_answer_leaves_the_sessions_newer_probe_in_flight():
    """A probe answered twice (its thread's answer reported again after a refusal let the next write probe anew)
    must not take the newer probe off the books: the next write would start a second probe of the same peer,
    and the writes waiting on the first would never hear its answer."""
    openings = Openings(open_timeout_s=5.0)
    _, old, _ = openings.admit("peer", 100.0)
    openings.answered(old, False, 100.01)
    verdict, new, _ = openings.admit("peer", 101.0)
    assert verdict is Verdict.PROBE and new is not old
    openings.answered(old, False, 101.5)
    assert openings.probing() == 1
    again, same, _ = openings.admit("peer", 102.0)
    assert again is Verdict.WAIT and same is new

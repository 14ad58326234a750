"""Unreachable bootstrap servers (transfer.core.prefill_breaker)."""

from __future__ import annotations

from transfer.core.prefill_breaker import BootstrapBreaker


def test_a_slow_failure_keeps_rooms_from_asking_for_a_while():
    breaker = BootstrapBreaker(retry_s=1.0, slow_s=0.25)
    assert breaker.failed("h:1", now=10.0, took_s=0.5, why="unreachable: timed out")
    assert breaker.refusal("h:1", 10.3) == "unreachable: timed out (after 0.5s) (0.3s ago; not asked again for 1s)"
    assert breaker.refusal("h:2", 10.3) is None, "other servers are asked as usual"
    assert breaker.refusal("h:1", 11.0) is None, "once the pause is over it is asked again"
    assert len(breaker) == 0


def test_a_paused_server_says_why_and_when_it_is_asked_again():
    breaker = BootstrapBreaker(retry_s=1.0, slow_s=0.25)
    breaker.failed("h:1", now=10.0, took_s=2.0, why="unreachable: timed out")
    assert breaker.paused("h:1", 10.25) == ("unreachable: timed out (after 2.0s) (0.2s ago; not asked again for 1s)",
                                            11.0)
    assert breaker.paused("h:1", 11.0) is None


def test_a_quick_failure_lets_every_room_try():
    breaker = BootstrapBreaker(retry_s=1.0, slow_s=0.25)
    assert not breaker.failed("h:1", now=10.0, took_s=0.01, why="connection refused")
    assert breaker.refusal("h:1", 10.0) is None


def test_an_answer_closes_the_breaker():
    breaker = BootstrapBreaker()
    breaker.failed("h:1", now=0.0, took_s=2.0, why="timed out")
    breaker.succeeded("h:1")
    assert breaker.refusal("h:1", 0.1) is None


def test_the_servers_remembered_are_bounded():
    breaker = BootstrapBreaker(retry_s=100.0, max_servers=3)
    for i in range(10):
        breaker.failed(f"h:{i}", now=float(i), took_s=1.0, why="timed out")
    assert len(breaker) == 3
    assert breaker.refusal("h:9", 9.5) is not None and breaker.refusal("h:0", 9.5) is None

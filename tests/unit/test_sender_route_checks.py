"""When a sender pool's route keeper checks its route: each wait drawn around ROUTE_CHECK_S, so pools
started together ask the bootstrap server apart, and sooner after a check that failed, backing off to
the period.

The schedule is a pure function of a seeded random.Random; the keeper's loop runs here on a stand-in
for its closing event, and its checks on a client whose answers are replaced. What a real server and
real pools do is tests/live/test_sender_route.py."""

from __future__ import annotations

import random

import pytest

from transfer import sender
from transfer.bootstrap import BootstrapClient
from transfer.errors import BootstrapError, BootstrapNoRoute, BootstrapUnreachable
from transfer.sender import ROUTE_CHECK_S, ROUTE_RETRY_S, route_check_wait

#: A host's encode ranks, each with its own sender pool, all started at once.
POOLS = 32


def _moments(seed: int, span_s: float) -> list[float]:
    """The moments a keeper whose checks all settle checks, within `span_s` of its start."""
    rng, moments, at = random.Random(seed), [], 0.0
    while (at := at + route_check_wait(0, rng)) < span_s:
        moments.append(at)
    return moments


def test_each_wait_is_drawn_from_half_to_one_and_a_half_periods():
    rng = random.Random(1)
    waits = [route_check_wait(0, rng) for _ in range(2000)]
    assert all(0.5 * ROUTE_CHECK_S <= wait <= 1.5 * ROUTE_CHECK_S for wait in waits)
    assert min(waits) < 0.55 * ROUTE_CHECK_S and max(waits) > 1.45 * ROUTE_CHECK_S, "spread over the range"
    assert sum(waits) / len(waits) == pytest.approx(ROUTE_CHECK_S, rel=0.05), "as many checks as a fixed period"


def test_pools_started_together_do_not_check_at_the_same_moments():
    # With a fixed period every pool of the host checks at 5 s, 10 s, ...: 32 connections at once to a
    # server that serves a bounded number from one address and answers the rest 503.
    moments = sorted(at for seed in range(POOLS) for at in _moments(seed, 120.0))
    at_once = max(sum(1 for other in moments if at <= other < at + 0.1) for at in moments)
    assert at_once <= POOLS // 4, f"{at_once} of {POOLS} pools' checks within 100 ms"
    firsts = sorted(_moments(seed, 120.0)[0] for seed in range(POOLS))
    assert firsts[-1] - firsts[0] > 0.8 * ROUTE_CHECK_S, "the first checks spread over most of a period"


def test_after_a_failed_check_the_next_comes_sooner_backing_off_to_the_period():
    rng = random.Random(2)
    for failures in range(1, 12):
        bound = min(ROUTE_RETRY_S * 2 ** (failures - 1), ROUTE_CHECK_S)
        waits = [route_check_wait(failures, rng) for _ in range(200)]
        assert all(0.5 * bound <= wait <= 1.5 * bound for wait in waits), failures
    assert 1.5 * ROUTE_RETRY_S < 0.5 * ROUTE_CHECK_S, "the first retry comes before any regular check"
    assert route_check_wait(10**9, rng) <= 1.5 * ROUTE_CHECK_S, "bounded however long the server fails"


class _Closing:
    """The keeper's closing event: records each wait, and is set once `waits` waits were asked for."""

    def __init__(self, waits: int) -> None:
        self.asked: list[float] = []
        self.waits = waits

    def wait(self, timeout: float) -> bool:
        self.asked.append(timeout)
        return len(self.asked) > self.waits

    def is_set(self) -> bool:
        return len(self.asked) > self.waits


def test_the_keeper_waits_as_the_schedule_says_for_the_checks_that_failed_in_a_row(monkeypatch):
    settled = iter([False, False, True, False, True])
    monkeypatch.setattr(sender._Route, "check", lambda route: next(settled))
    route = sender._Route("10.0.0.1:8998", None, 4, 2, "10.0.0.7", 7000, 3, rng=random.Random(3))
    route.closing = _Closing(5)  # type: ignore[assignment]
    route._keep()
    expected, rng = [], random.Random(3)
    for failures in [0, 1, 2, 0, 1, 0]:
        expected.append(route_check_wait(failures, rng))
    assert route.closing.asked == expected  # type: ignore[attr-defined]


def _fail(error: Exception):
    def call(*args, **kwargs):
        raise error
    return call


@pytest.mark.parametrize(("look_up", "put", "settled"), [
    (lambda *a, **k: ("10.0.0.7", 7000, "ab" * 16), None, True),
    (lambda *a, **k: ("10.0.0.8", 7001, "cd" * 16), None, True),
    (_fail(BootstrapUnreachable("bootstrap server 10.0.0.1:8998 unreachable: ConnectionRefusedError")), None, False),
    (_fail(BootstrapError("bootstrap server 10.0.0.1:8998 answered HTTP 503 for encode rank 3: busy")), None, False),
    (_fail(BootstrapNoRoute("no route")), lambda *a, **k: True, True),
    (_fail(BootstrapNoRoute("no route")), lambda *a, **k: False, True),
    (_fail(BootstrapNoRoute("no route")), _fail(BootstrapError("could not register ...: HTTP 503: busy")), False),
    (_fail(BootstrapNoRoute("no route")), _fail(BootstrapUnreachable("could not register ...: refused")), False),
    (_fail(BootstrapNoRoute("no route")), _fail(BootstrapError("refused encode rank 3: HTTP 401: ...")), False),
], ids=["listed", "another-listed", "look-up-refused", "look-up-503", "registered", "another-registered-412",
        "put-503", "put-refused", "put-401"])
def test_a_check_settles_unless_the_server_did_not_answer_or_refused(monkeypatch, look_up, put, settled):
    monkeypatch.setattr(BootstrapClient, "registration", look_up)
    monkeypatch.setattr(BootstrapClient, "register_rank", put or _fail(AssertionError("no PUT where a route is")))
    route = sender._Route("10.0.0.1:8998", None, 4, 2, "10.0.0.7", 7000, 3, "ab" * 16)
    assert route.check() is settled

"""A rank's wait at its start (`epd-transfer rank`: a prefill rank for its encode rank's route, an encode rank
for the bootstrap server to answer) says what it waits for, then how it goes, and why it gave up: the lines
cli._waited writes, on a fake clock, with tries that fail as a real client's do."""

from __future__ import annotations

import socket

import pytest

from transfer import cli
from transfer.errors import BootstrapError, BootstrapNoRoute, BootstrapUnreachable

WHO, WHAT = "prefill rank 0", "encode rank 0 to register at bootstrap 10.0.0.1:8998"
NEVER, FIX = "encode rank 0 never registered at bootstrap 10.0.0.1:8998", "start encode rank 0"


class Clock:
    """time.monotonic() and time.sleep() as the wait sees them; each try takes `try_s`."""

    def __init__(self, try_s: float = 0.0) -> None:
        self.now = 1000.0
        self.try_s = try_s

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def _unreachable(cause: OSError) -> BootstrapUnreachable:
    """What BootstrapClient raises when a try got no answer: the OSError is its cause."""
    try:
        raise BootstrapUnreachable(f"bootstrap server 10.0.0.1:8998 unreachable for parallel info: {cause}") from cause
    except BootstrapUnreachable as error:
        return error


def _tries(clock: Clock, failures: list[BaseException], then_ready: bool = True):
    """An attempt that raises each of `failures` in turn (the last again once they run out, unless
    `then_ready`), each try taking clock.try_s; records the bound each try was given."""
    bounds: list[float] = []

    def attempt(bound_s: float) -> None:
        bounds.append(bound_s)
        clock.now += clock.try_s
        if len(bounds) <= len(failures):
            raise failures[len(bounds) - 1]
        if not then_ready:
            raise failures[-1]

    return attempt, bounds


def _wait(clock: Clock, attempt, timeout_s: float = 120.0) -> tuple[float, list[str]]:
    lines: list[str] = []
    left = cli._waited(WHO, WHAT, timeout_s, attempt, NEVER, FIX, say=lines.append, clock=clock, sleep=clock.sleep)
    return left, lines


def test_a_wait_met_at_the_first_try_says_nothing():
    clock = Clock()
    attempt, bounds = _tries(clock, [])
    left, lines = _wait(clock, attempt)
    assert lines == [] and left == 120.0 and len(bounds) == 1


def test_a_wait_says_what_it_waits_for_then_every_ten_seconds_how_it_goes_then_that_it_ended():
    clock = Clock()
    refused = _unreachable(ConnectionRefusedError(111, "Connection refused"))
    attempt, _ = _tries(clock, [refused] * 80)  # 0.05, 0.1, 0.2, 0.4 s apart, then 0.5 s: 38.75 s of refusals
    _, lines = _wait(clock, attempt)
    first, *still, last = lines
    assert first.startswith(f"{WHO}: waiting up to 120s (--bootstrap-timeout, until ")
    assert first.endswith(f") for {WHAT}; not yet: connection refused (nothing listens there)")
    assert [line.split(": ", 2)[2].split(",")[0] for line in still] == ["10s of 120s", "20s of 120s", "30s of 120s"]
    assert all(line.startswith(f"{WHO}: still waiting for {WHAT}: ") for line in still)
    assert all(line.endswith("tries; last: connection refused (nothing listens there)") for line in still)
    assert last.startswith(f"{WHO}: done waiting for {WHAT}, after 39s (81 tries)"), last


def test_a_short_wait_says_how_it_goes_every_quarter_of_it():
    clock = Clock()
    attempt, _ = _tries(clock, [_unreachable(ConnectionRefusedError(111, "Connection refused"))], then_ready=False)
    lines: list[str] = []
    with pytest.raises(BootstrapError):
        cli._waited(WHO, WHAT, 4.0, attempt, NEVER, FIX, say=lines.append, clock=clock, sleep=clock.sleep)
    # Said at 0 s, then at least a second apart (tries end 0.5 s apart): at 1, 2 and 3 s.
    assert [line.split(": ", 2)[2].split(",")[0] for line in lines[1:]] == ["1s of 4s", "2s of 4s", "3s of 4s"]


@pytest.mark.parametrize("failure, said", [
    (_unreachable(ConnectionRefusedError(111, "Connection refused")), "connection refused (nothing listens there)"),
    (_unreachable(socket.gaierror(-2, "Name or service not known")),
     "the host name does not resolve (Name or service not known)"),
    (_unreachable(TimeoutError("timed out")), "no answer (timed out)"),
    (BootstrapError("bootstrap server 10.0.0.1:8998 answered HTTP 503 for parallel info: busy"),
     "bootstrap server 10.0.0.1:8998 answered HTTP 503 for parallel info: busy"),
    (BootstrapNoRoute("no route for encode rank 0 in dp group 0 at 10.0.0.1:8998"),
     "no route for encode rank 0 in dp group 0 at 10.0.0.1:8998"),
], ids=["refused", "unresolvable", "no answer", "HTTP status", "no route yet"])
def test_a_wait_that_times_out_names_what_never_happened_the_last_reason_and_what_to_do(failure, said):
    clock = Clock(try_s=2.0)  # each try waits out its bound
    attempt, bounds = _tries(clock, [failure], then_ready=False)
    with pytest.raises(BootstrapError) as raised:
        _wait(clock, attempt, timeout_s=30.0)
    assert str(raised.value) == f"{NEVER} within 30s ({len(bounds)} tries), the last: {said}: {FIX}"
    assert all(0.05 <= bound <= 2.0 for bound in bounds), bounds  # each try within what is left, at most 2 s


def test_a_wait_whose_one_try_took_it_all_says_one_try():
    clock = Clock(try_s=30.0)  # the one try waits out the whole wait
    attempt, bounds = _tries(clock, [_unreachable(TimeoutError("timed out"))], then_ready=False)
    with pytest.raises(BootstrapError) as raised:
        _wait(clock, attempt, timeout_s=30.0)
    assert len(bounds) == 1
    assert str(raised.value) == f"{NEVER} within 30s (1 try), the last: no answer (timed out): {FIX}"


def test_each_try_is_given_what_is_left_of_the_wait_at_most_two_seconds():
    clock = Clock(try_s=0.7)
    starts: list[float] = []
    failure = _unreachable(TimeoutError("timed out"))

    def attempt(bound_s: float) -> None:
        starts.append(bound_s)
        assert bound_s == max(0.05, min(2.0, 1003.0 - clock.now)), (bound_s, clock.now)
        clock.now += 0.7
        raise failure

    with pytest.raises(BootstrapError):
        _wait(clock, attempt, timeout_s=3.0)
    assert starts[0] == 2.0 and min(starts) < 2.0


@pytest.mark.parametrize("bootstrap_timeout, rank_left, bound", [
    (120.0, 599.97, (120.0, "--bootstrap-timeout")),
    (120.0, 29.96, (30.0, "--timeout")),  # the rank's alarm comes first
])
def test_a_rank_waits_at_its_start_within_the_bound_that_ends_it_first(bootstrap_timeout, rank_left, bound):
    assert cli._start_bound(bootstrap_timeout, rank_left) == bound


def test_a_wait_the_ranks_timeout_ends_first_names_that_option_and_is_left_to_its_alarm():
    clock = Clock()
    attempt, _ = _tries(clock, [_unreachable(ConnectionRefusedError(111, "Connection refused"))] * 60)
    lines: list[str] = []
    cli._waited(WHO, WHAT, 120.0, attempt, NEVER, FIX, say=lines.append, clock=clock, sleep=clock.sleep,
                ends=(30.0, "--timeout"))
    assert lines[0].startswith(f"{WHO}: waiting up to 30s (--timeout, until "), lines
    # Every quarter of those 30 s; the wait itself goes on (--timeout's alarm, not the wait, ends the rank).
    assert [line.split(": ", 2)[2].split(",")[0] for line in lines[1:-1]] == ["8s of 30s", "15s of 30s",
                                                                             "23s of 30s"]
    assert lines[-1].startswith(f"{WHO}: done waiting for {WHAT}, after 29s (61 tries)"), lines[-1]


def test_the_two_look_ups_of_a_prefill_ranks_try_for_its_route_share_the_tries_bound(monkeypatch):
    """A server that answers the sizes late and never answers the route: each try's route look-up gets what is
    left of the try's bound after the sizes took theirs (0.05 s at least), so --bootstrap-timeout 1 ends the
    wait after about 1 s, not after the two look-ups' bounds together."""
    import functools

    import transfer.bootstrap
    from fakes import FakeTime

    clock = FakeTime(100.0)
    monkeypatch.setattr(transfer.bootstrap, "time", clock)
    monkeypatch.setattr(cli, "time", clock)
    lines: list[str] = []
    monkeypatch.setattr(cli, "_waited", functools.partial(cli._waited, say=lines.append, clock=clock.monotonic,
                                                          sleep=clock.sleep))
    asked: list[tuple[str, float, float]] = []

    def late_then_silent(self, method, path, body=None, headers=None, timeout=None, answered=None):
        sizes = "engine_rank=-1" in path
        asked.append(("sizes" if sizes else "route", clock.now, timeout))
        if sizes:
            clock.now += 0.9 * timeout
            return 200, b'{"prefill_tp_size": 1, "prefill_dp_size": 1}'
        clock.now += timeout
        raise TimeoutError("timed out")

    monkeypatch.setattr(transfer.bootstrap.BootstrapClient, "_request", late_then_silent)
    with pytest.raises(BootstrapError, match=rf"^{NEVER} within 1s \(1 try\), the last: .*timed out"):
        cli._wait_for_route(WHO, "10.0.0.1:8998", 0, 1.0)
    assert [what for what, _, _ in asked] == ["sizes", "route"], asked
    assert asked[1][2] == pytest.approx(0.1), asked
    assert clock.now <= 101.0 + 1e-9, clock.now

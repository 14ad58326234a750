"""`demo` and `bench` stop once, as a rank does: the first stop signal (Ctrl-C, SIGTERM, SIGHUP) unwinds the run,
which then stops its ranks, and one that comes meanwhile is noted, not raised, so it cannot cut that stop
short (ranks neither waited for nor killed), and the exit status is the first signal's. The signals are
raised in this process, on the test's thread, where their handlers run."""

from __future__ import annotations

import signal

import pytest

from transfer import bench, cli, harness

COMMANDS = {"demo": ["demo", "--protocol", "wire", "--items", "1", "--span", "1", "--hidden", "8"],
            "bench": ["bench", "--paths", "wire"]}


def _stopped_while_stopping(first: signal.Signals, second: signal.Signals, steps: list[str]):
    """A run (harness.run, bench.main) that the first signal stops, and the second while it stops its ranks."""

    def run(*_args, **_kwargs):
        try:
            _raise(first)
            steps.append("ran on past the first signal")
        finally:  # where the run stops its ranks (harness._stop, RankSet.close)
            _raise(second)
            steps.append("ranks stopped")

    return run


def _raise(sig: signal.Signals) -> None:
    """Raises `sig` in this process, where a handler of the command's takes it (by default it would end
    the test's process)."""
    assert callable(signal.getsignal(sig)), f"{sig.name} is taken by no handler: {signal.getsignal(sig)}"
    signal.raise_signal(sig)


def _run_stopped(command: str, first: signal.Signals, second: signal.Signals, monkeypatch) -> tuple[int, list[str]]:
    steps: list[str] = []
    run = _stopped_while_stopping(first, second, steps)
    monkeypatch.setattr(harness, "run", run)
    monkeypatch.setattr(bench, "main", run)
    return cli.main(COMMANDS[command]), steps


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("first, second", [
    (signal.SIGINT, signal.SIGINT), (signal.SIGINT, signal.SIGTERM),
    (signal.SIGTERM, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM),
    (signal.SIGHUP, signal.SIGINT), (signal.SIGINT, signal.SIGHUP),
], ids=lambda s: s.name)
def test_a_second_stop_signal_while_the_run_stops_its_ranks_is_noted_not_raised(command, first, second,
                                                                                  monkeypatch, capfd):
    code, steps = _run_stopped(command, first, second, monkeypatch)
    assert steps == ["ranks stopped"], steps
    assert code == 128 + first, f"exit {code} after {first.name} then {second.name}"
    err = capfd.readouterr().err
    said = "interrupted" if first == signal.SIGINT else f"stopped by {first.name}"
    assert f"epd-transfer {command}: {said}\n" in err, err
    assert f"{second.name} ignored: already stopping (SIGKILL ends it at once)" in err, err


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("ignored", [signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_ignored_when_the_run_started_stays_ignored(command, ignored, monkeypatch):
    signal.signal(ignored, signal.SIG_IGN)  # a background job's Ctrl-C, nohup's SIGHUP
    steps: list[str] = []

    def run(*_args, **_kwargs):
        signal.raise_signal(ignored)
        steps.append("ran on past an ignored signal")
        raise RuntimeError("the run failed")

    monkeypatch.setattr(harness, "run", run)
    monkeypatch.setattr(bench, "main", run)
    assert cli.main(COMMANDS[command]) == 1
    assert steps == ["ran on past an ignored signal"]
    assert signal.getsignal(ignored) is signal.SIG_IGN

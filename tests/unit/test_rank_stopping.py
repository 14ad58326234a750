"""A rank stops once: the first stop signal (or its --timeout) unwinds it, and one that comes while it
unwinds is noted, not raised, so it cannot cut its closing short halfway (a route left listed, rooms
never failed). The handlers run here as the signal would run them, on the test's thread."""

from __future__ import annotations

import signal

import pytest

from transfer import cli


@pytest.fixture
def rank_handlers():
    """The handlers `epd-transfer rank` installs (conftest.py puts back those before)."""
    for stop in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(stop, cli._raise_stopped)
    signal.signal(signal.SIGALRM, cli._raise_rank_timeout)


@pytest.mark.parametrize("first", ["SIGTERM", "--timeout"])
def test_a_stop_signal_while_the_rank_unwinds_is_noted_not_raised(rank_handlers, capfd, first):
    signal.setitimer(signal.ITIMER_REAL, 1000.0)  # the rank's --timeout, armed
    if first == "SIGTERM":
        with pytest.raises(cli._Stopped):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    else:
        with pytest.raises(cli._RankTimeout):
            signal.getsignal(signal.SIGALRM)(signal.SIGALRM, None)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), "--timeout still armed while unwinding"
    for stop in cli._STOP_SIGNALS:
        handler = signal.getsignal(stop)
        assert handler is cli._noted_while_stopping, (stop, handler)
        handler(stop, None)  # raises nothing: the unwinding goes on
    err = capfd.readouterr().err
    assert "SIGTERM ignored: already stopping (SIGKILL ends it at once)" in err


def test_a_stop_signal_ignored_when_the_rank_started_stays_ignored_while_it_unwinds(rank_handlers):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    with pytest.raises(cli._Stopped):
        cli._raise_stopped(signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN

"""Holds every unit test to its rule: no sockets, threads, processes or sleeps (those belong in tests/live)."""

from __future__ import annotations

import multiprocessing.process
import os
import signal
import subprocess
import threading
import time

import pytest
import pytest_socket
from hypothesis import HealthCheck, settings

# Speed is the benchmarks' to measure, never a unit test's: Hypothesis's per-example deadline (200 ms)
# and its too-slow health check would fail a correct test on a loaded host.
settings.register_profile("unit", deadline=None, suppress_health_check=[HealthCheck.too_slow])
# `pytest --hypothesis-profile=fuzz`: the property tests with a hundred times their examples (minutes, not seconds).
settings.register_profile("fuzz", settings.get_profile("unit"), max_examples=10_000,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                 HealthCheck.data_too_large])
settings.load_profile("unit")


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test must not {what}; a test that needs to belongs in tests/live")
    return refuse


@pytest.fixture(autouse=True)
def _pure(monkeypatch):
    """Refuses sockets (pytest-socket), threads, processes and sleeps for the test's duration."""
    pytest_socket.disable_socket()
    monkeypatch.setattr(threading.Thread, "start", _refuse("start a thread"))
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("start a process"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("start a process"))
    monkeypatch.setattr(os, "fork", _refuse("fork"))
    monkeypatch.setattr(time, "sleep", _refuse("sleep"))
    yield
    pytest_socket.enable_socket()


#: The signals whose handlers a command run in the test process sets (`epd-transfer demo`, `bench` and `rank`).
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)


@pytest.fixture(autouse=True)
def _signal_handlers_kept():
    """Puts back the handlers a command under test set, and disarms the timer a rank's --timeout arms, so the
    next test and pytest itself take a Ctrl-C or a SIGTERM as before (not as a command that is stopping would)."""
    before = {sig: signal.getsignal(sig) for sig in _HANDLED}
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    for sig, handler in before.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)

"""The rules tests/unit/conftest.py holds every unit test to."""

from __future__ import annotations

import os
import threading
import time

import pytest
from hypothesis import HealthCheck, settings


def test_no_hypothesis_deadline_or_too_slow_check():
    """A slow example on a loaded host is not a failure: timing is for the benchmarks."""
    assert settings.default.deadline is None
    assert HealthCheck.too_slow in settings.default.suppress_health_check


@pytest.mark.parametrize("act", [
    lambda: time.sleep(0),
    lambda: threading.Thread(target=lambda: None).start(),
    lambda: os.fork(),
], ids=["sleep", "thread", "fork"])
def test_sleeps_threads_and_forks_are_refused(act):
    with pytest.raises(AssertionError, match="belongs in tests/live"):
        act()

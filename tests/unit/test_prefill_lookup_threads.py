"""The prefill driver's look-up threads: one that cannot start is not kept."""

from __future__ import annotations

import threading

import pytest

from transfer.core.prefill import LookUpParallel
from transfer.drive.prefill import _LookUps


def test_a_look_up_thread_that_cannot_start_is_not_joined_on_close(monkeypatch):
    def cannot_start(thread):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    lookups = _LookUps("t", 1.0, lambda: 0.0, lambda result: None, 4)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        lookups.submit(LookUpParallel("127.0.0.1:1"))
    lookups.close(0.0)

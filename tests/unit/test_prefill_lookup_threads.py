"""The prefill driver's look-up threads: one that cannot start is not kept, and never raises out of submit():
with none running its look-up fails at once naming the thread limit; else a running one takes it."""

from __future__ import annotations

import threading

from transfer.core.prefill import LookUpParallel, LookUpRoute
from transfer.drive.prefill import _LookUps


def _cannot_start(thread: threading.Thread) -> None:
    raise RuntimeError("can't start new thread")


def test_a_look_up_thread_that_cannot_start_fails_its_look_up_and_is_not_joined_on_close(monkeypatch):
    monkeypatch.setattr(threading.Thread, "start", _cannot_start)
    delivered: list[tuple] = []
    lookups = _LookUps("t", 1.0, lambda: 0.0, delivered.append, 4)
    lookups.submit(LookUpParallel("127.0.0.1:1"))
    lookups.submit(LookUpRoute(("127.0.0.1:2", 0, 3)))
    assert [result[:3] for result in delivered] == [("failed", "127.0.0.1:1", None),
                                                    ("failed", "127.0.0.1:2", ("127.0.0.1:2", 0, 3))]
    for result in delivered:
        assert result[3].startswith("cannot start a thread to look it up (RuntimeError: can't start new thread)")
        assert "raise it (ulimit -u, the container's pids limit)" in result[3], result[3]
    assert lookups.close(0.0) == []


def test_a_look_up_no_new_thread_can_start_for_waits_for_a_running_one(monkeypatch):
    started: list[threading.Thread] = []
    monkeypatch.setattr(threading.Thread, "start", lambda thread: started.append(thread))  # runs nothing
    delivered: list[tuple] = []
    lookups = _LookUps("t", 1.0, lambda: 0.0, delivered.append, 4)
    lookups.submit(LookUpParallel("127.0.0.1:1"))
    monkeypatch.setattr(threading.Thread, "start", _cannot_start)
    lookups.submit(LookUpParallel("127.0.0.1:2"))
    assert len(started) == 1 and delivered == []
    assert [job.bootstrap_addr for job in lookups._jobs] == ["127.0.0.1:1", "127.0.0.1:2"]

"""transfer._io.ThrottledLog: complaints about peers, at most one per kind per interval."""

from __future__ import annotations

import logging

import pytest

from transfer import _io


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(_io.time, "monotonic", lambda: now[0])
    return now


def test_each_kind_logs_once_per_interval_then_counts_what_it_left_out(clock, caplog):
    logger = logging.getLogger("test.throttled")
    throttled = _io.ThrottledLog(logger, interval_s=1.0)
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        for _ in range(1000):
            throttled.warning("bad room", "dropped: %s", "bad room")
        throttled.warning("bad rank", "dropped: %s", "bad rank")  # another kind logs at once
        assert caplog.messages == ["dropped: bad room", "dropped: bad rank"]
        clock[0] += 0.5
        throttled.warning("bad room", "dropped: %s", "bad room")
        assert len(caplog.messages) == 2
        clock[0] += 0.6
        throttled.warning("bad room", "dropped: %s", "bad room")
        assert caplog.messages[-1] == "dropped: bad room (and 1000 more like it in the last 1.1s, not logged)"
        clock[0] += 5
        throttled.warning("bad room", "dropped: %s", "bad room")
        assert caplog.messages[-1] == "dropped: bad room"  # nothing was left out since


def test_repeats_told_long_after_their_kind_last_logged_say_how_long(clock, caplog):
    # The repeats came just after the kind's line; its next line, an hour later, tells them as the hour's.
    throttled = _io.ThrottledLog(logging.getLogger("test.throttled"), interval_s=1.0)
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        throttled.warning("bad room", "dropped: %s", "bad room")
        clock[0] += 0.5
        for _ in range(3):
            throttled.warning("bad room", "dropped: %s", "bad room")
        clock[0] += 3599.5
        throttled.warning("bad room", "dropped: %s", "bad room")
    assert caplog.messages == ["dropped: bad room",
                               "dropped: bad room (and 3 more like it in the last 3600.0s, not logged)"]


def test_kinds_are_bounded(clock, caplog):
    throttled = _io.ThrottledLog(logging.getLogger("test.throttled"), interval_s=60.0, max_kinds=8)
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        for kind in range(100):  # e.g. a peer cycling through ranks
            throttled.warning(kind, "kind %d", kind)
        assert len(throttled._kinds) <= 8
        assert len(caplog.messages) == 10  # new kinds share the line budget
        clock[0] += 61
        throttled.warning("later", "later")
    assert caplog.messages[-2:] == ["90 more warnings were not logged: at most 10 lines are logged per 60s", "later"]


def test_count_concluded_counts_by_kind_and_names_the_room_once(clock, caplog):
    # Both drivers count and log their conclusions through it: a detail that starts with its room
    # is logged "room 5 failed: ...", never "room 5 failed: room 5: ...".
    from transfer.core.failure import Failure, FailureKind
    from transfer.metrics import Metrics

    metrics = Metrics("t")
    failures = _io.ThrottledLog(logging.getLogger("test.concluded"))
    with caplog.at_level(logging.WARNING, logger="test.concluded"):
        _io.count_concluded(metrics, failures, 5, False, Failure(FailureKind.OTHER, "room 5: asking for it failed"),
                            1.0)
        _io.count_concluded(metrics, failures, 6, True, None, 0.25)
    assert caplog.messages == ["room 5 failed: asking for it failed"]
    counted = {(row["name"], row["labels"].get("reason")): row["value"] for row in metrics.snapshot()
               if row["name"] in ("t_rooms_failed_total", "t_rooms_succeeded_total")}
    assert counted[("t_rooms_failed_total", "other")] == 1 and counted[("t_rooms_succeeded_total", None)] == 1

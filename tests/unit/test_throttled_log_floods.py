"""ThrottledLog under floods a peer can provoke: few lines, every repeat counted, bounded memory."""

from __future__ import annotations

import logging
import re
import sys

import pytest

from transfer import _io

FLOOD = 10_000
SPAN_S = 2.0  # the flood arrives over two seconds


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(_io.time, "monotonic", lambda: now[0])
    return now


def _counted(messages: list[str]) -> int:
    """Warnings the lines account for: each line, plus the repeats and the untold each reports."""
    total = 0
    for message in messages:
        told = re.match(r"(\d+) more warnings were not logged", message)
        if told:
            total += int(told.group(1))
            continue
        total += 1
        repeats = re.search(r"\(and (\d+) more like it", message)
        total += int(repeats.group(1)) if repeats else 0
    return total


def _flood(throttled: _io.ThrottledLog, clock: list[float], key_of) -> None:
    for i in range(FLOOD):
        clock[0] += SPAN_S / FLOOD
        throttled.warning(key_of(i), "room 600: status from encode rank %d, expected 0; ignored", i)
    clock[0] += 5.0  # later warnings tell what the flood left untold: its kind's next line, or the next line
    throttled.warning(key_of(FLOOD), "room 600: status from encode rank %d, expected 0; ignored", FLOOD)
    throttled.warning("after", "after the flood")


@pytest.mark.parametrize("key_of", [lambda i: "wrong rank", lambda i: ("rank", i), lambda i: f"room {i} expired"],
                         ids=["one key", "a key per rank", "a key per room"])
def test_a_flood_of_one_kind_logs_a_few_lines_and_counts_every_repeat(clock, caplog, key_of):
    throttled = _io.ThrottledLog(logging.getLogger("test.flood"))
    with caplog.at_level(logging.WARNING, logger="test.flood"):
        _flood(throttled, clock, key_of)
    assert len(caplog.messages) <= 50, len(caplog.messages)
    assert _counted(caplog.messages) == FLOOD + 2
    assert len(throttled._kinds) <= 256


def test_memory_holds_no_key_and_is_bounded_whatever_the_keys(clock):
    throttled = _io.ThrottledLog(logging.getLogger("test.flood"), max_kinds=64, max_lines=FLOOD)
    long_key = "x" * (1 << 20)
    throttled.warning(long_key, "a long key")
    for i in range(FLOOD):
        throttled.warning(("rank", i), "rank %d", i)
    assert len(throttled._kinds) == 64
    assert all(type(kind) is int for kind in throttled._kinds)
    assert sys.getsizeof(throttled._kinds) < 64 << 10


def test_a_kind_logs_again_once_its_interval_passed_within_the_budget(clock, caplog):
    throttled = _io.ThrottledLog(logging.getLogger("test.flood"), interval_s=1.0, max_lines=2)
    with caplog.at_level(logging.WARNING, logger="test.flood"):
        for _ in range(3):
            throttled.warning("a", "a")
            throttled.warning("b", "b")
            throttled.warning("c", "c")  # over the budget of two lines a second
            clock[0] += 1.5
    assert caplog.messages == [
        "a", "b",
        "1 more warnings were not logged: at most 2 lines are logged per 1s", "a", "b",
        "1 more warnings were not logged: at most 2 lines are logged per 1s", "a", "b",
    ]


def test_repeats_of_a_kind_that_never_comes_back_are_told_by_a_later_warning_of_any_kind(clock, caplog):
    throttled = _io.ThrottledLog(logging.getLogger("test.flood"), interval_s=1.0)
    with caplog.at_level(logging.WARNING, logger="test.flood"):
        for _ in range(1000):
            throttled.warning("bad room", "bad room")  # one line, 999 repeats; the peer then stops
        clock[0] += 0.5
        throttled.warning("other", "other")  # the interval has not passed: nothing to tell yet
        clock[0] += 1.0
        throttled.warning("other", "other")
        clock[0] += 1.0
        throttled.warning("bad room", "bad room")  # its repeats were told: its line counts none
    assert caplog.messages == [
        "bad room", "other",
        "999 more warnings were not logged: repeats of kinds logged at most once per 1s that did not come back "
        "since",
        "other", "bad room",
    ]


def test_flush_tells_what_was_left_out_in_a_bounded_number_of_lines(clock, caplog):
    # At close no later warning comes: flush() tells the repeats and what the line budget left out.
    throttled = _io.ThrottledLog(logging.getLogger("test.flood"), interval_s=1.0, max_kinds=64)
    with caplog.at_level(logging.WARNING, logger="test.flood"):
        for i in range(FLOOD):
            throttled.warning(("rank", i % 100), "rank %d", i % 100)  # 100 kinds the peer cycles through
        logged = len(caplog.messages)
        throttled.flush()
        assert len(caplog.messages) == logged + 2
        assert _counted(caplog.messages) == FLOOD
        throttled.flush()  # nothing left to tell
    assert len(caplog.messages) == logged + 2
    assert len(throttled._kinds) <= 64

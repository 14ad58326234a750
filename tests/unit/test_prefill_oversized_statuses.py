"""A prefill driver's read of its status socket counts the messages it discards for their size (over
MAX_CONTROL_MESSAGE bytes or MAX_CONTROL_PARTS parts) among those it handles per hold of its lock: a peer
pushing nothing but such messages, faster than they are discarded, must not keep the I/O thread (or a
waiting caller) in one read, holding the lock, for as long as it keeps pushing. The reads are scripted (what
`_io.take_statuses` hands over, one answer a call); the driver is made without its I/O thread and sockets."""

from __future__ import annotations

import threading

from prefill_rooms import reading_driver

from transfer import _io
from transfer.drive import prefill as drive
from transfer.drive.prefill import PrefillDriver


def driver() -> PrefillDriver:
    """A driver with what its reads of the status socket use, and no thread or socket."""
    return reading_driver()


class Flooded(Exception):
    """The read went on far past its limit."""


def flooded(monkeypatch, limit: int, settled_first: int = 0) -> list[int]:
    """_io.take_statuses answers as it does for a message discarded for its size (nothing handed over, the
    socket not empty), every call, after `settled_first` lane Successes in the first; raises Flooded once
    called far more often than `limit` messages allow. The calls made, counted in the list returned."""
    calls: list[int] = []

    def take(sock, lanes, most):
        calls.append(most)
        if len(calls) > 4 * limit:
            raise Flooded()
        settled = settled_first if len(calls) == 1 else 0
        return list(range(settled)), None, False

    monkeypatch.setattr(_io, "take_statuses", take)
    return calls


def test_messages_discarded_for_their_size_count_toward_the_limit_of_a_hold(monkeypatch):
    d = driver()
    calls = flooded(monkeypatch, drive.STATUSES_PER_HOLD)
    assert d._take_statuses(drive.STATUSES_PER_HOLD) == ([], True)
    assert len(calls) == drive.STATUSES_PER_HOLD
    assert d._statuses_left is True and d._drained is False


def test_a_discard_after_lane_successes_counts_with_them(monkeypatch):
    d = driver()
    calls = flooded(monkeypatch, 8, settled_first=3)
    assert d._take_statuses(8) == ([], True)
    assert len(calls) == 1 + (8 - 3 - 1)  # the first call read 3 Successes and 1 discard
    assert d._drained is False


def test_the_io_threads_drain_returns_under_a_flood_of_discards(monkeypatch):
    d = driver()
    d._stopping, d._lock = False, threading.Lock()
    calls = flooded(monkeypatch, drive.DRAIN_BATCH)
    d._drain_statuses()
    assert len(calls) == drive.DRAIN_BATCH

"""A prefill driver whose close() gave up on a thread stuck inside a step (the caller's metrics exporter that
hangs, say): close() failed its rooms and gave their memory to its quarantine from then on, without a cancel. When
that thread returns, no ask may leave for any of those rooms: a write it called for could land in memory the pool
has leased to another room by then (or the caller reused, told safe_to_reuse). Here the thread stuck is the I/O
thread inside one room's conclusion, with another room's ask next in the same step, or a caller's receive() inside
its room's count, before its ask.

A driver with neither its thread nor real sockets (as in test_prefill_driver_plain_ask): the encode address's
socket and monitor are fakes, through the transfer._io calls the driver makes on them."""

from __future__ import annotations

import threading
from collections import deque

import pytest
from prefill_rooms import BOOT, ENCODE, KEY0, core, spec

from transfer import _io
from transfer.core.failure import Failure, FailureKind
from transfer.core.prefill import Conclude, SendAsk
from transfer.drive import prefill as drive
from transfer.drive.prefill import PrefillDriver, Room
from transfer.metrics import Metrics
from transfer.status import TransferPoll


class _Socket:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []


class _Waker:
    def wake(self) -> None:
        pass


class _Stuck(Metrics):
    """The caller's metrics: counting `counter` takes so long that close() gives up on the thread meanwhile (it
    marks the driver stopping, as close() does when it cannot take the lock)."""

    def __init__(self, counter: str) -> None:
        super().__init__("epd_prefill")
        self.counter = counter
        self.driver: PrefillDriver | None = None

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        if name == self.counter and self.driver is not None:
            self.driver._stopping = True
        super().inc(name, amount, **labels)


@pytest.fixture
def fake_links(monkeypatch):
    def send_frames(sock: _Socket, frames: list[bytes]) -> None:
        sock.sent.append(frames)

    monkeypatch.setattr(_io, "send_frames", send_frames)
    monkeypatch.setattr(_io, "send_ask", lambda sock, info: send_frames(sock, info.to_frames()))
    monkeypatch.setattr(_io, "dropped", lambda monitor: False)


def _driver(metrics: _Stuck) -> PrefillDriver:
    """A driver whose core routed rank 0 (at ENCODE) and announced the main region there; its I/O thread is this
    one."""
    driver = PrefillDriver.__new__(PrefillDriver)
    driver.engine_rank, driver.clock = 0, lambda: 5.0
    driver.metrics, driver.core, driver.rooms = metrics, core(), {}
    driver.table, driver.conclusions, driver._watcher = drive.RoomTable(), _io.Conclusions(), None
    driver._complaints = driver._failures = _io.ThrottledLog(drive.log)
    driver._lock, driver._stopping, driver.failure, driver._forks = threading.Lock(), False, None, drive._forks.count
    driver._sockets, driver._monitors, driver._used_at, driver._watching = {}, {}, {}, {}
    driver._cancels_out, driver._resync, driver._wake_at = deque(), False, 0.0
    driver._waker, driver._thread, driver._verifies = _Waker(), threading.current_thread(), deque()
    driver._sockets[ENCODE], driver._monitors[ENCODE] = _Socket(), object()
    first = driver.core
    first.receive(0.0, spec(999))
    first.parallel_resolved(0.0, BOOT, 1, 1)
    driver._carry(0.0, first.route_resolved(0.0, KEY0, ENCODE))  # the announcement and room 999's ask
    first.clear(0.0, 999)
    driver._sockets[ENCODE].sent.clear()
    metrics.driver = driver
    return driver


def _file(driver: PrefillDriver, room: int) -> tuple[Room, list]:
    """Room `room` received by the core and filed: its record and the actions that start it."""
    token, actions = driver.core.receive(1.0, spec(room, slot=room))
    record = Room(room, 1.0, 64, None, token)
    driver.rooms[room] = record
    driver.table.start(room, TransferPoll.Bootstrapping)
    return record, actions


def test_an_ask_after_a_conclusion_that_outlasted_close_does_not_leave(fake_links):
    driver = _driver(_Stuck("rooms_failed_total"))
    failing, _ = _file(driver, 6)
    asking, actions = _file(driver, 5)
    assert [type(action) for action in actions] == [SendAsk]
    failure = Failure(FailureKind.DEADLINE, "room 6: no status")
    with driver._lock:  # the I/O thread's step: room 6 fails (its count hangs past close()), room 5's ask is next
        driver._carry(2.0, [*driver.core.fail(2.0, 6, failing.token, failure), *actions])
    assert driver._stopping
    assert driver._sockets[ENCODE].sent == [], "an ask left after close() gave its room up"


def test_a_receive_whose_count_outlasted_close_sends_no_ask(fake_links):
    driver = _driver(_Stuck("rooms_started_total"))
    token, actions = driver.core.receive(1.0, spec(5, slot=5))
    driver.core.clear(1.0, 5, token)  # only to see that the room's start is the plain lone ask
    assert [type(action) for action in actions] == [SendAsk]
    record = Room(5, 1.0, 64, None)
    driver.receive(record, spec(5, slot=5))  # its count of the start hangs past close()
    assert driver._stopping
    assert driver._sockets[ENCODE].sent == [], "an ask left after close() gave its room up"

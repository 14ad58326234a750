"""The prefill driver's receive(): the lone ask it sends itself (`_ask_plain`) ends as _carry() would carry it.

A driver with neither its thread nor real sockets: each encode address's socket and monitor are fakes whose
send and drop reports the test picks, through the transfer._io calls the driver makes on them.
"""

from __future__ import annotations

import threading
from collections import deque

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from fakes import Region, Regions
from prefill_rooms import BOOT, ENCODE, KEY0, MAIN, core, spec

from transfer import _io
from transfer.drive import prefill as drive
from transfer.drive.prefill import PrefillDriver, Room
from transfer.frames import TransferInfo
from transfer.metrics import Metrics
from transfer.status import TransferPoll

OTHER = ("10.0.0.4", 7001)
FRESH = Regions(Region(0x900000, 1 << 20))


class _Socket:
    """A socket to an encode address: what it was sent, and what its next send does."""

    def __init__(self, send: str) -> None:
        self.send = send  # "ok", "again" or "error"
        self.sent: list[list[bytes]] = []


class _Monitor:
    def __init__(self, drop: bool) -> None:
        self.drop = drop


class _LookUps:
    def __init__(self) -> None:
        self.submitted: list = []

    def submit(self, action: object) -> None:
        self.submitted.append(action)


class _Waker:
    def __init__(self) -> None:
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1


def _send_frames(sock: _Socket, frames: list[bytes]) -> None:
    if sock.send == "again":
        raise zmq.Again()
    if sock.send == "error":
        raise RuntimeError("the socket broke")
    sock.sent.append(frames)


def _send_ask(sock: _Socket, info: TransferInfo) -> None:
    _send_frames(sock, info.to_frames())


def _dropped(monitor: _Monitor) -> bool:
    lost, monitor.drop = monitor.drop, False
    return lost


def _driver(send: str, drop: bool, watched: bool, cancel_queued: bool, socket: bool) -> PrefillDriver:
    """A driver whose core routed rank 0 (at ENCODE) and announced the main region there."""
    driver = PrefillDriver.__new__(PrefillDriver)
    driver.engine_rank, driver.clock = 0, lambda: 5.0
    driver.metrics, driver.core, driver.rooms = Metrics("epd_prefill"), core(), {}
    driver.table, driver.conclusions, driver._watcher = drive.RoomTable(), _io.Conclusions(), None
    driver._complaints = driver._failures = _io.ThrottledLog(drive.log)
    driver._lock, driver._stopping, driver.failure, driver._forks = threading.Lock(), False, None, drive._forks.count
    driver._sockets, driver._monitors, driver._used_at, driver._watching = {}, {}, {}, {}
    driver._cancels_out, driver._resync, driver._wake_at = deque(), False, 0.0
    driver._lookups, driver._waker, driver._thread, driver._verifies = _LookUps(), _Waker(), None, deque()
    driver._sockets[ENCODE], driver._monitors[ENCODE] = _Socket("ok"), _Monitor(False)
    first = driver.core
    first.receive(0.0, spec(999))
    first.parallel_resolved(0.0, BOOT, 1, 1)
    driver._carry(0.0, first.route_resolved(0.0, KEY0, ENCODE))  # the announcement and room 999's ask
    driver.core.clear(0.0, 999)
    sock = driver._sockets[ENCODE]
    sock.send, driver._monitors[ENCODE].drop = send, drop
    if watched:
        driver._watching[sock] = ENCODE
    if cancel_queued:
        driver._cancels_out.append(drive.SendCancel(OTHER, 1, 0, 1, [b"cancel"]))
    if not socket:
        del driver._sockets[ENCODE], driver._monitors[ENCODE]
    return driver


def _outcome(driver: PrefillDriver, record: Room) -> tuple:
    room = record.room
    return (driver.core.stage(room), driver.table.get(room), driver.table.failure(room), record.token,
            record.asked_at, record.concluded_at, room in driver.rooms, dict(driver._used_at), driver._resync,
            [(addr, sock.sent) for addr, sock in driver._sockets.items()], driver.core.waiting(ENCODE),
            driver._lookups.submitted, list(driver._cancels_out), driver._waker.woken, driver.metrics.snapshot())


def _general(driver: PrefillDriver, now: float, action: object, record: Room) -> list:
    driver.table.start(record.room, TransferPoll.Bootstrapping)
    return driver._carry(now, [action])


@pytest.fixture
def fake_links(monkeypatch):
    monkeypatch.setattr(_io, "send_frames", _send_frames)
    monkeypatch.setattr(_io, "send_ask", _send_ask)
    monkeypatch.setattr(_io, "dropped", _dropped)
    monkeypatch.setattr(_io, "push_socket", lambda *a, **kw: _Socket("ok"))
    monkeypatch.setattr(_io, "watch_drops", lambda sock: _Monitor(False))


# The fakes the fixture puts in place keep no state: every example may share them.
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(room=st.integers(0, 2**63 - 1).filter(lambda r: r != 999), send=st.sampled_from(["ok", "again", "error"]),
       drop=st.booleans(), watched=st.booleans(), cancel_queued=st.booleans(), socket=st.booleans(),
       fresh_region=st.booleans(), slot=st.integers(0, 100))
def test_a_receive_ends_as_its_ask_carried_by_carry_would(fake_links, room, send, drop, watched, cancel_queued,
                                                          socket, fresh_region, slot):
    outcomes = []
    for plain in (True, False):
        driver = _driver(send, drop, watched, cancel_queued, socket)
        if not plain:  # the general path: the room started at Bootstrapping, every action through _carry()
            driver._ask_plain = lambda now, action, record, d=driver: _general(d, now, action, record)
        record = Room(room, started_at=5.0, nbytes=64)
        room_spec = spec(room, slot=slot, regions=FRESH if fresh_region else MAIN)  # FRESH: announced first
        try:
            driver.receive(record, room_spec)
        except Exception as exc:  # noqa: BLE001 - the same error either way
            outcomes.append(repr(exc))
            continue
        outcomes.append(_outcome(driver, record))
    assert outcomes[0] == outcomes[1]


def test_the_plain_ask_is_sent_by_receive_itself(fake_links):
    driver = _driver("ok", drop=False, watched=False, cancel_queued=False, socket=True)
    driver._carry = None  # the plain ask needs no carry
    record = Room(7, started_at=5.0, nbytes=64)
    driver.receive(record, spec(7, slot=7))
    [frames] = driver._sockets[ENCODE].sent[2:]  # after the announcement and room 999's ask
    assert frames[0] == b"7" and record.asked_at == 5.0 and driver.core.stage(7) == "asked"

"""Status pushers (transfer._io.Pushers) over real ZMQ: thousands of dead receivers, a restarted
receiver at the same address, and a new receiver that must always be served."""

from __future__ import annotations

import logging
import os
import time

import zmq

from transfer import _io
from transfer.frames import parse_status, status_frames

DEAD = 5000


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _cpu_s() -> float:
    """This process's user + system CPU seconds, from /proc/self/stat."""
    with open("/proc/self/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _collect(pull: zmq.Socket, until, limit: float = 10.0) -> list[list[bytes]]:
    """Messages from `pull` until `until(messages)` holds or `limit` seconds pass."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + limit
    while not until(got) and time.monotonic() < deadline:
        frames = _io.recv_frames(pull)
        if frames is None:
            time.sleep(0.002)
        else:
            got.append(frames)
    return got


def _dead_endpoint(i: int) -> tuple[str, int]:
    """A loopback address nobody listens on (127.1.x.y, port 9)."""
    return f"127.1.{i // 250}.{1 + i % 250}", 9


def test_a_new_receiver_is_served_after_thousands_of_dead_ones():
    pushers = _io.Pushers(connect_s=1.0)
    pull, port = _io.pull_socket("127.0.0.1", 0)
    fds_before = _fds()
    try:
        for i in range(DEAD):
            pushers.send(*_dead_endpoint(i), status_frames(i, 0, 0))
        assert len(pushers) <= pushers.limit < _io.CONTEXT_MAX_SOCKETS // 4
        # The sockets closed to make room let go of their descriptors once ZMQ's reaper thread ran.
        deadline = time.monotonic() + 10
        while _fds() - fds_before > 3 * pushers.limit and time.monotonic() < deadline:
            time.sleep(0.05)
        fds_flood = _fds() - fds_before
        assert fds_flood <= 3 * pushers.limit, fds_flood
        assert pushers.send("127.0.0.1", port, status_frames(600, 4, 0))
        got = _collect(pull, lambda got: got)
        assert [parse_status(f)[:3] for f in got] == [(600, 4, 0)]
        # Unreachable endpoints are closed after connect_s; only the live receiver's stays.
        deadline = time.monotonic() + 10
        while len(pushers) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pushers) == 1
        # ZMQ's reaper thread closes a closed socket's descriptors a moment later.
        deadline = time.monotonic() + 10
        while _fds() - fds_before > 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        fds_settled = _fds() - fds_before
        cpu = _cpu_s()
        time.sleep(1.0)
        idle_cpu = _cpu_s() - cpu
        print(f"fds: +{fds_flood} during {DEAD} dead endpoints, +{fds_settled} after; "
              f"idle CPU {idle_cpu:.3f} s over 1 s; dropped {pushers.dropped}")
        assert fds_settled <= 8, fds_settled
        assert pushers.dropped == DEAD  # every dead receiver's status, none of the live one's
    finally:
        pushers.close()
        pull.close(0)


def test_a_restarted_receiver_at_the_same_address_never_gets_what_was_pushed_while_it_was_down():
    pull, port = _io.pull_socket("127.0.0.1", 0)
    pushers = _io.Pushers()
    try:
        assert pushers.send("127.0.0.1", port, status_frames(1, 4, 0))
        assert [parse_status(f)[0] for f in _collect(pull, lambda got: got)] == [1]
        pull.close(0)  # the receiver dies
        time.sleep(0.3)  # ZMQ notices the connection went down
        for room in range(100, 130):
            pushers.send("127.0.0.1", port, status_frames(room, 0, 0))  # Failed, for nobody
        successor, _ = _io.pull_socket("127.0.0.1", port)
        pull = successor
        marker = 1000
        deadline = time.monotonic() + 10
        got: list[list[bytes]] = []
        while time.monotonic() < deadline and not any(parse_status(f)[0] >= 1000 for f in got):
            pushers.send("127.0.0.1", port, status_frames(marker, 4, 0))
            marker += 1
            got += _collect(pull, lambda got: got, limit=0.05)
        rooms = [parse_status(f)[0] for f in got]
        assert rooms and all(room >= 1000 for room in rooms), rooms
    finally:
        pushers.close()
        pull.close(0)


def test_statuses_pushed_before_a_new_connection_is_up_arrive_in_order():
    pull, port = _io.pull_socket("127.0.0.1", 0)
    pushers = _io.Pushers()
    try:
        for room in range(50):
            assert pushers.send("127.0.0.1", port, status_frames(room, 4, 0))
        got = _collect(pull, lambda got: len(got) == 50)
        assert [parse_status(f)[0] for f in got] == list(range(50))
        assert pushers.dropped == 0
    finally:
        pushers.close()
        pull.close(0)


def test_close_lets_waiting_statuses_go_out_within_the_linger():
    pull, port = _io.pull_socket("127.0.0.1", 0)
    pushers = _io.Pushers()
    try:
        pushers.send("127.0.0.1", port, status_frames(7, 0, 0))
        pushers.close(linger_ms=2000)
        assert [parse_status(f)[0] for f in _collect(pull, lambda got: got)] == [7]
    finally:
        pull.close(0)


def test_the_context_socket_limit_is_set():
    assert _io.context().get(zmq.MAX_SOCKETS) == _io.CONTEXT_MAX_SOCKETS
    assert _io.status_connection_limit() <= _io.CONTEXT_MAX_SOCKETS // 4


def test_a_receiver_restarted_at_the_same_address_is_served_at_once_once_it_announces_itself():
    """expect() (its registration arrived) makes the next status wait for the new connection
    rather than be dropped while ZMQ's reconnection to the address backs off."""
    pull, port = _io.pull_socket("127.0.0.1", 0)
    pushers = _io.Pushers()
    try:
        pushers.expect("127.0.0.1", port)
        assert pushers.send("127.0.0.1", port, status_frames(1, 4, 0))
        assert [parse_status(f)[0] for f in _collect(pull, lambda got: got)] == [1]
        pull.close(0)
        time.sleep(2.5)  # down long enough for the reconnection pause to reach its longest
        pushers.send("127.0.0.1", port, status_frames(2, 0, 0))  # for nobody: dropped
        pull, _ = _io.pull_socket("127.0.0.1", port)
        pushers.expect("127.0.0.1", port)
        assert pushers.send("127.0.0.1", port, status_frames(3, 4, 0))
        assert [parse_status(f)[0] for f in _collect(pull, lambda got: got)] == [3]
        assert pushers.dropped == 1
    finally:
        pushers.close()
        pull.close(0)


def test_expect_leaves_a_live_connection_as_it_is():
    pull, port = _io.pull_socket("127.0.0.1", 0)
    pushers = _io.Pushers()
    try:
        for room in range(20):
            pushers.send("127.0.0.1", port, status_frames(room, 4, 0))
            pushers.expect("127.0.0.1", port)
        got = _collect(pull, lambda got: len(got) == 20)
        assert [parse_status(f)[0] for f in got] == list(range(20))
    finally:
        pushers.close()
        pull.close(0)


def test_close_tells_every_status_it_dropped_in_a_bounded_number_of_lines(caplog):
    # Each endpoint whose statuses close() drops is a repeat of one warning: one line, and the
    # count of the others (no later warning would tell it).
    pushers = _io.Pushers(connect_s=10.0)
    with caplog.at_level(logging.WARNING, logger=_io.log.name):
        for i in range(3):
            pushers.send(*_dead_endpoint(i), status_frames(i, 0, 0))
        pushers.close()
    said = [m for m in caplog.messages if "its connection did not come up before close()" in m]
    told = [m for m in caplog.messages if "more warnings were not logged" in m]
    assert len(said) == 1 and told == ["2 more warnings were not logged: repeats of kinds logged at most once per "
                                       "1s that did not come back since"], caplog.messages


def test_endpoints_that_cannot_be_connected_to_or_never_come_up_leave_a_live_connection_open():
    # A peer naming a host that is no IP address, or an address nobody listens at, in each of its
    # messages must not close the connection of a receiver that is up (and the statuses on it).
    pull, port = _io.pull_socket("127.0.0.1", 0)
    pushers = _io.Pushers(limit=4)
    try:
        pushers.send("127.0.0.1", port, status_frames(0, 4, 0))
        assert len(_collect(pull, lambda got: len(got) == 1)) == 1
        live = pushers._sockets[("127.0.0.1", port)]
        for i in range(50):
            assert not pushers.send(f"name{i}.invalid", 9, status_frames(i, 0, 0))
            pushers.send(*_dead_endpoint(i), status_frames(i, 0, 0))
        assert pushers._sockets.get(("127.0.0.1", port)) is live
        pushers.send("127.0.0.1", port, status_frames(1, 4, 0))
        assert [parse_status(f)[0] for f in _collect(pull, lambda got: len(got) == 1)] == [1]
    finally:
        pushers.close()
        pull.close(0)


def test_a_host_that_is_no_ip_address_closes_no_other_endpoint():
    pushers = _io.Pushers(limit=1)
    try:
        pushers.send(*_dead_endpoint(0), status_frames(0, 0, 0))  # still connecting: first to go otherwise
        for i in range(10):
            assert not pushers.send(f"name{i}.invalid", 9, status_frames(i, 0, 0))
        assert list(pushers._sockets) == [_dead_endpoint(0)]
    finally:
        pushers.close()


def test_a_count_of_dropped_statuses_that_raises_stops_neither_the_close_nor_a_send(caplog):
    # The encode driver counts drops in the caller's metrics, whose exporter may raise: close() still
    # closes every endpoint's socket and its waker, and a send() still answers False.
    def refusing(count: int) -> None:
        raise RuntimeError("exporter down")

    pushers = _io.Pushers(connect_s=10.0, on_dropped=refusing)
    for i in range(3):
        pushers.send(*_dead_endpoint(i), status_frames(i, 0, 0))
    with caplog.at_level(logging.WARNING, logger=_io.log.name):
        pushers.close()
    assert len(pushers) == 0 and pushers.dropped == 3
    assert pushers.send(*_dead_endpoint(0), status_frames(0, 0, 0)) is False
    assert any("exporter down" in m for m in caplog.messages), caplog.messages

"""The wire listener's connections and threads at their ends: a connection reset before its first
byte is no refused transfer, and a second close() returns only once every thread is joined."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

from live_helpers import wait_until
from test_wire_hostile import expect_error

from transfer import _native


def _wire_threads() -> int:
    """This process's listener threads (named epd-wire-*)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().startswith("epd-wire")
        except OSError:
            pass  # the thread ended meanwhile
    return count


def test_connections_reset_before_their_first_byte_count_as_no_refused_transfer():
    listener = _native.wire_listen("127.0.0.1", 0, 1.0, 5.0, 4096, 64)
    try:
        port = _native.wire_listener_port(listener)
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", port))
            assert wait_until(lambda: _native.wire_listener_stats(listener)["active"] == 1, 5)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
            sock.close()
            assert wait_until(lambda: _native.wire_listener_stats(listener)["active"] == 0, 5)
        stats = _native.wire_listener_stats(listener)
        assert (stats["failures"], stats["last_error"]) == (0, ""), stats
    finally:
        _native.wire_listener_close(listener)


def test_a_second_close_returns_only_once_every_listener_thread_is_joined():
    """The first close joins hundreds of connection threads; one from another thread meanwhile must
    not return before it is done (its caller may free registered memory a copy still writes)."""
    before = _wire_threads()
    listener = _native.wire_listen("127.0.0.1", 0, 5.0, 30.0, 4096, 1000, first_byte_timeout=30.0)
    port = _native.wire_listener_port(listener)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(400)]
    try:
        assert wait_until(lambda: _native.wire_listener_stats(listener)["active"] == len(socks), 10)
        go = threading.Event()
        seen: list[int] = []

        def second() -> None:
            go.wait()
            time.sleep(0.001)  # the first close is under way
            _native.wire_listener_close(listener)
            seen.append(_wire_threads() - before)

        thread = threading.Thread(target=second)
        thread.start()
        go.set()
        _native.wire_listener_close(listener)
        thread.join(30)
        assert seen == [0], f"the second close returned with {seen} listener threads still running"
    finally:
        for sock in socks:
            sock.close()


def _thread_cpu_ticks(name: str) -> int:
    """User and system clock ticks this process's threads called `name` have used."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() != name:
                    continue
            with open(f"/proc/self/task/{task}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass  # the thread ended meanwhile
    return total


def test_a_forked_child_closing_the_listener_leaves_the_parents_listener_serving():
    """A child forked from the host (multiprocessing's fork) that closes its copy of the listener, as
    its exit does, must not stop, wake or cut anything of the parent's."""
    listener = _native.wire_listen("127.0.0.1", 0, 0.5, 30.0, 4096, 4, first_byte_timeout=30.0)
    try:
        port = _native.wire_listener_port(listener)
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        with sock:
            assert wait_until(lambda: _native.wire_listener_stats(listener)["active"] == 1, 5)
            pid = os.fork()
            if pid == 0:  # the child: close its copy, then leave without running the parent's cleanup
                try:
                    _native.wire_listener_close(listener)
                finally:
                    os._exit(0)
            assert os.waitpid(pid, 0)[1] == 0
            before = _thread_cpu_ticks("epd-wire-accept")
            time.sleep(1.0)
            spent = _thread_cpu_ticks("epd-wire-accept") - before
            assert spent < os.sysconf("SC_CLK_TCK") // 2, f"the accept thread used {spent} ticks in 1 s"
            # The parent's connection is still served: a stalled header gets its timeout answer.
            sock.sendall(b"\x10\x00")
            expect_error(sock, r"^read: timed out waiting for the peer at the start of a transfer "
                         r"\(2 of 5 header bytes\)$", room=None)
        # And new connections are still taken.
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            assert wait_until(lambda: _native.wire_listener_stats(listener)["accepted"] == 2, 5)
    finally:
        _native.wire_listener_close(listener)

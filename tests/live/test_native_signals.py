"""Signals during the native wire's waits: a bounded wait stays bounded however often a signal cuts
it short (a profiler's or a watchdog's periodic timer, a host that signals threads).

- `read_frame` and `write_frame` with a timeout give up once that timeout passed without progress,
  even when a periodic timer interrupts every wait long before it ends.
- The wire listener's threads never see the host's signals: a connection that stalls mid-header is
  answered its timeout while a signal is aimed at its thread again and again.

Each test stops waiting on its own after many timeouts' worth of signals, so a wait that restarts
with every signal fails the test instead of hanging it."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import threading
import time

import pytest
from test_wire_hostile import expect_error

from transfer import _native
from transfer.wire import FrameError

TIMEOUT = 0.3  # the wait under test
TICK = 0.05  # the period of the interrupting timer, far below TIMEOUT
GIVE_UP_TICKS = 200  # ten seconds of ticks: a wait that restarts with every tick never ends


class StillWaiting(Exception):
    """Raised by the timer's handler once the wait under test outlived GIVE_UP_TICKS ticks."""


@pytest.fixture
def periodic_alarm():
    """SIGALRM every TICK seconds; its handler gives up on the wait after GIVE_UP_TICKS."""
    ticks = [0]

    def handler(*_: object) -> None:
        ticks[0] += 1
        if ticks[0] >= GIVE_UP_TICKS:
            raise StillWaiting(f"still waiting after {ticks[0]} signals")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, TICK, TICK)
    try:
        yield ticks
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)


def test_read_frame_times_out_while_a_timer_keeps_interrupting_it(periodic_alarm):
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.settimeout(TIMEOUT)
        with pytest.raises(FrameError, match=r"^read: timed out after 0\.3 s without progress$"):
            _native.read_frame(ours.fileno(), TIMEOUT, None, 0.0)
        assert periodic_alarm[0] >= 2  # the wait was interrupted, and more than once


def test_write_frame_times_out_while_a_timer_keeps_interrupting_it(periodic_alarm):
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.setblocking(False)
        try:
            while True:  # fill the peer's receive buffer and ours: the write below cannot progress
                ours.send(b"x" * 65536)
        except BlockingIOError:
            pass
        ours.settimeout(TIMEOUT)
        periodic_alarm[0] = 0
        with pytest.raises(FrameError, match=r"^write: timed out after 0\.3 s without progress$"):
            _native.write_frame(ours.fileno(), 1, (b"y" * 100_000,), TIMEOUT)
        assert periodic_alarm[0] >= 2


def _threads_named(name: str) -> list[int]:
    tids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() == name:
                    tids.append(int(task))
        except OSError:
            pass  # the thread ended meanwhile
    return tids


def test_a_stalled_connection_is_answered_its_timeout_while_its_thread_is_signalled():
    libc = ctypes.CDLL(None, use_errno=True)
    tgkill = 234  # x86-64 syscall number
    old = signal.signal(signal.SIGUSR1, lambda *_: None)  # a Python handler: no SA_RESTART
    listener = _native.wire_listen("127.0.0.1", 0, TIMEOUT, 30.0, 4096, 2, min_rate=0.0, first_byte_timeout=30.0)
    done = threading.Event()
    signalled = [0]
    try:
        sock = socket.create_connection(("127.0.0.1", _native.wire_listener_port(listener)), timeout=10)
        with sock:
            sock.sendall(b"\x10\x00")  # two of a frame header's five bytes, then silence
            deadline = time.monotonic() + 10
            while not _threads_named("epd-wire-conn") and time.monotonic() < deadline:
                time.sleep(0.01)
            tids = _threads_named("epd-wire-conn")
            assert tids, "the listener started no connection thread"

            def pester() -> None:
                while not done.wait(TICK):
                    for tid in tids:
                        libc.syscall(tgkill, os.getpid(), tid, signal.SIGUSR1)
                        signalled[0] += 1

            thread = threading.Thread(target=pester, daemon=True)
            thread.start()
            try:
                expect_error(sock, r"^read: timed out waiting for the peer at the start of a transfer "
                             r"\(2 of 5 header bytes\)$", room=None)
            finally:
                done.set()
                thread.join(5)
            assert signalled[0] >= 2
            assert _native.wire_listener_stats(listener)["failures"] == 1
    finally:
        _native.wire_listener_close(listener)
        signal.signal(signal.SIGUSR1, old)

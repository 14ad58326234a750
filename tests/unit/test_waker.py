"""The self-pipe that wakes a driver's loop: its flag and its pipe agree."""

import os
import select

from transfer._io import Waker


def _readable(waker: Waker) -> bool:
    return bool(select.select([waker.fileno()], [], [], 0)[0])


def test_a_wake_is_pending_until_drained():
    waker = Waker()
    try:
        waker.wake()
        waker.wake()  # at most one byte waits
        assert waker.pending() and _readable(waker)
        assert waker.drain(readable=False) is True
        assert not waker.pending() and not _readable(waker)
    finally:
        waker.close()


def test_a_drain_not_asked_by_the_pipe_skips_the_read_when_nothing_is_pending():
    waker = Waker()
    try:
        assert waker.drain(readable=False) is False
        assert not _readable(waker)
    finally:
        waker.close()


def test_a_byte_left_by_a_racing_wake_is_read_once_the_pipe_says_so():
    """A wake() that set its flag just before a drain cleared it writes its byte after: the
    flag is down while the pipe is readable, and only a drain told so empties it."""
    waker = Waker()
    try:
        os.write(waker._w, b"!")  # the racing wake's byte, its flag already cleared
        assert waker.drain(readable=False) is False
        assert _readable(waker)  # the caller's poll sees it ...
        assert waker.drain(readable=True) is True  # ... and drains it
        assert not _readable(waker)
        waker.wake()  # the flag is down: the next wake writes again
        assert _readable(waker)
    finally:
        waker.close()


def test_waker_never_loses_a_wake_up_racing_with_drain(monkeypatch):
    """A wake() that lands while drain() runs must not silence every later wake().

    The race is forced deterministically: the first read inside drain() lets another
    wake() in before it reads. With the flag cleared before the pipe is emptied, that
    wake-up's byte is swallowed while the flag stays set, and the loop sleeps forever.
    """
    from transfer import _io

    waker = Waker()
    real_read = os.read
    raced = []

    def read_after_a_racing_wake(fd, n):
        if not raced:
            raced.append(True)
            waker.wake()  # another thread queues work and wakes the loop right now
        return real_read(fd, n)

    try:
        waker.wake()
        monkeypatch.setattr(_io.os, "read", read_after_a_racing_wake)
        waker.drain()
        monkeypatch.setattr(_io.os, "read", real_read)
        assert raced
        waker.wake()  # the next piece of work must still wake the loop
        assert _readable(waker)  # wake() wrote its byte before returning
    finally:
        waker.close()

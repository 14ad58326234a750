"""The room table and the waker under real threads."""

from __future__ import annotations

import random
import threading

from transfer.status import RoomTable, TransferPoll


P = TransferPoll
NON_FAILED = [P.Bootstrapping, P.Bootstrapped, P.WaitingForInput, P.Transferring, P.Success]


def test_room_table_thread_safety_smoke():
    table = RoomTable()
    rooms = range(64)
    for room in rooms:
        table.start(room)
    # Each thread sends its own shuffled stream; room r sees a failure exactly when r % 5 == 0.
    streams = []
    for seed in range(8):
        rng = random.Random(seed)
        events = [(room, status) for room in rooms for status in NON_FAILED]
        events += [(room, P.Failed) for room in rooms if room % 5 == 0 and seed == room % 8]
        rng.shuffle(events)
        streams.append(events)
    barrier = threading.Barrier(len(streams))
    errors: list[BaseException] = []

    def run(events):
        try:
            barrier.wait(timeout=30)
            for room, status in events:
                now = table.update(room, status, f"failed by stream for room {room}")
                assert now is not None and now >= P.Bootstrapping or now is P.Failed
        except BaseException as exc:  # surfaced to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(events,)) for events in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert not errors
    for room in rooms:
        if room % 5 == 0:
            assert table.get(room) is P.Failed
            assert table.reason(room) == f"failed by stream for room {room}"
        else:
            assert table.get(room) is P.Success
            assert table.reason(room) is None


def test_waker_never_loses_a_wake_up_racing_with_drain(monkeypatch):
    """A wake() that lands while drain() runs must not silence every later wake().

    The race is forced deterministically: the first read inside drain() lets another
    wake() in before it reads. With the flag cleared before the pipe is emptied, that
    wake-up's byte is swallowed while the flag stays set, and the loop sleeps forever.
    """
    import os
    import select

    from transfer import _io

    waker = _io.Waker()
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
        readable, _, _ = select.select([waker.fileno()], [], [], 0.5)
        assert readable == [waker.fileno()]
    finally:
        waker.close()

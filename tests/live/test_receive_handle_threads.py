"""A receive handle waited on by one thread while another clears it, or closes its manager.

Real Mooncake engine (tcp on loopback), real ZMQ sockets and a real bootstrap server; the room asked
for is never sent, so only the clear() or the close() can end the waits. The waits' own timeout is far
past the bound the test gives them: a wait that returns only at its timeout fails the test.
"""

from __future__ import annotations

import threading

import pytest
from live_helpers import HOST, LIVE, wait_until

from transfer.buffers import ReceivePool
from transfer.core.failure import FailureKind
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
SLOT = SPAN * HIDDEN * 2
WAIT_S = 120.0  # each wait's own timeout
RETURN_S = 30.0  # how long the test gives a wait to return once the room is let go


def _waiters(handle, count: int) -> tuple[list[threading.Thread], dict[int, TransferPoll]]:
    got: dict[int, TransferPoll] = {}

    def wait(i: int) -> None:
        got[i] = handle.wait(WAIT_S)

    threads = [threading.Thread(target=wait, args=(i,), name=f"test-wait-{i}", daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, got


@pytest.mark.parametrize("let_go", ["clear", "close"])
def test_waits_on_a_handle_from_two_threads_return_when_a_third_lets_the_room_go(engines, server, let_go):
    """One waiting thread sleeps on the status socket (the watcher), the other on the conclusions: a
    clear() or close() from a third thread wakes both, the room Failed, and its slot is given back."""
    encode, prefill = engines
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST), ReceivePool(prefill, 2 * SLOT, SLOT) as pool:
        manager = SessionManager(prefill, 0, 1, 1, pool=pool, host=HOST, deadline_s=WAIT_S)
        try:
            handle = manager.receive(1, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
            assert wait_until(lambda: handle.poll() == TransferPoll.WaitingForInput, 10.0), handle.poll()
            threads, got = _waiters(handle, 2)
            assert wait_until(lambda: manager._driver._watcher is not None, 10.0), "no wait() watches the socket"
            getattr(handle if let_go == "clear" else manager, let_go)()
            for thread in threads:
                thread.join(RETURN_S)
            assert not any(thread.is_alive() for thread in threads), f"a wait() outlived the {let_go}()"
            assert got == {0: TransferPoll.Failed, 1: TransferPoll.Failed}, got
            if let_go == "close":
                assert handle.failure_kind is FailureKind.CLOSED, handle.failure
            stats = pool.stats()
            assert stats["leased"] == 0 and stats["free"] + stats["quarantined"] == 2, stats
        finally:
            manager.close()


def test_a_wait_that_took_other_rooms_successes_hands_their_checksums_on_at_its_timeout(engines, server):
    """A thread's wait() on a room never sent sleeps on the status socket and takes the Successes of sixteen
    other rooms there in one hold (the I/O thread is busy meanwhile, checksumming another room's bytes
    until the test lets it go). Their checksums are slow (as on a slow device): the waiting thread checks
    them until its timeout passes (the first one ends past it), then returns, leaving the rest to the I/O
    thread, which checks every one once free. Working through all sixteen first would hold wait(timeout)
    0.5 s per room past it."""
    import time

    import torch
    from live_helpers import item_tensor

    from transfer.sender import SenderPool

    rooms, check_s, timeout_s = 16, 0.5, 5.0
    encode, prefill = engines
    arena = torch.stack([item_tensor(room, SPAN, HIDDEN) for room in range(rooms + 1)])
    encode.register(arena)
    try:
        with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as sender, \
                ReceivePool(prefill, (rooms + 2) * SLOT, SLOT) as pool, \
                SessionManager(prefill, 0, 1, 1, pool=pool, host=HOST, deadline_s=WAIT_S) as manager:
            driver = manager._driver
            checksum = driver._checksum
            io_free = threading.Event()
            waiter_ends: list[float] = []

            def slow_checksum(region, addr, nbytes):
                if threading.current_thread() is driver._thread:
                    io_free.wait(WAIT_S)
                else:  # the waiting thread: its first check ends past its timeout, the others take check_s
                    while waiter_ends and time.monotonic() < waiter_ends[0]:
                        time.sleep(0.01)
                    time.sleep(check_s)
                return checksum(region, addr, nbytes)

            driver._checksum = slow_checksum
            busy = manager.receive(rooms, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
            never = manager.receive(rooms + 1, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
            handles = [manager.receive(room, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
                       for room in range(rooms)]
            assert wait_until(lambda: all(h.poll() == TransferPoll.WaitingForInput
                                          for h in [busy, never, *handles]), 10.0)
            sender.send(rooms, arena[rooms])  # the I/O thread takes its Success and checks it, until io_free
            assert wait_until(lambda: busy.stages.get("status") is not None, 10.0), busy.stages
            returned: list[tuple[TransferPoll, int]] = []

            def wait_on_never() -> None:
                waiter_ends.append(time.monotonic() + timeout_s)
                status = never.wait(timeout_s)
                returned.append((status, sum(h.poll() == TransferPoll.Success for h in handles)))

            waiter = threading.Thread(target=wait_on_never, name="test-wait", daemon=True)
            waiter.start()
            assert wait_until(lambda: driver._watcher is not None, 10.0), "the wait() does not watch the socket"
            with driver._lock:  # the Successes queue meanwhile, to be taken in one hold
                sent = [sender.send(room, arena[room]) for room in range(rooms)]
                assert wait_until(lambda: all(s.poll() == TransferPoll.Success for s in sent), 10.0)
                assert wait_until(lambda: driver._status_sock.poll(0), 10.0)
            try:
                waiter.join(RETURN_S)
                assert not waiter.is_alive(), "the wait() did not return"
                (status, checked), = returned
                assert status == TransferPoll.WaitingForInput
                assert checked == 1, f"the wait() checked {checked} rooms, not only the one under way at its timeout"
            finally:
                io_free.set()
            assert wait_until(lambda: all(h.poll() == TransferPoll.Success for h in [busy, *handles]), RETURN_S), \
                [(h.room, h.poll().name, h.failure) for h in handles]
            for handle in [busy, never, *handles, *sent]:
                handle.clear()
    finally:
        encode.unregister(arena.data_ptr())

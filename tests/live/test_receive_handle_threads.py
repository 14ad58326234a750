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

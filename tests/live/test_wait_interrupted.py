"""A stop signal's exception (a rank's SIGTERM handler raises KeyboardInterrupt wherever the main thread is)
that lands in a caller's wait() while it checks a room's landed bytes raises out of wait(), and the check
it cut short is left to the manager's I/O thread: the room still concludes Success, at once, not Failed at
its deadline.

Real Mooncake engines (tcp on loopback), a real bootstrap server and real ZMQ sockets, ranks in this
process. The interrupt is played in the caller's checksum of the landed bytes (the slow step of a wait()
that takes a Success)."""

from __future__ import annotations

import threading

import pytest
import torch
from live_helpers import HOST, LIVE, item_tensor

from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
#: Far past what the test waits: a room left to its deadline shows.
DEADLINE_S = 120.0


def test_a_wait_interrupted_while_it_checks_the_landed_bytes_leaves_the_check_to_the_io_thread(engines, server):
    encode, prefill = engines
    src = item_tensor(1, SPAN, HIDDEN)
    dst = torch.zeros(SPAN, HIDDEN, dtype=torch.bfloat16)
    caller = threading.get_ident()
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool, \
            SessionManager(prefill, 0, 1, 1, buffer=dst, host=HOST, deadline_s=DEADLINE_S) as manager:
        driver = manager._driver
        checksum = driver._checksum
        interrupted: list[int] = []

        def interrupted_in_the_caller(*args):
            landed = checksum(*args)
            if threading.get_ident() == caller and not interrupted:
                interrupted.append(1)
                raise KeyboardInterrupt  # as the signal's handler raises it once the checksum returned
            return landed

        driver._checksum = interrupted_in_the_caller
        # The I/O thread also reads the status socket on turns of its own: held off it until the interrupt, so
        # that the caller's wait() is the one to take the Success.
        drain = driver._drain_statuses
        driver._drain_statuses = lambda: drain() if interrupted else None
        handle = manager.receive(1, server.address, dst)
        # Sent while the caller waits: its wait() takes the Success, and checks the bytes itself.
        sender = threading.Timer(0.3, lambda: sent.append(pool.send(1, src)))
        sent: list = []
        sender.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                handle.wait(30)
        finally:
            sender.join()
        assert interrupted == [1]
        assert handle.wait(10) == TransferPoll.Success, (handle.poll(), handle.failure)
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
        handle.clear()
        sent[0].wait(10)
        sent[0].clear()

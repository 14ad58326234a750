"""concluded() on both sides: the rooms that reached Success or Failed since the last call,
each handed out once, so a scheduler loop looks at those instead of polling every handle.

Real Mooncake engines (tcp on loopback), a real bootstrap server and real ZMQ sockets;
the bytes that landed are checked for the rooms reported Success.
"""

from __future__ import annotations

import torch
from live_helpers import HOST, LIVE, item_tensor, wait_until

from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll, is_terminal

pytestmark = LIVE

SPAN, HIDDEN = 4, 64


def test_concluded_rooms_are_handed_out_once_in_order_and_cleared_ones_are_left_out(engines, server):
    encode, prefill = engines
    slots = torch.zeros(6, SPAN, HIDDEN, dtype=torch.bfloat16)
    items = {room: item_tensor(room, SPAN, HIDDEN) for room in (1, 2, 3, 4)}
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool, \
            SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST, deadline_s=1.5) as manager:
        assert manager.concluded() == [] and pool.concluded() == []
        received = {room: manager.receive(room, server.address, slots[room]) for room in (1, 2, 4, 5)}
        sent = {}
        for room in (2, 1, 4):  # room 5 is never sent: it fails at its deadline
            sent[room] = pool.send(room, items[room])
            assert received[room].wait(5.0) == TransferPoll.Success, received[room].failure
        assert manager.concluded() == [2, 1, 4]
        assert manager.concluded() == []  # each room once
        assert wait_until(lambda: all(is_terminal(h.poll()) for h in sent.values()), 5.0)
        assert pool.concluded() == [2, 1, 4]
        for room in (2, 1, 4):
            assert torch.equal(slots[room].view(torch.uint8), items[room].view(torch.uint8)), f"room {room}: landed bytes differ"

        sent[4].clear()
        received[4].clear()  # concluded again is impossible; cleared rooms are not reported
        assert received[5].wait(5.0) == TransferPoll.Failed
        received[3] = manager.receive(3, server.address, slots[3])
        sent[3] = pool.send(3, items[3])
        assert received[3].wait(5.0) == TransferPoll.Success, received[3].failure
        received[3].clear()  # cleared before it was handed out: left out
        assert manager.concluded() == [5]
        # The room number reused after a clear is reported again when it concludes.
        again = manager.receive(4, server.address, slots[4])
        sent[4] = pool.send(4, items[4])
        assert again.wait(5.0) == TransferPoll.Success, again.failure
        assert manager.concluded() == [4]
        assert wait_until(lambda: sent[4].poll() == TransferPoll.Success, 5.0)
        assert pool.concluded() == [3, 4]
        for handle in (*received.values(), again, *sent.values()):
            handle.clear()
        assert manager._driver.table._concluded == {} and pool._table._concluded == {}  # nothing held for cleared rooms

"""A send() that registers its source on the caller's thread holds up no other room."""

from __future__ import annotations

import threading
import time

import torch
from live_helpers import HOST, LIVE, item_tensor

from transfer.drive.encode import RETRY_RELEASES_S
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64


def test_a_room_is_served_while_another_send_is_registering_its_source(engines, server, monkeypatch):
    encode, prefill = engines
    slots = torch.zeros(1, SPAN, HIDDEN, dtype=torch.bfloat16)
    rows = item_tensor(1, SPAN, HIDDEN)
    big = torch.zeros(1024, HIDDEN, dtype=torch.bfloat16)  # not registered: its send() registers it
    registering, may_finish = threading.Event(), threading.Event()
    register = encode.register

    def slow_register(buf, length=None):
        if isinstance(buf, torch.Tensor) and buf.data_ptr() == big.data_ptr():
            registering.set()
            may_finish.wait(30.0)  # a large source pinned over RDMA
        return register(buf, length)

    encode.register(rows, rows.numel() * rows.element_size())
    try:
        with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool, \
                SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST) as manager:
            pool.send(1, rows)
            monkeypatch.setattr(encode, "register", slow_register)
            sender = threading.Thread(target=pool.send, args=(9, big), daemon=True)
            sender.start()
            try:
                assert registering.wait(10.0)
                time.sleep(2 * RETRY_RELEASES_S)  # the driver's retry of kept registrations comes due
                handle = manager.receive(1, server.address, slots[0])
                assert handle.wait(10.0) == TransferPoll.Success, handle.failure
                assert torch.equal(slots[0].view(torch.uint8), rows.view(torch.uint8))
            finally:
                may_finish.set()
                sender.join(10.0)
            assert not sender.is_alive()
    finally:
        monkeypatch.undo()
        encode.unregister(rows.data_ptr())

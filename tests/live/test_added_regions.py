"""Regions added with SessionManager.add_region() are destinations our encode rank writes into, each
pair of embedding and deepstack regions announced on its own (real Mooncake tcp, real ZMQ, the real
bootstrap server)."""

from __future__ import annotations

import pytest
import torch
from live_helpers import HOST

from transfer.bootstrap import BootstrapServer
from transfer.errors import UsageError
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll


def test_the_main_embedding_buffer_with_a_second_deepstack_buffer_takes_writes(engines):
    encode_engine, prefill_engine = engines
    embeddings = torch.zeros(4, 8, dtype=torch.float32)
    first_ds, second_ds = torch.zeros(2, 16, dtype=torch.float32), torch.zeros(2, 16, dtype=torch.float32)
    prefill_engine.register(second_ds)
    item, deepstack = torch.randn(2, 8), torch.randn(2, 16)
    encode_engine.register(item)
    encode_engine.register(deepstack)
    try:
        with BootstrapServer(HOST, 0) as server, \
                SessionManager(prefill_engine, 0, 1, 1, buffer=embeddings, deepstack_buffer=first_ds, host=HOST,
                               deadline_s=20) as manager, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as pool:
            manager.add_region(embeddings, second_ds)
            for room, rows, ds_dst in ((1, embeddings[0:2], first_ds), (2, embeddings[2:4], second_ds)):
                received = manager.receive(room, server.address, rows, deepstack_dst=ds_dst)
                sent = pool.send(room, item, deepstack)
                assert received.wait(10) is TransferPoll.Success, received.failure
                assert sent.wait(5) is TransferPoll.Success, sent.failure
                assert torch.equal(rows, item) and torch.equal(ds_dst, deepstack), f"room {room}"
                received.clear()
                sent.clear()
    finally:
        prefill_engine.unregister(second_ds.data_ptr())
        encode_engine.unregister(item.data_ptr())
        encode_engine.unregister(deepstack.data_ptr())


def test_a_region_added_to_a_closed_manager_is_refused(engines):
    _, prefill_engine = engines
    embeddings, extra = torch.zeros(4, 8, dtype=torch.float32), torch.zeros(4, 8, dtype=torch.float32)
    prefill_engine.register(extra)
    try:
        manager = SessionManager(prefill_engine, 0, 1, 1, buffer=embeddings, host=HOST, deadline_s=20)
        manager.close()
        with pytest.raises(UsageError, match=r"^session manager is closed: its close\(\) ran \(called, or its "
                                               r"with block ended\); start a new SessionManager to receive more$"):
            manager.add_region(extra)
    finally:
        prefill_engine.unregister(extra.data_ptr())

"""Each handle's stages: when a room's ask, writes and status happened, on both sides.

Real Mooncake engines (tcp on loopback), a real bootstrap server and real ZMQ sockets,
both sides in this process, so their stages share one clock and must follow the order
the messages make: the prefill rank asks, the encode rank sees the ask, writes, concludes,
and only then can the prefill rank read the status.
"""

from __future__ import annotations

import torch
from live_helpers import HOST, LIVE, item_tensor, wait_until

from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64


def _absolute(handle) -> dict[str, float]:
    return {name: handle.started_at + seconds for name, seconds in handle.stages.items()}


def test_stages_follow_the_messages_whichever_side_starts_first(engines, server):
    encode, prefill = engines
    slots = torch.zeros(2, SPAN, HIDDEN, dtype=torch.bfloat16)
    items = [item_tensor(room, SPAN, HIDDEN) for room in range(2)]
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool, \
            SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST, deadline_s=10.0) as manager:
        # Room 0 is asked for before its item is sent, room 1 the other way round.
        received = manager.receive(0, server.address, slots[0])
        assert wait_until(lambda: len(pool._core.parked) == 1, 10.0), "room 0's ask never reached the encode rank"
        sent = pool.send(0, items[0])
        pairs = [(received, sent)]
        sent = pool.send(1, items[1])
        pairs.append((manager.receive(1, server.address, slots[1]), sent))
        for room, (received, sent) in enumerate(pairs):
            assert received.wait(10.0) == TransferPoll.Success, received.failure
            assert sent.wait(10.0) == TransferPoll.Success, sent.failure
            assert torch.equal(slots[room].view(torch.uint8), items[room].view(torch.uint8))
            assert list(received.stages) == ["asked", "status", "concluded"]
            assert list(sent.stages) == ["asked", "writing", "submitted", "concluded"]
            assert 0 <= received.stages["asked"] <= received.stages["status"] <= received.stages["concluded"]
            assert received.stages["concluded"] == received.latency_s
            assert sent.stages["concluded"] == sent.latency_s
            p, e = _absolute(received), _absolute(sent)
            assert p["asked"] <= e["asked"] <= e["writing"] <= e["submitted"] <= e["concluded"] <= p["status"], (p, e)
            # Writes start once both the ask and the item are there.
            assert e["writing"] >= max(e["asked"], sent.started_at)
        first, second = pairs
        assert first[1].stages["asked"] < 0 < second[1].stages["asked"], "room 0's ask came before its item"
        for received, sent in pairs:
            received.clear()
            sent.clear()


def test_a_room_that_never_got_its_status_has_no_status_stage(engines, server):
    encode, prefill = engines
    slots = torch.zeros(1, SPAN, HIDDEN, dtype=torch.bfloat16)
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST), \
            SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST, deadline_s=0.5) as manager:
        received = manager.receive(7, server.address, slots[0])  # never sent: fails at its deadline
        assert received.wait(10.0) == TransferPoll.Failed
        assert list(received.stages) == ["asked", "concluded"]
        assert received.stages["concluded"] >= 0.5
        received.clear()

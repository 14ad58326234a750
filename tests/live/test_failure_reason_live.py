"""A prefill rank sees why the encode rank refused its room (the reason on the Failed status), live."""

from __future__ import annotations

import pytest
from live_helpers import HOST, LIVE

from transfer.bootstrap import BootstrapServer
from transfer.core.failure import FailureKind
from transfer.harness import SENTINEL
from transfer.receiver import ENCODE_FAILED, SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 8, 64


@pytest.mark.parametrize("wrong", ["hidden", "dtype"])
def test_a_prefill_rank_asking_with_the_wrong_geometry_reads_the_encode_ranks_reason(engines, wrong):
    import torch

    encode_engine, prefill_engine = engines
    item = torch.arange(SPAN * HIDDEN, dtype=torch.float32).to(torch.bfloat16).view(SPAN, HIDDEN)
    # The prefill rank's slot disagrees with the item in one way: half the row width, or another dtype.
    width, dtype = (HIDDEN // 2, torch.bfloat16) if wrong == "hidden" else (HIDDEN, torch.float16)
    slots = torch.empty((2, SPAN, width), dtype=dtype)
    slots.view(torch.uint8).fill_(SENTINEL)
    room = 4242 if wrong == "hidden" else 4243
    with BootstrapServer(HOST, 0) as server, \
            SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as pool, \
            SessionManager(prefill_engine, 0, 1, 1, buffer=slots, host=HOST, deadline_s=30.0) as manager:
        received = manager.receive(room, server.address, slots[0])
        sent = pool.send(room, item)
        assert received.wait(20.0) is TransferPoll.Failed
        assert sent.wait(20.0) is TransferPoll.Failed
        kind = received.failure_kind
        detail = received.failure
        assert kind is FailureKind.PEER_FAILED, (kind, detail)
        # The prefill's detail names the encode rank, then the encode side's own kind and reason.
        assert detail.startswith(f"{ENCODE_FAILED} (encode rank 0 at "), detail
        expected = (f"hidden {HIDDEN // 2} != item hidden {HIDDEN}" if wrong == "hidden"
                    else "dtype torch.float16 != item dtype torch.bfloat16")
        assert f": geometry: room {room}: receiver {prefill_engine.session_id} {expected}" in detail, detail
        assert sent.failure_kind is FailureKind.GEOMETRY and expected in sent.failure, sent.failure
        # Refused before any byte moved.
        assert bool((slots.view(torch.uint8) == SENTINEL).all())
        received.clear()
        sent.clear()

"""What a prefill engine does with us, end to end: sharded ranks receive their rows into
pooled slots over real Mooncake, agree on every item's outcome, and rebuild the full rows
with one collective per batch (gloo). One rank missing its deadline cancels that item, which
then fails on every rank, and every other item of the batch is rebuilt bit for bit."""

from __future__ import annotations

import multiprocessing as mp

from flow_ranks import encode_process, prefill_process
from live_helpers import LIVE, free_port

from transfer.bootstrap import BootstrapServer

pytestmark = LIVE


def test_sharded_ranks_receive_agree_and_rebuild_the_full_rows():
    # Spans include ones smaller than the fanout (empty shards on rank 1).
    spans = {40: 1, 41: 2, 42: 5, 43: 64, 44: 8}
    rooms = sorted(spans)
    late = 44  # sent after rank 1's deadline: rank 0 gets it, rank 1 does not
    ctx = mp.get_context("spawn")
    results, stop = ctx.Queue(), ctx.Event()
    with BootstrapServer("127.0.0.1", 0) as server:
        encode = ctx.Process(target=encode_process,
                             args=(server.address, rooms, spans, late, 4.0, results, stop), daemon=True)
        encode.start()
        assert results.get(timeout=60) == ("encode", "ready")
        dist_addr = f"127.0.0.1:{free_port()}"
        ranks = [
            ctx.Process(target=prefill_process,
                        args=(rank, 2, dist_addr, server.address, rooms, spans, deadline, results), daemon=True)
            for rank, deadline in ((0, 30.0), (1, 2.5))
        ]
        for proc in ranks:
            proc.start()
        try:
            outcomes = dict(results.get(timeout=120) for _ in ranks)
        finally:
            stop.set()
            for proc in ranks + [encode]:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    for name, outcome in outcomes.items():
        assert isinstance(outcome, dict), f"{name} crashed:\n{outcome}"
    rank0, rank1 = outcomes["prefill0"], outcomes["prefill1"]
    # Rank 1 gave the late item up at its deadline and cancelled it: the encode rank wrote it
    # to neither rank (rank 0 was told Failed), and the ranks agreed it failed on both.
    assert rank0[late]["local"] is False and rank1[late]["local"] is False
    assert rank0[late]["agreed"] is False and rank1[late]["agreed"] is False
    for room in rooms:
        if room == late:
            continue
        for outcome in (rank0, rank1):
            assert outcome[room] == {"local": True, "agreed": True, "full_rows_match": True}, (room, outcome)

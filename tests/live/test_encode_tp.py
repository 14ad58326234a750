"""Several encode ranks (E = 2) serving P = 4 and P = 2 prefill ranks over real Mooncake tcp.

Rows are shared out over the whole prefill group (the reference peer's layout), per
encode block, or not at all (identity); every prefill rank then holds the full rows of
every item, rebuilt over gloo where sharded, and every byte is checked. Group-wide
shards have each encode rank write only its block's share of each item.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
from encode_tp_ranks import DTYPE, HIDDEN, encode_process, prefill_process
from live_helpers import LIVE, free_port

from transfer.bootstrap import BootstrapServer
from transfer.frames import dtype_size

pytestmark = LIVE

ROW_BYTES = HIDDEN * dtype_size(DTYPE)
# Spans smaller than the group leave whole blocks with empty shards.
SPANS = {70: 1, 71: 2, 72: 3, 73: 64, 74: 9}


def run_deployment(encode_tp: int, prefill_tp: int, shards: str) -> dict:
    """Runs E encode and P prefill rank processes; returns every rank's outcome by name."""
    rooms = sorted(SPANS)
    ctx = mp.get_context("spawn")
    results, stop = ctx.Queue(), ctx.Event()
    procs = []
    with BootstrapServer("127.0.0.1", 0) as server:
        try:
            for rank in range(encode_tp):
                procs.append(ctx.Process(target=encode_process, daemon=True,
                                         args=(rank, encode_tp, server.address, rooms, SPANS, results, stop)))
                procs[-1].start()
            for _ in range(encode_tp):
                name, ready = results.get(timeout=60)
                assert ready == "ready", f"{name}: {ready}"
            dist_addr = f"127.0.0.1:{free_port()}"
            for rank in range(prefill_tp):
                procs.append(ctx.Process(target=prefill_process, daemon=True,
                                         args=(rank, prefill_tp, encode_tp, shards, dist_addr, server.address,
                                               rooms, SPANS, results)))
                procs[-1].start()
            outcomes = dict(results.get(timeout=120) for _ in range(encode_tp + prefill_tp))
        finally:
            stop.set()
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    for name, outcome in outcomes.items():
        assert isinstance(outcome, dict), f"{name} crashed:\n{outcome}"
    return outcomes


def item_bytes() -> int:
    return sum(SPANS.values()) * ROW_BYTES


@pytest.mark.parametrize("encode_tp, prefill_tp, shards, copies", [
    (2, 4, "group", 1),
    (2, 4, "per_block", 2),
    (2, 4, "identity", 4),
    (2, 2, "group", 1),
])
def test_every_rank_ends_with_every_items_full_rows(encode_tp, prefill_tp, shards, copies):
    outcomes = run_deployment(encode_tp, prefill_tp, shards)
    for rank in range(prefill_tp):
        outcome = outcomes[f"prefill{rank}"]
        assert outcome["failures"] == {}, (rank, outcome)
        for room, result in outcome["rooms"].items():
            assert result == {"agreed": True, "full_rows_match": True}, (rank, room, result)
    encode = [outcomes[f"encode{e}"] for e in range(encode_tp)]
    assert all(e["failures"] == [] for e in encode), encode
    # Bytes the encode ranks wrote in all: each item once over the group, once per block, once per rank.
    assert sum(e["written"] for e in encode) == copies * item_bytes()
    if shards == "group":
        # Each encode rank writes only its block's contiguous share.
        from transfer.frames import prefill_shard

        fanout = prefill_tp // encode_tp
        for e in range(encode_tp):
            rows = sum(prefill_shard(span, r, prefill_tp, encode_tp)[1]
                       for span in SPANS.values() for r in range(e * fanout, (e + 1) * fanout))
            assert encode[e]["written"] == rows * ROW_BYTES

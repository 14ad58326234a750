"""Empty shards in transfer.reassemble: ranks in separate processes over torch.distributed gloo.

A span smaller than the group leaves ranks without rows; such a rank's shard, given at
any row_start inside the span, must rebuild the item on every rank. Every rank derives
the items' true rows from the room alone and compares the rebuilt bytes bit for bit.
"""

from __future__ import annotations

import gloo_ranks
import torch
from gloo_ranks import seen
from sharded_rows import HIDDEN, destination, original, same_bytes

from transfer.reassemble import ShardedItem, reassemble

GROUP_TIMEOUT_S = 15
JOIN_S = 120
SIZE = 3


def spec_shard(span: int, rank: int, size: int) -> tuple[int, int]:
    """SPEC.md section 2, written out again so the test does not trust the code under review."""
    base, rem = divmod(span, size)
    return rank * base + min(rank, rem), base + (1 if rank < rem else 0)


def empty_shards_given_at_row_0(rank: int, size: int) -> dict:
    """Spans 0, 1, 2 and 7 over the group; every rank without rows of an item gives its shard as (0, 0),
    the others their split, as a handle from a receive() asked at row_start=0 for no rows holds it."""
    spans = {50: 1, 51: 2, 52: 0, 53: 7}
    truths, items, given = {}, [], []
    for room, span in spans.items():
        rows, ds_rows = original(room, span, torch.float32), original(room, span, torch.bfloat16, HIDDEN * 2)
        start, count = spec_shard(span, rank, size)
        shard = (start, count) if count else (0, 0)
        items.append(ShardedItem(room, destination(rows, rank, size), True, destination(ds_rows, rank, size),
                                 shard=shard))
        truths[room] = (rows, ds_rows)
        given.append(list(shard))
    try:
        flags, raised = reassemble(items), None
    except Exception as exc:  # noqa: BLE001 - what it raises is the observation
        flags, raised = None, f"{type(exc).__name__}: {exc}"
    exact = [same_bytes(item.full, truths[item.room][0]) and same_bytes(item.deepstack, truths[item.room][1])
             for item in items]
    return {"flags": flags, "raised": raised, "exact": exact, "given": given}


def test_a_span_smaller_than_the_group_rebuilds_with_empty_shards_given_at_another_row_start(tmp_path):
    observed = seen(gloo_ranks.run_ranks(__name__, "empty_shards_given_at_row_0", SIZE, tmp_path,
                                         group_timeout_s=GROUP_TIMEOUT_S, join_s=JOIN_S))
    # The scenario gives empty shards away from their split: rank 2 of span 1 and 2 (split (1, 0), (2, 0)).
    assert observed[2]["given"][:2] == [[0, 0], [0, 0]] and spec_shard(2, 2, SIZE) == (2, 0)
    for rank, obs in enumerate(observed):
        assert obs["raised"] is None, (rank, obs["raised"])
        assert obs["flags"] == [True] * 4 and obs["exact"] == [True] * 4, (rank, obs)

"""transfer.reassemble's pure parts: shard destinations and views, and item checks."""

from __future__ import annotations

import torch
from sharded_rows import HIDDEN, destination, original, same_bytes

from transfer import reassemble as reassemble_module
from transfer.frames import shard_rows
from transfer.reassemble import ShardedItem


def test_destinations_hold_exactly_their_shard():
    rows = original(1, 10, torch.float32)
    shards = [destination(rows, r, 3) for r in range(3)]
    for r, dst in enumerate(shards):
        start, count = shard_rows(10, r, 3)
        assert same_bytes(dst[start : start + count], rows[start : start + count])
        assert not same_bytes(dst, rows)


def test_shard_views_tile_the_item_bytes():
    rows = original(2, 7, torch.bfloat16)
    ds = original(2, 7, torch.bfloat16, HIDDEN * 3)
    item = ShardedItem(2, rows, True, ds)
    parts = [reassemble_module._shard_views(item, r, 3) for r in range(3)]
    assert same_bytes(torch.cat([p[0] for p in parts]), rows.view(torch.uint8).reshape(-1))
    assert same_bytes(torch.cat([p[1] for p in parts]), ds.view(torch.uint8).reshape(-1))
    sizes = [reassemble_module._shard_bytes([item], r, 3) for r in range(3)]
    assert sizes == [v[0].numel() + v[1].numel() for v in parts]
    assert max(sizes) - min(sizes) <= rows[0].numel() * 2 + ds[0].numel() * 2  # at most one row apart


def test_check_item_names_the_problem():
    rows = original(3, 4, torch.float32)
    assert reassemble_module._check_item(ShardedItem(3, rows, True), torch.device("cpu")) is None
    bad = reassemble_module._check_item(ShardedItem(3, rows.t(), True), torch.device("cpu"))
    assert "not a contiguous" in bad
    short_ds = original(3, 3, torch.float32, HIDDEN)
    assert "deepstack of shape (3, 6)" in reassemble_module._check_item(
        ShardedItem(3, rows, True, short_ds), torch.device("cpu"))

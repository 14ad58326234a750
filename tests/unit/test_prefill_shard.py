"""prefill_shard: which rows of an item a prefill rank receives, over the group or per block."""

from __future__ import annotations

import pytest

from transfer.frames import prefill_shard, shard_rows


def test_the_group_wide_split_is_the_reference_peers():
    # 64 rows over 4 prefill ranks: encode rank 0 serves ranks 0-1, rows [0, 32).
    assert [prefill_shard(64, r, 4, 2) for r in range(4)] == [(0, 16), (16, 16), (32, 16), (48, 16)]


def test_the_per_block_split_tiles_the_item_in_every_block():
    assert [prefill_shard(64, r, 4, 2, per_block=True) for r in range(4)] == [(0, 32), (32, 32)] * 2


@pytest.mark.parametrize("span", [0, 1, 3, 10, 257])
def test_with_one_encode_rank_both_splits_agree(span):
    for rank in range(4):
        assert prefill_shard(span, rank, 4, 1) == prefill_shard(span, rank, 4, 1, per_block=True) == shard_rows(span, rank, 4)


def test_a_group_that_is_not_a_multiple_of_the_encode_ranks_is_refused():
    with pytest.raises(ValueError, match="prefill tp 3 is not a multiple of encode tp 2"):
        prefill_shard(10, 0, 3, 2)


@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("rank", [-1, 4, 5])
def test_a_rank_outside_the_group_is_refused_by_either_split(rank, per_block):
    # Per block, rank % (P // E) would otherwise hand a rank no group has another rank's rows.
    with pytest.raises(ValueError, match=rf"prefill tp rank {rank} outside \[0, tp size 4\)"):
        prefill_shard(64, rank, 4, 2, per_block=per_block)

"""validate_fanout over row shards taken across the whole prefill group (SPEC.md sections 1 and 6).

With E encode ranks and P prefill ranks, prefill rank r asks encode rank r // fanout for
shard_rows(span, r, P): each encode rank sees its block's contiguous share of the item.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transfer.frames import TransferInfo, shard_rows, validate_fanout

HIDDEN, DTYPE = 256, "torch.bfloat16"


def ask(rank: int, row_start: int, rows: int, span: int, fanout: int) -> TransferInfo:
    """Prefill rank `rank`'s TransferInfo for room 9."""
    return TransferInfo(room=9, endpoint="127.0.0.1", port=5000 + rank, session_id=f"127.0.0.1:{17000 + rank}",
                        embedding_ptr=0x10000 * (rank + 1), deepstack_ptr=0, rows=rows, hidden=HIDDEN, dtype=DTYPE,
                        has_deepstack=False, fanout=fanout, row_start=row_start, span=span)


def global_block(span: int, encode_rank: int, encode_tp: int, prefill_tp: int) -> list[TransferInfo]:
    """The asks encode rank `encode_rank` receives when the prefill group shards over all its ranks."""
    fanout = prefill_tp // encode_tp
    ranks = range(encode_rank * fanout, (encode_rank + 1) * fanout)
    return [ask(r, *shard_rows(span, r, prefill_tp), span, fanout) for r in ranks]


def check(infos: list[TransferInfo], span: int) -> str | None:
    return validate_fanout(span, HIDDEN, DTYPE, False, infos, len(infos))


@pytest.mark.parametrize("encode_tp, prefill_tp", [(2, 4), (2, 2), (4, 8), (3, 6)])
@pytest.mark.parametrize("span", [0, 1, 2, 3, 5, 64, 1000])
def test_every_block_of_a_group_wide_split_is_valid(encode_tp, prefill_tp, span):
    for encode_rank in range(encode_tp):
        assert check(global_block(span, encode_rank, encode_tp, prefill_tp), span) is None


def test_the_reference_peers_halves_are_served():
    assert check(global_block(64, 0, 2, 4), 64) is None  # rows [0, 32)
    assert check(global_block(64, 1, 2, 4), 64) is None  # rows [32, 64)
    assert [(i.row_start, i.rows) for i in global_block(64, 1, 2, 4)] == [(32, 16), (48, 16)]


@given(span=st.integers(0, 3000), encode_tp=st.integers(1, 4), fanout=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_any_group_wide_block_in_any_order_is_valid(span, encode_tp, fanout, seed):
    prefill_tp = encode_tp * fanout
    for encode_rank in range(encode_tp):
        infos = global_block(span, encode_rank, encode_tp, prefill_tp)
        random.Random(seed).shuffle(infos)
        assert check(infos, span) is None


def test_a_gap_inside_the_block_is_refused_with_its_rows():
    infos = [ask(0, 10, 5, 64, 2), ask(1, 20, 5, 64, 2)]
    assert check(infos, 64) == "room 9: rows [15, 20) have no receiver (gap before 127.0.0.1:17001)"


def test_a_gap_of_one_row_is_refused():
    infos = [ask(0, 10, 5, 64, 2), ask(1, 16, 5, 64, 2)]
    assert check(infos, 64) == "room 9: rows [15, 16) have no receiver (gap before 127.0.0.1:17001)"


def test_shards_that_start_at_row_0_without_the_whole_span_are_no_identity_set():
    # Identity is row_start == 0 and rows == span: two asks for rows [0, 3) of 8 overlap.
    reason = check([ask(0, 0, 3, 8, 2), ask(1, 0, 3, 8, 2)], 8)
    assert reason == "room 9: receivers 127.0.0.1:17000 and 127.0.0.1:17001 overlap on rows [0, 3)"
    assert check([ask(0, 0, 8, 8, 2), ask(1, 0, 8, 8, 2)], 8) is None


def test_an_overlap_inside_the_block_is_refused():
    reason = check([ask(0, 32, 10, 64, 2), ask(1, 40, 24, 64, 2)], 64)
    assert reason == ("room 9: receivers 127.0.0.1:17000 and 127.0.0.1:17001 overlap on rows [40, 42)")


@pytest.mark.parametrize("row_start, rows", [(60, 5), (-1, 3), (64, 1)])
def test_a_shard_outside_the_item_is_refused(row_start, rows):
    reason = check([ask(0, 32, 16, 64, 2), ask(1, row_start, rows, 64, 2)], 64)
    assert reason is not None and "outside [0, 64)" in reason and "127.0.0.1:17001" in reason


@pytest.mark.parametrize("empty_first", [True, False])
def test_empty_shards_at_either_end_are_ignored(empty_first):
    shards = [ask(0, 3, 0, 5, 3), ask(1, 3, 1, 5, 3), ask(2, 4, 1, 5, 3)]
    if not empty_first:
        shards = [ask(0, 3, 1, 5, 3), ask(1, 4, 1, 5, 3), ask(2, 5, 0, 5, 3)]
    assert check(shards, 5) is None


def test_a_block_with_only_empty_shards_writes_nothing_and_is_valid():
    # span 2 over 4 prefill ranks and 2 encode ranks: the second block gets no rows.
    infos = global_block(2, 1, 2, 4)
    assert [i.rows for i in infos] == [0, 0]
    assert check(infos, 2) is None


def test_a_per_block_split_is_still_served():
    infos = [ask(r, *shard_rows(64, r, 2), 64, 2) for r in range(2)]
    assert check(infos, 64) is None

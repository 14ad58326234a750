"""What the demo's and the bench's ranks need in memory, said before they start, and a buffer a rank cannot
allocate, said in one line (transfer.harness's memory helpers; transfer.bench.memory_refusal)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from transfer import bench, harness
from transfer.harness import ItemSource, NoMemory, Scenario, allocate, memory_refusal, rank_memory


def test_an_allocation_torch_cannot_make_is_one_line_naming_it_and_its_size():
    with pytest.raises(NoMemory) as caught:
        allocate(lambda: torch.empty(2**60, dtype=torch.uint8), 2**60, "its receive arena")
    assert str(caught.value) == "cannot allocate its receive arena, 1,073,741,824.0 GiB (1152921504606846976 bytes)"


def test_an_item_pool_that_cannot_be_allocated_says_its_shape():
    with pytest.raises(NoMemory) as caught:
        ItemSource(2**29, 2**29, "torch.bfloat16")
    assert str(caught.value) == ("cannot allocate an item pool of 1073741824 x 536870912 torch.bfloat16, "
                                 "1,073,741,824.0 GiB (1152921504606846976 bytes)")


def test_an_item_pool_allocates_the_bytes_its_estimate_says():
    pool = ItemSource(64, 96, "torch.float16", width_factor=2).pool
    assert pool.numel() * pool.element_size() == ItemSource.pool_bytes(64, 96, "torch.float16", width_factor=2)


def test_a_rank_needs_its_item_pools_and_the_receive_slots_its_rooms_use():
    sc = Scenario(span=1024, hidden=4096, dtype="torch.bfloat16", inflight=8, items=64, deepstack=2)
    pool = ItemSource.pool_bytes(1024, 4096, "torch.bfloat16")  # 2 x 1024 rows of 8 KiB
    assert pool == 2048 * 8192
    assert rank_memory(sc, "encode") == 3 * pool  # the items and their deepstack rows, twice as wide
    assert rank_memory(sc, "prefill") == 3 * pool + 3 * 8 * 1024 * 8192
    sc.items = 2  # two rooms fill two slots only
    assert rank_memory(sc, "prefill") == 3 * pool + 3 * 2 * 1024 * 8192


@pytest.mark.parametrize("inflight, slots", [(2**64, 2), (8, 2), (1, 1)])
def test_a_prefill_rank_allocates_the_receive_slots_its_rooms_use(inflight, slots, monkeypatch):
    # As rank_memory counts them: no more rooms than --items are ever in flight, so an --inflight past them
    # (past any tensor's size, even) allocates no more.
    from transfer import receiver

    class Made(Exception):
        pass

    def manager(engine, rank, *args, buffer, deepstack_buffer, **kwargs):
        raise Made(tuple(buffer.shape), tuple(deepstack_buffer.shape))

    monkeypatch.setattr(harness, "make_engine", lambda sc: contextlib.nullcontext())
    monkeypatch.setattr(receiver, "SessionManager", manager)
    sc = Scenario(span=4, hidden=8, items=2, inflight=inflight, deepstack=2, protocol="wire")
    with pytest.raises(Made) as made:
        harness.prefill_rank(sc, 0, "127.0.0.1:1", _nothing, _nothing, _nothing)
    assert made.value.args == ((slots, 4, 8), (slots, 4, 16))


def _nothing() -> None:
    pass


def test_memory_past_the_hosts_is_refused_with_both_figures():
    assert memory_refusal(2**30, "2 ranks", limit=2**30) is None
    assert memory_refusal(2**30 + 1, "2 ranks", limit=2**30) == (
        "2 ranks need 1.0 GiB (1073741825 bytes) of memory, more than this host's RAM and swap, 1.0 GiB "
        "(1073741824 bytes)")


def test_this_hosts_memory_is_known_and_plausible():
    limit = harness.host_memory()
    assert limit is not None and limit >= 2**28


def test_the_bench_needs_its_arenas_and_the_pools_of_its_largest_cell_at_once():
    opts = bench.Options(sizes=[(1024, 4096), (64, 4096)], fanouts=[2], inflight=[8], paths=["raw"],
                         integrity=[False], items=32)
    cells = bench.plan(opts, wire_ok=False)
    pool = ItemSource.pool_bytes(1024, 4096, opts.dtype, distinct=bench._distinct_rooms(cells[0]))
    # One encode rank sends from the pool and two prefill ranks check against it.
    assert bench.memory_need(opts) == sum(bench.arena_sizes(opts, cells)) + 3 * pool
    assert bench.memory_refusal(opts) is None


def test_the_memcpy_path_needs_its_largest_item_three_times():
    opts = bench.Options(sizes=[(1024, 4096), (64, 4096)], paths=["memcpy"])
    assert bench.memory_need(opts) == 3 * 1024 * 4096 * 2

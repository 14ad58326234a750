"""transfer.reassemble's pure parts: shard destinations and views, and item checks."""

from __future__ import annotations

import torch
from sharded_rows import GARBAGE, HIDDEN, destination, original, same_bytes

from transfer import reassemble as reassemble_module
from transfer.reassemble import ShardedItem


def test_the_destinations_these_tests_build_hold_the_spec_shard_and_garbage_elsewhere():
    rows = original(1, 10, torch.float32)
    for rank, (start, stop) in enumerate([(0, 4), (4, 7), (7, 10)]):  # SPEC.md's 10 rows over 3 ranks
        dst = destination(rows, rank, 3)
        assert same_bytes(dst[start:stop], rows[start:stop])
        outside = torch.cat([dst[:start], dst[stop:]]).view(torch.uint8)
        assert outside.numel() > 0 and bool((outside == GARBAGE).all())


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


def test_agreement_rows_of_unusable_arguments_name_the_problem_without_raising():
    table = reassemble_module._table
    assert table([True, False], [(1, 2), (3, 4)]) == (2, 2, [1, 1, 2, -1, -2, 0, 3, 4, -3, -4], None)
    assert "no length" in table([True], [5])[3]
    assert "not a truth value" in table([torch.ones(2)], None)[3]
    assert "not an integer" in table([True], [("x",)])[3]
    assert table([True], [(2**64,)])[3] == "item 0 has a key outside signed 64 bits: [18446744073709551616]"


def test_the_min_of_every_ranks_counted_elements_names_the_fewest_and_the_most_items_and_their_ranks():
    counted, count_range = reassemble_module._counted, reassemble_module._count_range

    def agreed(counts: list[int]) -> tuple[tuple[int, int], tuple[int, int]]:
        size = len(counts)
        low, high = (min(pair) for pair in zip(*(counted(c, r, size) for r, c in enumerate(counts))))
        assert all(-(2**63) <= v < 2**63 for v in (low, high))  # what the int64 all-reduce carries
        return count_range(low, high, size)

    assert agreed([4]) == ((4, 0), (4, 0))
    assert agreed([0, 0, 0]) == ((0, 0), (0, 0))
    assert agreed([2, 1, 2]) == ((1, 1), (2, 0))
    assert agreed([3, 5, 5, 3, 0, 5, 0, 3]) == ((0, 4), (5, 1))
    assert agreed([7, 7, 7, 6]) == ((6, 3), (7, 0))
    big = 2**58  # any item count a list can hold, times a group of eight, fits 63 bits
    assert agreed([big, big + 1, 0, big, big, big, big, big]) == ((0, 2), (big + 1, 1))


def test_a_room_key_is_the_room_inside_the_wires_range_only():
    key = reassemble_module._room_key
    assert [key(0), key(5), key(2**63 - 1)] == [0, 5, 2**63 - 1]
    assert [key(-1), key(2**63), key(2**63 + 5), key(2**64 + 5)] == [-1] * 4


def test_a_shard_is_checked_against_the_ranks_split_of_the_span():
    rows = original(4, 10, torch.float32)
    check = reassemble_module._check_shard
    assert check(ShardedItem(4, rows, True, shard=(4, 3)), 0, 1, 3, None) is None
    assert check(ShardedItem(4, rows, True), 0, 1, 3, None) is None
    wrong = check(ShardedItem(4, rows, True, shard=(0, 10)), 2, 1, 3, None)
    assert wrong.startswith("item 2 (room 4) holds rows [0, 10) of 10, but rank 1 of a group of 3 holds rows [4, 7)")


def test_an_empty_shard_anywhere_in_the_span_is_the_split_of_a_rank_holding_no_rows():
    check = reassemble_module._check_shard
    rows = original(5, 2, torch.float32)  # 2 rows over 4 ranks: ranks 2 and 3 hold (2, 0)
    for shard in ((0, 0), (1, 0), (2, 0)):
        assert check(ShardedItem(5, rows, True, shard=shard), 0, 3, 4, None) is None, shard
    for shard in ((3, 0), (-1, 0), (1, 1)):  # outside the span, or rows the rank does not hold
        assert check(ShardedItem(5, rows, True, shard=shard), 0, 3, 4, None) is not None, shard
    wrong = check(ShardedItem(5, rows, True, shard=(0, 0)), 0, 1, 4, None)  # rank 1 holds row 1
    assert wrong.startswith("item 0 (room 5) holds rows [0, 0) of 2, but rank 1 of a group of 4 holds rows [1, 2)")
    assert check(ShardedItem(6, original(6, 0, torch.float32), True, shard=(0, 0)), 0, 1, 4, None) is None


def test_reassembly_without_a_process_group_says_how_to_make_one():
    import pytest
    import torch.distributed as dist

    from transfer.errors import UsageError

    assert not dist.is_initialized()
    item = ShardedItem(1, original(1, 4, torch.float32), True)
    for call, what in ((lambda: reassemble_module.reassemble([item]), "reassemble"),
                       (lambda: reassemble_module.agree([True]), "agree")):
        with pytest.raises(UsageError, match=rf"^{what}: torch.distributed has no process group in this process: "
                                             r"call torch.distributed.init_process_group\(\)"):
            call()


def test_items_sharing_memory_are_named_and_adjacent_ones_are_not():
    buf = torch.zeros(20, 3)
    items = [ShardedItem(1, buf[0:10], True), ShardedItem(2, buf[10:15], True), ShardedItem(3, buf[14:20], True),
             ShardedItem(4, original(4, 3, torch.float32), True), ShardedItem(5, buf[:0], True)]
    items[3].deepstack = items[3].full[1:]  # [2, hidden] rows inside its own full tensor
    problems = reassemble_module._shared_memory(items, range(len(items)))
    assert sorted(problems) == [1, 2, 3]  # 0 ends where 1 starts; an empty tensor holds no memory
    assert problems[1].startswith("its full tensor shares memory with room 3's full tensor")
    assert problems[3] == "its full tensor and its deepstack share memory: give each its own"
    assert reassemble_module._shared_memory(items, [0, 2, 4]) == {}  # only the usable items are compared


def _disagreement_lines(caplog, here: list[tuple[bool, tuple[int, ...]]],
                        there: list[tuple[bool, tuple[int, ...]]]) -> list[str]:
    """What this rank logs about the items another rank failed or saw otherwise: the agreement's MIN of both
    ranks' rows, built as the all-reduce would, given to the logging step."""
    rows = [reassemble_module._table([ok for ok, _ in side], [key for _, key in side])[2] for side in (here, there)]
    width = 1 + 2 * len(here[0][1])
    reduced = torch.minimum(torch.tensor(rows[0]), torch.tensor(rows[1])).view(len(here), width)
    items = [ShardedItem(key[0], torch.zeros(1, 1), ok) for ok, key in here]
    caplog.clear()
    with caplog.at_level("WARNING", logger="transfer.reassemble"):
        reassemble_module._log_disagreements(items, [ok for ok, _ in here], reduced, 1)
    return [record.getMessage() for record in caplog.records]


def test_a_batch_another_rank_failed_is_one_line_naming_the_count_and_the_first_rooms(caplog):
    geometry = (8, 24, 1, -1, -1)
    here = [(True, (100 + i, *geometry)) for i in range(20)]
    there = [(False, key) for _, key in here]
    assert _disagreement_lines(caplog, here, there) == [
        "20 rooms failed on another rank of the group (rooms 100, 101, 102, 103, 104, 105, 106, 107 and 12 more); "
        "failing them on rank 1"]
    one = [(True, (7, *geometry)), (True, (8, *geometry))]
    assert _disagreement_lines(caplog, one, [(True, one[0][1]), (False, one[1][1])]) == [
        "room 8 failed on another rank of the group; failing it on rank 1"]


def test_a_batch_whose_geometry_differs_is_one_line_spelling_out_the_first_rooms(caplog):
    here = [(True, (100 + i, 8, 24, 1, -1, -1)) for i in range(5)]
    there = [(True, (100 + i, 9 if i else 8, 24, 1 if i else 2, -1, -1)) for i in range(5)]
    assert _disagreement_lines(caplog, here, there) == [
        "5 rooms have another geometry on another rank of the group (room 100: dtype 1 .. 2; room 101: span 8 .. 9; "
        "room 102: span 8 .. 9 and 2 more); failing them on rank 1"]
    assert _disagreement_lines(caplog, here[:2], there[:1] + here[1:2]) == [
        "room 100 has another geometry on another rank of the group (dtype 1 .. 2); failing it on rank 1"]


def test_a_batch_of_items_unusable_on_this_rank_is_one_line_spelling_out_the_first_rooms(caplog):
    items = [ShardedItem(100 + i, torch.zeros(1, 1), True) for i in range(20)]
    caplog.clear()
    with caplog.at_level("WARNING", logger="transfer.reassemble"):
        reassemble_module._log_unusable(items, [(i, f"problem {i}") for i in range(20)], 1)
        reassemble_module._log_unusable(items, [(4, "its deepstack is odd")], 1)
        reassemble_module._log_unusable(items, [], 1)
    assert [record.getMessage() for record in caplog.records] == [
        "20 rooms are unusable on rank 1 of the group (room 100: problem 0; room 101: problem 1; room 102: problem 2 "
        "and 17 more); failing them",
        "room 104 on rank 1 of the group: its deepstack is odd; failing it"]

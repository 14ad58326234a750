"""Hostile cases for transfer.reassemble: ranks in separate processes over torch.distributed gloo.

Every rank builds its items from (room, dtype, columns) alone, so it can compute the
true full rows on its own and compare the rebuilt bytes with them bit for bit. The
expected shard of a rank is computed here from SPEC.md section 2, not with
transfer.frames.shard_rows. Every wait is bounded: the group's timeout, a deadline
on joining the rank processes, and a bounded wait for the peers' result files."""

from __future__ import annotations

import datetime
import logging
import os
import time
import zlib

import pytest
import gloo_ranks
import torch
import torch.distributed as dist
from gloo_ranks import seen

from transfer.reassemble import ShardedItem, agree, reassemble
from transfer.status import TransferPoll


GARBAGE = 0xA5  # what a destination holds outside the rank's own shard
GROUP_TIMEOUT_S = 15  # a hang on the reviewed code costs this, not the suite
JOIN_S = 120


def spec_shard(span: int, rank: int, size: int) -> tuple[int, int]:
    """SPEC.md section 2, written out again so the test does not trust the code under review."""
    base, rem = divmod(span, size)
    return rank * base + min(rank, rem), base + (1 if rank < rem else 0)


def truth(room: int, span: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The item's true rows: random bytes seeded by (room, cols, dtype)."""
    width = cols * torch.empty((), dtype=dtype).element_size()
    seed = (room * 1_000_003 + cols * 131 + zlib.crc32(str(dtype).encode())) % (2**62)
    raw = torch.randint(0, 256, (span, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype)


def placed(rows: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """A contiguous destination holding this rank's shard of `rows` and garbage elsewhere."""
    dst = torch.full(rows.view(torch.uint8).shape, GARBAGE, dtype=torch.uint8)
    start, count = spec_shard(rows.shape[0], rank, size)
    dst[start : start + count] = rows.view(torch.uint8)[start : start + count]
    return dst.view(rows.dtype)


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit-exact equality of two tensors (or both None)."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(dense(a).view(torch.uint8),
                                                                     dense(b).view(torch.uint8))


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with default strides (.contiguous() keeps odd strides on size-1 dimensions)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


class Case:
    """One item on one rank with its truth and a snapshot of the destination before the call."""

    def __init__(self, rank: int, size: int, room: int, span: int, cols: int = 3,
                 dtype: torch.dtype = torch.float32, ds_cols: int = 0, ds_dtype: torch.dtype | None = None,
                 ok: bool = True) -> None:
        self.rows = truth(room, span, cols, dtype)
        ds_dtype = ds_dtype or dtype
        self.ds_rows = truth(room + 7_777, span, ds_cols, ds_dtype) if ds_cols else None
        ds = placed(self.ds_rows, rank, size) if self.ds_rows is not None else None
        self.item = ShardedItem(room, placed(self.rows, rank, size), ok, ds)
        self.snapshot()

    def snapshot(self) -> None:
        """Remember the destination as it is now (after any test-made change to the item)."""
        self.before = (self.item.full.clone() if isinstance(self.item.full, torch.Tensor) else None,
                       None if self.item.deepstack is None else self.item.deepstack.clone())

    def exact(self) -> bool:
        """The destination holds the item's true rows (and deepstack rows)."""
        return same(self.item.full, self.rows) and same(self.item.deepstack, self.ds_rows)

    def untouched(self) -> bool:
        """The destination is exactly as it was before the call."""
        full = self.item.full if isinstance(self.item.full, torch.Tensor) else None
        return same(full, self.before[0]) and same(self.item.deepstack, self.before[1])


class CapturedLog(logging.Handler):
    """The messages one logger emits while in the `with` block."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.DEBUG)
        self.logger = logging.getLogger(name)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> CapturedLog:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)


def judge(cases: list[Case], call) -> dict:
    """Run `call(items)` and report flags (or what it raised), exactness and untouchedness per item."""
    try:
        flags, raised = call([c.item for c in cases]), None
    except Exception as exc:  # noqa: BLE001 - what it raises is the observation
        flags, raised = None, f"{type(exc).__name__}: {exc}"
    return {"flags": flags, "raised": raised, "exact": [c.exact() for c in cases],
            "untouched": [c.untouched() for c in cases]}


def run_ranks(scenario: str, size: int, folder) -> list[dict]:
    """Each rank's result for `scenario` ({'missing': True, ...} for a rank that wrote none in time)."""
    return gloo_ranks.run_ranks(__name__, scenario, size, folder, group_timeout_s=GROUP_TIMEOUT_S, join_s=JOIN_S)


DTYPES = ["bfloat16", "float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
          "float8_e4m3fn", "float8_e5m2"]


def batch_scenarios(rank: int, size: int) -> dict:
    """Every batch scenario in the same order on every rank; the group stays usable throughout."""
    out: dict = {}

    spans = sorted({0, 1, 2, 3, 5, 7, 97, max(size - 1, 0), size, size + 1, 2 * size + 1})
    cases = [Case(rank, size, 100 + i, span, ds_cols=2 if i % 2 else 0) for i, span in enumerate(spans)]
    out["uneven_spans"] = judge(cases, reassemble)

    # Odd widths so the packed buffer puts multi-byte dtypes at odd byte offsets.
    cases = [Case(rank, size, 200 + i, 5 + i % 3, cols=3, dtype=getattr(torch, name),
                  ds_cols=1 + i % 2, ds_dtype=getattr(torch, DTYPES[-1 - i]))
             for i, name in enumerate(DTYPES)]
    out["dtypes"] = judge(cases, reassemble)

    cases = [Case(rank, size, 300, 9, cols=1, dtype=torch.bfloat16, ds_cols=3),
             Case(rank, size, 301, 4, cols=33, dtype=torch.int8),
             Case(rank, size, 302, 13, cols=4, dtype=torch.float32, ds_cols=8, ds_dtype=torch.bfloat16),
             Case(rank, size, 303, 1, cols=5, dtype=torch.float16)]
    out["mixed_geometry"] = judge(cases, reassemble)

    # Deepstack on one rank only: that item fails everywhere; the others rebuild.
    cases = [Case(rank, size, 400, 6), Case(rank, size, 401, 6, ds_cols=2 if rank == 0 else 0),
             Case(rank, size, 402, 6, ds_cols=2)]
    out["deepstack_on_one_rank"] = judge(cases, reassemble)

    # Two dtypes that are not in DTYPE_BYTES, of the same size: the ranks disagree on the dtype.
    odd = torch.float8_e4m3fnuz if rank == 0 else torch.float8_e5m2fnuz
    cases = [Case(rank, size, 500, 6, dtype=odd), Case(rank, size, 501, 6)]
    out["unlisted_dtype_mismatch"] = judge(cases, reassemble)

    # The last rank's destination is a transposed (non-contiguous) view: fail it everywhere.
    cases = [Case(rank, size, 600, 8, cols=4), Case(rank, size, 601, 5)]
    if rank == size - 1:
        full = cases[0].item.full
        cases[0].item.full = full.t().contiguous().t()  # same values, column-major
        cases[0].snapshot()
    out["non_contiguous_on_one_rank"] = judge(cases, reassemble)

    # The ranks hold the same rooms in a different order (same geometry): must not swap rows.
    rooms = [700, 701] if rank == 0 else [701, 700]
    cases = [Case(rank, size, room, 6) for room in rooms]
    out["room_order_differs"] = judge(cases, reassemble)

    # A room outside the wire's 0 .. 2**63 - 1 was never received: its item fails, the call goes on.
    cases = [Case(rank, size, 2**64 + 5, 6), Case(rank, size, 801, 4)]
    out["huge_room"] = judge(cases, reassemble)

    # Room 5 on even ranks, 2**63 + 5 on odd ones: two rooms, not one item to merge.
    cases = [Case(rank, size, 2**63 + 5 if rank % 2 else 5, 6), Case(rank, size, 802, 4)]
    out["rooms_alike_mod_2_63"] = judge(cases, reassemble)

    # The last rank's outcome was set to a TransferPoll after the item was made: only Success is ok.
    cases = [Case(rank, size, 810, 6), Case(rank, size, 811, 5)]
    if rank == size - 1:
        cases[0].item.ok = TransferPoll.Transferring
    out["poll_set_later"] = judge(cases, reassemble)

    # Shards given as this rank's split over the group rebuild; a whole-span shard (a group of
    # one's split) on every rank contradicts any larger group and refuses the batch everywhere.
    cases = [Case(rank, size, 820 + i, span) for i, span in enumerate((1, 6, 11))]
    for case in cases:
        case.item.shard = spec_shard(case.rows.shape[0], rank, size)
    out["shards_of_the_group"] = judge(cases, reassemble)
    cases = [Case(rank, size, 830, 6), Case(rank, size, 831, 9)]
    cases[0].item.shard = spec_shard(6, rank, size)
    cases[1].item.shard = (0, 9)
    out["shards_of_another_group"] = judge(cases, reassemble)

    # The span differs on rank 0: the item fails everywhere and every other rank says why.
    with CapturedLog("transfer.reassemble") as captured:
        cases = [Case(rank, size, 840, 6 if rank == 0 else 7), Case(rank, size, 841, 4)]
        out["geometry_differs"] = judge(cases, reassemble)
    out["geometry_differs"]["log"] = captured.lines

    # More items than any small fixed agreement table holds.
    cases = [Case(rank, size, 1000 + i, i % (2 * size + 2), cols=2, dtype=torch.float16, ds_cols=i % 2)
             for i in range(1500)]
    out["many_items"] = judge(cases, reassemble)

    out["empty"] = judge([], reassemble)
    out["empty_agree"] = agree([])
    return out


@pytest.fixture(scope="module", params=(1, 2, 3, 4), ids=lambda n: f"world{n}")
def batch(request, tmp_path_factory):
    """(size, every rank's observations) after one spawned run of batch_scenarios."""
    size = request.param
    return size, seen(run_ranks("batch_scenarios", size, tmp_path_factory.mktemp(f"batch{size}")))


def _each(batch, name):
    return [ranks[name] for ranks in batch[1]]


@pytest.mark.parametrize("name", ["uneven_spans", "dtypes", "mixed_geometry", "many_items"])
def test_batch_rebuilds_bit_exact(batch, name):
    for rank, obs in enumerate(_each(batch, name)):
        assert obs["raised"] is None, (rank, obs["raised"])
        assert all(obs["flags"]), (rank, obs["flags"])
        assert all(obs["exact"]), (rank, [i for i, e in enumerate(obs["exact"]) if not e])


def test_deepstack_on_one_rank_only_fails_that_item(batch):
    size = batch[0]
    for obs in _each(batch, "deepstack_on_one_rank"):
        if size == 1:
            assert obs["flags"] == [True, True, True] and all(obs["exact"])
            continue
        assert obs["flags"] == [True, False, True]
        assert obs["exact"][0] and obs["exact"][2] and obs["untouched"][1]


def test_unlisted_dtypes_that_differ_fail_the_item(batch):
    size = batch[0]
    for obs in _each(batch, "unlisted_dtype_mismatch"):
        assert obs["raised"] is None, obs["raised"]
        if size == 1:
            assert obs["flags"] == [True, True] and all(obs["exact"])
            continue
        assert obs["flags"] == [False, True], "rows of different dtypes were exchanged as one item"
        assert obs["untouched"][0] and obs["exact"][1]


def test_non_contiguous_destination_fails_everywhere_untouched(batch):
    for obs in _each(batch, "non_contiguous_on_one_rank"):
        assert obs["flags"] == [False, True]
        assert obs["untouched"][0] and obs["exact"][1]


def test_ranks_holding_rooms_in_another_order_raise_everywhere_and_write_nothing(batch):
    size = batch[0]
    for obs in _each(batch, "room_order_differs"):
        if size == 1:
            assert obs["flags"] == [True, True]
            continue
        assert obs["raised"] is not None and "room" in obs["raised"], obs
        assert all(obs["untouched"]), "rows of one room were written into another"


def test_a_room_outside_the_wires_range_fails_its_item_only(batch):
    for obs in _each(batch, "huge_room"):
        assert obs["raised"] is None, obs["raised"]
        assert obs["flags"] == [False, True] and obs["untouched"][0] and obs["exact"][1]


def _raised_everywhere_untouched(batch, name: str, expected: str) -> None:
    """Every rank raised naming `expected` and wrote nothing (a world of one rebuilt both items)."""
    for rank, obs in enumerate(_each(batch, name)):
        if batch[0] == 1:
            assert obs["flags"] == [True, True] and all(obs["exact"])
            continue
        assert obs["raised"] is not None and expected in obs["raised"], (rank, obs)
        assert all(obs["untouched"]), (rank, "rows were written although the batch was refused")


def test_rooms_equal_modulo_2_63_are_different_rooms(batch):
    _raised_everywhere_untouched(batch, "rooms_alike_mod_2_63", "different rooms at position 0")


def test_an_outcome_set_to_an_unfinished_poll_after_construction_fails_the_item(batch):
    for rank, obs in enumerate(_each(batch, "poll_set_later")):
        assert obs["raised"] is None, (rank, obs["raised"])
        assert obs["flags"] == [False, True], (rank, obs)
        assert obs["untouched"][0] and obs["exact"][1]


def test_shards_that_are_the_groups_split_rebuild(batch):
    for rank, obs in enumerate(_each(batch, "shards_of_the_group")):
        assert obs["raised"] is None and all(obs["flags"]) and all(obs["exact"]), (rank, obs)


def test_shards_of_another_group_raise_everywhere_and_write_nothing(batch):
    _raised_everywhere_untouched(batch, "shards_of_another_group",
                                 "ConfigError: reassemble: item 1 (room 831) holds rows [0, 9) of 9")


def test_a_geometry_that_differs_fails_the_item_and_says_which_part(batch):
    size = batch[0]
    for rank, obs in enumerate(_each(batch, "geometry_differs")):
        assert obs["raised"] is None, (rank, obs["raised"])
        if size == 1:
            assert obs["flags"] == [True, True]
            continue
        assert obs["flags"] == [False, True] and obs["untouched"][0] and obs["exact"][1], (rank, obs)
        assert any("room 840" in line and "span 6 .. 7" in line for line in obs["log"]), (rank, obs["log"])


def test_empty_batch(batch):
    for obs in _each(batch, "empty"):
        assert obs["flags"] == [] and obs["raised"] is None
    assert _each(batch, "empty_agree") == [[]] * batch[0]


def count_mismatch(rank: int, size: int) -> dict:
    """Rank 0 has two items, the others three; afterwards a well-formed batch must still work."""
    cases = [Case(rank, size, 10 + i, 6) for i in range(2 if rank == 0 else 3)]
    started = time.monotonic()
    first = judge(cases, reassemble)
    first["took"] = time.monotonic() - started
    return {"mismatch": first, "after": judge([Case(rank, size, 20, 7, ds_cols=1)], reassemble)}


def empty_vs_items(rank: int, size: int) -> dict:
    """Rank 0 has no items, the others one."""
    cases = [] if rank == 0 else [Case(rank, size, 30, 6)]
    started = time.monotonic()
    first = judge(cases, reassemble)
    first["took"] = time.monotonic() - started
    return {"mismatch": first, "after": judge([Case(rank, size, 31, 5)], reassemble)}


def agree_width_mismatch(rank: int, size: int) -> dict:
    """agree() with two keys per item on rank 0 and three on the others."""
    keys = [(1, 2)] if rank == 0 else [(1, 2, 3)]
    try:
        return {"flags": agree([True], keys=keys), "raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"flags": None, "raised": f"{type(exc).__name__}: {exc}"}


def agree_bad_key_on_one_rank(rank: int, size: int) -> dict:
    """agree() where the last rank's key does not fit 64 bits."""
    keys = [(2**64,)] if rank == size - 1 else [(1,)]
    started = time.monotonic()
    try:
        out = {"flags": agree([True], keys=keys), "raised": None}
    except Exception as exc:  # noqa: BLE001
        out = {"flags": None, "raised": f"{type(exc).__name__}: {exc}"}
    out["took"] = time.monotonic() - started
    return out


def agree_unusable_argument_on_one_rank(rank: int, size: int) -> dict:
    """agree() where the last rank passes a key that is not a tuple, then an outcome without a truth value;
    afterwards a well-formed call must still work."""
    out = {}
    for name, oks, keys in (("key", [True], [5]), ("ok", [torch.ones(2)], [(1,)])):
        if rank != size - 1:
            oks, keys = [True], [(1,)]
        started = time.monotonic()
        try:
            out[name] = {"flags": agree(oks, keys=keys), "raised": None}
        except Exception as exc:  # noqa: BLE001
            out[name] = {"flags": None, "raised": f"{type(exc).__name__}: {exc}"}
        out[name]["took"] = time.monotonic() - started
    out["after"] = agree([True, TransferPoll.Failed], keys=[(1,), (2,)])
    return out


def missing_tensor_on_one_rank(rank: int, size: int) -> dict:
    """The last rank's receive failed before it had rows: its item's `full` is None."""
    cases = [Case(rank, size, 40, 6), Case(rank, size, 41, 6)]
    if rank == size - 1:
        cases[0].item.full, cases[0].item.ok = None, False
        cases[0].snapshot()
    return judge(cases, reassemble)


def odd_strides_on_one_rank(rank: int, size: int) -> dict:
    """The last rank's destination is 'contiguous' to torch (hidden 1) but has a row stride of 1
    and a column stride of 4 (a transposed row): a uint8 view of it cannot be taken."""
    cases = [Case(rank, size, 50, 4, cols=1), Case(rank, size, 51, 6)]
    if rank == size - 1:
        odd = torch.empty(1, 4, dtype=torch.float32).t()
        odd.copy_(cases[0].item.full)
        cases[0].item.full = odd
        cases[0].snapshot()
    return judge(cases, reassemble)


def sub_groups(rank: int, size: int) -> dict:
    """World 4 in blocks [0, 1] and [2, 3]: each block rebuilds its own items; a non-member call raises."""
    blocks = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine, other = blocks[rank // 2], blocks[1 - rank // 2]
    out = {}
    if rank == 0:
        cases = [Case(0, 2, 60, 6)]
        out["non_member"] = judge(cases, lambda items: reassemble(items, other))
    in_block = rank % 2
    cases = [Case(in_block, 2, 70 + 10 * (rank // 2) + i, span, ds_cols=i % 2)
             for i, span in enumerate([1, 2, 5, 11])]
    out["block"] = judge(cases, lambda items: reassemble(items, mine))
    cases = [Case(rank, size, 90 + i, span) for i, span in enumerate([3, 9])]
    out["world"] = judge(cases, reassemble)
    return out


def wrong_block_on_one_rank(rank: int, size: int) -> dict:
    """The last rank believes its block is one rank larger (then its rank_in_block is off by one);
    afterwards a well-formed batch must still work."""
    out = {}
    for name, kwargs in (("block_size", {"block_size": size + 1}), ("rank_in_block", {"rank_in_block": rank + 1})):
        cases = [Case(rank, size, 100, 6)]
        call = (lambda items, kw=kwargs: reassemble(items, **kw)) if rank == size - 1 else reassemble
        started = time.monotonic()
        out[name] = judge(cases, call)
        out[name]["took"] = time.monotonic() - started
    out["after"] = judge([Case(rank, size, 101, 5)], reassemble)
    return out


def unusable_item_on_one_rank(rank: int, size: int) -> dict:
    """The last rank holds an item whose room is text, then one whose outcome has no truth value;
    afterwards a well-formed batch must still work."""
    out = {}
    for name, field, value in (("room", "room", "seven"), ("ok", "ok", torch.ones(2))):
        cases = [Case(rank, size, 110, 6), Case(rank, size, 111, 4)]
        if rank == size - 1:
            setattr(cases[1].item, field, value)
        started = time.monotonic()
        out[name] = judge(cases, reassemble)
        out[name]["took"] = time.monotonic() - started
    out["after"] = judge([Case(rank, size, 112, 5)], reassemble)
    return out


def dead_peer(rank: int, size: int) -> dict:
    """Rank 1 exits without a word once the group is up; rank 0 must not wait the group timeout."""
    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone without a word
    time.sleep(1)  # let the peer go
    started = time.monotonic()
    result = judge([Case(rank, size, 95, 8)], reassemble)
    result["took"] = time.monotonic() - started
    return result


def test_ranks_with_different_item_counts_raise_everywhere_promptly(tmp_path):
    for rank, obs in enumerate(seen(run_ranks("count_mismatch", 2, tmp_path))):
        first = obs["mismatch"]
        assert first["raised"] is not None and "items" in first["raised"], (rank, first)
        assert first["raised"].startswith("UsageError: reassemble:"), (rank, first)  # misuse, no CollectiveError
        assert "Timed out" not in first["raised"], (rank, first)  # told, not left to the group's timeout
        assert all(first["untouched"])
        assert obs["after"]["flags"] == [True] and all(obs["after"]["exact"]), (rank, obs["after"])


def middle_rank_out_of_step(rank: int, size: int) -> dict:
    """Rank 1 of three passes one item where the others pass two, then refuses a batch (a block size
    off by one); afterwards a well-formed batch must still work."""
    out = {}
    cases = [Case(rank, size, 130, 6)] + ([] if rank == 1 else [Case(rank, size, 131, 4)])
    out["count"] = judge(cases, reassemble)
    cases = [Case(rank, size, 132, 6)]
    out["refused"] = judge(cases, (lambda items: reassemble(items, block_size=size + 1)) if rank == 1 else reassemble)
    out["after"] = judge([Case(rank, size, 133, 5)], reassemble)
    return out


def test_a_rank_out_of_step_is_named_on_every_rank(tmp_path):
    for rank, obs in enumerate(seen(run_ranks("middle_rank_out_of_step", 3, tmp_path))):
        got = obs["count"]["raised"] or ""
        assert got.startswith("UsageError: reassemble: the ranks of the group pass different numbers of items "
                              "(rank 1 of the group passes 1, rank 0 passes 2; "
                              f"this is rank {rank}, with {1 if rank == 1 else 2})"), (rank, got)
        got = obs["refused"]["raised"] or ""
        expected = "block_size 4 differs" if rank == 1 else "rank 1 of the group refused the batch (its log says why"
        assert got.startswith("ConfigError: reassemble: ") and expected in got, (rank, got)
        assert all(obs["count"]["untouched"]) and all(obs["refused"]["untouched"]), (rank, obs)
        assert obs["after"]["flags"] == [True] and all(obs["after"]["exact"]), (rank, obs["after"])


def test_empty_list_on_one_rank_raises_everywhere_promptly(tmp_path):
    for rank, obs in enumerate(seen(run_ranks("empty_vs_items", 2, tmp_path))):
        first = obs["mismatch"]
        assert first["raised"] is not None and "items" in first["raised"], (rank, first)
        assert "Timed out" not in first["raised"], (rank, first)  # told, not left to the group's timeout
        assert obs["after"]["flags"] == [True] and all(obs["after"]["exact"]), (rank, obs["after"])


def test_agree_with_different_key_widths_raises_everywhere(tmp_path):
    for rank, obs in enumerate(seen(run_ranks("agree_width_mismatch", 2, tmp_path))):
        assert obs["raised"] is not None and "keys" in obs["raised"], (rank, obs)


def test_agree_with_an_invalid_key_on_one_rank_raises_everywhere_promptly(tmp_path):
    for rank, obs in enumerate(seen(run_ranks("agree_bad_key_on_one_rank", 2, tmp_path))):
        assert obs["raised"] is not None and obs["raised"].startswith("ConfigError: agree:"), (rank, obs)
        assert "Timed out" not in obs["raised"], (rank, obs)  # told, not left to the group's timeout


def test_agree_with_an_unusable_argument_on_one_rank_raises_everywhere_promptly(tmp_path):
    for rank, obs in enumerate(seen(run_ranks("agree_unusable_argument_on_one_rank", 2, tmp_path))):
        for name in ("key", "ok"):
            got = obs[name]
            assert got["raised"] is not None and got["raised"].startswith("ConfigError: agree:"), (rank, name, got)
            assert "Timed out" not in got["raised"], (rank, name, got)  # told, not left to the group's timeout
        assert obs["after"] == [True, False], (rank, obs["after"])


def test_missing_destination_on_one_rank_fails_the_item_everywhere(tmp_path):
    for rank, obs in enumerate(seen(run_ranks("missing_tensor_on_one_rank", 2, tmp_path))):
        assert obs["raised"] is None, (rank, obs["raised"])
        assert obs["flags"] == [False, True], (rank, obs)
        assert obs["untouched"][0] and obs["exact"][1]


def test_destination_without_a_byte_view_fails_the_item_everywhere(tmp_path):
    for rank, obs in enumerate(seen(run_ranks("odd_strides_on_one_rank", 2, tmp_path))):
        assert obs["raised"] is None, (rank, obs["raised"])
        assert obs["flags"] == [False, True], (rank, obs)
        assert obs["untouched"][0] and obs["exact"][1]


def _refused_by_the_last_rank(observed: list[dict], names: tuple[str, ...], reason) -> None:
    """Each named batch raised a ConfigError on every rank, promptly and writing nothing: the last
    rank naming `reason(name)`, the others another rank's refusal; a good batch after it works."""
    for rank, obs in enumerate(observed):
        for name in names:
            got = obs[name]
            assert got["raised"] is not None and got["raised"].startswith("ConfigError: reassemble:"), (rank, name, got)
            last = len(observed) - 1
            expected = reason(name) if rank == last else f"rank {last} of the group refused the batch (its log says why"
            assert expected in got["raised"], (rank, name, got["raised"])
            assert "Timed out" not in got["raised"], (rank, name, got)  # told, not left to the group's timeout
            assert all(got["untouched"]), (rank, name)
        assert obs["after"]["flags"] == [True] and all(obs["after"]["exact"]), (rank, obs["after"])


def test_a_wrong_block_on_one_rank_raises_everywhere_promptly(tmp_path):
    observed = seen(run_ranks("wrong_block_on_one_rank", 2, tmp_path))
    _refused_by_the_last_rank(observed, ("block_size", "rank_in_block"), lambda name: name)


def test_an_unusable_item_on_one_rank_raises_everywhere_promptly(tmp_path):
    observed = seen(run_ranks("unusable_item_on_one_rank", 2, tmp_path))
    _refused_by_the_last_rank(observed, ("room", "ok"), lambda name: "item 1 is not a usable ShardedItem")


def test_blocks_inside_a_larger_world(tmp_path):
    observed = seen(run_ranks("sub_groups", 4, tmp_path))
    non_member = observed[0]["non_member"]
    assert non_member["raised"] is not None and "not a member" in non_member["raised"], non_member
    # What to do, not only what is wrong: torch.distributed skips a non-member's collectives silently.
    assert "call it only on the ranks of the group" in non_member["raised"], non_member
    assert "global rank 0" in non_member["raised"], non_member
    assert all(non_member["untouched"]), "a rank outside the group reported or wrote rows"
    for rank, obs in enumerate(observed):
        for name in ("block", "world"):
            assert obs[name]["raised"] is None, (rank, name, obs[name]["raised"])
            assert all(obs[name]["flags"]) and all(obs[name]["exact"]), (rank, name, obs[name])


def test_a_dead_peer_makes_reassembly_raise_not_hang(tmp_path):
    obs = seen(run_ranks("dead_peer", 2, tmp_path)[:1])[0]
    assert obs["raised"] is not None, obs
    # Not this rank's misuse: a CollectiveError (still a UsageError) naming this rank and the rooms.
    assert obs["raised"].startswith("CollectiveError: reassemble:"), obs["raised"]
    assert "rank 0 of the group" in obs["raised"] and "rooms 95 (1 item)" in obs["raised"], obs["raised"]
    assert "Timed out" not in obs["raised"], obs["raised"]  # the peer's end was seen, not the group's timeout
    assert all(obs["untouched"])


STALL_GROUP_TIMEOUT_S = 3


def late_peer(rank: int, size: int) -> dict:
    """On a group with a short timeout, rank 1 reaches neither reassemble nor agree in time; rank 0
    calls both (the group is broken after the first, so each on a group of its own)."""
    groups = [dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=STALL_GROUP_TIMEOUT_S))
              for _ in range(2)]
    if rank == 1:
        time.sleep(2 * STALL_GROUP_TIMEOUT_S + 3)  # busy elsewhere past both timeouts
        return {}
    out = {}
    for name, group in zip(("reassemble", "agree"), groups):
        cases = [Case(rank, size, 960, 8), Case(rank, size, 961, 3)]
        call = ((lambda items, g=group: reassemble(items, g)) if name == "reassemble"
                else (lambda items, g=group: agree([True] * len(items), g)))
        started = time.monotonic()
        out[name] = judge(cases, call)
        out[name]["took"] = time.monotonic() - started
    return out


def test_a_late_peer_raises_a_collective_error_naming_this_rank_and_the_rooms(tmp_path):
    from transfer.errors import CollectiveError, UsageError

    assert issubclass(CollectiveError, UsageError)  # callers catching UsageError still catch it
    obs = seen(run_ranks("late_peer", 2, tmp_path)[:1])[0]
    got = obs["reassemble"]
    assert got["raised"] is not None and got["raised"].startswith("CollectiveError: reassemble:"), got
    assert "rank 0 of the group" in got["raised"] and "rooms 960, 961" in got["raised"], got["raised"]
    assert "Timed out" in got["raised"], got["raised"]
    assert all(got["untouched"])
    got = obs["agree"]
    assert got["raised"] is not None and got["raised"].startswith("CollectiveError: agree:"), got
    assert "rank 0 of the group" in got["raised"] and "2 items" in got["raised"], got["raised"]



def exchange_memory_short_on_one_rank(rank: int, size: int) -> dict:
    """The last rank's address space is capped just above what it holds, so it cannot allocate the
    exchange's buffers (32 MiB of rows over 2 ranks: 16 MiB packed, 32 MiB gathered) although the
    ranks agree; afterwards, the cap lifted, a well-formed batch must still work."""
    import resource

    judge([Case(rank, size, 970, 5)], reassemble)  # warm up the group's threads and allocator
    cases = [Case(rank, size, 971 + i, 64, cols=32 * 1024) for i in range(4)]  # 8 MiB each
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if rank == size - 1:
        with open("/proc/self/status") as handle:
            vm = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (8 << 20), hard))
    started = time.monotonic()
    flags, raised = None, None
    try:
        with CapturedLog("transfer.reassemble") as captured:
            flags = reassemble([c.item for c in cases])
    except Exception as exc:  # noqa: BLE001 - what it raises is the observation
        raised = f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # judged below: the comparisons allocate too
    out = {"short": {"flags": flags, "raised": raised, "took": time.monotonic() - started, "log": captured.lines,
                     "untouched": [c.untouched() for c in cases]}}
    del cases
    out["after"] = judge([Case(rank, size, 980, 7, ds_cols=1)], reassemble)
    return out


def test_a_rank_that_cannot_allocate_the_exchange_fails_the_batch_everywhere_promptly(tmp_path):
    observed = seen(run_ranks("exchange_memory_short_on_one_rank", 2, tmp_path))
    for rank, obs in enumerate(observed):
        short = obs["short"]
        assert short["raised"] is None, (rank, short["raised"])
        assert short["flags"] == [False] * 4 and all(short["untouched"]), (rank, short)
        assert not any("Timed out" in line for line in short["log"]), (rank, short["log"])
        assert obs["after"]["flags"] == [True] and all(obs["after"]["exact"]), (rank, obs["after"])
    assert any("could not allocate" in line for line in observed[-1]["short"]["log"]), observed[-1]["short"]["log"]


def items_not_a_list_on_one_rank(rank: int, size: int) -> dict:
    """The last rank passes its items as a generator, then passes None instead of a list; afterwards a
    well-formed batch must still work."""
    out = {}
    for name in ("generator", "none"):
        cases = [Case(rank, size, 990, 6), Case(rank, size, 991, 3, ds_cols=1)]
        call = reassemble
        if rank == size - 1:
            call = ((lambda items: reassemble(item for item in items)) if name == "generator"
                    else (lambda items: reassemble(None)))  # type: ignore[arg-type]
        started = time.monotonic()
        out[name] = judge(cases, call)
        out[name]["took"] = time.monotonic() - started
    out["after"] = judge([Case(rank, size, 992, 5)], reassemble)
    return out


def test_items_given_as_an_iterable_rebuild_and_no_items_raise_everywhere_promptly(tmp_path):
    observed = seen(run_ranks("items_not_a_list_on_one_rank", 2, tmp_path))
    for rank, obs in enumerate(observed):
        got = obs["generator"]
        assert got["raised"] is None and got["flags"] == [True, True] and all(got["exact"]), (rank, got)
        got = obs["none"]
        assert got["raised"] is not None and got["raised"].startswith("ConfigError: reassemble:"), (rank, got)
        assert "Timed out" not in got["raised"], (rank, got)  # told, not left to the group's timeout
        assert all(got["untouched"]), rank
        assert obs["after"]["flags"] == [True] and all(obs["after"]["exact"]), (rank, obs["after"])
    assert "the items are not a sequence" in observed[-1]["none"]["raised"], observed[-1]["none"]["raised"]


def overlapping_destinations(rank: int, size: int) -> dict:
    """Rooms 1000 and 1001 of 10 rows each are given destinations that share 5 rows of one buffer
    (rows 0-9 and 5-14), then room 1002 a deepstack that is its own destination; room 1003 is whole."""
    buf = torch.full((15, 3), 0, dtype=torch.float32)
    cases = [Case(rank, size, 1000 + i, 10) for i in range(2)]
    for case, start in zip(cases, (0, 5)):
        case.item.full = buf[start : start + 10]
    for case in cases:  # what each rank's receive left there: its own shard of each room, the second last
        start, count = spec_shard(10, rank, size)
        case.item.full[start : start + count] = case.rows[start : start + count]
    aliased = Case(rank, size, 1002, 6)
    aliased.item.deepstack = aliased.item.full
    whole = Case(rank, size, 1003, 7)
    cases += [aliased, whole]
    for case in cases:
        case.snapshot()
    with CapturedLog("transfer.reassemble") as captured:
        out = judge(cases, reassemble)
    out["log"] = captured.lines
    return out


def test_destinations_sharing_memory_fail_their_items_everywhere_untouched(tmp_path):
    for rank, obs in enumerate(seen(run_ranks("overlapping_destinations", 2, tmp_path))):
        assert obs["raised"] is None, (rank, obs["raised"])
        assert obs["flags"] == [False, False, False, True], (rank, obs)
        assert obs["untouched"][:3] == [True] * 3 and obs["exact"][3], (rank, obs)
        named = [line for line in obs["log"] if "room 100" in line]
        assert len(named) == 1 and named[0].startswith(f"3 rooms are unusable on rank {rank} of the group ("), \
            (rank, obs["log"])
        assert "room 1000: its full tensor shares memory with room 1001's full tensor" in named[0], named
        assert "room 1002: its full tensor and its deepstack share memory" in named[0], named


def first_item_on_a_device_the_group_cannot_use(rank: int, size: int) -> dict:
    """The last rank's first item is on the meta device (a destination never made real); the batch's
    collectives must still run where the group can run them, and the group stay usable."""
    whole = Case(rank, size, 1101, 4)
    first = Case(rank, size, 1100, 6).item
    if rank == size - 1:
        first = ShardedItem(1100, torch.empty(6, 3, device="meta"), True)
    started = time.monotonic()
    out = {"meta": judge([whole], lambda items: reassemble([first, *items]))}
    out["meta"]["took"] = time.monotonic() - started
    out["after"] = judge([Case(rank, size, 1102, 5)], reassemble)
    device = "meta" if rank == size - 1 else None
    try:
        out["agree"] = {"flags": agree([True], device=device), "raised": None}
    except Exception as exc:  # noqa: BLE001 - what it raises is the observation
        out["agree"] = {"flags": None, "raised": f"{type(exc).__name__}: {exc}"}
    out["agree_after"] = agree([True, False])
    return out


def test_a_first_item_on_a_device_the_group_cannot_use_fails_only_that_item_everywhere(tmp_path):
    for rank, obs in enumerate(seen(run_ranks("first_item_on_a_device_the_group_cannot_use", 2, tmp_path))):
        got = obs["meta"]
        assert got["raised"] is None, (rank, got["raised"])
        assert got["flags"] == [False, True] and got["exact"] == [True], (rank, got)
        assert obs["after"]["flags"] == [True] and all(obs["after"]["exact"]), (rank, obs["after"])
        expected = ("device 'meta': the group's gloo backend runs no collective on meta tensors" if rank == 1
                    else "rank 1 of the group refused the batch (its log says why; other ranks may have refused it "
                         "too, each logging why)")
        assert obs["agree"]["raised"] == f"ConfigError: agree: {expected}", (rank, obs["agree"])
        assert obs["agree_after"] == [True, False], (rank, obs["agree_after"])


def agree_on_a_device_one_rank_lacks(rank: int, size: int) -> dict:
    """The last rank asks agree() for a CUDA device no process has (gloo runs collectives on CUDA, so the
    device passes as the backend's); afterwards a well-formed call must still work."""
    device = "cuda:99" if rank == size - 1 else None
    started = time.monotonic()
    try:
        out = {"flags": agree([True], device=device), "raised": None}
    except Exception as exc:  # noqa: BLE001 - what it raises is the observation
        out = {"flags": None, "raised": f"{type(exc).__name__}: {exc}"}
    out["took"] = time.monotonic() - started
    out["after"] = agree([True, False])
    return out


def test_agree_on_a_device_one_rank_lacks_raises_everywhere_promptly(tmp_path):
    observed = seen(run_ranks("agree_on_a_device_one_rank_lacks", 2, tmp_path))
    for rank, obs in enumerate(observed):
        assert obs["raised"] is not None and obs["raised"].startswith("ConfigError: agree:"), (rank, obs)
        assert "Timed out" not in obs["raised"], (rank, obs)  # told, not left to the group's timeout
        assert obs["after"] == [True, False], (rank, obs["after"])
    assert "device 'cuda:99': this process cannot hold a tensor there" in observed[-1]["raised"], observed[-1]
    assert "rank 1 of the group refused the batch" in observed[0]["raised"], observed[0]

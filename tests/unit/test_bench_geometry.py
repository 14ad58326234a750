"""bench with several encode ranks: the plan, the rows, ratios and added latency per cell, the table."""

from __future__ import annotations

import pytest

from transfer import bench, cli
from transfer.frames import prefill_shard


def _opts(*argv: str) -> bench.Options:
    return bench.options_from(cli.build_parser().parse_args(["bench", *argv]))


def test_encode_ranks_default_to_one_and_take_a_list():
    assert _opts().encode_ranks == [1]
    assert all(c.encode_ranks == 1 and c.prefill_ranks == c.fanout for c in bench.plan(_opts(), wire_ok=True))
    opts = _opts("--encode-ranks", "1,2", "--fanouts", "2", "--sizes", "64x256", "--inflight", "4",
                 "--paths", "raw,epd", "--integrity", "off")
    cells = bench.plan(opts, wire_ok=False)
    assert [(c.path, c.encode_ranks, c.prefill_ranks) for c in cells] == [("raw", 1, 2), ("epd", 1, 2),
                                                                          ("raw", 2, 4), ("epd", 2, 4)]
    assert [[c.encode_ranks for c in g] for g in bench._groups(cells)] == [[1, 1], [2, 2]]


def test_a_cells_shards_cover_the_item_over_the_whole_prefill_group():
    cell = bench.Cell("epd", 63, 256, "torch.bfloat16", fanout=2, inflight=1, items=1, encode_ranks=2)
    shards = [cell.shard(r) for r in range(cell.prefill_ranks)]
    assert shards == [prefill_shard(63, r, 4, 2) for r in range(4)]
    assert sum(rows for _, rows in shards) == 63 and shards[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(shards, shards[1:]))
    one = bench.Cell("epd", 63, 256, "torch.bfloat16", fanout=2, inflight=1, items=1)
    assert [one.shard(r) for r in range(2)] == [(0, 32), (32, 31)]


def test_arenas_fit_every_ranks_largest_shard():
    cells = [bench.Cell("raw", 64, 256, "torch.bfloat16", fanout=2, inflight=4, items=8),
             bench.Cell("raw", 64, 256, "torch.bfloat16", fanout=2, inflight=4, items=8, encode_ranks=2)]
    # Ranks 0-1 hold 32 rows at E = 1, ranks 2-3 only exist at E = 2 (16 rows each).
    assert bench.arena_sizes(bench.Options(), cells) == [4 * 32 * 512] * 2 + [4 * 16 * 512] * 2


def _raw_report(rooms, latency, nbytes, t_start=0.0, t_end=1.0):
    return {"t_start": t_start, "t_end": t_end, "latencies": [latency(r) for r in rooms],
            "latency_rooms": list(rooms), "failed": [], "bytes": nbytes, "cpu": None}


def test_a_raw_row_sums_its_encode_ranks_and_takes_each_rooms_slowest():
    cell = bench.Cell("raw", 64, 256, "torch.bfloat16", fanout=1, inflight=2, items=4, encode_ranks=2)
    half = 4 * cell.item_bytes // 2
    reports = {("encode", 0): _raw_report(range(4), lambda r: 0.001, half, t_start=0.5),
               ("encode", 1): _raw_report(range(4), lambda r: 0.1 if r == 2 else 0.002, half, t_end=2.0),
               ("prefill", 0): {"bad": [], "cpu": None}, ("prefill", 1): {"bad": [], "cpu": None}}
    row = bench.row_of(cell, reports)
    assert row["encode_ranks"] == 2 and row["encode_bytes"] == [half, half] and row["prefill_bytes"] is None
    assert row["gbps"] == pytest.approx(4 * cell.item_bytes / 2.0 / 1e9)  # from the first start to the last end
    assert row["p50_ms"] == pytest.approx(2.0) and row["p99_ms"] == pytest.approx(100.0)
    assert row["verified"] and row["p50_added_ms"] is None


def test_an_epd_row_reports_what_each_rank_moved():
    cell = bench.Cell("epd", 64, 256, "torch.bfloat16", fanout=1, inflight=2, items=4, encode_ranks=2)
    encode = {"t_start": 0.0, "failed": [], "bytes": 4 * 32 * 512}
    prefill = {"t_start": 0.0, "t_end": 1.0, "latencies": [0.01] * 4, "latency_rooms": [0, 1, 2, 3],
               "failed": [], "bytes": 4 * 32 * 512, "bad": []}
    row = bench.row_of(cell, {("encode", 1): encode, ("encode", 0): dict(encode, bytes=1),
                              ("prefill", 0): prefill, ("prefill", 1): dict(prefill, bytes=2)})
    assert row["encode_bytes"] == [1, 4 * 32 * 512]  # in rank order
    assert row["prefill_bytes"] == [4 * 32 * 512, 2]


def _run(path, gbps, p50, verified=True, encode_ranks=1):
    return {"path": path, "item_bytes": 1024, "encode_ranks": encode_ranks, "fanout": 1, "inflight": 8,
            "integrity": False, "gbps": gbps, "rooms_per_s": 1.0, "p50_ms": p50, "p99_ms": 2 * p50,
            "ratio_to_raw": None, "p50_added_ms": None, "verified": verified, "failed": 0 if verified else 1,
            "problems": []}


def test_added_latency_is_against_raw_of_the_same_turn():
    # The reported epd run (median GB/s) is turn 2's; raw's own median run is turn 0's.
    raw = [_run("raw", 2.0, 1.0), _run("raw", 1.0, 3.0), _run("raw", 3.0, 2.5)]
    epd = [_run("epd", 1.0, 4.0), _run("epd", 3.0, 5.0), _run("epd", 2.0, 4.5)]
    assert bench.median_row(epd, raw)["p50_added_ms"] == pytest.approx(4.5 - 2.5)
    assert bench.median_row([dict(r, path="wire") for r in epd], raw)["p50_added_ms"] == pytest.approx(2.0)
    assert bench.median_row([dict(r, path="floor") for r in epd], raw)["p50_added_ms"] == pytest.approx(2.0)
    assert bench.median_row(raw, raw)["p50_added_ms"] is None
    assert bench.median_row(epd)["p50_added_ms"] is None  # no raw in the cell


def test_added_latency_is_left_out_against_a_raw_run_that_lost_rooms():
    raw = [_run("raw", 2.0, 1.0, verified=False)]
    assert bench.median_row([_run("epd", 1.0, 4.0)], raw)["p50_added_ms"] is None


def test_ratios_keep_cells_of_different_encode_ranks_apart():
    rows = [_run("raw", 2.0, 1.0), _run("raw", 4.0, 1.0, encode_ranks=2),
            _run("epd", 1.0, 1.0), _run("epd", 1.0, 1.0, encode_ranks=2)]
    bench.fill_ratios(rows)
    assert [r["ratio_to_raw"] for r in rows] == [1.0, 1.0, 0.5, 0.25]


def test_the_table_shows_encode_ranks_only_when_some_cell_has_several():
    one = [_run("raw", 2.0, 1.0), _run("epd", 1.0, 1.0)]
    assert "encode" not in bench.format_table(one).splitlines()[0]
    both = one + [_run("epd", 1.0, 1.0, encode_ranks=2)]
    lines = bench.format_table(both).splitlines()
    assert lines[0].split()[:4] == ["path", "item", "encode", "fanout"]
    assert [line.split()[3] for line in lines[1:]] == ["1", "1", "2"]


def _shaped(path, gbps, span, hidden, verified=True):
    """A 512 KiB row of span x hidden bf16 items."""
    return dict(_run(path, gbps, 1.0, verified), item_bytes=512 * 1024, span=span, hidden=hidden,
                dtype="torch.bfloat16")


def test_two_items_of_one_size_keep_their_own_raw_rows_and_table_lines():
    # --sizes 64x4096,128x2048: both 512 KiB. A's raw lost rooms, so A's epd has no ratio, not one to B's raw.
    rows = [_shaped("raw", 1.0, 64, 4096, verified=False), _shaped("raw", 2.0, 128, 2048),
            _shaped("epd", 0.9, 64, 4096), _shaped("epd", 1.0, 128, 2048),
            _shaped("memcpy", 4.0, 64, 4096), _shaped("memcpy", 8.0, 128, 2048)]
    bench.fill_ratios(rows)
    assert [r["ratio_to_raw"] for r in rows] == [None, 1.0, None, 0.5, None, 4.0]
    lines = bench.format_table(rows).splitlines()[1:]
    assert [line.split("512 KiB ")[1].split()[0] for line in lines] == ["64x4096", "128x2048"] * 3
    alone = bench.format_table(rows[1::2]).splitlines()[1:]
    assert all(line.split("512 KiB ")[1].split()[0] == "1" for line in alone)  # the fanout: one item, no shape

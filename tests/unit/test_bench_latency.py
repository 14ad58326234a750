"""`epd-transfer bench`'s figures: per-room latencies, and ratios only against a raw run that moved every byte."""

from __future__ import annotations

import pytest

from transfer import bench


def test_epd_latency_is_per_room_its_slowest_rank():
    # One latency per room (its last shard), as raw reports: pooled per rank's shard, one slow
    # shard in 50 rooms at fanout 2 would be 1 sample in 100 and vanish below p99.
    cell = bench.Cell("epd", 64, 256, "torch.bfloat16", fanout=2, inflight=8, items=50)
    rooms = list(range(50))
    fast = [0.010] * 50
    slow = [1.0 if room == 7 else 0.010 for room in rooms]
    prefill = {"t_start": 0.0, "t_end": 1.0, "failed": [], "bytes": 50 * cell.item_bytes // 2, "bad": []}
    reports = {("encode", 0): {"t_start": 0.0, "failed": []},
               ("prefill", 0): dict(prefill, latencies=fast, latency_rooms=rooms),
               ("prefill", 1): dict(prefill, latencies=slow, latency_rooms=rooms)}
    row = bench.row_of(cell, reports)
    assert row["p99_ms"] == pytest.approx(1000.0)
    assert row["p50_ms"] == pytest.approx(10.0)
    assert row["verified"] and row["rooms_per_s"] == pytest.approx(50.0)


def test_room_latencies_match_rooms_not_positions():
    # Ranks settle the same rooms, but a rank's failed room is missing from its list.
    a = {"latencies": [0.1, 0.2, 0.3], "latency_rooms": [0, 1, 2]}
    b = {"latencies": [0.5, 0.05], "latency_rooms": [0, 2]}
    assert sorted(bench._room_latencies([a, b])) == [0.2, 0.3, 0.5]


def _row(path, gbps, verified=True, **extra):
    return dict({"path": path, "item_bytes": 1024, "fanout": 1, "inflight": 8, "integrity": False, "gbps": gbps,
                 "rooms_per_s": 1.0, "p50_ms": 1.0, "p99_ms": 2.0, "ratio_to_raw": None, "verified": verified,
                 "failed": 0 if verified else 3, "problems": [] if verified else ["room 3: deadline"]}, **extra)


def test_no_ratio_against_a_raw_run_that_lost_rooms():
    # A raw run that lost rooms counts fewer bytes, so its GB/s is low and the epd ratio high:
    # the epd row must not carry that ratio as a clean figure.
    rows = [_row("raw", 1.0, verified=False), _row("epd", 1.5), _row("memcpy", 10.0)]
    bench.fill_ratios(rows)
    assert rows[1]["ratio_to_raw"] is None
    assert rows[2]["ratio_to_raw"] is None


def test_no_ratio_from_runs_paired_with_a_broken_raw():
    raw = [_row("raw", g) for g in (2.0, 1.0, 2.0)]
    raw[1] = _row("raw", 1.0, verified=False)
    epd = [_row("epd", g) for g in (1.6, 1.6, 1.6)]
    rows = [bench.median_row(raw, raw), bench.median_row(epd, raw)]
    bench.fill_ratios(rows)
    assert not rows[0]["verified"]
    assert rows[1]["ratio_to_raw"] is None


def test_memcpy_ratio_uses_only_verified_raw_rows():
    rows = [_row("raw", 3.0, verified=False, fanout=4), _row("raw", 2.0), _row("memcpy", 10.0)]
    bench.fill_ratios(rows)
    assert rows[2]["ratio_to_raw"] == pytest.approx(5.0)

"""`epd-transfer bench --encode-ranks 2`: one tiny cell per path over real Mooncake tcp, each
encode rank moving its block's share of every item, every landed byte checked by the ranks."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from live_helpers import LIVE

from transfer import bench, cli
from transfer.frames import dtype_size, prefill_shard

pytestmark = LIVE

SPAN, HIDDEN, ITEMS = 63, 256, 6  # 63 rows: the two encode ranks' shares differ (32 and 31 rows)
ROW_BYTES = HIDDEN * dtype_size("torch.bfloat16")


@pytest.fixture(scope="module")
def e2_run(tmp_path_factory):
    """One bench run: E = 2, fanout 1 (P = 2), 2 rooms in flight, raw, floor, epd and wire."""
    out = tmp_path_factory.mktemp("bench-e2")
    argv = ["bench", "--encode-ranks", "2", "--fanouts", "1", "--sizes", f"{SPAN}x{HIDDEN}", "--inflight", "2",
            "--items", str(ITEMS), "--paths", "raw,floor,epd,wire", "--integrity", "off", "--deadline", "30",
            "--timeout", "120", "--json", str(out / "rows.json")]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
        rc = bench.main(cli.build_parser().parse_args(argv))
    with open(out / "rows.json") as fh:
        rows = json.load(fh)
    return rc, stdout.getvalue(), {row["path"]: row for row in rows}


def test_every_path_runs_the_cell_and_lands_every_byte(e2_run):
    rc, output, rows = e2_run
    assert rc == 0, output
    paths = {"raw", "floor", "epd"} | ({"wire"} if bench.wire_available() is None else set())
    assert set(rows) == paths, output
    for row in rows.values():
        assert row["encode_ranks"] == 2 and row["fanout"] == 1, row
        assert row["verified"] and row["failed"] == 0 and row["items"] == ITEMS, row
        assert row["gbps"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0, row


def test_each_encode_rank_moves_its_blocks_share_and_together_the_item(e2_run):
    _, _, rows = e2_run
    item = SPAN * ROW_BYTES
    shares = [prefill_shard(SPAN, r, 2, 2)[1] * ROW_BYTES for r in range(2)]
    assert shares == [32 * ROW_BYTES, 31 * ROW_BYTES]
    for path, row in rows.items():
        assert row["encode_bytes"] == [ITEMS * share for share in shares], path
        assert sum(row["encode_bytes"]) / ITEMS == item, path
        if path != "raw":  # what landed, as each prefill rank counted it
            assert row["prefill_bytes"] == [ITEMS * share for share in shares], path


def test_rows_carry_the_latency_added_over_raw(e2_run):
    _, _, rows = e2_run
    assert rows["raw"]["p50_added_ms"] is None
    for path in set(rows) - {"raw"}:
        assert rows[path]["p50_added_ms"] == pytest.approx(rows[path]["p50_ms"] - rows["raw"]["p50_ms"]), path


def test_the_table_has_an_encode_ranks_column(e2_run):
    _, output, _ = e2_run
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("path"))
    assert lines[header].split()[:4] == ["path", "item", "encode", "fanout"]
    body = lines[header + 1 : header + 1 + len(e2_run[2])]
    assert all(line.split()[3] == "2" for line in body), body  # after the item's "31.5 KiB"

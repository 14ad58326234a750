"""`epd-transfer bench --paths cfloor`: the floor's loops in C (native/floor.c), between real rank
processes over Mooncake tcp and ZMQ, checked row by row against the bytes that landed."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest
from live_helpers import LIVE, MOONCAKE_MISSING

from transfer import bench, cli
from transfer.config import resolve

pytestmark = LIVE


def _direct_calls_missing() -> str:
    """Why this host's engines cannot call Mooncake from C ("" when they can)."""
    if MOONCAKE_MISSING:
        return MOONCAKE_MISSING
    from transfer.engine import _installed_mooncake, direct_calls_verdict

    ok, why = direct_calls_verdict(_installed_mooncake(), bool(resolve("EPD_MOONCAKE_DIRECT")), True)
    return "" if ok else f"Mooncake's calls from C are off here: {why}"


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["bench", *argv])


def _run(tmp_path, *argv: str) -> tuple[int, str, list[dict]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = bench.main(_args(*argv, "--json", str(tmp_path / "rows.json"), "--deadline", "30", "--timeout", "120"))
    rows = json.loads((tmp_path / "rows.json").read_text()) if rc == 0 else []
    return rc, out.getvalue() + err.getvalue(), rows


def test_the_cfloor_path_moves_and_checks_every_room_as_the_floor_does(tmp_path):
    missing = _direct_calls_missing()
    if missing:
        pytest.skip(missing)
    rc, said, rows = _run(tmp_path, "--paths", "raw,floor,cfloor", "--sizes", "64x256,96x256", "--fanouts", "1,2",
                          "--inflight", "1,4", "--items", "24", "--cpu")
    assert rc == 0, said
    cfloor = [row for row in rows if row["path"] == "cfloor"]
    assert len(cfloor) == 2 * 2 * 2, rows
    for row in cfloor:
        assert row["verified"] is True and row["failed"] == 0, row
        # Every rank's shard of every timed room, counted where it landed and where it left; the warm-up's out.
        shards = [n * 256 * 2 * 24 for n in (bench.prefill_shard(row["span"], r, row["fanout"], 1)[1]
                                             for r in range(row["fanout"]))]
        assert row["prefill_bytes"] == shards and row["encode_bytes"] == [sum(shards)], row
        assert row["p99_ms"] >= row["p50_ms"] > 0 and row["p50_added_ms"] is not None, row
        assert row["cpu_control_ms"] > 0 and row["cpu_threads"]["encode"]["caller"]["ms"] > 0, row
        assert row["stages_ms"] is None, row
    assert {(r["span"], r["fanout"], r["inflight"]) for r in cfloor} == {
        (span, fanout, inflight) for span in (64, 96) for fanout in (1, 2) for inflight in (1, 4)}


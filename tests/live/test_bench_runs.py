"""`epd-transfer bench`: one tiny live run (raw, epd with and without integrity, wire when present,
memcpy) checked row by row."""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import platform
import sys
import threading
import time

import pytest

from transfer import bench, cli, config
from transfer import engine as engine_module


try:
    import mooncake.engine  # noqa: F401

    _MOONCAKE_MISSING = ""
except ImportError as _error:  # pragma: no cover - depends on the host
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"

#: Whether the ranks' engines make Mooncake's calls from C, as the bench counts the CPU inside them.
_DIRECT_CALLS = not _MOONCAKE_MISSING and engine_module.direct_calls_verdict(
    engine_module._installed_mooncake(), bool(config.resolve("EPD_MOONCAKE_DIRECT")),
    callable(getattr(mooncake.engine.TransferEngine, "get_engine_ptr", None)))[0]

try:
    import matplotlib  # noqa: F401

    _MATPLOTLIB = True
except ImportError:  # pragma: no cover - optional extra
    _MATPLOTLIB = False


def _args(*argv: str) -> argparse.Namespace:
    """The bench's parsed arguments, through the real command line."""
    return cli.build_parser().parse_args(["bench", *argv])


def test_thread_cpu_splits_our_threads_from_the_transports():
    """A thread named epd-* is the control plane; an unnamed one, or one named epd-wire-*, is the
    transport, and so is a thread that ended inside the window (its time stays in the process's)."""
    if bench.thread_cpu() is None:
        pytest.skip("no /proc/self/stat on this host")
    from transfer import _io

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    release = threading.Event()

    def named(name: str, seconds: float, done: threading.Event) -> None:
        _io.name_this_thread(name)
        burn(seconds)
        done.set()
        release.wait(30)  # alive until the reading: a control-plane thread lives as long as its pool

    before = bench.thread_cpu()
    ours, wire_side = threading.Event(), threading.Event()
    threads = [threading.Thread(target=named, args=("epd-test-pool", 0.3, ours)),
               threading.Thread(target=named, args=("epd-wire-test", 0.2, wire_side))]
    for thread in threads:
        thread.start()
    assert ours.wait(30) and wire_side.wait(30)
    ended = threading.Thread(target=burn, args=(0.2,))
    ended.start()
    ended.join(30)
    spent = bench._cpu_since(before)
    release.set()
    for thread in threads:
        thread.join(30)
    assert 0.28 <= spent["control"] < 0.55, spent  # the pool thread's 0.3 s, plus this test's own bits
    assert spent["transport"] >= 0.38, spent  # the epd-wire thread's 0.2 s and the ended thread's 0.2 s
    assert 0.28 <= spent["groups"]["other"][0] < 0.4, spent  # epd-test-pool started inside the window
    assert spent["groups"]["caller"][1] >= 1, spent  # this thread slept in wait() and join()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny bench run: 64 x 256 bf16 items, fanout 1 and 2, 1 and 4 in flight."""
    if _MOONCAKE_MISSING:
        pytest.skip(_MOONCAKE_MISSING)
    out = tmp_path_factory.mktemp("bench")
    argv = ["--sizes", "64x256", "--fanouts", "1,2", "--inflight", "1,4", "--items", "12", "--repeat", "2",
            "--deadline", "30", "--timeout", "120", "--stages", "--json", str(out / "rows.json"),
            "--targets", "--paths", ",".join(bench.DEFAULT_PATHS)]
    if _MATPLOTLIB:
        argv += ["--plot", str(out / "plot.png")]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = bench.main(_args(*argv))
    return rc, stdout.getvalue() + stderr.getvalue(), out


@pytest.mark.live
def test_tiny_bench_writes_sane_rows(tiny_run):
    rc, stdout, out = tiny_run
    assert rc == 0, stdout
    with open(out / "rows.json") as fh:
        rows = json.load(fh)
    wire = bench.wire_available() is None
    transfer_rows = 2 * 2 * (1 + 1 + 2 + (2 if wire else 0))
    assert len(rows) == transfer_rows + 1  # + one memcpy row
    for row in rows:
        assert set(bench.ROW_KEYS) <= set(row), row
        assert row["item_bytes"] == 64 * 256 * 2
        assert row["gbps"] > 0 and row["rooms_per_s"] > 0, row
        assert row["ratio_to_raw"] is not None and row["ratio_to_raw"] > 0, row
        assert row["p99_ms"] >= row["p50_ms"] > 0, row
        assert row["verified"] is True and row["failed"] == 0, row
        if row["path"] != "memcpy":
            assert len(row["gbps_runs"]) == 2 and row["gbps"] in row["gbps_runs"], row
            assert row["cpu_control_ms"] >= 0 and row["cpu_transport_ms"] >= 0, row
        if row["path"] in ("raw", "wire", "memcpy"):
            assert row.get("cpu_mooncake_ms") is None, row
        elif _DIRECT_CALLS:  # the floor's and epd's encode ranks submit and poll through Mooncake's calls from C
            assert 0 < row["cpu_mooncake_ms"] <= row["cpu_control_ms"], row
        if row["path"] == "floor":
            assert row["prefill_bytes"] == [12 * row["item_bytes"] // row["fanout"]] * row["fanout"], row
            assert row["encode_bytes"] == [12 * row["item_bytes"]], row  # the warm-up shards left out
            assert row["cpu_control_ms"] > 0 and row["p50_added_ms"] is not None, row
            assert row["cpu_threads"]["encode"]["caller"]["ms"] > 0, row
        if row["path"] in ("raw", "floor", "memcpy"):
            assert row["stages_ms"] is None, row
        else:
            # Each of this rank's stages follows from the one before it. The item, and another
            # rank's first ask, may come before its ask; its status, before the room's last write.
            stages = [row["stages_ms"][name] for name in ("asked", "writing", "status", "concluded")]
            assert 0 <= stages[0] and stages == sorted(stages), row
            assert row["stages_ms"]["seen"] <= row["stages_ms"]["writing"] <= row["stages_ms"]["written"], row
            assert row["stages_ms"]["concluded"] <= row["p99_ms"], row
        if row["path"] == "epd":
            for role in ("encode", "prefill"):
                groups = row["cpu_threads"][role]
                assert {"caller", "driver", "zmq"} <= set(groups), row
                assert groups["caller"]["ms"] > 0 and groups["caller"]["switches"] >= 0, row
    cells = {(r["path"], r["fanout"], r["inflight"], r["integrity"]) for r in rows if r["path"] != "memcpy"}
    for fanout in (1, 2):
        for inflight in (1, 4):
            assert ("raw", fanout, inflight, False) in cells and ("floor", fanout, inflight, False) in cells
            assert ("epd", fanout, inflight, True) in cells and ("epd", fanout, inflight, False) in cells
            if wire:
                assert ("wire", fanout, inflight, True) in cells
    raw = [r for r in rows if r["path"] == "raw"]
    assert all(r["ratio_to_raw"] == 1.0 for r in raw)


@pytest.mark.live
def test_tiny_bench_prints_the_table(tiny_run):
    rc, stdout, _ = tiny_run
    lines = stdout.splitlines()
    said = next(line for line in lines if line.startswith("epd-transfer bench: protocol"))
    # The figures depend on the cores and on the interpreter's build, which runs most of the control plane.
    assert said.endswith(f", {platform.python_implementation()} {platform.python_version()} ({sys.executable}), "
                         f"{len(os.sched_getaffinity(0))} CPUs"), said
    header = next(i for i, line in enumerate(lines) if line.startswith("path"))
    assert "GB/s" in lines[header] and "ratio" in lines[header]
    paths = [line.split()[0] for line in lines[header + 1:] if line and not line.startswith(("note", "!"))]
    assert {"raw", "epd", "memcpy"} <= set(paths)
    stages = next(i for i, line in enumerate(lines) if line.startswith("stages:"))
    assert lines[stages + 1].split()[-len(bench.STAGES):] == list(bench.STAGES)
    staged = itertools.takewhile(lambda line: line.startswith(("epd ", "wire ")), lines[stages + 2:])
    assert {line.split()[0] for line in staged} >= {"epd"}
    if bench.wire_available() is not None:
        assert any(line.startswith("note: wire: skipped") for line in lines)


@pytest.mark.live
def test_tiny_bench_checks_the_targets_and_finds_none_of_their_cells(tiny_run):
    rc, stdout, _ = tiny_run
    lines = stdout.splitlines()
    start = lines.index("targets: the epd path against the control plane's budget per room")
    assert lines[start + 1].split() == ["figure", "cell", "target", "measured", "met"]
    checked = lines[start + 2 : start + 2 + len(bench.TARGETS)]
    assert all(line.split()[-2:] == ["not", "measured"] for line in checked), checked
    assert lines[start + 2 + len(bench.TARGETS)] == (f"0 of {len(bench.TARGETS)} targets met "
                                                     f"({len(bench.TARGETS)} not measured)")


@pytest.mark.live
@pytest.mark.skipif(not _MATPLOTLIB, reason="matplotlib is not installed (pip install 'epd-transfer[plot]')")
def test_tiny_bench_draws_a_png(tiny_run):
    _, _, out = tiny_run
    with open(out / "plot.png", "rb") as fh:
        head = fh.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out / "plot.png") > 5000

"""`epd-transfer bench`: the plan, the figures' arithmetic, the table and progress bar."""

from __future__ import annotations

import argparse
import io
import types

import pytest

from transfer import _native, bench, cli


def _args(*argv: str) -> argparse.Namespace:
    """The bench's parsed arguments, through the real command line."""
    return cli.build_parser().parse_args(["bench", *argv])


def test_parse_sizes_reads_rows_by_hidden():
    assert bench.parse_sizes("64x4096, 1024X4096") == [(64, 4096), (1024, 4096)]
    for bad in ("64", "64x", "x4096", "0x4096", "64x-1", "", "64x4096,,8x8", "64x4096,"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_sizes(bad)


def test_parse_lists_refuse_nonsense():
    assert bench.parse_ints("1,2,4") == [1, 2, 4]
    assert bench.parse_paths("raw,memcpy") == ["raw", "memcpy"]
    assert bench.parse_paths("floor,epd") == ["floor", "epd"]
    assert bench.parse_integrity("off,on") == [False, True]
    for parse, bad in ((bench.parse_ints, "1,0"), (bench.parse_ints, "a"), (bench.parse_paths, "raw,fast"),
                       (bench.parse_integrity, "maybe")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    # An empty entry is a typo: refused, not skipped.
    for parse, text in ((bench.parse_ints, "1,,2"), (bench.parse_ints, "1,"), (bench.parse_paths, "raw,,epd"),
                        (bench.parse_integrity, "on,"), (bench.parse_ints, " , ")):
        with pytest.raises(argparse.ArgumentTypeError, match="empty entry|no integers given"):
            parse(text)


def test_defaults_are_the_issues_matrix():
    opts = bench.options_from(_args())
    assert opts.sizes == [(64, 4096), (1024, 4096), (8192, 4096)]
    assert opts.fanouts == [1, 2, 4] and opts.inflight == [1, 8, 32]
    assert opts.integrity == [True, False] and opts.protocol == "tcp"
    cells = bench.plan(opts, wire_ok=True)
    # 3 sizes x 3 fanouts x 3 windows x (raw + floor + epd on/off + wire on/off)
    assert len(cells) == 27 * 6
    assert {c.item_bytes for c in cells} == {512 * 1024, 8 * 2**20, 64 * 2**20}
    assert len(bench.plan(opts, wire_ok=False)) == 27 * 4


def test_the_floor_runs_once_a_cell_without_integrity():
    opts = bench.options_from(_args("--paths", "raw,floor", "--sizes", "64x4096", "--fanouts", "1,4",
                                    "--inflight", "8", "--integrity", "on,off"))
    cells = bench.plan(opts, wire_ok=True)
    floors = [c for c in cells if c.path == "floor"]
    assert [(c.fanout, c.integrity) for c in floors] == [(1, False), (4, False)]
    # Each floor cell follows the raw cell of its geometry, so both share a turn of the host.
    assert [c.path for c in cells] == ["raw", "floor", "raw", "floor"]


def test_quick_is_a_small_subset():
    opts = bench.options_from(_args("--quick"))
    assert opts.sizes == [(64, 4096), (1024, 4096)] and opts.fanouts == [1, 4] and opts.inflight == [8]
    cells = bench.plan(opts, wire_ok=True)
    assert len(cells) == 2 * 2 * 6
    assert sum(c.items * c.item_bytes for c in cells) <= 24 * 64 * 2**20


def test_items_per_cell_scale_with_size_and_fill_the_window():
    opts = bench.Options()
    assert opts.items_for(512 * 1024, 8) == 512  # 256 MiB of 512 KiB items
    assert opts.items_for(64 * 2**20, 8) == 16  # the minimum
    assert opts.items_for(64 * 2**20, 32) == 32  # at least one full window
    opts.items = 5
    assert opts.items_for(64 * 2**20, 32) == 5


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert bench.percentile(values, 50) == 50.0
    assert bench.percentile(values, 99) == 99.0
    assert bench.percentile([3.0], 99) == 3.0
    assert bench.percentile([], 50) == 0.0


def _row(path, gbps, fanout=1, inflight=8, size=1024, integrity=False):
    return {"path": path, "item_bytes": size, "fanout": fanout, "inflight": inflight, "integrity": integrity,
            "gbps": gbps, "rooms_per_s": 1.0, "p50_ms": 1.0, "p99_ms": 2.0, "ratio_to_raw": None}


def test_ratios_are_against_raw_in_the_same_cell():
    rows = [_row("raw", 2.0), _row("epd", 1.5, integrity=True), _row("raw", 4.0, fanout=4), _row("epd", 1.0, fanout=4),
            _row("memcpy", 8.0), _row("epd", 1.0, size=2048)]
    bench.fill_ratios(rows)
    assert [r["ratio_to_raw"] for r in rows] == [1.0, 0.75, 1.0, 0.25, 2.0, None]


def test_repeats_take_turns_within_a_geometry():
    opts = bench.options_from(_args("--sizes", "64x256,128x256", "--fanouts", "1", "--inflight", "1,8",
                                    "--paths", "raw,epd", "--integrity", "on"))
    groups = bench._groups(bench.plan(opts, wire_ok=False))
    assert [[c.path for c in g] for g in groups] == [["raw", "epd"]] * 4
    assert len({(g[0].span, g[0].inflight) for g in groups}) == 4
    assert all(len({(c.span, c.inflight, c.fanout) for c in g}) == 1 for g in groups)


def test_median_row_keeps_the_median_run_and_any_failure():
    runs = [dict(_row("epd", g), p99_ms=g * 10, verified=True, failed=0, problems=[]) for g in (3.0, 1.0, 2.0)]
    row = bench.median_row(runs)
    assert row["gbps"] == 2.0 and row["p99_ms"] == 20.0 and row["gbps_runs"] == [3.0, 1.0, 2.0]
    assert row["verified"]
    runs[0].update(verified=False, failed=1, problems=["room 7: deadline"])
    row = bench.median_row(runs)
    assert row["gbps"] == 2.0 and not row["verified"] and row["failed"] == 1 and row["problems"] == ["room 7: deadline"]
    assert bench.median_row(runs[:2])["gbps"] == 1.0  # an even count reports the lower middle run


def test_repeated_ratios_pair_each_run_with_raw_of_its_turn():
    # A slow spell halves both paths in turn 2: the paired ratio stays 0.8.
    raw = [_row("raw", g) for g in (2.0, 1.0, 2.0)]
    epd = [dict(_row("epd", g), verified=True, failed=0, problems=[]) for g in (1.6, 0.8, 1.0)]
    raw_row = bench.median_row([dict(r, verified=True, failed=0, problems=[]) for r in raw], raw)
    epd_row = bench.median_row(epd, raw)
    assert epd_row["ratio_runs"] == pytest.approx([0.8, 0.8, 0.5])
    rows = [raw_row, epd_row]
    bench.fill_ratios(rows)
    assert raw_row["ratio_to_raw"] == 1.0
    assert epd_row["ratio_to_raw"] == pytest.approx(0.8)  # not 1.0 / 2.0, the median runs' own ratio
    assert "paired_ratio" not in epd_row


def test_row_of_flags_lost_rooms_and_bad_bytes():
    cell = bench.Cell("epd", 4, 8, "torch.bfloat16", fanout=2, inflight=2, items=4, integrity=True)
    encode = {"t_start": 10.0, "failed": []}
    prefill = {"t_start": 10.0, "t_end": 12.0, "latencies": [0.1, 0.2, 0.3, 0.4], "failed": [], "bytes": 32, "bad": []}
    good = bench.row_of(cell, {("encode", 0): encode, ("prefill", 0): prefill, ("prefill", 1): dict(prefill)})
    assert good["verified"] and good["failed"] == 0
    assert good["gbps"] == pytest.approx(64 / 2.0 / 1e9) and good["rooms_per_s"] == pytest.approx(2.0)
    assert good["p50_ms"] == pytest.approx(200.0) and good["p99_ms"] == pytest.approx(400.0)
    bad = dict(prefill, bad=["prefill 1 room 3: landed rows differ from the item"], failed=[(2, "deadline")])
    row = bench.row_of(cell, {("encode", 0): encode, ("prefill", 0): prefill, ("prefill", 1): bad})
    assert not row["verified"] and row["failed"] == 1 and "deadline" in row["problems"]


def test_row_of_gives_each_rooms_cpu_summed_over_the_ranks():
    """Four rooms; the encode rank and two prefill ranks spent 8 ms / 40 ms and 4 ms / 20 ms each:
    per room (8 + 4 + 4) / 4 = 4 ms of control plane and (40 + 20 + 20) / 4 = 20 ms of transport.
    A rank without a reading (no /proc) leaves both out."""
    cell = bench.Cell("epd", 4, 8, "torch.bfloat16", fanout=2, inflight=2, items=4, integrity=False)
    encode = {"t_start": 10.0, "failed": [], "cpu": {"control": 0.008, "transport": 0.040}}
    prefill = {"t_start": 10.0, "t_end": 12.0, "latencies": [0.1] * 4, "failed": [], "bytes": 32, "bad": [],
               "cpu": {"control": 0.004, "transport": 0.020}}
    row = bench.row_of(cell, {("encode", 0): encode, ("prefill", 0): prefill, ("prefill", 1): dict(prefill)})
    assert row["cpu_control_ms"] == pytest.approx(4.0) and row["cpu_transport_ms"] == pytest.approx(20.0)
    blind = bench.row_of(cell, {("encode", 0): encode, ("prefill", 0): prefill, ("prefill", 1): dict(prefill, cpu=None)})
    assert blind["cpu_control_ms"] is None and blind["cpu_transport_ms"] is None


def test_row_of_counts_a_raw_cells_issuing_threads_as_transport():
    """Raw has no control plane: the encode rank's 8 ms in its issuing thread and 40 ms in
    Mooncake's, and the prefill ranks' 4 ms and 20 ms each, are (8 + 40 + 2 * 24) / 4 = 24 ms
    of transport per room and none of control."""
    cell = bench.Cell("raw", 4, 8, "torch.bfloat16", fanout=2, inflight=2, items=4, integrity=False)
    encode = {"t_start": 10.0, "t_end": 12.0, "latencies": [0.1] * 4, "latency_rooms": [0, 1, 2, 3], "failed": [],
              "bytes": 64, "cpu": {"control": 0.008, "transport": 0.040}}
    prefill = {"bad": [], "cpu": {"control": 0.004, "transport": 0.020}}
    row = bench.row_of(cell, {("encode", 0): encode, ("prefill", 0): prefill, ("prefill", 1): dict(prefill)})
    assert row["cpu_control_ms"] == 0.0 and row["cpu_transport_ms"] == pytest.approx(24.0)
    blind = bench.row_of(cell, {("encode", 0): dict(encode, cpu=None), ("prefill", 0): prefill,
                                ("prefill", 1): dict(prefill)})
    assert blind["cpu_control_ms"] is None and blind["cpu_transport_ms"] is None


def test_table_lists_every_row():
    rows = [_row("raw", 2.0), _row("epd", 1.5, integrity=True)]
    bench.fill_ratios(rows)
    table = bench.format_table(rows).splitlines()
    assert table[0].split()[:2] == ["path", "item"] and "GB/s" in table[0] and "p99" in table[0]
    assert table[1].split()[0] == "raw" and table[1].split()[-1] == "1.00"
    assert table[2].split()[0] == "epd" and " on " in table[2] and table[2].split()[-1] == "0.75"
    rows[1].update(cpu_control_ms=1.25, cpu_mooncake_ms=0.25, cpu_transport_ms=6.5)
    wide = bench.format_table(rows, cpu=True).splitlines()
    assert wide[0].split()[-6:] == ["control", "ms", "mooncake", "ms", "transport", "ms"]
    assert wide[1].split()[-3:] == ["-", "-", "-"] and wide[2].split()[-4:] == ["0.75", "1.250", "0.250", "6.500"]


def test_row_of_tells_the_control_cpu_inside_mooncakes_calls_where_every_rank_counted_it():
    """The encode rank spent 6 ms of its 20 ms of control CPU inside Mooncake's calls, the prefill ranks none
    of theirs: (6 + 0 + 0) / 4 rooms = 1.5 ms a room, out of (20 + 2 * 4) / 4 = 7 ms a room of control."""
    cell = bench.Cell("epd", 4, 8, "torch.bfloat16", fanout=2, inflight=2, items=4, integrity=False)
    encode = {"t_start": 10.0, "t_end": 12.0, "failed": [], "bytes": 64,
              "cpu": {"control": 0.020, "transport": 0.010, "mooncake": 0.006}}
    prefill = {"t_start": 10.0, "t_end": 12.0, "failed": [], "bad": [], "bytes": 32, "latencies": [0.1] * 4,
               "latency_rooms": [0, 1, 2, 3], "cpu": {"control": 0.004, "transport": 0.020, "mooncake": 0.0}}
    row = bench.row_of(cell, {("encode", 0): encode, ("prefill", 0): prefill, ("prefill", 1): dict(prefill)})
    assert row["cpu_control_ms"] == pytest.approx(7.0) and row["cpu_mooncake_ms"] == pytest.approx(1.5)
    # A rank whose engine makes Mooncake's calls through the binding counts none: no share is told.
    uncounted = dict(prefill, cpu={"control": 0.004, "transport": 0.020})
    row = bench.row_of(cell, {("encode", 0): encode, ("prefill", 0): prefill, ("prefill", 1): uncounted})
    assert row["cpu_control_ms"] == pytest.approx(7.0) and row["cpu_mooncake_ms"] is None


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_only_on_a_terminal():
    plain = io.StringIO()
    bar = bench.Progress(2, plain)
    bar.step("raw 512 KiB")
    bar.close()
    assert plain.getvalue() == ""
    tty = _Tty()
    bar = bench.Progress(2, tty)
    bar.step("raw 512 KiB")
    bar.step("epd 512 KiB")
    bar.close()
    assert "1/2" in tty.getvalue() and "2/2" in tty.getvalue() and tty.getvalue().endswith("\n")


def test_memcpy_row_moves_bytes():
    row = bench.memcpy_row(64, 256, "torch.bfloat16", items=8)
    assert row["path"] == "memcpy" and row["item_bytes"] == 64 * 256 * 2
    assert row["gbps"] > 0 and row["p99_ms"] >= row["p50_ms"] >= 0


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(bench.importlib, "import_module", lambda name: no_matplotlib(name))
    rc = bench.main(_args("--paths", "memcpy", "--plot", str(tmp_path / "p.png")))
    assert rc == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("name, main, group", [
    ("python", True, "caller"), ("epd-enc0", False, "driver"), ("epd-pre3-io", False, "driver"),
    ("ZMQbg/IO/0", False, "zmq"), ("ZMQbg/Reaper", False, "zmq"), ("epd-pre0-boot-1", False, "other"),
    ("epd-status", False, "other"), ("epd-probe-10.0.", False, "other"), ("epd-wire-w0", False, None),
    ("python", False, None),
])
def test_thread_group_names_the_control_planes_threads(name, main, group):
    assert bench.thread_group(name, main) == group


def test_row_of_splits_each_rooms_control_cpu_per_role_and_thread_group():
    """Two rooms; the encode rank's driver spent 6 ms over 10 wake-ups, each prefill rank's caller
    2 ms over 4: per room 3 ms and 5 switches on the encode side, 2 ms and 4 summed over the prefill ranks."""
    cell = bench.Cell("epd", 4, 8, "torch.bfloat16", fanout=2, inflight=1, items=2, integrity=False)
    encode = {"t_start": 10.0, "failed": [],
              "cpu": {"control": 0.006, "transport": 0.01, "groups": {"driver": [0.006, 10]}}}
    prefill = {"t_start": 10.0, "t_end": 12.0, "latencies": [0.1] * 2, "failed": [], "bytes": 32, "bad": [],
               "cpu": {"control": 0.002, "transport": 0.0, "groups": {"caller": [0.002, 4]}}}
    row = bench.row_of(cell, {("encode", 0): encode, ("prefill", 0): prefill, ("prefill", 1): dict(prefill)})
    assert row["cpu_threads"]["encode"] == {"driver": {"ms": pytest.approx(3.0), "switches": pytest.approx(5.0)}}
    assert row["cpu_threads"]["prefill"] == {"caller": {"ms": pytest.approx(2.0), "switches": pytest.approx(4.0)}}
    older = dict(prefill, cpu={"control": 0.002, "transport": 0.0})  # a reading without groups
    row = bench.row_of(cell, {("encode", 0): encode, ("prefill", 0): prefill, ("prefill", 1): older})
    assert row["cpu_threads"]["prefill"] is None and row["cpu_threads"]["encode"] is not None
    raw = bench.row_of(bench.Cell("raw", 4, 8, "torch.bfloat16", fanout=2, inflight=1, items=2, integrity=False),
                       {("encode", 0): dict(encode, t_end=12.0, latencies=[0.1] * 2, bytes=64),
                        ("prefill", 0): {"bad": [], "cpu": None}})
    assert raw["cpu_threads"] is None  # raw has no control plane


def _staged(started: float, **stages: float) -> tuple[float, dict[str, float]]:
    return started, stages


def test_stage_p50s_joins_each_prefill_rank_with_its_encode_rank():
    """Two encode ranks, fanout 1: prefill rank 1's rooms are encode rank 1's. Times in seconds
    on one clock; each stage in ms from the prefill rank's receive()."""
    cell = bench.Cell("epd", 4, 8, "torch.bfloat16", fanout=1, inflight=1, items=2, encode_ranks=2)
    encodes = [{"stages": {0: _staged(9.999, asked=0.003, writing=0.003, submitted=0.004, concluded=0.011)}},
               {"stages": {0: _staged(20.0, asked=0.002, writing=0.004, submitted=0.006, concluded=0.020)},
                1: _staged(30.0, concluded=0.5)}]  # a room its prefill rank never had: left out
    prefill = [{"stages": {0: _staged(10.0, asked=0.001, status=0.012, concluded=0.013)}},
               {"stages": {0: _staged(20.001, asked=0.0005, status=0.0215, concluded=0.0225)}}]
    stages = bench.stage_p50s(cell, encodes, prefill)
    assert list(stages) == list(bench.STAGES)
    # Nearest-rank p50 of two samples is the lower one.
    expected = {"asked": 0.5, "offered": -1.0, "seen": 1.0, "writing": 2.0, "submitted": 3.0, "written": 10.0,
                "status": 12.0, "concluded": 13.0}
    assert stages == pytest.approx(expected)
    assert bench.stage_p50s(cell, [{}, {}], prefill) is None  # raw and floor reports carry no stages


def test_stage_p50s_leaves_out_rooms_that_missed_a_stage():
    cell = bench.Cell("epd", 4, 8, "torch.bfloat16", fanout=2, inflight=1, items=1)
    encodes = [{"stages": {0: _staged(0.0, asked=0.001, writing=0.002, submitted=0.0025, concluded=0.003)}}]
    prefill = [{"stages": {0: _staged(0.0, asked=0.0, concluded=0.05)}},  # its status never came
               {"stages": {0: _staged(0.0, asked=0.0, status=0.004, concluded=0.005)}}]
    assert bench.stage_p50s(cell, encodes, prefill)["concluded"] == pytest.approx(5.0)
    assert bench.stage_p50s(cell, encodes, prefill[:1]) is None


def test_format_stages_lists_only_rows_with_stages():
    staged = dict(_row("epd", 1.0), item_bytes=512 * 1024, fanout=4, inflight=8, integrity=False,
                  stages_ms=dict(zip(bench.STAGES, (0.03, -0.3, 0.3, 0.75, 0.8, 1.95, 2.4, 2.41))))
    lines = bench.format_stages([dict(_row("raw", 2.0), stages_ms=None), staged]).splitlines()
    assert lines[0].split() == ["path", "item", "fanout", "inflight", "integrity", *bench.STAGES]
    assert lines[1].split() == ["epd", "512", "KiB", "4", "8", "off", "0.030", "-0.300", "0.300", "0.750", "0.800",
                                "1.950", "2.400", "2.410"]
    assert len(lines) == 2


def test_a_rank_log_in_a_removed_temporary_folder_is_quoted_not_named(tmp_path):
    # The message is read after close() removed the folder: its path would name nothing.
    (tmp_path / "bench-prefill-1.log").write_text("first\nlast words\n")
    ranks = object.__new__(bench.RankSet)
    ranks.log_dir = str(tmp_path)
    ranks._tmp = object()  # type: ignore[assignment]  # the folder is a temporary one
    tail = ranks._log_tail(("prefill", 1))
    assert str(tmp_path) not in tail and tail.endswith("first\nlast words\n")
    assert "--log-dir" in tail
    ranks._tmp = None  # --log-dir: the log stays, and its path is worth giving
    assert ranks._log_tail(("prefill", 1)).startswith(str(tmp_path / "bench-prefill-1.log") + "\n")


def test_the_cfloor_path_runs_only_when_asked_for():
    assert "cfloor" in bench.PATHS and "cfloor" not in bench.DEFAULT_PATHS
    assert "cfloor" not in bench.options_from(_args()).paths
    opts = bench.options_from(_args("--paths", "floor,cfloor", "--sizes", "64x4096", "--fanouts", "1",
                                    "--inflight", "8", "--integrity", "on,off"))
    assert [(c.path, c.integrity) for c in bench.plan(opts, wire_ok=True)] == [("floor", False), ("cfloor", False)]


def test_counting_calls_on_a_python_whose_cprofile_is_one_per_process_raises_before_any_profiler(monkeypatch):
    # A rank process told to count (bench.main called without the command line's refusal) says why,
    # where otherwise its threads would end at their first call and the bench would wait for them.
    import sys
    import threading

    monkeypatch.setattr(sys, "version_info", (3, 13, 0, "final", 0))
    counts = bench.CallCounts()
    with pytest.raises(RuntimeError, match=r"^--calls needs Python 3\.10 or 3\.11 \(this is 3\.13\)"):
        counts.install()
    assert threading.getprofile() is None and counts.snapshot() == {}


def test_a_rank_counts_mooncakes_calls_once_an_engine_makes_them_from_c(monkeypatch):
    asked: list[bool] = []
    monkeypatch.setattr(bench, "_MOONCAKE_COUNTED", False)
    monkeypatch.setattr(_native, "mooncake_account", asked.append)
    bench._count_mooncake_calls(types.SimpleNamespace(calls="binding"))
    bench._count_mooncake_calls(object())  # the wire path's engine has no `calls`
    assert asked == [] and not bench._MOONCAKE_COUNTED
    bench._count_mooncake_calls(types.SimpleNamespace(calls="direct"))
    bench._count_mooncake_calls(types.SimpleNamespace(calls="direct"))
    assert asked == [True] and bench._MOONCAKE_COUNTED

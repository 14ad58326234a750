"""`epd-transfer bench --targets`: the cells it measures and how the epd rows are held to the budget."""

from __future__ import annotations

import argparse

from transfer import bench, cli

KIB512, MIB8 = 512 * 1024, 8 * 2**20


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["bench", *argv])


def _epd(size, fanout, inflight, integrity=False, span=None, hidden=4096, **figures):
    """An epd row of `size` bytes: span x hidden bf16, span taken from size when not given."""
    row = {"path": "epd", "item_bytes": size, "span": span or size // (hidden * 2), "hidden": hidden,
           "dtype": "torch.bfloat16", "encode_ranks": 1, "fanout": fanout, "inflight": inflight,
           "integrity": integrity, "verified": True, "cpu_control_ms": None, "p50_added_ms": None,
           "ratio_to_raw": None}
    row.update(figures)
    return row


def _by_cell(results):
    return {(r["target"].key, r["target"].item_bytes, r["target"].fanout, r["target"].inflight,
             r["target"].integrity): (r["measured"], r["met"]) for r in results}


def test_targets_measures_every_cell_a_target_names_and_no_other():
    opts = bench.options_from(_args("--targets"))
    cells = bench.plan(opts, wire_ok=True)
    measured = {(c.item_bytes, c.fanout, c.inflight, c.integrity) for c in cells if c.path == "epd"}
    named = {(t.item_bytes, t.fanout, t.inflight, t.integrity) for t in bench.TARGETS}
    assert named <= measured
    assert {c.path for c in cells} == {"raw", "epd"}
    assert {c.item_bytes for c in cells} == {KIB512, MIB8} and {c.inflight for c in cells} == {1, 8}


def test_options_given_beside_targets_are_kept():
    opts = bench.options_from(_args("--targets", "--fanouts", "2", "--paths", "raw,floor,epd"))
    assert opts.fanouts == [2] and opts.paths == ["raw", "floor", "epd"] and opts.inflight == [1, 8]


def test_bounds_hold_at_the_bound_and_fail_past_it_in_their_direction():
    rows = [_epd(MIB8, 1, 8, cpu_control_ms=0.3, ratio_to_raw=0.9),
            _epd(MIB8, 4, 8, cpu_control_ms=0.61, ratio_to_raw=0.89),
            _epd(KIB512, 1, 1, p50_added_ms=-0.2)]
    found = _by_cell(bench.check_targets(rows))
    assert found[("cpu_control_ms", MIB8, 1, 8, False)] == (0.3, True)
    assert found[("ratio_to_raw", MIB8, 1, 8, False)] == (0.9, True)
    assert found[("cpu_control_ms", MIB8, 4, 8, False)] == (0.61, False)
    assert found[("ratio_to_raw", MIB8, 4, 8, False)] == (0.89, False)
    assert found[("p50_added_ms", KIB512, 1, 1, False)] == (-0.2, True)


def test_a_cell_not_measured_or_that_lost_rooms_is_neither_met_nor_failed():
    rows = [_epd(MIB8, 1, 8, cpu_control_ms=0.1, verified=False),
            _epd(MIB8, 1, 8, integrity=True, ratio_to_raw=None),
            {**_epd(MIB8, 4, 8, cpu_control_ms=0.1), "path": "wire"},
            {**_epd(KIB512, 4, 8, cpu_control_ms=0.1), "encode_ranks": 2}]
    results = bench.check_targets(rows)
    assert all(r["measured"] is None and r["met"] is None for r in results)
    assert bench.format_targets(results).splitlines()[-1] == f"0 of {len(bench.TARGETS)} targets met " \
                                                             f"({len(bench.TARGETS)} not measured)"


def test_the_targets_table_names_each_cell_bound_and_verdict():
    rows = [_epd(KIB512, 4, 8, cpu_control_ms=0.25, ratio_to_raw=0.31)]
    lines = bench.format_targets(bench.check_targets(rows)).splitlines()
    assert lines[0].split() == ["figure", "cell", "target", "measured", "met"]
    cpu = next(line for line in lines if line.startswith("control CPU") and "512 KiB (64x4096), fanout 4" in line)
    assert "at most 0.3" in cpu and cpu.split()[-2:] == ["0.250", "yes"]
    ratio = next(line for line in lines if line.startswith("ratio") and "512 KiB (64x4096), fanout 4" in line)
    assert "at least 0.5" in ratio and ratio.split()[-2:] == ["0.310", "no"]
    assert lines[-1] == f"1 of {len(bench.TARGETS)} targets met ({len(bench.TARGETS) - 2} not measured)"


def test_the_targets_tell_the_part_of_a_control_cpu_figure_inside_mooncakes_calls():
    rows = [_epd(KIB512, 4, 8, cpu_control_ms=0.45, cpu_mooncake_ms=0.09, ratio_to_raw=0.41),
            _epd(MIB8, 1, 8, cpu_control_ms=0.38)]
    results = bench.check_targets(rows)
    lines = bench.format_targets(results).splitlines()
    assert lines[-2] == f"0 of {len(bench.TARGETS)} targets met ({len(bench.TARGETS) - 3} not measured)"
    assert lines[-1] == ("of the control CPU, 512 KiB (64x4096), fanout 4, 8 in flight, integrity off: 0.090 ms "
                         "inside Mooncake's write and status calls, 0.360 ms the rest")
    # The verdict is the whole figure's: 0.45 misses 0.3 whatever part of it Mooncake's calls took.
    assert _by_cell(results)[("cpu_control_ms", KIB512, 4, 8, False)] == (0.45, False)


def test_a_measured_figure_never_reads_on_the_wrong_side_of_its_bound():
    # The figure shown falls on its verdict's side: 0.3049 over a bound of 0.3 never reads "0.30", nor 0.3004 "0.300".
    rows = [_epd(MIB8, 1, 8, cpu_control_ms=0.3049, ratio_to_raw=0.8951),
            _epd(MIB8, 4, 8, cpu_control_ms=0.6004, ratio_to_raw=0.89996),
            _epd(KIB512, 1, 1, p50_added_ms=0.2951), _epd(KIB512, 4, 1, p50_added_ms=0.5)]
    lines = bench.format_targets(bench.check_targets(rows)).splitlines()[1:-1]
    shown = [line.split()[-2:] for line in lines if not line.endswith("not measured")]
    assert len(shown) == 6
    for line, (measured, met) in zip((line for line in lines if not line.endswith("not measured")), shown):
        bound = float(line.split("at least" if "at least" in line else "at most")[1].split()[0])
        holds = float(measured) >= bound if "at least" in line else float(measured) <= bound
        assert holds == (met == "yes"), line
    assert ["0.305", "no"] in shown and ["0.6004", "no"] in shown and ["0.89996", "no"] in shown
    assert ["0.500", "yes"] in shown


def test_targets_tell_two_items_of_one_size_apart():
    # 64x4096 and 128x2048 bf16 are both 512 KiB: the target names 64x4096, whichever row comes last.
    ours = _epd(KIB512, 4, 8, cpu_control_ms=0.1)
    other = _epd(KIB512, 4, 8, span=128, hidden=2048, cpu_control_ms=0.9)
    for rows in ([ours, other], [other, ours]):
        found = _by_cell(bench.check_targets(rows))
        assert found[("cpu_control_ms", KIB512, 4, 8, False)] == (0.1, True)

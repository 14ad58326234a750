"""How scripts/bench_ab.py orders its runs and sums up two checkouts' bench rows: medians, ranges, verdicts."""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from bench_ab import MIN_RUNS, format_summary, order, side_pythons, summarise  # noqa: E402


def _row(path="epd", fanout=1, inflight=1, control=1.0, added=0.5, ratio=0.9, verified=True, driver=0.3, caller=0.1,
         prefill=0.2, zmq=(0.02, 0.03), integrity=False):
    threads = None if path == "raw" else {
        "encode": {"caller": {"ms": caller, "switches": 1.0}, "driver": {"ms": driver, "switches": 2.0},
                   "zmq": {"ms": zmq[0], "switches": 1.0}},
        "prefill": {"caller": {"ms": prefill, "switches": 1.0}, "zmq": {"ms": zmq[1], "switches": 1.0}}}
    return {"path": path, "item_bytes": 524288, "span": 64, "hidden": 4096, "dtype": "torch.bfloat16",
            "encode_ranks": 1, "fanout": fanout, "inflight": inflight, "integrity": integrity, "verified": verified,
            "cpu_control_ms": 0.0 if path == "raw" else control, "p50_added_ms": None if path == "raw" else added,
            "ratio_to_raw": None if path == "raw" else ratio, "cpu_threads": threads}


def _runs(controls):
    """One run per figure: the raw row and an epd row of that control CPU."""
    return [[_row("raw"), _row(control=c)] for c in controls]


def _figure(rows, name, **cell):
    matches = [r for r in rows if r["figure"] == name and all(r["cell"][k] == v for k, v in cell.items())]
    assert len(matches) == 1, matches
    return matches[0]


def test_abba_order_alternates_which_side_goes_first():
    assert order(3, ["a", "b"]) == ["a", "b", "b", "a", "a", "b"]
    assert order(2, ["a", "b", "aa"]) == ["a", "b", "aa", "aa", "b", "a"]


def test_side_a_and_its_copy_share_one_interpreter_and_b_has_its_own():
    assert side_pythons(["a", "b", "aa"], "/v311/python", "/v313/python") == {
        "a": "/v311/python", "b": "/v313/python", "aa": "/v311/python"}


def test_each_side_gets_the_median_and_range_of_its_runs():
    rows = summarise({"a": _runs([1.0, 3.0, 2.0]), "b": _runs([4.0, 6.0, 5.0, 7.0])})
    control = _figure(rows, "control ms")
    assert control["a"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert control["b"] == {"median": 5.5, "min": 4.0, "max": 7.0, "n": 4}
    assert control["change_pct"] == pytest.approx(175.0)
    assert control["verdict"] == "moved"
    assert control["cell"] == {"span": 64, "hidden": 4096, "dtype": "torch.bfloat16", "encode_ranks": 1,
                               "fanout": 1,
                               "inflight": 1, "integrity": False, "path": "epd"}


def test_raw_rows_have_no_summary_and_cells_stay_apart():
    runs = [[_row("raw"), _row(fanout=1, control=1.0), _row(fanout=4, control=2.0)] for _ in range(MIN_RUNS)]
    rows = summarise({"a": runs, "b": runs})
    assert {(r["cell"]["path"], r["cell"]["fanout"]) for r in rows} == {("epd", 1), ("epd", 4)}
    assert _figure(rows, "control ms", fanout=4)["a"]["median"] == 2.0
    assert _figure(rows, "control ms", fanout=4)["change_pct"] == 0.0


def test_overlapping_ranges_are_within_noise():
    rows = summarise({"a": _runs([1.0, 1.2, 1.4]), "b": _runs([1.3, 1.5, 1.6])})
    assert _figure(rows, "control ms")["verdict"] == "within noise"


def test_ranges_that_only_touch_overlap():
    rows = summarise({"a": _runs([1.0, 1.1, 1.3]), "b": _runs([1.3, 1.5, 1.6])})
    assert _figure(rows, "control ms")["verdict"] == "within noise"


def test_apart_ranges_are_within_noise_where_the_a_a_copy_is_apart_too():
    a, b = _runs([1.0, 1.1, 1.2]), _runs([2.0, 2.1, 2.2])
    assert _figure(summarise({"a": a, "b": b, "aa": _runs([1.15, 1.2, 1.25])}), "control ms")["verdict"] == "moved"
    noisy = summarise({"a": a, "b": b, "aa": _runs([1.5, 1.6, 1.7])})
    assert _figure(noisy, "control ms")["aa"]["median"] == 1.6
    assert _figure(noisy, "control ms")["verdict"] == "within noise"


def test_fewer_runs_than_the_minimum_give_no_verdict():
    short = [1.0 + i for i in range(MIN_RUNS - 1)]
    rows = summarise({"a": _runs(short), "b": _runs([10.0 + c for c in short])})
    assert _figure(rows, "control ms")["verdict"] == "too few runs"


def test_runs_that_lost_rooms_are_left_out_and_counted():
    a = _runs([1.0, 1.1, 1.2]) + [[_row("raw"), _row(control=9.0, verified=False)]]
    rows = summarise({"a": a, "b": _runs([2.0, 2.1, 2.2])})
    control = _figure(rows, "control ms")
    assert control["a"]["max"] == 1.2 and control["a"]["n"] == 3
    assert control["lost"] == {"a": 1, "b": 0}


def test_thread_groups_are_read_from_cpu_threads():
    rows = summarise({"a": [[_row(driver=0.4, caller=0.1, prefill=0.25, zmq=(0.01, 0.02))]],
                      "b": [[_row(driver=0.2, caller=0.1, prefill=0.25, zmq=(0.01, 0.02))]]})
    assert _figure(rows, "encode driver ms")["a"]["median"] == 0.4
    assert _figure(rows, "encode driver ms")["change_pct"] == pytest.approx(-50.0)
    assert _figure(rows, "encode caller ms")["b"]["median"] == 0.1
    assert _figure(rows, "prefill callers ms")["a"]["median"] == 0.25
    assert _figure(rows, "ZMQ ms")["a"]["median"] == pytest.approx(0.03)
    assert _figure(rows, "p50 added ms")["a"]["median"] == 0.5
    assert _figure(rows, "ratio to raw")["b"]["median"] == 0.9


def test_a_figure_missing_on_one_side_has_no_change_or_verdict():
    b = [[_row(control=1.0) | {"p50_added_ms": None}] for _ in range(MIN_RUNS)]
    rows = summarise({"a": _runs([1.0] * MIN_RUNS), "b": b})
    added = _figure(rows, "p50 added ms")
    assert added["b"] is None and added["change_pct"] is None and added["verdict"] == "-"


def test_the_text_names_each_cell_and_its_verdicts():
    rows = summarise({"a": _runs([1.0, 1.1, 1.2]), "b": _runs([2.0, 2.1, 2.2]), "aa": _runs([1.0, 1.1, 1.2])})
    text = format_summary(rows)
    assert "64x4096 bfloat16, fanout 1, in flight 1, integrity off, epd" in text
    control = next(line for line in text.splitlines() if line.strip().startswith("control ms"))
    assert control.split()[2:] == ["1.100", "[1.000,", "1.200]", "2.100", "[2.000,", "2.200]", "1.100", "[1.000,",
                                   "1.200]", "+90.9", "%", "moved"]


def test_the_control_cpu_inside_mooncakes_calls_is_compared_where_a_side_counted_it():
    a = [[_row("raw"), {**_row(control=c), "cpu_mooncake_ms": m}] for c, m in ((1.0, 0.03), (1.2, 0.04), (1.1, 0.05))]
    b = _runs([1.0, 1.1, 1.2])  # a checkout whose bench does not count it: no figure
    mooncake = _figure(summarise({"a": a, "b": b}), "of it Mooncake's calls ms")
    assert mooncake["a"] == {"median": 0.04, "min": 0.03, "max": 0.05, "n": 3}
    assert mooncake["b"] is None and mooncake["change_pct"] is None

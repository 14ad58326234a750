#!/usr/bin/env python3
"""Compares two checkouts' `epd-transfer bench` figures in alternating runs, with this host's noise beside them.

Each side (`--a`, `--b`: git revisions of this repository; by default HEAD against the working tree as it
is, uncommitted changes included) is prepared under a temporary folder: a detached git worktree for a
revision, a copy of the tracked and untracked-not-ignored files for the working tree. Its native extension
is built in place with the side's interpreter (`--a-python`, `--b-python`: a Python that has torch, pyzmq
and Mooncake installed, such as another venv's; by default this one), and each run is `python -m
transfer.cli bench <bench options> --json FILE` with PYTHONPATH and the working folder set to that side's
tree (each side's `transfer` is checked and printed once). Two interpreters on one revision compare the
interpreters. `--runs N` pairs run in ABBA order (A B, B A, A B, ...), so neither side always
goes first and a drift of the host between runs falls on both. `--aa` adds a second copy
of A to every pair (A B A', then A' B A), so the A/A column shows the noise of identical code in the same
window.

Per cell (item, encode ranks, fanout, in flight, integrity, path) and figure (control CPU ms a room, p50
added ms, ratio to raw, and the control plane's thread groups from `cpu_threads`), the table shows each
side's median [min, max], the change of the medians and a verdict: "moved" only where A's and B's ranges do
not overlap (and, with `--aa`, A's and A''s do), else "within noise"; with fewer than MIN_RUNS runs a side,
"too few runs". The trees are removed at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKING_TREE = "working tree"
BENCH = ["--sizes", "64x4096", "--fanouts", "1,4", "--inflight", "1,8", "--paths", "raw,epd", "--integrity", "off",
         "--cpu", "--items", "1000"]
#: Runs a side needs before two ranges' overlap says anything: two sides of identical code keep apart by chance
#: in 2 of 20 sets of three runs each (every ordering of the six equally likely), 2 of 924 with six each.
MIN_RUNS = 3


def _group(role: str, *groups: str) -> Callable[[dict], float | None]:
    """A row's control-plane ms a room in `role`'s thread groups, summed; None where the row has none."""
    def read(row: dict) -> float | None:
        threads = (row.get("cpu_threads") or {}).get(role)
        if not threads:
            return None
        return sum(threads.get(group, {}).get("ms", 0.0) for group in groups)
    return read


def _zmq(row: dict) -> float | None:
    """ZMQ's I/O threads' ms a room, both roles."""
    parts = [_group(role, "zmq")(row) for role in ("encode", "prefill")]
    return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)


#: The figures compared, each read from one bench row: (name, reader).
FIGURES: list[tuple[str, Callable[[dict], float | None]]] = [
    ("control ms", lambda row: row.get("cpu_control_ms")),
    ("of it Mooncake's calls ms", lambda row: row.get("cpu_mooncake_ms")),  # None from a bench that does not count it
    ("p50 added ms", lambda row: row.get("p50_added_ms")),
    ("ratio to raw", lambda row: row.get("ratio_to_raw")),
    ("encode driver ms", _group("encode", "driver")),
    ("encode caller ms", _group("encode", "caller")),
    ("prefill callers ms", _group("prefill", "caller")),
    ("ZMQ ms", _zmq),
]


def cell_of(row: dict) -> tuple:
    """The cell a bench row measures: (item rows, hidden, dtype, encode ranks, fanout, in flight, integrity, path)."""
    return (row.get("span"), row.get("hidden"), row.get("dtype"), row.get("encode_ranks", 1), row["fanout"],
            row["inflight"], row["integrity"], row["path"])


def spread(values: list[float]) -> dict[str, Any] | None:
    """median, min, max and n of `values`; None when there are none."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def overlap(one: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two spreads' [min, max] ranges share a value."""
    return bool(one["min"] <= other["max"] and other["min"] <= one["max"])


def verdict(a: dict | None, b: dict | None, aa: dict | None, with_aa: bool) -> str:
    """'moved' where A's and B's ranges keep apart (and, with the A/A copy, A's and A''s overlap), else
    'within noise'; '-' where a side has no figure, 'too few runs' under MIN_RUNS a side."""
    if a is None or b is None or (with_aa and aa is None):
        return "-"
    if min(a["n"], b["n"], aa["n"] if aa is not None else MIN_RUNS) < MIN_RUNS:
        return "too few runs"
    if overlap(a, b) or (aa is not None and not overlap(a, aa)):
        return "within noise"
    return "moved"


def summarise(runs: dict[str, list[list[dict]]]) -> list[dict]:
    """Summary rows from each side's runs ('a', 'b' and optionally 'aa': one list of bench --json rows a run).

    One summary row per cell of a path with a control plane (raw and memcpy have none) and figure: each
    side's spread of that figure over its runs (rows that lost rooms or bytes left out, and counted in
    `lost`), the change of B's median from A's in % (None where A's is 0 or missing) and the verdict.
    Cells in the order the bench first listed them.
    """
    with_aa = "aa" in runs
    cells: dict[tuple, dict[str, list[dict]]] = {}
    for side, side_runs in runs.items():
        for rows in side_runs:
            for row in rows:
                if row.get("path") in ("raw", "memcpy"):
                    continue
                cells.setdefault(cell_of(row), {}).setdefault(side, []).append(row)
    out = []
    for cell, sides in cells.items():
        kept = {side: [r for r in sides.get(side, []) if r.get("verified", True)] for side in runs}
        lost = {side: len(sides.get(side, [])) - len(kept[side]) for side in runs}
        for name, read in FIGURES:
            figures = {side: spread([v for v in map(read, kept[side]) if v is not None]) for side in runs}
            a, b, aa = figures["a"], figures["b"], figures.get("aa")
            change = (100.0 * (b["median"] - a["median"]) / a["median"]
                      if a is not None and b is not None and a["median"] else None)
            out.append({"cell": dict(zip(("span", "hidden", "dtype", "encode_ranks", "fanout", "inflight",
                                          "integrity", "path"), cell)),
                        "figure": name, "a": a, "b": b, "aa": aa, "change_pct": change,
                        "verdict": verdict(a, b, aa, with_aa), "lost": lost})
    return out


def order(runs: int, sides: list[str]) -> list[str]:
    """The sides' runs, `runs` rounds in ABBA order: `sides` in turn, then reversed, and so on."""
    out: list[str] = []
    for turn in range(runs):
        out += sides if turn % 2 == 0 else sides[::-1]
    return out


def side_pythons(sides: list[str], a_python: str, b_python: str) -> dict[str, str]:
    """Each side's interpreter: B's its own, A's and its copy's A's."""
    return {side: b_python if side == "b" else a_python for side in sides}


def _cell_label(cell: dict) -> str:
    encode = f", encode ranks {cell['encode_ranks']}" if cell.get("encode_ranks", 1) != 1 else ""
    integrity = "on" if cell["integrity"] else "off"
    dtype = str(cell["dtype"]).removeprefix("torch.")
    return (f"{cell['span']}x{cell['hidden']} {dtype}{encode}, fanout {cell['fanout']}, in flight "
            f"{cell['inflight']}, integrity {integrity}, {cell['path']}")


def _spread_text(s: dict | None) -> str:
    return "-" if s is None else f"{s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"


def format_summary(rows: list[dict]) -> str:
    """The summary rows as text: a block per cell, a line per figure."""
    with_aa = any(r["aa"] is not None for r in rows)
    head = ["figure", "A", "B"] + (["A/A copy"] if with_aa else []) + ["change", "verdict"]
    lines: list[str] = []
    cells: dict[str, list[dict]] = {}
    for r in rows:
        cells.setdefault(_cell_label(r["cell"]), []).append(r)
    for label, cell_rows in cells.items():
        lost = {side: n for side, n in cell_rows[0]["lost"].items() if n}
        lines.append(label + (f" (runs that lost rooms or bytes, left out: {lost})" if lost else ""))
        table = [head] + [[r["figure"], _spread_text(r["a"]), _spread_text(r["b"])]
                          + ([_spread_text(r["aa"])] if with_aa else [])
                          + ["-" if r["change_pct"] is None else f"{r['change_pct']:+.1f} %", r["verdict"]]
                          for r in cell_rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(head))]
        lines += ["  " + "  ".join(text.ljust(w) for text, w in zip(line, widths)).rstrip() for line in table]
        lines.append("")
    return "\n".join(lines).rstrip()


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _copy_working_tree(dest: Path) -> None:
    """The working tree's tracked and untracked-not-ignored files, as they are, into `dest`."""
    listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if not source.is_file():  # deleted, or a submodule's folder
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / name)


def prepare(rev: str, dest: Path, python: str = sys.executable) -> None:
    """`dest`: a detached worktree of `rev`, or a copy of the working tree; its native extension built by `python`."""
    if rev == WORKING_TREE:
        dest.mkdir(parents=True)
        _copy_working_tree(dest)
    else:
        _git("worktree", "add", "--detach", "--quiet", str(dest), rev)
    subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest, check=True,
                   stdout=subprocess.DEVNULL)


def _child_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def imported_from(tree: Path, python: str = sys.executable) -> str:
    """Where a child with `tree`'s environment imports `transfer` from; refuses another tree's."""
    where = subprocess.run([python, "-c", "import transfer; print(transfer.__file__)"], cwd=tree,
                           env=_child_env(tree), check=True, capture_output=True, text=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"bench_ab: a child run in {tree} imports transfer from {where}")
    return where


def run_bench(tree: Path, bench: list[str], json_path: Path, python: str = sys.executable) -> list[dict]:
    """One bench run in `tree` by `python`; its rows."""
    done = subprocess.run([python, "-m", "transfer.cli", "bench", *bench, "--json", str(json_path)],
                          cwd=tree, env=_child_env(tree), capture_output=True, text=True)
    if not json_path.exists():
        raise SystemExit(f"bench_ab: the bench in {tree} exited {done.returncode} without its JSON\n"
                         f"{(done.stdout + done.stderr)[-4000:]}")
    if done.returncode != 0:
        print(f"bench_ab: the bench in {tree} exited {done.returncode} (a cell lost rooms or bytes)", file=sys.stderr)
    with open(json_path) as fh:
        rows: list[dict] = json.load(fh)
    return rows


def _resolve(rev: str) -> str:
    """`rev`'s commit, or WORKING_TREE."""
    if rev == WORKING_TREE:
        return rev
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"bench_ab: {rev} names no commit of {REPO}") from None


def _remove(trees: Iterable[tuple[str, Path]]) -> None:
    for rev, tree in trees:
        if rev == WORKING_TREE:
            shutil.rmtree(tree, ignore_errors=True)
        else:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", default="HEAD", help="side A: a git revision (default HEAD)")
    parser.add_argument("--b", default=WORKING_TREE,
                        help="side B: a git revision (default: the working tree as it is, uncommitted changes too)")
    parser.add_argument("--a-python", default=sys.executable, metavar="PYTHON",
                        help="side A's interpreter (default: this one)")
    parser.add_argument("--b-python", default=sys.executable, metavar="PYTHON",
                        help="side B's interpreter (default: this one)")
    parser.add_argument("--runs", type=int, default=6, help="pairs of runs, in ABBA order (default 6)")
    parser.add_argument("--aa", action="store_true", help="also run a second copy of A in every pair: the noise floor")
    parser.add_argument("--keep", action="store_true", help="keep the prepared trees (their folder is printed)")
    parser.add_argument("--json", metavar="FILE", help="also write the summary rows to FILE")
    parser.add_argument("bench", nargs="*", help=f"bench options, after -- (default: {' '.join(BENCH)})")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    bench = args.bench or BENCH
    if any(arg == "--json" or arg.startswith("--json=") for arg in bench):
        parser.error("the bench's --json is this script's to give")
    revs = {"a": _resolve(args.a), "b": _resolve(args.b)}
    if args.aa:
        revs["aa"] = revs["a"]
    pythons = side_pythons(list(revs), args.a_python, args.b_python)
    root = Path(tempfile.mkdtemp(prefix="bench_ab-"))
    trees = {side: root / side for side in revs}
    prepared: list[tuple[str, Path]] = []
    try:
        for side, rev in revs.items():
            prepare(rev, trees[side], pythons[side])
            prepared.append((rev, trees[side]))
            where = imported_from(trees[side], pythons[side])
            print(f"bench_ab: {side} = {rev} on {pythons[side]}: transfer from {where}", file=sys.stderr)
        runs: dict[str, list[list[dict]]] = {side: [] for side in revs}
        sequence = order(args.runs, list(revs))
        for i, side in enumerate(sequence):
            print(f"bench_ab: run {i + 1}/{len(sequence)}: {side}", file=sys.stderr, flush=True)
            runs[side].append(run_bench(trees[side], bench, root / f"run-{i}-{side}.json", pythons[side]))
    finally:
        if args.keep:
            print(f"bench_ab: the trees are kept under {root}", file=sys.stderr)
        else:
            _remove(prepared)
            shutil.rmtree(root, ignore_errors=True)
    rows = summarise(runs)
    print(f"A = {revs['a']} on {pythons['a']}, B = {revs['b']} on {pythons['b']}; {args.runs} pair(s) in ABBA order"
          f"{', with a second copy of A' if args.aa else ''}; bench {' '.join(bench)}")
    print("median [min, max] over the runs; 'moved': A's and B's ranges keep apart"
          + (" while A's and its copy's overlap" if args.aa else "") + "\n")
    print(format_summary(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"a": revs["a"], "b": revs["b"], "a_python": pythons["a"], "b_python": pythons["b"],
                       "runs": args.runs, "bench": bench, "order": sequence, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

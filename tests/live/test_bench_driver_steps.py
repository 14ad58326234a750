"""scripts/bench_driver_steps.py runs rooms end to end and prints the encode driver's calls a room by step."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from live_helpers import MOONCAKE_MISSING

pytestmark = [pytest.mark.live, pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING or "n/a")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ("items and clears filed", "ask: received", "ask: parsed", "ask: rules, to its room's dispatch",
         "writes picked", "write: submitted", "write: completion polls", "write: done, rules", "status: encoded",
         "status: sent", "room concluded: books, metrics", "other")


def _steps(fanout: int, *extra: str) -> tuple[list[str], float, dict[str, float]]:
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_driver_steps.py"), "--rooms", "20",
                             "--inflight", "4", "--rows", "4", "--hidden", "256", "--fanout", str(fanout), *extra],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"20 rooms of 2 KiB, fanout {fanout}, 4 in flight"), lines[0]
    total = float(lines[0].rsplit(" made ", 1)[1].split()[0])
    counts = {line[:34].strip(): float(line[34:]) for line in lines[2:2 + len(STEPS)]}
    return lines, total, counts


def test_the_steps_add_up_to_the_drivers_calls_and_the_asks_and_writes_scale_with_the_fanout():
    _, total_1, one = _steps(1)
    lines, total_2, two = _steps(2, "--detail", "write: submitted")
    for total, counts in ((total_1, one), (total_2, two)):
        assert tuple(counts) == STEPS, counts
        assert sum(counts.values()) == pytest.approx(total, abs=0.1 * len(STEPS)), (total, counts)
    # Each room's one write a receiver, and its status: twice the calls at fanout 2 (a plain status is
    # encoded without a call: its sending counts).
    for step in ("write: submitted", "status: sent"):
        assert one[step] > 0 and two[step] == pytest.approx(2 * one[step], rel=0.05), (step, one, two)
    # One ask a receiver, each built where it is read (natively, one call for the asks queued): none parsed after.
    assert two["ask: received"] > one["ask: received"] > 0 and one["ask: parsed"] == two["ask: parsed"] == 0, (one, two)
    detail = lines[lines.index("write: submitted: the functions it enters most, calls a room") + 1:]
    listed = [float(line.split()[0]) for line in detail if line.strip()]
    assert 1 <= len(listed) <= 25 and listed == sorted(listed, reverse=True) and listed[-1] > 0, detail
    assert sum(listed) <= two["write: submitted"] + 1e-6, (listed, two)


def test_cpu_prints_the_drivers_thread_cpu_a_room_and_profile_its_functions_by_own_time():
    base = [sys.executable, os.path.join(REPO, "scripts", "bench_driver_steps.py"), "--rooms", "20", "--inflight",
            "4", "--rows", "4", "--hidden", "256", "--fanout", "2"]
    for extra in (["--cpu"], ["--profile", "5", "--callers", "_carry"]):
        result = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        first = result.stdout.splitlines()[0]
        assert first.startswith("20 rooms of 2 KiB, fanout 2, 4 in flight"), first
        assert float(first.rsplit(" took ", 1)[1].split()[0]) > 0, first
    assert "Ordered by: internal time" in result.stdout and "was called by" in result.stdout, result.stdout
    refused = subprocess.run([*base, "--cpu", "--detail", "other"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--detail" in refused.stderr, refused.stderr

"""scripts/bench_caller_calls.py runs rooms end to end and prints the calls each caller call makes a room."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from live_helpers import MOONCAKE_MISSING

pytestmark = [pytest.mark.live, pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING or "n/a")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("dst, into", [("pool", "pool slots"), ("tensor", "a registered buffer's rows")])
def test_the_caller_calls_bench_counts_each_caller_call_and_lists_one_calls_functions(dst, into):
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_caller_calls.py"), "--rooms", "20",
                             "--inflight", "4", "--rows", "4", "--hidden", "256", "--detail", "prefill receive",
                             "--dst", dst],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("20 rooms of 2 KiB, 4 in flight"), lines[0]
    assert f"integrity off, into {into}, in " in lines[0], lines[0]
    counts = {" ".join(line.split()[:2]): float(line.split()[2]) for line in lines
              if line.startswith(("prefill ", "encode ")) and len(line.split()) == 3}
    assert set(counts) == {"prefill receive", "prefill wait", "prefill clear", "encode send", "encode wait",
                           "encode clear"}, lines
    assert all(count >= 1 for count in counts.values()), counts
    detail = lines[lines.index("prefill receive: the functions it enters most, calls a room") + 1:]
    listed = [float(line.split()[0]) for line in detail if line.strip()]
    assert 1 <= len(listed) <= 25 and listed == sorted(listed, reverse=True) and listed[-1] > 0, detail
    assert sum(listed) <= counts["prefill receive"] + 1e-6, (listed, counts)  # a share of the call's own count


def test_the_caller_calls_bench_prints_each_caller_calls_cpu_a_room_with_cpu():
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_caller_calls.py"), "--rooms", "20",
                             "--inflight", "4", "--rows", "4", "--hidden", "256", "--cpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("20 rooms of 2 KiB, 4 in flight") and "(profiled)" not in lines[0], lines[0]
    assert lines[1] == "call             CPU a room (us)", lines
    cpu = {" ".join(line.split()[:2]): float(line.split()[2]) for line in lines[2:] if len(line.split()) == 3}
    assert set(cpu) == {"prefill receive", "prefill wait", "prefill clear", "encode send", "encode wait",
                        "encode clear"}, lines
    # Each call does work on its thread (a receive() sends its ask; a send() files its item): none is free.
    assert cpu["prefill receive"] > 0 and cpu["encode send"] > 0, cpu

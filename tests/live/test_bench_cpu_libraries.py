"""scripts/bench_cpu_libraries.py samples a running bench cell with perf and splits each thread group's
CPU by library."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from live_helpers import MOONCAKE_MISSING

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from bench_cpu_libraries import perf_refusal  # noqa: E402

REFUSAL = perf_refusal()
pytestmark = [pytest.mark.live, pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING or "n/a")]


@pytest.mark.skipif(REFUSAL is not None, reason=REFUSAL or "n/a")
def test_the_script_samples_a_running_cell_and_splits_each_thread_groups_cpu_by_library():
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_cpu_libraries.py"), "--delay", "1",
                             "--seconds", "1", "--frequency", "499", "--", "--sizes", "4x256", "--fanouts", "1",
                             "--inflight", "4", "--paths", "epd", "--integrity", "off", "--items", "200000"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert re.match(r"\d+ samples over 1 s; the control plane's threads took \d+ \(", lines[0]), lines[0]
    groups = {line.split("  ")[0].strip(): line for line in lines[2:] if "%" in line and ":" not in line}
    # Both ranks' callers and drivers ran and were sampled: each rank's main thread works every room.
    assert {"encode driver", "prefill caller"} <= set(groups), lines
    shares = [float(line.split("%")[0].split()[-1]) for line in groups.values()]
    assert 99.0 <= sum(shares) <= 101.0, lines
    assert lines[-1].startswith("control plane: ") and "interpreter " in lines[-1], lines[-1]

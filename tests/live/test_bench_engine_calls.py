"""scripts/bench_engine_calls.py runs and prints a row per way and size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from live_helpers import MOONCAKE_MISSING

from transfer import engine as engine_module

pytestmark = [pytest.mark.live, pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING or "n/a")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_calls_bench_prints_each_way_for_each_size():
    ok, why = engine_module.direct_calls_verdict(engine_module._installed_mooncake(), True, True)
    if not ok:
        pytest.skip(f"the direct calls are off here: {why}")
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_engine_calls.py"),
                             "--sizes", "4096,65536", "--writes", "5", "--rounds", "2", "--gap-us", "50"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("binding", "direct", "Engine"))]
    ways = {" ".join(row[:2]) for row in rows}
    assert ways == {"binding, bare", "direct, bare", "Engine, binding", "Engine, direct"}
    assert sorted(int(row[2]) for row in rows) == [4096] * 4 + [65536] * 4
    for row in rows:
        assert float(row[3]) > 0, row  # a submission's median CPU

"""`epd-transfer demo` whose every room fails at its deadline ends once the prefill ranks are done, saying so."""

from __future__ import annotations

import json
import subprocess
import sys

from live_helpers import LIVE

pytestmark = LIVE

#: Under the demo's 60 s fanout timeout, which an encode rank waiting for asks that cannot
#: come any more would run into, and well over the ranks' start-up on a busy host.
BOUND_S = 50


def test_a_demo_whose_rooms_all_miss_a_tiny_deadline_reports_them_failed_and_exits_non_zero():
    items = 6
    result = subprocess.run(
        [sys.executable, "-m", "transfer.cli", "demo", "-P", "1", "--items", str(items), "--span", "16",
         "--hidden", "64", "--inflight", "2", "--deadline", "0.001", "--json"],
        capture_output=True, text=True, timeout=BOUND_S,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert summary["failed"] == items and summary["bytes"] == 0 and summary["verified"] is False
    prefill = [line for line in summary["failures"] if line.startswith("prefill 0 ")]
    encode = [line for line in summary["failures"] if line.startswith("encode 0 ")]
    # Each rank says why for every room: the prefill rank its deadline, the encode rank that nobody asked.
    assert len(prefill) == items and all("within 0.001s" in line for line in prefill), prefill
    assert len(encode) == items and all("every prefill rank had finished without it" in line
                                        or "cancelled" in line for line in encode), encode

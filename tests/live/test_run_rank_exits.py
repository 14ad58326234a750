"""transfer.harness.run against a rank that reports, then dies: the run fails naming it, not a verified summary."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from live_helpers import LIVE

from transfer import harness

pytestmark = LIVE

REPO = str(Path(__file__).resolve().parents[2])

# Runs in every interpreter the run spawns: the rank named "prefill-0" crashes at its exit, after its report.
_CRASH_AT_EXIT = """import atexit, os, signal
import multiprocessing

def _crash():
    if multiprocessing.current_process().name == "prefill-0":
        os.kill(os.getpid(), signal.SIGSEGV)

atexit.register(_crash)
"""


def test_a_rank_that_crashes_after_its_report_fails_the_run_naming_it(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(_CRASH_AT_EXIT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), REPO]))
    sc = harness.Scenario(protocol="wire", encode_ranks=1, prefill_ranks=1, items=2, span=8, hidden=64, inflight=2,
                          timeout_s=120)
    with pytest.raises(RuntimeError, match=r"^prefill rank 0 died \(killed by SIGSEGV\) after its report; ") as caught:
        harness.run(sc)
    assert "encode rank" not in str(caught.value).splitlines()[0]

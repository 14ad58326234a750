"""scripts/zmq-floor.sh: the C floor of a room's asks and statuses builds against pyzmq's libzmq,
runs every cell it is given between real processes and prints figures that add up."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "zmq-floor.sh")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EPD_PYTHON": sys.executable})


def test_every_cell_prints_a_row_whose_parts_add_up():
    result = _run("--fanouts", "1,2", "--inflight", "1,3", "--write-us", "0,2000", "--rooms", "200")
    assert result.returncode == 0, result.stderr
    header, *lines = result.stdout.splitlines()
    assert header.split()[:3] == ["fanout", "inflight", "write_us"]
    rows = [line.split() for line in lines]
    assert [(int(r[0]), int(r[1]), int(r[2])) for r in rows] == [
        (fanout, depth, write) for write in (0, 2000) for fanout in (1, 2) for depth in (1, 3)]
    for fanout, depth, write, rate, p50, control, encode, prefill in ([float(x) for x in r] for r in rows):
        assert rate > 0 and encode > 0 and prefill > 0
        assert abs(control - (encode + prefill)) <= 0.002
        # A room's status waits for its write: 2 ms of it shows in every room's latency.
        assert p50 >= write / 1000, (fanout, depth, write, p50)


def test_an_unknown_argument_is_refused():
    result = _run("--fanout", "4")
    assert result.returncode == 2
    assert "unknown argument --fanout" in result.stderr


def test_a_fanout_past_64_is_refused():
    result = _run("--fanouts", "65", "--inflight", "1", "--write-us", "0", "--rooms", "10")
    assert result.returncode != 0
    assert "need 1 <= FANOUT <= 64" in result.stderr

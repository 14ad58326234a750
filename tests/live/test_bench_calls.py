"""`epd-transfer bench --calls`: each thread group's Python calls a room, counted in the rank processes."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest

from transfer import bench, cli

try:
    import mooncake.engine  # noqa: F401

    _MOONCAKE_MISSING = ""
except ImportError as _error:  # pragma: no cover - depends on the host
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"


@pytest.mark.live
@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "-")
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="--calls needs Python 3.10 or 3.11 (a cProfile per thread)")
def test_calls_are_counted_per_role_and_thread_and_printed(tmp_path):
    argv = ["bench", "--calls", "--paths", "floor,epd", "--integrity", "off", "--sizes", "64x256", "--fanouts", "2",
            "--inflight", "4", "--items", "60", "--deadline", "30", "--timeout", "120",
            "--json", str(tmp_path / "rows.json")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = bench.main(cli.build_parser().parse_args(argv))
    assert rc == 0, out.getvalue()
    with open(tmp_path / "rows.json") as fh:
        rows = {r["path"]: r for r in json.load(fh)}
    epd, floor = rows["epd"]["cpu_threads"], rows["floor"]["cpu_threads"]
    # The library's rules and bookkeeping make many calls a room on each side; the floor's bare
    # loops (each prefill rank's on its main thread) fewer.
    assert epd["encode"]["driver"]["calls"] > 50, epd
    assert epd["encode"]["caller"]["calls"] > 10, epd
    assert epd["prefill"]["caller"]["calls"] > floor["prefill"]["caller"]["calls"] > 0, (epd, floor)
    assert epd["prefill"]["zmq"]["calls"] == 0, epd  # ZMQ's I/O threads run no Python

    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Python calls a room"))
    assert lines[start + 1].split()[:7] == ["path", "item", "fanout", "inflight", "integrity", "encode", "caller"]
    epd_counts = next(line.split() for line in lines[start + 2:] if line.startswith("epd "))[6:]  # item: "32 KiB"
    for role, group in (("encode", "caller"), ("encode", "driver"), ("prefill", "caller")):
        assert f"{epd[role][group]['calls']:.0f}" in epd_counts, (role, group, epd_counts, epd)

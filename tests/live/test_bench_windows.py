"""`epd-transfer bench` live: comparable timing windows, verified bytes per room, and a rank that dies
mid-cell ends the run."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
from bench_fakes import FakeWorker, check_each_peer_was_first_written_before_the_window, writes_before_the_window

from transfer import bench


try:
    import mooncake.engine  # noqa: F401

    _MOONCAKE_MISSING = ""
except ImportError as _error:  # pragma: no cover - depends on the host
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"


def test_raw_window_opens_after_the_first_write_to_each_peer_with_writer_threads(monkeypatch):
    # As the unit test does for --raw-issue async, here with --raw-issue sync (writer threads).
    cell = bench.Cell("raw", 64, 256, "torch.bfloat16", fanout=2, inflight=2, items=6)
    worker = FakeWorker(cell)
    opened = writes_before_the_window(worker, cell, "sync", monkeypatch)
    check_each_peer_was_first_written_before_the_window(worker, cell, opened)


def _live_opts(**kw) -> bench.Options:
    opts = bench.Options(sizes=[(64, 256)], fanouts=[2], inflight=[2], paths=["raw", "epd"], integrity=[False],
                         items=8, deadline_s=20.0, timeout_s=60.0)
    for key, value in kw.items():
        setattr(opts, key, value)
    return opts


@pytest.mark.live
def test_live_rows_report_one_latency_per_room_and_verified_bytes():
    if _MOONCAKE_MISSING:
        pytest.skip(_MOONCAKE_MISSING)
    opts = _live_opts()
    cells = bench.plan(opts, wire_ok=False)
    with bench.RankSet(opts, 2, bench.arena_sizes(opts, cells)) as ranks:
        for cell in cells:
            reports = ranks.run_cell(cell)
            prefill = [v for k, v in reports.items() if k[0] == "prefill"]
            if cell.path == "epd":
                for report in prefill:
                    assert sorted(report["latency_rooms"]) == list(range(cell.items))
                assert len(bench._room_latencies(prefill)) == cell.items
            row = bench.row_of(cell, reports)
            assert row["verified"] and row["failed"] == 0, row
            assert row["gbps"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0


@pytest.mark.live
def test_a_rank_killed_mid_cell_ends_the_run_with_its_log():
    if _MOONCAKE_MISSING:
        pytest.skip(_MOONCAKE_MISSING)
    opts = _live_opts(paths=["epd"], items=100000, fanouts=[2], timeout_s=60.0)
    cell = bench.plan(opts, wire_ok=False)[0]
    with bench.RankSet(opts, 2, bench.arena_sizes(opts, [cell])) as ranks:
        victim = ranks.procs[("prefill", 1)]
        killer = threading.Timer(2.0, lambda: os.kill(victim.pid, 9))
        killer.start()
        try:
            with pytest.raises(RuntimeError) as err:
                ranks.run_cell(cell)
        finally:
            killer.cancel()
    # Said of the dead rank, not a timeout of the cell (timeout_s 60) that waited it out.
    assert "prefill rank 1 exited (-9)" in str(err.value)
    # Its log lived in a temporary folder, gone by now: the message carries its last lines, not its path.
    assert "log: its last lines (keep the whole log with --log-dir)" in str(err.value)
    assert "bench-prefill-1.log" not in str(err.value)


class _Sleepers:
    """A RankSet's reporting side over plain sleeping processes: its queue, logs and processes, no engines."""

    def __init__(self, log_dir) -> None:
        ctx = mp.get_context("spawn")
        self.ranks = object.__new__(bench.RankSet)
        self.ranks.opts = _live_opts(timeout_s=30.0)
        self.ranks.res_q = ctx.Queue()
        self.ranks.log_dir = str(log_dir)
        self.ranks._tmp = None  # the logs are kept (as with --log-dir)
        self.ranks.procs = {("prefill", r): ctx.Process(target=time.sleep, args=(60,), daemon=True) for r in (0, 1)}
        for proc in self.ranks.procs.values():
            proc.start()
        (log_dir / "bench-prefill-1.log").write_text("prefill 1's last words\n")

    def kill(self, rank: int) -> None:
        os.kill(self.ranks.procs[("prefill", rank)].pid, 9)

    def close(self) -> None:
        for proc in self.ranks.procs.values():
            proc.kill()
            proc.join(5)


@pytest.mark.live
@pytest.mark.parametrize("death_after_s", [None, 0.2])
def test_a_peer_failure_that_outruns_a_rank_death_is_reported_after_it(tmp_path, death_after_s):
    sleepers = _Sleepers(tmp_path)
    try:
        if death_after_s is None:
            sleepers.kill(1)
            sleepers.ranks.procs[("prefill", 1)].join(10)
        else:
            threading.Timer(death_after_s, sleepers.kill, (1,)).start()
        sleepers.ranks.res_q.put(("error", "prefill", 0, "peer gone"))
        with pytest.raises(RuntimeError) as err:
            sleepers.ranks._gather("finished", list(sleepers.ranks.procs))
    finally:
        sleepers.close()
    message = str(err.value)
    assert message.startswith("prefill rank 1 exited (-9); log: "), message
    assert "prefill 1's last words" in message
    assert "\nthen prefill rank 0 failed:\npeer gone\n" in message


@pytest.mark.live
def test_a_rank_failure_with_every_peer_alive_is_reported_as_it_is(tmp_path):
    sleepers = _Sleepers(tmp_path)
    try:
        sleepers.ranks.res_q.put(("error", "prefill", 0, "bad geometry"))
        with pytest.raises(RuntimeError) as err:
            sleepers.ranks._gather("finished", list(sleepers.ranks.procs))
    finally:
        sleepers.close()
    assert str(err.value).startswith("prefill rank 0 failed:\nbad geometry\nlog: ")
    assert "exited" not in str(err.value)

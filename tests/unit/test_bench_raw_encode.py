"""bench._raw_encode, the raw path's encode side, driven through a recording engine and worker hooks."""

from __future__ import annotations

from bench_fakes import (FakeWorker, RecordingEngine, check_each_peer_was_first_written_before_the_window,
                         writes_before_the_window)

from transfer import bench


class _PollingEngine(RecordingEngine):
    """The recording engine with poll(), which the raw path's sweeps call: every write is over at once."""

    def poll(self, ticket) -> bool:
        return True


def _worker(cell: bench.Cell) -> FakeWorker:
    worker = FakeWorker(cell)
    worker.eng = _PollingEngine()
    return worker


def test_raw_warm_up_bytes_are_overwritten_by_a_timed_room_with_other_bytes():
    # The untimed warm-up write must not leave bytes that could stand in for a lost timed write.
    cell = bench.Cell("raw", 64, 256, "torch.bfloat16", fanout=2, inflight=4, items=10)
    worker = _worker(cell)
    bench._raw_encode(worker, cell, {"protocol": "tcp", "raw_issue": "async", "raw_writers": 1})
    warm = worker.eng.writes[:2]
    timed = worker.eng.writes[2:]
    # One warm-up write per receiver, then the timed rooms' (each receiver's shard per room).
    assert sorted(w[0] for w in warm) == ["peer0", "peer1"], worker.eng.writes
    assert len(timed) == cell.items * cell.fanout
    for session, src, dst, _ in warm:
        later = [w for w in timed if w[0] == session and w[2] == dst]
        assert later, "a slot written only by the warm-up would be checked against nothing timed"
        assert later[-1][1] != src


def test_raw_window_opens_after_the_first_write_to_each_peer(monkeypatch):
    # The epd path moves an untimed room first; raw must not time its peers' handshakes either,
    # or the first raw cell of each new prefill rank is slowed and every ratio to it inflated.
    cell = bench.Cell("raw", 64, 256, "torch.bfloat16", fanout=2, inflight=2, items=6)
    worker = _worker(cell)
    opened = writes_before_the_window(worker, cell, "async", monkeypatch)
    check_each_peer_was_first_written_before_the_window(worker, cell, opened)

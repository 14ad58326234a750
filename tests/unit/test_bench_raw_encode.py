"""bench._raw_encode, the raw path's encode side, driven through a recording engine and worker hooks."""

from __future__ import annotations

from transfer import bench


class _RecordingEngine:
    """The engine calls _raw_encode makes, each write recorded as (session, src, dst, length)."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, int, int, int]] = []

    def write_async(self, session, srcs, dsts, lens) -> int:
        self.writes.append((session, srcs[0], dsts[0], lens[0]))
        return len(self.writes)

    def wait(self, ticket, timeout_s=None) -> None:
        return None

    def write(self, session, srcs, dsts, lens) -> None:
        self.wait(self.write_async(session, srcs, dsts, lens))


class _FakeWorker:
    """The hooks _raw_encode drives, with `fanout` receivers of 32 rows each."""

    def __init__(self, cell: bench.Cell) -> None:
        from transfer.harness import ItemSource

        self.eng = _RecordingEngine()
        self.src = ItemSource(cell.span, cell.hidden, cell.dtype)
        stride = 32 * cell.row_bytes
        self.receivers = [{"session": f"peer{r}", "addr": 1 << 32 + r, "stride": stride,
                           "row_start": 32 * r, "rows": 32, "rank": r} for r in range(cell.fanout)]

    def engine(self, protocol):
        return self.eng

    def source(self, cell, protocol=None):
        return self.src

    def ready(self, info=None) -> None:
        pass

    def go(self):
        return self.receivers

    def finished(self) -> None:
        pass


def test_raw_warm_up_bytes_are_overwritten_by_a_timed_room_with_other_bytes():
    # The untimed warm-up write must not leave bytes that could stand in for a lost timed write.
    cell = bench.Cell("raw", 64, 256, "torch.bfloat16", fanout=2, inflight=4, items=10)
    worker = _FakeWorker(cell)
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

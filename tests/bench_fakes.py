"""Stand-ins for what the bench's bodies drive: an engine that records its writes, the worker's
hooks, and the zmq module a floor prefill rank talks through."""

from __future__ import annotations

import collections
import time
import types
from typing import Callable

from transfer import bench


def floor_zmq(on_ask: Callable[[int, int], None]) -> types.ModuleType:
    """A zmq module whose PUSH socket hands each bare floor ask's room and destination to on_ask,
    then queues the room's bare status for the PULL socket."""
    statuses: collections.deque = collections.deque()

    class _Socket:
        def bind_to_random_port(self, addr) -> int:
            return 1

        def connect(self, addr) -> None:
            pass

        def send(self, ask: bytes) -> None:
            room, _, dst = bench._FLOOR_ASK.unpack(ask)
            on_ask(room, dst)
            statuses.append(bench._FLOOR_STATUS.pack(room))

        def poll(self, timeout_ms) -> int:
            return len(statuses)

        def recv(self) -> bytes:
            return statuses.popleft()

        def close(self, linger=None) -> None:
            pass

    zmq = types.ModuleType("zmq")
    zmq.PULL, zmq.PUSH = 7, 8  # type: ignore[attr-defined]
    zmq.Context = lambda: types.SimpleNamespace(socket=lambda kind: _Socket(), term=lambda: None)  # type: ignore[attr-defined]
    return zmq


class RecordingEngine:
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


class FakeWorker:
    """The hooks _raw_encode drives, with `fanout` receivers of 32 rows each."""

    def __init__(self, cell: bench.Cell) -> None:
        from transfer.harness import ItemSource

        self.eng = RecordingEngine()
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


def writes_before_the_window(worker: FakeWorker, cell: bench.Cell, issue: str, monkeypatch) -> int:
    """Runs _raw_encode; how many writes the engine had taken when its timed window opened."""
    opened: list[int] = []
    reading = bench.thread_cpu

    def mark():
        opened.append(len(worker.eng.writes))
        return reading()

    monkeypatch.setattr(bench, "thread_cpu", mark)
    report = bench._raw_encode(worker, cell, {"protocol": "tcp", "raw_issue": issue, "raw_writers": 2})
    assert report["failed"] == [] and report["bytes"] == cell.items * cell.item_bytes
    return opened[0]


def check_each_peer_was_first_written_before_the_window(worker: FakeWorker, cell: bench.Cell, opened: int) -> None:
    """The first write to each peer (its connection) came before the window; each timed room
    wrote each receiver's shard once, into slot room % slots."""
    sessions = [r["session"] for r in worker.receivers]
    assert sorted(w[0] for w in worker.eng.writes[:opened]) == sorted(sessions)
    timed = worker.eng.writes[opened:]
    assert len(timed) == cell.items * cell.fanout
    for room in range(cell.items):
        for r in worker.receivers:
            dst = r["addr"] + (room % cell.slots) * r["stride"]
            slot_rooms = len(range(room % cell.slots, cell.items, cell.slots))
            assert sum(1 for w in timed if w[0] == r["session"] and w[2] == dst) == slot_rooms


class FakeTime:
    """The bench's `time` module on a fake clock: sleep() moves it on; process_time stays real."""

    def __init__(self) -> None:
        self.now = 0.0
        self.process_time = time.process_time

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def time(self) -> float:
        return 1000.0 + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

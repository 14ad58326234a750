"""`epd-transfer bench`, epd/wire prefill side: a failed room's slot is asked into again only once its
handle says safe_to_reuse (its encode rank may still write into it until then).

The body runs over a fake session manager and the bench's `time` on a fake clock (sleeps move it on).
"""

from __future__ import annotations

import math

import pytest

from bench_fakes import FakeTime

from transfer import bench
from transfer.harness import ItemSource
from transfer.status import TransferPoll

CELL = dict(span=64, hidden=256, dtype="torch.bfloat16", fanout=1, inflight=1, items=4)


class _Worker:
    def __init__(self, cell: bench.Cell) -> None:
        import torch

        self.rank, self.setup = 0, {"host": "127.0.0.1"}
        self.src = ItemSource(cell.span, cell.hidden, cell.dtype)
        self.arena = torch.empty(bench.arena_sizes(bench.Options(), [cell])[0], dtype=torch.uint8)

    def engine(self, protocol):
        return None

    def source(self, cell, protocol=None):
        return self.src

    def slots(self, cell, rows):
        return bench._Worker.slots(self, cell, rows)  # type: ignore[arg-type]

    def ready(self, info=None) -> None:
        pass

    def go(self):
        return None

    def finished(self) -> None:
        pass


class _Handle:
    """A room that succeeds, or fails and is safe to reuse from `safe_at` on the fake clock."""

    def __init__(self, clock: FakeTime, room: int, fails: bool, safe_at: float) -> None:
        self.clock, self.room, self.fails, self.safe_at = clock, room, fails, safe_at
        self.latency_s, self.started_at, self.stages = 1e-4, 0.0, {}
        self.failure = "deadline" if fails else None

    def wait(self, timeout_s=None):
        return TransferPoll.Failed if self.fails else TransferPoll.Success

    @property
    def safe_to_reuse(self) -> bool:
        return not self.fails or self.clock.now >= self.safe_at

    def clear(self) -> None:
        pass


def _run(monkeypatch, safe_at: float) -> tuple[dict, list]:
    """Room 1 fails, its slot safe from `safe_at`; the report and each ask's (room, slot, unsafe rooms there)."""
    clock = FakeTime()
    monkeypatch.setattr(bench, "time", clock)
    cell = bench.Cell("epd", **CELL)
    worker = _Worker(cell)
    row_start, rows = cell.shard(0)
    handles: list[_Handle] = []
    asks: list = []

    class _Manager:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def receive(self, room, bootstrap, dst, row_start, span):
            addr = dst.data_ptr()
            unsafe = [h.room for h in handles if h.addr == addr and not h.safe_to_reuse]  # type: ignore[attr-defined]
            asks.append((room, addr, unsafe))
            handle = _Handle(clock, room, room == 1, safe_at)
            handle.addr = addr  # type: ignore[attr-defined]
            handles.append(handle)
            if room != 1:
                first = worker.src.offset(room, cell.span) + row_start
                dst.view(-1)[:] = worker.src.pool[first : first + rows].reshape(-1)
            return handle

    monkeypatch.setattr("transfer.receiver.SessionManager", _Manager)
    report = bench._epd_prefill(worker, cell, {"protocol": "tcp", "deadline_s": 1.0, "bootstrap": "fake:0"})  # type: ignore[arg-type]
    return report, asks


def test_a_failed_rooms_slot_is_asked_into_only_once_it_is_safe_to_reuse(monkeypatch):
    report, asks = _run(monkeypatch, safe_at=3e-3)
    assert [room for room, _, _ in asks] == [bench.WARMUP_ROOM, 0, 1, 2, 3]
    assert all(not unsafe for _, _, unsafe in asks), asks  # room 2 waited for room 1's slot
    assert [room for room, _ in report["failed"]] == [1]
    assert report["latency_rooms"] == [0, 2, 3] and report["bad"] == []


def test_a_failed_room_whose_slot_never_turns_safe_fails_the_rank_after_the_deadline(monkeypatch):
    with pytest.raises(TimeoutError, match="none was safe to reuse"):
        _run(monkeypatch, safe_at=math.inf)

"""`epd-transfer bench`: what a floor or epd prefill rank checks of the bytes that land, and when.

The prefill bodies run in this process over fakes: a session manager, or ZMQ sockets, whose
"encode rank" copies each asked room's shard from the item pool into the slot at once.
"""

from __future__ import annotations

import ctypes
import sys
import types

import pytest

from bench_fakes import floor_zmq

from transfer import bench
from transfer.harness import ItemSource
from transfer.status import TransferPoll

CELL = dict(span=64, hidden=256, dtype="torch.bfloat16", fanout=2, inflight=1, items=10)


class _Worker:
    """The hooks a prefill body drives, as prefill rank `rank`; `log` records finished() and the slot check.

    `misplaced` rooms land another room's rows, `short` ones all but their last row; with `flip`,
    finished() flips a byte in the middle of slot 0.
    """

    def __init__(self, cell: bench.Cell, rank: int = 1, misplaced: dict[int, int] | None = None,
                 short: set[int] | None = None, flip: bool = False) -> None:
        import torch

        self.rank, self.cell, self.log, self.setup = rank, cell, [], {"host": "127.0.0.1"}
        self.src = ItemSource(cell.span, cell.hidden, cell.dtype)
        self.arena = torch.empty(bench.arena_sizes(bench.Options(), [cell])[rank], dtype=torch.uint8)
        self.misplaced, self.short, self.flip = misplaced or {}, short or set(), flip

    def deliver(self, room: int, dst: int) -> None:
        """What the encode rank writes for room at dst: its shard, another room's, or all but its last row."""
        row_start, rows = self.cell.shard(self.rank)
        first = self.src.offset(self.misplaced.get(room, room), self.cell.span) + row_start
        nbytes = (rows - (room in self.short)) * self.cell.row_bytes
        ctypes.memmove(dst, self.src.pool.data_ptr() + first * self.cell.row_bytes, nbytes)

    def engine(self, protocol):
        return types.SimpleNamespace(session_id="fake:1")

    def source(self, cell, protocol=None):
        return self.src

    def slots(self, cell, rows):
        return bench._Worker.slots(self, cell, rows)  # type: ignore[arg-type]

    def ready(self, info=None) -> None:
        pass

    def go(self):
        return {"port": 1}

    def finished(self) -> None:
        self.log.append("finished")
        if self.flip:
            self.arena[self.cell.shard(self.rank)[1] * self.cell.row_bytes // 2] ^= 1


class _Handle:
    def __init__(self, room: int) -> None:
        self.room, self.latency_s, self.started_at, self.stages, self.failure = room, 1e-4, 0.0, {}, None

    def wait(self, timeout_s=None):
        return TransferPoll.Success

    def clear(self) -> None:
        pass


def _session_manager(worker: _Worker):
    """A SessionManager whose receive() lands the room at once."""

    class _Manager:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def receive(self, room, bootstrap, dst, row_start, span):
            worker.deliver(room, dst.data_ptr())
            return _Handle(room)

    return _Manager


def _zmq(worker: _Worker) -> types.ModuleType:
    """A zmq module whose PUSH socket lands each bare ask's shard and queues its bare status."""
    return floor_zmq(worker.deliver)


def _run(monkeypatch, path: str, **faults) -> tuple[dict, _Worker]:
    """One floor or epd prefill body over the fakes, the slot check logged after it runs."""
    cell = bench.Cell(path, **CELL)
    worker = _Worker(cell, **faults)
    if path == "floor":
        monkeypatch.setitem(sys.modules, "zmq", _zmq(worker))
    else:
        monkeypatch.setattr("transfer.receiver.SessionManager", _session_manager(worker))
    check = bench._check_slots

    def logged(*args):
        problems = check(*args)
        worker.log.append("check")
        return problems

    monkeypatch.setattr(bench, "_check_slots", logged)
    body = bench._floor_prefill if path == "floor" else bench._epd_prefill
    report = body(worker, cell, {"protocol": "tcp", "deadline_s": 5.0, "bootstrap": "fake:0"})  # type: ignore[arg-type]
    return report, worker


@pytest.mark.parametrize("path", ["floor", "epd"])
def test_every_room_that_lands_is_checked_not_only_each_slots_last(monkeypatch, path):
    # One slot, ten rooms: room 3 lands room 7's rows, and room 5 all but its last row; room 9, the slot's
    # last, lands right, so checking only the last room would pass the cell.
    report, _ = _run(monkeypatch, path, misplaced={3: 7}, short={5})
    assert report["latency_rooms"] == list(range(10))
    assert report["bad"] == [f"prefill 1 room {room}: the first or last 64 landed bytes differ from the item"
                             for room in (3, 5)]


@pytest.mark.parametrize("path", ["floor", "epd"])
def test_rooms_that_land_right_pass_and_the_slots_last_room_is_still_compared_whole(monkeypatch, path):
    report, _ = _run(monkeypatch, path)
    assert report["bad"] == []
    # A byte in the middle of the slot's last room: the fingerprints miss it, the whole comparison does not.
    report, _ = _run(monkeypatch, path, flip=True)
    assert report["bad"] == ["prefill 1 room 9: landed rows differ from the item"]


@pytest.mark.parametrize("path", ["floor", "epd"])
def test_the_slots_are_compared_after_every_rank_is_done(monkeypatch, path):
    # Comparing the slots inside the cell would compete with peers still timed.
    _, worker = _run(monkeypatch, path)
    assert worker.log == ["finished", "check"]


def test_a_fingerprint_reads_both_ends_of_the_shard():
    cell = bench.Cell("epd", **CELL)
    worker = _Worker(cell)
    row_start, rows = cell.shard(worker.rank)
    slots = bench._Worker.slots(worker, cell, rows)  # type: ignore[arg-type]
    landed = bench._Fingerprints(worker, cell, slots, row_start, rows)  # type: ignore[arg-type]
    worker.deliver(4, slots[0].data_ptr())
    bad: list[str] = []
    landed.check(4, 0, bad)
    assert bad == []
    slots[0, rows - 1, -1] += 1  # the shard's very last element
    landed.check(4, 0, bad)
    slots[0, rows - 1, -1] -= 1
    slots[0, 0, 0] += 1  # its very first
    landed.check(4, 0, bad)
    assert len(bad) == 2

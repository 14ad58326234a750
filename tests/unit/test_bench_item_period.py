"""`epd-transfer bench` and the harness's items: a receive slot never already holds the item its next room
is checked against, so a write that never landed cannot pass the byte checks.

ItemSource's items repeat only after more rooms than a cell has slots, and the floor, epd and wire
warm-up room carries an item no timed room first in its slot has.
"""

from __future__ import annotations

import ctypes
import sys
import types

import torch

from bench_fakes import floor_zmq

from transfer import bench
from transfer.harness import ItemSource


def test_items_repeat_only_after_a_thousand_rooms_even_for_short_items():
    # 64 rows used to give 65 starts: room r and room r + 65 were one item, so at 65 rooms in flight a
    # slot's lost write left the bytes it was checked against.
    for span in (1, 16, 64, 200, 1024):
        source = ItemSource(span, 16, "torch.bfloat16")
        starts = [source.offset(room, span) for room in range(1024)]
        assert len(set(starts)) == 1024, span
        assert all(0 <= s <= source.rows - span for s in starts)


def test_a_cell_with_more_slots_than_that_gets_items_that_repeat_later_still():
    cell = bench.Cell("raw", 64, 16, "torch.bfloat16", fanout=1, inflight=65 * 1024, items=65 * 1024 + 64)
    worker = bench._Worker("encode", 0, {"arena_bytes": 0}, None, None)
    source = worker.source(cell)
    slots = cell.slots
    assert all(source.offset(room, cell.span) != source.offset(room - slots, cell.span)
               for room in range(slots, cell.items))


class _Pool:
    """A SenderPool that records what each room carries and succeeds at once."""

    sent: list = []

    def __init__(self, *args, **kwargs) -> None:
        _Pool.sent = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def send(self, room, item, deepstack=None):
        _Pool.sent.append((room, bytes(item.contiguous().view(torch.uint8).numpy())))  # bf16 NaNs are not equal
        return types.SimpleNamespace(room=room, wait=lambda timeout: bench_success(), clear=lambda: None,
                                     started_at=0.0, stages={}, failure=None)


def bench_success():
    from transfer.status import TransferPoll

    return TransferPoll.Success


class _EncodeWorker:
    def __init__(self, cell: bench.Cell) -> None:
        self.rank, self.setup = 0, {"host": "127.0.0.1"}
        self.src = ItemSource(cell.span, cell.hidden, cell.dtype)

    def engine(self, protocol):
        return None

    def source(self, cell, protocol=None):
        return self.src

    def ready(self, info=None) -> None:
        pass

    def go(self):
        return None

    def finished(self) -> None:
        pass


def test_the_epd_warm_up_room_carries_an_item_no_room_first_in_a_slot_has(monkeypatch):
    # At 1 in flight the warm-up room and room 0 share slot 0: with room 0's own item in it, a room 0
    # whose write never landed would read as landed.
    monkeypatch.setattr("transfer.sender.SenderPool", _Pool)
    monkeypatch.setattr(bench, "_bytes_written", lambda pool: 0)
    for inflight in (1, 4):
        cell = bench.Cell("epd", 64, 256, "torch.bfloat16", fanout=1, inflight=inflight, items=8)
        bench._epd_encode(_EncodeWorker(cell), cell, {"protocol": "tcp", "deadline_s": 5.0, "bootstrap": "x"})  # type: ignore[arg-type]
        (warm_room, warm), *timed = _Pool.sent
        assert warm_room == bench.WARMUP_ROOM
        for room, item in timed[: cell.slots]:
            assert warm != item, f"the warm-up room carries room {room}'s item"


def test_a_lost_first_floor_write_into_the_warm_up_slot_is_caught(monkeypatch):
    # 1 in flight, 65 x 1024 rooms: the floor's warm-up used to ask for room `items`, whose item is room
    # 0's when the items repeat every 65 rooms (or every 1024); room 0's write is lost.
    cell = bench.Cell("floor", 64, 16, "torch.bfloat16", fanout=1, inflight=1, items=65 * 1024)
    worker = bench._Worker("prefill", 0, {"arena_bytes": bench.arena_sizes(bench.Options(), [cell])[0],
                                          "host": "127.0.0.1"}, None, None)
    # The bench's own worker and item pool, with the parent's hooks and the engine stood in for.
    worker.engine = lambda protocol: types.SimpleNamespace(session_id="fake:1")  # type: ignore[method-assign]
    worker.ready = lambda info=None: None  # type: ignore[method-assign]
    worker.go = lambda: {"port": 1}  # type: ignore[method-assign]
    worker.finished = lambda: None  # type: ignore[method-assign]
    source = worker.source(cell)
    row_start, rows = cell.shard(0)

    def on_ask(room: int, dst: int) -> None:
        if room != 0:  # room 0's write is lost; its status still comes
            first = source.offset(room, cell.span) + row_start
            ctypes.memmove(dst, source.pool.data_ptr() + first * cell.row_bytes, rows * cell.row_bytes)

    monkeypatch.setitem(sys.modules, "zmq", floor_zmq(on_ask))
    report = bench._floor_prefill(worker, cell, {"protocol": "tcp", "deadline_s": 5.0})
    assert report["bad"] == ["prefill 0 room 0: the first or last 64 landed bytes differ from the item"]

"""The bench's floor path, prefill side, in its own process over real Mooncake tcp and ZMQ, against a
stand-in encode rank (this test) that completes a room's write after a later room's."""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest
from live_helpers import HOST, LIVE, MOONCAKE_MISSING

from transfer import bench

pytestmark = LIVE

BOUND_S = 60


class _Parent:
    """What `epd-transfer bench` does with one prefill rank process: start it, run one cell, stop it."""

    def __init__(self, cell: bench.Cell) -> None:
        ctx = mp.get_context("spawn")
        self.cmd_q, self.res_q = ctx.Queue(), ctx.Queue()
        setup = {"host": HOST, "arena_bytes": cell.slots * cell.item_bytes, "timeout_s": BOUND_S}
        self.proc = ctx.Process(target=bench._worker_main, args=("prefill", 0, setup, self.cmd_q, self.res_q),
                                daemon=True)
        self.proc.start()
        self.expect("started")
        self.cmd_q.put(("cell", cell, {"protocol": "tcp", "deadline_s": 30}))

    def expect(self, what: str):
        try:
            kind, _, _, payload = self.res_q.get(timeout=BOUND_S)
        except queue.Empty:
            raise AssertionError(f"the prefill rank sent no {what!r} within {BOUND_S}s") from None
        assert kind == what, payload
        return payload

    def stop(self) -> None:
        self.cmd_q.put(("stop",))
        self.proc.join(BOUND_S)
        if self.proc.is_alive():
            self.proc.kill()


class _StandInEncode:
    """Takes the floor's bare asks, writes what each names with a real engine, pushes bare statuses."""

    def __init__(self, cell: bench.Cell, engine, ctx) -> None:
        import zmq

        from transfer.harness import ItemSource

        self.cell, self.engine = cell, engine
        self.source = ItemSource(cell.span, cell.hidden, cell.dtype)
        engine.register(self.source.pool)
        self.pull = ctx.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port(f"tcp://{HOST}")
        self.push = ctx.socket(zmq.PUSH)

    def connect(self, info: dict) -> None:
        self.info = info
        self.push.connect(f"tcp://{HOST}:{info['status_port']}")

    def ask(self) -> tuple[int, int]:
        """The next ask: (room, destination address)."""
        assert self.pull.poll(BOUND_S * 1000), "the prefill rank asked for nothing"
        room, rank, dst = bench._FLOOR_ASK.unpack(self.pull.recv())
        assert rank == 0
        return room, dst

    def write(self, room: int, dst: int) -> None:
        cell, info = self.cell, self.info
        src = self.source.pool.data_ptr() + (self.source.offset(room, cell.span) + info["row_start"]) * cell.row_bytes
        self.engine.write(info["session"], [src], [dst], [info["rows"] * cell.row_bytes])

    def status(self, room: int) -> None:
        self.push.send(bench._FLOOR_STATUS.pack(room))

    def close(self) -> None:
        self.pull.close(0)
        self.push.close(0)


def test_a_room_concluded_out_of_order_frees_its_own_slot_for_the_next_ask():
    if MOONCAKE_MISSING:
        pytest.skip(MOONCAKE_MISSING)
    import zmq

    from transfer.engine import Engine

    cell = bench.Cell("floor", 16, 256, "torch.bfloat16", fanout=1, inflight=2, items=6)
    parent = _Parent(cell)
    ctx = zmq.Context()
    try:
        with Engine(HOST, "tcp") as engine:
            encode = _StandInEncode(cell, engine, ctx)
            try:
                encode.connect(parent.expect("ready"))
                parent.cmd_q.put(("go", {"port": encode.port}))
                room, dst = encode.ask()  # the untimed warm-up room
                encode.write(room, dst)
                encode.status(room)
                parent.expect("ready")  # warmed up: its timed rooms wait for every rank to be
                parent.cmd_q.put(("go", None))
                asks = dict(encode.ask() for _ in range(cell.inflight))
                assert sorted(asks) == [0, 1]
                # Room 1 completes first; room 0's write is still to come.
                encode.write(1, asks[1])
                encode.status(1)
                room, dst = encode.ask()
                assert room == 2
                assert dst == asks[1], "room 2 was asked into a slot whose room is still being written"
                encode.write(2, dst)
                encode.write(0, asks[0])
                encode.status(0)
                encode.status(2)
                for _ in range(3, cell.items):
                    room, dst = encode.ask()
                    encode.write(room, dst)
                    encode.status(room)
                parent.expect("finished")
                parent.cmd_q.put(("close", None))
                report = parent.expect("report")
            finally:
                encode.close()
        assert report["failed"] == [] and report["bad"] == [], report
        assert sorted(report["latency_rooms"]) == list(range(cell.items))
    finally:
        parent.stop()
        ctx.term()

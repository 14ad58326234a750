"""`epd-transfer bench --paths cfloor`: the floor's loops in C (native/floor.c), between real rank
processes over Mooncake tcp and ZMQ, checked row by row against the bytes that landed."""

from __future__ import annotations

import argparse
import ctypes
import contextlib
import io
import json

import pytest
from live_helpers import LIVE, MOONCAKE_MISSING

from transfer import bench, cli
from transfer.config import resolve

pytestmark = LIVE


def _direct_calls_missing() -> str:
    """Why this host's engines cannot call Mooncake from C ("" when they can)."""
    if MOONCAKE_MISSING:
        return MOONCAKE_MISSING
    from transfer.engine import _installed_mooncake, direct_calls_verdict

    ok, why = direct_calls_verdict(_installed_mooncake(), bool(resolve("EPD_MOONCAKE_DIRECT")), True)
    return "" if ok else f"Mooncake's calls from C are off here: {why}"


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["bench", *argv])


def _run(tmp_path, *argv: str) -> tuple[int, str, list[dict]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = bench.main(_args(*argv, "--json", str(tmp_path / "rows.json"), "--deadline", "30", "--timeout", "120"))
    rows = json.loads((tmp_path / "rows.json").read_text()) if rc == 0 else []
    return rc, out.getvalue() + err.getvalue(), rows


def test_the_cfloor_path_moves_and_checks_every_room_as_the_floor_does(tmp_path):
    missing = _direct_calls_missing()
    if missing:
        pytest.skip(missing)
    rc, said, rows = _run(tmp_path, "--paths", "raw,floor,cfloor", "--sizes", "64x256,96x256", "--fanouts", "1,2",
                          "--inflight", "1,4", "--items", "24", "--cpu")
    assert rc == 0, said
    cfloor = [row for row in rows if row["path"] == "cfloor"]
    assert len(cfloor) == 2 * 2 * 2, rows
    for row in cfloor:
        assert row["verified"] is True and row["failed"] == 0, row
        # Every rank's shard of every timed room, counted where it landed and where it left; the warm-up's out.
        shards = [n * 256 * 2 * 24 for n in (bench.prefill_shard(row["span"], r, row["fanout"], 1)[1]
                                             for r in range(row["fanout"]))]
        assert row["prefill_bytes"] == shards and row["encode_bytes"] == [sum(shards)], row
        assert row["p99_ms"] >= row["p50_ms"] > 0 and row["p50_added_ms"] is not None, row
        assert row["cpu_control_ms"] > 0 and row["cpu_threads"]["encode"]["caller"]["ms"] > 0, row
        # Its encode rank's loop makes Mooncake's calls from C, counted as they are for the other paths.
        assert 0 < row["cpu_mooncake_ms"] <= row["cpu_control_ms"], row
        assert row["stages_ms"] is None, row
    assert {(r["span"], r["fanout"], r["inflight"]) for r in cfloor} == {
        (span, fanout, inflight) for span in (64, 96) for fanout in (1, 2) for inflight in (1, 4)}



@pytest.mark.parametrize("room, said", [(-2, "floor prefill 0: a status for room -2, not asked for"),
                                        (5, "floor prefill 0: a status for room 5, not asked for")])
def test_the_c_floors_prefill_loop_refuses_a_status_it_did_not_ask_for_naming_it(room, said):
    """Real ZMQ sockets on loopback: the loop's asks go out, a status for a room it never asked for
    comes back, and the loop stops with an error naming it."""
    import zmq

    from transfer import _io

    if _io._NATIVE is None:
        pytest.skip("transfer._native is not bound to pyzmq's libzmq")
    slot = bytearray(64)
    ctx = zmq.Context()
    asks, statuses, pusher, puller = (ctx.socket(kind) for kind in (zmq.PULL, zmq.PULL, zmq.PUSH, zmq.PUSH))
    try:
        ask_port = asks.bind_to_random_port("tcp://127.0.0.1")
        status_port = statuses.bind_to_random_port("tcp://127.0.0.1")
        puller.connect(f"tcp://127.0.0.1:{ask_port}")  # the loop's asks
        pusher.connect(f"tcp://127.0.0.1:{status_port}")  # this test's statuses
        pusher.send(bench._FLOOR_STATUS.pack(room))
        address = ctypes.addressof(ctypes.c_char.from_buffer(slot))
        with pytest.raises(RuntimeError, match=f"^{said}$"):
            _io._NATIVE.floor_receive(puller.underlying, statuses.underlying, statuses.fileno(), 0, [address], 2,
                                      10.0, 8, 64)
        assert bench._FLOOR_ASK.unpack(asks.recv())[:2] == (0, 0), "the loop asked for room 0 first"
    finally:
        for sock in (asks, statuses, pusher, puller):
            sock.close(linger=0)
        ctx.term()



class _ClearsTheList:
    """An integer whose reading empties the list it stands in."""

    def __init__(self, listed: list, value: int) -> None:
        self.listed, self.value = listed, value

    def __index__(self) -> int:
        self.listed.clear()
        return self.value


def test_the_c_floors_prefill_loop_reads_its_slots_once_whatever_a_slot_runs():
    """A slot's __index__ that empties the list mid-parse: the loop works from its own copy (both slots,
    each read once) rather than reading freed memory."""
    import zmq

    from transfer import _io

    if _io._NATIVE is None:
        pytest.skip("transfer._native is not bound to pyzmq's libzmq")
    slot_a, slot_b = bytearray(b"A" * 64), bytearray(b"B" * 64)
    ctx = zmq.Context()
    asks, statuses, pusher, puller = (ctx.socket(kind) for kind in (zmq.PULL, zmq.PULL, zmq.PUSH, zmq.PUSH))
    try:
        ask_port = asks.bind_to_random_port("tcp://127.0.0.1")
        status_port = statuses.bind_to_random_port("tcp://127.0.0.1")
        puller.connect(f"tcp://127.0.0.1:{ask_port}")
        pusher.connect(f"tcp://127.0.0.1:{status_port}")
        pusher.send(bench._FLOOR_STATUS.pack(0))
        first = ctypes.addressof(ctypes.c_char.from_buffer(slot_a))
        slots: list = []
        slots.extend([_ClearsTheList(slots, first), ctypes.addressof(ctypes.c_char.from_buffer(slot_b))])
        rooms, _, _, prints = _io._NATIVE.floor_receive(puller.underlying, statuses.underlying, statuses.fileno(),
                                                        0, slots, 1, 10.0, 8, 64)
        assert slots == [] and bench._FLOOR_STATUS.unpack(rooms) == (0,)
        assert prints == b"A" * 16, "room 0 landed in the first slot given"
        assert bench._FLOOR_ASK.unpack(asks.recv()) == (0, 0, first)
    finally:
        for sock in (asks, statuses, pusher, puller):
            sock.close(linger=0)
        ctx.term()


@pytest.mark.skipif(bool(_direct_calls_missing()), reason=_direct_calls_missing() or "")
def test_the_c_floors_encode_loop_reads_its_receivers_once_whatever_a_receiver_runs():
    """A receiver's __index__ that empties the list mid-parse: the loop parses both from its own copy."""
    import mooncake.engine
    import zmq

    from transfer import _io

    if _io._NATIVE is None:
        pytest.skip("transfer._native is not bound to pyzmq's libzmq")
    _io._NATIVE.mooncake_bind(mooncake.engine.__file__)
    ctx = zmq.Context()
    asks, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        receivers: list = []
        receivers.extend([(_ClearsTheList(receivers, 0), push.underlying, 0, 0, 1), (1, push.underlying, 0, 0, 1)])
        assert _io._NATIVE.floor_serve(1, asks.underlying, asks.fileno(), receivers, 0, 1.0, 1e-3, 1e-2, 4096, 8, 1,
                                       1, -1) == 0
        assert receivers == []
    finally:
        asks.close(linger=0)
        push.close(linger=0)
        ctx.term()

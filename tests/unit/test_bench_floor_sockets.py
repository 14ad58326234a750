"""`epd-transfer bench`, floor prefill side: its ZMQ sockets and context are closed however the body ends,
a failure before its first ask included."""

from __future__ import annotations

import sys
import types

import pytest

from transfer import bench


def _zmq(made: list) -> types.ModuleType:
    """A zmq module whose context and sockets record being closed and terminated."""

    class _Socket:
        def __init__(self) -> None:
            self.closed = False
            made.append(self)

        def bind_to_random_port(self, addr) -> int:
            return 1

        def close(self, linger=None) -> None:
            self.closed = True

    class _Context:
        def __init__(self) -> None:
            self.closed = False
            made.append(self)

        def socket(self, kind) -> _Socket:
            return _Socket()

        def term(self) -> None:
            self.closed = True

    zmq = types.ModuleType("zmq")
    zmq.PULL, zmq.PUSH = 7, 8  # type: ignore[attr-defined]
    zmq.Context = _Context  # type: ignore[attr-defined]
    return zmq


def test_a_floor_prefill_that_fails_reading_its_fingerprints_closes_its_sockets_and_context(monkeypatch):
    cell = bench.Cell("floor", 64, 256, "torch.bfloat16", fanout=1, inflight=2, items=4)
    worker = bench._Worker("prefill", 0, {"arena_bytes": bench.arena_sizes(bench.Options(), [cell])[0],
                                          "host": "127.0.0.1"}, None, None)
    worker.engine = lambda protocol: types.SimpleNamespace(session_id="fake:1")  # type: ignore[method-assign]
    made: list = []
    monkeypatch.setitem(sys.modules, "zmq", _zmq(made))

    def unreadable(*args):
        raise MemoryError("the item pool")

    monkeypatch.setattr(bench, "_Fingerprints", unreadable)
    with pytest.raises(MemoryError):
        bench._floor_prefill(worker, cell, {"protocol": "tcp", "deadline_s": 5.0})
    assert made, "the body made no ZMQ context"
    assert all(thing.closed for thing in made), made

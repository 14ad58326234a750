"""Fixtures several live test modules share (a module that defines its own keeps it)."""

from __future__ import annotations

import logging

import pytest
from live_helpers import HOST, MOONCAKE_MISSING

#: What a driver logs when its thread dies (it fails every room it had, then serves none).
DRIVER_DEATHS = ("the sender pool's thread failed", "the I/O thread failed")


@pytest.fixture(autouse=True)
def _drivers_stay_up(request, caplog):
    """Fails a test during which a driver thread of this process died, unless it is marked
    `driver_dies` (it kills one on purpose): the rooms a dead driver fails would pass a test
    that waits for Failed without the behaviour it meant to check ever running."""
    yield
    if request.node.get_closest_marker("driver_dies") is not None:
        return
    deaths = [record.getMessage() for record in caplog.get_records("call")
              if record.levelno >= logging.ERROR and any(death in record.getMessage() for death in DRIVER_DEATHS)]
    assert not deaths, f"a driver thread died during the test: {deaths}"


@pytest.fixture(scope="module")
def engines():
    """(encode engine, prefill engine): two real Mooncake engines (tcp on loopback)."""
    if MOONCAKE_MISSING:
        pytest.skip(MOONCAKE_MISSING)
    from transfer.engine import Engine

    with Engine(HOST, "tcp") as encode, Engine(HOST, "tcp") as prefill:
        yield encode, prefill


@pytest.fixture
def server():
    """A real bootstrap server on an ephemeral loopback port."""
    from transfer.bootstrap import BootstrapServer

    with BootstrapServer(HOST, 0) as bootstrap:
        yield bootstrap


@pytest.fixture(params=["native", "pyzmq"])
def zmq_path(request, monkeypatch):
    """Runs a test on the native ZMQ path (transfer._native's libzmq calls) and again on pyzmq's."""
    from transfer import _io

    if request.param == "native":
        if _io._NATIVE is None:
            pytest.fail("the native ZMQ path did not bind (transfer._native built? libzmq 4?)")
    else:
        monkeypatch.setattr(_io, "_NATIVE", None)
    return request.param


@pytest.fixture
def listener():
    """(push, pull): a control listener (`_io.pull_socket`, bounded as the drivers' are) on loopback and a
    PUSH connected to it."""
    import zmq

    from transfer import _io

    pull, port = _io.pull_socket(HOST, 0, "listener")
    push = _io.context().socket(zmq.PUSH)
    push.connect(f"tcp://{HOST}:{port}")
    try:
        yield push, pull
    finally:
        push.close(0)
        pull.close(0)

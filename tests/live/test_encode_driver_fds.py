"""The encode driver waits with poll(): a process with more than 1024 descriptors open is served."""

from __future__ import annotations

import gc
import os
import resource

import pytest
import torch
from live_helpers import HOST, LIVE, TOKEN, RawPrefill, item_tensor

from transfer.bootstrap import BootstrapServer
from transfer.engine import Engine
from transfer.errors import PortsInUse
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 256
OPEN_FIRST = 1100


@pytest.fixture
def many_descriptors():
    """Opens OPEN_FIRST descriptors, so every socket made afterwards is numbered past select()'s 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < OPEN_FIRST + 512:
        pytest.skip(f"the descriptor limit {hard} is too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, OPEN_FIRST + 512) if hard == resource.RLIM_INFINITY
                                                else max(soft, min(hard, OPEN_FIRST + 4096)), hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(OPEN_FIRST)]
    try:
        yield fds
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions that ended any thread during the test."""
    import threading

    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(f"{args.thread.name}: {args.exc_value!r}"))
    return errors


def test_a_room_is_served_with_1100_descriptors_open(many_descriptors, thread_errors):
    import zmq

    with Engine(HOST, "tcp") as encode, Engine(HOST, "tcp") as prefill, \
            BootstrapServer(HOST, 0, token=TOKEN) as server, \
            SenderPool(encode, 0, 1, 1, server.address, token=TOKEN) as pool, \
            RawPrefill(prefill, pool.host, pool.port, SPAN * HIDDEN * 2) as raw:
        assert pool._driver.pull.getsockopt(zmq.FD) > 1024
        rows = item_tensor(3, SPAN, HIDDEN)
        handle = pool.send(3, rows)
        raw.ask(3, raw.base, SPAN, HIDDEN, SPAN)
        assert handle.wait(10.0) == TransferPoll.Success, handle.failure
        assert raw.statuses(1, 5.0)[0][:3] == [b"3", b"5", b"0"]
        assert torch.equal(raw.buffer, rows.contiguous().view(torch.uint8).reshape(-1))
        assert pool._thread.is_alive()
    assert thread_errors == []  # the status pushers' thread too waits with poll()


def test_a_driver_that_cannot_bind_its_port_leaves_no_descriptor_open():
    from transfer import _io
    from transfer.core.encode import EncodeCore
    from transfer.drive.encode import EncodeDriver, RoomBook, SourceRegistry
    from transfer.metrics import Metrics

    def pipes() -> int:
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
            except FileNotFoundError:  # closed since the listing
                pass
        return count

    blocker, port = _io.pull_socket(HOST, 0)
    try:
        gc.collect()
        before = pipes()
        for _ in range(50):
            with pytest.raises(PortsInUse, match=str(port)):
                EncodeDriver(EncodeCore(), None, 0, HOST, port, RoomBook(Metrics("t")), SourceRegistry(None),
                             Metrics("t"))
        # Each leaked wake-up pipe is two; what the rest of the process opens meanwhile stays well under it.
        assert pipes() - before < 25
    finally:
        blocker.close(0)

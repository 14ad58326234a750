"""A caller's call that needs a lock one of the library's threads is stuck holding gives up within
LOCK_WAIT_S, raising the library's error that names the stuck thread and what to do, instead of joining it;
and a thread the process cannot start fails the rooms that needed it, naming why, instead of raising out of
receive() or stopping the manager.

Real Mooncake engines (tcp on loopback), real ZMQ sockets and real bootstrap servers. The stuck holders are
the library's own threads inside a call that does not return: the prefill I/O thread counting a failed room
with the caller's metrics (an exporter that hangs), the encode thread dropping a temporary registration
(an engine.unregister that hangs); the thread limit is played by Thread.start() raising as CPython's does.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import torch
from live_helpers import HOST, LIVE, item_tensor, wait_until

from transfer import _io
from transfer.buffers import ReceivePool
from transfer.core.failure import FailureKind
from transfer.errors import EngineError, UsageError
from transfer.metrics import Metrics
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
SLOT = SPAN * HIDDEN * 2  # bfloat16
LOCK_WAIT_S = 0.5  # the bound under test, cut short
HANG_S = 30.0  # a call still waiting this long joined the stuck thread


class HangingExporter(Metrics):
    """The caller's metrics, whose exporter hangs on `counter` once armed (until `go` is set)."""

    def __init__(self, prefix: str, counter: str) -> None:
        super().__init__(prefix)
        self.counter = counter
        self.armed = False
        self.hanging = threading.Event()
        self.go = threading.Event()

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        if self.armed and name == self.counter and not self.go.is_set():
            self.hanging.set()
            self.go.wait(HANG_S)
        super().inc(name, amount, **labels)


def _refusing_address() -> str:
    """A loopback address nothing listens at: a look-up there is refused at once."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return f"{HOST}:{sock.getsockname()[1]}"


def _call(call: Any) -> Any:
    """What `call()` returned or raised, on a thread of its own; fails the test if it is still waiting after
    HANG_S (it joined the stuck thread)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, name="test-caller", daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), "the call waited for the stuck thread"
    return outcome[0]


def test_receive_and_clear_behind_the_io_thread_stuck_inside_a_step_raise_usage_error_naming_it(engines,
                                                                                              monkeypatch):
    """The I/O thread concludes a room whose look-up was refused and hangs in the caller's exporter while it
    counts it, holding the manager's lock: a receive() and a clear() give up within the bound with
    UsageError naming that thread and saying to close the manager; nothing was filed or forgotten, so once
    the exporter returns the same calls go through."""
    _, prefill = engines
    monkeypatch.setattr(_io, "LOCK_WAIT_S", LOCK_WAIT_S)
    refusing = _refusing_address()
    metrics = HangingExporter("epd_prefill", "rooms_failed_total")
    with ReceivePool(prefill, 4 * SLOT, SLOT) as pool:
        manager = SessionManager(prefill, 0, 1, 1, pool=pool, host=HOST, metrics=metrics, close_timeout_s=5.0)
        try:
            metrics.armed = True
            first = manager.receive(1, refusing, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
            assert metrics.hanging.wait(HANG_S), "the I/O thread never counted the refused room"

            raised = _call(lambda: manager.receive(2, refusing, rows=SPAN, hidden=HIDDEN, dtype="bfloat16"))
            assert isinstance(raised, UsageError), repr(raised)
            text = str(raised)
            assert "receive() waited 0.5s" in text and "nothing was done" in text, text
            assert "thread epd-prefill-0" in text and "close() the manager" in text, text
            assert pool.stats()["leased"] == 1, pool.stats()  # the second room's slot went back

            raised = _call(first.clear)
            assert isinstance(raised, UsageError) and "clear() waited 0.5s" in str(raised), repr(raised)
            assert "thread epd-prefill-0" in str(raised), str(raised)

            metrics.go.set()
            assert first.wait(HANG_S) == TransferPoll.Failed
            assert first.failure_kind is FailureKind.BOOTSTRAP
            first.clear()  # kept by the clear() that gave up: forgotten now, its slot free again
            manager.receive(2, refusing, rows=SPAN, hidden=HIDDEN, dtype="bfloat16").clear()
            assert pool.stats()["leased"] == 0, pool.stats()
        finally:
            metrics.go.set()
            manager.close()


def test_a_look_up_thread_the_process_cannot_start_fails_its_room_naming_the_thread_limit(engines, server,
                                                                                         monkeypatch):
    """receive() needs a look-up thread and the process is at its thread limit (Thread.start() raises
    RuntimeError, as CPython's does then): receive() returns its handle, and the room fails as a bootstrap
    failure saying so and what to do; the manager's I/O thread serves on, and the next room, once threads
    can be started again, is looked up and asked for."""
    encode, prefill = engines
    start = threading.Thread.start

    def at_the_limit(thread: threading.Thread) -> None:
        if thread.name.startswith("epd-pre0-boot"):
            raise RuntimeError("can't start new thread")
        start(thread)

    with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as sender, \
            ReceivePool(prefill, 4 * SLOT, SLOT) as pool, \
            SessionManager(prefill, 0, 1, 1, pool=pool, host=HOST) as manager:
        monkeypatch.setattr(threading.Thread, "start", at_the_limit)
        handle = manager.receive(1, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
        assert handle.wait(HANG_S) == TransferPoll.Failed
        assert handle.failure_kind is FailureKind.BOOTSTRAP
        assert "cannot start a thread to look it up (RuntimeError: can't start new thread)" in handle.failure, \
            handle.failure
        assert "thread limit" in handle.failure, handle.failure
        handle.clear()
        monkeypatch.undo()
        sent = sender.send(2, item_tensor(2, SPAN, HIDDEN))
        again = manager.receive(2, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
        assert again.wait(HANG_S) == TransferPoll.Success, again.failure
        assert torch.equal(again.rows, item_tensor(2, SPAN, HIDDEN))
        again.clear()
        sent.clear()


def test_send_behind_a_deregistration_that_does_not_return_raises_engine_error_naming_the_thread(engines, server,
                                                                                               monkeypatch):
    """A cleared room's temporary source registration is dropped by the pool's thread, inside the engine's
    unregister(), which hangs (a wedged device), holding the engine's book of source registrations: the next
    send() gives up within the bound with EngineError naming that thread, its room number free; once the
    engine returns, the same send() goes through."""
    encode, _ = engines
    monkeypatch.setattr(_io, "LOCK_WAIT_S", LOCK_WAIT_S)
    hanging, go = threading.Event(), threading.Event()
    unregister = encode.unregister

    def wedged(addr: int) -> None:
        hanging.set()
        go.wait(HANG_S)
        unregister(addr)

    with SenderPool(encode, 0, 1, 1, server.address, host=HOST, close_timeout_s=5.0) as pool:
        try:
            monkeypatch.setattr(encode, "unregister", wedged)
            # Sources outside registered memory: each send registers its own for the room.
            pool.send(1, item_tensor(1, SPAN, HIDDEN)).clear()
            assert hanging.wait(HANG_S), "the pool's thread never dropped the cleared room's registration"
            second = item_tensor(2, SPAN, HIDDEN)
            raised = _call(lambda: pool.send(2, second))
            assert isinstance(raised, EngineError), repr(raised)
            text = str(raised)
            assert "waited 0.5s for the engine's book of source registrations" in text, text
            assert "nothing was sent" in text and "thread epd-encode-0" in text, text
            assert "close() the sender pool" in text, text
            go.set()
            assert wait_until(lambda: pool._sources.holding == 0, HANG_S)
            pool.send(2, second).clear()
        finally:
            go.set()
    assert not any(base <= second.data_ptr() < base + n for base, n in encode.registered().items())

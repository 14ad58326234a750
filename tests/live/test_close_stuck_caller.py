"""close() of a sender pool returns within close_timeout_s while another of the caller's threads is stuck
inside a send() that holds the pool's room book (its own metrics' exporter does not return), as a session
manager's close() does while a caller holds its lock: the open rooms fail, the error log names the stuck
holder, and the room the stuck send published, once its exporter returned, fails, and the pool's thread
then closes its sockets.

Real Mooncake engines (tcp on loopback), a real bootstrap server and real ZMQ sockets."""

from __future__ import annotations

import threading
import time

import torch
from live_helpers import HOST, LIVE, port_rebindable, wait_until

from transfer.metrics import Metrics
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
CLOSE_TIMEOUT_S = 2.0
WAIT_S = 10.0


class Hanging(Metrics):
    """The caller's metrics, whose exporter hangs counting `counter` once armed, until let go."""

    def __init__(self, prefix: str, counter: str) -> None:
        super().__init__(prefix)
        self.counter = counter
        self.armed = False
        self.inside = threading.Event()
        self.go = threading.Event()

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        if self.armed and name == self.counter:
            self.armed = False
            self.inside.set()
            self.go.wait(60)
        super().inc(name, amount, **labels)


def test_a_pool_closes_within_its_bound_while_a_send_is_stuck_in_the_callers_exporter(engines, server, caplog):
    encode, _ = engines
    metrics = Hanging("epd_encode", "rooms_started_total")
    pool = SenderPool(encode, 0, 1, 1, server.address, host=HOST, metrics=metrics, close_timeout_s=CLOSE_TIMEOUT_S)
    first = pool.send(1, torch.ones(SPAN, HIDDEN, dtype=torch.bfloat16))
    metrics.armed = True
    src = torch.ones(SPAN, HIDDEN, dtype=torch.bfloat16)
    sent: list = []
    stuck = threading.Thread(target=lambda: sent.append(pool.send(2, src)), daemon=True)
    stuck.start()
    try:
        assert metrics.inside.wait(WAIT_S)
        closing = threading.Thread(target=pool.close, daemon=True)
        started = time.monotonic()
        closing.start()
        closing.join(CLOSE_TIMEOUT_S + 3.0)
        took = time.monotonic() - started
        assert not closing.is_alive(), f"close() still waiting after {took:.1f}s (close_timeout_s {CLOSE_TIMEOUT_S}s)"
        assert first.poll() == TransferPoll.Failed and "held its room book" in first.failure, first.failure
        assert any("a thread held its room book" in r.getMessage() for r in caplog.records)
    finally:
        metrics.go.set()
    stuck.join(WAIT_S)
    # The stuck send's room, published once its exporter returned, is failed, and the thread closes.
    [handle] = sent
    assert handle.poll() == TransferPoll.Failed
    assert wait_until(lambda: not pool._driver.thread.is_alive(), WAIT_S)
    assert port_rebindable(HOST, pool.port)
    handle.clear()
    first.clear()

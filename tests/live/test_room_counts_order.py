"""A room is counted started before its conclusion is counted, on both sides, so that no snapshot or
scrape, taken at any moment, shows more rooms concluded than started."""

from __future__ import annotations

import threading

from live_helpers import HOST, wait_until

from transfer.core.failure import FailureKind
from transfer.metrics import Metrics
from transfer.status import TransferPoll


class CheckedMetrics(Metrics):
    """Metrics that note each increment after which rooms concluded outnumber rooms started."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.counts = {"rooms_started_total": 0, "rooms_succeeded_total": 0, "rooms_failed_total": 0}
        self.inconsistent: list[dict[str, int]] = []
        self._counts_lock = threading.Lock()

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        super().inc(name, amount, **labels)
        if amount and name in self.counts:
            with self._counts_lock:
                self.counts[name] += 1
                if self.counts["rooms_succeeded_total"] + self.counts["rooms_failed_total"] > \
                        self.counts["rooms_started_total"]:
                    self.inconsistent.append(dict(self.counts))


def test_a_room_that_fails_within_receive_was_counted_started_first(engines, server):
    import torch

    from transfer.bootstrap import BootstrapClient
    from transfer.receiver import SessionManager

    _, prefill_engine = engines
    # An encode side of tensor-parallel size 2 and a prefill side of 1: once the sizes are known, a room
    # fails (geometry) inside receive() itself.
    BootstrapClient(server.address).register_rank(2, 1, HOST, 1, 0, retry_for=5)
    buf = torch.zeros((2, 4, 16), dtype=torch.bfloat16)
    metrics = CheckedMetrics("epd_prefill")
    with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=10.0, metrics=metrics) as manager:
        for room in (1, 2):
            handle = manager.receive(room, server.address, buf[room - 1])
            assert handle.wait(10) == TransferPoll.Failed
            assert handle.failure_kind is FailureKind.GEOMETRY, handle.failure
            handle.clear()
    assert metrics.counts == {"rooms_started_total": 2, "rooms_succeeded_total": 0, "rooms_failed_total": 2}
    assert metrics.inconsistent == []


class WaitingMetrics(CheckedMetrics):
    """Counts a room started only once its send has concluded, or after a while when it cannot conclude
    before being counted: what a sending thread descheduled right after handing the item over does."""

    table = None

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        if name == "rooms_started_total" and amount and self.table is not None:
            table = self.table
            wait_until(lambda: table.get(5) in (TransferPoll.Success, TransferPoll.Failed), 2)
        super().inc(name, amount, **labels)


def test_a_send_that_concludes_at_once_was_counted_started_first(engines, server):
    import torch

    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool

    encode_engine, prefill_engine = engines
    item = torch.randn(8, 16).to(torch.bfloat16)
    encode_engine.register(item)
    buf = torch.zeros((4, 16), dtype=torch.bfloat16)
    metrics = WaitingMetrics("epd_encode")
    try:
        with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, metrics=metrics) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=10.0) as manager:
            # The prefill rank asks for 4 rows first; the item sent has 8, so the room fails (geometry) as soon
            # as the encode rank's thread files the item.
            handle = manager.receive(5, server.address, buf)
            assert wait_until(lambda: sender._core.parked.get(5) is not None, 10)
            metrics.table = sender._table
            sent = sender.send(5, item)
            assert sent.wait(10) == TransferPoll.Failed
            assert handle.wait(10) == TransferPoll.Failed
            sent.clear()
            handle.clear()
    finally:
        encode_engine.unregister(item.data_ptr())
    assert metrics.counts["rooms_started_total"] == 1 and metrics.counts["rooms_failed_total"] == 1
    assert metrics.inconsistent == []

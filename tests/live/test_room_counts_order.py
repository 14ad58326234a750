"""A room is counted started before its conclusion is counted, on both sides, so that no snapshot or
scrape, taken at any moment, shows more rooms concluded than started; on the encode side before the pool's
thread is handed the item at all, so nothing of the room (a write queued, written or concluded) comes first."""

from __future__ import annotations

import threading
from collections.abc import Callable

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
        self._count({name: amount})

    def inc_all(self, amounts: dict[str, float], observations: dict[str, float] | None = None) -> None:
        super().inc_all(amounts, observations)
        self._count(amounts)

    def _count(self, amounts: dict[str, float]) -> None:
        with self._counts_lock:
            for name, amount in amounts.items():
                if amount and name in self.counts:
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


class QueueWatchingMetrics(Metrics):
    """Counts a room started only once the pool's thread has queued its write (what the queue_depth gauge
    reads), or after a while when it cannot have before the room is counted: what a sending thread
    descheduled right after handing the item over does. Notes each write it saw queued first."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.queue_depth: Callable[[], int] | None = None
        self.queued_before_started: list[int] = []

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        # The gauge's own reading: a whole scrape would wait for send() (parked_rooms reads under its lock).
        depth = self.queue_depth
        if name == "rooms_started_total" and amount and depth is not None:
            if wait_until(lambda: depth() > 0, 2):
                self.queued_before_started.append(depth())
        super().inc(name, amount, **labels)


class HeldEvent:
    """A ready event that completes when the test says so."""

    done = False

    def query(self) -> bool:
        return self.done


def test_a_sent_rooms_writes_are_queued_only_once_it_was_counted_started(engines, server):
    import torch

    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool

    encode_engine, prefill_engine = engines
    item = torch.randn(8, 16).to(torch.bfloat16)
    encode_engine.register(item)
    buf = torch.zeros((8, 16), dtype=torch.bfloat16)
    metrics = QueueWatchingMetrics("epd_encode")
    ready = HeldEvent()
    try:
        with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, metrics=metrics) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=10.0) as manager:
            # The prefill rank asks first: the item, once the encode rank's thread has it, completes the fanout
            # and its write waits in the queue for its ready event.
            handle = manager.receive(5, server.address, buf)
            assert wait_until(lambda: sender._core.parked.get(5) is not None, 10)
            metrics.queue_depth = lambda: sender._core.waiting
            sent = sender.send(5, item, ready_event=ready)
            metrics.queue_depth = None
            assert wait_until(lambda: sender._core.waiting == 1, 10)  # its write waits for its ready event
            ready.done = True
            assert sent.wait(10) == TransferPoll.Success
            assert handle.wait(10) == TransferPoll.Success
            assert torch.equal(buf, item)
            sent.clear()
            handle.clear()
    finally:
        encode_engine.unregister(item.data_ptr())
    assert metrics.queued_before_started == []

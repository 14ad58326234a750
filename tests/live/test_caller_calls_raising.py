"""A caller-facing call that raises after it changed state leaves nothing held for the caller to lose:
send() and receive() that raise leave the room number free and the item's sources or pool slot let go
of, and a clear() that raises still forgets the room and gives its slot back.

Real Mooncake engines (tcp on loopback), a real bootstrap server and real ZMQ sockets. The errors come
from the caller's own Metrics, whose inc() of one counter raises; the one after send() queued its item
is a KeyboardInterrupt played at a point where a signal may land (no error of the library's own raises
there).
"""

from __future__ import annotations

import pytest
import torch
from live_helpers import HOST, LIVE, item_tensor, wait_until

from transfer.buffers import ReceivePool
from transfer.metrics import Metrics, total
from transfer import receiver
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
SLOT = SPAN * HIDDEN * 2  # bfloat16
WAIT_S = 10.0


class Refusing(Metrics):
    """The caller's metrics, whose exporter refuses to count `counter` once armed (as one whose backend is
    down might): inc() of it raises before counting."""

    def __init__(self, prefix: str, counter: str) -> None:
        super().__init__(prefix)
        self.counter = counter
        self.armed = False

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        if self.armed and name == self.counter:
            raise ExporterDown(f"cannot count {name}")
        super().inc(name, amount, **labels)


class ExporterDown(Exception):
    pass


def _registered(engine, tensor: torch.Tensor) -> bool:
    addr = tensor.data_ptr()
    return any(base <= addr < base + size for base, size in engine.registered().items())


def test_a_send_whose_count_raises_leaves_the_room_free_and_its_source_unregistered(engines, server):
    encode, _ = engines
    src = item_tensor(1, SPAN, HIDDEN)
    metrics = Refusing("epd_encode", "rooms_started_total")
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST, metrics=metrics) as pool:
        metrics.armed = True
        for _ in range(2):  # the second call meets the same error, not a room still being sent
            with pytest.raises(ExporterDown):
                pool.send(1, src)
            assert wait_until(lambda: not _registered(encode, src), WAIT_S)  # on the pool thread's next turn
        assert pool.concluded() == [] and pool._book.held == {}


def test_a_send_interrupted_after_queueing_its_item_fails_it_and_frees_the_room(engines, server, monkeypatch):
    encode, prefill = engines
    src = item_tensor(1, SPAN, HIDDEN)
    dst = torch.zeros(SPAN, HIDDEN, dtype=torch.bfloat16)
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool, \
            SessionManager(prefill, 0, 1, 1, buffer=dst, host=HOST, deadline_s=30) as manager:
        offer = pool._driver.offer

        def interrupted(item):
            offer(item)
            raise KeyboardInterrupt

        monkeypatch.setattr(pool._driver, "offer", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pool.send(1, src)
        monkeypatch.undo()
        # The driver failed the queued item and let go of its source; the room counts failed, naming why.
        assert wait_until(lambda: not _registered(encode, src), WAIT_S)
        snapshot = pool.stats()
        assert total(snapshot, "epd_encode_rooms_started_total") == 1
        assert total(snapshot, "epd_encode_rooms_failed_total", reason="other") == 1
        assert pool.concluded() == []  # nobody holds a handle to hear of it
        # The room number is free: sent again, it is served.
        received = manager.receive(1, server.address, dst)
        sent = pool.send(1, src)
        assert received.wait(WAIT_S) == TransferPoll.Success, received.failure
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
        assert wait_until(lambda: sent.poll() == TransferPoll.Success, WAIT_S)
        sent.clear()
        received.clear()


def test_a_send_interrupted_after_queueing_its_item_raises_the_interrupt_though_the_failures_count_raises(
        engines, server, monkeypatch):
    # The withdrawn room's conclusion counts as failed, and the exporter refuses that count: the caller still
    # gets the stop signal's exception (which its handler waits for), not the count's, and the room is free.
    encode, _ = engines
    src = item_tensor(1, SPAN, HIDDEN)
    metrics = Refusing("epd_encode", "rooms_failed_total")
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST, metrics=metrics) as pool:
        offer = pool._driver.offer

        def interrupted(item):
            offer(item)
            raise KeyboardInterrupt

        monkeypatch.setattr(pool._driver, "offer", interrupted)
        metrics.armed = True
        with pytest.raises(KeyboardInterrupt):
            pool.send(1, src)
        monkeypatch.undo()
        assert pool._book.held == {}
        assert wait_until(lambda: not _registered(encode, src), WAIT_S)
        metrics.armed = False


def test_an_encode_clear_whose_count_raises_still_frees_the_room(engines, server):
    encode, _ = engines
    src = item_tensor(1, SPAN, HIDDEN)
    metrics = Refusing("epd_encode", "rooms_failed_total")
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST, metrics=metrics) as pool:
        metrics.armed = True
        handle = pool.send(1, src)
        with pytest.raises(ExporterDown):
            handle.clear()  # unconcluded: it concludes Failed (cleared), which counts
        assert handle.poll() == TransferPoll.Failed
        assert pool._book.held == {}
        assert wait_until(lambda: not _registered(encode, src), WAIT_S)
        again = pool.send(1, src)  # not "already being sent"
        assert again.poll() == TransferPoll.WaitingForInput
        with pytest.raises(ExporterDown):
            again.clear()


def test_a_receive_whose_count_raises_leaves_the_room_free_and_gives_its_slot_back(engines, server):
    _, prefill = engines
    metrics = Refusing("epd_prefill", "rooms_started_total")
    with ReceivePool(prefill, 2 * SLOT, SLOT) as slots, \
            SessionManager(prefill, 0, 1, 1, pool=slots, host=HOST, deadline_s=30, metrics=metrics) as manager:
        metrics.armed = True
        for _ in range(2):  # the second call meets the same error, not a room number still held
            with pytest.raises(ExporterDown):
                manager.receive(1, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
            assert slots.stats()["leased"] == 0
        assert manager._driver.rooms == {} and manager.concluded() == []


def test_a_prefill_clear_whose_count_raises_still_forgets_the_room_and_gives_its_slot_back(engines, server):
    _, prefill = engines
    metrics = Refusing("epd_prefill", "rooms_failed_total")
    with ReceivePool(prefill, 2 * SLOT, SLOT) as slots, \
            SessionManager(prefill, 0, 1, 1, pool=slots, host=HOST, deadline_s=30, metrics=metrics) as manager:
        metrics.armed = True
        handle = manager.receive(1, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
        assert slots.stats()["leased"] == 1
        with pytest.raises(ExporterDown):
            handle.clear()  # unconcluded: counted failed (cleared)
        assert manager._driver.rooms == {}
        assert slots.stats()["leased"] == 0  # freed, or quarantined until its cancel is confirmed
        again = manager.receive(1, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
        assert slots.stats()["leased"] == 1
        with pytest.raises(ExporterDown):
            again.clear()


def test_a_receive_interrupted_after_filing_its_room_forgets_it_and_gives_its_slot_back(engines, server, monkeypatch):
    _, prefill = engines
    with ReceivePool(prefill, 2 * SLOT, SLOT) as slots, \
            SessionManager(prefill, 0, 1, 1, pool=slots, host=HOST, deadline_s=30) as manager:
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(receiver, "ReceiveHandle", interrupted)
        with pytest.raises(KeyboardInterrupt):
            manager.receive(1, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
        monkeypatch.undo()
        assert manager._driver.rooms == {} and slots.stats()["leased"] == 0
        snapshot = manager.stats()
        assert total(snapshot, "epd_prefill_rooms_started_total") == 1
        assert total(snapshot, "epd_prefill_rooms_failed_total", reason="cleared") == 1
        again = manager.receive(1, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
        assert slots.stats()["leased"] == 1
        again.clear()
    assert slots.stats()["leased"] == 0

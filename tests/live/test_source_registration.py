"""A send() that registers its source on the caller's thread holds up no other room."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import weakref

import numpy
import pytest
import torch
from live_helpers import HOST, LIVE, bootstrap_server, item_tensor, wait_until

from transfer.drive import encode as drive
from transfer.drive.encode import DROP_BATCH, RETRY_RELEASES_S
from transfer.engine import Engine, EngineError
from transfer.core.failure import FailureKind
from transfer.errors import ConfigError
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64


def test_a_room_is_served_while_another_send_is_registering_its_source(engines, server, monkeypatch):
    encode, prefill = engines
    slots = torch.zeros(1, SPAN, HIDDEN, dtype=torch.bfloat16)
    rows = item_tensor(1, SPAN, HIDDEN)
    big = torch.zeros(1024, HIDDEN, dtype=torch.bfloat16)  # not registered: its send() registers it
    registering, may_finish = threading.Event(), threading.Event()
    register = encode.register

    def slow_register(buf, length=None):
        if isinstance(buf, torch.Tensor) and buf.data_ptr() == big.data_ptr():
            registering.set()
            may_finish.wait(30.0)  # a large source pinned over RDMA
        return register(buf, length)

    encode.register(rows, rows.numel() * rows.element_size())
    try:
        with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool, \
                SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST) as manager:
            pool.send(1, rows)
            monkeypatch.setattr(encode, "register", slow_register)
            sender = threading.Thread(target=pool.send, args=(9, big), daemon=True)
            sender.start()
            try:
                assert registering.wait(10.0)
                time.sleep(2 * RETRY_RELEASES_S)  # the driver's retry of kept registrations comes due
                handle = manager.receive(1, server.address, slots[0])
                assert handle.wait(10.0) == TransferPoll.Success, handle.failure
                assert torch.equal(slots[0].view(torch.uint8), rows.view(torch.uint8))
            finally:
                may_finish.set()
                sender.join(10.0)
            assert not sender.is_alive()
    finally:
        monkeypatch.undo()
        encode.unregister(rows.data_ptr())


@contextlib.contextmanager
def _two_pools(engines, server, slots: torch.Tensor):
    """Two sender pools on one encode engine (registered at `server` and at a second bootstrap server),
    and a session manager receiving into `slots`: (first, second, its bootstrap address, manager)."""
    encode, prefill = engines
    with bootstrap_server(token=None) as other, \
            SenderPool(encode, 0, 1, 1, server.address, host=HOST) as first, \
            SenderPool(encode, 0, 1, 1, other.address, host=HOST) as second, \
            SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST) as manager:
        yield first, second, other.address, manager


def test_a_source_two_pools_on_one_engine_send_stays_registered_until_both_are_done(engines, server):
    # The first pool registers the source; the second finds it registered. The first room's
    # clear must not unregister it under the second room, whose receiver has not asked yet.
    encode, _ = engines
    slots = torch.zeros(2, SPAN, HIDDEN, dtype=torch.bfloat16)
    rows = item_tensor(1, SPAN, HIDDEN)  # not registered: the first send() registers it
    with _two_pools(engines, server, slots) as (first, second, other, manager):
        sent_first = first.send(1, rows)
        sent_second = second.send(2, rows)
        received = manager.receive(1, server.address, slots[0])
        assert received.wait(10.0) == TransferPoll.Success, received.failure
        received.clear()
        sent_first.clear()
        time.sleep(1.0)  # an idle pool's thread lets go of a cleared room's item within half a second
        assert rows.data_ptr() in encode.registered(), "the first pool unregistered a source the second still sends"
        received = manager.receive(2, other, slots[1])
        assert received.wait(10.0) == TransferPoll.Success, received.failure
        assert torch.equal(slots[1].view(torch.uint8), rows.view(torch.uint8))
        received.clear()
        sent_second.clear()
    assert rows.data_ptr() not in encode.registered()  # both pools closed: nothing holds it


def _in_mooncake(engine: Engine, tensor: torch.Tensor) -> bool:
    """Whether Mooncake itself has memory of `tensor`'s storage registered: it refuses to register
    it again (-7, an overlap) while it does."""
    storage = tensor.untyped_storage()
    if engine._te.register_memory(storage.data_ptr(), storage.nbytes()) != 0:
        return True
    assert engine._te.unregister_memory(storage.data_ptr()) == 0
    return False


def _break_the_thread(pool: SenderPool) -> None:
    """The pool's thread fails on the next item it files."""

    def broken(offer, now):
        raise RuntimeError("injected")

    pool._core.offer = broken


def test_the_source_of_a_write_a_closing_pool_abandoned_is_dropped_by_a_later_pool_once_the_write_is_over(
        engines, server, monkeypatch):
    """A close that gives up on a write still in flight keeps its source registered (the engine may still read
    it). Nothing polls that write again: a later pool on the engine drops the registration once the engine says
    the write is over, where it stayed for the engine's life."""
    encode, prefill = engines
    slots = torch.zeros(1, SPAN, HIDDEN, dtype=torch.bfloat16)
    rows = item_tensor(1, SPAN, HIDDEN)  # not registered: its send() registers it
    poll, slow = encode.poll, threading.Event()
    slow.set()
    # The write is slower than the close: the closing pool sees it in flight throughout.
    monkeypatch.setattr(encode, "poll", lambda ticket: False if slow.is_set() else poll(ticket))
    with SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST) as manager:
        pool = SenderPool(encode, 0, 1, 1, server.address, host=HOST, close_timeout_s=1.0)
        try:
            handle = pool.send(1, rows)
            received = manager.receive(1, server.address, slots[0])
            assert wait_until(lambda: "submitted" in handle.stages, 10.0)
        finally:
            pool.close()
        assert handle.poll() == TransferPoll.Failed and "write still in flight" in handle.failure
        assert rows.data_ptr() in encode.registered(), "unregistered while the engine may still read it"
        received.wait(10.0)
        received.clear()
        slow.clear()
        with SenderPool(encode, 0, 1, 1, server.address, host=HOST):
            assert wait_until(lambda: rows.data_ptr() not in encode.registered(), 10.0), \
                "the abandoned write's source stayed registered once the write was over"
            assert not _in_mooncake(encode, rows)


@pytest.mark.driver_dies
def test_a_pool_whose_thread_fails_lets_go_of_the_sources_its_rooms_held(engines, server):
    encode, _ = engines
    filed, lost = item_tensor(1, SPAN, HIDDEN), item_tensor(2, SPAN, HIDDEN)  # each send() registers its own
    pool = SenderPool(encode, 0, 1, 1, server.address, host=HOST)
    try:
        first = pool.send(1, filed)
        assert wait_until(lambda: 1 in pool._core.rooms(), 5.0)  # the thread filed it: it waits for its asks
        _break_the_thread(pool)
        second = pool.send(2, lost)  # the thread fails on this one
        assert second.wait(5.0) == TransferPoll.Failed and first.wait(5.0) == TransferPoll.Failed
        assert wait_until(lambda: not pool._thread.is_alive(), 5.0)
        for source in (filed, lost):
            assert source.data_ptr() not in encode.registered()
            assert not _in_mooncake(encode, source), "a failed pool's source stayed registered with Mooncake"
        assert pool._sources.holding == 0 and pool._sources.counts.counts() == {}
        first.clear()
        second.clear()
    finally:
        pool.close()
    assert not any(source.data_ptr() in encode.registered() or _in_mooncake(encode, source) for source in (filed, lost))


def test_a_pool_whose_thread_failed_keeps_nothing_of_rooms_cleared_after(engines, server, monkeypatch):
    # Items the thread never filed (its room rules raising on each) and clears that come after it
    # stopped: nothing may stay queued for a thread that is gone, holding an item's memory or source.
    encode, _ = engines
    # The test's log capture would keep the tracebacks logged, and the items their frames hold.
    monkeypatch.setattr(logging.getLogger("transfer.sender"), "disabled", True)
    arrays = [numpy.zeros((SPAN, HIDDEN), dtype=numpy.float32) for _ in range(4)]
    memory = [weakref.ref(array) for array in arrays]  # the source tensors share it, and keep it alive
    pool = SenderPool(encode, 0, 1, 1, server.address, host=HOST)
    try:
        every_item_sent = threading.Event()

        def broken(offer, now):
            every_item_sent.wait(5.0)  # the other items wait in the thread's queue meanwhile
            raise RuntimeError("injected")

        pool._core.offer = broken
        handles = [pool.send(room, torch.from_numpy(array)) for room, array in enumerate(arrays, 1)]
        every_item_sent.set()
        assert all(handle.wait(5.0) == TransferPoll.Failed for handle in handles)
        assert wait_until(lambda: not pool._thread.is_alive(), 5.0)
        for handle in handles:
            handle.clear()
        assert not pool._driver.commands, "commands queued for a thread that is gone"
        assert pool._sources.holding == 0 and pool._sources.counts.counts() == {}
        del arrays, handles
        gc.collect()
        assert [ref() is None for ref in memory] == [True] * 4, "the pool still holds an item's memory"
    finally:
        pool.close()


@pytest.mark.driver_dies
def test_a_pool_whose_thread_fails_leaves_a_source_another_pool_sends_registered(engines, server):
    encode, _ = engines
    slots = torch.zeros(1, SPAN, HIDDEN, dtype=torch.bfloat16)
    rows = item_tensor(3, SPAN, HIDDEN)  # not registered: the first send() registers it
    with _two_pools(engines, server, slots) as (failing, serving, other, manager):
        _break_the_thread(failing)
        lost = failing.send(1, rows)
        sent = serving.send(2, rows)
        assert lost.wait(5.0) == TransferPoll.Failed
        assert wait_until(lambda: not failing._thread.is_alive(), 5.0)
        assert serving._sources.counts.counts().get(rows.data_ptr()) == 1  # the failed pool's hold went, once
        assert rows.data_ptr() in encode.registered() and _in_mooncake(encode, rows)
        received = manager.receive(2, other, slots[0])
        assert received.wait(10.0) == TransferPoll.Success, received.failure
        assert torch.equal(slots[0].view(torch.uint8), rows.view(torch.uint8))
        received.clear()
        sent.clear()
        lost.clear()
        # An idle pool's thread lets go of a cleared room's item within half a second.
        assert wait_until(lambda: rows.data_ptr() not in encode.registered(), 5.0)
        assert not _in_mooncake(encode, rows)


class _SlowRegistrations:
    """Mooncake's TransferEngine, whose registrations wait for `may_finish` (pinning a large region)."""

    def __init__(self, te) -> None:
        self._te = te
        self.registering, self.may_finish = threading.Event(), threading.Event()

    def batch_register_memory(self, addrs: list[int], sizes: list[int]) -> int:
        self.registering.set()
        self.may_finish.wait(30.0)
        return self._te.batch_register_memory(addrs, sizes)

    def __getattr__(self, name: str):
        return getattr(self._te, name)


def test_an_engine_writes_while_it_registers_another_region_and_closes_once_that_is_done(engines):
    _, prefill = engines
    encode = Engine(HOST, "tcp")  # closed by the test
    source = item_tensor(1, SPAN, HIDDEN)
    landing = torch.zeros_like(source)
    encode.register(source)
    prefill.register(landing)
    big = torch.zeros(1024, HIDDEN, dtype=torch.bfloat16)
    slow = encode._te = _SlowRegistrations(encode._te)
    refused: list[str] = []

    def register_big() -> None:
        try:
            encode.register(big)
        except EngineError as exc:
            refused.append(str(exc))

    registering = threading.Thread(target=register_big, daemon=True)
    closing = threading.Thread(target=encode.close, daemon=True)
    registering.start()
    try:
        assert slow.registering.wait(10.0)
        encode.write(prefill.session_id, [source.data_ptr()], [landing.data_ptr()], [source.nbytes])
        assert torch.equal(landing.view(torch.uint8), source.view(torch.uint8))
        assert big.data_ptr() not in encode.registered()  # not until Mooncake has it
        closing.start()
        closing.join(0.5)
        assert closing.is_alive(), "close() did not wait for the registration under way"
    finally:
        slow.may_finish.set()
        registering.join(10.0)
        if closing.ident is None:  # failed before closing
            encode.close()
        closing.join(10.0)
        prefill.unregister(landing.data_ptr())
    assert not closing.is_alive() and not registering.is_alive()
    assert encode.registered() == {}  # the region registered meanwhile went with the engine
    assert len(refused) == 1 and "closed meanwhile" in refused[0], refused


def test_items_waiting_for_their_receivers_each_in_a_temporary_registration_land_exactly(engines, server):
    """Hundreds of items sent from unregistered tensors before any receiver asks (each in a registration of its
    own): the engine finds each source, and each item's rows land, by address; every temporary registration goes
    once its room is over."""
    encode, prefill = engines
    rooms = 300
    items = [item_tensor(room, SPAN, HIDDEN) for room in range(1, rooms + 1)]
    before = encode.registered()
    found = [encode.registration_holding(item.data_ptr() + 16, 32) for item in items[:3]]
    assert found == [None, None, None]
    slots = torch.zeros(rooms, SPAN, HIDDEN, dtype=torch.bfloat16)
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool, \
            SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST) as manager:
        sends = [pool.send(room, item) for room, item in enumerate(items, 1)]
        nbytes = SPAN * HIDDEN * 2
        for item in items:
            assert encode.registration_holding(item.data_ptr() + 16, 32) == (item.data_ptr(), nbytes)
            assert encode.registration_overlapping(item.data_ptr() - 8, 16) == (item.data_ptr(), nbytes)
        asks = [manager.receive(room, server.address, slots[room - 1]) for room in range(1, rooms + 1)]
        for room, (send, ask) in enumerate(zip(sends, asks), 1):
            assert ask.wait(30.0) == TransferPoll.Success, ask.failure
            assert send.wait(30.0) == TransferPoll.Success, send.failure
            assert torch.equal(slots[room - 1].view(torch.uint8), items[room - 1].view(torch.uint8)), room
            ask.clear()
            send.clear()
        assert wait_until(lambda: encode.registered() == before, 10.0)
        assert all(encode.registration_holding(item.data_ptr(), 1) is None for item in items)


class _CountedUnregistrations:
    """Mooncake's TransferEngine, counting its unregistration calls (and the addresses each named); each address
    unregistered takes `cost_s` more (deregistering a region over RDMA)."""

    def __init__(self, te, cost_s: float = 0.0) -> None:
        self._te = te
        self.cost_s = cost_s
        self.calls: list[tuple[str, int]] = []

    def unregister_memory(self, addr: int) -> int:
        self.calls.append(("unregister_memory", 1))
        time.sleep(self.cost_s)
        return self._te.unregister_memory(addr)

    def batch_unregister_memory(self, addrs: list[int]) -> int:
        self.calls.append(("batch_unregister_memory", len(addrs)))
        time.sleep(self.cost_s * len(addrs))
        return self._te.batch_unregister_memory(addrs)

    def __getattr__(self, name: str):
        return getattr(self._te, name)


def test_a_duplicate_send_of_a_room_is_refused_before_its_source_is_registered(engines, server, monkeypatch):
    """Registering a source is slow over RDMA: a send() the room book refuses must not pay for one first."""
    encode, _ = engines
    registering: list[int] = []
    register = encode.register

    def counted(buf, length=None):
        registering.append(buf.data_ptr() if isinstance(buf, torch.Tensor) else buf)
        return register(buf, length)

    monkeypatch.setattr(encode, "register", counted)
    first, second = item_tensor(1, SPAN, HIDDEN), item_tensor(2, SPAN, HIDDEN)
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool:
        handle = pool.send(1, first)
        assert registering == [first.data_ptr()]
        with pytest.raises(ConfigError, match="room 1 is already being sent; clear\\(\\) it first"):
            pool.send(1, second)
        assert registering == [first.data_ptr()], "the refused send registered its source"
        assert encode.registration_holding(second.data_ptr(), 1) is None
        handle.clear()


def _waiting_items(count: int) -> list[torch.Tensor]:
    """`count` items outside registered memory, each its own tensor (its send registers it alone)."""
    return [torch.zeros(SPAN, HIDDEN, dtype=torch.bfloat16) for _ in range(count)]


def test_closing_a_pool_with_thousands_of_rooms_waiting_drops_their_registrations_in_batches(
        engines, server, monkeypatch):
    """Thousands of items waiting for receivers that never asked, each in a temporary registration: close fails
    every room, naming why, and drops every registration with a few of Mooncake's batch calls, not one call each
    (each rewrites the engine's segment description: 20,000 took seconds of the pool's thread)."""
    encode, _ = engines
    before = encode.registered()
    items = _waiting_items(3000)
    pool = SenderPool(encode, 0, 1, 1, server.address, host=HOST)
    try:
        handles = [pool.send(room, item) for room, item in enumerate(items, 1)]
        counted = _CountedUnregistrations(encode._te)
        monkeypatch.setattr(encode, "_te", counted)
    finally:
        pool.close()
    assert not pool._thread.is_alive()
    assert [handle.poll() for handle in handles] == [TransferPoll.Failed] * len(items)
    assert {(handle.failure_kind, handle.failure) for handle in handles} == {(FailureKind.CLOSED, "sender pool closed")}
    assert encode.registered() == before
    assert [name for name, _ in counted.calls] == ["batch_unregister_memory"] * len(counted.calls)
    assert sum(n for _, n in counted.calls) == len(items) and len(counted.calls) <= len(items) // DROP_BATCH + 1


def test_clearing_thousands_of_waiting_rooms_drops_their_registrations_in_batches(engines, server, monkeypatch):
    encode, _ = engines
    before = encode.registered()
    items = _waiting_items(3000)
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool:
        handles = [pool.send(room, item) for room, item in enumerate(items, 1)]
        counted = _CountedUnregistrations(encode._te)
        monkeypatch.setattr(encode, "_te", counted)
        for handle in handles:
            handle.clear()
        assert wait_until(lambda: encode.registered() == before, 60.0)
    # Every registration dropped, in few engine calls: a driver turn that took a lone clear drops its one
    # registration with unregister_memory, which a loaded host makes happen now and then.
    assert sum(n for _, n in counted.calls) == len(items), counted.calls
    assert len(counted.calls) <= len(items) // 10, counted.calls
    assert any(name == "batch_unregister_memory" for name, _ in counted.calls), counted.calls


def test_a_close_that_cannot_drop_every_registration_in_time_concludes_its_rooms_and_leaves_the_rest_to_the_engine(
        engines, server, monkeypatch, caplog):
    """Unregistering slowly (RDMA), a close with thousands of rooms waiting kept its thread past close_timeout_s,
    which logged it stuck inside an engine call: it now stops dropping registrations in time, concludes every room
    with its reason, and the next pool on the engine drops the registrations left."""
    encode, _ = engines
    before = encode.registered()
    monkeypatch.setattr(drive, "DROP_BATCH", 64)
    items = _waiting_items(2000)
    pool = SenderPool(encode, 0, 1, 1, server.address, host=HOST, close_timeout_s=1.0)
    try:
        handles = [pool.send(room, item) for room, item in enumerate(items, 1)]
        monkeypatch.setattr(encode, "_te", _CountedUnregistrations(encode._te, cost_s=1e-3))
    finally:
        with caplog.at_level(logging.INFO, logger="transfer.sender"):
            pool.close()
    assert not pool._thread.is_alive(), "close() returned with its thread still dropping registrations"
    assert not [m for m in caplog.messages if "stuck" in m or "still inside an engine call" in m]
    assert [handle.poll() for handle in handles] == [TransferPoll.Failed] * len(items)
    assert {(handle.failure_kind, handle.failure) for handle in handles} == {(FailureKind.CLOSED, "sender pool closed")}
    left = len(encode.registered()) - len(before)
    assert left > 0
    [line] = [m for m in caplog.messages if "temporary source registrations no room holds" in m]
    assert f"closing left {left} temporary source registrations" in line
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST):  # the next pool on the engine
        assert wait_until(lambda: encode.registered() == before, 60.0)

"""The prefill caller reads statuses on its own thread: poll()/concluded() while it keeps
coming back, wait() while it waits, and the I/O thread once it has gone quiet.

Real Mooncake engines (tcp on loopback), a real bootstrap server and sender pool; the
landed bytes are checked in every case.
"""

from __future__ import annotations

import select
import threading
import time

import pytest
import torch
from live_helpers import HOST, LIVE, item_tensor, wait_until

from transfer.drive import prefill as drive
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64


def _record_status_threads(driver) -> list[str]:
    """Names the thread that fed each status to the core."""
    handled: list[str] = []
    status = driver.core.status

    def recording(*args, **kwargs):
        handled.append(threading.current_thread().name)
        return status(*args, **kwargs)

    driver.core.status = recording
    return handled


@pytest.fixture
def pair(engines, server):
    encode, prefill = engines
    slots = torch.zeros(4, SPAN, HIDDEN, dtype=torch.bfloat16)
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool, \
            SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST) as manager:
        yield pool, manager, slots, server.address


def test_a_caller_that_keeps_polling_reads_the_statuses_itself(pair, monkeypatch):
    """With the caller's lease long, the status that concludes the room is read by concluded()."""
    monkeypatch.setattr(drive, "CALLER_LEASE_S", 10.0)
    pool, manager, slots, bootstrap = pair
    handled = _record_status_threads(manager._driver)
    item = item_tensor(1, SPAN, HIDDEN)
    manager.concluded()  # the caller is here: the lease starts
    handle = manager.receive(1, bootstrap, slots[0])
    sent = pool.send(1, item)
    seen: list[int] = []
    deadline = time.monotonic() + 10
    while 1 not in seen and time.monotonic() < deadline:
        seen += manager.concluded()
        time.sleep(0.0005)
    assert seen == [1], seen
    assert handle.poll() == TransferPoll.Success, handle.failure
    assert torch.equal(slots[0].view(torch.uint8), item.view(torch.uint8)), "landed bytes differ"
    assert handled and set(handled) == {threading.current_thread().name}, handled
    assert sent.wait(5) == TransferPoll.Success


def test_a_caller_gone_quiet_has_its_rooms_concluded_by_the_io_thread(pair):
    """A caller that polls once and never again still sees the room concluded, by the I/O thread."""
    pool, manager, slots, bootstrap = pair
    handled = _record_status_threads(manager._driver)
    item = item_tensor(2, SPAN, HIDDEN)
    handle = manager.receive(2, bootstrap, slots[1])
    manager.concluded()
    pool.send(2, item)
    record = handle._state
    assert wait_until(lambda: record.concluded_at is not None, 10), "nobody read the status"
    assert handled and set(handled) == {f"epd-prefill-{manager._driver.engine_rank}"}, handled
    assert handle.poll() == TransferPoll.Success, handle.failure
    assert torch.equal(slots[1].view(torch.uint8), item.view(torch.uint8)), "landed bytes differ"


def test_wait_reads_and_verifies_on_the_waiting_thread(engines, server):
    """A waiting caller handles its room's status and checksum itself; the room lands intact."""
    encode, prefill = engines
    slots = torch.zeros(2, SPAN, HIDDEN, dtype=torch.bfloat16)
    item = item_tensor(3, SPAN, HIDDEN)
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST, integrity=True) as pool, \
            SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST, integrity=True) as manager:
        driver = manager._driver
        handled = _record_status_threads(driver)
        verified: list[str] = []
        verify = driver._verify
        driver._verify = lambda v: (verified.append(threading.current_thread().name), verify(v))[1]
        handle = manager.receive(3, server.address, slots[0])
        pool.send(3, item)
        assert handle.wait(10) == TransferPoll.Success, handle.failure
        me = threading.current_thread().name
        assert handled and me in handled, handled
        assert verified == [me], verified
        assert torch.equal(slots[0].view(torch.uint8), item.view(torch.uint8)), "landed bytes differ"


def test_a_wait_whose_status_came_after_the_socket_was_read_empty_is_woken_by_it(pair):
    """A read that found the status socket empty leaves its descriptor to signal what comes since: a waiting
    caller whose status came meanwhile, unread, sleeps on the descriptor first and returns on it at once. The
    I/O thread reads nothing here, so the status is the waiting thread's to read."""
    pool, manager, slots, bootstrap = pair
    driver = manager._driver
    driver._drain_statuses = lambda: None  # the I/O thread leaves the socket alone
    handled = _record_status_threads(driver)
    item = item_tensor(6, SPAN, HIDDEN)
    handle = manager.receive(6, bootstrap, slots[0])
    time.sleep(2 * drive.PROGRESS_EVERY_S)
    manager.concluded()  # reads the socket to empty
    assert driver._drained
    sent = pool.send(6, item)
    assert sent.wait(10) == TransferPoll.Success, sent.failure
    poller = select.poll()
    poller.register(driver._status_fd, select.POLLIN)
    assert wait_until(lambda: bool(poller.poll(0)), 10.0), "the status socket's descriptor never signalled"
    assert driver._drained and handle._state.concluded_at is None  # nobody read it yet
    sleeps: list[list[tuple[int, int]]] = []  # what each of the waiting caller's sleeps returned
    watch_poller = driver._watch_poller

    class Recording:
        def poll(self, timeout_ms):
            sleeps.append(watch_poller.poll(timeout_ms))
            return sleeps[-1]

    driver._watch_poller = Recording()
    assert handle.wait(10) == TransferPoll.Success, handle.failure
    assert sleeps == [[(driver._status_fd, select.POLLIN)]], sleeps  # one sleep, ended by the status socket
    assert handled == [threading.current_thread().name], handled
    assert torch.equal(slots[0].view(torch.uint8), item.view(torch.uint8)), "landed bytes differ"


def test_two_waiters_both_see_their_rooms_concluded(pair):
    """One waiter reads the socket, the other waits for the conclusion; each room lands."""
    pool, manager, slots, bootstrap = pair
    items = {room: item_tensor(room, SPAN, HIDDEN) for room in (4, 5)}
    handles = {room: manager.receive(room, bootstrap, slots[i]) for i, room in enumerate(items)}
    results: dict[int, TransferPoll] = {}
    threads = [threading.Thread(target=lambda r=room: results.__setitem__(r, handles[r].wait(10)))
               for room in items]
    for thread in threads:
        thread.start()
    for room, item in items.items():
        pool.send(room, item)
    for thread in threads:
        thread.join(15)
    assert results == {4: TransferPoll.Success, 5: TransferPoll.Success}, results
    for i, item in enumerate(items.values()):
        assert torch.equal(slots[i].view(torch.uint8), item.view(torch.uint8)), "landed bytes differ"


def test_a_waiter_sees_a_deadline_reached_on_the_io_thread(engines, server):
    """A room nobody serves fails at its deadline, concluded by the I/O thread; its waiter returns Failed."""
    prefill = engines[1]
    slots = torch.zeros(1, SPAN, HIDDEN, dtype=torch.bfloat16)
    with SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST, deadline_s=0.3) as manager:
        handle = manager.receive(6, server.address, slots[0])  # no encode rank registered there
        assert handle.wait(30) == TransferPoll.Failed
        assert handle.failure_kind is not None
        assert torch.count_nonzero(slots[0]) == 0

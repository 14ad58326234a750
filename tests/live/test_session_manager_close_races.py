"""SessionManager.close() racing the work of other threads: a call the close overtook says the manager is
closed, whatever the shutdown does next, and leaves the pool's slots as they were; checksums taken before the
close do not hold its I/O thread past it.

Real Mooncake engines (tcp on loopback), real ZMQ sockets and a real bootstrap server. The interleavings are
forced: the receiving thread, once it read that the manager is open, waits there until the closing thread is
done (tests/live/lock_races.py); the statuses queue while the test holds the driver's lock.
"""

from __future__ import annotations

import time

import pytest
from live_helpers import HOST, LIVE

from lock_races import Race, pause_on_read, run_racers
from transfer.buffers import ReceivePool
from transfer.drive.prefill import MANAGER_CLOSED
from transfer.errors import UsageError
from transfer.receiver import SessionManager

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
SLOT = SPAN * HIDDEN * 2


@pytest.mark.parametrize("rows", [SPAN, 4 * SPAN], ids=["slot", "fallback"])
def test_a_pooled_receive_overtaken_by_close_then_the_pools_close_says_the_manager_is_closed(engines, server,
                                                                                           monkeypatch, rows):
    """The shutdown closes the manager, then its pool (the documented order), while the scheduler's receive()
    is past its look at the manager: receive() raises UsageError naming the closed manager, not the pool's
    SlotError, whose text blames the order of the closes."""
    _, prefill = engines
    before = prefill.registered()
    pool = ReceivePool(prefill, 2 * SLOT, SLOT)
    try:
        manager = SessionManager(prefill, 0, 1, 1, pool=pool, host=HOST, close_timeout_s=5.0)
        race = Race(patient={"receive"})
        pause_on_read(monkeypatch, SessionManager, "_closed", race)

        def shut_down() -> None:
            manager.close()
            pool.close()

        outcomes = run_racers(race, {
            "receive": lambda: manager.receive(1, server.address, rows=rows, hidden=HIDDEN, dtype="bfloat16"),
            "close": shut_down,
        })
        monkeypatch.undo()
        assert outcomes["close"] is None, outcomes
        raised = outcomes["receive"]
        assert isinstance(raised, UsageError) and str(raised) == MANAGER_CLOSED, repr(raised)
        stats = pool.stats()
        assert (stats["leased"], stats["fallbacks_live"]) == (0, 0), stats
    finally:
        pool.close()
    assert prefill.registered() == before


def test_a_pooled_receive_overtaken_by_close_gives_its_slot_back(engines, server, monkeypatch):
    """The same race with the pool left open: the slot receive() leased after the close is free again (no
    encode rank was asked for it), and the pool serves the next manager."""
    _, prefill = engines
    with ReceivePool(prefill, 2 * SLOT, SLOT) as pool:
        manager = SessionManager(prefill, 0, 1, 1, pool=pool, host=HOST, close_timeout_s=5.0)
        race = Race(patient={"receive"})
        pause_on_read(monkeypatch, SessionManager, "_closed", race)
        outcomes = run_racers(race, {
            "receive": lambda: manager.receive(1, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16"),
            "close": manager.close,
        })
        monkeypatch.undo()
        raised = outcomes["receive"]
        assert isinstance(raised, UsageError) and str(raised) == MANAGER_CLOSED, repr(raised)
        stats = pool.stats()
        assert (stats["free"], stats["leased"], stats["quarantined"]) == (2, 0, 0), stats
        with SessionManager(prefill, 0, 1, 1, pool=pool, host=HOST) as again:
            again.receive(1, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16").clear()


def test_close_during_a_backlog_of_checksums_stops_the_io_thread_after_the_one_under_way(engines, server, caplog):
    """Sixteen rooms' Successes are taken in one hold of the driver's lock, so the I/O thread has sixteen
    landed items to checksum; their checksums are slow (as on a slow device: each sleeps 0.5 s first).
    close() comes while the first runs: the rooms not checked yet fail as closed, and the I/O thread stops
    once the checksum under way ends, within close's bound, its sockets closed and no error logged. Checking
    the others first would hold the thread past the bound (15 x 0.5 s), which close() would take for a
    stuck thread: its rooms failed with no cancel sent, its status port left open until it ends."""
    import logging
    import threading

    import torch
    from live_helpers import item_tensor, port_rebindable, wait_until

    from transfer.core.failure import FailureKind
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll, is_terminal

    rooms, check_s, close_s = 16, 0.5, 3.0
    encode, prefill = engines
    caplog.set_level(logging.ERROR, logger="transfer.receiver")
    arena = torch.stack([item_tensor(room, SPAN, HIDDEN) for room in range(rooms)])
    encode.register(arena)
    try:
        with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as sender, \
                ReceivePool(prefill, rooms * SLOT, SLOT) as pool:
            manager = SessionManager(prefill, 0, 1, 1, pool=pool, host=HOST, close_timeout_s=close_s)
            driver = manager._driver
            checksum = driver._checksum
            entered, go = threading.Event(), threading.Event()

            def slow_checksum(region, addr, nbytes):
                entered.set()
                go.wait(30.0)
                time.sleep(check_s)
                return checksum(region, addr, nbytes)

            driver._checksum = slow_checksum
            handles = [manager.receive(room, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
                       for room in range(rooms)]
            assert wait_until(lambda: all(h.poll() == TransferPoll.WaitingForInput for h in handles), 10.0)
            with driver._lock:  # the statuses queue meanwhile, to be taken in one hold
                sent = [sender.send(room, arena[room]) for room in range(rooms)]
                assert wait_until(lambda: all(s.poll() == TransferPoll.Success for s in sent), 10.0)
                assert wait_until(lambda: driver._status_sock.poll(0), 10.0)
            assert entered.wait(10.0), "no checksum started"
            closer = threading.Thread(target=manager.close, name="test-close")
            closer.start()
            assert wait_until(lambda: driver._stopping, 10.0)
            go.set()
            closer.join(30.0)
            assert not closer.is_alive()
            stopped = [r.getMessage() for r in caplog.records if "did not stop" in r.getMessage()]
            assert not stopped, stopped
            assert not driver._thread.is_alive()
            assert port_rebindable(HOST, manager.status_port)
            assert all(is_terminal(h.poll()) for h in handles)
            failed = [h for h in handles if h.poll() == TransferPoll.Failed]
            assert len(failed) >= rooms - 1 and all(h.failure_kind is FailureKind.CLOSED for h in failed)
            for handle in handles:
                handle.clear()
            for handle in sent:
                handle.clear()
    finally:
        encode.unregister(arena.data_ptr())

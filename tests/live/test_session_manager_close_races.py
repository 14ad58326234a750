"""SessionManager.close() racing the calls of other threads: a call the close overtook says the manager is
closed, whatever the shutdown does next, and leaves the pool's slots as they were.

Real Mooncake engine (tcp on loopback), real ZMQ sockets and a real bootstrap server. The interleaving is
forced (tests/live/lock_races.py): the receiving thread, once it read that the manager is open, waits there
until the closing thread is done.
"""

from __future__ import annotations

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

"""SessionManager.close() returns within close_timeout_s: what is still busy then is left to end alone,
named once in the log, and memory a write may still land in is not handed out again.

Real Mooncake engines (tcp on loopback), a real bootstrap server for the encode rank that
answers, and a listener that accepts and never answers for the look-up that stalls.
"""

from __future__ import annotations

import logging
import socket
import threading

from live_helpers import HOST, LIVE, wait_until

from transfer.buffers import ReceivePool
from transfer.core.failure import FailureKind
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
SLOT = SPAN * HIDDEN * 2
LOOKUP_S = 60.0  # the stalled look-up's own timeout: far past the close's bound


def _lookup_threads(rank: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"epd-pre{rank}-boot")]


def test_close_leaves_a_look_up_still_waiting_for_its_server_and_keeps_an_asked_rooms_slot_back(engines, server,
                                                                                                 caplog):
    """A look-up stalled on a server that accepts and never answers would hold close() until its own
    timeout (60 s here); close_timeout_s=1 leaves it to end alone, logs it by its server, and still fails
    both rooms and settles their slots: the room never asked frees its slot, the room asked of an encode
    rank (that may still write) quarantines it."""
    encode, prefill = engines
    caplog.set_level(logging.ERROR, logger="transfer.receiver")
    with socket.socket() as silent:
        silent.bind((HOST, 0))
        silent.listen(16)  # the kernel accepts; nobody ever answers
        stalled = f"{HOST}:{silent.getsockname()[1]}"
        with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as sender, \
                ReceivePool(prefill, 2 * SLOT, SLOT) as pool:
            manager = SessionManager(prefill, 0, 1, 1, pool=pool, host=HOST, lookup_timeout_s=LOOKUP_S,
                                     close_timeout_s=1.0)
            looking = manager.receive(1, stalled, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
            asked = manager.receive(2, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
            # Asked of the encode rank, which has no item 2 to write yet.
            assert wait_until(lambda: asked.poll() == TransferPoll.WaitingForInput, 10.0), asked.poll()
            assert wait_until(lambda: _lookup_threads(0), 10.0), "the stalled look-up never started"
            assert looking.poll() == TransferPoll.Bootstrapping
            closer = threading.Thread(target=manager.close, name="test-close")
            closer.start()
            closer.join(30.0)  # generous: the look-up alone would hold it 60 s
            assert not closer.is_alive(), "close() waited for the stalled look-up"
            assert _lookup_threads(0), "close() returned only once the look-up ended"
            for handle in (looking, asked):
                assert handle.poll() == TransferPoll.Failed and handle.failure == "session manager closed"
                assert handle.failure_kind is FailureKind.CLOSED
            # close() took both leases back: the room never asked frees its slot, the asked one's waits out
            # the quarantine (its encode rank may still write; no confirmation is heard any more).
            stats = pool.stats()
            assert (stats["leased"], stats["quarantined"], stats["free"]) == (0, 1, 1), stats
            assert sender.stats() is not None  # the encode rank is still up, its item never sent
        left = [r.getMessage() for r in caplog.records if "closing left" in r.getMessage()]
        assert len(left) == 1, left
        assert "1 bootstrap look-ups still under way after" in left[0], left[0]
        assert f"the parallel sizes at bootstrap {stalled}" in left[0], left[0]
        assert "raise close_timeout_s (EPD_CLOSE_TIMEOUT_S)" in left[0], left[0]
    # The listener is gone: the look-up's connection is reset, it ends, and delivers nothing.
    assert wait_until(lambda: not _lookup_threads(0), 20.0), "the abandoned look-up never ended"

"""What the HELP texts of the counters say is what the library counts.

A prefill room is counted started when receive() files it, before anything is asked of an encode rank: one
that fails at its bootstrap look-up never sends an ask, and is counted started and Failed all the same (a driver
without its I/O thread or sockets, prefill_rooms.status_driver, its core real and its look-ups kept for the test
to answer). A status push is counted dropped whatever lost it: a receiver that cannot be reached as well as one
that stopped draining its queue, and the pushes made once the pushers closed."""

from __future__ import annotations

import math
import threading

import pytest
from prefill_rooms import BOOT, spec, status_driver

from transfer import _io
from transfer.core.failure import FailureKind
from transfer.core.prefill import LookUpParallel
from transfer.drive.prefill import Room
from transfer.errors import ConfigError, UsageError
from transfer.metrics import KNOWN_HELP, REASON_CATEGORIES, total
from transfer.status import TransferPoll


class LookUps:
    """Stands in for the driver's look-up threads: keeps what it was given."""

    def __init__(self) -> None:
        self.submitted: list = []

    def submit(self, action) -> None:
        self.submitted.append(action)


class Waker:
    def wake(self) -> None:
        pass


def _receiving_driver():
    d = status_driver()
    d._lock = threading.Lock()
    d._stopping, d.failure, d._resync, d._wake_at = False, None, False, math.inf
    d.clock = lambda: 0.0
    d._lookups, d._waker = LookUps(), Waker()
    return d


def _counts(d) -> dict[str, float]:
    rows = d.metrics.snapshot()
    counts = {"started": total(rows, "epd_prefill_rooms_started_total"),
              "succeeded": total(rows, "epd_prefill_rooms_succeeded_total")}
    for reason in REASON_CATEGORIES:
        if total(rows, "epd_prefill_rooms_failed_total", reason=reason):
            counts[reason] = total(rows, "epd_prefill_rooms_failed_total", reason=reason)
    return counts


def test_a_prefill_room_is_counted_started_when_received_before_any_ask_as_its_help_says():
    d = _receiving_driver()
    record = Room(5, 0.0, 64, None)
    d.receive(record, spec(5))
    assert d._lookups.submitted == [LookUpParallel(BOOT)]  # nothing asked of an encode rank yet
    assert _counts(d) == {"started": 1, "succeeded": 0}
    d._carry(1.0, d.core.lookup_failed(1.0, BOOT, None, "connection refused", 0.01))
    assert d.table.get(5) is TransferPoll.Failed
    # Never asked, yet counted started and concluded: started = succeeded + failed holds.
    assert _counts(d) == {"started": 1, "succeeded": 0, FailureKind.BOOTSTRAP.value: 1}
    help_text = KNOWN_HELP["rooms_started_total"]
    assert "receive()" in help_text and "send()" in help_text, help_text
    assert "ask sent" not in help_text, help_text


def test_a_status_lost_to_an_unreachable_receiver_or_a_closed_pusher_is_counted_dropped_as_its_help_says():
    counted: list[int] = []
    pushers = _io.Pushers(on_dropped=counted.append)
    try:
        # A peer that announced a host that is not an IP address: no connection can be made to it.
        assert pushers.send("prefill-7.example", 5555, [b"7", b"Success", b"0"]) is False
    finally:
        pushers.close()
    assert pushers.send("10.0.0.3", 5555, [b"8", b"Failed", b"0"]) is False  # closed
    assert counted == [1, 1] and pushers.dropped == 2
    help_text = KNOWN_HELP["statuses_dropped_total"]
    assert "reach" in help_text and "closed" in help_text, help_text


def test_a_receive_refused_before_it_filed_its_room_counts_nowhere():
    d = _receiving_driver()
    d.receive(Room(5, 0.0, 64, None), spec(5))
    with pytest.raises(ConfigError, match="already being received"):
        d.receive(Room(5, 0.0, 64, None), spec(5))
    d._stopping = True
    with pytest.raises(UsageError):
        d.receive(Room(6, 0.0, 64, None), spec(6))
    assert _counts(d) == {"started": 1, "succeeded": 0}  # the first receive's room only, still open

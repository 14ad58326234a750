"""The prefill driver's conclusions when the caller's metrics refuse to count them (an exporter that raises, a
MemoryError): the room is concluded on its record as in the table (when, whether it succeeded, whether its memory
is safe) and its waiters are woken, however the count went; the count's error is raised after. So the handle's
safe_to_reuse and the fate close() gives its pool slot read the conclusion the table holds. A driver without its
I/O thread or sockets (prefill_rooms.status_driver), its core real."""

from __future__ import annotations

import pytest
from prefill_rooms import spec, status_driver

from transfer.core.failure import Failure, FailureKind
from transfer.core.prefill import Overturn
from transfer.core.quarantine import Fate, fate_of, reusable
from transfer.drive.prefill import Room
from transfer.metrics import Metrics
from transfer.status import TransferPoll


class ExporterDown(Exception):
    pass


class Refusing(Metrics):
    """The caller's metrics, whose every count raises once armed, before counting."""

    armed = False

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        if self.armed:
            raise ExporterDown(name)
        super().inc(name, amount, **labels)

    def inc_all(self, amounts, observations=None) -> None:
        if self.armed:
            raise ExporterDown(", ".join(amounts))
        super().inc_all(amounts, observations)

    def inc_all_observing(self, amounts, name, values) -> None:
        if self.armed:
            raise ExporterDown(", ".join(amounts))
        super().inc_all_observing(amounts, name, values)


class Notified:
    """Stands in for the driver's Conclusions: counts the wake-ups."""

    def __init__(self) -> None:
        self.times = 0

    def notify(self) -> None:
        self.times += 1


def _driver_with_room(room: int = 5):
    d = status_driver()
    d.metrics = Refusing("epd_prefill")
    d.conclusions = notified = Notified()
    token, _ = d.core.receive(0.0, spec(room))  # waits for its bootstrap look-up: never asked
    record = Room(room, 0.0, 64, None, token)
    d.rooms[room] = record
    d.table.start(room, TransferPoll.Bootstrapping)
    d.metrics.armed = True
    return d, record, notified


def _reusable(record: Room, now: float) -> bool:
    return reusable(succeeded=record.succeeded, memory_safe=record.memory_safe, concluded_at=record.concluded_at,
                    now=now, quarantine_s=1000.0)


def test_a_failure_whose_count_raises_still_concludes_the_room_and_wakes_its_waiters():
    d, record, notified = _driver_with_room()
    failure = Failure(FailureKind.BOOTSTRAP, "bootstrap 10.0.0.1:8998: refused")
    with pytest.raises(ExporterDown):
        d._carry(1.0, d.core.fail(1.0, record.room, record.token, failure))
    assert d.table.get(record.room) is TransferPoll.Failed
    assert record.concluded_at == 1.0 and not record.succeeded
    assert notified.times == 1
    # No encode rank was asked: its memory is safe at once, and close() would free its slot.
    assert record.memory_safe and _reusable(record, 1.0)
    assert fate_of(succeeded=record.succeeded, memory_safe=record.memory_safe, confirmable=False) is Fate.FREE


def test_a_success_whose_count_raises_still_concludes_the_room_and_wakes_its_waiters():
    d, record, notified = _driver_with_room()
    with pytest.raises(ExporterDown):
        d._succeed(2.0, [record])
    assert d.table.get(record.room) is TransferPoll.Success
    assert record.concluded_at == 2.0 and record.succeeded
    assert notified.times == 1
    assert _reusable(record, 2.0)
    assert fate_of(succeeded=record.succeeded, memory_safe=record.memory_safe, confirmable=False) is Fate.FREE


def test_an_overturn_whose_count_raises_still_marks_the_room_failed_and_wakes_its_waiters():
    d, record, notified = _driver_with_room()
    d.metrics.armed = False
    d._succeed(2.0, [record])
    d.metrics.armed = True
    with pytest.raises(ExporterDown):
        d._overturn(Overturn(record.room, record.token, Failure(FailureKind.PEER_FAILED, "encode rank failed")))
    assert d.table.get(record.room) is TransferPoll.Failed
    assert not record.succeeded and record.memory_safe
    assert notified.times == 2

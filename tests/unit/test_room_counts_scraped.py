"""A room's conclusion is counted in one update of its Metrics: a scrape, whenever it comes, sees a Success
with its latency (room_latency_seconds' _count is rooms_succeeded_total, docs/operations.md) and, on the
prefill side, its bytes and whether it was verified, or none of them."""

from __future__ import annotations

import threading

import pytest

from transfer import _io
from transfer.core.failure import Failure, FailureKind
from transfer.core.prefill import Conclude
from transfer.drive.encode import RoomBook, RoomState
from transfer.drive.prefill import PrefillDriver, Room
from transfer.errors import ConfigError
from transfer.metrics import Metrics, declare_role
from transfer.status import RoomTable, TransferPoll


class _ScrapedLock:
    """A Metrics' lock that notes, each time it is taken, what a scrape taking it then would read."""

    def __init__(self, metrics: ScrapedMetrics) -> None:
        self._lock = threading.Lock()
        self._metrics = metrics

    def __enter__(self) -> bool:
        self._lock.acquire()
        self._metrics.scrapes.append(self._metrics.read())
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class ScrapedMetrics(Metrics):
    """Metrics scraped at every moment a scrape could come: whenever its lock is free to take."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.scrapes: list[dict[str, float]] = []
        self._lock = _ScrapedLock(self)  # type: ignore[assignment]

    def read(self) -> dict[str, float]:
        """Counter totals and histogram counts (`<name>_count`), as a scrape reads them (lock held)."""
        seen = {name: float(sum(series.values())) for name, series in self._counters.items()}
        seen.update({f"{name}_count": float(sum(h.count for h in series.values()))
                     for name, series in self._histograms.items()})
        return seen


def _consistent(scrape: dict[str, float]) -> bool:
    return scrape.get("rooms_succeeded_total", 0) == scrape.get("room_latency_seconds_count", 0)


def test_no_scrape_sees_an_encode_rooms_success_without_its_latency():
    metrics = ScrapedMetrics("epd_encode")
    declare_role(metrics, "encode", 0)
    book = RoomBook(metrics)
    metrics.scrapes.clear()  # those while the series were being created
    for room in (1, 2):
        state = RoomState(room, started_at=1.0)
        book.held[room] = state
        book.table.start(room, TransferPoll.WaitingForInput)
        assert book.conclude(state, TransferPoll.Success, None, at=1.5)
    metrics.scrapes.append(metrics.read())
    assert metrics.scrapes[-1]["rooms_succeeded_total"] == 2
    assert "epd_encode_rooms_succeeded_total{rank=\"0\",role=\"encode\"} 2\n" in metrics.prometheus_text()
    assert [scrape for scrape in metrics.scrapes if not _consistent(scrape)] == []


class _SafeCore:
    """The prefill core as _conclude asks it: whether a room's memory is safe."""

    def safe(self, room: int, token: int) -> bool:
        return False


def _prefill_driver(metrics: Metrics, record: Room) -> PrefillDriver:
    """A prefill driver holding `record`, with neither its thread nor its sockets: what _conclude reads."""
    driver = PrefillDriver.__new__(PrefillDriver)
    driver.metrics, driver.core, driver.rooms = metrics, _SafeCore(), {record.room: record}
    driver.table, driver.conclusions, driver._watcher = RoomTable(), _io.Conclusions(), None
    driver._failures = _io.ThrottledLog(_io.log)
    driver.table.start(record.room, TransferPoll.Transferring)
    return driver


@pytest.mark.parametrize("unverified", [False, True])
def test_no_scrape_sees_a_prefill_rooms_success_without_its_latency_bytes_and_verification(unverified):
    metrics = ScrapedMetrics("epd_prefill")
    declare_role(metrics, "prefill", 0)
    record = Room(7, started_at=1.0, nbytes=512, token=3)
    driver = _prefill_driver(metrics, record)
    metrics.scrapes.clear()  # those while the series were being created
    driver._conclude(1.25, Conclude(7, 3, None, unverified=unverified))
    metrics.scrapes.append(metrics.read())
    assert record.succeeded and metrics.scrapes[-1]["bytes_received_total"] == 512
    assert metrics.scrapes[-1]["rooms_unverified_total"] == (1 if unverified else 0)
    for scrape in metrics.scrapes:
        succeeded = scrape["rooms_succeeded_total"]
        assert _consistent(scrape), scrape
        assert scrape["bytes_received_total"] == 512 * succeeded, scrape
        assert scrape["rooms_unverified_total"] == (succeeded if unverified else 0), scrape


def test_a_failure_is_counted_under_its_kind_alone():
    metrics = ScrapedMetrics("epd_encode")
    declare_role(metrics, "encode", 0)
    _io.count_concluded(metrics, _io.ThrottledLog(_io.log), 7, False, Failure(FailureKind.DEADLINE, "late"), 3.0)
    rows = {row["labels"]["reason"]: row["value"] for row in metrics.snapshot()
            if row["name"] == "epd_encode_rooms_failed_total"}
    assert rows == {**{reason: 0 for reason in rows}, "deadline": 1}
    assert metrics.read()["rooms_succeeded_total"] == 0 and metrics.read()["room_latency_seconds_count"] == 0


def test_inc_all_refuses_what_inc_and_observe_refuse_recording_nothing():
    metrics = Metrics("ns")
    metrics.inc("a_total", 0)
    metrics.histogram("h")
    for amounts, observations in (({"a_total": 1, "b_total": -1}, {"h": 0.1}),
                                  ({"a_total": 1, "b_total": float("inf")}, {}),
                                  ({"a_total": 1}, {"h": float("nan")}),
                                  ({"a_total": 1, "h": 1}, {})):
        with pytest.raises(ConfigError):
            metrics.inc_all(amounts, observations)
    assert [(row["name"], row["value"]) for row in metrics.snapshot() if row["value"]] == []
    metrics.inc_all({"a_total": 2, "b_total": 3}, {"h": 0.1})
    values = {row["name"]: row["value"] for row in metrics.snapshot() if "le" not in row["labels"]}
    assert values == {"ns_a_total": 2, "ns_b_total": 3, "ns_h_sum": 0.1, "ns_h_count": 1}

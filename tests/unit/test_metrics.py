"""Metrics: snapshot values, quantile estimates, the text format, the collector."""

from __future__ import annotations

import json
import math

import pytest

from metrics_golden import GOLDEN, small_example

from transfer.core.failure import FailureKind
from transfer.metrics import REASON_CATEGORIES, Metrics, escape_label_value, estimate_quantile, zero_room_counters


def test_text_format_golden():
    assert small_example().prometheus_text() == GOLDEN


def test_empty_metrics_render_nothing():
    m = Metrics("epd")
    assert m.prometheus_text() == ""
    assert m.snapshot() == {"namespace": "epd", "counters": {}, "gauges": {}, "histograms": {}}


def test_label_escaping():
    assert escape_label_value('a"b') == 'a\\"b'
    assert escape_label_value("a\\b") == "a\\\\b"
    assert escape_label_value("a\nb") == "a\\nb"
    m = Metrics("x")
    m.inc("c_total", path='C:\\tmp\n"q"')
    assert 'x_c_total{path="C:\\\\tmp\\n\\"q\\""} 1' in m.prometheus_text()


def test_snapshot_values():
    m = Metrics("epd")
    m.inc("rooms_started_total")
    m.inc("rooms_started_total")
    m.inc("bytes_written_total", 4096)
    m.inc("rooms_failed_total", reason="timeout")
    m.inc("rooms_failed_total", reason="timeout")
    m.inc("rooms_failed_total", reason="write", peer=3)
    m.set_gauge("parked_rooms", 5)
    depth = [7]
    m.gauge_fn("queue_depth", lambda: depth[0])
    m.observe("room_latency_seconds", 0.2)
    snap = m.snapshot()
    assert snap["counters"]["rooms_started_total"] == {"": 2}
    assert snap["counters"]["bytes_written_total"] == {"": 4096}
    assert snap["counters"]["rooms_failed_total"] == {"reason=timeout": 2, "peer=3,reason=write": 1}
    assert snap["gauges"]["parked_rooms"] == {"": 5}
    assert snap["gauges"]["queue_depth"] == {"": 7.0}
    depth[0] = 9  # evaluated at read time, not at registration
    assert m.snapshot()["gauges"]["queue_depth"] == {"": 9.0}
    h = snap["histograms"]["room_latency_seconds"][""]
    assert h["count"] == 1 and h["sum"] == pytest.approx(0.2)
    json.dumps(snap, allow_nan=False)  # plain and strict-JSON serializable


def test_broken_gauge_fn_does_not_break_reads():
    m = Metrics("epd")
    m.gauge_fn("queue_depth", lambda: 1 / 0)
    assert m.snapshot()["gauges"]["queue_depth"] == {"": None}
    assert "epd_queue_depth NaN" in m.prometheus_text()


def test_histogram_percentiles():
    m = Metrics("epd")
    # 100 observations: 1 ms .. 100 ms, uniform.
    for i in range(1, 101):
        m.observe("room_latency_seconds", i / 1000)
    h = m.snapshot()["histograms"]["room_latency_seconds"][""]
    assert h["count"] == 100
    assert h["sum"] == pytest.approx(5.05)
    assert h["p50"] == pytest.approx(0.05, abs=0.005)  # the 0.025..0.05 bucket ends exactly at 50
    assert 0.09 <= h["p99"] <= 0.1  # clamped to the largest value seen, 0.1
    assert h["max"] == pytest.approx(0.1)


def test_percentile_in_overflow_bucket_is_the_max_seen():
    m = Metrics("epd", buckets=(1.0,))
    m.observe("lat", 50.0)
    m.observe("lat", 90.0)
    h = m.snapshot()["histograms"]["lat"][""]
    assert 50.0 <= h["p50"] <= 90.0
    assert h["p99"] <= 90.0


def test_estimate_quantile_edges():
    assert math.isnan(estimate_quantile(0.5, (1.0,), [0, 0]))
    # all mass in one bucket [0.1, 0.2]: the median sits mid-bucket
    assert estimate_quantile(0.5, (0.1, 0.2), [0, 10, 0]) == pytest.approx(0.15)


def test_kind_conflicts_and_bad_names():
    m = Metrics("epd")
    m.inc("rooms_started_total")
    with pytest.raises(ValueError, match="is a counter, not a gauge"):
        m.set_gauge("rooms_started_total", 1)
    with pytest.raises(ValueError, match="cannot decrease"):
        m.inc("rooms_started_total", -1)
    with pytest.raises(ValueError, match="not a valid Prometheus name"):
        m.inc("bad-name")
    with pytest.raises(ValueError, match="label name 'le'"):
        m.observe("room_latency_seconds", 0.1, le="x")
    with pytest.raises(ValueError, match="NaN"):
        m.observe("room_latency_seconds", float("nan"))


def test_room_counters_exist_at_zero_with_one_failure_series_per_kind():
    m = Metrics("epd")
    zero_room_counters(m)
    counters = m.snapshot()["counters"]
    assert counters["rooms_started_total"] == {"": 0} and counters["rooms_succeeded_total"] == {"": 0}
    assert counters["rooms_failed_total"] == {f"reason={kind.value}": 0 for kind in FailureKind}
    assert 'epd_rooms_failed_total{reason="deadline"} 0' in m.prometheus_text()
    assert set(REASON_CATEGORIES) == {kind.value for kind in FailureKind}


def test_prometheus_client_collector():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    m = small_example()
    m.gauge_fn("parked_rooms", lambda: 4)
    collector = m.register_with_prometheus_client(registry)
    text = prometheus_client.generate_latest(registry).decode()
    assert "epd_rooms_started_total 2.0" in text
    assert 'epd_rooms_failed_total{reason="checksum"} 1.0' in text
    assert 'epd_room_latency_seconds_bucket{le="0.1"} 2.0' in text
    assert 'epd_room_latency_seconds_bucket{le="+Inf"} 3.0' in text
    assert "epd_room_latency_seconds_count 3.0" in text
    assert "epd_queue_depth 3.0" in text
    assert "epd_parked_rooms 4.0" in text
    m.inc("rooms_started_total")  # read at scrape time
    assert "epd_rooms_started_total 3.0" in prometheus_client.generate_latest(registry).decode()
    registry.unregister(collector)
    assert "epd_" not in prometheus_client.generate_latest(registry).decode()

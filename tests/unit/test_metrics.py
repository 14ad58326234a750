"""Metrics: the flat snapshot, role labels and zeroed series, quantile estimates, the text format, the collector."""

from __future__ import annotations

import json
import math
import re

import pytest

from metrics_golden import GOLDEN, GOLDEN_SNAPSHOT, small_example

from transfer.core.failure import FailureKind
from transfer.errors import ConfigError, ConfigTypeError
from transfer.metrics import (
    REASON_CATEGORIES,
    ROLE_COUNTERS,
    ROLES,
    Metrics,
    _bucket_index,
    _check_amount,
    _checked_value,
    declare_role,
    escape_label_value,
    estimate_quantile,
    total,
    zero_room_counters,
)


def test_text_format_golden():
    assert small_example().prometheus_text() == GOLDEN


def test_empty_metrics_render_nothing():
    m = Metrics("epd")
    assert m.prometheus_text() == ""
    assert m.snapshot() == []


def test_snapshot_golden_has_the_texts_samples_one_row_each():
    m = small_example()
    assert m.snapshot() == GOLDEN_SNAPSHOT
    # The text format and the snapshot name and label every sample alike.
    lines = [line for line in m.prometheus_text().splitlines() if not line.startswith("#")]
    assert len(lines) == len(GOLDEN_SNAPSHOT)
    assert [line.partition("{")[0] for line in lines] == [row["name"] for row in GOLDEN_SNAPSHOT]


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
    assert total(snap, "epd_rooms_started_total") == 2
    assert total(snap, "epd_bytes_written_total") == 4096
    assert [(row["labels"], row["value"]) for row in snap if row["name"] == "epd_rooms_failed_total"] == [
        ({"peer": "3", "reason": "write"}, 1), ({"reason": "timeout"}, 2)]
    assert total(snap, "epd_rooms_failed_total", reason="timeout") == 2
    assert total(snap, "epd_parked_rooms") == 5
    assert [row for row in snap if row["name"] == "epd_queue_depth"] == [
        {"name": "epd_queue_depth", "type": "gauge", "labels": {}, "value": 7}]
    depth[0] = 9  # evaluated at read time, not at registration
    assert total(m.snapshot(), "epd_queue_depth") == 9
    assert total(snap, "epd_room_latency_seconds_count") == 1
    assert total(snap, "epd_room_latency_seconds_sum") == pytest.approx(0.2)
    assert total(snap, "epd_room_latency_seconds_bucket", le="0.25") == 1
    assert total(snap, "epd_room_latency_seconds_bucket", le="0.1") == 0
    json.dumps(snap, allow_nan=False)  # plain and strict-JSON serializable


def test_the_default_latency_buckets_tell_apart_rooms_under_a_millisecond():
    m = Metrics("epd")
    for seconds in (0.00008, 0.0003, 0.0004, 0.0008):  # rooms of an RDMA link's sizes
        m.observe("room_latency_seconds", seconds)
    snap = m.snapshot()
    assert [total(snap, "epd_room_latency_seconds_bucket", le=le) for le in ("0.0001", "0.00025", "0.0005", "0.001")] \
        == [1, 1, 3, 4]


def test_broken_gauge_fn_does_not_break_reads():
    m = Metrics("epd")
    m.gauge_fn("queue_depth", lambda: 1 / 0)
    assert m.snapshot() == [{"name": "epd_queue_depth", "type": "gauge", "labels": {}, "value": None}]
    assert "epd_queue_depth NaN" in m.prometheus_text()


@pytest.mark.parametrize("value", [None, "three", [1], object()], ids=["None", "text", "list", "object"])
def test_a_gauge_set_to_no_number_is_refused_and_the_reads_go_on(value):
    # One that is no number would fail every read of the text format: an endpoint serving the set would close
    # each scrape unanswered.
    m = Metrics("epd")
    m.inc("rooms_started_total")
    with pytest.raises(ConfigTypeError, match="gauge 'parked_rooms' takes a number, not "):
        m.set_gauge("parked_rooms", value)
    assert m.prometheus_text().endswith("epd_rooms_started_total 1\n")
    assert [row["name"] for row in m.snapshot()] == ["epd_rooms_started_total"]


def test_a_gauge_keeps_an_int_as_an_int_and_reads_other_numbers_as_floats():
    m = Metrics("epd")
    m.set_gauge("parked_rooms", 3)
    m.set_gauge("fallback_bytes", 2.5)
    assert [(row["name"], row["value"]) for row in m.snapshot()] == [("epd_fallback_bytes", 2.5),
                                                                      ("epd_parked_rooms", 3)]
    assert "epd_parked_rooms 3\n" in m.prometheus_text()


def test_a_counter_read_from_a_callable_is_a_counter():
    m = Metrics("epd", labels={"rank": 1, "role": "encode"})
    dropped = [0]
    m.counter_fn("statuses_dropped_total", lambda: dropped[0])
    dropped[0] = 3
    assert m.snapshot() == [{"name": "epd_statuses_dropped_total", "type": "counter",
                             "labels": {"rank": "1", "role": "encode"}, "value": 3}]
    text = m.prometheus_text()
    assert "# TYPE epd_statuses_dropped_total counter" in text
    assert 'epd_statuses_dropped_total{rank="1",role="encode"} 3\n' in text
    with pytest.raises(ValueError, match="is a counter, not a gauge"):
        m.gauge_fn("statuses_dropped_total", lambda: 0)


def test_every_series_carries_the_sets_labels_and_a_series_may_not_override_them():
    m = Metrics("epd")
    m.inc("rooms_started_total")
    m.label(role="prefill", rank=2)
    m.observe("room_latency_seconds", 0.5)
    assert {tuple(sorted(row["labels"].items())) for row in m.snapshot() if "le" not in row["labels"]} == {
        (("rank", "2"), ("role", "prefill"))}
    m.label(role="prefill")  # the same value again is fine
    with pytest.raises(ConfigError, match=r"already labelled role='prefill' \(not 'encode'\).*a Metrics of its own"):
        m.label(role="encode")
    with pytest.raises(ValueError, match="label name 'rank'"):
        m.inc("rooms_started_total", rank=3)
    m.inc("rooms_failed_total", reason="deadline")
    with pytest.raises(ValueError, match="label 'reason' is already a series label"):
        m.label(reason="x")


def test_an_empty_histogram_is_exposed_at_zero():
    m = Metrics("epd", buckets=(1.0,))
    m.histogram("room_latency_seconds")
    assert [(row["name"], row["value"]) for row in m.snapshot()] == [
        ("epd_room_latency_seconds_bucket", 0), ("epd_room_latency_seconds_bucket", 0),
        ("epd_room_latency_seconds_sum", 0.0), ("epd_room_latency_seconds_count", 0)]
    assert "epd_room_latency_seconds_count 0\n" in m.prometheus_text()


def test_estimate_quantile_edges():
    assert math.isnan(estimate_quantile(0.5, (1.0,), [0, 0]))
    # all mass in one bucket [0.1, 0.2]: the median sits mid-bucket
    assert estimate_quantile(0.5, (0.1, 0.2), [0, 10, 0]) == pytest.approx(0.15)


def test_kind_conflicts_and_bad_names():
    m = Metrics("epd")
    m.inc("rooms_started_total")
    with pytest.raises(ValueError, match="is a counter, not a gauge"):
        m.set_gauge("rooms_started_total", 1)
    for amount in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"takes a finite non-negative amount, not {amount}"):
            m.inc("rooms_started_total", amount)
    assert m.snapshot()[0]["value"] == 1
    with pytest.raises(ValueError, match="not a valid Prometheus name"):
        m.inc("bad-name")
    with pytest.raises(ValueError, match="label name 'le'"):
        m.observe("room_latency_seconds", 0.1, le="x")
    with pytest.raises(ValueError, match="NaN"):
        m.observe("room_latency_seconds", float("nan"))


def test_room_counters_exist_at_zero_with_one_failure_series_per_kind():
    m = Metrics("epd")
    zero_room_counters(m)
    snap = m.snapshot()
    assert total(snap, "epd_rooms_started_total") == 0 and total(snap, "epd_rooms_succeeded_total") == 0
    failed = {row["labels"]["reason"]: row["value"] for row in snap if row["name"] == "epd_rooms_failed_total"}
    assert failed == {kind.value: 0 for kind in FailureKind}
    assert 'epd_rooms_failed_total{reason="deadline"} 0' in m.prometheus_text()
    assert set(REASON_CATEGORIES) == {kind.value for kind in FailureKind}


@pytest.mark.parametrize("role", ROLES)
def test_a_roles_counters_exist_at_zero_labelled_with_rank_and_role(role):
    m = Metrics(f"epd_{role}")
    declare_role(m, role, 3)
    snap = m.snapshot()
    assert snap and all(row["labels"]["rank"] == "3" and row["labels"]["role"] == role for row in snap)
    assert all(row["value"] == 0 for row in snap)
    counters = {row["name"] for row in snap if row["type"] == "counter"}
    assert counters == {f"epd_{role}_{name}" for name in ROLE_COUNTERS[role]}
    assert all(name.endswith("_total") for name in counters)
    assert f"epd_{role}_room_latency_seconds_count" in {row["name"] for row in snap}
    failed = {row["labels"]["reason"] for row in snap if row["name"] == f"epd_{role}_rooms_failed_total"}
    assert failed == set(REASON_CATEGORIES)
    text = m.prometheus_text()
    assert f'epd_{role}_rooms_failed_total{{rank="3",reason="deadline",role="{role}"}} 0\n' in text
    with pytest.raises(ConfigError, match="a Metrics of its own"):
        declare_role(m, role, 4)  # a second component on the same Metrics


def test_unverified_successes_are_counted_on_the_prefill_side_only():
    assert "rooms_unverified_total" in ROLE_COUNTERS["prefill"]
    assert "rooms_unverified_total" not in ROLE_COUNTERS["encode"]


def test_prometheus_client_collector():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    m = small_example()
    m.gauge_fn("parked_rooms", lambda: 4)
    collector = m.register_with_prometheus_client(registry)
    text = prometheus_client.generate_latest(registry).decode()
    labels = 'rank="0",role="prefill"'
    assert f"epd_rooms_started_total{{{labels}}} 2.0" in text
    assert f'epd_rooms_failed_total{{rank="0",reason="checksum",role="prefill"}} 1.0' in text
    assert f'epd_room_latency_seconds_bucket{{le="0.1",{labels}}} 2.0' in text  # prometheus_client sorts labels
    assert f'epd_room_latency_seconds_bucket{{le="+Inf",{labels}}} 3.0' in text
    assert f"epd_room_latency_seconds_count{{{labels}}} 3.0" in text
    assert f"epd_queue_depth{{{labels}}} 3.0" in text
    assert f"epd_parked_rooms{{{labels}}} 4.0" in text
    assert "# TYPE epd_rooms_started_total counter" in text
    m.inc("rooms_started_total")  # read at scrape time
    assert f"epd_rooms_started_total{{{labels}}} 3.0" in prometheus_client.generate_latest(registry).decode()
    registry.unregister(collector)
    assert "epd_" not in prometheus_client.generate_latest(registry).decode()


def test_a_registry_refuses_a_second_collector_whose_families_clash():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    first = small_example()
    first.register_with_prometheus_client(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        first.register_with_prometheus_client(registry)  # the same set twice
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        small_example().register_with_prometheus_client(registry)  # another of the same names
    text = prometheus_client.generate_latest(registry).decode()
    assert text.count("# TYPE epd_rooms_started_total counter") == 1


def test_a_set_records_one_component_at_a_time_and_serves_the_next_once_released():
    m = Metrics("epd_x")
    release = m.claim("the sender pool of encode rank 0")
    with pytest.raises(ConfigError, match=r"^metrics 'epd_x' already record the sender pool of encode rank 0, which "
                                          r"is not closed: the sender pool of encode rank 1 would write the same "
                                          r"series .*give each a Metrics of its own, or close the first"):
        m.claim("the sender pool of encode rank 1")
    release()
    release()  # a second release (a close after a failed start) lets go of nothing else
    again = m.claim("the sender pool of encode rank 1")
    release()
    with pytest.raises(ConfigError):  # an old release does not free the set its successor holds
        m.claim("a third")
    again()
    m.claim("a third")


def test_a_counter_counted_with_and_without_labels_keeps_each_series_and_its_kind():
    m = Metrics("epd")
    m.inc("rooms_failed_total", reason="timeout")
    m.inc("rooms_failed_total")
    m.inc("rooms_failed_total", 2)
    m.set_gauge("parked_rooms", 1)
    snap = m.snapshot()
    assert [(row["labels"], row["value"]) for row in snap if row["name"] == "epd_rooms_failed_total"] == [
        ({}, 3), ({"reason": "timeout"}, 1)]
    with pytest.raises(ConfigError, match="is a gauge"):
        m.inc("parked_rooms")
    with pytest.raises(ConfigError, match="finite non-negative"):
        m.inc("rooms_failed_total", -1)


def test_a_histogram_observed_with_and_without_labels_keeps_each_series_and_its_kind():
    m = Metrics("epd")
    m.observe("room_latency_seconds", 0.5, path="epd")
    m.observe("room_latency_seconds", 0.25)
    m.observe("room_latency_seconds", 0.75)
    m.inc("rooms_started_total")
    counts = {tuple(sorted(row["labels"].items())): row["value"] for row in m.snapshot()
              if row["name"] == "epd_room_latency_seconds_count"}
    assert counts == {(): 2, (("path", "epd"),): 1}
    with pytest.raises(ConfigError, match="is a counter, not a histogram"):
        m.observe("rooms_started_total", 1.0)


def test_a_components_gauges_leave_the_set_when_it_lets_go_and_the_callers_own_stay():
    m = Metrics("epd_x")
    m.gauge_fn("own_gauge", lambda: 7)
    claim = m.claim("the session manager of prefill rank 0")
    claim.gauge_fn("rooms_in_flight", lambda: 3)
    assert {row["name"]: row["value"] for row in m.snapshot()} == {"epd_x_own_gauge": 7, "epd_x_rooms_in_flight": 3}
    claim()
    assert {row["name"] for row in m.snapshot()} == {"epd_x_own_gauge"}
    assert "rooms_in_flight" not in m.prometheus_text()
    claim.gauge_fn("rooms_in_flight", lambda: 3)  # a claim let go of registers nothing
    assert {row["name"] for row in m.snapshot()} == {"epd_x_own_gauge"}
    again = m.claim("the session manager of prefill rank 0")
    again.gauge_fn("rooms_in_flight", lambda: 1)
    claim()  # an old claim takes nothing of its successor's
    assert total(m.snapshot(), "epd_x_rooms_in_flight") == 1


from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_AMOUNTS = st.one_of(st.sampled_from([1, 0, 2.5, -1, math.nan, math.inf, -math.inf]), st.integers(-2, 5),
                     st.floats(allow_nan=True, allow_infinity=True))
_COUNTER_NAMES = st.sampled_from(["a_total", "b_total", "h"])  # "h" is claimed as a histogram below


@given(st.dictionaries(_COUNTER_NAMES, _AMOUNTS, max_size=3),
       st.dictionaries(st.sampled_from(["h", "a_total"]), _AMOUNTS, max_size=2),
       st.lists(st.tuples(_COUNTER_NAMES, _AMOUNTS), max_size=3))
def test_inc_and_inc_all_check_inline_as_check_amount_and_checked_value_do(amounts, observations, incs):
    """inc() and inc_all() test amounts and observations inline, calling _check_amount and _checked_value
    only to refuse: each refuses what those refuse with the same error, recording nothing, and otherwise
    records what one inc() or observe() a name records."""
    fast, slow = Metrics("ns"), Metrics("ns")
    for metrics in (fast, slow):
        metrics.histogram("h")
    for name, amount in incs:
        try:
            _check_amount(name, amount)
            slow._series(slow._counters, name, "counter")
        except ConfigError as exc:
            with pytest.raises(ConfigError, match=f"^{re.escape(str(exc))}$"):
                fast.inc(name, amount)
            continue
        fast.inc(name, amount)
        slow.inc(name, amount)
    expected: ConfigError | None = None
    try:
        for name, amount in amounts.items():
            _check_amount(name, amount)
        for name, value in observations.items():
            _checked_value(name, value)
        for name in amounts:
            slow._series(slow._counters, name, "counter")
        for name in observations:
            slow._series(slow._histograms, name, "histogram")
    except ConfigError as exc:
        expected = exc
    if expected is not None:
        with pytest.raises(ConfigError, match=f"^{re.escape(str(expected))}$"):
            fast.inc_all(amounts, observations)
    else:
        fast.inc_all(amounts, observations)
        for name, amount in amounts.items():
            slow.inc(name, amount)
        for name, value in observations.items():
            slow.observe(name, value)
    assert fast.snapshot() == slow.snapshot()


@given(st.lists(st.tuples(st.sampled_from([(), (("reason", "a"),), (("reason", "b"),)]),
                          st.one_of(st.integers(0, 5), st.floats(0, 1e6), st.sampled_from([True, False, -0.0, 0.0]))),
                max_size=6))
def test_a_counter_holds_the_sum_of_its_amounts_from_zero(incs):
    """Each series holds 0 plus each amount inc() (or for an unlabelled one, inc_all()) added to it, in order, typed
    as that sum is (True adds 1)."""
    m, all_at_once = Metrics("ns"), Metrics("ns")
    expected: dict = {}
    for labels, amount in incs:
        m.inc("a_total", amount, **dict(labels))
        if not labels:
            all_at_once.inc_all({"a_total": amount})
        expected[labels] = expected.get(labels, 0) + amount
    for metrics, series in ((m, expected), (all_at_once, {(): expected[()]} if () in expected else {})):
        held = metrics._counters.get("a_total", {})
        assert {key: (type(value), value) for key, value in held.items()} == {
            key: (type(value), value) for key, value in series.items()}


_BOUNDS = st.lists(st.one_of(st.floats(-1e3, 1e3), st.sampled_from([0.0, -0.0, 0.001, 0.5, 1.0])), min_size=1,
                   max_size=6)
_VALUES = st.lists(st.one_of(st.floats(allow_nan=False), st.sampled_from([0.0, -0.0, 0.001, 0.5, 1.0])), max_size=6)


@given(_BOUNDS, _VALUES)
def test_observe_and_inc_all_record_each_value_in_the_bucket_bucket_index_names(bounds, values):
    """Where a value is recorded its bucket is read in one call (bisect_left of the sorted bounds): the bucket
    _bucket_index() names, duplicate bounds, negative values, the bounds themselves and +-Inf included."""
    observed, all_at_once = Metrics("ns", buckets=bounds), Metrics("ns", buckets=bounds)
    expected = [0] * (len(bounds) + 1)
    for value in values:
        observed.observe("h", value)
        all_at_once.inc_all({}, {"h": value})
        expected[_bucket_index(observed.buckets, value)] += 1
    for metrics in (observed, all_at_once):
        assert (metrics._histograms["h"][()].counts if values else expected) == expected


_LATENCIES = st.lists(st.one_of(st.floats(-1.0, 100.0), st.sampled_from([0.0, 0.001, 0.5, math.inf, -math.inf, math.nan])),
                      min_size=1, max_size=5)


@given(st.lists(st.integers(0, 1 << 40), min_size=1, max_size=5), _LATENCIES, st.sampled_from([None, "h", "c_total"]),
       st.sampled_from([[], [0.5], [-1.0]]))
@example([1, 2, 3], [0.1, 0.2, 0.3], None, [])  # summed in another order, the histogram's sum differs
def test_inc_all_observing_records_what_an_inc_all_of_each_value_records(nbytes, latencies, claimed, earlier):
    """inc_all_observing(sums, name, values) records what inc_all() of each room's amounts and value records,
    in turn (one room or more, as the prefill driver calls it): the sums, each value in order (the histogram's
    sum added to value by value); a name claimed as another kind or a NaN refused, recording nothing (with
    inc_all()'s error where only one of them is wrong)."""
    rooms = list(zip(nbytes, latencies))
    together, one_by_one = Metrics("ns"), Metrics("ns")
    for metrics in (together, one_by_one):
        if claimed == "h":
            metrics.inc("h")  # claimed as a counter: no histogram of that name
        elif claimed == "c_total":
            metrics.histogram("c_total")
        for value in earlier:
            metrics.inc_all({"c_total": 1} if claimed != "c_total" else {}, {"l": value})
    expected: ConfigError | None = None
    try:
        for size, latency in rooms:
            one_by_one.inc_all({"c_total": 1, "b_total": size}, {"l" if claimed != "h" else "h": latency})
    except ConfigError as exc:
        expected = exc
    name = "l" if claimed != "h" else "h"
    sums = {"c_total": len(rooms), "b_total": sum(nbytes[:len(rooms)])}
    if expected is not None:
        before = together.snapshot()
        with pytest.raises(ConfigError) as refused:
            together.inc_all_observing(sums, name, [latency for _, latency in rooms])
        assert together.snapshot() == before
        if claimed is None or not any(math.isnan(latency) for _, latency in rooms):  # one reason to refuse
            assert str(refused.value) == str(expected)
        return
    together.inc_all_observing(sums, name, [latency for _, latency in rooms])
    assert together.snapshot() == one_by_one.snapshot()
    assert together.prometheus_text() == one_by_one.prometheus_text()

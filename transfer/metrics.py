"""Counters, histograms and gauges a serving stack scrapes, with no mandatory dependency.

One `Metrics` object per component (session manager, sender pool) holds its
series under a namespace, every one labelled with the component's `rank` and `role`.
Read it three ways, all with the same names and labels: `snapshot()` (a flat list of
samples for `stats()` and JSON), `prometheus_text()` (the text exposition format,
written here so it works without prometheus_client), and
`register_with_prometheus_client()` (a Collector an engine mounts in its own
registry). `serve()` starts a tiny /metrics endpoint for processes that have none.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler
from typing import Any

from transfer._http import BoundedHTTPServer, OneDeadlineHandler
from transfer.core.failure import FailureKind
from transfer.errors import ConfigError, ConfigTypeError
from transfer.ports import PortSpec, bind_port, listen_error

log = logging.getLogger(__name__)

# Latency buckets in seconds: a room takes from a tenth of a millisecond (a small item
# over RDMA) to a minute (bootstrap timeout), so cover both ends.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

# Help text for the names the library uses; others get their name spelled out.
KNOWN_HELP: dict[str, str] = {
    "rooms_started_total": "Rooms started: filed by receive() (before its ask goes out) or accepted by send().",
    "rooms_succeeded_total": "Rooms concluded Success.",
    "rooms_failed_total": "Rooms concluded Failed, by failure kind.",
    "bytes_written_total": "Embedding and deepstack bytes of the writes to receivers that completed, "
                           "whatever their room's fate.",
    "bytes_received_total": "Embedding and deepstack bytes of the rooms concluded Success, counted at the Success.",
    "room_latency_seconds": "Seconds from a room's start to its Success.",
    "queue_depth": "Receiver shard writes ready to start, waiting for a free slot in flight or their ready event "
                   "(not those of a failed room or a restarted receiver, which never start).",
    "rooms_in_flight": "Rooms asked for and not yet cleared, concluded or not.",
    "cancels_set_aside": "Cancels given up on unanswered (encode rank gone, or too many awaited) that still take "
                         "late answers; at 65536 no cancel is sent and cleared rooms' memory waits out its "
                         "quarantine.",
    "rooms_unverified_total": "Rooms concluded Success with no checksum to verify (the encode rank sent none).",
    "rooms_failed_after_success_total": "Rooms concluded Success that their encode rank then told Failed "
                                        "before they were cleared (another receiver's write failed): they are "
                                        "Failed now, and still counted in rooms_succeeded_total.",
    "statuses_dropped_total": "Status pushes dropped: their receiver could not be reached or stopped draining its "
                              "queue, or their connection closed before they went out (the pool closed, or made "
                              "room for another receiver).",
    "sessions_superseded_total": "Prefill sessions replaced by a restarted rank's new session, by how it was told.",
    "registrations_refused_total": "Registrations refused (a session that announced region lengths sent one without).",
    "cancels_total": "Answers to receivers' cancels, by answer (too_late, then confirmed or write_failed; or one of these).",
    "parked_rooms": "Items sent whose receivers have not all asked for them yet.",
    "quarantined_slots": "Receive slots held back after a failed or late write.",
    "fallback_bytes": "Bytes held by fallback receive buffers (items bigger than a slot, or no free slot).",
}

# The bounded values of rooms_failed_total's `reason` label: the failure kinds.
REASON_CATEGORIES: tuple[str, ...] = tuple(kind.value for kind in FailureKind)

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

LabelKey = tuple[tuple[str, str], ...]


#: The `role` label of each component's series.
ROLES: tuple[str, ...] = ("encode", "prefill")

#: The counters each role has from the start (at zero, so alerts and rates see them before
#: the first event), with the bounded values of their `reason` label (empty: unlabelled).
ROLE_COUNTERS: dict[str, dict[str, tuple[str, ...]]] = {
    "encode": {
        "rooms_started_total": (),
        "rooms_succeeded_total": (),
        "rooms_failed_total": REASON_CATEGORIES,
        "bytes_written_total": (),
        "cancels_total": ("confirmed", "too_late", "write_failed"),
        "sessions_superseded_total": ("shard", "status_endpoint"),
        "registrations_refused_total": ("no_lengths",),
        "statuses_dropped_total": (),
    },
    "prefill": {
        "rooms_started_total": (),
        "rooms_succeeded_total": (),
        "rooms_failed_total": REASON_CATEGORIES,
        "rooms_unverified_total": (),
        "rooms_failed_after_success_total": (),
        "bytes_received_total": (),
    },
}


def zero_room_counters(metrics: Metrics) -> None:
    """Creates the room counters at zero, one failure series per kind, so alerts see them before any room."""
    metrics.inc("rooms_started_total", 0)
    metrics.inc("rooms_succeeded_total", 0)
    for reason in REASON_CATEGORIES:
        metrics.inc("rooms_failed_total", 0, reason=reason)


def declare_role(metrics: Metrics, role: str, rank: int) -> None:
    """Labels `metrics` with the component's role and rank, and creates its counters and latency histogram."""
    if role not in ROLE_COUNTERS:
        raise ConfigError(f"role {role!r} is not one of {ROLES}")
    metrics.label(role=role, rank=rank)
    for name, reasons in ROLE_COUNTERS[role].items():
        if reasons:
            for reason in reasons:
                metrics.inc(name, 0, reason=reason)
        else:
            metrics.inc(name, 0)
    metrics.histogram("room_latency_seconds")


def total(snapshot: Iterable[dict], name: str, **labels: object) -> float:
    """The sum of the values of a snapshot's samples named `name` whose labels include `labels`."""
    want = {k: str(v) for k, v in labels.items()}
    return sum(row["value"] or 0 for row in snapshot
               if row["name"] == name and all(row["labels"].get(k) == v for k, v in want.items()))


def escape_label_value(value: str) -> str:
    """Escape a label value for the text format: backslash, double quote, newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """Escape HELP text for the text format: backslash and newline."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """Format a sample value as the text format expects (ints bare, +Inf, NaN)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _labels_text(key: LabelKey, extra: Iterable[tuple[str, str]] = ()) -> str:
    """Render `{k="v",...}` for a sample line, or '' when there are no labels."""
    pairs = list(key) + list(extra)
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(v)}"' for k, v in pairs) + "}"


def _check_name(name: str) -> None:
    """Refuse a metric name the text format cannot carry."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(f"metric name {name!r} is not a valid Prometheus name")


def _label_key(labels: dict[str, object], reserved: tuple[str, ...] = ()) -> LabelKey:
    """Normalise keyword labels into a sorted tuple of (name, str(value))."""
    for k in labels:
        if not _LABEL_RE.match(k) or k.startswith("__") or k in reserved:
            raise ConfigError(f"label name {k!r} is not allowed")
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


class _Histogram:
    """One label set's bucket counts (non-cumulative), sum and count."""

    __slots__ = ("count", "counts", "total")

    def __init__(self, n_buckets: int) -> None:
        self.counts = [0] * (n_buckets + 1)  # last slot is the +Inf overflow
        self.total = 0.0
        self.count = 0


def estimate_quantile(q: float, bounds: tuple[float, ...], counts: list[int],
                      low: float = 0.0, high: float = math.inf) -> float:
    """Estimate the q-quantile from non-cumulative bucket counts by linear interpolation.

    Like Prometheus' histogram_quantile, but clamped to the observed [low, high],
    so a sample in the +Inf bucket yields the largest value seen, not a bound.
    Returns NaN when there are no observations.
    """
    count = sum(counts)
    if count == 0:
        return math.nan
    rank = q * count
    cumulative = 0
    for i, n in enumerate(counts):
        if n and cumulative + n >= rank:
            lower = bounds[i - 1] if i > 0 else min(0.0, low)
            upper = bounds[i] if i < len(bounds) else high
            lower = max(lower, low)
            upper = min(upper, high)
            if upper <= lower:
                return float(upper)
            return lower + (upper - lower) * ((rank - cumulative) / n)
        cumulative += n
    return float(high)


class Metrics:
    """Thread-safe counters, histograms and gauges under one namespace."""

    def __init__(self, namespace: str, buckets: Iterable[float] = LATENCY_BUCKETS,
                 labels: dict[str, object] | None = None) -> None:
        """Create an empty set; `namespace` prefixes every exposed name (`<ns>_<name>`), `labels` label every series."""
        if namespace:
            _check_name(namespace)
        self.namespace = namespace
        self._const: LabelKey = _label_key(labels or {}, reserved=("le",))
        self.buckets = tuple(sorted(float(b) for b in buckets))
        if not self.buckets or any(math.isinf(b) or math.isnan(b) for b in self.buckets):
            raise ConfigError("buckets must be finite numbers, at least one")
        self._lock = threading.Lock()
        self._kinds: dict[str, str] = {}
        self._help: dict[str, str] = {}
        self._counters: dict[str, dict[LabelKey, float]] = {}
        self._gauges: dict[str, dict[LabelKey, float]] = {}
        self._gauge_fns: dict[str, Callable[[], float]] = {}
        self._counter_fns: dict[str, Callable[[], float]] = {}
        self._histograms: dict[str, dict[LabelKey, _Histogram]] = {}
        self._component: tuple[object, str] | None = None  # (its claim, its name) while a component holds it
        self._fn_owners: dict[str, object] = {}  # gauge name -> the claim whose gauge_fn it is

    # ---- recording -------------------------------------------------------

    def _claim(self, name: str, kind: str) -> None:
        """Bind a name to one kind on first use; refuse reuse as another kind (lock held)."""
        have = self._kinds.get(name)
        if have is None:
            _check_name(self.full_name(name))
            self._kinds[name] = kind
        elif have != kind:
            raise ConfigError(f"metric {name!r} is a {have}, not a {kind}")

    @property
    def labels(self) -> dict[str, str]:
        """The labels every series of this set carries."""
        return dict(self._const)

    def label(self, **labels: object) -> None:
        """Adds labels every series carries (a component's rank and role); ConfigError for one set otherwise.

        A label already set to another value means two components share this Metrics:
        their series would merge, so each needs its own.
        """
        key = _label_key(labels, reserved=("le",))
        with self._lock:
            have = dict(self._const)
            clash = {k: (have[k], v) for k, v in key if k in have and have[k] != v}
            if clash:
                raise ConfigError(f"metrics {self.namespace!r} already labelled "
                                  + ", ".join(f"{k}={old!r} (not {new!r})" for k, (old, new) in sorted(clash.items()))
                                  + ": give each component a Metrics of its own")
            keys: list[LabelKey] = [k for table in (self._counters, self._gauges) for s in table.values() for k in s]
            keys += [k for s in self._histograms.values() for k in s]
            used = {name for labelled in keys for name, _ in labelled}
            taken = used & {k for k, _ in key}
            if taken:
                raise ConfigError(f"label {sorted(taken)[0]!r} is already a series label of {self.namespace!r}")
            have.update(key)
            self._const = tuple(sorted(have.items()))

    def claim(self, component: str) -> MetricsClaim:
        """Marks this set as the one `component` (a sender pool, a session manager) records into, until the
        returned claim is called (its close); ConfigError while another component holds it.

        Two open components of one role and rank on one set would write the same series: their
        counters would add up unseen and the second's gauges (queue_depth, ...) would hide the
        first's. So each open component needs a set of its own; a set its component let go of
        (closed) may serve the next one, whose counters go on from where the first's stopped.
        The gauges the component registered through its claim (`claim.gauge_fn`) leave the set
        when it lets go: a set that outlives it neither reads its closed parts nor keeps them alive.
        """
        token = object()
        with self._lock:
            if self._component is not None:
                raise ConfigError(f"metrics {self.namespace!r} already record {self._component[1]}, which is not "
                                  f"closed: {component} would write the same series (its gauges hiding the first's, "
                                  f"its counters merging with them): give each a Metrics of its own, or close the "
                                  f"first before reusing its Metrics")
            self._component = (token, component)
        return MetricsClaim(self, token)

    def _release(self, token: object) -> None:
        """Lets go of the set if `token` holds it, dropping the gauges registered under it."""
        with self._lock:
            if self._component is not None and self._component[0] is token:
                self._component = None
            for name in [name for name, owner in self._fn_owners.items() if owner is token]:
                del self._fn_owners[name]
                self._gauge_fns.pop(name, None)

    def _owned_gauge_fn(self, token: object, name: str, fn: Callable[[], float]) -> None:
        """gauge_fn() for the component holding the set under `token`; nothing once it let go."""
        if not callable(fn):
            raise ConfigTypeError(f"gauge_fn {name!r}: fn is not callable")
        with self._lock:
            if self._component is None or self._component[0] is not token:
                return
            self._claim(name, "gauge")
            self._gauge_fns[name] = fn
            self._fn_owners[name] = token

    def _series_key(self, labels: dict[str, object], reserved: tuple[str, ...] = ()) -> LabelKey:
        """A series' own label key; the set's labels and `reserved` may not be among them."""
        if not labels:
            return ()
        return _label_key(labels, reserved=reserved + tuple(k for k, _ in self._const))

    def describe(self, name: str, help_text: str) -> None:
        """Set the HELP text of a metric (defaults: KNOWN_HELP, else the name spelled out)."""
        with self._lock:
            self._help[name] = help_text

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        """Add a finite non-negative amount to a counter (ConfigError otherwise)."""
        if not 0 <= amount < math.inf:  # _check_amount's test, its call only to refuse
            _check_amount(name, amount)
        key = self._series_key(labels) if labels else ()
        counters = self._counters
        with self._lock:
            # There once claimed as a counter.
            series = counters[name] if name in counters else self._series(counters, name, "counter")
            series[key] = (series[key] if key in series else 0) + amount  # series.get(key, 0), without its call

    def inc_all(self, amounts: dict[str, float], observations: dict[str, float] | None = None) -> None:
        """Adds to unlabelled counters and records one observation in each of unlabelled histograms, all
        under one hold of the lock: no read sees some of them and not the others (a room's Success with
        its latency and bytes). ConfigError for an amount inc() refuses or a NaN, recording nothing."""
        # The dicts are read by key, not through items() (a call each loop).
        for name in amounts:
            amount = amounts[name]
            if not 0 <= amount < math.inf:  # _check_amount's test, its call only to refuse
                _check_amount(name, amount)
        observed = []
        if observations:
            for name in observations:
                value = float(observations[name])
                if value != value:  # NaN: _checked_value refuses it
                    _checked_value(name, value)
                # _bucket_index(), in one call: the bounds are sorted.
                observed.append((name, value, bisect_left(self.buckets, value)))
        counters, histograms = self._counters, self._histograms
        with self._lock:
            # Every name claimed before any series moves: a name claimed as another kind records nothing.
            for name in amounts:
                if name not in counters:
                    self._series(counters, name, "counter")
            for name, _, _ in observed:
                if name not in histograms:
                    self._series(histograms, name, "histogram")
            for name in amounts:
                series = counters[name]
                # As inc() adds: 0 + amount for a series' first count, without get()'s call.
                series[()] = series[()] + amounts[name] if () in series else 0 + amounts[name]
            for name, value, index in observed:
                self._record(histograms[name], (), value, index)

    def inc_all_observing(self, amounts: dict[str, float], name: str, values: list[float]) -> None:
        """inc_all(amounts_i, {name: value_i}) for several values at once, `amounts` the sums of the amounts_i:
        adds `amounts` to unlabelled counters and records each of `values`, in order, in the unlabelled
        histogram `name`, all under one hold of the lock (the Successes of the rooms one read of a status socket
        concluded: their count, their bytes and each one's latency). ConfigError for an amount or value inc_all()
        refuses, recording nothing."""
        for counter in amounts:
            amount = amounts[counter]
            if not 0 <= amount < math.inf:  # _check_amount's test, its call only to refuse
                _check_amount(counter, amount)
        buckets = self.buckets
        # Each value with its bucket (_bucket_index(), in one call: the bounds are sorted).
        observed = [(value, bisect_left(buckets, value)) for value in map(float, values)]
        for value, _ in observed:
            if value != value:  # NaN: _checked_value refuses it
                _checked_value(name, value)
        counters, histograms = self._counters, self._histograms
        with self._lock:
            # Every name claimed before any series moves, as inc_all() claims them.
            for counter in amounts:
                if counter not in counters:
                    self._series(counters, counter, "counter")
            if observed and name not in histograms:
                self._series(histograms, name, "histogram")
            for counter in amounts:
                series = counters[counter]
                # As inc() adds: 0 + amount for a series' first count, without get()'s call.
                series[()] = series[()] + amounts[counter] if () in series else 0 + amounts[counter]
            if observed:
                held = histograms[name]
                if () not in held:
                    held[()] = _Histogram(len(buckets))
                hist = held[()]
                counts = hist.counts
                for value, index in observed:  # _record() of each, in order
                    counts[index] += 1
                    hist.total += value
                    hist.count += 1

    def _series(self, store: dict, name: str, kind: str) -> dict:
        """`name`'s series by label key in `store` (self._counters or self._histograms, as `kind` says), the name
        claimed as that kind the first time (_lock held)."""
        series = store.get(name)  # there once claimed as that kind
        if series is None:
            self._claim(name, kind)
            series = store.setdefault(name, {})
        return series

    def _record(self, series: dict, key: tuple, value: float, index: int) -> None:
        """One observation in bucket `index` of the histogram at `key` of `series` (_lock held)."""
        hist = series.get(key)
        if hist is None:
            hist = series[key] = _Histogram(len(self.buckets))
        hist.counts[index] += 1
        hist.total += value
        hist.count += 1

    def histogram(self, name: str, **labels: object) -> None:
        """Creates a histogram series with no observations yet (so it is exposed before the first)."""
        key = self._series_key(labels, reserved=("le",))
        with self._lock:
            self._claim(name, "histogram")
            series = self._histograms.setdefault(name, {})
            if key not in series:
                series[key] = _Histogram(len(self.buckets))

    def observe(self, name: str, value: float, **labels: object) -> None:
        """Record one observation (seconds, for latencies) in a histogram."""
        value = _checked_value(name, value)
        key = self._series_key(labels, reserved=("le",)) if labels else ()
        index = bisect_left(self.buckets, value)  # _bucket_index(), in one call: the bounds are sorted
        with self._lock:
            self._record(self._series(self._histograms, name, "histogram"), key, value, index)

    def set_gauge(self, name: str, value: float, **labels: object) -> None:
        """Set a gauge to a number, read as a gauge_fn's is (an int stays one); ConfigTypeError for anything
        else, which no read could render."""
        try:
            value = value if type(value) is int else float(value)
        except (TypeError, ValueError):
            raise ConfigTypeError(f"gauge {name!r} takes a number, not {value!r}") from None
        key = self._series_key(labels)
        with self._lock:
            self._claim(name, "gauge")
            self._gauges.setdefault(name, {})[key] = value

    def gauge_fn(self, name: str, fn: Callable[[], float]) -> None:
        """Make a gauge whose value is `fn()` evaluated at read time (e.g. a queue's depth)."""
        if not callable(fn):
            raise ConfigTypeError(f"gauge_fn {name!r}: fn is not callable")
        with self._lock:
            self._claim(name, "gauge")
            self._gauge_fns[name] = fn
            self._fn_owners.pop(name, None)  # the caller's now: it stays when a component lets go

    def counter_fn(self, name: str, fn: Callable[[], float]) -> None:
        """Make a counter whose value is `fn()` evaluated at read time; `fn` must only ever grow."""
        if not callable(fn):
            raise ConfigTypeError(f"counter_fn {name!r}: fn is not callable")
        with self._lock:
            self._claim(name, "counter")
            self._counter_fns[name] = fn

    # ---- reading ---------------------------------------------------------

    def full_name(self, name: str) -> str:
        """The exposed name: `<namespace>_<name>`, or `name` without a namespace."""
        return f"{self.namespace}_{name}" if self.namespace else name

    def help_text(self, name: str) -> str:
        """HELP text for a metric."""
        return self._help.get(name) or KNOWN_HELP.get(name) or name.replace("_", " ")

    def _read(self) -> tuple[dict, dict, dict, dict]:
        """Copy every series under the lock, then evaluate callables outside it; keys carry the set's labels."""
        with self._lock:
            counters = {n: dict(s) for n, s in self._counters.items()}
            gauges = {n: dict(s) for n, s in self._gauges.items()}
            fns = [(gauges, n, fn) for n, fn in self._gauge_fns.items()]
            fns += [(counters, n, fn) for n, fn in self._counter_fns.items()]
            hists = {
                n: {k: (list(h.counts), h.total, h.count) for k, h in s.items()}
                for n, s in self._histograms.items()
            }
            kinds = dict(self._kinds)
            const = self._const
        # A callable may take its own locks (a queue's), so never call it under ours.
        for into, name, fn in fns:
            try:
                value = fn()
                into.setdefault(name, {})[()] = value if type(value) is int else float(value)
            except Exception:  # a broken callable must not break a scrape
                into.setdefault(name, {})[()] = math.nan
        if const:
            def labelled(k: LabelKey) -> LabelKey:
                return tuple(sorted(const + k))

            counters = {n: {labelled(k): v for k, v in s.items()} for n, s in counters.items()}
            gauges = {n: {labelled(k): v for k, v in s.items()} for n, s in gauges.items()}
            hists = {n: {labelled(k): v for k, v in s.items()} for n, s in hists.items()}
        return kinds, counters, gauges, hists

    def samples(self) -> list[tuple[str, str, str, LabelKey, float]]:
        """Every sample as (metric, kind, sample name, labels, value), in exposition order.

        The names are the exposed ones; a histogram gives cumulative `_bucket` samples
        (with `le`), then `_sum` and `_count`, per label set.
        """
        kinds, counters, gauges, hists = self._read()
        out: list[tuple[str, str, str, LabelKey, float]] = []
        for name in sorted(kinds):
            kind, full = kinds[name], self.full_name(name)
            if kind == "histogram":
                for key, (counts, total_, count) in sorted(hists.get(name, {}).items()):
                    cumulative = 0
                    for bound, n in zip(self.buckets + (math.inf,), counts):
                        cumulative += n
                        le = format_value(float(bound))
                        out.append((name, kind, f"{full}_bucket", key + (("le", le),), cumulative))
                    out.append((name, kind, f"{full}_sum", key, float(total_)))
                    out.append((name, kind, f"{full}_count", key, count))
            else:
                for key, value in sorted((counters if kind == "counter" else gauges).get(name, {}).items()):
                    out.append((name, kind, full, key, value))
        return out

    def snapshot(self) -> list[dict]:
        """Every sample as a flat row `{"name", "type", "labels", "value"}`, named and labelled as Prometheus sees it.

        JSON-serializable (a gauge whose callable failed reads None); ship it as is:
        one row per series, counters exist at zero from the start.
        """
        return [{"name": sample, "type": kind, "labels": dict(key), "value": _json_number(value)}
                for _, kind, sample, key, value in self.samples()]

    def prometheus_text(self) -> str:
        """The metrics in the Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        current = None
        for name, kind, sample, key, value in self.samples():
            if name != current:
                current = name
                full = self.full_name(name)
                lines.append(f"# HELP {full} {escape_help(self.help_text(name))}")
                lines.append(f"# TYPE {full} {kind}")
            lines.append(f"{sample}{_labels_text(key)} {format_value(value)}")
        return "\n".join(lines) + "\n" if lines else ""

    # ---- exposing --------------------------------------------------------

    def serve(self, host: str = "127.0.0.1", port: PortSpec = 0) -> MetricsServer:
        """Start a /metrics endpoint for this set in a daemon thread; close() stops it."""
        return MetricsServer([self], host=host, port=port)

    def register_with_prometheus_client(self, registry: Any = None) -> _PrometheusCollector:
        """Register a Collector for these metrics in `registry` (default: the global one); returns it."""
        try:
            from prometheus_client import REGISTRY
        except ImportError as e:
            raise ImportError(
                "register_with_prometheus_client needs prometheus_client: "
                "pip install 'epd-transfer[metrics]' (or pip install prometheus_client)"
            ) from e
        collector = _PrometheusCollector(self)
        (registry if registry is not None else REGISTRY).register(collector)
        return collector


class MetricsClaim:
    """A component's hold on a Metrics (Metrics.claim): call it to let go (idempotent; an old claim
    frees nothing its successor holds), taking the gauges registered through it along."""

    __slots__ = ("_metrics", "_token")

    def __init__(self, metrics: Metrics, token: object) -> None:
        self._metrics = metrics
        self._token = token

    def gauge_fn(self, name: str, fn: Callable[[], float]) -> None:
        """Metrics.gauge_fn for the component: the gauge is read while it holds the set, and gone after."""
        self._metrics._owned_gauge_fn(self._token, name, fn)

    def __call__(self) -> None:
        """Lets go of the set."""
        self._metrics._release(self._token)


def _check_amount(name: str, amount: float) -> None:
    """ConfigError for a counter amount that is not finite and non-negative (NaN too: a counter stuck at NaN
    says nothing again)."""
    if not 0 <= amount < math.inf:
        raise ConfigError(f"counter {name!r} takes a finite non-negative amount, not {amount}")


def _checked_value(name: str, value: float) -> float:
    """A histogram observation as a float; ConfigError for NaN."""
    value = float(value)
    if math.isnan(value):
        raise ConfigError(f"histogram {name!r} got NaN")
    return value


def _bucket_index(bounds: tuple[float, ...], value: float) -> int:
    """Index of the first bucket whose upper bound is >= value (len(bounds) for +Inf): the rule that
    bisect_left() of the sorted bounds reads in one call where a value is recorded."""
    for i, bound in enumerate(bounds):
        if value <= bound:
            return i
    return len(bounds)


def _json_number(value: float) -> float | None:
    """JSON has no NaN/Inf: map them to None so json.dumps(strict) works."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


class _PrometheusCollector:
    """A prometheus_client Collector that reads a Metrics at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        """The families recorded or declared so far, so that a registry refuses a second collector whose
        names clash (two managers of one role, or one Metrics registered twice): a scrape with a
        family twice is refused whole."""
        return list(self.collect())

    def collect(self):
        """Yield one metric family per series name, from the same samples as the text format."""
        from prometheus_client.core import Metric

        m = self.metrics
        family, current = None, None
        for name, kind, sample, key, value in m.samples():
            if family is None or name != current:
                if family is not None:
                    yield family
                current, full = name, m.full_name(name)
                # prometheus_client names a counter family without its _total and adds it back.
                family = Metric(full.removesuffix("_total") if kind == "counter" else full, m.help_text(name), kind)
            family.add_sample(sample, dict(key), value)
        if family is not None:
            yield family


class MetricsServer:
    """A tiny HTTP server: GET /metrics (text format) and /stats (JSON snapshot); HEAD answers as GET does,
    headers only.

    Bounded for a network anyone may reach: one request per connection, each given
    `request_timeout_s` in all (a silent or dripping client is dropped then), and at
    most `max_connections` served at once, a quarter of them from one address (503 beyond, at once).
    """

    def __init__(self, sources: list[Metrics], host: str = "127.0.0.1", port: PortSpec = 0,
                 max_connections: int = 64, request_timeout_s: float = 10.0) -> None:
        """Bind host:port and start serving in a daemon thread.

        `port`: a port, 0 (any free one), or a range, `(9400, 9410)` or `"9400-9410"` (its
        first free port; `.port` says which); `PortsInUse` when none of it is free.
        """
        self.sources = list(sources)
        seen: set[str] = set()
        for source in self.sources:
            if not isinstance(source, Metrics):
                raise ConfigTypeError(f"metric source {source!r} is not a Metrics "
                                f"(serve(*sources, host=..., port=...) takes host and port by name)")
            # Two families of one name in one exposition make Prometheus reject the scrape: a
            # namespace that extends another (a, a_b) could give a_b_c_total from both.
            for other in seen:
                if _overlapping(source.namespace, other):
                    raise ConfigError(f"metric sources with the namespaces {other!r} and {source.namespace!r} "
                                      f"could name the same family: give each its own (Metrics(namespace=...)), "
                                      f"neither a prefix of the other")
            seen.add(source.namespace)
        handler = _make_handler(self, request_timeout_s)
        server_class = _MetricsHTTPServer.for_host(host)

        def bind(number: int) -> BoundedHTTPServer:
            try:
                return server_class((host, number), handler)
            except OSError as error:
                raise listen_error("metrics endpoint", host, number, error, reached="the endpoint") from None

        self._httpd = bind_port(port, bind, f"metrics endpoint on {host}")
        self._httpd.max_handlers = max_connections
        address = self._httpd.server_address  # an IP socket's: (host text, port, ...)
        self.host, self.port = str(address[0]), int(address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
            name=f"metrics-http-{self.port}", daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """The /metrics URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def render_text(self) -> str:
        """All sources' text, concatenated (namespaces keep names apart)."""
        return "".join(s.prometheus_text() for s in self.sources)

    def render_json(self) -> str:
        """All sources' snapshot rows as one JSON list (each row's name carries its namespace)."""
        return json.dumps([row for s in self.sources for row in s.snapshot()])

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _overlapping(one: str, other: str) -> bool:
    """Whether two namespaces are equal or one extends the other (`a` and `a_b`)."""
    return (one + "_").startswith(other + "_") or (other + "_").startswith(one + "_")


class _MetricsHTTPServer(BoundedHTTPServer):
    """The bounded HTTP server behind a MetricsServer."""

    busy_text = b"metrics endpoint busy: too many connections at once"
    client_busy_text = b"metrics endpoint busy: too many connections from this address at once"
    log = logging.getLogger(__name__)  # request errors go to this module's log


def serve(*sources: Metrics, host: str = "127.0.0.1", port: PortSpec = 0) -> MetricsServer:
    """Serve several Metrics (e.g. session manager and sender pool) on one /metrics endpoint."""
    return MetricsServer(list(sources), host=host, port=port)


def _make_handler(server: MetricsServer, request_timeout_s: float) -> type[BaseHTTPRequestHandler]:
    """A request handler bound to one MetricsServer."""

    class Handler(OneDeadlineHandler):
        # One request per connection, read within `timeout` seconds in all.
        timeout = request_timeout_s

        def do_GET(self) -> None:  # http.server's naming
            """Answer /metrics and /stats; 404 for anything else."""
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body = server.render_text().encode()
                ctype = "text/plain; version=0.0.4; charset=utf-8"
            elif path == "/stats":
                body = server.render_json().encode()
                ctype = "application/json"
            else:
                self.send_error(404, "only /metrics and /stats are served")
                return
            self._send(200, body, ctype)  # a HEAD request's without its body

        def do_HEAD(self) -> None:  # http.server's naming
            """Answer as GET does, headers only (a probe's or a load balancer's check)."""
            self.do_GET()

        def log_message(self, format: str, *args) -> None:
            """Stay quiet: a scraper every few seconds would flood stderr."""

    return Handler

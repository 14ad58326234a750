"""A fixed set of metric series, their text exposition and their flat snapshot, shared by the unit and live metrics tests."""

from __future__ import annotations

from transfer.metrics import Metrics


def small_example() -> Metrics:
    """A fixed set of series used by the golden tests."""
    m = Metrics("epd", buckets=(0.01, 0.1, 1), labels={"rank": 0, "role": "prefill"})
    m.inc("rooms_started_total", 2)
    m.inc("rooms_failed_total", reason="checksum")
    m.inc("rooms_failed_total", 3, reason='we"ird\\re\nason')
    m.set_gauge("queue_depth", 3)
    m.describe("queue_depth", "Items waiting\nto be sent.")
    for v in (0.005, 0.05, 2.0):
        m.observe("room_latency_seconds", v)
    return m


GOLDEN = """\
# HELP epd_queue_depth Items waiting\\nto be sent.
# TYPE epd_queue_depth gauge
epd_queue_depth{rank="0",role="prefill"} 3
# HELP epd_room_latency_seconds Seconds from a room's start to its Success.
# TYPE epd_room_latency_seconds histogram
epd_room_latency_seconds_bucket{rank="0",role="prefill",le="0.01"} 1
epd_room_latency_seconds_bucket{rank="0",role="prefill",le="0.1"} 2
epd_room_latency_seconds_bucket{rank="0",role="prefill",le="1.0"} 2
epd_room_latency_seconds_bucket{rank="0",role="prefill",le="+Inf"} 3
epd_room_latency_seconds_sum{rank="0",role="prefill"} 2.055
epd_room_latency_seconds_count{rank="0",role="prefill"} 3
# HELP epd_rooms_failed_total Rooms concluded Failed, by failure kind.
# TYPE epd_rooms_failed_total counter
epd_rooms_failed_total{rank="0",reason="checksum",role="prefill"} 1
epd_rooms_failed_total{rank="0",reason="we\\"ird\\\\re\\nason",role="prefill"} 3
# HELP epd_rooms_started_total Rooms started: filed by receive() (before its ask goes out) or accepted by send().
# TYPE epd_rooms_started_total counter
epd_rooms_started_total{rank="0",role="prefill"} 2
"""

_RANK = {"rank": "0", "role": "prefill"}

#: small_example().snapshot(): the same samples as GOLDEN, one row each.
GOLDEN_SNAPSHOT = [
    {"name": "epd_queue_depth", "type": "gauge", "labels": _RANK, "value": 3},
    {"name": "epd_room_latency_seconds_bucket", "type": "histogram", "labels": {**_RANK, "le": "0.01"}, "value": 1},
    {"name": "epd_room_latency_seconds_bucket", "type": "histogram", "labels": {**_RANK, "le": "0.1"}, "value": 2},
    {"name": "epd_room_latency_seconds_bucket", "type": "histogram", "labels": {**_RANK, "le": "1.0"}, "value": 2},
    {"name": "epd_room_latency_seconds_bucket", "type": "histogram", "labels": {**_RANK, "le": "+Inf"}, "value": 3},
    {"name": "epd_room_latency_seconds_sum", "type": "histogram", "labels": _RANK, "value": 2.055},
    {"name": "epd_room_latency_seconds_count", "type": "histogram", "labels": _RANK, "value": 3},
    {"name": "epd_rooms_failed_total", "type": "counter", "labels": {**_RANK, "reason": "checksum"}, "value": 1},
    {"name": "epd_rooms_failed_total", "type": "counter", "labels": {**_RANK, "reason": 'we"ird\\re\nason'},
     "value": 3},
    {"name": "epd_rooms_started_total", "type": "counter", "labels": _RANK, "value": 2},
]

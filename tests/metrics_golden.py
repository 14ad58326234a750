"""A fixed set of metric series and their text exposition, shared by the unit and live metrics tests."""

from __future__ import annotations

from transfer.metrics import Metrics


def small_example() -> Metrics:
    """A fixed set of series used by the golden text test."""
    m = Metrics("epd", buckets=(0.01, 0.1, 1))
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
epd_queue_depth 3
# HELP epd_room_latency_seconds Seconds from a room's start to its Success.
# TYPE epd_room_latency_seconds histogram
epd_room_latency_seconds_bucket{le="0.01"} 1
epd_room_latency_seconds_bucket{le="0.1"} 2
epd_room_latency_seconds_bucket{le="1.0"} 2
epd_room_latency_seconds_bucket{le="+Inf"} 3
epd_room_latency_seconds_sum 2.055
epd_room_latency_seconds_count 3
# HELP epd_rooms_failed_total Rooms concluded Failed, by failure kind.
# TYPE epd_rooms_failed_total counter
epd_rooms_failed_total{reason="checksum"} 1
epd_rooms_failed_total{reason="we\\"ird\\\\re\\nason"} 3
# HELP epd_rooms_started_total Rooms started (ask sent or item accepted).
# TYPE epd_rooms_started_total counter
epd_rooms_started_total 2
"""

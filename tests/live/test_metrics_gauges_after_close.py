"""A component's read-at-scrape gauges leave its Metrics when it closes: a set that outlives it (served by
an endpoint, or handed to the next component) neither reads the closed parts nor keeps them alive."""

from __future__ import annotations

import gc
import weakref

from live_helpers import HOST

SLOT = 4096


def _gauges(rows: list[dict]) -> set[str]:
    return {row["name"] for row in rows if row["type"] == "gauge"}


def test_a_closed_managers_pool_gauges_leave_its_metrics_and_free_the_pool(engines, server):
    import torch

    from transfer.buffers import ReceivePool
    from transfer.metrics import Metrics
    from transfer.receiver import SessionManager

    _, prefill_engine = engines
    shared = Metrics("epd_kept")
    pool = ReceivePool(prefill_engine, 4 * SLOT, SLOT)
    with pool, SessionManager(prefill_engine, 0, 1, 1, pool=pool, host=HOST, metrics=shared):
        assert _gauges(shared.snapshot()) == {"epd_kept_rooms_in_flight", "epd_kept_cancels_set_aside",
                                              "epd_kept_quarantined_slots", "epd_kept_fallback_bytes"}
    assert _gauges(shared.snapshot()) == set(), "a closed manager's gauges are still read"
    assert "quarantined_slots" not in shared.prometheus_text()
    gone = weakref.ref(pool)
    del pool
    gc.collect()
    assert gone() is None, "the Metrics keeps the closed pool (and its memory) alive"
    buf = torch.zeros(64, dtype=torch.uint8)
    with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, metrics=shared):
        assert _gauges(shared.snapshot()) == {"epd_kept_rooms_in_flight", "epd_kept_cancels_set_aside"}, \
            "a pool's gauges without a pool"


def test_a_closed_sender_pools_gauges_leave_its_metrics(engines, server):
    from transfer.metrics import Metrics
    from transfer.sender import SenderPool

    encode_engine, _ = engines
    shared = Metrics("epd_kept_encode")
    with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, metrics=shared):
        assert _gauges(shared.snapshot()) == {"epd_kept_encode_queue_depth", "epd_kept_encode_parked_rooms"}
    assert _gauges(shared.snapshot()) == set(), "a closed pool's gauges are still read"
    counters = {row["name"] for row in shared.snapshot() if row["type"] == "counter"}
    assert "epd_kept_encode_rooms_started_total" in counters, "counters stay: the next pool goes on from them"

"""statuses_dropped_total over real sender pools: it counts each status dropped as it is dropped, so it
only ever grows, also across the pools one Metrics serves in turn (a pool restarted in its process)."""

from __future__ import annotations

from live_helpers import DTYPE, HOST, junk_pusher, pointer, wait_until

from transfer.metrics import Metrics, total

DROPPED = "epd_encode_statuses_dropped_total"


def _ask_from_a_dead_receiver(port: int, room: int) -> None:
    """An ask whose status endpoint (port 1 of loopback) never connects: the Failed status its room gets when
    the pool closes is dropped."""
    push = junk_pusher(HOST, port)
    try:
        push.send_multipart([str(room).encode(), HOST.encode(), b"1", b"dead", pointer(4096), pointer(0), b"4",
                             b"4", DTYPE.encode(), b"0", b"1", b"0", b"4"])
    finally:
        push.close(linger=1000)


def test_the_count_of_dropped_statuses_carries_on_across_the_pools_of_one_metrics(engines, server):
    from transfer.sender import SenderPool

    encode_engine, _ = engines
    metrics = Metrics("epd_encode")
    with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, metrics=metrics) as first:
        assert total(first.stats(), DROPPED) == 0
        _ask_from_a_dead_receiver(first.port, 7)
        assert wait_until(lambda: first._core.parked.get(7) is not None, 10)
    assert total(metrics.snapshot(), DROPPED) == 1
    with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, metrics=metrics) as second:
        assert total(second.stats(), DROPPED) == 1
        _ask_from_a_dead_receiver(second.port, 8)
        assert wait_until(lambda: second._core.parked.get(8) is not None, 10)
    assert total(metrics.snapshot(), DROPPED) == 2

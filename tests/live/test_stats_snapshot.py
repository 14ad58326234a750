"""stats() on both sides of a real room (Mooncake tcp): flat rows labelled with rank and role, counters
at zero from the start, and a Success the encode rank sent no checksum for counted as unverified."""

from __future__ import annotations

from live_helpers import HOST

from transfer.metrics import ROLE_COUNTERS, total

BF16 = "torch.bfloat16"


def _counters(rows: list[dict]) -> dict[tuple[str, str], float]:
    return {(row["name"], row["labels"].get("reason", "")): row["value"] for row in rows if row["type"] == "counter"}


def test_both_sides_stats_are_flat_labelled_rows_and_an_unchecked_success_counts_unverified(engines, server):
    import torch

    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    encode_engine, prefill_engine = engines
    rows, hidden = 16, 128
    items = [torch.randn(rows, hidden).to(torch.bfloat16) for _ in range(2)]
    for item in items:
        encode_engine.register(item)
    buf = torch.zeros((2, rows, hidden), dtype=torch.bfloat16)
    try:
        # The encode rank sends no checksums, as a peer without our extension does.
        with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, integrity=False) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=10.0) as manager:
            for stats, role in ((sender.stats(), "encode"), (manager.stats(), "prefill")):
                assert stats and all(row["labels"]["rank"] == "0" and row["labels"]["role"] == role for row in stats)
                counters = _counters(stats)
                for name in ROLE_COUNTERS[role]:
                    assert any(key[0] == f"epd_{role}_{name}" for key in counters), name
                assert not any(counters.values()), "a counter was not zero before the first room"
            assert ("epd_encode_statuses_dropped_total", "") in _counters(sender.stats())

            handle = manager.receive(1, server.address, buf[0])
            sent = sender.send(1, items[0])
            assert handle.wait(10) == TransferPoll.Success, handle.failure
            assert sent.wait(10) == TransferPoll.Success, sent.failure
            assert torch.equal(buf[0].view(torch.uint8), items[0].view(torch.uint8))
            handle.clear()
            sent.clear()

            prefill = manager.stats()
            assert total(prefill, "epd_prefill_rooms_succeeded_total") == 1
            assert total(prefill, "epd_prefill_rooms_unverified_total") == 1
            assert total(prefill, "epd_prefill_bytes_received_total") == items[0].numel() * 2
            assert total(prefill, "epd_prefill_room_latency_seconds_count") == 1
            assert total(prefill, "epd_prefill_rooms_failed_total") == 0
            encode = sender.stats()
            assert total(encode, "epd_encode_rooms_succeeded_total") == 1
            assert total(encode, "epd_encode_bytes_written_total") == items[0].numel() * 2
            # The text exposition carries the same series, names and labels.
            text = manager.metrics.prometheus_text()
            assert 'epd_prefill_rooms_unverified_total{rank="0",role="prefill"} 1\n' in text
            assert 'epd_prefill_rooms_failed_total{rank="0",reason="deadline",role="prefill"} 0\n' in text

        # Checksums on both sides: the second room is verified, so the unverified count stays.
        with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=10.0) as manager:
            handle = manager.receive(2, server.address, buf[1])
            sent = sender.send(2, items[1])
            assert handle.wait(10) == TransferPoll.Success, handle.failure
            assert torch.equal(buf[1].view(torch.uint8), items[1].view(torch.uint8))
            assert sent.wait(10) == TransferPoll.Success, sent.failure
            handle.clear()
            sent.clear()
            assert total(manager.stats(), "epd_prefill_rooms_succeeded_total") == 1
            assert total(manager.stats(), "epd_prefill_rooms_unverified_total") == 0
    finally:
        for item in items:
            encode_engine.unregister(item.data_ptr())


def test_a_metrics_set_records_one_open_component_at_a_time(engines, server):
    """Two open sender pools of one rank on one Metrics would write the same series, the second's gauges
    hiding the first's: the second is refused, saying so; once the first closed, the set serves the next
    pool, whose counters go on from the first's. Likewise for session managers."""
    import pytest
    import torch

    from transfer.errors import ConfigError
    from transfer.engine import Engine
    from transfer.metrics import Metrics
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool

    encode_engine, prefill_engine = engines
    shared = Metrics("epd_shared")
    with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, metrics=shared) as first:
        with pytest.raises(ConfigError, match=r"^metrics 'epd_shared' already record the sender pool of encode rank "
                                              r"0, which is not closed: the sender pool of encode rank 0 would write "
                                              r"the same series \(its gauges hiding the first's"):
            SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, metrics=shared)
        handle = first.send(1, torch.zeros(2, 8))
        assert total(shared.snapshot(), "epd_shared_parked_rooms") == 1, "the first pool's gauge is still read"
        handle.clear()
    with SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, metrics=shared) as second:
        assert total(second.stats(), "epd_shared_rooms_started_total") == 1
        assert total(second.stats(), "epd_shared_parked_rooms") == 0, "the gauges read the open pool"
    prefill_metrics = Metrics("epd_shared_prefill")
    buf = torch.zeros(64, dtype=torch.uint8)
    with Engine(HOST, "tcp") as other_engine, \
            SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, metrics=prefill_metrics):
        with pytest.raises(ConfigError, match=r"already record the session manager of prefill rank 0, which is not"):
            SessionManager(other_engine, 0, 1, 1, buffer=torch.zeros(64, dtype=torch.uint8), host=HOST,
                           metrics=prefill_metrics)
        assert other_engine.registered() == {}, "the refused manager registered nothing"

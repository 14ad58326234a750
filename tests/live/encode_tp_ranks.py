"""Rank processes for deployments with several encode ranks: encode ranks serving items over
Mooncake, prefill ranks receiving their rows into pooled slots and rebuilding the full rows
over torch.distributed (gloo), across the whole group or within each encode rank's block."""

from __future__ import annotations

import traceback

HIDDEN = 64
DTYPE = "torch.bfloat16"


def encode_process(rank, encode_tp, bootstrap_addr, rooms, spans, results, stop) -> None:
    """Offers every room to this rank's block and reports the bytes it wrote."""
    try:
        import torch

        from transfer.engine import Engine
        from transfer.harness import ItemSource
        from transfer.metrics import total
        from transfer.sender import SenderPool
        from transfer.status import TransferPoll

        torch.set_num_threads(1)
        source = ItemSource(max(spans.values()), HIDDEN, DTYPE)
        with Engine("127.0.0.1", "tcp") as engine:
            engine.register(source.pool)
            with SenderPool(engine, rank, encode_tp, 1, bootstrap_addr) as pool:
                results.put((f"encode{rank}", "ready"))
                handles = [pool.send(room, source.item(room, spans[room])) for room in rooms]
                statuses = [handle.wait(60) for handle in handles]
                written = total(pool.stats(), "epd_encode_bytes_written_total")
                failures = [h.failure for h, s in zip(handles, statuses) if s != TransferPoll.Success]
                results.put((f"encode{rank}", {"written": int(written), "failures": failures}))
                stop.wait(60)
    except BaseException:  # noqa: BLE001 - the test must hear about it
        results.put((f"encode{rank}", traceback.format_exc()))


def prefill_process(rank, prefill_tp, encode_tp, shards, dist_addr, bootstrap_addr, rooms, spans, results) -> None:
    """Receives this rank's rows of every room, rebuilds the full rows as `shards` says, checks every byte."""
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from transfer.buffers import ReceivePool
        from transfer.engine import Engine
        from transfer.frames import prefill_shard
        from transfer.harness import ItemSource, same_bytes
        from transfer.reassemble import ShardedItem, reassemble
        from transfer.receiver import SessionManager
        from transfer.status import TransferPoll

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{dist_addr}", rank=rank, world_size=prefill_tp,
                                timeout=timedelta(seconds=60))
        fanout = prefill_tp // encode_tp
        # Every rank creates every block's group, in the same order, as torch.distributed requires.
        blocks = [dist.new_group(list(range(e * fanout, (e + 1) * fanout))) for e in range(encode_tp)]
        group = blocks[rank // fanout] if shards == "per_block" else None
        source = ItemSource(max(spans.values()), HIDDEN, DTYPE)
        slot_bytes = -(-max(spans.values()) * HIDDEN * 2 // 16) * 16
        with Engine("127.0.0.1", "tcp") as engine, \
                ReceivePool(engine, len(rooms) * slot_bytes, slot_bytes, quarantine_s=0.1) as slots, \
                SessionManager(engine, rank, prefill_tp, 1, pool=slots, deadline_s=30.0) as manager:
            handles = []
            for room in rooms:
                span = spans[room]
                if shards == "identity":
                    row_start, rows = 0, span
                else:
                    row_start, rows = prefill_shard(span, rank, prefill_tp, encode_tp,
                                                    per_block=shards == "per_block")
                handles.append(manager.receive(room, bootstrap_addr, rows=rows, hidden=HIDDEN, dtype=DTYPE,
                                               row_start=row_start, span=span))
            local = {h.room: h.wait(30) == TransferPoll.Success for h in handles}
            failures = {h.room: h.failure for h in handles if not local[h.room]}
            if shards == "identity":
                agreed = [local[h.room] for h in handles]
            else:
                agreed = reassemble([ShardedItem(h.room, h.rows, local[h.room], shard=h.shard) for h in handles], group)
            outcome = {}
            for handle, ok in zip(handles, agreed):
                full = same_bytes(handle.rows, source.item(handle.room, spans[handle.room]))
                outcome[handle.room] = {"agreed": ok, "full_rows_match": full}
                handle.clear()
            results.put((f"prefill{rank}", {"rooms": outcome, "failures": failures}))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the test must hear about it
        results.put((f"prefill{rank}", traceback.format_exc()))

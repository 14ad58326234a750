"""Rank processes of the end-to-end prefill flow test: an encode rank serving items over
Mooncake, and prefill ranks that receive their shards into pooled slots and rebuild the
full rows among themselves over torch.distributed (gloo)."""

from __future__ import annotations

import time
import traceback

HIDDEN = 128
DTYPE = "torch.bfloat16"


def encode_process(bootstrap_addr, rooms, spans, delayed, delay_s, results, stop) -> None:
    """Sends every room at once, except `delayed`, sent `delay_s` after the others concluded."""
    try:
        import torch

        from transfer.engine import Engine
        from transfer.harness import ItemSource
        from transfer.sender import SenderPool

        torch.set_num_threads(1)
        source = ItemSource(max(spans.values()), HIDDEN, DTYPE)
        with Engine("127.0.0.1", "tcp") as engine:
            engine.register(source.pool)
            with SenderPool(engine, 0, 1, 1, bootstrap_addr) as pool:
                results.put(("encode", "ready"))
                handles = [pool.send(room, source.item(room, spans[room])) for room in rooms if room != delayed]
                # The other rooms conclude once every prefill rank asked: the late one is
                # sent `delay_s` after that, when the ranks' asks for it are that old too.
                for handle in handles:
                    handle.wait(60)
                time.sleep(delay_s)
                pool.send(delayed, source.item(delayed, spans[delayed])).wait(30)
                stop.wait(60)
    except BaseException:  # noqa: BLE001 - the test must hear about it
        results.put(("encode", traceback.format_exc()))


def prefill_process(rank, world, dist_addr, bootstrap_addr, rooms, spans, deadline_s, results) -> None:
    """Receives this rank's shard of every room into a pool slot, then reassembles the batch."""
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from transfer.buffers import ReceivePool
        from transfer.engine import Engine
        from transfer.frames import shard_rows
        from transfer.harness import ItemSource, same_bytes
        from transfer.reassemble import ShardedItem, reassemble
        from transfer.receiver import SessionManager
        from transfer.status import TransferPoll

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{dist_addr}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        source = ItemSource(max(spans.values()), HIDDEN, DTYPE)
        slot_bytes = -(-max(spans.values()) * HIDDEN * 2 // 16) * 16
        with Engine("127.0.0.1", "tcp") as engine, \
                ReceivePool(engine, len(rooms) * slot_bytes, slot_bytes, quarantine_s=0.1) as slots, \
                SessionManager(engine, rank, world, 1, pool=slots, deadline_s=deadline_s) as manager:
            handles = []
            for room in rooms:
                row_start, rows = shard_rows(spans[room], rank, world)
                handles.append(manager.receive(room, bootstrap_addr, rows=rows, hidden=HIDDEN, dtype=DTYPE,
                                               row_start=row_start, span=spans[room]))
            local = {h.room: h.wait(30) == TransferPoll.Success for h in handles}
            items = [ShardedItem(h.room, h.rows, local[h.room], shard=h.shard) for h in handles]
            agreed = reassemble(items)
            outcome = {}
            for handle, ok in zip(handles, agreed):
                full = same_bytes(handle.rows, source.item(handle.room, spans[handle.room]))
                outcome[handle.room] = {"local": local[handle.room], "agreed": ok, "full_rows_match": full}
                handle.clear()
            results.put((f"prefill{rank}", outcome))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the test must hear about it
        results.put((f"prefill{rank}", traceback.format_exc()))

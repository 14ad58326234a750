"""An encode rank process for the integrity tests: serves deterministic items and can
corrupt a landed byte with a second, real one-sided write between the shard's write
and its status (what a stale registration or a wrong pointer does silently)."""

from __future__ import annotations

import traceback


class CorruptingEngine:
    """Wraps an Engine: after the batch that reads `targets`' first source byte lands,
    overwrites the first landed byte with its complement, then lets the status go."""

    def __init__(self, engine, scratch, targets: dict[int, int]) -> None:
        self._engine = engine
        self._scratch = scratch  # a registered uint8 tensor of 1 byte
        self._targets = targets  # source address -> the complement byte to land
        self._batches: dict[int, tuple[str, int, int]] = {}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def write_async(self, session_id, srcs, dsts, lengths):
        batch = self._engine.write_async(session_id, srcs, dsts, lengths)
        if srcs and srcs[0] in self._targets and lengths[0]:
            self._batches[batch] = (session_id, dsts[0], self._targets[srcs[0]])
        return batch

    def poll(self, batch):
        done = self._engine.poll(batch)
        if done:
            self._corrupt(batch)
        return done

    def wait(self, batch, timeout_s=None):
        self._engine.wait(batch, timeout_s)
        self._corrupt(batch)

    def _corrupt(self, batch):
        """Once the shard landed, overwrite its first byte with a second real write."""
        hit = self._batches.pop(batch, None)
        if hit is not None:
            session_id, dst, byte = hit
            self._scratch[0] = byte
            self._engine.write(session_id, [self._scratch.data_ptr()], [dst], [1])


def encode_process(bootstrap_addr, rooms, span, hidden, corrupt, integrity, results, stop) -> None:
    """Serves `rooms` from an ItemSource; corrupts the rooms in `corrupt`; reports statuses."""
    try:
        import torch

        from transfer.engine import Engine
        from transfer.harness import ItemSource
        from transfer.sender import SenderPool

        torch.set_num_threads(1)
        source = ItemSource(span, hidden, "torch.bfloat16")
        with Engine("127.0.0.1", "tcp") as engine:
            engine.register(source.pool)
            scratch = torch.zeros(8, dtype=torch.uint8)
            engine.register(scratch)
            targets = {}
            for room in corrupt:
                item = source.item(room, span)
                targets[item.data_ptr()] = int(item.view(torch.uint8)[0, 0]) ^ 0xFF
            wrapped = CorruptingEngine(engine, scratch, targets)
            with SenderPool(wrapped, 0, 1, 1, bootstrap_addr, integrity=integrity) as pool:
                handles = [pool.send(room, source.item(room, span)) for room in rooms]
                results.put(("ready", None))
                outcome = {h.room: (h.wait(30).name, h.failure) for h in handles}
                results.put(("done", outcome))
                stop.wait(30)
    except BaseException:  # noqa: BLE001 - the test must hear about it
        results.put(("error", traceback.format_exc()))

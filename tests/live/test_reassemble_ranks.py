"""transfer.reassemble across real processes over torch.distributed gloo on 127.0.0.1.

Each world size is spawned once (a module fixture); every rank runs all scenarios
in order and writes what it observed to a JSON file, and the tests below judge
those observations. Item contents are derived from (room, seed), so every rank
can rebuild the original rows and compare bit for bit.
"""

from __future__ import annotations

import datetime
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sharded_rows import GARBAGE, HIDDEN, destination, original, same_bytes

from transfer import reassemble as reassemble_module
from transfer.reassemble import ShardedItem, agree, reassemble


WORLD_SIZES = (2, 4)


def make_item(room: int, span: int, rank: int, size: int, *, dtype: torch.dtype = torch.float32,
              deepstack_k: int = 0, ok: bool = True) -> tuple[ShardedItem, torch.Tensor, torch.Tensor | None]:
    """(item for this rank, its original rows, its original deepstack rows or None)."""
    rows = original(room, span, dtype)
    ds_rows = original(room, span, dtype, HIDDEN * deepstack_k) if deepstack_k else None
    item = ShardedItem(room, destination(rows, rank, size), ok,
                       destination(ds_rows, rank, size) if ds_rows is not None else None)
    return item, rows, ds_rows


class CollectiveCounter:
    """Counts all-gathers and all-reduces by wrapping torch.distributed's functions."""

    NAMES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce")

    def __init__(self) -> None:
        self.calls = {name: 0 for name in self.NAMES}
        self._saved = {}

    def __enter__(self) -> CollectiveCounter:
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapped(*args, _fn=fn, _name=name, **kwargs):
                self.calls[_name] += 1
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    @property
    def gathers(self) -> int:
        """All-gathers of any flavour."""
        return sum(n for name, n in self.calls.items() if name.startswith("all_gather"))


def run_batch(rank: int, size: int, specs: list[dict]) -> dict:
    """Reassemble one batch built from `specs`; report flags, exactness and collective counts."""
    built = [make_item(s["room"], s["span"], rank, size, dtype=getattr(torch, s.get("dtype", "float32")),
                       deepstack_k=s.get("k", 0), ok=s.get("ok_on", {}).get(str(rank), True))
             for s in specs]
    items = [b[0] for b in built]
    before = [(i.full.clone(), None if i.deepstack is None else i.deepstack.clone()) for i in items]
    with CollectiveCounter() as counter:
        flags = reassemble(items)
    exact, untouched = [], []
    for (item, rows, ds_rows), (full0, ds0) in zip(built, before):
        exact.append(same_bytes(item.full, rows) and (ds_rows is None or same_bytes(item.deepstack, ds_rows)))
        untouched.append(same_bytes(item.full, full0) and (ds0 is None or same_bytes(item.deepstack, ds0)))
    return {"flags": flags, "exact": exact, "untouched": untouched, "calls": counter.calls,
            "gathers": counter.gathers}


def scenarios(rank: int, size: int) -> dict:
    """Every scenario, in the same order on every rank."""
    out: dict = {}
    out["plain"] = run_batch(rank, size, [{"room": 1, "span": 10}, {"room": 2, "span": 7},
                                          {"room": 3, "span": 64}])
    out["deepstack"] = run_batch(rank, size, [{"room": 4, "span": 9, "dtype": "bfloat16", "k": 3},
                                              {"room": 5, "span": 13, "dtype": "bfloat16", "k": 2}])
    # Mixed spans, several below the block size (empty shards), one empty item.
    out["mixed"] = run_batch(rank, size, [{"room": 6, "span": 1, "k": 1}, {"room": 7, "span": 2, "k": 1},
                                          {"room": 8, "span": 3, "k": 1}, {"room": 9, "span": 0, "k": 1},
                                          {"room": 10, "span": 17, "k": 1}, {"room": 11, "span": size, "k": 1}])
    # The last rank's room 13 failed: it fails everywhere, rooms 12 and 14 still succeed.
    last = str(size - 1)
    out["one_rank_fails"] = run_batch(rank, size, [{"room": 12, "span": 11},
                                                   {"room": 13, "span": 11, "ok_on": {last: False}},
                                                   {"room": 14, "span": 5, "k": 2}])
    out["all_fail"] = run_batch(rank, size, [{"room": 15, "span": 8, "ok_on": {"0": False}},
                                             {"room": 16, "span": 8, "ok_on": {last: False}}])
    out["only_small"] = run_batch(rank, size, [{"room": 17, "span": 1}])
    out["empty_batch"] = reassemble([])
    # Rank 0 disagrees about room 19's span and room 24's dtype (same size): both fail on all ranks.
    specs = [{"room": 18, "span": 6}, {"room": 19, "span": 5 if rank else 4}, {"room": 20, "span": 3},
             {"room": 24, "span": 4, "dtype": "float16" if rank else "bfloat16"}]
    out["geometry_mismatch"] = run_batch(rank, size, specs)
    # The padded list all_gather, as on a backend without a gather-into-one-tensor.
    saved = reassemble_module._gather_into_supported
    reassemble_module._gather_into_supported = lambda group: False
    try:
        out["list_gather"] = run_batch(rank, size, [{"room": 21, "span": 7, "k": 1}, {"room": 22, "span": 2},
                                                    {"room": 23, "span": 5, "dtype": "float16"}])
    finally:
        reassemble_module._gather_into_supported = saved
    # Identity items: only the agreement.
    with CollectiveCounter() as counter:
        flags = agree([True, rank != 1, True])
    out["identity"] = {"flags": flags, "calls": counter.calls}
    return out


def child(rank: int, size: int, port: int, folder: str) -> None:
    """One rank: join the gloo group, run every scenario, write the observations."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        observed = scenarios(rank, size)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
        json.dump(observed, handle)


def free_port() -> int:
    """An ephemeral port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def world(request, tmp_path_factory):
    """(size, [observations of rank 0 .. size-1]) after one spawned run of all scenarios."""
    size = request.param
    folder = str(tmp_path_factory.mktemp(f"world{size}"))
    mp.spawn(child, args=(size, free_port(), folder), nprocs=size, join=True)
    observed = []
    for rank in range(size):
        with open(os.path.join(folder, f"rank{rank}.json")) as handle:
            observed.append(json.load(handle))
    return size, observed


def _each(world, name):
    """The scenario's observation on every rank."""
    return [ranks[name] for ranks in world[1]]


@pytest.mark.parametrize("name", ["plain", "deepstack", "mixed", "only_small", "list_gather"])
def test_sharded_items_rebuild_bit_exact_on_every_rank(world, name):
    for seen in _each(world, name):
        assert all(seen["flags"]), seen
        assert all(seen["exact"]), seen


def test_one_rank_failing_fails_the_item_everywhere_and_leaves_it_untouched(world):
    for seen in _each(world, "one_rank_fails"):
        assert seen["flags"] == [True, False, True]
        assert seen["exact"][0] and seen["exact"][2]
        assert seen["untouched"][1] and not seen["exact"][1]


def test_all_failed_batch_needs_no_gather(world):
    for seen in _each(world, "all_fail"):
        assert seen["flags"] == [False, False]
        assert all(seen["untouched"])
        assert seen["gathers"] == 0 and seen["calls"]["all_reduce"] == 1


def test_geometry_disagreement_fails_only_that_item(world):
    for seen in _each(world, "geometry_mismatch"):
        assert seen["flags"] == [True, False, True, False]
        assert seen["untouched"][1] and seen["untouched"][3]
        assert seen["exact"][0] and seen["exact"][2]


@pytest.mark.parametrize("name", ["plain", "deepstack", "mixed", "one_rank_fails", "list_gather"])
def test_one_agreement_and_one_gather_per_batch(world, name):
    for seen in _each(world, name):
        assert seen["calls"]["all_reduce"] == 1
        assert seen["gathers"] == 1, seen["calls"]


def test_list_gather_path_uses_plain_all_gather(world):
    for seen in _each(world, "list_gather"):
        assert seen["calls"]["all_gather"] == 1
        assert seen["gathers"] == 1


def test_identity_items_only_agree(world):
    size = world[0]
    for seen in _each(world, "identity"):
        assert seen["flags"] == [True, False, True]
        assert seen["calls"]["all_reduce"] == 1 and sum(seen["calls"].values()) == 1
    assert size >= 2


def test_empty_batch_is_empty(world):
    assert _each(world, "empty_batch") == [[]] * world[0]


STALL_TIMEOUT_S = 3


def stall_child(rank: int, port: int, folder: str) -> None:
    """Rank 0 reassembles; rank 1 joined the group but never reaches reassembly."""
    import time

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S))
    if rank == 1:
        time.sleep(STALL_TIMEOUT_S + 5)  # stuck elsewhere, then gone without a word
        os._exit(0)
    item, _, _ = make_item(1, 8, rank, 2)
    started = time.monotonic()
    message = ""
    try:
        reassemble([item])
        outcome = "returned"
    except Exception as exc:  # noqa: BLE001 - what it raises is the observation
        outcome, message = f"raised {type(exc).__name__}", str(exc)
    took = time.monotonic() - started
    untouched = bool((item.full.view(torch.uint8)[4:] == GARBAGE).all())  # rank 1's rows, never agreed
    with open(os.path.join(folder, "stall.json"), "w") as handle:
        json.dump({"outcome": outcome, "message": message, "took": took, "untouched": untouched}, handle)
    os._exit(0)  # the group cannot be torn down cleanly with its peer stuck


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    """What rank 0 saw reassembling while rank 1 of its group never called reassemble."""
    folder = tmp_path_factory.mktemp("stall")
    mp.spawn(stall_child, args=(free_port(), str(folder)), nprocs=2, join=True)
    with open(folder / "stall.json") as handle:
        return json.load(handle)


def test_a_rank_that_never_reaches_reassembly_costs_the_groups_timeout_not_a_hang(stalled):
    seen = stalled
    assert seen["outcome"].startswith("raised"), seen
    assert "Timed out" in seen["message"], seen  # ended by the group's timeout
    assert seen["took"] >= STALL_TIMEOUT_S - 1, seen  # and not before it
    assert seen["untouched"], "rows outside this rank's shard were written although nothing was agreed"


def test_a_rank_that_never_reaches_reassembly_is_the_reason_given(stalled):
    # The backend's own text (kept) says only that a receive timed out: the error says which of
    # reassemble's collectives it was and what ends it so.
    assert stalled["outcome"] == "raised CollectiveError", stalled
    message = stalled["message"]
    assert message.startswith("reassemble: the agreement's all-reduce over the group's 2 ranks did not complete"), message
    assert "every rank of the group must make the same call" in message, message
    assert "Timed out" in message, message

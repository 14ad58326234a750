"""Scenarios run by the ranks of a gloo group (127.0.0.1), each rank in a process of its own.

A scenario is a function `(rank, size) -> observation` of a test module; every rank writes its
observation (or the traceback it crashed with) as JSON, and the test reads them all. Every wait is
bounded: the group's timeout, a deadline on the rank processes, and a bounded wait for the peers'
files before a rank leaves.
"""

from __future__ import annotations

import datetime
import importlib
import json
import multiprocessing
import os
import time
import traceback

import torch
import torch.distributed as dist
from live_helpers import free_port


def rank_main(module: str, scenario: str, rank: int, size: int, port: int, folder: str,
              group_timeout_s: float) -> None:
    """Join the gloo group, run the scenario, write what it saw, wait (bounded) for the peers, exit."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=group_timeout_s))
        result = {"seen": getattr(importlib.import_module(module), scenario)(rank, size)}
    except BaseException:  # noqa: BLE001 - the test must hear about it
        result = {"crashed": traceback.format_exc()}
    with open(os.path.join(folder, f"rank{rank}.json.tmp"), "w") as handle:
        json.dump(result, handle)
    os.rename(os.path.join(folder, f"rank{rank}.json.tmp"), os.path.join(folder, f"rank{rank}.json"))
    # A rank that leaves early would break a peer still in a collective; wait for the peers' files.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(folder, f"rank{r}.json")) for r in range(size)):
        time.sleep(0.05)
    os._exit(0)  # no teardown: a scenario may have left the group broken on purpose


def run_ranks(module: str, scenario: str, size: int, folder, *, group_timeout_s: float,
              join_s: float) -> list[dict]:
    """Each rank's result for `module.scenario` ({'missing': True, ...} for a rank that wrote none in time)."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(module, scenario, r, size, port, str(folder), group_timeout_s),
                         daemon=True) for r in range(size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + join_s
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
    hung = [proc.is_alive() for proc in procs]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    results = []
    for r in range(size):
        path = os.path.join(str(folder), f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as handle:
                results.append(json.load(handle))
        else:
            results.append({"missing": True, "hung": hung[r], "exitcode": procs[r].exitcode})
    return results


def seen(results: list[dict]) -> list:
    """Every rank's observation; fails naming a rank that crashed or never reported."""
    out = []
    for rank, result in enumerate(results):
        assert "seen" in result, f"rank {rank}: {result}"
        out.append(result["seen"])
    return out

#!/usr/bin/env python3
"""Prints the CPU a write's submission and status checks cost, per call: Mooncake's binding and
our C calls (native/mooncake.c) made bare, and our Engine through either.

Two engines in this process over tcp on 127.0.0.1; each write sleeps `--gap-us` before its
submission and between its checks, as the sender pool does, so every call pays what it
pays after a wake-up. Figures are the thread's CPU clock around each call, medians over
the rounds' medians [range]; the ways take turns within each round. Every write's first and
last bytes are checked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    from transfer.engine import Engine
except ImportError:  # run from a checkout that is not installed: use the in-place build
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from transfer.engine import Engine

cpu_ns = time.thread_time_ns


def engine_with(direct: bool) -> Engine:
    """An engine whose calls go direct or through the binding."""
    os.environ["EPD_MOONCAKE_DIRECT"] = "1" if direct else "0"
    try:
        return Engine("127.0.0.1", "tcp")
    finally:
        del os.environ["EPD_MOONCAKE_DIRECT"]


def timed_writes(submit, check, writes: int, gap_s: float):
    """CPU per submission, per check that found the write in flight, per check that found it done.

    submit(i) starts write i and returns what check() takes; check() returns whether it is over."""
    spent_on: dict[str, list[int]] = {"submit": [], "busy": [], "done": []}
    for i in range(writes):
        time.sleep(gap_s)
        t = cpu_ns()
        handle = submit(i)
        spent_on["submit"].append(cpu_ns() - t)
        while True:
            time.sleep(gap_s)
            t = cpu_ns()
            finished = check(handle)
            spent_on["done" if finished else "busy"].append(cpu_ns() - t)
            if finished:
                break
    return spent_on["submit"], spent_on["busy"], spent_on["done"]


def finished(rc: int, way: str) -> bool:
    """A bare status answer: 1 done, 0 (or -2, late) in flight; anything else failed the write."""
    if rc in (0, -2):
        return False
    if rc != 1:
        raise SystemExit(f"{way} write failed: rc={rc}")
    return True


def run_engine(engine: Engine, session: str, src: int, dst: int, length: int, writes: int, gap_s: float):
    """Our Engine: write_async, poll."""
    return timed_writes(lambda i: engine.write_async(session, [src + i % 2], [dst], [length]), engine.poll,
                        writes, gap_s)


def run_binding(te, session: str, src: int, dst: int, length: int, writes: int, gap_s: float):
    """Mooncake's binding called bare: batch_transfer_async_write, transfer_check_status."""
    return timed_writes(lambda i: te.batch_transfer_async_write(session, [src + i % 2], [dst], [length]),
                        lambda batch: finished(te.transfer_check_status(batch), "binding"), writes, gap_s)


def run_direct(engine: Engine, session: str, src: int, dst: int, length: int, writes: int, gap_s: float):
    """The C calls made bare (native/mooncake.c): mooncake_write, mooncake_check."""
    from transfer import _native
    pointer, handle = engine._direct, engine._handles[session]
    return timed_writes(lambda i: _native.mooncake_write(pointer, handle, src + i % 2, dst, length),
                        lambda batch: finished(_native.mooncake_check(pointer, batch), "direct"), writes, gap_s)


def us(values: list[int]) -> float:
    """Median in microseconds (nan when there were none)."""
    return statistics.median(values) / 1e3 if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="524288,8388608", help="bytes per write, comma-separated")
    parser.add_argument("--writes", type=int, default=300, help="writes per way, size and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-us", type=float, default=200.0, help="sleep before a submission and between checks")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    largest = max(sizes) + 1
    direct, binding, receiver = engine_with(True), engine_with(False), engine_with(False)
    if direct.calls != "direct":
        raise SystemExit(f"the direct calls are off here: {direct.calls_reason}")
    src_t = torch.randint(0, 256, (largest,), dtype=torch.uint8)
    dst_t = torch.zeros(largest, dtype=torch.uint8)
    srcs = {e: e.register(src_t)[0] for e in (direct, binding)}
    dst = receiver.register(dst_t)[0]
    session = receiver.session_id
    for e in (direct, binding):
        e.write(session, [srcs[e]], [dst], [4096])  # opens the segment
    ways = {
        "binding, bare": lambda n, w: run_binding(binding._te, session, srcs[binding], dst, n, w, gap_s),
        "direct, bare": lambda n, w: run_direct(direct, session, srcs[direct], dst, n, w, gap_s),
        "Engine, binding": lambda n, w: run_engine(binding, session, srcs[binding], dst, n, w, gap_s),
        "Engine, direct": lambda n, w: run_engine(direct, session, srcs[direct], dst, n, w, gap_s),
    }
    gap_s = args.gap_us * 1e-6
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for r in range(args.rounds):
        order = list(ways.items())
        order = order[r % len(order):] + order[:r % len(order)]
        for length in sizes:
            for name, fn in order:
                dst_t[:length].zero_()
                submit, busy, done = fn(length, args.writes)
                last = (args.writes - 1) % 2  # the last write's source offset
                for at in (0, length - 1):
                    if int(dst_t[at]) != int(src_t[at + last]):
                        raise SystemExit(f"{name}, {length} bytes: byte {at} did not land")
                results.setdefault((name, length), []).append((us(submit), us(busy), us(done)))
    print(f"CPU per call, us (thread clock; medians of {args.rounds} rounds of {args.writes} writes "
          f"[range]; {args.gap_us:g} us sleeps)")
    print(f"{'way':<18} {'bytes':>9}  {'submission':>18}  {'check, in flight':>18}  {'check, done':>18}")
    for (name, length), rows in results.items():
        cells = []
        for k in range(3):
            vals = [row[k] for row in rows]
            cells.append(f"{statistics.median(vals):6.1f} [{min(vals):.1f}-{max(vals):.1f}]")
        print(f"{name:<18} {length:>9}  {cells[0]:>18}  {cells[1]:>18}  {cells[2]:>18}")
    for e in (direct, binding, receiver):
        e.close()


if __name__ == "__main__":
    main()

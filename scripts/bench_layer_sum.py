#!/usr/bin/env python3
"""Prints layer_sum's throughput next to a plain memcpy of the same buffer (GB/s, best and median)."""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

try:
    from transfer import wire
except ImportError:  # run from a checkout that is not installed: use the in-place build
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from transfer import wire


def timed(fn, reps: int) -> list[float]:
    """Seconds per call over reps calls, after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def row(name: str, nbytes: int, secs: list[float]) -> str:
    """One table line: best and median GB/s (1 GB = 1e9 bytes)."""
    best = nbytes / min(secs) / 1e9
    median = nbytes / statistics.median(secs) / 1e9
    return f"{name:<22} {best:>9.2f} {median:>11.2f}"


def main() -> None:
    """Runs the comparison and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="buffer size in MiB (default 256)")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions (default 9)")
    args = parser.parse_args()
    nbytes = args.mib << 20
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)  # touched below so page faults are not timed
    dst.fill(1)
    unaligned = memoryview(src)[3:]

    rows = [
        ("layer_sum", nbytes, timed(lambda: wire.layer_sum(src), args.reps)),
        ("layer_sum (offset 3)", nbytes - 3, timed(lambda: wire.layer_sum(unaligned), args.reps)),
        ("numpy copyto", nbytes, timed(lambda: np.copyto(dst, src), args.reps)),
        ("ctypes.memmove", nbytes,
         timed(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes), args.reps)),
        ("numpy u64 sum", nbytes, timed(lambda: src.view("<u8").sum(dtype=np.uint64), args.reps)),
    ]
    print(f"buffer {args.mib} MiB, {args.reps} repetitions (memcpy reads and writes; layer_sum only reads)")
    print(f"{'':<22} {'best GB/s':>9} {'median GB/s':>11}")
    for name, n, secs in rows:
        print(row(name, n, secs))


if __name__ == "__main__":
    main()

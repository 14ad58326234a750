#!/usr/bin/env python3
"""Prints where the bench's threads spend their CPU, by library: the interpreter, the kernel, ZMQ,
torch, the C library, Mooncake, our native module.

Runs one `epd-transfer bench` cell (by default 512 KiB, fanout 4, 8 in flight, the epd path,
integrity off, enough rooms for about 20 s), waits for its ranks to start (at most `--start-timeout`
seconds) and then `--delay` seconds more for their warm-up, then samples every CPU with `perf record` for `--seconds` (the timed window: the rooms
in flight, nothing else) and sorts each sample by its thread's group, as `bench --cpu` groups
them (transfer.bench.thread_group: the caller, the driver, ZMQ's I/O threads, other; any other
thread of a rank is the transport), and by the library it ran in. Needs `perf` and the right to
sample every CPU (root, or kernel.perf_event_paranoid at most 0).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from transfer.bench import thread_group
except ImportError:  # run from a checkout that is not installed: use the in-place build
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from transfer.bench import thread_group

CELL = ["--sizes", "64x4096", "--fanouts", "4", "--inflight", "8", "--paths", "epd", "--integrity", "off",
        "--items", "40000"]

#: Library groups, by a part of the shared object's name; the first that matches.
LIBRARIES = (("interpreter", ("libpython", "python3.")), ("kernel", ("[kernel",)), ("ZMQ", ("libzmq",)),
             ("torch", ("torch", "libc10", "libgomp")), ("Mooncake", ("engine.so", "libasio", "store.so", "etcd")),
             ("native", ("_native",)), ("C library", ("libc.so", "ld-linux", "[vdso]", "libstdc++")))


def library(dso: str) -> str:
    """The group of shared object `dso` (a path, or a name such as [kernel.kallsyms])."""
    dso = os.path.basename(dso)
    for name, parts in LIBRARIES:
        if any(part in dso for part in parts):
            return name
    return "other"


def perf_refusal() -> str | None:
    """Why perf cannot sample every CPU here, or None."""
    if shutil.which("perf") is None:
        return "perf is not installed (Debian: apt-get install linux-perf)"
    try:
        paranoid = int(Path("/proc/sys/kernel/perf_event_paranoid").read_text())
    except (OSError, ValueError):
        return "kernel.perf_event_paranoid cannot be read"
    if os.geteuid() != 0 and paranoid > 0:
        return f"sampling every CPU needs root or kernel.perf_event_paranoid <= 0 (it is {paranoid})"
    return None


def descendants(pid: int) -> list[int]:
    """The processes below `pid`."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found.append(child)
                todo.append(child)
    return found


def rank_threads(bench: int) -> dict[int, str]:
    """Each thread of the bench's rank processes (those running an epd-enc or epd-pre thread) to
    'encode <group>' or 'prefill <group>' (group: caller, driver, zmq, other, transport)."""
    groups: dict[int, str] = {}
    for pid in descendants(bench):
        names: dict[int, str] = {}
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                names[int(task.name)] = (task / "comm").read_text().strip()
            except OSError:
                continue
        role = ("encode" if any(n.startswith("epd-enc") for n in names.values())
                else "prefill" if any(n.startswith("epd-pre") for n in names.values()) else None)
        if role is None:
            continue
        for tid, name in names.items():
            groups[tid] = f"{role} {thread_group(name, tid == pid) or 'transport'}"
    return groups


def started(bench: subprocess.Popen, timeout: float) -> dict[int, str] | None:
    """The bench's rank threads (rank_threads()) once both an encode and a prefill rank run their
    control plane's threads, or None when the bench ended or `timeout` passed first."""
    deadline = time.monotonic() + timeout
    while bench.poll() is None and time.monotonic() < deadline:
        groups = rank_threads(bench.pid)
        if {"encode driver", "prefill driver"} <= set(groups.values()):
            return groups
        time.sleep(0.2)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start-timeout", type=float, default=120.0,
                        help="seconds the bench's ranks may take to start (default 120)")
    parser.add_argument("--delay", type=float, default=4.0,
                        help="seconds from the ranks' start to the sampling (default 4)")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds sampled (default 6)")
    parser.add_argument("--frequency", type=int, default=2999, help="samples a second a CPU (default 2999)")
    parser.add_argument("bench", nargs="*", help=f"bench options, after -- (default: {' '.join(CELL)})")
    args = parser.parse_args()
    refusal = perf_refusal()
    if refusal:
        print(f"bench_cpu_libraries: {refusal}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        bench = subprocess.Popen([sys.executable, "-m", "transfer.cli", "bench", *(args.bench or CELL)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            groups = started(bench, args.start_timeout)
            if groups is None:
                out = bench.communicate(timeout=5)[0] if bench.poll() is not None else ""
                print(f"bench_cpu_libraries: the bench's ranks did not start within {args.start_timeout:g} s "
                      f"(exit {bench.poll()})\n{out}", file=sys.stderr)
                return 1
            time.sleep(args.delay)
            groups.update(rank_threads(bench.pid))  # threads the ranks started meanwhile
            subprocess.run(["perf", "record", "-q", "-a", "-F", str(args.frequency), "-o", data, "--", "sleep",
                            str(args.seconds)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            running = bench.poll() is None
        finally:
            bench.kill()
            out, _ = bench.communicate()
        if not running:
            print("bench_cpu_libraries: the bench ended while it was sampled: give more --items\n" + out,
                  file=sys.stderr)
            return 1
        script = subprocess.run(["perf", "script", "-i", data, "-F", "tid,ip,dso"], capture_output=True, text=True,
                                check=True).stdout
    samples: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in script.splitlines():
        fields = line.split(None, 2)  # tid, address, (shared object)
        if len(fields) != 3 or not fields[0].isdigit():
            continue
        group = groups.get(int(fields[0]), "idle" if fields[0] == "0" else "others")
        samples[group][library(fields[2].strip().strip("()"))] += 1
    total = sum(sum(c.values()) for c in samples.values())
    control = {g: c for g, c in samples.items() if g.split()[0] in ("encode", "prefill")
               and not g.endswith("transport")}
    control_total = sum(sum(c.values()) for c in control.values())
    print(f"{total} samples over {args.seconds:g} s; the control plane's threads took {control_total} "
          f"({100 * control_total / max(total, 1):.1f} %)")
    print(f"{'thread group':20} {'of all':>7}  libraries (share of the group's samples)")
    for group, counts in sorted(samples.items(), key=lambda item: -sum(item[1].values())):
        n = sum(counts.values())
        split = ", ".join(f"{name} {100 * k / n:.0f} %" for name, k in counts.most_common(5))
        print(f"{group:20} {100 * n / total:6.1f}%  {split}")
    by_library: collections.Counter[str] = collections.Counter()
    for counts in control.values():
        by_library.update(counts)
    print("control plane: " + ", ".join(f"{name} {100 * k / max(control_total, 1):.0f} %"
                                        for name, k in by_library.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

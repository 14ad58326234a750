"""`epd-transfer bench`: raw Mooncake writes, the epd path and the framed wire, side by side.

Every transfer path runs between the same processes and the same engines: `E` encode
processes and `E x fanout` prefill processes on loopback, started once and kept for the
whole run (spawning ranks costs seconds on a small host, which would dwarf a cell). Each
cell (item size, encode ranks, fanout, rooms in flight) runs every path back to back.
Prefill rank r receives rows prefill_shard(span, r, P, E) of each item, split over the
whole prefill group, and encode rank e serves the ranks of its block (r // fanout == e),
so with E > 1 each encode rank moves only its block's share:

- raw:    each encode process writes its block's shards of each item with Mooncake
          batch writes, no control plane, keeping `inflight` rooms outstanding;
- floor:  the ZMQ and engine calls a room takes and nothing else: each prefill rank pushes
          a bare ask, the encode rank writes the shard it names at once, polls it as the
          sender pool does and pushes a bare status; no rules, checks or bookkeeping. What
          a control plane over these parts costs at the least (its CPU and p50 added);
- cfloor: the floor with its timed loops in C (native/floor.c): the same messages, writes and
          poll schedule, no Python on the way (Mooncake's calls from C, `Engine.calls`
          'direct', required); what a native hot path would start from. Not in the default
          paths: ask for it with `--paths`;
- epd:    a fresh sender pool and session managers (a fresh bootstrap server) over the
          same engines: asks, statuses, checksums when integrity is on;
- wire:   the same with protocol "wire" (transfer.wire_engine), skipped if it is absent;
- memcpy: one host copy of an item per room in this process: the physical ceiling on
          loopback (its ratio_to_raw compares it with the best raw figure at that size).

Warm-up: each epd and wire cell first moves one untimed room, so the once-per-session
set-up (the bootstrap look-up, the registration, the first connections) stays out of the
timed window; each raw and floor cell likewise first writes one untimed shard to every
receiver, so the first write to a new peer (Mooncake's connection and handshake) is not
timed either. Then a barrier: every rank tells the parent it has warmed up, and opens its
timed window (its start time and CPU reading) only once the parent has heard from every
rank, so no timed room runs while some rank still warms up.

Latency, per room: raw, from a room's submission to its last shard's completion (the
slowest encode rank's; every room in flight is polled in each sweep, so a room is stamped
when it completes, not after the older rooms); epd and wire, from a prefill rank's ask to
its Success, the slowest rank's for each room (a room is served once every rank holds its
shard); floor and cfloor, likewise.
`p50_added_ms` is a floor, cfloor, epd or wire run's p50 less the p50 of the raw run of the same
cell and turn.
Landed bytes, per path. floor, cfloor, epd and wire: as each room concludes Success on a
prefill rank, the rank compares (cfloor: copies, to compare after its timed window) the first
and last FINGERPRINT_BYTES of its landed shard (all of a shorter one) with the item's, read from the item pool before the timed window (about a
microsecond a room, counted in the caller's control CPU), which catches a room's write
lost, cut short or landed from another room; and after every rank's timed window, each
slot's last room is compared whole, which also catches bytes wrong only mid-shard. raw:
a prefill rank is not told when a room lands, so only each slot's last room is compared,
whole; a write lost or misplaced in an earlier room goes unseen. Any difference fails the
cell, as a lost room does; integrity on adds the epd and wire paths' checksums of every
byte. Each row also lists the bytes every encode rank reports it wrote (`encode_bytes`).

CPU per room (`--cpu`; always in --json): each rank reads its threads' CPU time from /proc
over its timed window, split into the control plane (the caller's thread, the sender pool,
the session manager's I/O thread, ZMQ's I/O threads) and the transport (Mooncake's threads,
or the wire path's writer and listener threads: everything else), summed over the ranks and
divided by the rooms. A raw cell has no control plane: its issuing threads count as
transport. `--json` rows also split the control plane per role and thread group
(`cpu_threads`: caller, driver, zmq, other; ms and voluntary context switches per room).
A raw cell's prefill ranks read theirs from the barrier, after the warm-up shards.
`cpu_mooncake_ms` (the table's "mooncake ms") is the part of the control figure spent inside
Mooncake's write and status calls, which the control-plane threads make: Mooncake's own work. It is
counted (each call bracketed by two reads of the thread's CPU clock, system calls the control figure
carries) where every rank's engine makes those calls from C (`Engine.calls` 'direct'), else None; raw
cells, whose control figure is 0, and wire cells read None.

Python calls per room (`--calls`): every Python thread of every rank runs under cProfile, and
each control-plane group's calls over the timed window, divided by the rooms, are printed
after the table and kept in --json as `cpu_threads[role][group]['calls']` (caller, driver,
other; ZMQ's and Mooncake's threads run no Python). A count, exact and the same from run
to run, that shows a change's cost in steps where CPU time moves by +-30 %; the profiler
slows every call, so that run's times and ratios say nothing.

Stages (`--stages`; always in --json as `stages_ms`): where an epd or wire room's time
goes, from the handles' stages (README, "Where a room's time goes"). For each prefill rank
and room that succeeded, in ms from that rank's receive(): its ask handed to ZMQ (asked),
the item offered by send() (offered), the encode rank seeing the room's first ask (seen),
its writes queued (writing), the engine's submission call for its last write returning
(submitted), its last write seen over and the room concluded there (written; at fanout > 1 a
rank's status may come before it, once that rank's own write is over), the status read
(status) and the room concluded (concluded); each the p50 over the cell's rooms and prefill
ranks. All ranks run on this host, so their monotonic clocks agree.

Targets (`--targets`): the epd rows checked against the control plane's budget per room
(`TARGETS`: control CPU a room, p50 added over raw, ratio to raw, each in named cells),
printed after the table as figure, target, measured (3 decimals, more where fewer would
round it across its bound) and whether it held; a cell not measured, or whose room or
bytes were lost, reads "not measured".

Rows are told apart by their item's rows x hidden and dtype, not its bytes alone: two items
of one size (64x4096 and 128x2048 bf16) keep their own raw rows, ratios and targets, and
the tables then name each by its rows x hidden beside its size.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import functools
import gc
import importlib
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import select
import statistics
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

from transfer.cli import _dtype, _positive_int, _rank_host, _seconds
from transfer.frames import dtype_size, prefill_shard
from transfer.harness import NoMemory, allocate

PATHS = ("raw", "floor", "cfloor", "epd", "wire", "memcpy")
#: What runs without --paths: cfloor only when asked for.
DEFAULT_PATHS = ("raw", "floor", "epd", "wire", "memcpy")
DEFAULT_SIZES = "64x4096,1024x4096,8192x4096"
ROW_KEYS = ("path", "item_bytes", "span", "hidden", "dtype", "encode_ranks", "fanout", "inflight", "integrity", "gbps",
            "rooms_per_s", "p50_ms", "p99_ms", "ratio_to_raw", "p50_added_ms", "encode_bytes", "stages_ms")
#: A room's stages as `--stages` lists them (module docstring): the prefill rank's and its encode rank's.
STAGES = ("asked", "offered", "seen", "writing", "submitted", "written", "status", "concluded")
#: The stages taken from the encode rank's handle, by its names for them.
_ENCODE_STAGES = (("seen", "asked"), ("writing", "writing"), ("submitted", "submitted"), ("written", "concluded"))
MiB = 2**20
#: The untimed room every epd and wire cell moves first (outside the timed rooms' range).
WARMUP_ROOM = 1 << 40
#: The item a floor, epd or wire cell's warm-up room carries into slot 0: ItemSource's items
#: repeat only after more rooms than a cell has slots, so room -1's differs from every timed
#: room's that is first in a slot (a lost first write there cannot pass for a landed one).
WARMUP_ITEM = -1
#: Bytes at each end of a landed shard that a floor, epd or wire prefill rank checks as each room concludes.
FINGERPRINT_BYTES = 64


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Cell:
    """One measurement: a path over one geometry, fanout and window."""

    path: str  # raw | epd | wire | memcpy
    span: int
    hidden: int
    dtype: str
    fanout: int
    inflight: int
    items: int
    integrity: bool = False
    encode_ranks: int = 1

    @property
    def prefill_ranks(self) -> int:
        """P: every encode rank serves a block of `fanout` prefill ranks."""
        return self.encode_ranks * self.fanout

    def shard(self, rank: int) -> tuple[int, int]:
        """(row_start, rows) prefill rank `rank` receives of each item: a share of the whole group's."""
        return prefill_shard(self.span, rank, self.prefill_ranks, self.encode_ranks)

    @property
    def row_bytes(self) -> int:
        return self.hidden * dtype_size(self.dtype)

    @property
    def item_bytes(self) -> int:
        return self.span * self.row_bytes

    @property
    def slots(self) -> int:
        """Receive slots per prefill rank: one per room in flight."""
        return max(1, min(self.inflight, self.items))


@dataclass
class Options:
    """What to measure and how (the command line, as data)."""

    sizes: list[tuple[int, int]] = field(default_factory=lambda: parse_sizes(DEFAULT_SIZES))
    dtype: str = "torch.bfloat16"
    fanouts: list[int] = field(default_factory=lambda: [1, 2, 4])
    encode_ranks: list[int] = field(default_factory=lambda: [1])
    inflight: list[int] = field(default_factory=lambda: [1, 8, 32])
    paths: list[str] = field(default_factory=lambda: list(DEFAULT_PATHS))
    integrity: list[bool] = field(default_factory=lambda: [True, False])
    items: int | None = None  # fixed rooms per cell; None: scale by size
    cell_bytes: int = 256 * MiB
    min_items: int = 16
    protocol: str = "tcp"
    host: str = "127.0.0.1"
    depth: int | None = None  # async batches the sender pool keeps in flight; None: its default
    raw_issue: str = "async"
    raw_writers: int = 2
    timeout_s: float = 300.0
    deadline_s: float = 60.0
    log_dir: str | None = None
    repeat: int = 1  # runs of each cell, paths alternating; the run with the median GB/s is reported
    calls: bool = False  # count each thread's Python calls (cProfile on every Python thread of every rank)

    def items_for(self, item_bytes: int, inflight: int) -> int:
        """Rooms per cell: about cell_bytes moved, at least min_items and one full window."""
        if self.items is not None:
            return max(1, self.items)
        return max(self.min_items, inflight, math.ceil(self.cell_bytes / item_bytes))


def _entries(text: str, what: str) -> list[str]:
    """A comma-separated option's entries, stripped; an empty entry ('1,,2', '1,') is refused."""
    entries = [p.strip() for p in text.split(",")]
    if not any(entries):
        raise argparse.ArgumentTypeError(f"no {what} given")
    if not all(entries):
        raise argparse.ArgumentTypeError(f"{what} {text!r} has an empty entry")
    return entries


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """'64x4096,1024x4096' -> [(64, 4096), (1024, 4096)] (rows x hidden)."""
    sizes = []
    for part in _entries(text, "item sizes"):
        rows, sep, hidden = part.lower().partition("x")
        digits = rows.isascii() and rows.isdigit() and hidden.isascii() and hidden.isdigit()  # "²" is a digit too
        if not sep or not digits or int(rows) <= 0 or int(hidden) <= 0:
            raise argparse.ArgumentTypeError(f"item size {part!r} is not ROWSxHIDDEN (e.g. 1024x4096)")
        sizes.append((int(rows), int(hidden)))
    return sizes


def parse_ints(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4], all positive."""
    try:
        entries = _entries(text, "integers")
        if not text.isascii():  # int() takes any script's digits ("１" is 1)
            raise ValueError
        values = [int(p) for p in entries]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers")
    return values


def parse_paths(text: str) -> list[str]:
    """'raw,epd' -> ['raw', 'epd'], each one of PATHS."""
    paths = _entries(text, "paths")
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown path(s) {unknown}: choose from {', '.join(PATHS)}")
    return paths


def parse_integrity(text: str) -> list[bool]:
    """'on,off' -> [True, False]."""
    table = {"on": True, "off": False}
    values = [p.lower() for p in _entries(text, "integrity")]
    if any(v not in table for v in values):
        raise argparse.ArgumentTypeError(f"integrity {text!r}: expected on, off or on,off")
    return [table[v] for v in values]


def plan(opts: Options, wire_ok: bool) -> list[Cell]:
    """Every transfer cell, encode-ranks- then fanout-major so the same processes serve consecutive cells."""
    cells = []
    for encode_ranks, fanout in itertools.product(opts.encode_ranks, opts.fanouts):
        for span, hidden in opts.sizes:
            item_bytes = span * hidden * dtype_size(opts.dtype)
            for inflight in opts.inflight:
                items = opts.items_for(item_bytes, inflight)
                for path in opts.paths:
                    if path == "memcpy" or (path == "wire" and not wire_ok):
                        continue
                    flags = opts.integrity if path in ("epd", "wire") else [False]
                    for integrity in flags:
                        cells.append(Cell(path, span, hidden, opts.dtype, fanout, inflight, items, integrity,
                                          encode_ranks))
    return cells


def wire_available() -> str | None:
    """None when transfer.wire_engine imports, else why not."""
    try:
        importlib.import_module("transfer.wire_engine")
    except Exception as exc:  # noqa: BLE001 - any failure means the row is skipped
        return f"transfer.wire_engine does not import ({type(exc).__name__}: {exc})"
    return None


# ------------------------------------------------------------- worker side


def thread_group(name: str, main: bool) -> str | None:
    """The control-plane group of a thread by its name (None: the transport's).

    caller: the rank's main thread; driver: a sender pool's thread (epd-enc*) or a session
    manager's I/O thread (epd-pre*-io); zmq: ZMQ's I/O threads; other: our other threads
    (bootstrap look-ups, status pushers, probes). The wire path's epd-wire-* threads move
    bytes: transport.
    """
    if main:
        return "caller"
    if name.startswith("ZMQbg"):
        return "zmq"
    if not name.startswith("epd-") or name.startswith("epd-wire"):
        return None
    if name.startswith("epd-enc") or name.endswith("-io"):
        return "driver"
    return "other"


def interpreter() -> str:
    """The Python every rank runs (this process's): its build moves the control plane's figures, which are
    mostly the interpreter's work (docs/performance.md, "Measured: the control plane's CPU by library")."""
    return f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; the host's count where that is not known): the
    figures depend on it, since a room's processes and threads share them."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def calls_refusal() -> str | None:
    """Why `--calls` cannot count on this Python, or None where it can."""
    if sys.version_info[:2] < (3, 12):
        return None
    # There cProfile takes the process's one sys.monitoring profiler slot: a profiler per thread
    # cannot be enabled, and every rank thread after the first would end at its first call.
    return (f"--calls needs Python 3.10 or 3.11 (this is {sys.version_info[0]}.{sys.version_info[1]}): "
            f"from 3.12 cProfile profiles one thread per process at most, and --calls counts each thread's calls")


class CallCounts:
    """Python calls made so far by each Python thread of this process, counted by a cProfile profiler
    per thread: the thread that installs it, and every thread started after."""

    def __init__(self) -> None:
        self._profiles: dict[str, cProfile.Profile] = {}  # thread id (as /proc/self/task names it) -> profiler

    def install(self) -> None:
        """Starts counting; raises RuntimeError where this Python cannot (`calls_refusal()`)."""
        refusal = calls_refusal()
        if refusal is not None:
            raise RuntimeError(refusal)
        threading.setprofile(self._hand_over)
        self._profile_this_thread()

    def _hand_over(self, frame: Any, event: str, arg: Any) -> None:
        """A new thread's first profile event: its own profiler takes over from this hook."""
        self._profile_this_thread()

    def _profile_this_thread(self) -> None:
        profile = cProfile.Profile()
        self._profiles[str(threading.get_native_id())] = profile
        profile.enable()

    def snapshot(self) -> dict[str, int]:
        """Calls so far per thread id.

        The collector stays off while the profilers are read: a finalizer it ran would make calls on
        this thread, which reorder this thread's profiler's table while it is being walked (counting
        some entries twice and others not at all). Nothing else runs meanwhile: reading a profiler
        keeps the GIL.
        """
        enabled = gc.isenabled()
        gc.disable()
        try:
            return {tid: sum(entry.callcount for entry in profile.getstats())
                    for tid, profile in list(self._profiles.items())}
        finally:
            if enabled:
                gc.enable()


#: This rank process's call counter, when the bench counts calls (`--calls`).
_CALL_COUNTS: CallCounts | None = None


#: Whether this rank process counts the CPU inside Mooncake's calls (_native.mooncake_account): set once
#: one of its engines makes them from C.
_MOONCAKE_COUNTED = False


def _count_mooncake_calls(engine: Any) -> None:
    """Counts the CPU inside Mooncake's write and status calls from now on, where `engine` makes them from C."""
    global _MOONCAKE_COUNTED
    if getattr(engine, "calls", None) == "direct" and not _MOONCAKE_COUNTED:
        from transfer import _native

        _native.mooncake_account(True)
        _MOONCAKE_COUNTED = True


def thread_cpu() -> dict[str, Any] | None:
    """CPU this process has used: {'control': s, 'transport': s, 'threads': {tid: (group, s, switches)}},
    with `--calls` each thread's Python calls so far ('calls': {tid: n}), and where this process counts
    them, the seconds spent inside Mooncake's write and status calls ('mooncake').

    None without /proc. The control plane is the threads thread_group() names; they live
    as long as their pool or manager. The transport is the rest: the process's total
    (time.process_time(), which keeps the time of threads that have ended) less the
    control plane. Per-thread times come from schedstat (nanoseconds), or from stat's clock
    ticks where the kernel has no schedstat; switches are the voluntary ones (each a sleep
    the thread woke from).
    """
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    control = 0.0
    times: dict[str, tuple[str, float]] = {}
    main = str(os.getpid())
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                group = thread_group(fh.read().rstrip("\n"), tid == main)
            if group is None:
                continue
            seconds = _task_seconds(tid)
            control += seconds
            times[tid] = (group, seconds)
        except (OSError, ValueError):
            continue  # it ended: its time is in the process's total, on the transport's side
    # Read right after the threads' times, so the total covers them and little else; the
    # switch counts (not part of either side) are read after it.
    transport = max(0.0, time.process_time() - control)
    threads: dict[str, tuple[str, float, int]] = {}
    for tid, (group, seconds) in times.items():
        try:
            threads[tid] = (group, seconds, _task_switches(tid))
        except (OSError, ValueError):
            continue
    reading = {"control": control, "transport": transport, "threads": threads}
    if _MOONCAKE_COUNTED:
        from transfer import _native

        reading["mooncake"] = _native.mooncake_cpu()
    if _CALL_COUNTS is not None:
        reading["calls"] = _CALL_COUNTS.snapshot()
    return reading


def _task_seconds(tid: str) -> float:
    """A thread's CPU seconds: schedstat's nanoseconds, else stat's utime + stime ticks."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as fh:
            return int(fh.read().split()[0]) / 1e9
    except FileNotFoundError:
        with open(f"/proc/self/task/{tid}/stat") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _task_switches(tid: str) -> int:
    """A thread's voluntary context switches so far (0 where the kernel does not say)."""
    with open(f"/proc/self/task/{tid}/status") as fh:
        for line in fh:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def _cpu_since(before: dict[str, Any] | None) -> dict[str, Any] | None:
    """CPU seconds per side since `before` (a thread_cpu() reading), and per control-plane group
    {group: [seconds, switches, Python calls or None]} over the threads alive at the end (one
    started since counts whole); 'mooncake', the seconds inside Mooncake's calls, where both readings
    counted them."""
    after = thread_cpu()
    if before is None or after is None:
        return None
    groups: dict[str, list] = {}
    calls_now, calls_then = after.get("calls"), before.get("calls", {})
    for tid, (group, seconds, switches) in after["threads"].items():
        _, seconds_then, switches_then = before["threads"].get(tid, (group, 0.0, 0))
        entry = groups.setdefault(group, [0.0, 0, None if calls_now is None else 0])
        entry[0] += seconds - seconds_then
        entry[1] += switches - switches_then
        if calls_now is not None:
            entry[2] += calls_now.get(tid, 0) - calls_then.get(tid, 0)
    # The process's total is read a moment after its threads' times: a difference below zero
    # is that moment's jitter, not time spent.
    spent = {"control": after["control"] - before["control"],
             "transport": max(0.0, after["transport"] - before["transport"]), "groups": groups}
    if "mooncake" in before and "mooncake" in after:
        spent["mooncake"] = after["mooncake"] - before["mooncake"]
    return spent


class _Worker:
    """State a rank process keeps across cells: engines, their registered memory, item pools."""

    def __init__(self, role: str, rank: int, setup: dict, cmd_q, res_q) -> None:
        self.role, self.rank, self.setup = role, rank, setup
        self.cmd_q, self.res_q = cmd_q, res_q
        self.engines: dict[str, Any] = {}
        self.sources: dict[tuple[int, int, str, int], Any] = {}
        self.registered: set[tuple[str, int]] = set()
        self.arena = None
        if role == "prefill" and setup["arena_bytes"]:
            import torch

            # One receive arena for the whole run, registered once per engine: every cell's
            # slots are a view of it, so peers never see a region change between cells.
            nbytes = setup["arena_bytes"]
            self.arena = allocate(lambda: torch.empty(nbytes, dtype=torch.uint8), nbytes, "its receive arena")

    def engine(self, protocol: str):
        """The engine for protocol, started on first use with the arena registered."""
        if protocol not in self.engines:
            from transfer.harness import Scenario, make_engine

            engine = make_engine(Scenario(protocol=protocol, host=self.setup["host"]))
            self.engines[protocol] = engine
            _count_mooncake_calls(engine)
            if self.arena is not None:
                engine.register(self.arena)
        return self.engines[protocol]

    def source(self, cell: Cell, protocol: str | None = None):
        """The deterministic item pool for cell's geometry, registered with protocol's engine.

        Its items repeat only after more rooms than the cell has slots (see _distinct_rooms),
        so a slot whose room's write was lost never holds that room's item.
        """
        from transfer.harness import ItemSource

        distinct = _distinct_rooms(cell)
        key = (cell.span, cell.hidden, cell.dtype, distinct)
        if key not in self.sources:
            self.sources[key] = ItemSource(cell.span, cell.hidden, cell.dtype, distinct=distinct)
        src = self.sources[key]
        if protocol is not None and (protocol, src.pool.data_ptr()) not in self.registered:
            self.engine(protocol).register(src.pool)
            self.registered.add((protocol, src.pool.data_ptr()))
        return src

    def slots(self, cell: Cell, rows: int):
        """This rank's receive slots `[slots, rows, hidden]` for cell, a view of the arena."""
        import torch

        nbytes = cell.slots * max(rows, 1) * cell.row_bytes
        if self.arena is None or nbytes > self.arena.numel():
            raise RuntimeError(f"prefill {self.rank}: cell needs {nbytes} receive bytes, arena has "
                               f"{0 if self.arena is None else self.arena.numel()}")
        dtype = getattr(torch, cell.dtype.removeprefix("torch."))
        return self.arena[:nbytes].view(dtype).view(cell.slots, max(rows, 1), cell.hidden)

    # -- hooks the parent drives

    def ready(self, info: Any = None) -> None:
        """Tell the parent this rank is set up for the cell (or, the second time, warmed up)."""
        self.res_q.put(("ready", self.role, self.rank, info))

    def go(self) -> Any:
        """Block until the parent starts the cell (or its timed part); returns what it sent along."""
        return self._expect("go")

    def finished(self) -> None:
        """Tell the parent the timed part is over, then wait until every rank is."""
        self.res_q.put(("finished", self.role, self.rank, None))
        self._expect("close")

    def _expect(self, what: str) -> Any:
        try:
            msg = self.cmd_q.get(timeout=self.setup["timeout_s"])
        except queue_mod.Empty:
            raise TimeoutError(f"{self.role} {self.rank}: no {what!r} from the bench within "
                               f"{self.setup['timeout_s']:g}s") from None
        if msg is None or msg[0] == "stop":
            raise _Stop()
        if msg[0] != what:
            raise RuntimeError(f"{self.role} {self.rank}: expected {what!r}, got {msg!r}")
        return msg[1]

    def close(self) -> None:
        """Close every engine this process started."""
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


class _Stop(Exception):
    """The bench told this rank process to stop."""


def _distinct_rooms(cell: Cell) -> int:
    """Consecutive rooms whose items must differ in cell: more than its slots (room r and room
    r - slots share a slot), and at least ItemSource's default, so cells share pools."""
    from transfer.harness import DISTINCT_ROOMS

    return max(DISTINCT_ROOMS, cell.slots + 1)


def _start_timed(worker: _Worker) -> None:
    """The barrier after warm-up: tell the parent this rank has warmed up, then wait until every
    rank of the cell has (the parent's second go). A rank opens its timed window (t_start, its
    CPU reading) only after this, so no rank's timed rooms run while another still warms up."""
    worker.ready()
    worker.go()


def _worker_main(role: str, rank: int, setup: dict, cmd_q, res_q) -> None:
    """A rank process: runs cells until told to stop, reporting each or its traceback."""
    from transfer.harness import exit_with_parent

    exit_with_parent()  # a bench killed outright must not leave its ranks holding engines and ports
    if setup.get("calls"):
        global _CALL_COUNTS
        _CALL_COUNTS = CallCounts()
        _CALL_COUNTS.install()
    if setup.get("log_path"):
        # Mooncake logs through glog straight to fd 2; keep it out of the bench's output.
        fd = os.open(setup["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    # SIGINT was held back while this process started (harness.ctrl_c_held): drop one that came
    # meanwhile (the bench's process took it too, and stops this rank), then take the next as
    # Ctrl-C, which ends the cell it interrupts.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    worker = None
    try:
        worker = _Worker(role, rank, setup, cmd_q, res_q)
        res_q.put(("started", role, rank, None))
        while True:
            msg = cmd_q.get()
            if msg is None or msg[0] == "stop":
                break
            if msg[0] != "cell":
                continue  # a leftover of a cell that failed elsewhere
            cell = msg[1]
            try:
                body = _BODIES[(role, cell.path if cell.path in ("raw", "floor", "cfloor") else "epd")]
                res_q.put(("report", role, rank, body(worker, cell, msg[2])))
            except _Stop:
                break
            except NoMemory as error:  # one line: it names the buffer and its size
                res_q.put(("no_memory", role, rank, str(error)))
            except BaseException:  # noqa: BLE001 - the parent must hear about it
                res_q.put(("error", role, rank, traceback.format_exc()))
    except NoMemory as error:
        res_q.put(("no_memory", role, rank, str(error)))
    except BaseException:  # noqa: BLE001
        res_q.put(("error", role, rank, traceback.format_exc()))
    finally:
        if worker is not None:
            worker.close()


def _cell_protocol(cell: Cell, protocol: str) -> str:
    """The engine protocol a cell runs on: wire for the wire path, else the Mooncake one."""
    return "wire" if cell.path == "wire" else protocol


def _raw_encode(worker: _Worker, cell: Cell, extra: dict) -> dict:
    """Raw encode body: each room's shards for this rank's block, back to back, `inflight` rooms outstanding."""
    protocol = _cell_protocol(cell, extra["protocol"])
    engine = worker.engine(protocol)
    source = worker.source(cell, protocol)
    worker.ready()
    receivers = worker.go()  # this encode rank's block
    report: dict[str, Any] = {"latencies": [], "latency_rooms": [], "failed": []}
    base = source.pool.data_ptr()

    def batches(room: int) -> list[tuple[str, int, int, int]]:
        """(session, src, dst, length) of room's shard for every receiver (room i lands in slot i % slots)."""
        first = source.offset(room, cell.span)
        index = room
        slot = index % cell.slots
        return [(r["session"], base + (first + r["row_start"]) * cell.row_bytes, r["addr"] + slot * r["stride"],
                 r["rows"] * cell.row_bytes) for r in receivers if r["rows"]]

    # Untimed, like the epd path's warm-up room: the first write to each peer opens its
    # connection. Room `items` is never timed, and the timed room last in its slot overwrites it.
    for session, src, dst, length in batches(cell.items):
        engine.write(session, [src], [dst], [length])
    _start_timed(worker)
    cpu, report["t_start"] = thread_cpu(), time.time()  # the reading stays out of the timed window
    if extra["raw_issue"] == "sync":
        _raw_sync(engine, cell, batches, extra["raw_writers"], report)
    else:
        _raw_async(engine, cell, batches, report)
    report["t_end"], report["cpu"] = time.time(), _cpu_since(cpu)
    # What this rank wrote: every shard of each room whose writes all completed.
    report["bytes"] = sum(length for room in report["latency_rooms"] for *_, length in batches(room))
    worker.finished()
    return report


def _raw_async(engine, cell: Cell, batches, report: dict) -> None:
    """Issue each shard with write_async, `inflight` rooms outstanding, polling them all in sweeps.

    Room i lands in slot i % slots, so it is issued once room i - slots settled (which keeps at
    most `inflight` rooms out). Each sweep polls every room outstanding (poll() never blocks;
    a room's tickets in order, up to its first still in flight), so a room is stamped when its
    last shard is found over, not when a wait for an older room returns; between sweeps the
    thread sleeps as engine.wait() does, from POLL_MIN_S doubling to POLL_MAX_S while nothing
    completes. No timeout of ours: Mooncake's transfer timeout bounds each write (poll() then
    fails it). A room settles only once every ticket of it is over, a failed one included, so
    its slot is not written again, nor the room reported, while a shard of it may still land.
    """
    from transfer.engine import POLL_MAX_S, POLL_MIN_S

    outstanding: dict[int, tuple[deque, float, list[str]]] = {}  # room -> (tickets, started, failures)

    def sweep() -> bool:
        """Polls every outstanding room once; whether any ticket was found over."""
        progressed = False
        for room in list(outstanding):
            tickets, started, failures = outstanding[room]
            while tickets:
                try:
                    if not engine.poll(tickets[0]):
                        break
                except Exception as exc:  # noqa: BLE001 - recorded, the cell fails
                    failures.append(str(exc))  # poll() fails a ticket only once its batches settled
                tickets.popleft()
                progressed = True
            if tickets:
                continue
            ended = time.monotonic()
            del outstanding[room]
            if failures:
                report["failed"].append((room, failures[0]))
            else:
                report["latencies"].append(ended - started)
                report["latency_rooms"].append(room)
        return progressed

    def settle_until(done: Callable[[], bool]) -> None:
        delay = POLL_MIN_S
        while True:
            progressed = sweep()
            if done():
                return
            delay = POLL_MIN_S if progressed else min(2 * delay, POLL_MAX_S)
            time.sleep(delay)

    for index in range(cell.items):
        before = index - cell.slots  # the room last in this room's slot
        settle_until(lambda: before not in outstanding)
        started = time.monotonic()
        ids = [engine.write_async(session, [src], [dst], [length]) for session, src, dst, length in batches(index)]
        outstanding[index] = (deque(ids), started, [])
    settle_until(lambda: not outstanding)


def _raw_sync(engine, cell: Cell, batches, writers: int, report: dict) -> None:
    """Issue each shard as a synchronous write from `writers` threads, `inflight` rooms outstanding."""
    jobs: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    window = threading.Semaphore(cell.inflight)
    lock = threading.Condition()
    pending: dict[int, list] = {}

    def write_loop() -> None:
        while (job := jobs.get()) is not None:
            room, session, src, dst, length = job
            error = None
            try:
                engine.write(session, [src], [dst], [length])
            except Exception as exc:  # noqa: BLE001 - recorded, the cell fails
                error = str(exc)
            with lock:
                state = pending[room]
                state[0] -= 1
                if error and not state[2]:
                    state[2] = error
                    report["failed"].append((room, error))
                if state[0] == 0:
                    if not state[2]:
                        report["latencies"].append(time.monotonic() - state[1])
                        report["latency_rooms"].append(room)
                    del pending[room]
                    lock.notify_all()
                    window.release()

    threads = [threading.Thread(target=write_loop, daemon=True) for _ in range(max(1, writers))]
    for thread in threads:
        thread.start()
    for index in range(cell.items):
        window.acquire()
        shards = batches(index)
        with lock:
            # Rooms complete out of order: the room before this one in its slot must be done.
            lock.wait_for(lambda: index - cell.slots not in pending)
            pending[index] = [len(shards), time.monotonic(), None]
        for session, src, dst, length in shards:
            jobs.put((index, session, src, dst, length))
    for _ in threads:
        jobs.put(None)
    for thread in threads:
        thread.join()


def _offered_slots(worker: _Worker, cell: Cell, extra: dict) -> tuple[Any, int, int, dict]:
    """This prefill rank's receive slots for a raw or floor cell, filled with the sentinel:
    (slots, row_start, rows, what its encode rank needs to write into them)."""
    engine = worker.engine(_cell_protocol(cell, extra["protocol"]))
    row_start, rows = cell.shard(worker.rank)
    slots = worker.slots(cell, rows)
    _fill_sentinel(slots)
    info = {"session": engine.session_id, "addr": slots.data_ptr(), "stride": slots[0].nbytes,
            "row_start": row_start, "rows": rows, "rank": worker.rank}
    return slots, row_start, rows, info


def _raw_prefill(worker: _Worker, cell: Cell, extra: dict) -> dict:
    """Raw prefill body: offers its slots, waits out the writes, checks the last rooms' bytes."""
    slots, row_start, rows, info = _offered_slots(worker, cell, extra)
    worker.ready(info)
    worker.go()
    _start_timed(worker)  # the encode ranks' warm-up shards are in
    cpu = thread_cpu()
    worker.finished()
    cpu = _cpu_since(cpu)  # the encode's timed writes
    # Writes are over: slot s holds the last room written into it.
    last = {index % cell.slots: index for index in range(cell.items)}
    bad = _check_slots(worker, cell, slots, last, row_start, rows)
    return {"bad": bad, "cpu": cpu}


def _epd_encode(worker: _Worker, cell: Cell, extra: dict) -> dict:
    """epd encode body: a sender pool over the persistent engine, `inflight` rooms outstanding.

    Its `bytes` are what the pool wrote in the timed window (its bytes_written_total counter).
    """
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    protocol = _cell_protocol(cell, extra["protocol"])
    engine = worker.engine(protocol)
    source = worker.source(cell, protocol)
    report: dict[str, Any] = {"failed": [], "stages": {}}
    knobs = {"depth": extra["depth"]} if extra.get("depth") is not None else {}
    who = f"encode {worker.rank}"
    with SenderPool(engine, worker.rank, cell.encode_ranks, 1, extra["bootstrap"], host=worker.setup["host"],
                    integrity=cell.integrity, fanout_timeout_s=extra["deadline_s"], **knobs) as pool:
        worker.ready()
        worker.go()
        _warm_up(pool.send(WARMUP_ROOM, source.item(WARMUP_ITEM, cell.span)), extra["deadline_s"], who)
        _start_timed(worker)
        written = _bytes_written(pool)
        # The loop's own work stays out of the timed window's CPU: the items' views taken before it, and
        # each succeeded room's stages read after it (from its handle, which keeps them once cleared).
        items = [source.item(room, cell.span) for room in range(cell.items)]
        succeeded: list = []
        cpu, report["t_start"] = thread_cpu(), time.time()  # the reading stays out of the timed window
        window: deque = deque()

        def settle(handle) -> None:
            if handle.wait(extra["deadline_s"] + 5) != TransferPoll.Success:
                report["failed"].append((handle.room, handle.failure or "not concluded"))
            else:
                succeeded.append(handle)
            handle.clear()

        for room in range(cell.items):
            window.append(pool.send(room, items[room]))
            if len(window) >= cell.inflight:
                settle(window.popleft())
        while window:
            settle(window.popleft())
        report["t_end"], report["cpu"] = time.time(), _cpu_since(cpu)
        report["stages"] = {handle.room: (handle.started_at, handle.stages) for handle in succeeded}
        # A write is counted before its status goes out, so every settled room's writes are in.
        report["bytes"] = _bytes_written(pool) - written
        # Keep serving (statuses in flight) until every prefill rank is done.
        worker.finished()
    return report


def _epd_prefill(worker: _Worker, cell: Cell, extra: dict) -> dict:
    """epd prefill body: a session manager asking for `inflight` rooms at a time into arena slots."""
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    protocol = _cell_protocol(cell, extra["protocol"])
    engine = worker.engine(protocol)
    row_start, rows = cell.shard(worker.rank)
    slots = worker.slots(cell, rows)
    _fill_sentinel(slots)
    report: dict[str, Any] = {"latencies": [], "latency_rooms": [], "failed": [], "bytes": 0, "stages": {},
                              "bad": []}
    last: dict[int, int] = {}
    landed = _Fingerprints(worker, cell, slots, row_start, rows)
    with SessionManager(engine, worker.rank, cell.prefill_ranks, 1, buffer=slots, host=worker.setup["host"],
                        deadline_s=extra["deadline_s"], integrity=cell.integrity) as manager:
        worker.ready()
        worker.go()
        _warm_up(manager.receive(WARMUP_ROOM, extra["bootstrap"], slots[0, :rows], row_start=row_start,
                                 span=cell.span), extra["deadline_s"], f"prefill {worker.rank}")
        _start_timed(worker)
        # The loop's own work stays out of the timed window's CPU: each slot's shard view taken before it,
        # and each succeeded room's latency and stages read after it (from its handle, which keeps them
        # once cleared).
        shards = [slots[slot, :rows] for slot in range(cell.slots)]
        succeeded: list = []
        cpu, report["t_start"] = thread_cpu(), time.time()  # the reading stays out of the timed window
        window: deque = deque()
        free = list(range(cell.slots))
        unsafe: list = []  # (handle, slot) of failed rooms, until no write of theirs can land any more

        def settle() -> None:
            handle, slot = window.popleft()
            if handle.wait(extra["deadline_s"] + 5) == TransferPoll.Success:
                succeeded.append(handle)
                last[slot] = handle.room
                landed.check(handle.room, slot, report["bad"])
                free.append(slot)
            else:
                report["failed"].append((handle.room, handle.failure or "not concluded"))
                last.pop(slot, None)
                unsafe.append((handle, slot))  # its encode rank may still write into it
            handle.clear()

        def take_slot() -> int:
            """A slot no earlier room's write can land in: a free one, else the oldest room's once it
            settles; a failed room's only once its handle says safe_to_reuse (the encode rank
            confirmed the cancel clear() sent, or the quarantine bound passed)."""
            waiting_since = None
            while True:
                for entry in [e for e in unsafe if e[0].safe_to_reuse]:
                    unsafe.remove(entry)
                    free.append(entry[1])
                if free:
                    return free.pop()
                if window:
                    settle()
                    continue
                now = time.monotonic()
                waiting_since = now if waiting_since is None else waiting_since
                if now - waiting_since > extra["deadline_s"] + 5:
                    raise TimeoutError(f"prefill {worker.rank}: every slot is a failed room's, and none was safe "
                                       f"to reuse within {extra['deadline_s'] + 5:g}s")
                time.sleep(1e-3)

        for room in range(cell.items):
            slot = take_slot()
            window.append((manager.receive(room, extra["bootstrap"], shards[slot], row_start=row_start,
                                           span=cell.span), slot))
        while window:
            settle()
        report["t_end"], report["cpu"] = time.time(), _cpu_since(cpu)
        report["latencies"] = [handle.latency_s for handle in succeeded]
        report["latency_rooms"] = [handle.room for handle in succeeded]
        report["stages"] = {handle.room: (handle.started_at, handle.stages) for handle in succeeded}
        report["bytes"] = len(succeeded) * rows * cell.row_bytes
        worker.finished()
    report["bad"] += _check_slots(worker, cell, slots, last, row_start, rows)
    return report


#: A floor path's ask (room, prefill rank, destination address) and status (room).
_FLOOR_ASK = struct.Struct("<qqQ")
_FLOOR_STATUS = struct.Struct("<q")


def _floor_encode(worker: _Worker, cell: Cell, extra: dict, native: bool = False) -> dict:
    """Floor encode body: writes the shard each bare ask names, polls it, pushes a bare status.

    Each receiver's warm-up ask (room WARMUP_ITEM) is served before the barrier (_start_timed),
    the timed rooms' after it; `native` (the cfloor path) serves those in C (native/floor.c).
    """
    import zmq

    from transfer import config
    from transfer.core.polls import PollSchedule

    # The sender pool's schedule, EPD_POLL_MIN_S and EPD_POLL_MAX_S included.
    polls = PollSchedule(config.resolve("EPD_POLL_MIN_S"), config.resolve("EPD_POLL_MAX_S"))
    protocol = _cell_protocol(cell, extra["protocol"])
    engine = worker.engine(protocol)
    source = worker.source(cell, protocol)
    base = source.pool.data_ptr()
    host = worker.setup["host"]
    ctx = zmq.Context()
    pull = None
    pushes: dict[int, Any] = {}
    try:
        pull = ctx.socket(zmq.PULL)
        worker.ready({"port": pull.bind_to_random_port(f"tcp://{host}")})
        receivers = {info["rank"]: info for info in worker.go() if info["rows"]}
        for rank, info in receivers.items():
            pushes[rank] = ctx.socket(zmq.PUSH)
            pushes[rank].connect(f"tcp://{host}:{info['status_port']}")
        report: dict[str, Any] = {"failed": [], "bytes": 0}
        fd = pull.fileno()
        flights: deque = deque()  # (batch, rank, room, nbytes), oldest first
        served = 0
        progressed = time.monotonic()

        def serve(until: int) -> None:
            """Serves asks until `until` statuses went out in all."""
            nonlocal served, flights, progressed
            while served < until:
                while True:  # every queued ask: a socket drained empty signals its descriptor again
                    try:
                        room, rank, dst = _FLOOR_ASK.unpack(pull.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    info = receivers[rank]
                    nbytes = info["rows"] * cell.row_bytes
                    src = base + (source.offset(room, cell.span) + info["row_start"]) * cell.row_bytes
                    flights.append((engine.write_async(info["session"], [src], [dst], [nbytes]), rank, room, nbytes))
                    progressed = time.monotonic()
                    polls.started(nbytes, progressed)
                still: deque = deque()
                for flight in flights:
                    batch, rank, room, nbytes = flight
                    if not engine.poll(batch):
                        still.append(flight)
                        continue
                    pushes[rank].send(_FLOOR_STATUS.pack(room))
                    served += 1
                    progressed = time.monotonic()
                    if room != WARMUP_ITEM:
                        report["bytes"] += nbytes
                polls.polled(len(still) < len(flights), len({rank for _, rank, _, _ in still}))
                flights = still
                if served < until:
                    if time.monotonic() - progressed > extra["deadline_s"]:
                        raise TimeoutError(f"floor encode {worker.rank}: {until - served} asks left, none came or "
                                           f"completed for {extra['deadline_s']:g}s")
                    select.select([fd], [], [], polls.sleep_s(time.monotonic()) if flights else 0.1)

        serve(len(receivers))  # each receiver's warm-up ask: its first write opens the connection
        # Found before the barrier: a rank that cannot run the cell fails it before any other times it.
        in_c = _native_floor() if native else None
        if in_c is not None:
            pointer, handles = _native_targets(engine, receivers)
            targets = [(rank, pushes[rank].underlying, handles[rank], info["row_start"], info["rows"])
                       for rank, info in receivers.items()]
        _start_timed(worker)
        cpu, report["t_start"] = thread_cpu(), time.time()  # the reading stays out of the timed window
        progressed = time.monotonic()
        if in_c is None:
            serve((cell.items + 1) * len(receivers))
        else:
            report["bytes"] = in_c.floor_serve(pointer, pull.underlying, fd, targets, cell.items * len(receivers),
                                               extra["deadline_s"], polls.min_s, polls.max_s, base, cell.row_bytes,
                                               *source.offset_steps(cell.span), WARMUP_ITEM)
        report["t_end"], report["cpu"] = time.time(), _cpu_since(cpu)
        worker.finished()
        return report
    finally:
        for sock in (pull, *pushes.values()):
            if sock is not None:
                sock.close(linger=1000)
        ctx.term()


def _native_floor() -> Any:
    """transfer._native with libzmq's functions bound (transfer._io binds them on import)."""
    from transfer import _io

    if _io._NATIVE is None:
        raise RuntimeError("the cfloor path needs transfer._native bound to pyzmq's libzmq 4")
    return _io._NATIVE


def _native_targets(engine, receivers: dict[int, dict]) -> tuple[int, dict[int, int]]:
    """The engine pointer and each receiver's segment handle for native/floor.c, once the warm-up
    writes opened the sessions; RuntimeError when this engine's writes go through the binding."""
    pointer, handles, missing = 0, {}, []
    for rank, info in receivers.items():
        target = engine.native_target(info["session"])
        if target is None:
            missing.append(rank)
        else:
            pointer, handles[rank] = target
    if missing:
        raise RuntimeError(f"the cfloor path needs Mooncake's calls from C (Engine.calls 'direct', here "
                           f"{engine.calls!r}: {engine.calls_reason}) and an open session to prefill rank(s) {missing}")
    return pointer, handles


def _floor_prefill(worker: _Worker, cell: Cell, extra: dict, native: bool = False) -> dict:
    """Floor prefill body: bare asks for `inflight` rooms at a time, each concluded by its bare status
    (`native`, the cfloor path: the timed rooms' asks and statuses in C, native/floor.c)."""
    import zmq

    slots, row_start, rows, info = _offered_slots(worker, cell, extra)
    host = worker.setup["host"]
    report: dict[str, Any] = {"latencies": [], "latency_rooms": [], "failed": [], "bytes": 0, "bad": []}
    ctx = zmq.Context()
    pull = push = None
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        landed = _Fingerprints(worker, cell, slots, row_start, rows)
        worker.ready({**info, "status_port": pull.bind_to_random_port(f"tcp://{host}")})
        push.connect(f"tcp://{host}:{worker.go()['port']}")
        bound_ms = int(extra["deadline_s"] * 1000)

        slot_of: dict[int, int] = {}  # room asked -> its slot

        def ask(room: int, slot: int) -> None:
            slot_of[room] = slot
            push.send(_FLOOR_ASK.pack(room, worker.rank, slots[slot].data_ptr()))

        def status() -> int:
            if not pull.poll(bound_ms):
                raise TimeoutError(f"floor prefill {worker.rank}: no status within {extra['deadline_s']:g}s")
            return int(_FLOOR_STATUS.unpack(pull.recv())[0])

        last: dict[int, int] = {}
        if rows:
            ask(WARMUP_ITEM, 0)  # untimed: the first write to this rank opens its connection
            status()
            slot_of.clear()
        _start_timed(worker)
        cpu, report["t_start"] = thread_cpu(), time.time()  # the reading stays out of the timed window
        in_c = None  # what the loop in C brought back, looked at once its window closed
        if rows and native:
            in_c = _native_floor().floor_receive(push.underlying, pull.underlying, pull.fileno(), worker.rank,
                                                 landed.slots[: cell.slots], cell.items, extra["deadline_s"],
                                                 landed.width, landed.nbytes)
        elif rows:
            started: dict[int, float] = {}
            asked = 0
            while asked < min(cell.slots, cell.items):
                started[asked] = time.monotonic()
                ask(asked, asked)
                asked += 1
            for _ in range(cell.items):
                room = status()
                slot = slot_of.pop(room)
                report["latencies"].append(time.monotonic() - started.pop(room))
                report["latency_rooms"].append(room)
                report["bytes"] += rows * cell.row_bytes
                last[slot] = room
                landed.check(room, slot, report["bad"])
                if asked < cell.items:  # into the slot this room just freed: writes may complete out of order
                    started[asked] = time.monotonic()
                    ask(asked, slot)
                    asked += 1
        report["t_end"], report["cpu"] = time.time(), _cpu_since(cpu)
        if in_c is not None:
            rooms, slots_of, latencies, prints = in_c
            width = 2 * landed.width
            for i, (room, slot) in enumerate(zip(memoryview(rooms).cast("q"), memoryview(slots_of).cast("q"))):
                report["latency_rooms"].append(room)
                last[slot] = room
                landed.compare(room, prints[i * width : (i + 1) * width], report["bad"])
            report["latencies"] = list(memoryview(latencies).cast("d"))
            report["bytes"] = cell.items * rows * cell.row_bytes
        worker.finished()
        report["bad"] += _check_slots(worker, cell, slots, last, row_start, rows)
        return report
    finally:
        if pull is not None:
            pull.close(linger=0)
        if push is not None:
            push.close(linger=1000)
        ctx.term()


def _bytes_written(pool) -> int:
    """The bytes a sender pool has written so far."""
    from transfer.metrics import total

    return int(total(pool.stats(), pool.metrics.full_name("bytes_written_total")))


def _warm_up(handle, deadline_s: float, who: str) -> None:
    """Waits out the untimed warm-up room (WARMUP_ROOM); if it fails, so does the cell."""
    from transfer.status import TransferPoll

    if handle.wait(deadline_s + 5) != TransferPoll.Success:
        raise RuntimeError(f"{who}: the warm-up room failed: {handle.failure}")
    handle.clear()


def _fill_sentinel(slots) -> None:
    """Fill receive slots with the sentinel byte so a write that never landed shows."""
    import torch

    from transfer.harness import SENTINEL

    slots.view(torch.uint8).fill_(SENTINEL)


class _Fingerprints:
    """Each room's shard's first and last FINGERPRINT_BYTES, read before the timed window: a room's check is ~1 us."""

    def __init__(self, worker: _Worker, cell: Cell, slots, row_start: int, rows: int) -> None:
        source = worker.source(cell)
        self.rank, self.nbytes = worker.rank, rows * cell.row_bytes
        self.width = min(FINGERPRINT_BYTES, self.nbytes)
        self.slots = [slots[slot].data_ptr() for slot in range(cell.slots)]
        shard = source.pool.data_ptr() + row_start * cell.row_bytes
        self.want = [self._read(shard + source.offset(room, cell.span) * cell.row_bytes) for room in range(cell.items)]

    def _read(self, addr: int) -> bytes:
        """The first and last `width` bytes of the shard at addr."""
        return ctypes.string_at(addr, self.width) + ctypes.string_at(addr + self.nbytes - self.width, self.width)

    def check(self, room: int, slot: int, bad: list[str]) -> None:
        """Add to `bad` if room's shard, just landed in slot, does not begin and end as its item's does."""
        self.compare(room, self._read(self.slots[slot]), bad)

    def compare(self, room: int, landed: bytes, bad: list[str]) -> None:
        """Add to `bad` if `landed`, a shard's first and last bytes as read when its room concluded,
        differ from room's item's."""
        if landed != self.want[room]:
            bad.append(_differs(self.rank, room, f"the first or last {self.width} landed bytes"))


def _differs(rank: int, room: int, what: str) -> str:
    """A prefill rank's problem with a room's landed bytes."""
    return f"prefill {rank} room {room}: {what} differ from the item"


def _check_slots(worker: _Worker, cell: Cell, slots, last: dict[int, int], row_start: int, rows: int) -> list[str]:
    """Compare each slot's last room with its item's shard; returns what differs."""
    import torch

    if not rows:
        return []
    source = worker.source(cell)
    bad = []
    for slot, room in sorted(last.items()):
        want = source.item(room, cell.span)[row_start : row_start + rows]
        if not torch.equal(slots[slot, :rows].view(torch.uint8), want.view(torch.uint8)):
            bad.append(_differs(worker.rank, room, "landed rows"))
    return bad


_BODIES: dict[tuple[str, str], Callable[[_Worker, Cell, dict], dict]] = {
    ("encode", "raw"): _raw_encode,
    ("prefill", "raw"): _raw_prefill,
    ("encode", "floor"): _floor_encode,
    ("prefill", "floor"): _floor_prefill,
    ("encode", "cfloor"): functools.partial(_floor_encode, native=True),
    ("prefill", "cfloor"): functools.partial(_floor_prefill, native=True),
    ("encode", "epd"): _epd_encode,
    ("prefill", "epd"): _epd_prefill,
}


# -------------------------------------------------------------- parent side


class RankSet:
    """`encode` encode and `prefill` prefill rank processes, serving cells until closed."""

    def __init__(self, opts: Options, prefill: int, arena_bytes: list[int], encode: int = 1) -> None:
        self.opts = opts
        self._ctx = mp.get_context("spawn")
        self.res_q = self._ctx.Queue()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if opts.log_dir:
            self.log_dir = opts.log_dir
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="epd-bench-")
            self.log_dir = self._tmp.name
        os.makedirs(self.log_dir, exist_ok=True)
        self.procs: dict[tuple[str, int], Any] = {}
        self.cmd_qs: dict[tuple[str, int], Any] = {}
        ranks = [("encode", e, 0) for e in range(encode)] + [("prefill", r, arena_bytes[r]) for r in range(prefill)]
        try:
            self._start(ranks)
        except BaseException:
            self.close()
            raise

    def _start(self, ranks: list[tuple[str, int, int]]) -> None:
        """Spawns the rank processes and waits until each has started."""
        from transfer.harness import ctrl_c_held

        ctx, opts = self._ctx, self.opts
        with ctrl_c_held():  # a Ctrl-C now reaches each rank once it can take it (_worker_main)
            for role, rank, arena in ranks:
                setup = {"host": opts.host, "arena_bytes": arena, "timeout_s": opts.timeout_s, "calls": opts.calls,
                         "log_path": os.path.join(self.log_dir, f"bench-{role}-{rank}.log")}
                cmd_q = ctx.Queue()
                proc = ctx.Process(target=_worker_main, args=(role, rank, setup, cmd_q, self.res_q),
                                   name=f"bench-{role}-{rank}", daemon=True)
                proc.start()
                self.procs[(role, rank)] = proc
                self.cmd_qs[(role, rank)] = cmd_q
        self._gather("started", list(self.procs))

    def run_cell(self, cell: Cell) -> dict:
        """Runs one transfer cell on encode ranks 0..E-1 and prefill ranks 0..P-1; returns the reports."""
        from transfer.bootstrap import BootstrapServer

        members = [("encode", e) for e in range(cell.encode_ranks)]
        members += [("prefill", r) for r in range(cell.prefill_ranks)]
        extra = {"protocol": self.opts.protocol, "raw_issue": self.opts.raw_issue,
                 "raw_writers": self.opts.raw_writers, "deadline_s": self.opts.deadline_s, "depth": self.opts.depth}
        server = BootstrapServer(self.opts.host, 0) if cell.path not in ("raw", "floor", "cfloor") else None
        try:
            if server is not None:
                extra["bootstrap"] = server.address
            for key in members:
                self.cmd_qs[key].put(("cell", cell, extra))
            ready = self._gather("ready", members)
            receivers = sorted((info for key, info in ready.items() if key[0] == "prefill" and info), key=lambda i: i["rank"])
            for role, rank in members:
                # A raw or floor encode rank writes to its own block, a floor prefill rank asks its
                # encode rank; the epd bodies ignore what go carries.
                if role == "encode":
                    carried = [info for info in receivers if info["rank"] // cell.fanout == rank]
                else:
                    carried = ready[("encode", rank // cell.fanout)]
                self.cmd_qs[(role, rank)].put(("go", carried))
            # Each rank warms up, says ready again, and opens its timed window only at this go
            # (_start_timed): no timed room runs while some rank still warms up.
            self._gather("ready", members)
            for key in members:
                self.cmd_qs[key].put(("go", None))
            self._gather("finished", members)
            for key in members:
                self.cmd_qs[key].put(("close", None))
            return self._gather("report", members)
        finally:
            if server is not None:
                server.close()

    def _gather(self, what: str, members: list[tuple[str, int]]) -> dict:
        """Waits for `what` from every member; a member's error or the timeout raises."""
        deadline = time.monotonic() + self.opts.timeout_s
        got: dict[tuple[str, int], Any] = {}
        while len(got) < len(members):
            try:
                kind, role, rank, payload = self.res_q.get(timeout=0.5)
            except queue_mod.Empty:
                dead = self._dead([k for k in members if k not in got], grace_s=0.0)
                if dead is not None:
                    raise RuntimeError(self._death(dead))
                if time.monotonic() > deadline:
                    missing = [f"{r} {n}" for r, n in members if (r, n) not in got]
                    raise TimeoutError(f"no {what!r} from {', '.join(missing)} within {self.opts.timeout_s:g}s")
                continue
            if kind == "no_memory":
                raise RuntimeError(f"{role} rank {rank}: {payload}: {SMALLER_CELLS}")
            if kind == "error":
                failed = f"{role} rank {rank} failed:\n{payload}\nlog: {self._log_tail((role, rank))}"
                # A rank that dies takes its peers' rooms down with it, and they may report first:
                # name the death as the cause and the peer's failure as what followed.
                dead = self._dead([k for k in members if k != (role, rank)], grace_s=1.0)
                if dead is not None:
                    raise RuntimeError(f"{self._death(dead)}\nthen {failed}")
                raise RuntimeError(failed)
            if kind != what:
                raise RuntimeError(f"{role} rank {rank} sent {kind!r} while the bench waited for {what!r}")
            got[(role, rank)] = payload
        return got

    def _dead(self, members: list[tuple[str, int]], grace_s: float) -> tuple[str, int] | None:
        """The first of `members` whose process has exited, waiting up to `grace_s` for one to."""
        procs = [self.procs[k] for k in members]
        if grace_s > 0 and all(p.is_alive() for p in procs):
            deadline = time.monotonic() + grace_s
            # A process's sentinel signals as its descriptors close, a moment before it can be reaped.
            for sentinel in wait_for_sentinels([p.sentinel for p in procs], timeout=grace_s):
                next(p for p in procs if p.sentinel == sentinel).join(max(0.0, deadline - time.monotonic()))
        return next((k for k in members if not self.procs[k].is_alive()), None)

    def _death(self, key: tuple[str, int]) -> str:
        """What the bench says about a rank process that exited."""
        return f"{key[0]} rank {key[1]} exited ({self.procs[key].exitcode}); log: {self._log_tail(key)}"

    def _log_tail(self, key: tuple[str, int], lines: int = 15) -> str:
        """The last lines of a rank's log, for error messages, under its path where --log-dir keeps it
        (a temporary folder is gone by the time the message is read)."""
        path = os.path.join(self.log_dir, f"bench-{key[0]}-{key[1]}.log")
        where = path if self._tmp is None else "its last lines (keep the whole log with --log-dir)"
        try:
            with open(path, errors="replace") as fh:
                return where + "\n" + "".join(fh.readlines()[-lines:])
        except OSError:
            return path if self._tmp is None else "unreadable"

    def close(self) -> None:
        """Stop every rank process (bounded), then drop the temporary logs."""
        for key, cmd_q in self.cmd_qs.items():
            if self.procs[key].is_alive():
                cmd_q.put(("stop", None))
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RankSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def row_of(cell: Cell, reports: dict) -> dict:
    """One table row from a cell's rank reports.

    `encode_bytes` lists what each encode rank reports it wrote in its timed window (None
    where a report has no count); `prefill_bytes`, what each prefill rank reports landed.
    """
    encodes = [v for k, v in sorted(reports.items()) if k[0] == "encode"]
    prefill = [v for k, v in sorted(reports.items()) if k[0] == "prefill"]
    if cell.path == "raw":
        latencies = sorted(_room_latencies(encodes))
        starts, ends = [r["t_start"] for r in encodes], [r["t_end"] for r in encodes]
        nbytes = sum(r["bytes"] for r in encodes)
        failed = {room for r in encodes for room, _ in r["failed"]}
    else:
        latencies = sorted(_room_latencies(prefill))
        starts = [r["t_start"] for r in encodes + prefill]
        ends = [r["t_end"] for r in prefill]
        nbytes = sum(r["bytes"] for r in prefill)
        failed = {room for r in prefill + encodes for room, _ in r["failed"]}
    split = cpu_per_room(cell, [r.get("cpu") for r in prefill + encodes])
    threads = None if cell.path == "raw" else {
        "encode": thread_cpu_per_room(cell, [r.get("cpu") for r in encodes]),
        "prefill": thread_cpu_per_room(cell, [r.get("cpu") for r in prefill])}
    reasons = [why for r in prefill + encodes for _, why in r.get("failed", [])]
    bad = [b for r in prefill for b in r.get("bad", [])]
    wall = max(ends) - min(starts)
    return {
        "path": cell.path, "item_bytes": cell.item_bytes, "span": cell.span, "hidden": cell.hidden, "dtype": cell.dtype,
        "encode_ranks": cell.encode_ranks, "fanout": cell.fanout,
        "inflight": cell.inflight, "integrity": cell.integrity, "gbps": nbytes / wall / 1e9 if wall > 0 else 0.0,
        "rooms_per_s": (cell.items - len(failed)) / wall if wall > 0 else 0.0,
        "p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3,
        "ratio_to_raw": None, "p50_added_ms": None, "items": cell.items, "failed": len(failed),
        "verified": not bad and not failed, "problems": (reasons + bad)[:5],
        "cpu_control_ms": split["control"], "cpu_transport_ms": split["transport"],
        "cpu_mooncake_ms": split["mooncake"], "cpu_threads": threads, "stages_ms": stage_p50s(cell, encodes, prefill),
        "encode_bytes": [r.get("bytes") for r in encodes],
        "prefill_bytes": [r.get("bytes") for r in prefill] if cell.path != "raw" else None,
    }


def cpu_per_room(cell: Cell, readings: list[dict | None]) -> dict[str, float | None]:
    """Each room's CPU ms per side, summed over the ranks' readings, and 'mooncake', the part of the
    control side spent inside Mooncake's calls (None unless every rank counted it); all None when a
    reading is missing.

    A raw cell has no control plane: its main threads only submit and wait through
    Mooncake's API (the harness standing in for a caller), so all its time is transport.
    """
    present = [c for c in readings if c is not None]
    if len(present) < len(readings):
        return {"control": None, "transport": None, "mooncake": None}
    control, transport = (sum(c[side] for c in present) * 1e3 / cell.items for side in ("control", "transport"))
    if cell.path == "raw":
        return {"control": 0.0, "transport": control + transport, "mooncake": None}
    counted = cell.path != "wire" and all("mooncake" in c for c in present)  # the wire path makes no such call
    mooncake = sum(c["mooncake"] for c in present) * 1e3 / cell.items if counted else None
    return {"control": control, "transport": transport, "mooncake": mooncake}


def thread_cpu_per_room(cell: Cell, readings: list[dict | None]) -> dict[str, dict[str, float]] | None:
    """Each room's control-plane CPU ms and voluntary switches per thread group, summed over one role's
    ranks: {group: {'ms': ..., 'switches': ...}}, with 'calls' (Python calls) when counted; None when a
    rank has no per-thread reading."""
    if not readings or any(c is None or "groups" not in c for c in readings):
        return None
    out: dict[str, dict[str, float]] = {}
    for reading in readings:
        assert reading is not None  # narrowed above
        for group, (seconds, switches, *calls) in reading["groups"].items():
            entry = out.setdefault(group, {"ms": 0.0, "switches": 0.0})
            entry["ms"] += seconds * 1e3 / cell.items
            entry["switches"] += switches / cell.items
            if calls and calls[0] is not None:
                entry["calls"] = entry.get("calls", 0.0) + calls[0] / cell.items
    return out


def stage_p50s(cell: Cell, encodes: list[dict], prefill: list[dict]) -> dict[str, float] | None:
    """Each of STAGES' p50 in ms from a prefill rank's receive(), over every prefill rank's rooms
    that succeeded on both sides; None when a report has no stages (raw, floor) or no room has all.

    Prefill rank p is served by encode rank p // fanout; the offered stage is that encode
    rank's send(), the others are the handles' own stages (README, "Where a room's time goes").
    """
    if not prefill or any("stages" not in r for r in encodes + prefill):
        return None
    samples: dict[str, list[float]] = {name: [] for name in STAGES}
    for rank, report in enumerate(prefill):
        encode = encodes[rank // cell.fanout]["stages"]
        for room, (started, stages) in report["stages"].items():
            if room not in encode:
                continue
            offered, served = encode[room]
            at = {"offered": offered}
            at.update((name, started + stages[name]) for name in ("asked", "status", "concluded") if name in stages)
            at.update((ours, offered + served[theirs]) for ours, theirs in _ENCODE_STAGES if theirs in served)
            if len(at) < len(STAGES):
                continue  # a stage it never reached
            for name in STAGES:
                samples[name].append(at[name] - started)
    if not samples["asked"]:
        return None
    return {name: percentile(sorted(values), 50) * 1e3 for name, values in samples.items()}


def format_stages(rows: list[dict]) -> str:
    """The epd and wire rows' stages (ms from a prefill rank's receive(), p50) as an aligned table."""
    head = ["path", "item", "fanout", "inflight", "integrity", *STAGES]
    item = _item_label(rows)
    body = [[r["path"], item(r), str(r["fanout"]), str(r["inflight"]),
             "on" if r["integrity"] else "off", *(f"{r['stages_ms'][name]:.3f}" for name in STAGES)]
            for r in rows if r.get("stages_ms")]
    return _aligned(head, body)


def format_calls(rows: list[dict]) -> str:
    """The floor, epd and wire rows' Python calls a room per role and thread group (summed over the
    role's ranks) as an aligned table."""
    columns = [(role, group) for role in ("encode", "prefill") for group in ("caller", "driver", "other")]
    counted = [r for r in rows if r.get("cpu_threads")
               and any("calls" in g for t in r["cpu_threads"].values() if t for g in t.values())]
    shown = [(role, group) for role, group in columns
             if any((r["cpu_threads"].get(role) or {}).get(group, {}).get("calls") for r in counted)]
    head = ["path", "item", "fanout", "inflight", "integrity", *(f"{role} {group}" for role, group in shown)]
    item = _item_label(rows)

    def calls(r: dict, role: str, group: str) -> str:
        entry = (r["cpu_threads"].get(role) or {}).get(group, {})
        return f"{entry['calls']:.0f}" if "calls" in entry else "-"

    body = [[r["path"], item(r), str(r["fanout"]), str(r["inflight"]), "on" if r["integrity"] else "off",
             *(calls(r, role, group) for role, group in shown)] for r in counted]
    return _aligned(head, body)


def _room_latencies(reports: list[dict]) -> list[float]:
    """One latency per room: its slowest rank's (a prefill rank's, or for raw an encode rank's last shard).

    Pooling the ranks' latencies instead would count one slow shard as one sample among
    fanout x rooms, and report a p99 per shard, better than raw's per room.
    """
    if not all("latency_rooms" in r for r in reports):  # reports without room numbers
        return [lat for r in reports for lat in r["latencies"]]
    slowest: dict[int, float] = {}
    for report in reports:
        for room, lat in zip(report["latency_rooms"], report["latencies"]):
            slowest[room] = max(lat, slowest.get(room, lat))
    return list(slowest.values())


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of sorted values (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, math.ceil(pct / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


def memcpy_row(span: int, hidden: int, dtype: str, items: int, passes: int = 3) -> dict:
    """Host copy bandwidth of one item (single-threaded memmove), the best of `passes` passes.

    One source and two destinations, reused: where the three fit in the last-level cache
    (512 KiB items; 8 MiB ones on a 32 MiB L3) this is the cache's copy rate, not memory's,
    so an upper bound for the transfer paths, whose receive slots span more.
    """
    import ctypes

    import torch

    item_bytes = span * hidden * dtype_size(dtype)
    what = f"a memcpy item of {span}x{hidden} {dtype}"
    src = allocate(lambda: torch.randint(0, 256, (item_bytes,), dtype=torch.uint8), item_bytes, what)
    dsts = [allocate(lambda: torch.empty_like(src), item_bytes, f"a copy of {what}") for _ in range(2)]
    for dst in dsts:  # fault the pages in first: a ceiling, not a page-fault test
        dst.copy_(src)
    src_addr = src.data_ptr()
    dst_addrs = [dst.data_ptr() for dst in dsts]
    latencies: list[float] = []
    best = math.inf
    for _ in range(passes):
        start = time.perf_counter()
        for i in range(items):
            t0 = time.perf_counter()
            ctypes.memmove(dst_addrs[i % 2], src_addr, item_bytes)
            latencies.append(time.perf_counter() - t0)
        best = min(best, time.perf_counter() - start)
    if not torch.equal(dsts[0], src):
        raise RuntimeError("memcpy: the copy differs from its source")
    latencies.sort()
    return {
        "path": "memcpy", "item_bytes": item_bytes, "span": span, "hidden": hidden, "dtype": dtype, "encode_ranks": 1,
        "fanout": 1, "inflight": 1,
        "integrity": False, "gbps": items * item_bytes / best / 1e9, "rooms_per_s": items / best,
        "p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3,
        "ratio_to_raw": None, "p50_added_ms": None, "items": items, "failed": 0, "verified": True, "problems": [],
        "cpu_control_ms": None, "cpu_transport_ms": None, "cpu_mooncake_ms": None, "cpu_threads": None,
        "stages_ms": None, "encode_bytes": None,
        "prefill_bytes": None,
    }


def fill_ratios(rows: list[dict]) -> None:
    """ratio_to_raw: against raw in the same cell (the median of per-turn ratios when repeated);
    memcpy against the best raw of its item geometry. None where that raw lost rooms or bytes: its
    GB/s counts only what landed, so a ratio to it would flatter the path."""
    raws = [r for r in rows if r["path"] == "raw" and r.get("verified", True)]
    raw = {_geometry(r): r["gbps"] for r in raws}
    best: dict[tuple, float] = {}
    for r in raws:
        best[_shape(r)] = max(best.get(_shape(r), 0.0), r["gbps"])
    for row in rows:
        ref = best.get(_shape(row)) if row["path"] == "memcpy" else raw.get(_geometry(row))
        row["ratio_to_raw"] = row["gbps"] / ref if ref else None
        if ref and row.get("ratio_runs"):
            row["ratio_to_raw"] = statistics.median(row["ratio_runs"])


def _shape(row: dict) -> tuple:
    """A row's item: (bytes, rows, hidden, dtype); two items of one size may differ in the rest."""
    return row["item_bytes"], row.get("span"), row.get("hidden"), row.get("dtype")


def _geometry(row: dict) -> tuple:
    """A row's cell without its path: its item's _shape(), encode ranks, fanout, rooms in flight."""
    return *_shape(row), row.get("encode_ranks", 1), row["fanout"], row["inflight"]


def _item_label(rows: list[dict]) -> Callable[[dict], str]:
    """How the tables name a row's item: its size, with rows x hidden where another item of the rows has that size."""
    shapes: dict[int, set] = {}
    for row in rows:
        shapes.setdefault(row["item_bytes"], set()).add(_shape(row))

    def label(row: dict) -> str:
        size = human_bytes(row["item_bytes"])
        return f"{size} {row['span']}x{row['hidden']}" if len(shapes[row["item_bytes"]]) > 1 else size

    return label


#: What to do when the bench's buffers do not fit this host.
SMALLER_CELLS = "give smaller --sizes, or a lower --inflight, --fanouts or --encode-ranks"


def memory_need(opts: Options) -> int:
    """Bytes the bench holds at once, at least: its ranks' receive arenas and the item pools of the cell that
    needs most (its encode ranks send from one, its prefill ranks check against it), or the memcpy path's item
    and its two copies (in this process, before the ranks start)."""
    from transfer.harness import ItemSource

    cells = plan(opts, "wire" in opts.paths and wire_available() is None)
    need = 0
    if "memcpy" in opts.paths:
        need = 3 * max(span * hidden * dtype_size(opts.dtype) for span, hidden in opts.sizes)
    if cells:
        pools = max(ItemSource.pool_bytes(c.span, c.hidden, c.dtype, distinct=_distinct_rooms(c))
                    * (c.encode_ranks + sum(1 for r in range(c.prefill_ranks) if c.shard(r)[1])) for c in cells)
        need = max(need, sum(arena_sizes(opts, cells)) + pools)
    return need


def memory_refusal(opts: Options) -> str | None:
    """Why the bench's buffers (memory_need) cannot be held on this host, or None."""
    from transfer.harness import memory_refusal as refusal

    span, hidden = max(opts.sizes, key=lambda size: size[0] * size[1])
    return refusal(memory_need(opts), f"items up to {span}x{hidden} {opts.dtype}")


def arena_sizes(opts: Options, cells: list[Cell]) -> list[int]:
    """Receive bytes each prefill rank needs at most over the plan."""
    need = [0] * max([c.prefill_ranks for c in cells] or [1])
    for cell in cells:
        for rank in range(cell.prefill_ranks):
            rows = max(1, cell.shard(rank)[1])
            need[rank] = max(need[rank], cell.slots * rows * cell.row_bytes)
    return need


# ------------------------------------------------------------------ output


def human_bytes(n: int) -> str:
    """512 KiB, 8 MiB, 1.5 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            value = n / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def format_table(rows: list[dict], cpu: bool = False) -> str:
    """The rows as an aligned text table; with cpu, each room's CPU ms (control plane, the part of it inside
    Mooncake's calls, transport).

    An `encode` column (encode ranks) appears when some row has more than one; an item is
    named by its rows x hidden too where two of the rows' items have one size.
    """
    encode = any(r.get("encode_ranks", 1) > 1 for r in rows)
    head = ["path", "item", "fanout", "inflight", "integrity", "GB/s", "rooms/s", "p50 ms", "p99 ms", "ratio"]
    if encode:
        head.insert(2, "encode")
    if cpu:
        head += ["control ms", "mooncake ms", "transport ms"]
    body = []
    item = _item_label(rows)
    for r in rows:
        ratio = "-" if r["ratio_to_raw"] is None else f"{r['ratio_to_raw']:.2f}"
        path = r["path"] + ("" if r.get("verified", True) else " !")
        line = [path, item(r), str(r["fanout"]), str(r["inflight"]),
                "on" if r["integrity"] else "off", f"{r['gbps']:.3f}", f"{r['rooms_per_s']:.1f}",
                f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", ratio]
        if encode:
            line.insert(2, str(r.get("encode_ranks", 1)))
        if cpu:
            line += ["-" if r.get(key) is None else f"{r[key]:.3f}"
                     for key in ("cpu_control_ms", "cpu_mooncake_ms", "cpu_transport_ms")]
        body.append(line)
    return _aligned(head, body)


@dataclass(frozen=True)
class Target:
    """One bound on the epd path's figures in one cell: the control plane's budget per room."""

    what: str  # the figure, as the table names it
    key: str  # the row's key that holds it
    span: int
    hidden: int
    fanout: int
    inflight: int
    integrity: bool
    bound: float
    at_least: bool  # True: the figure must reach the bound; False: stay at or under it
    dtype: str = "torch.bfloat16"

    @property
    def item_bytes(self) -> int:
        return self.span * self.hidden * dtype_size(self.dtype)

    def geometry(self) -> tuple:
        """The _geometry() of the row this target checks."""
        return self.item_bytes, self.span, self.hidden, self.dtype, 1, self.fanout, self.inflight

    def holds(self, value: float) -> bool:
        """Whether a figure of `value` meets the bound."""
        return value >= self.bound if self.at_least else value <= self.bound

    def cell(self) -> str:
        """'8 MiB (1024x4096), fanout 4, 8 in flight, integrity off'."""
        return (f"{human_bytes(self.item_bytes)} ({self.span}x{self.hidden}), fanout {self.fanout}, "
                f"{self.inflight} in flight, integrity {'on' if self.integrity else 'off'}")


#: The control plane's budget per room, from the hardware it is for: a 400 Gb/s NIC moves
#: 512 KiB in about 10 us and 8 MiB in about 170 us, so the rules, messages and polls of a
#: room must cost a fraction of a millisecond (docs/performance.md, "The control plane's cost
#: per room"). `--targets` measures these cells and checks the epd path against them.
TARGETS = (
    Target("control CPU ms a room", "cpu_control_ms", 1024, 4096, 1, 8, False, 0.3, False),
    Target("control CPU ms a room", "cpu_control_ms", 1024, 4096, 4, 8, False, 0.6, False),
    Target("control CPU ms a room", "cpu_control_ms", 64, 4096, 4, 8, False, 0.3, False),
    Target("p50 added over raw, ms", "p50_added_ms", 64, 4096, 1, 1, False, 0.3, False),
    Target("p50 added over raw, ms", "p50_added_ms", 64, 4096, 4, 1, False, 0.5, False),
    Target("ratio to raw", "ratio_to_raw", 64, 4096, 4, 8, False, 0.5, True),
    Target("ratio to raw", "ratio_to_raw", 1024, 4096, 1, 8, False, 0.9, True),
    Target("ratio to raw", "ratio_to_raw", 1024, 4096, 4, 8, False, 0.9, True),
    Target("ratio to raw", "ratio_to_raw", 1024, 4096, 1, 8, True, 0.8, True),
    Target("ratio to raw", "ratio_to_raw", 1024, 4096, 4, 8, True, 0.8, True),
)
#: What `--targets` measures when nothing else is given: every cell TARGETS names.
TARGET_SIZES = "64x4096,1024x4096"


def check_targets(rows: list[dict], targets: tuple[Target, ...] = TARGETS) -> list[dict]:
    """Each target with the epd row's figure (`measured`) and whether it holds (`met`).

    A target whose cell was not measured, whose figure is missing, or whose row lost rooms or
    bytes reads `measured` None and `met` None: not a pass, not a failure.
    """
    epd = {(_geometry(r), r["integrity"]): r for r in rows if r["path"] == "epd"}
    results = []
    for target in targets:
        row = epd.get((target.geometry(), target.integrity))
        value = row.get(target.key) if row is not None and row.get("verified", True) else None
        met = None if value is None else target.holds(value)
        result = {"target": target, "measured": value, "met": met}
        mooncake = row.get("cpu_mooncake_ms") if row is not None and value is not None else None
        if target.key == "cpu_control_ms" and mooncake is not None:
            result["mooncake"] = mooncake  # the part of the figure inside Mooncake's calls
        results.append(result)
    return results


def format_targets(results: list[dict]) -> str:
    """The checked targets as a table, how many of them held, and of each control CPU figure measured, the
    part spent inside Mooncake's calls."""
    body = []
    for result in results:
        target, value, met = result["target"], result["measured"], result["met"]
        bound = f"{'at least' if target.at_least else 'at most'} {target.bound:g}"
        body.append([target.what, target.cell(), bound, "-" if value is None else _shown(value, target),
                     {True: "yes", False: "no", None: "not measured"}[met]])
    table = _aligned(["figure", "cell", "target", "measured", "met"], body)
    held = sum(1 for r in results if r["met"])
    measured = sum(1 for r in results if r["met"] is not None)
    lines = [table, f"{held} of {len(results)} targets met ({len(results) - measured} not measured)"]
    for r in results:
        if "mooncake" in r:
            lines.append(f"of the control CPU, {r['target'].cell()}: {r['mooncake']:.3f} ms inside Mooncake's write "
                         f"and status calls, {r['measured'] - r['mooncake']:.3f} ms the rest")
    return "\n".join(lines)


def _shown(value: float, target: Target) -> str:
    """value to 3 decimals, or as many more as it takes to read on the side of the bound it lies."""
    for digits in range(3, 17):
        text = f"{value:.{digits}f}"
        if target.holds(float(text)) == target.holds(value):
            return text
    return repr(value)


def _aligned(head: list[str], body: list[list[str]]) -> str:
    """Columns padded to their widest cell: the first two to the left, the figures to the right."""
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.rjust(w) if i >= 2 else x.ljust(w) for i, (x, w) in enumerate(zip(line, widths)))
                     for line in [head] + body)


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, stream=None) -> None:
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.monotonic()

    def step(self, label: str) -> None:
        """Count one finished cell and redraw."""
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / max(1, self.total))
        elapsed = time.monotonic() - self.started
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                          f"{elapsed:5.0f}s  {label[:40]:<40}")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """GB/s, ratio to raw and p99 against item size, one line per path, one column per fanout.

    GB/s and p99 are on log scales: memcpy (drawn dashed, the ceiling) runs ten times
    faster than any transfer path, which a linear axis would flatten into one line.
    Integrity on is drawn dotted with hollow markers, so the two runs of a path differ in
    more than colour. `title` (protocol, repeats) heads the figure.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib  (or: pip install 'epd-transfer[plot]')") from None
    fanouts = sorted({r["fanout"] for r in rows if r["path"] != "memcpy"}) or [1]
    inflights = sorted({r["inflight"] for r in rows if r["path"] != "memcpy"})
    window = 8 if 8 in inflights else (inflights[-1] if inflights else 1)
    sizes_seen = sorted({r["item_bytes"] for r in rows})
    fig, axes = plt.subplots(3, len(fanouts), figsize=(5.5 * len(fanouts), 11.5), squeeze=False)
    def label_of(row: dict) -> str:
        if row["path"] == "memcpy":
            return "memcpy (one copy at a time)"
        encode = row.get("encode_ranks", 1)
        label = row["path"] + (" +integrity" if row["integrity"] else "")
        return label + (f" E={encode}" if encode > 1 else "")

    colours = {label: f"C{i % 10}" for i, label in enumerate(sorted({label_of(r) for r in rows}))}  # same in every panel
    for col, fanout in enumerate(fanouts):
        series: dict[str, list[tuple[int, float, float, float | None]]] = {}
        for r in rows:
            if r["path"] == "memcpy" or (r["fanout"] == fanout and r["inflight"] == window):
                series.setdefault(label_of(r), []).append((r["item_bytes"], r["gbps"], r["p99_ms"], r.get("ratio_to_raw")))
        gbps_ax, ratio_ax, p99_ax = (axes[row][col] for row in range(3))
        for label, points in sorted(series.items()):
            points.sort()
            sizes = [p[0] for p in points]
            integrity = "+integrity" in label
            style = {"marker": "o", "label": label, "color": colours[label],
                     "linestyle": "--" if label.startswith("memcpy") else (":" if integrity else "-"),
                     "markerfacecolor": "none" if integrity else colours[label]}
            gbps_ax.plot(sizes, [p[1] for p in points], **style)
            p99_ax.plot(sizes, [p[2] for p in points], **style)
            ratios = [(size, p[3]) for size, p in zip(sizes, points) if p[3] is not None]
            if label != "raw" and not label.startswith("memcpy") and ratios:
                ratio_ax.plot([x for x, _ in ratios], [y for _, y in ratios], **style)
        ratio_ax.axhline(1.0, color="grey", linewidth=0.8)
        gbps_ax.set_title(f"fanout {fanout}, {window} room{'s' if window > 1 else ''} in flight")
        gbps_ax.set_ylabel("GB/s (log)")
        ratio_ax.set_ylabel("ratio to raw GB/s")
        p99_ax.set_ylabel("p99 latency, ms (log)")
        gbps_ax.set_yscale("log")
        p99_ax.set_yscale("log")
        for ax in (gbps_ax, p99_ax):  # 20 and 0.1, not 2 x 10^1 and 10^-1
            ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:g}"[0] in "25" else ""))
        for ax in (gbps_ax, ratio_ax, p99_ax):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(FixedLocator(sizes_seen))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([human_bytes(n) for n in sizes_seen])
            ax.set_xlabel("item size")
            ax.grid(True, which="both", alpha=0.3)
    # One legend for the figure, below the panels, where it covers no line.
    handles, labels = {}, []
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    fig.legend([handles[label] for label in labels], labels, loc="lower center", ncol=min(4, len(labels)),
               fontsize="small", frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97 if title else 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------ driver


def measure(opts: Options, progress: Progress | None = None, notes: list[str] | None = None) -> list[dict]:
    """Runs the whole plan and returns the rows, ratios filled in."""
    notes = notes if notes is not None else []
    wire_ok = True
    if "wire" in opts.paths:
        why = wire_available()
        if why:
            wire_ok = False
            notes.append(f"wire: skipped, {why}")
    cells = plan(opts, wire_ok)
    memcpys = [(s, h) for s, h in opts.sizes] if "memcpy" in opts.paths else []
    progress = progress or Progress(len(cells) + len(memcpys))
    progress.total = len(cells) + len(memcpys)
    rows = []
    for span, hidden in memcpys:
        item_bytes = span * hidden * dtype_size(opts.dtype)
        rows.append(memcpy_row(span, hidden, opts.dtype, opts.items_for(item_bytes, 1)))
        progress.step(f"memcpy {human_bytes(item_bytes)}")
    if cells:
        repeat = max(1, opts.repeat)
        progress.total = len(cells) * repeat + len(memcpys)
        with RankSet(opts, max(c.prefill_ranks for c in cells), arena_sizes(opts, cells),
                     encode=max(c.encode_ranks for c in cells)) as ranks:
            for group in _groups(cells):
                runs: dict[Cell, list[dict]] = {cell: [] for cell in group}
                # The paths of one geometry take turns, so a slow spell of a shared host
                # falls on every path rather than on whichever ran during it; every other
                # turn runs them in reverse, so no path always goes first.
                for turn in range(repeat):
                    for cell in (group if turn % 2 == 0 else group[::-1]):
                        runs[cell].append(row_of(cell, ranks.run_cell(cell)))
                        flag = "+i" if cell.integrity else ""
                        encode = f" e{cell.encode_ranks}" if cell.encode_ranks > 1 else ""
                        progress.step(f"{cell.path}{flag} {human_bytes(cell.item_bytes)}{encode} f{cell.fanout} "
                                      f"i{cell.inflight}")
                raw = next((found for cell, found in runs.items() if cell.path == "raw"), None)
                rows += [median_row(found, raw) for found in runs.values()]
    progress.close()
    fill_ratios(rows)
    order = {p: i for i, p in enumerate(PATHS)}
    rows.sort(key=lambda r: (r["item_bytes"], r["span"], r["encode_ranks"], r["fanout"], r["inflight"], order[r["path"]],
                             not r["integrity"]))
    return rows


def _groups(cells: list[Cell]) -> list[list[Cell]]:
    """Consecutive cells of one geometry (encode ranks, fanout, size, window), in plan order."""
    geometries = itertools.groupby(cells, key=lambda cell: (cell.encode_ranks, cell.fanout, cell.span, cell.hidden,
                                                            cell.inflight))
    return [list(group) for _, group in geometries]


def median_row(runs: list[dict], raw: list[dict] | None = None) -> dict:
    """The run with the median GB/s (its latencies with it), every run's GB/s, and any failure.

    With `raw`, the raw runs of the same turns: `ratio_runs` pairs each run with the raw
    run of its own turn, and fill_ratios() reports their median, so a slow spell of the
    host that hit both paths of a turn cancels out. A floor, cfloor, epd or wire row's
    `p50_added_ms` is its reported run's p50 less that of the raw run of the same turn (None
    where that raw run lost rooms: its p50 would leave them out).
    """
    turn = sorted(range(len(runs)), key=lambda i: runs[i]["gbps"])[(len(runs) - 1) // 2]
    row = dict(runs[turn])
    row["gbps_runs"] = [r["gbps"] for r in runs]
    paired = raw if raw is not None and len(raw) == len(runs) else None
    if paired is not None and all(r["gbps"] > 0 for r in paired):
        row["ratio_runs"] = [r["gbps"] / ref["gbps"] for r, ref in zip(runs, paired)]
    if paired is not None and row["path"] in ("floor", "cfloor", "epd", "wire") and paired[turn].get("verified", True):
        row["p50_added_ms"] = row["p50_ms"] - paired[turn]["p50_ms"]
    broken = [r for r in runs if not r["verified"]]
    if broken:
        row.update(verified=False, failed=max(r["failed"] for r in broken), problems=broken[0]["problems"])
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's options on its subcommand parser."""
    parser.add_argument("--sizes", type=parse_sizes, default=None,
                        help=f"item sizes as ROWSxHIDDEN, comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--dtype", type=_dtype, default="torch.bfloat16", help="element type of the items")
    parser.add_argument("--fanouts", type=parse_ints, default=None, help="prefill ranks per encode rank (default 1,2,4)")
    parser.add_argument("--encode-ranks", type=parse_ints, default=None,
                        help="encode ranks E (default 1); a cell has E x fanout prefill ranks, each item's rows "
                             "split over all of them, each encode rank writing its block's share")
    parser.add_argument("--inflight", type=parse_ints, default=None, help="rooms in flight (default 1,8,32)")
    parser.add_argument("--paths", type=parse_paths, default=None,
                        help=f"subset of {','.join(PATHS)} (default {','.join(DEFAULT_PATHS)})")
    parser.add_argument("--integrity", type=parse_integrity, default=None,
                        help="epd/wire checksums: on, off or on,off (default on,off)")
    parser.add_argument("--items", type=_positive_int, default=None, help="rooms per cell (default: ~--cell-mib per cell)")
    parser.add_argument("--cell-mib", type=_positive_int, default=None, help="MiB moved per cell when --items is not given (default 256)")
    parser.add_argument("--min-items", type=_positive_int, default=None, help="fewest rooms per cell (default 16)")
    parser.add_argument("--protocol", default="tcp", choices=["tcp", "rdma", "auto"],
                        help="Mooncake protocol of the raw and epd paths")
    parser.add_argument("--host", type=_rank_host, default="127.0.0.1", help="IPv4 address every rank binds")
    parser.add_argument("--depth", type=_positive_int, default=None,
                        help="async batches the epd sender pool keeps in flight (default: the pool's own)")
    parser.add_argument("--raw-issue", choices=["async", "sync"], default="async",
                        help="raw writes: write_async + wait (async) or sync writes from --raw-writers threads")
    parser.add_argument("--raw-writers", type=_positive_int, default=2, help="threads for --raw-issue sync")
    parser.add_argument("--deadline", type=_seconds, default=60.0, help="per-room deadline of the epd and wire paths, seconds")
    parser.add_argument("--timeout", type=_seconds, default=300.0, help="bound on each step of a cell, seconds")
    parser.add_argument("--repeat", type=_positive_int, default=1,
                        help="runs per cell, the paths of a geometry taking turns; reports the median run")
    parser.add_argument("--log-dir", default=None, help="keep the rank processes' logs here (default: a temporary folder, removed)")
    parser.add_argument("--quick", action="store_true",
                        help="a subset: 512 KiB and 8 MiB, fanout 1 and 4, 8 in flight, ~64 MiB (at least 8 rooms) "
                             "per cell")
    parser.add_argument("--targets", action="store_true",
                        help="check the epd path against the control plane's budget per room (docs/performance.md); "
                             "measures 512 KiB and 8 MiB, fanout 1 and 4, 1 and 8 in flight, raw and epd, "
                             "integrity on and off, wherever those options are not given")
    parser.add_argument("--cpu", action="store_true",
                        help="add each room's CPU ms to the table: our control plane, and the transport's threads")
    parser.add_argument("--calls", action="store_true",
                        help="also count each thread's Python calls a room (cProfile on every rank's Python threads; "
                             "that run's times and ratios are slowed by it; Python 3.10 and 3.11 only)")
    parser.add_argument("--stages", action="store_true",
                        help="also print where each epd and wire room's time went: the p50 of each stage, ms from "
                             "a prefill rank's receive()")
    parser.add_argument("--json", metavar="FILE", nargs="?", const="-", default=None,
                        help="print the rows as JSON instead of the table, or also write them to FILE and say where "
                             "(default: the table only)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw GB/s, the ratio to raw and p99 against item size into FILE.png (default: no plot)")


def options_from(args: argparse.Namespace) -> Options:
    """Options from parsed arguments; --quick fills whatever was not given."""
    quick = getattr(args, "quick", False)
    targets = getattr(args, "targets", False)
    opts = Options()
    opts.sizes = args.sizes or (parse_sizes(TARGET_SIZES) if quick or targets else opts.sizes)
    opts.fanouts = args.fanouts or ([1, 4] if quick or targets else opts.fanouts)
    opts.encode_ranks = getattr(args, "encode_ranks", None) or opts.encode_ranks
    opts.inflight = args.inflight or ([1, 8] if targets else [8] if quick else opts.inflight)
    opts.paths = args.paths or (["raw", "epd"] if targets else opts.paths)
    opts.integrity = args.integrity if args.integrity is not None else opts.integrity
    opts.items = args.items
    opts.cell_bytes = (args.cell_mib or (64 if quick else 256)) * MiB
    opts.min_items = args.min_items or (8 if quick else opts.min_items)
    for name in ("dtype", "protocol", "host", "depth", "raw_issue", "raw_writers", "log_dir"):
        setattr(opts, name, getattr(args, name))
    opts.timeout_s = args.timeout
    opts.repeat = max(1, getattr(args, "repeat", 1) or 1)
    opts.deadline_s = args.deadline
    opts.calls = getattr(args, "calls", False)
    return opts


def main(args: argparse.Namespace) -> int:
    """Run the bench; 0 when every cell moved every byte correctly."""
    opts = options_from(args)
    refusal = memory_refusal(opts)  # said now, not by a rank's traceback once it fails to allocate
    if refusal is not None:
        print(f"epd-transfer bench: {refusal}: {SMALLER_CELLS}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            print("epd-transfer bench: --plot needs matplotlib: pip install matplotlib "
                  "(or: pip install 'epd-transfer[plot]')", file=sys.stderr)
            return 2
    notes: list[str] = []
    try:
        rows = measure(opts, notes=notes)
    except (RuntimeError, TimeoutError) as exc:
        print(f"epd-transfer bench: {exc}", file=sys.stderr)
        return 1
    except NoMemory as exc:  # the memcpy path's, in this process
        print(f"epd-transfer bench: {exc}: {SMALLER_CELLS}", file=sys.stderr)
        return 1
    broken = [r for r in rows if not r["verified"]]
    as_json = args.json == "-"  # the rows on stdout instead of the table
    if not as_json:
        pool = f"depth {opts.depth}" if opts.depth is not None else ""
        print(f"epd-transfer bench: protocol {opts.protocol} on {opts.host}, sender pool "
              f"{pool or 'defaults'}, raw issue {opts.raw_issue}, {interpreter()}, {usable_cpus()} CPUs")
        print(format_table(rows, cpu=getattr(args, "cpu", False)))
        if opts.calls:
            print("\nPython calls a room, over each role's ranks (cProfile: this run's times are slowed by it)")
            print(format_calls(rows))
        if getattr(args, "stages", False) and any(r.get("stages_ms") for r in rows):
            print("\nstages: ms from a prefill rank's receive(), p50 over its rooms")
            print(format_stages(rows))
        if getattr(args, "targets", False):
            print("\ntargets: the epd path against the control plane's budget per room")
            print(format_targets(check_targets(rows)))
        for note in notes:
            print(f"note: {note}")
        item = _item_label(rows)
        for r in broken:
            encode = f" encode ranks {r['encode_ranks']}" if r["encode_ranks"] > 1 else ""
            print(f"! {r['path']} {item(r)}{encode} fanout {r['fanout']} inflight "
                  f"{r['inflight']}: {r['failed']} failed room(s); {'; '.join(r['problems'])}")
    if as_json:
        print(json.dumps(rows, indent=1), flush=True)
        if getattr(args, "targets", False):
            print(format_targets(check_targets(rows)), file=sys.stderr)
    elif args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
        print(f"epd-transfer bench: wrote JSON to {os.path.abspath(args.json)}", file=sys.stderr)
    if args.plot:
        repeats = f"median of {opts.repeat} runs per cell" if opts.repeat > 1 else "one run per cell"
        plot(rows, args.plot, title=f"epd-transfer bench: Mooncake {opts.protocol} on {opts.host}, raw issue "
                                    f"{opts.raw_issue}, {repeats}")
        print(f"epd-transfer bench: wrote the plot to {os.path.abspath(args.plot)}", file=sys.stderr)
    return 1 if broken else 0


__all__ = [
    "ROW_KEYS",
    "Cell",
    "Options",
    "RankSet",
    "TARGETS",
    "Target",
    "add_arguments",
    "check_targets",
    "format_table",
    "format_targets",
    "main",
    "measure",
    "memcpy_row",
    "parse_sizes",
    "plan",
    "plot",
]

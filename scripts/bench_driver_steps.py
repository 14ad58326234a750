#!/usr/bin/env python3
"""Prints the Python calls the encode driver's thread makes a room, split by the step of a room they
serve: what each step of the native hot path (docs/performance.md, "Next: the native hot path, as
planned") would take off the encode side.

One process: a bootstrap server, a sender pool and `--fanout` session managers, each on its own
Mooncake engine over tcp on 127.0.0.1, integrity off; the prefill ranks share the item's rows.
`--inflight` rooms are kept in flight. The driver's thread runs under `sys.setprofile`, which counts
the Python functions and built-ins it enters; each call is counted for the innermost step whose
function is running (`STEPS`), the rest as `other` (the loop, its sleeps and ticks). Every room
must succeed and its first and last rows must have landed on every rank. `--detail STEP` also lists
the functions that step enters most, a room. `--cpu` runs the same rooms without the profiler and
prints the driver thread's CPU a room instead (its thread clock over the timed rooms, in microseconds);
`--profile N` runs them under cProfile on the driver's thread and lists the N functions of most own time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

try:
    from transfer.bootstrap import BootstrapServer
except ImportError:  # run from a checkout that is not installed: use the in-place build
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from transfer.bootstrap import BootstrapServer
from room_loop import print_counts, room_options, run_rooms  # scripts/room_loop.py, beside this script
from transfer.engine import Engine
from transfer.frames import shard_rows
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

#: (module, function) -> the step its calls serve, innermost first: a step's function called from
#: within another step counts for itself.
STEPS = {
    ("transfer/drive/encode.py", "_take_commands"): "items and clears filed",
    ("transfer/_io.py", "take_asks"): "ask: received",  # plain asks parsed there too, natively
    ("transfer/_io.py", "recv_frames"): "ask: received",
    ("transfer/frames.py", "from_frames"): "ask: parsed",
    ("transfer/core/encode.py", "ask"): "ask: rules, to its room's dispatch",
    ("transfer/core/encode.py", "_pump"): "writes picked",
    ("transfer/core/encode.py", "_start"): "writes picked",  # emitted by a pick, or by a fanout's writes started at once
    ("transfer/drive/encode.py", "_start"): "write: submitted",
    ("transfer/drive/encode.py", "_settle"): "write: completion polls",
    ("transfer/core/encode.py", "write_done"): "write: done, rules",
    ("transfer/frames.py", "status_frames"): "status: encoded",
    ("transfer/_io.py", "send"): "status: sent",
    ("transfer/drive/encode.py", "conclude"): "room concluded: books, metrics",
}
OTHER = "other"


class DriverClock:
    """Sums the driver thread's CPU over the timed rooms (its thread clock, no profiler); `hand_over` finds the
    thread. With `profile`, runs cProfile on that thread instead, from its start."""

    def __init__(self, profile: bool = False) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.functions: collections.Counter[str] = collections.Counter()
        self.ns = 0
        self.profiler = cProfile.Profile(time.thread_time) if profile else None  # CPU, not the sleeps
        self._clock: int | None = None

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Adds the driver thread's CPU meanwhile to `ns`."""
        if self._clock is None:
            raise SystemExit("the sender pool's thread was not found")
        started = time.clock_gettime_ns(self._clock)
        try:
            yield
        finally:
            self.ns += time.clock_gettime_ns(self._clock) - started

    def hand_over(self, frame: Any, event: str, arg: Any) -> None:
        """threading.setprofile's hook: notes the sender pool's thread's clock (or profiles it); every thread
        stops calling it."""
        sys.setprofile(None)
        name = threading.current_thread().name
        if name.startswith("epd-enc") and not name.endswith("-route"):
            self._clock = time.pthread_getcpuclockid(threading.get_ident())
            if self.profiler is not None:
                self.profiler.enable()


class StepCounter:
    """Counts a thread's calls per step (see STEPS); installed on the driver's thread by `hand_over`."""

    def __init__(self, detail: str | None) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.functions: collections.Counter[str] = collections.Counter()
        self.counting = False
        self._detail = detail
        self._stack: list[tuple[Any, str]] = []  # (frame, step) of each Python frame entered while installed

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Counts the driver's calls meanwhile."""
        self.counting = True
        try:
            yield
        finally:
            self.counting = False

    def hand_over(self, frame: Any, event: str, arg: Any) -> None:
        """threading.setprofile's hook: the sender pool's thread keeps counting, every other thread stops."""
        name = threading.current_thread().name
        sys.setprofile(self.hook if name.startswith("epd-enc") and not name.endswith("-route") else None)

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        stack = self._stack
        if event == "call":
            step = stack[-1][1] if stack else OTHER
            self._count(step, frame, event, arg)
            code = frame.f_code
            stack.append((frame, STEPS.get((_module(code.co_filename), code.co_name), step)))
        elif event == "return":
            if stack and stack[-1][0] is frame:
                stack.pop()
        elif event == "c_call":
            self._count(stack[-1][1] if stack else OTHER, frame, event, arg)

    def _count(self, step: str, frame: Any, event: str, arg: Any) -> None:
        if not self.counting:
            return
        self.counts[step] += 1
        if step == self._detail:
            code = frame.f_code
            self.functions[getattr(arg, "__qualname__", repr(arg)) if event == "c_call"
                           else f"{_module(code.co_filename)}:{code.co_name}"] += 1


def _module(filename: str) -> str:
    """'transfer/core/encode.py' for a file of this package, else the file's name."""
    parts = Path(filename).parts
    return "/".join(parts[len(parts) - 1 - parts[::-1].index("transfer"):]) if "transfer" in parts else parts[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    room_options(parser)
    parser.add_argument("--fanout", type=int, default=1, help="prefill ranks sharing each item (default 1)")
    parser.add_argument("--detail", choices=sorted({*STEPS.values(), OTHER}),
                        help="also list the functions this step enters most")
    parser.add_argument("--cpu", action="store_true",
                        help="print the driver thread's CPU a room (us, no profiler) instead of its calls")
    parser.add_argument("--profile", type=int, metavar="N",
                        help="list the N functions of most own time on the driver's thread (cProfile)")
    parser.add_argument("--callers", metavar="FUNCTION", help="with --profile: also list who calls FUNCTION")
    args = parser.parse_args()
    if (args.cpu or args.profile) and args.detail:
        parser.error("--detail lists calls counted under sys.setprofile, which --cpu and --profile leave off")
    rows, hidden, fanout, inflight = args.rows, args.hidden, args.fanout, args.inflight
    if fanout < 1 or rows < fanout:
        parser.error(f"--fanout must be between 1 and --rows ({rows})")
    counter: StepCounter | DriverClock = (DriverClock(bool(args.profile)) if args.cpu or args.profile
                                          else StepCounter(args.detail))
    item_bytes = rows * hidden * 2
    shards = [shard_rows(rows, rank, fanout) for rank in range(fanout)]
    threading.setprofile(counter.hand_over)  # before the sender pool starts its thread
    try:
        with Engine("127.0.0.1", "tcp") as encode_engine, BootstrapServer("127.0.0.1", 0) as server:
            engines = [Engine("127.0.0.1", "tcp") for _ in range(fanout)]
            try:
                items = torch.randn(inflight, rows, hidden).to(torch.bfloat16)
                encode_engine.register(items)
                buffers = [torch.empty(2 * inflight, count, hidden, dtype=torch.bfloat16) for _, count in shards]
                for engine, buffer in zip(engines, buffers):
                    engine.register(buffer)
                took = _run(args.rooms, inflight, counter, server.address, encode_engine, engines, buffers, items,
                            shards)
            finally:
                for engine in engines:
                    engine.close()
    finally:
        threading.setprofile(None)
    if isinstance(counter, DriverClock):
        print(f"{args.rooms} rooms of {item_bytes // 1024} KiB, fanout {fanout}, {inflight} in flight, integrity "
              f"off, in {took:.2f} s{' (profiled)' if counter.profiler else ''}: the encode driver's thread took "
              f"{counter.ns / args.rooms / 1000:.1f} us of CPU a room")
        if counter.profiler is not None:
            counter.profiler.disable()  # the thread's own profiler is off with the thread; this one is stopped
            stats = pstats.Stats(counter.profiler).sort_stats("tottime")
            stats.print_stats(args.profile)
            if args.callers:
                stats.print_callers(args.callers)
        return 0
    total = sum(counter.counts.values())
    print(f"{args.rooms} rooms of {item_bytes // 1024} KiB, fanout {fanout}, {inflight} in flight, integrity off, "
          f"in {took:.2f} s (profiled): the encode driver made {total / args.rooms:.1f} calls a room")
    print_counts("step", [*dict.fromkeys(STEPS.values()), OTHER], counter.counts, counter.functions, args.rooms,
                 args.detail)
    return 0


def _run(rooms: int, inflight: int, counter: StepCounter | DriverClock, bootstrap: str, encode_engine: Engine,
         engines: list[Engine], buffers: list[torch.Tensor], items: torch.Tensor,
         shards: list[tuple[int, int]]) -> float:
    """Runs `inflight` untimed rooms, then `rooms` counted ones; the seconds the counted ones took."""
    fanout, span = len(engines), items.shape[1]
    with SenderPool(encode_engine, 0, 1, 1, bootstrap, integrity=False) as sender:
        managers = [SessionManager(engine, rank, fanout, 1, buffer=buffer, integrity=False)
                    for rank, (engine, buffer) in enumerate(zip(engines, buffers))]
        try:
            def start(room: int) -> tuple[int, Any, list]:
                slot = room % (2 * inflight)
                sent = sender.send(room, items[room % inflight])
                asked = [manager.receive(room, bootstrap, buffers[rank][slot], row_start=shards[rank][0], span=span)
                         for rank, manager in enumerate(managers)]
                return room, sent, asked

            def finish(room: int, sent: Any, asked: list) -> None:
                item = items[room % inflight]
                for rank, handle in enumerate(asked):
                    status = handle.wait(30.0)
                    if status != TransferPoll.Success:
                        raise SystemExit(f"room {room}, prefill rank {rank}: {status.name}: {handle.failure}")
                    first, count = shards[rank]
                    landed = buffers[rank][room % (2 * inflight)]
                    if not (torch.equal(landed[0], item[first]) and torch.equal(landed[-1], item[first + count - 1])):
                        raise SystemExit(f"room {room}, prefill rank {rank}: the rows that landed are not the item's")
                    handle.clear()
                sent.wait(30.0)
                sent.clear()

            return run_rooms(start, finish, rooms, inflight, counter.counted)
        finally:
            for manager in managers:
                manager.close()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Prints the Python calls each caller call makes a room: a prefill rank's receive(), wait() and
clear(), and the encode caller's send(), wait() and clear().

One process: a bootstrap server, a sender pool and a session manager with a receive pool, each
side on its own Mooncake engine over tcp on 127.0.0.1, fanout 1, integrity off. `--inflight`
rooms are kept in flight, each received into a slot the manager leases from its pool, or with `--dst tensor`
into a 2-D slice of a registered buffer (as `transfer.bench` receives); every call of the timed rooms runs under `sys.setprofile`, which counts
the Python functions and built-ins it enters (the threads behind the calls are not counted:
`bench --calls` counts those). Every room must succeed and its first and last rows must have
landed. `--detail CALL` also lists the functions that call enters most, a room. `--cpu` runs the
same rooms without the profiler and prints each call's CPU a room instead (the calling thread's
clock around each call, in microseconds).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
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
from transfer.buffers import ReceivePool
from transfer.engine import Engine
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

CALLS = ("prefill receive", "prefill wait", "prefill clear", "encode send", "encode wait", "encode clear")


class Counter:
    """Counts the calls made inside `run(name, ...)`, per name, and for one name per function."""

    def __init__(self, detail: str | None) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.functions: collections.Counter[str] = collections.Counter()
        self._detail = detail
        self._name: str | None = None

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if self._name is None or event not in ("call", "c_call"):
            return
        self.counts[self._name] += 1
        if self._name == self._detail:
            code = frame.f_code
            self.functions[getattr(arg, "__qualname__", repr(arg)) if event == "c_call"
                           else f"{Path(code.co_filename).name}:{code.co_name}"] += 1

    @contextlib.contextmanager
    def profiled(self) -> Iterator[None]:
        """Counts the calls made inside `run()` meanwhile."""
        sys.setprofile(self.hook)
        try:
            yield
        finally:
            sys.setprofile(None)

    def run(self, name: str, call: Any, *args: Any) -> Any:
        self._name = name
        try:
            return call(*args)
        finally:
            self._name = None


class Clock(Counter):
    """Sums the calling thread's CPU nanoseconds spent inside `run(name, ...)`, per name (no profiler)."""

    def __init__(self) -> None:
        super().__init__(None)
        self._on = False

    @contextlib.contextmanager
    def profiled(self) -> Iterator[None]:
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def run(self, name: str, call: Any, *args: Any) -> Any:
        if not self._on:
            return call(*args)
        started = time.thread_time_ns()
        try:
            return call(*args)
        finally:
            self.counts[name] += time.thread_time_ns() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    room_options(parser)
    parser.add_argument("--detail", choices=CALLS, help="also list the functions this call enters most")
    parser.add_argument("--dst", choices=("pool", "tensor"), default="pool",
                        help="receive into a pool's slot (default) or a 2-D slice of a registered buffer")
    parser.add_argument("--cpu", action="store_true",
                        help="print each call's CPU a room (us, no profiler) instead of its Python calls")
    args = parser.parse_args()
    if args.cpu and args.detail:
        parser.error("--detail lists calls counted under the profiler, which --cpu leaves off")
    rows, hidden, inflight = args.rows, args.hidden, args.inflight
    counter = Clock() if args.cpu else Counter(args.detail)
    item_bytes = rows * hidden * 2
    with Engine("127.0.0.1", "tcp") as encode_engine, Engine("127.0.0.1", "tcp") as prefill_engine, \
            BootstrapServer("127.0.0.1", 0) as server:
        items = torch.randn(inflight, rows, hidden).to(torch.bfloat16)
        encode_engine.register(items)
        slots = torch.zeros(inflight * 2, rows, hidden, dtype=torch.bfloat16) if args.dst == "tensor" else None
        with ReceivePool(prefill_engine, item_bytes * inflight * 2, item_bytes) as pool, \
                SenderPool(encode_engine, 0, 1, 1, server.address, integrity=False) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, **({"pool": pool} if slots is None else {"buffer": slots}),
                               integrity=False) as manager:

            def start(room: int) -> tuple[int, Any, Any]:
                sent = counter.run("encode send", sender.send, room, items[room % inflight])
                if slots is not None:  # rooms in flight never share a slot
                    asked = counter.run("prefill receive", manager.receive, room, server.address,
                                        slots[room % (inflight * 2), :rows])
                else:
                    asked = counter.run("prefill receive", manager.receive, room, server.address, None, rows, hidden,
                                        torch.bfloat16)
                return room, sent, asked

            def finish(room: int, sent: Any, asked: Any) -> None:
                status = counter.run("prefill wait", asked.wait, 30.0)
                if status != TransferPoll.Success:
                    raise SystemExit(f"room {room}: {status.name}: {asked.failure}")
                landed = slots[room % (inflight * 2)] if slots is not None else asked.rows
                if not (torch.equal(landed[0], items[room % inflight][0])
                        and torch.equal(landed[-1], items[room % inflight][-1])):
                    raise SystemExit(f"room {room}: the rows that landed are not the item's")
                counter.run("prefill clear", asked.clear)
                counter.run("encode wait", sent.wait, 30.0)
                counter.run("encode clear", sent.clear)

            took = run_rooms(start, finish, args.rooms, inflight, counter.profiled)
    into = "a registered buffer's rows" if slots is not None else "pool slots"
    print(f"{args.rooms} rooms of {item_bytes // 1024} KiB, {inflight} in flight, fanout 1, integrity off, "
          f"into {into}, in {took:.2f} s{'' if args.cpu else ' (profiled)'}")
    if args.cpu:
        print("call             CPU a room (us)")
        for name in CALLS:
            print(f"{name:16} {counter.counts[name] / args.rooms / 1000:.1f}")
    else:
        print_counts("call", list(CALLS), counter.counts, counter.functions, args.rooms, args.detail)
    return 0


if __name__ == "__main__":
    sys.exit(main())

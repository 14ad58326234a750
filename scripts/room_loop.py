"""What the call-counting scripts share: their room options and the loop that keeps rooms in flight."""

from __future__ import annotations

import argparse
import collections
import contextlib
import time
from collections.abc import Callable
from typing import Any


def room_options(parser: argparse.ArgumentParser) -> None:
    """--rows, --hidden, --rooms and --inflight."""
    parser.add_argument("--rows", type=int, default=64, help="rows of an item (default 64)")
    parser.add_argument("--hidden", type=int, default=4096, help="bfloat16 elements a row (default 4096: 512 KiB)")
    parser.add_argument("--rooms", type=int, default=400, help="timed rooms (default 400)")
    parser.add_argument("--inflight", type=int, default=8, help="rooms in flight (default 8)")


def run_rooms(start: Callable[[int], tuple], finish: Callable[..., None], rooms: int, inflight: int,
              counted: Callable[[], contextlib.AbstractContextManager[Any]]) -> float:
    """Runs `inflight` rooms one by one, untimed and uncounted (sockets, sessions, first look-ups), then
    `rooms` more with `inflight` in flight inside `counted()`: `start(room)` begins one and returns what
    `finish(*it)` takes to end it. The seconds the counted rooms took."""
    for room in range(inflight):
        finish(*start(room))
    open_rooms: collections.deque = collections.deque()
    started = time.monotonic()
    with counted():
        for room in range(inflight, inflight + rooms):
            open_rooms.append(start(room))
            if len(open_rooms) >= inflight:
                finish(*open_rooms.popleft())
        while open_rooms:
            finish(*open_rooms.popleft())
    return time.monotonic() - started


def print_counts(what: str, names: list[str], counts: collections.Counter[str], functions: collections.Counter[str],
                 rooms: int, detail: str | None) -> None:
    """Each name's count a room under a `what` column, then with `detail` the functions that one entered most."""
    width = max(len(what), *map(len, names)) + 1
    print(f"{what:{width}} calls a room")
    for name in names:
        print(f"{name:{width}} {counts[name] / rooms:.1f}")
    if detail:
        print(f"\n{detail}: the functions it enters most, calls a room")
        for function, count in functions.most_common(25):
            print(f"{count / rooms:7.2f} {function}")

"""How many forks this process is from the one the interpreter started in: an object made before its
process was forked (a driver's thread and sockets, a Mooncake engine's threads) lives in the parent
only, and remembers the count it was made at to know a forked child by a plain comparison. No I/O,
so the engine can use it without pulling in ZMQ."""

from __future__ import annotations

import os

__all__ = ["count", "forks"]

#: Forks so far: what forks() returns, for a hot path to read without a call.
count = 0  # counted in each child


def _count_fork() -> None:
    global count
    count += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


def forks() -> int:
    """Forks so far (0 in the process the interpreter started in)."""
    return count

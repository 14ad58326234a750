"""How many forks this process is from the one the interpreter started in: an object made before its
process was forked (a driver's thread and sockets, a Mooncake engine's threads) lives in the parent
only, and remembers the count it was made at to know a forked child by a plain comparison. No I/O,
so the engine can use it without pulling in ZMQ. Also: module-wide locks made free again in a child."""

from __future__ import annotations

import os
from typing import TypeVar

__all__ = ["count", "forks", "free_in_child"]

_L = TypeVar("_L")

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


def free_in_child(lock: _L) -> _L:
    """`lock` (a module's Lock or RLock), made free again in each forked child: a thread that held it at
    the fork is not there to let go of it, and the child's first call that takes it would wait for ever.
    What it guards is a module's small book, consistent between two bytecodes, which is where a fork
    finds the thread that held it."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=getattr(lock, "_at_fork_reinit"))
    return lock

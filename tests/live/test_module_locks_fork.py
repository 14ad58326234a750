"""The library's module-wide locks in a forked child: one that another thread of the parent held at the fork
is free in the child, so the child's first call that takes it (a new session manager, a name look-up, a
reassembly, a ZMQ context) does not wait for ever.

Each lock is held by a thread of the parent across a real fork."""

from __future__ import annotations

import importlib
import threading

import pytest
from live_helpers import LIVE, in_forked_child

pytestmark = LIVE

MODULE_LOCKS = [
    ("transfer._io", "_context_lock"),
    ("transfer._io", "_oversized_lock"),
    ("transfer._resolve", "_name_lookups_lock"),
    ("transfer.buffers", "_held_lock"),
    ("transfer.drive.encode", "_engine_sources_lock"),
    ("transfer.engine", "_direct_lock"),
    ("transfer.reassemble", "_turns_lock"),
    ("transfer.receiver", "_managed_lock"),
    ("transfer.receiver", "_leases_lock"),
]


@pytest.mark.parametrize(("module", "name"), MODULE_LOCKS, ids=[f"{m}.{n}" for m, n in MODULE_LOCKS])
def test_a_module_lock_another_thread_held_at_the_fork_is_free_in_the_child(module, name):
    lock = getattr(importlib.import_module(module), name)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)

        def child() -> dict:  # the module's lock as the child's code finds it
            return {"taken": getattr(importlib.import_module(module), name).acquire(timeout=2)}

        assert in_forked_child(child) == {"taken": True}
    finally:
        done.set()
        holder.join(10)
    assert lock.acquire(timeout=0), "the parent's lock is free once its holder let go"
    lock.release()

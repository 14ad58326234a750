"""The library's ZMQ context: its own (never the engine's zmq.Context.instance()), one per
process, its I/O thread under SCHED_BATCH unless EPD_ZMQ_SCHED_BATCH=0, and remade in a
forked child. Each case runs in a fresh interpreter so that it sees the threads it made."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
                                reason="needs Linux's SCHED_BATCH and /proc/self/task")

#: Prints, as JSON, the scheduling policy of each ZMQ I/O thread that each context started.
_PROBE = r"""
import json, os, sys, time, zmq
from transfer import _io

def io_threads(known=()):
    # A new I/O thread names itself (after setting its policy) once it runs: wait for that.
    deadline = time.monotonic() + 10
    while True:
        found = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ZMQbg/IO") and int(tid) not in known:
                    found[int(tid)] = os.sched_getscheduler(int(tid))
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)

ours = _io.context()
a = ours.socket(zmq.PULL)
a.bind_to_random_port("tcp://127.0.0.1")
mine = io_threads()
theirs_ctx = zmq.Context.instance()
b = theirs_ctx.socket(zmq.PULL)
b.bind_to_random_port("tcp://127.0.0.1")
theirs = io_threads(mine)
out = {"same": _io.context() is ours, "instance": ours is theirs_ctx,
       "ours": sorted(mine.values()), "theirs": sorted(theirs.values())}
if "fork" in sys.argv:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        child = _io.context()
        c = child.socket(zmq.PUSH)
        c.bind_to_random_port("tcp://127.0.0.1")
        c.close(0)
        os.write(w, json.dumps({"new": child is not ours}).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    out["child"] = json.loads(os.read(r, 1000))
a.close(0); b.close(0)
print(json.dumps(out))
"""


def probe(*args: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_our_io_thread_runs_sched_batch_and_the_engines_context_is_left_alone():
    out = probe()
    assert out["same"] and not out["instance"], out
    assert out["ours"] == [os.SCHED_BATCH], out
    assert out["theirs"] == [os.SCHED_OTHER], out


def test_the_policy_can_be_switched_off():
    out = probe(EPD_ZMQ_SCHED_BATCH="0")
    assert out["ours"] == [os.SCHED_OTHER] and out["theirs"] == [os.SCHED_OTHER], out


def test_a_forked_child_makes_its_own_context():
    out = probe("fork")
    assert out["child"] == {"new": True}, out

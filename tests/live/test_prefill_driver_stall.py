"""A prefill rank held up past a room's deadline, while its encode rank pushed the room's status in time,
takes that status: the room succeeds.

The prefill rank runs in its own process, stopped (SIGSTOP) the moment its room's bytes land
in its memory (read through /proc/PID/mem), before it reads the Success its encode rank pushes
right after, and resumed once the room's deadline is past: the Success waits, unread, in its
status socket. On resuming, whether its I/O thread ticks first or ZMQ's I/O thread hands the
status over first is a race, so the test settles it the hard way: the process on one CPU, ZMQ's
I/O thread at SCHED_IDLE (until a moment after the resume), so the tick comes first. Real
Mooncake `tcp` on 127.0.0.1, a real SenderPool in this process and a real SessionManager in the other.
"""

from __future__ import annotations

import itertools
import os
import random
import time

from live_helpers import (
    HOST,
    LIVE,
    TOKEN,
    bootstrap_server,
    item_bytes,
    item_tensor,
    on_one_cpu,
    prefill_process,
    stopped,
    wait_until,
)

from transfer.engine import Engine
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
DEADLINE_S = 1.0
STOPS = 4
#: How long the prefill rank stays stopped past the room's deadline.
PAST_DEADLINE_S = 0.3

_rooms = itertools.count(random.randrange(1 << 20, 1 << 40))


def test_a_status_pushed_while_the_prefill_rank_was_stopped_counts_after_it_resumes():
    warmup, rooms = next(_rooms), [next(_rooms) for _ in range(STOPS)]
    with bootstrap_server() as server, Engine(HOST, protocol="tcp") as engine, \
            SenderPool(engine, 0, 1, 1, server.address, host=HOST, token=TOKEN) as pool, \
            prefill_process(server.address, span=SPAN, hidden=HIDDEN, slots=1 + STOPS,
                            deadline_s=DEADLINE_S) as prefill:
        pid, arena, slot_bytes = prefill.info["pid"], prefill.info["arena"], prefill.info["slot_bytes"]
        # A served room first: the route is cached and the connections are up.
        sent = pool.send(warmup, item_tensor(warmup, SPAN, HIDDEN))
        prefill.call("ask", [warmup])
        assert prefill.call("wait", [warmup], 10.0)[warmup][0] == "Success"
        assert sent.wait(5.0) == TransferPoll.Success
        sent.clear()
        io_threads = on_one_cpu(pid)

        told, outcomes = {}, {}
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            for slot, room in enumerate(rooms, start=1):
                item = item_bytes(room, slot_bytes).tobytes()
                landing = arena + slot * slot_bytes
                asked = time.monotonic()
                prefill.call("ask", [room])
                assert wait_until(lambda: len(pool._core.parked) == 1, 5.0), "the ask never reached the encode rank"
                handle = pool.send(room, item_tensor(room, SPAN, HIDDEN))
                ends = time.monotonic() + 5.0
                while os.pread(mem.fileno(), slot_bytes, landing) != item:
                    assert time.monotonic() < ends, "the room's bytes never landed"
                with stopped(pid, io_threads):
                    # The encode rank pushes its Success now, long before the deadline.
                    told[room] = (handle.wait(DEADLINE_S).name, time.monotonic() - asked < DEADLINE_S)
                    time.sleep(max(0.0, asked + DEADLINE_S + PAST_DEADLINE_S - time.monotonic()))
                handle.clear()
                outcomes.update(prefill.call("wait", [room], 10.0))
        assert told == {room: ("Success", True) for room in rooms}
        # (status, failure, the bytes landed exactly)
        assert outcomes == {room: ("Success", None, True) for room in rooms}

"""An encode rank held up past its fanout timeout while its receivers asked in time still serves their asks.

The encode rank runs in its own process, stopped (SIGSTOP) once its item was filed and
resumed when the fanout timeout and the sweep that enforces it are past: the asks came
while it was stopped and wait, unread, in its request socket. On resuming, whether its
driver thread ticks first or ZMQ's I/O thread hands the asks over first is a race, so the
test settles it the hard way: the process on one CPU, ZMQ's I/O thread at SCHED_IDLE (until
a moment after the resume), so the driver's tick always comes first. Real Mooncake `tcp` on
127.0.0.1, a real SenderPool and SessionManager.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import time

from live_helpers import HOST, LIVE, Receiver, bootstrap_server, encode_process, on_one_cpu, stopped, wait_until

from transfer.core.encode import SWEEP_S
from transfer.engine import Engine
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
FANOUT_TIMEOUT_S = 0.5
# The second test's: the second ask (0.1 s and a poll after the first) goes out well within it on a slow host.
FANOUT_PAIR_TIMEOUT_S = 2.0
STOPS = 2

_rooms = itertools.count(random.randrange(1 << 20, 1 << 40))


def test_asks_that_came_while_the_encode_rank_was_stopped_are_served_after_it_resumes():
    warmup, rooms = next(_rooms), [next(_rooms) for _ in range(STOPS)]
    with bootstrap_server() as server, Engine(HOST, protocol="tcp") as engine, \
            encode_process(server.address, fanout_timeout_s=FANOUT_TIMEOUT_S) as encode, \
            Receiver(engine, 0, 1, fanout=1, slots=1 + STOPS) as prefill:
        # A served room first: the route is cached and the request connection is up.
        prefill.ask(warmup, server.address, SPAN)
        encode.call("send", [warmup], SPAN, HIDDEN)
        assert prefill.wait([warmup], 10.0) == {warmup: ("Success", None)}
        pid = encode.proc.pid
        io_threads = on_one_cpu(pid)

        outcomes = {}
        for room in rooms:
            encode.call("send", [room], SPAN, HIDDEN)
            assert wait_until(lambda: encode.call("state")["waiting_for_asks"] == 1, 5.0), "the item was never filed"
            filed = time.monotonic()
            with stopped(pid, io_threads):
                handle = prefill.ask(room, server.address, SPAN)  # in time: long before the fanout timeout
                assert wait_until(lambda: handle.poll() != TransferPoll.Bootstrapping, 5.0), "the ask never went out"
                # Stopped until the fanout timeout and the sweep that enforces it are past.
                time.sleep(max(0.0, filed + FANOUT_TIMEOUT_S + 2 * SWEEP_S - time.monotonic()))
            outcomes.update(prefill.wait([room], 10.0))
            encode.call("wait", [room], 5.0)
        assert outcomes == {room: ("Success", None) for room in rooms}
        assert [prefill.landed(room) for room in rooms] == [None] * STOPS


def test_the_ask_completing_a_fanout_while_the_encode_rank_was_stopped_is_served_after_it_resumes():
    """Fanout 2: one prefill rank's ask is read before the stop, the other's comes, in time, while the
    encode rank is stopped past the fanout timeout; read after the resume, it completes the fanout."""
    warmup, rooms = next(_rooms), [next(_rooms) for _ in range(STOPS)]
    with bootstrap_server() as server, Engine(HOST, protocol="tcp") as engine0, \
            Engine(HOST, protocol="tcp") as engine1, \
            encode_process(server.address, fanout_timeout_s=FANOUT_PAIR_TIMEOUT_S) as encode, \
            Receiver(engine0, 0, 2, fanout=2, slots=1 + STOPS) as first, \
            Receiver(engine1, 1, 2, fanout=2, slots=1 + STOPS) as second:
        first.ask(warmup, server.address, SPAN)
        second.ask(warmup, server.address, SPAN)
        encode.call("send", [warmup], SPAN, HIDDEN)
        assert first.wait([warmup], 10.0) == second.wait([warmup], 10.0) == {warmup: ("Success", None)}
        pid = encode.proc.pid
        outcomes = {}
        for room in rooms:
            encode.call("send", [room], SPAN, HIDDEN)
            assert wait_until(lambda: encode.call("state")["waiting_for_asks"] == 1, 5.0), "the item was never filed"
            handle = first.ask(room, server.address, SPAN)
            asked = time.monotonic()
            assert wait_until(lambda: handle.poll() != TransferPoll.Bootstrapping, 5.0), "the ask never went out"
            time.sleep(0.1)  # the encode rank reads it in time
            os.kill(pid, signal.SIGSTOP)
            try:
                other = second.ask(room, server.address, SPAN)  # in time: well within the fanout timeout
                assert wait_until(lambda: other.poll() != TransferPoll.Bootstrapping, 5.0), "the ask never went out"
                # The set-up: the second ask went out while the fanout was still open.
                assert time.monotonic() - asked < FANOUT_PAIR_TIMEOUT_S, "the set-up was too slow for the fanout"
                # Stopped until the fanout timeout and the sweep that enforces it are past.
                time.sleep(max(0.0, asked + FANOUT_PAIR_TIMEOUT_S + 2 * SWEEP_S - time.monotonic()))
            finally:
                os.kill(pid, signal.SIGCONT)
            outcomes.update({room: (first.wait([room], 10.0)[room], second.wait([room], 10.0)[room])})
            encode.call("wait", [room], 5.0)
        assert outcomes == {room: (("Success", None), ("Success", None)) for room in rooms}
        assert [(first.landed(room), second.landed(room)) for room in rooms] == [(None, None)] * STOPS

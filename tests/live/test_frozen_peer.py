"""A prefill rank stopped (SIGSTOP) before the encode rank's first write to it: other receivers keep flowing.

Its kernel still accepts connections, so Mooncake's handshake with it would wait 60 s holding
the lock every write of the encode rank's engine takes. Real Mooncake `tcp` on 127.0.0.1, the
encode rank and the stopped prefill rank in their own processes, healthy receivers in this one.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import threading
import time

import pytest
from live_helpers import HOST, LIVE, Receiver, bootstrap_server, encode_process, prefill_process, wait_until

import torch

from transfer.engine import Engine, EngineError
from transfer.sender import DEAD_SESSION_S

pytestmark = LIVE

SPAN, HIDDEN = 8, 64
#: A healthy room waiting for the stopped peer's handshake would take Mooncake's 60 s.
HEALTHY_BOUND_S = 10.0
# How long the write to a port that never answers waits for its handshake: the healthy writes beside it
# (milliseconds each) all end well inside it.
SILENT_OPEN_S = 10.0

#: How long after its writes failed the encode rank skips the stopped peer, with a margin.
PAUSE_S = DEAD_SESSION_S + 2.0

_rooms = itertools.count(random.randrange(1 << 20, 1 << 40))


def rooms(n: int) -> list[int]:
    """n rooms no other test uses."""
    return [next(_rooms) for _ in range(n)]


@pytest.fixture
def server():
    with bootstrap_server() as s:
        yield s


def test_a_peer_stopped_before_first_contact_stalls_no_other_receiver(server):
    """Rooms for a warm receiver and for one first contacted meanwhile succeed, every byte checked;
    the stopped rank's rooms fail naming its unanswered handshake, and once resumed it is served again."""
    warmup, doomed, warm_rooms, fresh_rooms, revived = rooms(2), rooms(6), rooms(20), rooms(20), rooms(2)
    with Engine(HOST, protocol="tcp") as warm_engine, Engine(HOST, protocol="tcp") as fresh_engine, \
            encode_process(server.address) as encode, \
            Receiver(warm_engine, 0, 1, fanout=1, slots=len(warmup) + len(warm_rooms)) as warm:
        for room in warmup:
            warm.ask(room, server.address, SPAN)
        encode.call("send", warmup, SPAN, HIDDEN)
        assert warm.wait(warmup, 10.0) == {room: ("Success", None) for room in warmup}

        victim = prefill_process(server.address, span=SPAN, hidden=HIDDEN, slots=len(doomed) + len(revived))
        stopped = False
        try:
            victim.call("ask", doomed)
            # Stopped once the encode rank filed its asks, before any write reached it.
            assert wait_until(lambda: encode.call("state")["asks"] == len(doomed), 10.0)
            os.kill(victim.proc.pid, signal.SIGSTOP)
            stopped = True
            with Receiver(fresh_engine, 0, 1, fanout=1, slots=len(fresh_rooms)) as fresh:
                for room in warm_rooms:
                    warm.ask(room, server.address, SPAN)
                for room in fresh_rooms:
                    fresh.ask(room, server.address, SPAN)
                # The stopped rank's rooms go first, so every healthy write queues behind its handshake.
                healthy = [room for pair in zip(warm_rooms, fresh_rooms) for room in pair]
                encode.call("send", doomed + healthy, SPAN, HIDDEN)
                sent_at = time.monotonic()
                sent = encode.call("wait", doomed + healthy, 3 * HEALTHY_BOUND_S, timeout=4 * HEALTHY_BOUND_S)

                assert {room: sent[room][0] for room in healthy} == {room: "Success" for room in healthy}, sent
                slow = {room: sent[room][2] for room in healthy if sent[room][2] > HEALTHY_BOUND_S}
                assert not slow, f"healthy rooms waited for the stopped peer: {slow}"
                assert warm.wait(warm_rooms, 10.0) == {room: ("Success", None) for room in warm_rooms}
                assert fresh.wait(fresh_rooms, 10.0) == {room: ("Success", None) for room in fresh_rooms}
                for room in warm_rooms:
                    assert warm.landed(room) is None
                for room in fresh_rooms:
                    assert fresh.landed(room) is None

                session = victim.info["session"]
                for room in doomed:
                    status, reason, _ = sent[room]
                    assert status == "Failed", (room, sent[room])
                    assert f"write to {session}" in reason, reason
                first = sent[doomed[0]][1]
                assert "handshake port did not answer" in first and "stopped" in first, first
                fresh.clear()
            warm.clear()

            os.kill(victim.proc.pid, signal.SIGCONT)
            stopped = False
            victim.call("wait", doomed, 10.0)
            time.sleep(max(0.0, sent_at + sent[doomed[0]][2] + PAUSE_S - time.monotonic()))
            victim.call("ask", revived)
            encode.call("send", revived, SPAN, HIDDEN)
            back = victim.call("wait", revived, 20.0, timeout=30.0)
            assert back == {room: ("Success", None, True) for room in revived}, back
        finally:
            if stopped:
                os.kill(victim.proc.pid, signal.SIGCONT)
            victim.kill()


def test_engine_writes_flow_while_a_port_that_accepts_never_answers():
    """A listening socket nobody accepts on is a stopped process as Mooncake sees it: the kernel
    completes the connection and nothing ever answers. Writes to a live peer meanwhile land."""
    silent = socket.create_server((HOST, 0), backlog=8)
    session = f"{HOST}:{silent.getsockname()[1]}"
    with silent, Engine(HOST, protocol="tcp", open_timeout_s=SILENT_OPEN_S) as writer, \
            Engine(HOST, protocol="tcp") as reader:
        src = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
        dst = torch.zeros(4096, dtype=torch.uint8)
        writer.register(src)
        reader.register(dst)
        outcome: list[BaseException | None] = []

        def write_to_silent() -> None:
            try:
                writer.write(session, [src.data_ptr()], [0x10000], [64])
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                outcome.append(exc)

        thread = threading.Thread(target=write_to_silent, daemon=True)
        thread.start()
        time.sleep(0.2)  # its first contact is under way
        try:
            for i in range(20):
                dst.zero_()
                writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [4096])
                # Done while the write to the silent port still waits for its handshake: not behind it.
                assert thread.is_alive() and outcome == [], (
                    f"write {i} returned only after the silent port's: {outcome}")
                assert torch.equal(dst, src), f"write {i}: bytes differ"
        finally:
            thread.join(90)
        assert len(outcome) == 1 and isinstance(outcome[0], EngineError), outcome
        assert (f"write to {session} failed (its Mooncake handshake port did not answer within {SILENT_OPEN_S:g}s"
                in str(outcome[0])), outcome


def test_engine_a_port_that_refuses_at_once_gets_mooncakes_own_answer_at_once():
    """A port that closes every connection (a peer without probes, or not Mooncake) answers the
    probe with a failure at once: the write goes to Mooncake, which refuses it just as fast."""
    closer = socket.create_server((HOST, 0), backlog=8)
    session = f"{HOST}:{closer.getsockname()[1]}"
    stop = threading.Event()

    def close_everything() -> None:
        closer.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = closer.accept()
            except OSError:
                continue
            conn.close()

    thread = threading.Thread(target=close_everything, daemon=True)
    thread.start()
    try:
        with Engine(HOST, protocol="tcp") as writer:
            src = torch.ones(64, dtype=torch.uint8)
            writer.register(src)
            with pytest.raises(EngineError, match="Mooncake refused the batch"):
                writer.write(session, [src.data_ptr()], [0x10000], [64])
    finally:
        stop.set()
        thread.join(10)
        closer.close()

"""The wire listener with every connection slot held by idle or dribbling connections: a new sender
takes the slot of the one furthest behind the least rate, and its bytes land."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch
from wire_bytes import transfer_bytes

from transfer import _native, wire
from transfer.engine import TransferError
from transfer.wire import Msg
from transfer.wire_engine import WireEngine

SLOTS = 64
NBYTES = 256 << 10


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _wait_for(predicate, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def pair():
    """(receiving engine with SLOTS slots and long timeouts, sending engine, dst, src)."""
    with WireEngine("127.0.0.1", max_connections=SLOTS, recv_timeout_s=30.0, idle_timeout_s=300.0) as rx, \
            WireEngine("127.0.0.1") as tx:
        dst = torch.zeros(NBYTES, dtype=torch.uint8)
        src = torch.arange(NBYTES, dtype=torch.int64).to(torch.uint8)
        rx.register(dst)
        tx.register(src)
        yield rx, tx, dst, src


def _write(tx: WireEngine, rx: WireEngine, dst: torch.Tensor, src: torch.Tensor) -> None:
    tx.write(rx.session_id, [src.data_ptr()], [dst.data_ptr()], [NBYTES])


def test_idle_connections_holding_every_slot_do_not_lock_a_sender_out(pair):
    rx, tx, dst, src = pair
    idle = [_connect(rx.port) for _ in range(SLOTS)]
    try:
        assert _wait_for(lambda: rx.stats()["active"] == SLOTS, 10)
        time.sleep(1.5)  # every idle connection is now more than the default second behind
        _write(tx, rx, dst, src)
        assert torch.equal(dst, src)
        stats = rx.stats()
        assert stats["evicted"] == 1 and stats["refused"] == 0 and stats["transfers_received"] == 1
        # Exactly one was closed to make room, without an answer: its thread closes it once it has read
        # to the end of the stream, which may be a moment after the sender's write was served.
        closed: set[int] = set()

        def look() -> bool:
            for index, sock in enumerate(idle):
                if index not in closed:
                    sock.settimeout(0.0)
                    try:
                        if sock.recv(1) == b"":
                            closed.add(index)
                    except BlockingIOError:
                        pass
            return bool(closed)

        assert _wait_for(look, 10)
        look()
        assert len(closed) == 1, closed
    finally:
        for sock in idle:
            sock.close()


def test_dribbling_transfers_holding_every_slot_do_not_lock_a_sender_out(pair):
    """Each slot holds a transfer that began and sends a byte every 0.1 s, far below the least
    rate but inside the receive timeout and the grace (60 s here): the furthest behind is closed
    for the sender, with a reason that says so, and the sender's bytes land."""
    rx, tx, dst, src = pair
    msg = Msg({"room": 9, "layers": 1, "rows": 1, "row_bytes": 64, "ptr": dst.data_ptr(),
               "ptr0": dst.data_ptr(), "bytes0": 64}).encode()
    prefill = struct.pack("<IB", 1 + len(msg), wire.PREFILL) + msg
    drippers = [_connect(rx.port) for _ in range(SLOTS)]
    stop = threading.Event()

    def drip() -> None:
        sent = 0
        while not stop.is_set() and sent < len(prefill):
            for sock in drippers:
                try:
                    sock.send(prefill[sent:sent + 1])
                except OSError:
                    pass
            sent += 1
            stop.wait(0.1)

    dripping = threading.Thread(target=drip, daemon=True)
    dripping.start()
    try:
        assert _wait_for(lambda: rx.stats()["active"] == SLOTS, 10)
        time.sleep(1.5)
        _write(tx, rx, dst, src)
        assert torch.equal(dst, src)
        stats = rx.stats()
        assert stats["evicted"] == 1 and stats["refused"] == 0
        assert _wait_for(lambda: rx.stats()["last_error"], 5)
        reason = rx.stats()["last_error"]
        assert "closed by the listener for a new connection: every slot was taken" in reason, reason
        print(reason)
    finally:
        stop.set()
        dripping.join(5)
        for sock in drippers:
            sock.close()


def test_connections_less_than_evict_after_behind_are_not_closed_for_a_newcomer():
    """A full listener whose connections are all less than evict_after behind answers "listener
    busy": half the slots hold pooled connections idle after one transfer, half hold transfers that
    sent part of a header. (Not silent ones: a connection that has sent nothing may be closed for a
    newcomer at any age.)"""
    with WireEngine("127.0.0.1", max_connections=SLOTS, evict_after_s=60.0) as rx, WireEngine("127.0.0.1") as tx:
        dst = torch.zeros(NBYTES, dtype=torch.uint8)
        src = torch.ones(NBYTES, dtype=torch.uint8)
        rx.register(dst)
        tx.register(src)
        holders = [_connect(rx.port) for _ in range(SLOTS)]
        try:
            whole = transfer_bytes(dst.data_ptr(), bytes(64))  # zeros: dst stays all zero
            for sock in holders[:SLOTS // 2]:
                sock.sendall(whole)
                kind, payload, _ = wire.read_frame(sock)
                assert kind == wire.RESULT and Msg.decode(payload) == Msg({"bytes": 64, "room": 7}), payload
            for sock in holders[SLOTS // 2:]:
                sock.sendall(whole[:3])  # part of the PREFILL frame's length
            assert _wait_for(lambda: rx.stats()["active"] == SLOTS, 10)
            with pytest.raises(TransferError, match=f"listener busy: all {SLOTS} connections in use"):
                _write(tx, rx, dst, src)
            assert not bool(dst.any())
            stats = rx.stats()
            assert (stats["evicted"], stats["transfers_received"], stats["active"]) == (0, SLOTS // 2, SLOTS), stats
        finally:
            for sock in holders:
                sock.close()


def test_silent_connections_opened_faster_than_evict_after_do_not_keep_a_sender_out():
    """A client opens connections at about 100 a second and never sends a byte, keeping each a few
    seconds, so every one of the 4 slots always holds a connection far younger than evict_after
    (1 s). A connection that has sent nothing holds nothing, so a newcomer may close it at any age:
    each of 10 writes, every one on a fresh sender's new connection, lands (none is answered
    "listener busy" for want of a connection evict_after behind)."""
    with WireEngine("127.0.0.1", max_connections=4) as rx:
        dst = torch.zeros(4096, dtype=torch.uint8)
        rx.register(dst)
        stop = threading.Event()
        flooded = []

        def flood() -> None:
            held: list[tuple[float, socket.socket]] = []
            while not stop.is_set():
                try:
                    held.append((time.monotonic(), socket.create_connection(("127.0.0.1", rx.port), timeout=2)))
                    flooded.append(1)
                except OSError:
                    pass
                while held and time.monotonic() - held[0][0] > 3.0:
                    held.pop(0)[1].close()
                stop.wait(0.01)
            for _, sock in held:
                sock.close()

        flooding = threading.Thread(target=flood, daemon=True)
        flooding.start()
        try:
            assert _wait_for(lambda: len(flooded) >= 40 and rx.stats()["accepted"] >= 40, 20), rx.stats()
            before = len(flooded)
            failures = []
            for i in range(10):
                src = torch.full((4096,), i + 1, dtype=torch.uint8)
                with WireEngine("127.0.0.1") as tx:
                    tx.register(src)
                    try:
                        tx.write(rx.session_id, [src.data_ptr()], [dst.data_ptr()], [4096])
                    except TransferError as exc:
                        failures.append(str(exc))
                        continue
                assert torch.equal(dst, src), i
                time.sleep(0.05)
            during = len(flooded)
        finally:
            stop.set()
            flooding.join(10)
        assert not failures, f"{len(failures)}/10 writes refused: {failures[0]}"
        stats = rx.stats()
        assert during - before >= 10, (before, during)  # the flood kept going through the writes
        assert stats["evicted"] >= 10, stats  # the flood's connections were closed for newcomers
        assert stats["transfers_received"] == 10, stats


def test_a_negative_evict_after_keeps_every_slot():
    handle = _native.wire_listen("127.0.0.1", 0, 5.0, 5.0, 4096, 1, evict_after=-1.0)
    try:
        port = _native.wire_listener_port(handle)
        with _connect(port):
            assert _wait_for(lambda: _native.wire_listener_stats(handle)["active"] == 1, 5)
            time.sleep(1.2)
            with _connect(port) as extra:
                kind, payload, _ = wire.read_frame(extra)
                assert (kind, Msg.decode(payload).body) == (wire.ERROR, b"listener busy: all 1 connections in use")
        assert _native.wire_listener_stats(handle)["evicted"] == 0
    finally:
        _native.wire_listener_close(handle)


def test_a_transfer_closed_for_a_newcomer_is_told_why():
    """The one slot holds a transfer that sent its PREFILL and stalled: the newcomer takes the slot,
    and the stalled sender reads an ERROR for its room saying why, not a bare close."""
    with WireEngine("127.0.0.1", max_connections=1, recv_timeout_s=30.0) as rx, WireEngine("127.0.0.1") as tx:
        dst = torch.zeros(4096, dtype=torch.uint8)
        src = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
        rx.register(dst)
        tx.register(src)
        msg = Msg({"room": 5, "layers": 1, "rows": 1, "row_bytes": 4096, "ptr": dst.data_ptr(),
                   "ptr0": dst.data_ptr(), "bytes0": 4096}).encode()
        with _connect(rx.port) as stalled:
            stalled.sendall(struct.pack("<IB", 1 + len(msg), wire.PREFILL) + msg)
            assert _wait_for(lambda: rx.stats()["active"] == 1, 10)
            time.sleep(1.5)  # more than the default second behind
            tx.write(rx.session_id, [src.data_ptr()], [dst.data_ptr()], [4096])
            assert torch.equal(dst, src)
            kind, payload, _ = wire.read_frame(stalled)
        answer = Msg.decode(payload)
        assert kind == wire.ERROR and answer.get("room") == "5", (kind, answer)
        assert "closed by the listener for a new connection: every slot was taken" in answer.body.decode()
        assert rx.stats()["evicted"] == 1

"""The wire listener's bounds on its connection slots (native/wire_listener.c).

- A connection beyond max_conns is answered "listener busy" so that a peer which already sent its
  request reads the whole answer and then a clean close, never a reset; the accept thread never
  blocks on such a connection.
- A transfer must average a least byte rate once a grace period has passed, so a peer that dribbles
  a byte just inside every receive timeout (inside one frame or as many tiny frames) loses its slot
  with a clear reason; steady transfers, 64 MiB frames and idle time between transfers are not cut.

Every listener here uses short timeouts, and every socket wait is bounded."""

from __future__ import annotations

import math
import re
import select
import socket
import struct
import time

import numpy as np
import pytest
import torch
from test_wire_hostile import expect_error
from wire_bytes import frame

from transfer import _native, wire
from transfer.engine import TransferError
from transfer.wire import Msg
from transfer.wire_engine import WireEngine

PAGE = 4096
SENTINEL = 0xA5
BUSY_ONE = "listener busy: all 1 connections in use"
DEFAULT_RATE = 256 * 1024  # the listener's default least average rate, bytes/s


class Listener:
    """A raw native listener on an ephemeral loopback port with one registered page of memory."""

    def __init__(self, recv: float = 0.4, idle: float = 5.0, chunk: int = PAGE, conns: int = 1, *rate: float):
        # Idle connections hold the slots here however long a test runs: none is closed for a newcomer.
        self.handle = _native.wire_listen("127.0.0.1", 0, recv, idle, chunk, conns, *rate, evict_after=-1.0)
        self.port = _native.wire_listener_port(self.handle)
        self.memory = np.full(PAGE, SENTINEL, dtype=np.uint8)
        self.base = self.memory.ctypes.data
        _native.wire_add_region(self.handle, self.base, PAGE)

    def connect(self) -> socket.socket:
        """A raw connection (no Nagle, 5 s bound on every wait)."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def stats(self) -> dict:
        """The listener's counters."""
        return _native.wire_listener_stats(self.handle)

    def wait_active(self, count: int) -> None:
        """Waits (at most 5 s) until exactly count connections hold slots."""
        deadline = time.monotonic() + 5
        while self.stats()["active"] != count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.stats()["active"] == count

    def close(self) -> None:
        """Stops and joins the listener's threads."""
        _native.wire_listener_close(self.handle)

    def __enter__(self) -> Listener:
        """Context-manager entry."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on exit."""
        self.close()


def prefill(dest: int, nbytes: int) -> bytes:
    """A PREFILL Msg (room 7) for one layer of nbytes at dest, rows 1."""
    return Msg({"room": 7, "layers": 1, "rows": 1, "row_bytes": nbytes, "ptr": dest, "ptr0": dest,
                "bytes0": nbytes}).encode()


def layer_frame(data: bytes) -> bytes:
    """A whole LAYER frame of layer 0 (rows 1) carrying data."""
    return frame(wire.LAYER, wire.layer_header(0, 1, wire.layer_sum(data)) + data)


def good_transfer(sock: socket.socket, dest: int, data: bytes) -> None:
    """A well-behaved transfer of data to dest on sock, answered RESULT."""
    sock.sendall(frame(wire.PREFILL, prefill(dest, len(data))) + layer_frame(data) + frame(wire.FIRST, b""))
    kind, payload, _ = wire.read_frame(sock)
    assert kind == wire.RESULT, Msg.decode(payload)
    assert Msg.decode(payload) == Msg({"bytes": len(data), "room": 7})


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything the listener sends until its orderly close; a reset raises ConnectionResetError."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def only_error(data: bytes) -> Msg:
    """The single ERROR frame that data must consist of, decoded."""
    assert len(data) >= 5, data
    length, kind = struct.unpack_from("<IB", data)
    assert kind == wire.ERROR and len(data) == 4 + length, data
    return Msg.decode(data[5:])


def dribble_until_answered(sock: socket.socket, pieces: list[bytes], every: float, limit: float) -> float:
    """Sends one piece per `every` seconds until the listener speaks or `limit` seconds pass; the time
    the answer took (the test fails at the limit)."""
    started = time.monotonic()
    for piece in pieces:
        if time.monotonic() - started > limit:
            break
        try:
            sock.sendall(piece)
        except OSError:
            break  # the listener already dropped us: its answer is waiting
        readable, _, _ = select.select([sock], [], [], every)
        if readable:
            return time.monotonic() - started
    readable, _, _ = select.select([sock], [], [], max(0.0, limit - (time.monotonic() - started)))
    assert readable, f"the listener let the dribbling peer hold its slot for {limit} s"
    return time.monotonic() - started


def _seconds_in(reason: str) -> float:
    """The seconds a too-slow reason says the transfer had run when it was cut."""
    return float(re.search(r"bytes of this transfer in (\d+\.\d\d) s", reason).group(1))


# ------------------------------------------------------------------ listener busy


def test_a_refused_peer_sends_its_whole_request_then_reads_the_answer_and_a_clean_close():
    """The listener does not close a refused socket at once: whichever came first, that close or the
    peer's bytes, the kernel would answer those bytes with a reset (a later send failing, or the
    answer followed by ECONNRESET instead of an orderly end)."""
    with Listener(conns=1) as lst, lst.connect():
        lst.wait_active(1)
        msg = frame(wire.PREFILL, prefill(lst.base, PAGE))
        chunk = layer_frame(bytes(PAGE))
        for _ in range(10):
            with lst.connect() as sock:
                for piece in (msg, chunk, chunk, chunk):
                    sock.sendall(piece)
                    time.sleep(0.01)  # time for a reset to come back, had the listener sent one
                answer = only_error(read_to_eof(sock))
                assert answer == Msg({}, BUSY_ONE.encode())
        assert lst.stats()["refused"] == 10
        assert lst.stats()["accepted"] == 1


def test_busy_listener_takes_what_the_peer_sends_before_it_reads():
    """A refused peer that sends megabytes before it reads is not reset: the listener drains them."""
    with Listener(conns=1) as lst, lst.connect():
        lst.wait_active(1)
        for _ in range(3):
            with lst.connect() as sock:
                sock.sendall(frame(wire.PREFILL, prefill(lst.base, PAGE)) + bytes(4 << 20))
                assert only_error(read_to_eof(sock)).body.decode() == BUSY_ONE


def test_the_sender_reports_a_busy_listener_clearly():
    """WireEngine.write to a full listener always fails with the listener's reason, never a reset."""
    n = 1_000_000
    with WireEngine("127.0.0.1", chunk_bytes=PAGE, max_connections=1, evict_after_s=-1.0) as rx, \
            WireEngine("127.0.0.1", chunk_bytes=PAGE) as tx:
        dst = torch.zeros(n, dtype=torch.uint8)
        src = torch.ones(n, dtype=torch.uint8)
        rx.register(dst)
        tx.register(src)
        with socket.create_connection(("127.0.0.1", rx.port), timeout=5):
            deadline = time.monotonic() + 5
            while rx.stats()["active"] != 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            for _ in range(200):
                with pytest.raises(TransferError) as caught:
                    tx.write(rx.session_id, [src.data_ptr()], [dst.data_ptr()], [n])
                assert f"refused by the peer: {BUSY_ONE} (1 buffer(s), {n} bytes" in str(caught.value)
        assert rx.stats()["refused"] == 200
        assert not bool(dst.any())


def test_refused_peers_that_stay_silent_do_not_stall_accepting():
    """Refused peers that neither read nor close are drained by the accept thread's poll, not waited
    for: all sixty are refused within the 30 s wait (draining each for its second in turn would take
    59 seconds to reach the sixtieth), a slot that frees up is taken at once, and each still reads its
    answer. Sixty stay within the 64 refused connections the accept thread drains at once."""
    peers = 60
    with Listener(conns=1) as lst:
        holder = lst.connect()
        lst.wait_active(1)
        silent = [lst.connect() for _ in range(peers)]
        deadline = time.monotonic() + 30
        while lst.stats()["refused"] < peers and time.monotonic() < deadline:
            time.sleep(0.005)
        assert lst.stats()["refused"] == peers, "the accept thread waited on the refused connections in turn"
        holder.close()
        lst.wait_active(0)
        with lst.connect() as sock:
            good_transfer(sock, lst.base, b"\x11" * 64)
        for sock in silent:
            with sock:
                assert only_error(read_to_eof(sock)).body.decode() == BUSY_ONE
        assert lst.stats()["refused"] == peers


# ------------------------------------------------------------------ slow peers


def test_a_dribbled_prefill_loses_its_slot_with_a_clear_reason():
    """One byte every 50 ms (well inside the 0.4 s receive timeout) does not hold the only slot for as
    long as the peer likes: the transfer is refused once the grace (2 x 0.4 s) has passed."""
    with Listener(recv=0.4, conns=1) as lst:
        msg = frame(wire.PREFILL, prefill(lst.base, PAGE))
        with lst.connect() as slow:
            took = dribble_until_answered(slow, [msg[i:i + 1] for i in range(len(msg))], 0.05, 15.0)
            reason = expect_error(
                slow, r"^read: the peer is too slow \(\d+ bytes of this transfer in \d+\.\d\d s; a transfer must "
                      rf"average at least {DEFAULT_RATE} bytes/s after its first 0\.80 s\) (inside PREFILL after "
                      r"\d+ of \d+ bytes|at the start of a transfer \(\d of 5 header bytes\))$", room=None)
            # Cut for its rate (the reason says so), and not before the grace.
            assert took > 0.7 and _seconds_in(reason) >= 0.8, (took, reason)
        stats = lst.stats()
        assert stats["too_slow"] == 1 and stats["failures"] == 1
        assert stats["last_error"] == reason
        lst.wait_active(0)
        with lst.connect() as sock:  # the slot is free again
            good_transfer(sock, lst.base, b"\x22" * 100)
        assert bytes(lst.memory[:100]) == b"\x22" * 100


def test_one_byte_frames_just_inside_the_timeout_lose_the_slot():
    """Each LAYER frame arrives whole and carries one byte, every 0.1 s: no single wait times out, but
    the transfer's average rate is far below the least one."""
    with Listener(recv=0.4, conns=1) as lst:
        with lst.connect() as slow:
            slow.sendall(frame(wire.PREFILL, prefill(lst.base, PAGE)))
            pieces = [layer_frame(bytes([i])) for i in range(1, 200)]
            # The whole dribble would take 20 s: the limit tells a slot held to its end.
            took = dribble_until_answered(slow, pieces, 0.1, 15.0)
            reason = expect_error(slow, r"^read: the peer is too slow \(\d+ bytes of this transfer in \d+\.\d\d s; "
                                        r".*\) (inside a transfer|inside a LAYER header|mid-frame)", room=7)
            assert took > 0.7 and _seconds_in(reason) >= 0.8, (took, reason)
        landed = int(np.count_nonzero(lst.memory != SENTINEL))
        # The frames before the cut landed in order; nothing after them was touched.
        assert 0 < landed < len(pieces)
        assert bytes(lst.memory[:landed]) == bytes(range(1, landed + 1))
        assert bool((lst.memory[landed:] == SENTINEL).all())


def test_the_bound_is_a_rate_not_a_cap_on_time():
    """With min_rate 32 KiB/s after 0.3 s: 16 KiB every 0.1 s (160 KiB/s) runs 1.2 s and lands;
    1 KiB every 0.1 s (10 KiB/s) is refused, and the reason gives the figures."""
    chunk = 16 << 10
    with Listener(0.5, 5.0, chunk, 2, 32 * 1024, 0.3) as lst:
        memory = np.zeros(12 * chunk, dtype=np.uint8)
        _native.wire_add_region(lst.handle, memory.ctypes.data, memory.nbytes)
        data = np.random.default_rng(5).integers(0, 256, memory.nbytes, dtype=np.uint8).tobytes()
        with lst.connect() as steady:
            steady.sendall(frame(wire.PREFILL, prefill(memory.ctypes.data, len(data))))
            # 12 chunks, each followed by a 0.1 s pause: the transfer runs past the 0.3 s grace.
            for off in range(0, len(data), chunk):
                steady.sendall(layer_frame(data[off:off + chunk]))
                time.sleep(0.1)
            steady.sendall(frame(wire.FIRST, b""))
            kind, payload, _ = wire.read_frame(steady)
            assert kind == wire.RESULT, Msg.decode(payload)
        assert memory.tobytes() == data
        with lst.connect() as slow:
            slow.sendall(frame(wire.PREFILL, prefill(memory.ctypes.data, len(data))))
            pieces = [layer_frame(data[off:off + 1024]) for off in range(0, len(data), 1024)]
            # 10 KiB/s; the whole dribble would take 19.2 s: the limit tells a slot held to its end.
            took = dribble_until_answered(slow, pieces, 0.1, 15.0)
            reason = expect_error(slow, r"^read: the peer is too slow \(\d+ bytes of this transfer in \d+\.\d\d s; "
                                        r"a transfer must average at least 32768 bytes/s after its first 0\.30 s\)",
                                  room=7)
            assert took > 0.2 and _seconds_in(reason) >= 0.3, (took, reason)
        assert lst.stats()["too_slow"] == 1


def test_idle_time_between_transfers_is_not_judged_by_the_rate():
    """A connection reused after sitting idle longer than the grace still carries the next transfer."""
    with Listener(recv=0.3, idle=5.0, conns=1) as lst:
        with lst.connect() as sock:
            good_transfer(sock, lst.base, b"\x01" * 200)
            time.sleep(1.2)  # twice the grace (2 x 0.3 s), inside the idle timeout
            good_transfer(sock, lst.base + 200, b"\x02" * 200)
        stats = lst.stats()
        assert (stats["accepted"], stats["transfers"], stats["too_slow"], stats["failures"]) == (1, 2, 0, 0)
        assert bytes(lst.memory[:400]) == b"\x01" * 200 + b"\x02" * 200


def test_64_mib_frames_over_loopback_are_never_cut():
    """Full-size frames with a short receive timeout (0.5 s, so a 1 s grace) and the default rate."""
    big = wire.MAX_PAYLOAD - wire.LAYER_HEADER
    n = 64 << 20
    with WireEngine("127.0.0.1", recv_timeout_s=0.5, chunk_bytes=big) as writer, \
            WireEngine("127.0.0.1", recv_timeout_s=0.5, chunk_bytes=big) as reader:
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
        dst = torch.zeros(n, dtype=torch.uint8)
        writer.register(src)
        reader.register(dst)
        for _ in range(2):
            writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [n])
        assert torch.equal(src, dst)
        stats = reader.stats()
        assert stats["too_slow"] == 0 and stats["transfers_refused"] == 0
        assert stats["bytes_received"] == 2 * n


def test_rate_arguments_are_optional_checked_and_zero_turns_the_rate_off():
    """Six arguments still work; a negative or NaN rate and a NaN grace are refused; rate 0 is no bound."""
    old_style = _native.wire_listen("127.0.0.1", 0, 1.0, 1.0, PAGE, 2)
    _native.wire_listener_close(old_style)
    for rate in (-1.0, math.nan):
        with pytest.raises(ValueError, match=r"^wire listener: min_rate -?nan|^wire listener: min_rate -1 "):
            _native.wire_listen("127.0.0.1", 0, 1.0, 1.0, PAGE, 2, rate)
    with pytest.raises(ValueError, match=r"^wire listener: a timeout is NaN$"):
        _native.wire_listen("127.0.0.1", 0, 1.0, 1.0, PAGE, 2, 1024.0, math.nan)
    with Listener(0.4, 5.0, PAGE, 1, 0.0, 0.1) as lst, lst.connect() as sock:
        # 8 bytes every 50 ms: far below any rate, yet no bound but the receive timeout applies.
        msg = frame(wire.PREFILL, prefill(lst.base, 8))
        for off in range(0, len(msg), 8):
            sock.sendall(msg[off:off + 8])
            time.sleep(0.05)
        sock.sendall(layer_frame(b"\x33" * 8) + frame(wire.FIRST, b""))
        kind, payload, _ = wire.read_frame(sock)
        assert kind == wire.RESULT, Msg.decode(payload)
        assert lst.stats()["too_slow"] == 0


def test_the_engines_late_write_bound_is_the_grace_and_rate_its_listener_cuts_at():
    """WireEngine.late_write_s(), which a receive pool's default quarantine is sized by, names the grace
    and the least rate its own listener holds a dribbling transfer to."""
    engine = WireEngine("127.0.0.1", 0, recv_timeout_s=0.4)
    memory = torch.full((PAGE,), SENTINEL, dtype=torch.uint8)
    try:
        engine.register(memory)
        assert engine.late_write_s(PAGE) == pytest.approx(0.8 + PAGE / DEFAULT_RATE)
        msg = frame(wire.PREFILL, prefill(memory.data_ptr(), PAGE))
        with socket.create_connection(("127.0.0.1", engine.port), timeout=5.0) as slow:
            dribble_until_answered(slow, [msg[i:i + 1] for i in range(len(msg))], 0.05, 15.0)
            expect_error(slow, rf"a transfer must average at least {DEFAULT_RATE} bytes/s after its first 0\.80 s\)",
                         room=None)
    finally:
        engine.close()
    assert bool((memory == SENTINEL).all())
    unbounded = WireEngine("127.0.0.1", 0, min_rate_bps=0)
    try:
        assert unbounded.late_write_s(PAGE) == math.inf
    finally:
        unbounded.close()

"""Frames across real sockets and pipes: bytes, round trips and every read/write error (SPEC.md section 9),
and a whole sender-side transfer in one native call, checked frame by frame against a hand-driven peer."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc

import numpy as np
import pytest

from transfer import _native, wire
from transfer.errors import ConfigError, ConfigTypeError
from transfer.wire import FrameError, Msg

MAX = wire.MAX_PAYLOAD


@pytest.fixture
def pair():
    """A connected socketpair whose reads give up after 20 s instead of hanging a broken test."""
    a, b = socket.socketpair()
    a.settimeout(20)
    b.settimeout(20)
    with a, b:
        yield a, b


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """Reads n raw bytes."""
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "peer closed early"
        out += chunk
    return out


def pending(sock: socket.socket) -> bytes:
    """Whatever bytes are waiting, without blocking."""
    old = sock.gettimeout()
    sock.setblocking(False)
    try:
        return sock.recv(1 << 20)
    except BlockingIOError:
        return b""
    finally:
        sock.settimeout(old)


def read_error(sock) -> str:
    """The message of the FrameError a read raises."""
    with pytest.raises(FrameError) as err:
        wire.read_frame(sock)
    return str(err.value)


def writer_thread(sock, kind, payload) -> threading.Thread:
    """Writes one frame from a thread (a big frame does not fit the socket buffer)."""
    t = threading.Thread(target=wire.write_frame, args=(sock, kind, payload), daemon=True)
    t.start()
    return t


# --- bytes on the wire --------------------------------------------------------------


def test_frame_bytes_golden(pair):
    a, b = pair
    wire.write_frame(a, wire.RESULT, b"ok")
    assert recv_exactly(b, 7) == b"\x03\x00\x00\x00\x14ok"
    wire.write_frame(a, wire.GEN, b"")
    assert recv_exactly(b, 5) == b"\x01\x00\x00\x00\x01"
    wire.write_frame(a, 255, bytearray(b"\x00" * 256))
    assert recv_exactly(b, 5 + 256) == b"\x01\x01\x00\x00\xff" + b"\x00" * 256
    assert pending(b) == b""


def test_write_frame_parts_gathers_without_joining(pair):
    a, b = pair
    base = bytearray(b"0123456789")
    wire.write_frame_parts(a, wire.LAYER, [b"ab", memoryview(base)[3:6], b"", np.frombuffer(b"xyz", np.uint8)])
    assert recv_exactly(b, 5 + 8) == b"\x09\x00\x00\x00\x0aab345xyz"
    wire.write_frame_parts(a, wire.ERROR, [])
    assert recv_exactly(b, 5) == b"\x01\x00\x00\x00\x15"


def test_read_frame_parses_hand_made_bytes(pair):
    a, b = pair
    a.sendall(b"\x03\x00\x00\x00\x14ok" + b"\x01\x00\x00\x00\x0b")
    kind, payload, wire_us = wire.read_frame(b)
    assert (kind, payload) == (20, b"ok") and isinstance(wire_us, int) and wire_us >= 0
    assert wire.read_frame(b)[:2] == (wire.FIRST, b"")


def test_streams_a_layer_frame_without_a_copy(pair):
    a, b = pair
    data = np.random.default_rng(2).integers(0, 256, 4099, dtype=np.uint8)
    header = wire.layer_header(5, 3, wire.layer_sum(data))
    wire.write_frame_parts(a, wire.LAYER, [header, data])
    kind, payload, _ = wire.read_frame(b)
    assert kind == wire.LAYER and payload == wire.layer_frame(5, 3, data.tobytes())
    layer, rows, view = wire.parse_layer(payload)
    assert (layer, rows, bytes(view)) == (5, 3, data.tobytes())


# --- round trips --------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 200_000])
def test_round_trip_sizes(pair, size):
    a, b = pair
    payload = os.urandom(size)
    t = writer_thread(a, wire.DECODE, payload)
    assert wire.read_frame(b)[:2] == (wire.DECODE, payload)
    t.join(20)
    assert not t.is_alive()


def test_round_trip_10_mib_and_wire_time(pair):
    a, b = pair
    payload = os.urandom(10 << 20)
    t = writer_thread(a, wire.PREFILL, memoryview(payload))
    kind, got, wire_us = wire.read_frame(b)
    t.join(20)
    assert kind == wire.PREFILL and got == payload
    assert 0 <= wire_us < 20_000_000


def test_round_trip_exactly_max_payload(pair):
    a, b = pair
    payload = np.random.default_rng(3).integers(0, 256, MAX, dtype=np.uint8)
    t = writer_thread(a, wire.LAYER, payload)
    kind, got, _ = wire.read_frame(b)
    t.join(30)
    assert kind == wire.LAYER and len(got) == MAX and wire.layer_sum(got) == wire.layer_sum(payload)


def test_many_frames_in_a_row(pair):
    a, b = pair

    def send():
        for i in range(200):
            wire.write_frame(a, wire.GEN, i.to_bytes(2, "little") * i)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    for i in range(200):
        assert wire.read_frame(b)[:2] == (wire.GEN, i.to_bytes(2, "little") * i)
    t.join(20)


def test_int_fds_over_a_pipe():
    r, w = os.pipe()
    try:
        wire.write_frame(w, wire.RESULT, b"via fd")
        assert wire.read_frame(r)[:2] == (wire.RESULT, b"via fd")
        os.close(w)
        w = -1
        assert read_error(r) == "read: connection closed before a frame header"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


# --- read errors ----------------------------------------------------------------------------


def test_closed_before_header(pair):
    a, b = pair
    a.close()
    assert read_error(b) == "read: connection closed before a frame header"


def test_truncated_header(pair):
    a, b = pair
    a.sendall(b"\x05\x00")
    a.close()
    assert read_error(b) == "read: connection closed inside a frame header after 2 of 4 bytes"


def test_header_only_stream(pair):
    a, b = pair
    a.sendall(struct.pack("<I", 11))  # promises a kind byte and 10 payload bytes, sends none
    a.close()
    assert read_error(b) == "read: connection closed mid-payload after 0 of 11 bytes"


def test_peer_closes_mid_payload(pair):
    a, b = pair
    a.sendall(struct.pack("<IB", 101, wire.GEN) + b"z" * 10)
    a.close()
    assert read_error(b) == "read: connection closed mid-payload after 11 of 101 bytes"


def test_zero_length_frame(pair):
    a, b = pair
    a.sendall(b"\x00\x00\x00\x00")
    assert read_error(b) == "read: zero-length frame has no kind byte"


def test_oversize_length_fails_before_allocating(pair):
    a, b = pair
    a.sendall(struct.pack("<IB", MAX + 2, wire.GEN))  # payload of 64 MiB + 1
    tracemalloc.start()
    try:
        message = read_error(b)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message == "read: frame payload of 67108865 bytes exceeds the limit of 67108864 bytes"
    assert peak < 1 << 20  # nothing near the announced size was allocated
    assert pending(b) == bytes([wire.GEN])  # the kind byte was never read


def test_largest_length_field(pair):
    a, b = pair
    a.sendall(b"\xff\xff\xff\xff")
    assert read_error(b) == "read: frame payload of 4294967294 bytes exceeds the limit of 67108864 bytes"


def test_max_payload_length_is_accepted(pair):
    a, b = pair
    a.sendall(struct.pack("<IB", MAX + 1, wire.GEN) + b"abc")
    a.close()
    assert read_error(b) == f"read: connection closed mid-payload after 4 of {MAX + 1} bytes"


def test_read_timeout_from_socket(pair):
    a, b = pair
    b.settimeout(0.2)
    start = time.monotonic()
    with pytest.raises(FrameError) as err:
        wire.read_frame(b)
    assert str(err.value) == "read: timed out after 0.2 s without progress"
    assert err.value.errno == errno.ETIMEDOUT
    assert time.monotonic() - start >= 0.2  # not before its timeout


def test_read_bad_fd_reports_errno():
    s = socket.socket()
    s.close()  # fileno() is now -1
    with pytest.raises(FrameError) as err:
        wire.read_frame(s)
    assert str(err.value) == f"read: {os.strerror(errno.EBADF)}"
    assert err.value.errno == errno.EBADF


# --- write errors ---------------------------------------------------------------------------


def test_write_oversize_payload_sends_nothing(pair):
    a, b = pair
    big = np.zeros(MAX + 1, dtype=np.uint8)  # calloc'd: no real memory touched
    with pytest.raises(FrameError) as err:
        wire.write_frame(a, wire.GEN, big)
    assert str(err.value) == "write: payload of 67108865 bytes exceeds the limit of 67108864 bytes"
    with pytest.raises(FrameError) as err:
        wire.write_frame_parts(a, wire.GEN, [big[:MAX], b"x"])
    assert str(err.value) == "write: payload of 67108865 bytes exceeds the limit of 67108864 bytes"
    assert pending(b) == b""


def test_write_parts_whose_lengths_add_up_past_64_bits_send_nothing(pair):
    """Four 2**62-byte parts sum to 2**64, which a wrapping size_t counts as 0 bytes: the length
    check must still refuse them before the first byte goes out."""
    a, b = pair
    backing = ctypes.create_string_buffer(64)
    huge = memoryview((ctypes.c_char * (1 << 62)).from_address(ctypes.addressof(backing)))
    with pytest.raises(FrameError) as err:
        wire.write_frame_parts(a, wire.GEN, [huge, huge, huge, huge, b"tail"])
    assert str(err.value) == ("write: payload of more than 18446744073709551615 bytes exceeds the limit of "
                              "67108864 bytes")
    assert pending(b) == b""


def test_write_to_closed_peer(pair):
    a, b = pair
    b.close()
    with pytest.raises(FrameError) as err:
        wire.write_frame(a, wire.GEN, b"x" * 100)
    assert err.value.errno in (errno.EPIPE, errno.ECONNRESET)
    assert str(err.value) == f"write: {os.strerror(err.value.errno)}"


def test_write_to_a_closed_peer_raises_even_where_sigpipe_would_kill():
    """A host that did not ignore SIGPIPE (an engine embedding Python may not): writing a frame,
    or a whole transfer, to a socket whose peer hung up is an EPIPE error, not a dead process;
    a pipe still takes writev."""
    code = textwrap.dedent("""
        import errno, os, signal, socket
        import numpy as np
        from transfer import _native, wire
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        a, b = socket.socketpair()
        b.close()
        for attempt in ("frame", "transfer"):
            try:
                if attempt == "frame":
                    wire.write_frame(a, wire.GEN, b"x" * 100)
                else:
                    data = np.ones(4096, dtype=np.uint8)
                    _native.wire_transfer(a.fileno(), b"p", ((data.ctypes.data, data.nbytes),), 1, 1024, 5.0)
            except wire.FrameError as exc:
                assert exc.errno == errno.EPIPE, exc
                print(attempt, "EPIPE")
        r, w = os.pipe()
        wire.write_frame(w, wire.GEN, b"pipe")
        print("pipe", wire.read_frame(r)[1].decode())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"rc {done.returncode} (-13 is SIGPIPE): {done.stderr}"
    assert done.stdout.split("\n")[:3] == ["frame EPIPE", "transfer EPIPE", "pipe pipe"], done.stdout


def test_write_timeout_when_peer_does_not_read(pair):
    a, b = pair
    a.settimeout(0.2)
    with pytest.raises(FrameError) as err:
        wire.write_frame(a, wire.GEN, bytes(32 << 20))
    assert str(err.value) == "write: timed out after 0.2 s without progress"
    assert err.value.errno == errno.ETIMEDOUT


def test_write_argument_errors(pair):
    a, _ = pair
    for kind in (-1, 256):
        with pytest.raises(ConfigError, match=r"^frame kind must be an int in 0\.\.255, got -?\d+$"):
            wire.write_frame(a, kind, b"")
    for kind, named in ((True, "bool True"), (1.0, "float 1.0")):
        with pytest.raises(ConfigTypeError, match=rf"^frame kind must be an int in 0\.\.255, got {named}$"):
            wire.write_frame(a, kind, b"")
    with pytest.raises(BufferError, match="C-contiguous"):
        wire.write_frame(a, 1, memoryview(bytes(10))[::2])
    with pytest.raises(TypeError, match="need a socket or an int fd"):
        wire.write_frame("nope", 1, b"")


# --- GIL and signals --------------------------------------------------------------------------

#: x86-64 system calls a blocked read sits in: read, poll, select, recvfrom, recvmsg, epoll_wait,
#: pselect6, ppoll, epoll_pwait (a thread waiting for the GIL sits in futex, 202).
_READ_SYSCALLS = {0, 7, 23, 45, 47, 232, 270, 271, 281}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="reads x86-64 system call numbers")
def test_gil_released_while_blocked_in_read(pair):
    a, b = pair
    result = {}

    def reader():
        result["frame"] = wire.read_frame(b)

    def reader_in_read() -> bool:
        """Whether the reader thread sits in a system call that reads the socket (not waiting for the GIL)."""
        try:
            with open(f"/proc/self/task/{result['tid']}/syscall") as f:
                number = int(f.read().split()[0])
        except (KeyError, OSError, ValueError, IndexError):
            return False
        return number in _READ_SYSCALLS

    def reader():
        result["tid"] = threading.get_native_id()
        result["frame"] = wire.read_frame(b)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    # This thread runs Python code until it sees the reader blocked in its read: if the read
    # held the GIL, it could not, and the read would time out (20 s) before the frame is sent.
    while not reader_in_read():
        assert t.is_alive(), f"the read ended before anything was sent: {result}"
    wire.write_frame(a, wire.FIRST, b"late")
    t.join(30)
    assert result.get("frame", (None, None))[:2] == (wire.FIRST, b"late"), result


def test_a_signal_that_cuts_a_blocking_write_short_has_its_handler_run_at_once():
    """sendmsg interrupted after some bytes moved returns a short count, not EINTR: the handler's
    exception must still end the write then, not once the stalled peer reads again."""

    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted

    a, b = socket.socketpair()  # blocking, and nobody reads b until the rescue below
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    rescued = threading.Event()

    def rescue_the_writer() -> None:  # bounds the test should the interrupted write not end
        rescued.set()
        b.shutdown(socket.SHUT_RDWR)

    rescue = threading.Timer(20.0, rescue_the_writer)
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        rescue.start()
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        started = time.monotonic()
        with pytest.raises(Interrupted):
            _native.write_frame(a.fileno(), wire.GEN, [b"x" * (32 << 20)], -1.0)
        assert not rescued.is_set(), "the handler waited for the peer to read (the rescue ended the write)"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        rescue.cancel()
        a.close()
        b.close()


def test_eintr_is_retried():
    a, b = socket.socketpair()
    calls = []
    old = signal.signal(signal.SIGALRM, lambda *_: calls.append(1))
    timer = threading.Timer(0.4, wire.write_frame, (a, wire.RESULT, b"after signal"))
    try:
        timer.start()
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        assert wire.read_frame(b)[:2] == (wire.RESULT, b"after signal")
        assert calls == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        timer.join(5)
        a.close()
        b.close()


def test_signal_handler_exception_aborts_read():
    class Stop(Exception):
        pass

    def handler(*_):
        raise Stop("interrupted")

    a, b = socket.socketpair()
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Stop):
            wire.read_frame(b)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        a.close()
        b.close()


# --- a whole transfer in one native call (_native.wire_transfer) ---------------------

PREFILL_MSG = Msg({"room": 7, "layers": 2}).encode()


def layers(*sizes: int) -> tuple[list[np.ndarray], tuple[tuple[int, int], ...]]:
    """Distinct random bytes per layer, and their (address, length) pairs."""
    rng = np.random.default_rng(sum(sizes))
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    return arrays, tuple((a.ctypes.data, a.nbytes) for a in arrays)


def transfer_in_thread(sock, spans, rows: int, chunk: int) -> tuple[threading.Thread, dict]:
    """Runs wire_transfer from a thread; the dict gets 'result' or 'error'."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = _native.wire_transfer(sock.fileno(), PREFILL_MSG, spans, rows, chunk, sock.gettimeout())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_transfer_is_prefill_checksummed_chunks_first_then_the_answer(pair):
    """Two layers in 1000-byte chunks: the peer sees PREFILL, every chunk of layer 0 then layer 1
    with its layer index, rows and a checksum that verifies, FIRST; the call returns its RESULT."""
    a, b = pair
    arrays, spans = layers(2500, 1200)
    thread, out = transfer_in_thread(a, spans, 4, 1000)
    kind, payload, _ = wire.read_frame(b)
    assert (kind, payload) == (wire.PREFILL, PREFILL_MSG)
    landed: dict[int, bytearray] = {0: bytearray(), 1: bytearray()}
    sizes = []
    while (frame := wire.read_frame(b))[0] == wire.LAYER:
        layer, rows, data = wire.parse_layer(frame[1])  # raises on a bad checksum
        assert rows == 4
        landed[layer] += data
        sizes.append((layer, len(data)))
    assert frame[:2] == (wire.FIRST, b"")
    assert sizes == [(0, 1000), (0, 1000), (0, 500), (1, 1000), (1, 200)]
    assert [bytes(landed[i]) for i in (0, 1)] == [arr.tobytes() for arr in arrays]
    wire.write_frame(b, wire.RESULT, Msg({"bytes": 3700, "room": 7}).encode())
    thread.join(20)
    complete, (kind, payload, _) = out["result"]
    assert complete is True and kind == wire.RESULT
    assert Msg.decode(payload).number("bytes") == 3700


def test_an_answer_mid_transfer_stops_the_sending(pair):
    """A peer that answers ERROR before the transfer is over: the call stops after the chunk it was
    on, sends no FIRST, and returns the ERROR with complete False."""
    a, b = pair
    _, spans = layers(5000)
    wire.write_frame(b, wire.ERROR, Msg({"room": 7}, body=b"layer 0: no").encode())
    thread, out = transfer_in_thread(a, spans, 1, 1000)
    thread.join(20)
    complete, (kind, payload, _) = out["result"]
    assert complete is False and kind == wire.ERROR
    assert Msg.decode(payload).body == b"layer 0: no"
    frames = [wire.read_frame(b)[0] for _ in range(2)]
    assert frames == [wire.PREFILL, wire.LAYER]  # then nothing: no more chunks, no FIRST
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv(1)


def test_a_peer_gone_before_the_prefill_is_stage_prefill(pair):
    """Nothing got out: the FrameError says so (stage 'prefill', safe to retry elsewhere)."""
    a, b = pair
    b.close()
    _, spans = layers(100)
    with pytest.raises(FrameError) as caught:
        _native.wire_transfer(a.fileno(), PREFILL_MSG, spans, 1, 1000, 20.0)
    assert caught.value.stage == "prefill"
    assert str(caught.value).startswith("write: ")


def test_a_peer_that_hangs_up_without_answering_is_stage_answer(pair):
    """Everything sent, then the peer closes: the read of the answer fails, stage 'answer'."""
    a, b = pair
    _, spans = layers(300)
    thread, out = transfer_in_thread(a, spans, 1, 1000)
    for expected in (wire.PREFILL, wire.LAYER, wire.FIRST):
        assert wire.read_frame(b)[0] == expected
    b.close()
    thread.join(20)
    error = out["error"]
    assert isinstance(error, FrameError) and error.stage == "answer"
    assert str(error) == "read: connection closed before a frame header"


def test_a_peer_that_stops_reading_mid_data_is_stage_data():
    """A peer that takes the PREFILL, then neither reads nor answers: the write times out, stage 'data'."""
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        a.settimeout(0.5)
        _, spans = layers(8 << 20)
        with pytest.raises(FrameError) as caught:
            _native.wire_transfer(a.fileno(), PREFILL_MSG, spans, 1, 1 << 20, 0.5)
    assert caught.value.stage == "data"
    assert str(caught.value) == "write: timed out after 0.5 s without progress"


@pytest.mark.parametrize(("spans", "rows", "chunk", "message"), [
    ((), 1, 1000, "1..16 layers, got 0"),
    (((4096, 10),) * 17, 1, 1000, "1..16 layers, got 17"),
    (((4096, 0),), 1, 1000, "layer 0 (0x1000+0) is not a non-empty range"),
    (((0, 10),), 1, 1000, "layer 0 (0x0+10) is not a non-empty range"),
    (((2**64 - 4, 10),), 1, 1000, "is not a non-empty range of the address space"),
    (((4096, 10),), 1, 0, "chunk must be in 1.."),
    (((4096, 10),), -1, 1000, "rows must be an int in 0..4294967295"),
])
def test_arguments_are_checked_before_anything_is_sent(pair, spans, rows, chunk, message):
    """Bad layers, rows or chunk size: a ValueError naming it, and not a byte on the wire."""
    a, b = pair
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        _native.wire_transfer(a.fileno(), PREFILL_MSG, spans, rows, chunk, 20.0)
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv(1)

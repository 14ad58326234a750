"""_native.wire_transfer: a whole sender-side transfer (PREFILL, LAYER chunks, FIRST, the answer)
in one call, checked frame by frame against a hand-driven peer on a socketpair."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from transfer import _native, wire
from transfer.wire import FrameError, Msg

PREFILL = Msg({"room": 7, "layers": 2}).encode()


@pytest.fixture
def pair():
    """A connected socketpair whose reads and writes give up after 20 s instead of hanging a test."""
    a, b = socket.socketpair()
    a.settimeout(20)
    b.settimeout(20)
    with a, b:
        yield a, b


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
            out["result"] = _native.wire_transfer(sock.fileno(), PREFILL, spans, rows, chunk, sock.gettimeout())
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
    assert (kind, payload) == (wire.PREFILL, PREFILL)
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
        _native.wire_transfer(a.fileno(), PREFILL, spans, 1, 1000, 20.0)
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
            _native.wire_transfer(a.fileno(), PREFILL, spans, 1, 1 << 20, 0.5)
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
        _native.wire_transfer(a.fileno(), PREFILL, spans, rows, chunk, 20.0)
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv(1)

"""transfer._io.send_frames when libzmq refuses a part: nothing of the message is delivered, and a
part refused after the first hands the rest of the message over, so that libzmq's drop of the
message's remaining parts ends with this message instead of swallowing the next one.

The native path (transfer._native.zmq_send_parts) runs against stand-in libzmq functions bound
through zmq_bind, the pyzmq path against a stand-in for pyzmq's send; no socket is made."""

from __future__ import annotations

import ctypes
import errno

import pytest
import zmq

from transfer import _io

EAGAIN, EINTR = errno.EAGAIN, errno.EINTR
PARTS = [b"room", b"rank", b"rows", b"last"]


class FakeLibzmq:
    """zmq_send and zmq_errno that refuse the calls named in `refuse` (call index -> errno) and
    record every call as (part, more)."""

    def __init__(self, refuse: dict[int, int]) -> None:
        self.refuse = refuse
        self.calls: list[tuple[bytes, bool]] = []
        self.err = 0
        send_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        errno_t = ctypes.CFUNCTYPE(ctypes.c_int)
        unused_t = ctypes.CFUNCTYPE(ctypes.c_int)
        self._keep = [send_t(self._send), errno_t(lambda: self.err), unused_t(lambda: 0)]

    def _send(self, handle, data, size, flags) -> int:
        index = len(self.calls)
        self.calls.append((ctypes.string_at(data, size), bool(flags & 2)))
        if index in self.refuse:
            self.err = self.refuse[index]
            return -1
        return size

    def addresses(self) -> list[int]:
        """zmq_bind's eight addresses: the message calls (unused by a send) and send, errno."""
        send, err, unused = (ctypes.cast(f, ctypes.c_void_p).value for f in self._keep)
        return [unused] * 6 + [send, err]


@pytest.fixture
def native_send():
    """Sends PARTS through zmq_send_parts against a FakeLibzmq; the real libzmq is bound again after."""
    if _io._NATIVE is None:
        pytest.fail("the native ZMQ path did not bind (transfer._native built? libzmq 4?)")

    def send(fake: FakeLibzmq) -> None:
        _io._NATIVE.zmq_bind(*fake.addresses())
        _io._NATIVE.zmq_send_parts(1, list(PARTS))

    yield send
    assert _io._native_parts() is _io._NATIVE  # the real libzmq again


def whole(parts: list[bytes]) -> list[tuple[bytes, bool]]:
    return [(part, i + 1 < len(parts)) for i, part in enumerate(parts)]


@pytest.mark.parametrize("refused", [1, 2])
def test_native_a_later_part_refused_hands_over_the_rest_and_reports_the_failure(refused, native_send):
    fake = FakeLibzmq({refused: EAGAIN})
    with pytest.raises(OSError) as caught:
        native_send(fake)
    assert caught.value.errno == EAGAIN
    assert fake.calls == whole(PARTS)


def test_native_a_refused_first_part_is_the_only_call(native_send):
    fake = FakeLibzmq({0: EAGAIN})
    with pytest.raises(OSError) as caught:
        native_send(fake)
    assert caught.value.errno == EAGAIN
    assert fake.calls == whole(PARTS)[:1]


def test_native_an_interrupted_part_is_sent_again(native_send):
    fake = FakeLibzmq({2: EINTR})
    native_send(fake)
    assert fake.calls == whole(PARTS)[:3] + whole(PARTS)[2:]


class FakeSocket:
    """Stands in for pyzmq's send on the pyzmq path: refuses the calls named in `refuse`."""

    def __init__(self, refuse: set[int]) -> None:
        self.refuse = refuse
        self.calls: list[tuple[bytes, bool]] = []

    def send(self, sock: object, frame: bytes, flags: int) -> None:
        index = len(self.calls)
        self.calls.append((frame, bool(flags & zmq.SNDMORE)))
        if index in self.refuse:
            raise zmq.Again()


@pytest.mark.parametrize("refused, sent", [(1, len(PARTS)), (0, 1), (3, len(PARTS))])
def test_pyzmq_a_refused_part_hands_over_the_rest_after_the_first(refused, sent, monkeypatch):
    fake = FakeSocket({refused})
    monkeypatch.setattr(_io, "_NATIVE", None)
    monkeypatch.setattr(_io, "_send", fake.send)
    with pytest.raises(zmq.Again):
        _io.send_frames(object(), list(PARTS))
    assert fake.calls == whole(PARTS)[:sent]

"""The control plane's size bounds hold for a whole multipart message, over real ZMQ sockets."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from transfer import _io

CAP = _io.MAX_CONTROL_MESSAGE


@pytest.fixture(params=["native", "pyzmq"])
def path(request, monkeypatch):
    """recv_frames through transfer._native's libzmq calls, or through pyzmq's."""
    if request.param == "native" and _io._NATIVE is None:
        pytest.skip("transfer._native is not bound to libzmq here")
    if request.param == "pyzmq":
        monkeypatch.setattr(_io, "_NATIVE", None)
    return request.param


@pytest.fixture
def pair():
    """A listener made as ours are (pull_socket) and a PUSH connected to it."""
    pull, port = _io.pull_socket("127.0.0.1", 0)
    push = _io.context().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close(0)
    pull.close(0)


def _next(pull: zmq.Socket, limit: float = 10.0) -> list[bytes]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        frames = _io.recv_frames(pull)
        if frames is not None:
            return frames
        time.sleep(0.005)
    raise AssertionError("no message within the limit")


def test_a_message_of_many_parts_each_under_the_cap_is_discarded_whole(path, pair, caplog, monkeypatch):
    monkeypatch.setattr(_io, "_complaints", _io.ThrottledLog(_io.log))  # not throttled by earlier tests
    push, pull = pair
    big = [b"x" * (CAP - 1)] * 96  # 6 MiB, every part under the per-part bound
    before = _io.oversized_dropped
    with caplog.at_level(logging.WARNING, logger="transfer"):
        push.send_multipart(big)
        push.send_multipart([b"7", b"2", b"0"])
        assert _next(pull) == [b"7", b"2", b"0"]
    assert _io.oversized_dropped == before + 1
    assert any(f"dropped a control message of {96 * (CAP - 1)} bytes in 96 parts" in m for m in caplog.messages)
    assert _io.recv_frames(pull) is None


def test_a_message_of_too_many_tiny_parts_is_discarded(path, pair):
    push, pull = pair
    before = _io.oversized_dropped
    push.send_multipart([b""] * (_io.MAX_CONTROL_PARTS + 1))
    push.send_multipart([b"a"] * _io.MAX_CONTROL_PARTS)
    assert _next(pull) == [b"a"] * _io.MAX_CONTROL_PARTS
    assert _io.oversized_dropped == before + 1


def test_a_message_of_exactly_the_cap_is_taken(path, pair):
    push, pull = pair
    exact = [b"y" * (CAP // 2), b"z" * (CAP - CAP // 2)]
    push.send_multipart(exact)
    assert _next(pull) == exact


def test_oversized_messages_alone_leave_the_socket_empty_not_stuck(path, pair):
    """recv_frames returns None only once the socket is empty, after discarding every big message."""
    push, pull = pair
    before = _io.oversized_dropped
    for _ in range(20):
        push.send_multipart([b"q" * (CAP // 2)] * 3)
    deadline = time.monotonic() + 10
    while _io.oversized_dropped < before + 20 and time.monotonic() < deadline:
        assert _io.recv_frames(pull) is None
        time.sleep(0.005)
    assert _io.oversized_dropped == before + 20

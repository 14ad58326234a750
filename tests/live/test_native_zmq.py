"""send_frames/recv_frames: whole multipart messages through transfer._native's libzmq calls,
and the pyzmq path that serves where those cannot be bound. Real ZMQ sockets on loopback."""

from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager

import pytest
import zmq

from transfer import _io
from transfer.frames import TransferInfo

HOST = "127.0.0.1"


@contextmanager
def connected(hwm: int):
    """A PUSH connected to a PULL on loopback, each queue bounded at `hwm` (0: unbounded)."""
    ctx = _io.context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, hwm)
    port = pull.bind_to_random_port(f"tcp://{HOST}")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, hwm)
    push.connect(f"tcp://{HOST}:{port}")
    try:
        yield push, pull
    finally:
        push.close(0)
        pull.close(0)


@pytest.fixture
def pair():
    with connected(0) as socks:
        yield socks


def drain(sock: zmq.Socket, count: int, recv=_io.recv_frames, timeout: float = 10.0) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        frames = recv(sock)
        if frames is None:
            assert time.monotonic() < deadline, f"{len(got)} of {count} messages arrived"
            time.sleep(0.001)
            continue
        got.append(frames)
    return got


def messages(n: int, seed: int) -> list[list[bytes]]:
    rng = random.Random(seed)
    return [[rng.randbytes(rng.choice([0, 1, 7, 200, 70_000])) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def test_messages_arrive_whole_and_in_order(zmq_path, pair):
    push, pull = pair
    sent = messages(500, seed=1)
    assert _io.recv_frames(pull) is None  # nothing queued yet: None, not an error
    for frames in sent:
        _io.send_frames(push, frames)
    assert drain(pull, len(sent)) == sent
    assert _io.recv_frames(pull) is None


def test_either_path_reads_what_plain_pyzmq_sent_and_the_other_way(zmq_path, pair):
    push, pull = pair
    sent = messages(100, seed=2)
    for frames in sent:
        push.send_multipart(frames)
    assert drain(pull, len(sent)) == sent
    for frames in sent:
        _io.send_frames(push, frames)
    assert drain(pull, len(sent), recv=lambda s: s.recv_multipart(zmq.NOBLOCK) if s.poll(0) else None) == sent


def test_a_full_queue_raises_again_and_queues_no_part(zmq_path):
    with connected(1) as (push, pull):
        sent = []
        deadline = time.monotonic() + 10
        while True:  # the kernel's buffers take some first
            frames = [b"%d" % len(sent), os.urandom(4096), b"end"]
            try:
                _io.send_frames(push, frames)
            except zmq.Again:
                break
            sent.append(frames)
            assert time.monotonic() < deadline, "the queue never filled"
        assert drain(pull, len(sent)) == sent  # every message whole: no refused one left a part behind
        time.sleep(0.1)
        assert _io.recv_frames(pull) is None


@pytest.mark.parametrize("refused, error", [
    ([b"head", "a str", b"tail"], TypeError),
    ((b"head", 7), TypeError),  # a tuple: never the native call, whichever path
    ([], ValueError),
])
def test_a_message_refused_for_its_parts_queues_nothing_on_either_path(zmq_path, pair, refused, error):
    """A part that is not bytes is refused before any part is queued: a part queued with more to
    come would be the head of the next message sent on the socket."""
    push, pull = pair
    with pytest.raises(error, match="not bytes|at least one part"):
        _io.send_frames(push, refused)
    _io.send_frames(push, [b"next"])
    assert drain(pull, 1) == [[b"next"]]
    time.sleep(0.05)
    assert _io.recv_frames(pull) is None


def test_a_closed_socket_raises_zmq_error(zmq_path):
    sock = _io.context().socket(zmq.PULL)
    sock.close(0)
    with pytest.raises(zmq.ZMQError):
        _io.recv_frames(sock)
    push = _io.context().socket(zmq.PUSH)
    push.close(0)
    with pytest.raises(zmq.ZMQError):
        _io.send_frames(push, [b"x"])


def test_an_ask_arrives_as_its_to_frames_parts_on_either_path(zmq_path, pair):
    push, pull = pair
    rng = random.Random(3)
    asks = [TransferInfo(rng.randrange(2**63), "10.0.0.12", rng.randrange(65536), "10.0.0.12:15432",
                         rng.randrange(2**64), rng.randrange(2**64), rng.randrange(-5, 1 << 20), 4096, "torch.bfloat16",
                         rng.random() < 0.5, rng.randint(1, 8), rng.randrange(1 << 20), rng.randrange(1 << 21),
                         rng.choice([None, 0, 16384])) for _ in range(200)]
    for info in asks:
        _io.send_ask(push, info)
    assert drain(pull, len(asks)) == [info.to_frames() for info in asks]


def test_native_send_refuses_what_is_not_a_list_of_bytes(pair):
    if _io._NATIVE is None:
        pytest.fail("the native ZMQ path did not bind")
    push, pull = pair
    with pytest.raises(TypeError, match="part 1 is str"):
        _io._NATIVE.zmq_send_parts(push.underlying, [b"a", "b"])
    with pytest.raises(ValueError, match="at least one part"):
        _io._NATIVE.zmq_send_parts(push.underlying, [])
    _io.send_frames(push, [b"after"])  # nothing of the refused ones was queued
    assert drain(pull, 1) == [[b"after"]]


def test_dropped_tells_of_a_lost_connection_once(zmq_path):
    ctx = _io.context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port(f"tcp://{HOST}")
    push = ctx.socket(zmq.PUSH)
    monitor = _io.watch_drops(push)
    try:
        push.connect(f"tcp://{HOST}:{port}")
        _io.send_frames(push, [b"up"])
        assert drain(pull, 1) == [[b"up"]]  # connected
        assert not _io.dropped(monitor)
        pull.close(0)
        deadline = time.monotonic() + 10.0
        while not _io.dropped(monitor):
            assert time.monotonic() < deadline, "the lost connection was never reported"
            time.sleep(0.01)
        assert not _io.dropped(monitor)  # the report was drained
    finally:
        _io.close_watched(push, monitor)
        pull.close(0)

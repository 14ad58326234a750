"""_io.take_asks: an encode rank's request socket read with its plain asks parsed natively, and on the
pyzmq path. Real ZMQ sockets on loopback: every request comes out once, in the order it was sent."""

from __future__ import annotations

import dataclasses

from live_helpers import take_all

from transfer import _io
from transfer.frames import TransferInfo, cancel_frames, registration_frames

HOST = "127.0.0.1"


def ask(room: int, **changes) -> TransferInfo:
    info = TransferInfo(room, HOST, 17001, f"{HOST}:15432", 0x7F00_1234_0000, 0, 4, 2048, "torch.bfloat16", False,
                        1, 0, 4)
    return dataclasses.replace(info, **changes)


def taking(pull):
    return lambda most: _io.take_asks(pull, most)


def test_plain_asks_come_parsed_in_order_and_every_other_request_comes_between_them(zmq_path, listener):
    push, pull = listener
    wide = ask(3, has_deepstack=True, deepstack_row_bytes=512)
    sent = [ask(1).to_frames(), ask(2).to_frames(),
            registration_frames(HOST, 17001, f"{HOST}:15432", 0x7F00_0000_0000, 0),
            wide.to_frames(), cancel_frames(2, HOST, 17001, f"{HOST}:15432"), [b"garbage", b"\xff"],
            ask(4).to_frames() + [b"later", b"parts a peer may add"], ask(5).to_frames()]
    for frames in sent:
        push.send_multipart(frames)
    got = take_all(taking(pull), len(sent), "ask")
    if zmq_path == "native":
        assert got == [("ask", ask(1)), ("ask", ask(2)), ("message", sent[2]), ("ask", wide), ("message", sent[4]),
                       ("message", sent[5]), ("message", sent[6]), ("ask", ask(5))]
        assert all(type(item) is TransferInfo for kind, item in got if kind == "ask")
    else:  # no native intake: every request goes the general way
        assert got == [("message", frames) for frames in sent]
    assert TransferInfo.from_frames(sent[6]) == ask(4)  # the general path still takes what the plain one leaves


def test_a_request_over_the_bounds_is_dropped_counted_and_the_next_one_is_read(zmq_path, listener):
    push, pull = listener
    before = _io.oversized_dropped
    push.send_multipart([b"1"] * (_io.MAX_CONTROL_PARTS + 1))
    push.send_multipart(ask(2).to_frames())
    got = take_all(taking(pull), 1, "ask", most=8)
    assert got == ([("ask", ask(2))] if zmq_path == "native" else [("message", ask(2).to_frames())])
    assert _io.oversized_dropped == before + 1


def test_at_most_the_messages_asked_for_are_taken_in_one_call(listener):
    push, pull = listener
    for room in range(10):
        push.send_multipart(ask(room).to_frames())
    assert take_all(taking(pull), 4, "ask", most=4) == [("ask", ask(room)) for room in range(4)]
    assert take_all(taking(pull), 6, "ask") == [("ask", ask(room)) for room in range(4, 10)]

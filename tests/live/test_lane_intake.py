"""_io.take_statuses: a prefill status socket read with lanes (transfer.core.lane), natively and on the
pyzmq path. Real ZMQ sockets on loopback: the order statuses are taken in is what a lane must keep."""

from __future__ import annotations

from live_helpers import take_all

from transfer import _io
from transfer.frames import status_frames
from transfer.status import TransferPoll

S, F = TransferPoll.Success, TransferPoll.Failed


def taking(pull, lanes: dict[int, int]):
    return lambda most: _io.take_statuses(pull, lanes, most)


def test_lane_successes_settle_in_order_and_every_other_message_comes_between_them(zmq_path, listener):
    push, pull = listener
    sent = [status_frames(1, S, 0), status_frames(2, S, 0), status_frames(3, F, 0), status_frames(4, S, 1),
            status_frames(5, S, 0), [b"6", b"5", b"0", b"123", b"456"], status_frames(9, S, 0)]
    for frames in sent:
        push.send_multipart(frames)
    lanes = {1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 0}
    got = take_all(taking(pull, lanes), len(sent), "settled")
    if zmq_path == "native":
        assert got == [("settled", 1), ("settled", 2), ("message", sent[2]), ("message", sent[3]),
                       ("settled", 5), ("settled", 6), ("message", sent[6])]
        assert lanes == {3: 0, 4: 0}  # not settled: the general rules end those lanes
    else:  # no native intake: every status goes the general way, and lanes are left to it
        assert got == [("message", frames) for frames in sent]
        assert lanes == {1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 0}


def test_a_message_over_the_bounds_is_dropped_counted_and_the_next_one_is_read(zmq_path, listener):
    push, pull = listener
    before = _io.oversized_dropped
    push.send_multipart([b"1"] * (_io.MAX_CONTROL_PARTS + 1))
    push.send_multipart(status_frames(2, S, 0))
    got = take_all(taking(pull, {2: 0}), 1, "settled", most=8)
    assert got == ([("settled", 2)] if zmq_path == "native" else [("message", status_frames(2, S, 0))])
    assert _io.oversized_dropped == before + 1


def test_a_take_call_ends_at_a_message_discarded_for_its_size_having_read_only_it(zmq_path, listener):
    # On both paths, so a caller can count the discard among the messages it reads per turn: a peer pushing
    # only such messages must not keep it in one call.
    push, pull = listener
    before = _io.oversized_dropped
    push.send_multipart([b"1"] * (_io.MAX_CONTROL_PARTS + 1))
    push.send_multipart(status_frames(2, F, 0))
    assert pull.poll(10_000)
    assert _io.take_statuses(pull, {2: 0}, 8) == ([], None, False)
    assert _io.oversized_dropped == before + 1
    assert take_all(taking(pull, {2: 0}), 1, "settled") == [("message", status_frames(2, F, 0))]


def test_at_most_the_messages_asked_for_are_taken_in_one_call(listener):
    push, pull = listener
    for room in range(10):
        push.send_multipart(status_frames(room, S, 0))
    lanes = {room: 0 for room in range(10)}
    assert take_all(taking(pull, lanes), 4, "settled", most=4) == [("settled", room) for room in range(4)]
    assert sorted(lanes) == list(range(4, 10))
    assert take_all(taking(pull, lanes), 6, "settled") == [("settled", room) for room in range(4, 10)]

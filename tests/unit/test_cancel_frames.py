"""The cancel extension's codec: a cancel and its answer round-trip; malformed input raises WireError."""

from __future__ import annotations

import pytest

from transfer.frames import (
    CANCEL_PARTS,
    TRANSFER_INFO_PARTS,
    Cancel,
    CancelAnswer,
    CancelReply,
    WireError,
    cancel_frames,
    cancel_reply_frames,
    is_cancel,
    is_registration,
    parse_cancel,
    parse_cancel_reply,
    parse_status,
)
from transfer.status import TransferPoll


def test_cancel_round_trips():
    cancel = Cancel(7, "127.0.0.1", 5555, "127.0.0.1:17000")
    frames = cancel.to_frames()
    assert frames == [b"Cancel", b"7", b"127.0.0.1", b"5555", b"127.0.0.1:17000"]
    assert is_cancel(frames) and not is_registration(frames)
    assert parse_cancel(frames) == cancel
    assert parse_cancel([memoryview(f) for f in frames] + [b"later parts ignored"]) == cancel


def test_a_cancel_says_in_part_5_that_its_sender_reads_write_failed_answers():
    cancel = Cancel(7, "127.0.0.1", 5555, "127.0.0.1:17000", reads_write_failed=True)
    frames = cancel.to_frames()
    assert frames == [b"Cancel", b"7", b"127.0.0.1", b"5555", b"127.0.0.1:17000", b"reads-write-failed"]
    assert parse_cancel(frames) == cancel
    assert parse_cancel([memoryview(f) for f in frames] + [b"later parts ignored"]) == cancel
    assert parse_cancel(frames[:5] + [b"reads-something-else"]).reads_write_failed is False


def test_an_unasked_cancel_says_so_in_part_5_and_reads_as_a_plain_cancel_to_an_earlier_release():
    cancel = Cancel(7, "127.0.0.1", 5555, "127.0.0.1:17000", unasked=True)
    frames = cancel.to_frames()
    assert frames == [b"Cancel", b"7", b"127.0.0.1", b"5555", b"127.0.0.1:17000", b"unasked"]
    assert frames == cancel_frames(7, "127.0.0.1", 5555, "127.0.0.1:17000", reads_write_failed=True, unasked=True)
    assert parse_cancel(frames) == cancel and not cancel.reads_write_failed
    assert parse_cancel(frames + [b"later parts ignored"]) == cancel
    # An earlier release read part 5 for reads-write-failed alone: it takes this for a plain cancel.
    assert parse_cancel(frames[:5] + [b"reads-write-failed"]).unasked is False
    assert len(frames) < TRANSFER_INFO_PARTS  # a peer drops it as malformed


def test_cancel_is_a_shape_the_peers_drop():
    """A peer parses any request not marked None as a TransferInfo: a cancel is too short for one."""
    assert len(cancel_frames(1, "h", 1, "s")) == CANCEL_PARTS < TRANSFER_INFO_PARTS
    assert len(cancel_frames(1, "h", 1, "s", reads_write_failed=True)) == CANCEL_PARTS + 1 < TRANSFER_INFO_PARTS


@pytest.mark.parametrize(("frames", "message"), [
    ([b"Cancel", b"1", b"h", b"1"], "malformed cancel frame: 4 parts < 5"),
    ([b"None", b"1", b"h", b"1", b"s"], "cancel part 0 must be Cancel"),
    ([b"Cancel", b"x", b"h", b"1", b"s"], "room is not an integer"),
    ([b"Cancel", b"-1", b"h", b"1", b"s"], "negative room"),
    ([b"Cancel", b"1", "hé".encode(), b"1", b"s"], "endpoint must be ASCII"),
    ([b"Cancel", b"1", b"h", b"70000", b"s"], "invalid port"),
    ([b"Cancel", b"1", b"h", b"1", b"\xff"], "session must be ASCII"),
])
def test_parse_cancel_refuses_malformed(frames, message):
    with pytest.raises(WireError, match=f"^{message}$"):
        parse_cancel(frames)


@pytest.mark.parametrize(("args", "message"), [
    ((-1, "h", 1, "s"), "negative room"),
    ((1, "h", -1, "s"), "invalid port"),
    ((1, "hé", 1, "s"), "endpoint must be ASCII"),
    ((1, "h", 1, None), "session must be ASCII"),
])
def test_cancel_frames_refuses_what_the_parser_would(args, message):
    with pytest.raises(WireError, match=f"^{message}$"):
        cancel_frames(*args)


def test_is_cancel_on_odd_input():
    assert not is_cancel([])
    assert not is_cancel([object()])
    assert not is_cancel([b"cancel"])


@pytest.mark.parametrize("answer", list(CancelAnswer))
def test_cancel_reply_round_trips_as_a_failed_status(answer):
    frames = cancel_reply_frames(9, 2, answer)
    assert frames[3] == {CancelAnswer.CONFIRMED: b"cancel-confirmed", CancelAnswer.TOO_LATE: b"cancel-too-late",
                         CancelAnswer.WRITE_FAILED: b"cancel-write-failed"}[answer]
    assert parse_cancel_reply(frames) == CancelReply(9, 2, answer)
    # Read as a plain status it is Failed: a receiver without the extension fails the room.
    assert parse_status(frames[:3])[:3] == (9, TransferPoll.Failed, 2)


def test_plain_statuses_are_not_cancel_replies():
    assert parse_cancel_reply([b"9", b"2", b"0"]) is None
    assert parse_cancel_reply([b"9", b"2", b"0", b"123"]) is None
    assert parse_cancel_reply([b"9", b"2", b"0", b"1", b"2"]) is None
    assert parse_cancel_reply([b"9", b"2", b"0", object()]) is None


@pytest.mark.parametrize(("frames", "message"), [
    ([b"9", b"2", b"0", b"cancel-confirmed"], "a cancel answer must be Failed"),
    ([b"x", b"3", b"0", b"cancel-confirmed"], "room is not an integer"),
    ([b"9", b"77", b"0", b"cancel-too-late"], "unknown status"),
])
def test_parse_cancel_reply_refuses_malformed(frames, message):
    with pytest.raises(WireError, match=f"^{message}$"):
        parse_cancel_reply(frames)

"""An independent conformance audit of the wire against SPEC.md sections 2, 3, 4, 7 and 8.

Every expectation here is written out by hand from the SPEC text: literal bytes,
struct.pack pointers, literal error strings. None is produced by calling our own
encoders, so an encoder and its parser that drifted together still fail here."""

from __future__ import annotations

import struct
import sys

import pytest
import zmq
from prefill_rooms import core, routed, spec

from transfer.core.prefill import Conclude
from transfer.frames import (
    Registration,
    TransferInfo,
    WireError,
    is_registration,
    parse_registration,
    parse_status,
    registration_frames,
    shard_rows,
    status_frames,
)
from transfer.status import RoomTable, TransferPoll, advance


def ptr(value: int) -> bytes:
    """SPEC 4.1/4.2's pointer part, exactly as the SPEC writes it."""
    return struct.pack("Q", value)


@pytest.mark.parametrize("span, rank, size, expected", [
    (10, 0, 3, (0, 4)), (10, 2, 3, (7, 3)), (2, 3, 4, (2, 0)),  # the SPEC's own examples
    (10, 1, 3, (4, 3)), (7, 0, 2, (0, 4)), (7, 1, 2, (4, 3)), (3, 2, 4, (2, 1)), (3, 3, 4, (3, 0)),
    (0, 0, 1, (0, 0)), (0, 2, 3, (0, 0)), (1, 0, 5, (0, 1)), (1, 4, 5, (1, 0)), (8, 3, 4, (6, 2)),
    (9, 0, 1, (0, 9)), (11, 3, 4, (9, 2)), (13, 4, 5, (11, 2)), (13, 2, 5, (6, 3)),
])
def test_shard_rows_examples(span, rank, size, expected):
    assert shard_rows(span, rank, size) == expected


@pytest.mark.parametrize("size", range(1, 13))
def test_shard_rows_tile_the_span_in_rank_order(size):
    for span in range(70):
        base, rem = span // size, span % size
        end = 0
        for rank in range(size):
            start, count = shard_rows(span, rank, size)
            assert start == end, (span, rank, size)  # contiguous, in rank order
            assert count == base + (1 if rank < rem else 0)  # the first `rem` ranks get one more
            if span < size:
                assert count == (1 if rank < span else 0)
            end = start + count
        assert end == span


def test_transfer_poll_wire_values():
    assert {p.name: int(p) for p in TransferPoll} == {
        "Failed": 0, "Bootstrapping": 1, "Bootstrapped": 2, "WaitingForInput": 3, "Transferring": 4, "Success": 5,
    }


@pytest.mark.parametrize("old", list(TransferPoll))
@pytest.mark.parametrize("new", list(TransferPoll))
def test_advance_is_max_with_failed_sticky(old, new):
    expected = 0 if 0 in (int(old), int(new)) else max(int(old), int(new))
    assert int(advance(old, new)) == expected


def test_room_table_moves_only_upward_and_failed_never_resurrects():
    table = RoomTable()
    table.start(1, TransferPoll.Bootstrapping)
    seen = [table.update(1, TransferPoll(v)) for v in (3, 2, 4, 1, 3)]
    assert [int(s) for s in seen] == [3, 3, 4, 4, 4]
    assert table.update(1, TransferPoll.Success) == TransferPoll.Success
    # Failed overrides any state, Success included, and then nothing moves it.
    assert table.update(1, TransferPoll.Failed, "boom") == TransferPoll.Failed
    for value in (5, 4, 3, 2, 1):
        assert table.update(1, TransferPoll(value)) == TransferPoll.Failed
    assert table.start(1, TransferPoll.Bootstrapping) == TransferPoll.Failed
    assert table.reason(1) == "boom"
    assert table.update(99, TransferPoll.Success) is None  # unknown rooms are ignored


# A hand-built 13-part TransferInfo and the values it carries.
EMB, DS = 0x00007F1234560010, 0x00007F9876540000
INFO = [
    b"42", b"10.1.2.3", b"17001", b"10.1.2.3:15000", ptr(EMB), ptr(DS), b"3", b"4096", b"torch.bfloat16", b"1",
    b"2", b"5", b"8",
]
INFO_VALUES = dict(room=42, endpoint="10.1.2.3", port=17001, session_id="10.1.2.3:15000", embedding_ptr=EMB,
                   deepstack_ptr=DS, rows=3, hidden=4096, dtype="torch.bfloat16", has_deepstack=True, fanout=2,
                   row_start=5, span=8)
NAMES = ["room", "endpoint", "port", "session", "embedding pointer", "deepstack pointer", "rows", "hidden", "dtype",
         None, "fanout", "row_start", "span"]
NUMBER_PARTS = [0, 2, 6, 7, 10, 11, 12]
PLAIN_NUMBER_PARTS = [6, 7, 10, 11, 12]  # no range rule beyond signed 64 bits
TEXT_PARTS = [1, 3, 8]
POINTER_PARTS = [4, 5]


def info_error(frames) -> str:
    """The WireError message parsing `frames` raises (AssertionError when it parses)."""
    with pytest.raises(WireError) as caught:
        TransferInfo.from_frames(frames)
    return str(caught.value)


def with_part(index: int, value: bytes, frames=INFO) -> list[bytes]:
    changed = list(frames)
    changed[index] = value
    return changed


def fields(info: TransferInfo) -> dict:
    return {k: getattr(info, k) for k in INFO_VALUES}


def test_transfer_info_encodes_to_the_hand_built_parts():
    assert TransferInfo(**INFO_VALUES).to_frames() == INFO
    no_ds = TransferInfo(**{**INFO_VALUES, "has_deepstack": False, "deepstack_ptr": 0}).to_frames()
    assert no_ds[5] == b"\x00" * 8 and no_ds[9] == b"0"


def test_transfer_info_parses_the_hand_built_parts():
    assert fields(TransferInfo.from_frames(INFO)) == INFO_VALUES


def test_pointers_are_native_order_8_bytes():
    value = 0x0102030405060708
    frames = with_part(4, value.to_bytes(8, sys.byteorder))
    assert TransferInfo.from_frames(frames).embedding_ptr == value
    assert TransferInfo(**{**INFO_VALUES, "embedding_ptr": value}).to_frames()[4] == value.to_bytes(8, sys.byteorder)
    assert ptr(value) == value.to_bytes(8, sys.byteorder)  # native order, standard size
    assert TransferInfo.from_frames(with_part(5, b"\xff" * 8)).deepstack_ptr == 2**64 - 1  # unsigned


@pytest.mark.parametrize("value, expected", [
    (b"1", True), (b"0", False), (b"", False), (b"true", False), (b"True", False), (b"01", False), (b" 1", False),
    (b"1 ", False), (b"1\x00", False), (b"\x01", False), (b"2", False), (b"yes", False), (b"+1", False),
    ("١".encode(), False), (b"\xff", False),
])
def test_has_deepstack_is_true_only_for_1(value, expected):
    assert TransferInfo.from_frames(with_part(9, value)).has_deepstack is expected


@pytest.mark.parametrize("extra", [[b""], [b"junk"], [b"\xff\xfe"], [b"x"] * 7, [ptr(1), b"None", b"-1"]])
def test_parts_beyond_13_are_ignored(extra):
    # Part 13 is ours (docs/protocol.md 8: the receiver's deepstack row bytes, a decimal);
    # the peers send 13 parts, and every part after ours is ignored.
    assert fields(TransferInfo.from_frames(INFO)) == INFO_VALUES
    assert TransferInfo.from_frames(INFO).deepstack_row_bytes is None
    parsed = TransferInfo.from_frames(INFO + [b"96"] + extra)
    assert fields(parsed) == INFO_VALUES and parsed.deepstack_row_bytes == 96


@pytest.mark.parametrize("count", range(13))
def test_fewer_than_13_parts(count):
    assert info_error(INFO[:count]) == f"malformed EmbeddingTransferInfo frame: {count} parts < 13"


def test_the_part_count_is_checked_before_any_part():
    assert info_error([b"-1", b"\xff", b"x"] + [b""] * 9) == "malformed EmbeddingTransferInfo frame: 12 parts < 13"


@pytest.mark.parametrize("index", TEXT_PARTS)
@pytest.mark.parametrize("bad", [b"\xff", "é".encode(), b"abc\x80", "٣".encode()])
def test_text_parts_must_be_ascii(index, bad):
    assert info_error(with_part(index, bad)) == f"{NAMES[index]} must be ASCII"


@pytest.mark.parametrize("index", TEXT_PARTS)
def test_text_parts_take_any_ascii(index):
    parsed = TransferInfo.from_frames(with_part(index, b" any ascii\x01\x7f "))
    assert getattr(parsed, ["room", "endpoint", "port", "session_id", "", "", "", "", "dtype"][index]) \
        == " any ascii\x01\x7f "


@pytest.mark.parametrize("index", POINTER_PARTS)
@pytest.mark.parametrize("length", [0, 1, 4, 7, 9, 16])
def test_pointer_parts_must_be_8_bytes(index, length):
    assert info_error(with_part(index, b"\x01" * length)) == f"{NAMES[index]} must be 8 bytes"


NOT_INTEGERS = [
    b" 7 ", b" 7", b"7 ", b"\t7", b"7\n", b"1_0", b"", b"+", b"-", b"+-7", b"-+7", b"--7", b"++7", b"0x10", b"1e3",
    b"7.0", b"7,0", b"abc", b"\x00", b"7\x00",
    str(2**63).encode(), str(-(2**63) - 1).encode(), b"9" * 40, b"-" + b"9" * 40, b"99999999999999999999",
]
NON_ASCII_DIGITS = [
    "٧".encode(),  # Arabic-Indic seven
    "۷".encode(),  # extended Arabic-Indic seven
    "７".encode(),  # fullwidth seven
    "७".encode(),  # Devanagari seven
    "²".encode(),  # superscript two
    "1٠".encode(),  # ASCII one then Arabic-Indic zero
    b"\xff", b"7\x80",
]


@pytest.mark.parametrize("index", NUMBER_PARTS)
@pytest.mark.parametrize("bad", NOT_INTEGERS)
def test_numbers_that_are_not_signed_64_bit_decimals(index, bad):
    assert info_error(with_part(index, bad)) == f"{NAMES[index]} is not an integer"


@pytest.mark.parametrize("index", NUMBER_PARTS)
@pytest.mark.parametrize("bad", NON_ASCII_DIGITS)
def test_non_ascii_numbers_are_reported_as_not_ascii(index, bad):
    assert info_error(with_part(index, bad)) == f"{NAMES[index]} must be ASCII"


@pytest.mark.parametrize("index", PLAIN_NUMBER_PARTS)
@pytest.mark.parametrize("text, value", [
    (b"+7", 7), (b"-0", 0), (b"+0", 0), (b"0", 0), (b"007", 7), (b"-7", -7), (b"0" * 30 + b"7", 7),
    (b"9223372036854775807", 2**63 - 1), (b"-9223372036854775808", -(2**63)), (b"+9223372036854775807", 2**63 - 1),
])
def test_numbers_accepted_as_signed_64_bit_decimals(index, text, value):
    parsed = TransferInfo.from_frames(with_part(index, text))
    assert getattr(parsed, {6: "rows", 7: "hidden", 10: "fanout", 11: "row_start", 12: "span"}[index]) == value


@pytest.mark.parametrize("text, outcome", [
    (b"0", 0), (b"-0", 0), (b"+5", 5), (b"9223372036854775807", 2**63 - 1),
    (b"-1", "negative room"), (b"-9223372036854775808", "negative room"),
    (b"9223372036854775808", "room is not an integer"),
])
def test_room_range(text, outcome):
    if isinstance(outcome, int):
        assert TransferInfo.from_frames(with_part(0, text)).room == outcome
    else:
        assert info_error(with_part(0, text)) == outcome


@pytest.mark.parametrize("text, outcome", [
    (b"0", 0), (b"65535", 65535), (b"+80", 80), (b"-0", 0), (b"00080", 80),
    (b"65536", "invalid port"), (b"-1", "invalid port"), (b"9223372036854775807", "invalid port"),
    (b"-9223372036854775808", "invalid port"), (b"9223372036854775808", "port is not an integer"),
    (b" 80", "port is not an integer"), ("８０".encode(), "port must be ASCII"),
])
def test_port_range(text, outcome):
    if isinstance(outcome, int):
        assert TransferInfo.from_frames(with_part(2, text)).port == outcome
    else:
        assert info_error(with_part(2, text)) == outcome


# One bad value per named part, in part order, with the error each reports.
BAD = [
    (0, b"x", "room is not an integer"),
    (1, b"\xff", "endpoint must be ASCII"),
    (2, b"70000", "invalid port"),
    (3, b"\xc3\xa9", "session must be ASCII"),
    (4, b"\x00" * 7, "embedding pointer must be 8 bytes"),
    (5, b"", "deepstack pointer must be 8 bytes"),
    (6, b"1_0", "rows is not an integer"),
    (7, "٣".encode(), "hidden must be ASCII"),
    (8, b"\x80", "dtype must be ASCII"),
    (10, b" 2", "fanout is not an integer"),
    (11, b"", "row_start is not an integer"),
    (12, str(2**63).encode(), "span is not an integer"),
]


def test_first_failure_in_part_order_is_reported():
    frames = list(INFO)
    for index, bad, _ in BAD:
        frames[index] = bad
    for index, _, message in BAD:  # repair each part once its error was the one reported
        assert info_error(frames) == message
        frames[index] = INFO[index]
    assert fields(TransferInfo.from_frames(frames)) == INFO_VALUES


@pytest.mark.parametrize("later", range(1, len(BAD)))
def test_an_earlier_failure_hides_every_later_one(later):
    for earlier in range(later):
        frames = list(INFO)
        frames[BAD[earlier][0]] = BAD[earlier][1]
        frames[BAD[later][0]] = BAD[later][1]
        assert info_error(frames) == BAD[earlier][2]


def test_negative_room_comes_before_later_parts():
    assert info_error([b"-3", b"\xff"] + INFO[2:]) == "negative room"
    assert info_error([b"-3"] + INFO[1:4] + [b"short"] + INFO[5:]) == "negative room"


def _containers(frames):
    """The same parts as the containers a caller may hand the parser."""
    ctx_frames = [zmq.Frame(f) for f in frames]
    return [list(frames), tuple(frames), [bytearray(f) for f in frames], [memoryview(f) for f in frames], ctx_frames]


@pytest.mark.parametrize("frames", [INFO, INFO + [b"extra"]] + [with_part(i, b, INFO) for i, b, _ in BAD])
def test_every_container_parses_the_same(frames):
    outcomes = []
    for container in _containers(frames):
        try:
            outcomes.append(fields(TransferInfo.from_frames(container)))
        except WireError as exc:
            outcomes.append(str(exc))
    assert all(o == outcomes[0] for o in outcomes), outcomes


@pytest.mark.parametrize("index", range(13))
@pytest.mark.parametrize("wrap", [zmq.Frame, bytearray, memoryview])
def test_one_part_in_another_buffer_type_reads_by_its_bytes(index, wrap):
    """A part's meaning is its bytes, whatever object carries them (one zmq.Frame among bytes)."""
    frames = list(INFO)
    frames[index] = wrap(frames[index])
    assert fields(TransferInfo.from_frames(frames)) == INFO_VALUES


REG = [b"None", b"10.1.2.3", b"17001", b"10.1.2.3:15000", ptr(0x7F0000001000), ptr(0)]


def test_registration_encodes_to_the_hand_built_parts():
    assert registration_frames("10.1.2.3", 17001, "10.1.2.3:15000", 0x7F0000001000, 0) == REG
    # Section 8: region lengths ride in parts 6 and 7.
    assert registration_frames("10.1.2.3", 17001, "10.1.2.3:15000", 0x7F0000001000, 0x7F0000900000, 4096, 8192) \
        == REG[:5] + [ptr(0x7F0000900000), b"4096", b"8192"]


def test_a_peer_registration_of_6_parts_parses_without_lengths():
    reg = parse_registration(REG)
    assert reg == Registration("10.1.2.3", 17001, "10.1.2.3:15000", 0x7F0000001000, 0, None, None)
    assert not reg.has_lengths


def test_registration_with_lengths_parses_them():
    reg = parse_registration(REG + [b"4096", b"0"])
    assert (reg.embedding_len, reg.deepstack_len) == (4096, 0)


@pytest.mark.parametrize("first, expected", [
    (b"None", True), (b"none", False), (b"NONE", False), (b"None ", False), (b" None", False), (b"None\x00", False),
    (b"", False), (b"0", False), (b"42", False), (b"null", False),
])
def test_a_registration_is_exactly_part_0_none(first, expected):
    assert is_registration([first] + REG[1:]) is expected
    assert is_registration([first] + INFO[1:]) is expected


@pytest.mark.parametrize("wrap", [zmq.Frame, bytearray, memoryview])
def test_registration_parts_read_by_their_bytes(wrap):
    for index in range(6):
        frames = list(REG)
        frames[index] = wrap(frames[index])
        assert is_registration(frames) is True
        assert parse_registration(frames) == Registration("10.1.2.3", 17001, "10.1.2.3:15000", 0x7F0000001000, 0)


def test_empty_and_transfer_info_frames_are_not_registrations():
    assert is_registration([]) is False
    assert is_registration(INFO) is False


@pytest.mark.parametrize("status", list(TransferPoll))
def test_status_encodes_to_three_ascii_parts(status):
    assert status_frames(17, status, 3) == [b"17", str(int(status)).encode(), b"3"]
    assert status_frames(17, int(status), 0) == [b"17", str(int(status)).encode(), b"0"]


def test_status_checksums_are_parts_3_and_4_ascii_decimal():
    assert status_frames(9, TransferPoll.Success, 1, [123]) == [b"9", b"5", b"1", b"123"]
    assert status_frames(9, TransferPoll.Success, 1, [2**64 - 1, 0]) \
        == [b"9", b"5", b"1", b"18446744073709551615", b"0"]


def status_error(frames) -> str:
    with pytest.raises(WireError) as caught:
        parse_status(frames)
    return str(caught.value)


@pytest.mark.parametrize("wrap", [zmq.Frame, bytearray, memoryview])
def test_status_parts_read_by_their_bytes(wrap):
    for index in range(4):
        frames = [b"7", b"5", b"2", b"11"]
        frames[index] = wrap(frames[index])
        assert parse_status(frames) == (7, TransferPoll.Success, 2, (11,))


@pytest.mark.parametrize("count", range(3))
def test_status_needs_3_parts(count):
    assert status_error([b"1", b"5", b"0"][:count]) == "an EPD status has 3 frames"


NOT_UTF8 = [b"\xff", b"\x80", b"\xc3", b"7\xff", b"\xed\xa0\x80"]


@pytest.mark.parametrize("index, name", [(0, "room"), (1, "status"), (2, "rank")])
@pytest.mark.parametrize("bad", NOT_INTEGERS + NON_ASCII_DIGITS + NOT_UTF8)
def test_status_numbers_follow_4_2_and_have_no_ascii_error(index, name, bad):
    frames = [b"7", b"5", b"0"]
    frames[index] = bad
    assert status_error(frames) == f"{name} is not an integer"


@pytest.mark.parametrize("value", [b"6", b"-1", b"100", b"9223372036854775807", b"-9223372036854775808"])
def test_unknown_status(value):
    assert status_error([b"1", value, b"0"]) == "unknown status"


@pytest.mark.parametrize("frames, expected", [
    ([b"x", b"-1", b"\xff"], "room is not an integer"),
    ([b"-1", b"x", b"x"], "negative room"),
    ([b"-9223372036854775808", b"9", b"x"], "negative room"),
    ([b"1", b"x", b"\xff"], "status is not an integer"),
    ([b"1", b"9", b"\xff"], "unknown status"),
    ([b"1", b"-1", b"x"], "unknown status"),
    ([b"1", b"5", "٠".encode()], "rank is not an integer"),
    ([b"1", b"5", b""], "rank is not an integer"),
])
def test_status_errors_come_in_spec_order(frames, expected):
    assert status_error(frames) == expected
    assert status_error(frames + [b"junk", b"more"]) == expected


def test_a_peers_failed_concludes_with_the_specs_reason():
    """SPEC 7: Failed from the paired encode rank concludes the room Failed with reason
    `encode failed to send embedding`; ours adds the encode rank and its address, in parentheses."""
    prefill = core()
    routed(prefill)
    prefill.receive(0.0, spec(1, slot=1))
    room, status, rank, _ = parse_status([b"1", b"0", b"0"])  # a peer's bare Failed for room 1
    [conclusion] = [a for a in prefill.status(0.1, room, status, rank) if isinstance(a, Conclude)]
    assert conclusion.failure.detail == "encode failed to send embedding (encode rank 0 at 10.0.0.2:7000)"

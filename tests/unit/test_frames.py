"""The control-plane contract: shard geometry, frame codecs and their exact errors (SPEC.md 2, 4, 6, 8)."""

from __future__ import annotations

import dataclasses
import random
import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transfer.frames import (
    DTYPE_BYTES,
    MAX_REASON_BYTES,
    Registration,
    TransferInfo,
    WireError,
    check_region,
    dtype_size,
    is_registration,
    parse_registration,
    parse_status,
    registration_frames,
    shard_rows,
    status_frames,
    validate_fanout,
)
from transfer.status import TransferPoll


I64_MAX = 2**63 - 1
I64_MIN = -(2**63)
U64_MAX = 2**64 - 1
HIGH_PTR = 0xFFFF_FFFF_FFFF_F000
HIGH_PTR_BYTES = b"\x00\xf0\xff\xff\xff\xff\xff\xff"  # HIGH_PTR, little-endian

little_endian = pytest.mark.skipif(sys.byteorder != "little", reason="golden pointer bytes are little-endian")


def wire_error(message: str):
    """pytest.raises for a WireError whose message is exactly `message`."""
    return pytest.raises(WireError, match="^" + re.escape(message) + "$")


@pytest.mark.parametrize(
    "span, rank, size, expected",
    [
        (10, 0, 3, (0, 4)),
        (10, 1, 3, (4, 3)),
        (10, 2, 3, (7, 3)),
        (2, 3, 4, (2, 0)),
        (2, 1, 4, (1, 1)),
        (0, 0, 1, (0, 0)),
        (7, 0, 1, (0, 7)),
    ],
)
def test_shard_rows_spec_examples(span, rank, size, expected):
    assert shard_rows(span, rank, size) == expected


@pytest.mark.parametrize("args", [(10, 0, 0), (10, 0, -1), (10, 3, 3), (10, -1, 3), (-1, 0, 2)])
def test_shard_rows_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        shard_rows(*args)


@given(span=st.integers(0, 10**7), size=st.integers(1, 300))
def test_shard_rows_tiles_in_rank_order_and_balances(span, size):
    shards = [shard_rows(span, r, size) for r in range(size)]
    cursor = 0
    for start, count in shards:
        assert start == cursor and count >= 0
        cursor += count
    assert cursor == span
    counts = [c for _, c in shards]
    assert max(counts) - min(counts) <= 1
    # The larger shards come first.
    assert counts == sorted(counts, reverse=True)


def test_dtype_size_known_and_unknown():
    assert dtype_size("torch.bfloat16") == 2
    assert dtype_size("torch.float8_e4m3fn") == 1
    assert dtype_size("torch.float64") == 8
    with wire_error("unknown dtype 'torch.complex64'"):
        dtype_size("torch.complex64")
    assert dtype_size("bfloat16") == 2  # the short spelling is the same dtype
    with wire_error("unknown dtype 'complex64'"):
        dtype_size("complex64")


#: The dtypes the wire carries, as SPEC.md's dtype part spells them (`str(torch.dtype)`; it names
#: torch.bfloat16), with their element sizes: written out here, not read from DTYPE_BYTES.
WIRE_DTYPES = {
    "torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4, "torch.float64": 8,
    "torch.int8": 1, "torch.uint8": 1, "torch.int16": 2, "torch.int32": 4, "torch.int64": 8,
    "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1, "torch.bool": 1,
}


def test_dtype_table_matches_torch():
    torch = pytest.importorskip("torch")
    assert DTYPE_BYTES == WIRE_DTYPES
    for name, size in WIRE_DTYPES.items():
        dtype = getattr(torch, name.split(".", 1)[1])
        assert str(dtype) == name
        assert torch.empty((), dtype=dtype).element_size() == size, name


INFO = TransferInfo(
    room=7,
    endpoint="10.0.0.2",
    port=5555,
    session_id="10.0.0.2:17000",
    embedding_ptr=HIGH_PTR,
    deepstack_ptr=0x0000_7F00_0000_1000,
    rows=4,
    hidden=2048,
    dtype="torch.bfloat16",
    has_deepstack=True,
    fanout=3,
    row_start=8,
    span=10,
)
INFO_FRAMES = [
    b"7",
    b"10.0.0.2",
    b"5555",
    b"10.0.0.2:17000",
    b"\x00\xf0\xff\xff\xff\xff\xff\xff",
    b"\x00\x10\x00\x00\x00\x7f\x00\x00",
    b"4",
    b"2048",
    b"torch.bfloat16",
    b"1",
    b"3",
    b"8",
    b"10",
]


@little_endian
def test_transfer_info_golden_encode():
    assert INFO.to_frames() == INFO_FRAMES


@little_endian
def test_transfer_info_golden_decode():
    assert TransferInfo.from_frames(INFO_FRAMES) == INFO


def test_transfer_info_field_order():
    names = [f for f in TransferInfo.__dataclass_fields__]
    assert names == ["room", "endpoint", "port", "session_id", "embedding_ptr", "deepstack_ptr", "rows",
                     "hidden", "dtype", "has_deepstack", "fanout", "row_start", "span", "deepstack_row_bytes"]


def test_transfer_info_without_deepstack_golden():
    info = TransferInfo(0, "127.0.0.1", 0, "127.0.0.1:1", 4096, 0, 0, 1, "torch.float32", False, 1, 0, 0)
    frames = info.to_frames()
    assert frames == [b"0", b"127.0.0.1", b"0", b"127.0.0.1:1", (4096).to_bytes(8, sys.byteorder), b"\x00" * 8,
                      b"0", b"1", b"torch.float32", b"0", b"1", b"0", b"0"]
    assert TransferInfo.from_frames(frames) == info


def test_transfer_info_helpers():
    assert INFO.row_bytes() == 4096
    assert not INFO.is_identity
    identity = TransferInfo(1, "h", 1, "s", 0, 0, 10, 8, "torch.float32", False, 2, 0, 10)
    assert identity.is_identity and identity.row_bytes() == 32


def test_transfer_info_extra_parts_ignored_and_buffer_types_accepted():
    # Part 13 is ours (the deepstack row bytes); every later part is ignored.
    frames = [bytearray(p) for p in INFO_FRAMES[:6]] + [memoryview(p) for p in INFO_FRAMES[6:]] + [
        bytearray(b"64"), b"x", b"\xff"]
    assert TransferInfo.from_frames(frames) == TransferInfo.from_frames(INFO_FRAMES + [b"64"])
    assert TransferInfo.from_frames(tuple(INFO_FRAMES)) == TransferInfo.from_frames(INFO_FRAMES)


@pytest.mark.parametrize("part, expected", [(b"1", True), (b"0", False), (b"true", False), (b"", False),
                                            (b"11", False), (b"\xff", False), (b" 1", False)])
def test_has_deepstack_is_true_only_for_1(part, expected):
    frames = list(INFO_FRAMES)
    frames[9] = part
    assert TransferInfo.from_frames(frames).has_deepstack is expected


@pytest.mark.parametrize("count", [0, 1, 6, 12])
def test_transfer_info_too_few_parts(count):
    with wire_error(f"malformed EmbeddingTransferInfo frame: {count} parts < 13"):
        TransferInfo.from_frames(INFO_FRAMES[:count])


NUMBER_PARTS = [(0, "room"), (2, "port"), (6, "rows"), (7, "hidden"), (10, "fanout"), (11, "row_start"),
                (12, "span")]
TEXT_PARTS = [(1, "endpoint"), (3, "session"), (8, "dtype")]
NOT_INTEGERS = [b"", b" 7", b"7 ", b" 7 ", b"1_0", b"x", b"0x10", b"7\n", b"\t7", b"1.0", b"1e3", b"+", b"-",
                b"--1", b"+-1", b"9223372036854775808", b"-9223372036854775809", b"99999999999999999999999",
                b"1" * 5000, b"\x007"]
NON_ASCII = [b"\xef\xbc\x97", b"\xff", b"7\x80", "\u0663".encode()]  # fullwidth 7, junk, Arabic-Indic 3


def with_part(index: int, value: bytes) -> list[bytes]:
    """INFO_FRAMES with one part replaced."""
    frames = list(INFO_FRAMES)
    frames[index] = value
    return frames


@pytest.mark.parametrize("index, name", NUMBER_PARTS)
@pytest.mark.parametrize("value", NOT_INTEGERS)
def test_number_parts_not_integers(index, name, value):
    with wire_error(f"{name} is not an integer"):
        TransferInfo.from_frames(with_part(index, value))


@pytest.mark.parametrize("index, name", NUMBER_PARTS + TEXT_PARTS)
@pytest.mark.parametrize("value", NON_ASCII)
def test_non_ascii_parts(index, name, value):
    with wire_error(f"{name} must be ASCII"):
        TransferInfo.from_frames(with_part(index, value))


@pytest.mark.parametrize("index, name", [(4, "embedding pointer"), (5, "deepstack pointer")])
@pytest.mark.parametrize("value", [b"", b"\x00" * 7, b"\x00" * 9, b"0", b"18446744073709551615"])
def test_pointer_parts_must_be_8_bytes(index, name, value):
    with wire_error(f"{name} must be 8 bytes"):
        TransferInfo.from_frames(with_part(index, value))


@pytest.mark.parametrize("value", [b"-1", b"-9223372036854775808"])
def test_negative_room(value):
    with wire_error("negative room"):
        TransferInfo.from_frames(with_part(0, value))


@pytest.mark.parametrize("value", [b"65536", b"-1", b"9223372036854775807", b"-9223372036854775808"])
def test_invalid_port(value):
    with wire_error("invalid port"):
        TransferInfo.from_frames(with_part(2, value))


@pytest.mark.parametrize(
    "index, value, field, expected",
    [
        (0, b"+5", "room", 5),
        (0, b"-0", "room", 0),
        (0, b"0007", "room", 7),
        (0, b"9223372036854775807", "room", I64_MAX),
        (0, b"0" * 40 + b"1", "room", 1),
        (2, b"65535", "port", 65535),
        (2, b"+0", "port", 0),
        (6, b"-9223372036854775808", "rows", I64_MIN),
        (6, b"-3", "rows", -3),
        (12, b"9223372036854775807", "span", I64_MAX),
        (1, b"", "endpoint", ""),
        (8, b"not.a.dtype", "dtype", "not.a.dtype"),
        (4, b"\xff" * 8, "embedding_ptr", U64_MAX),
        (5, b"\x00" * 8, "deepstack_ptr", 0),
    ],
)
def test_number_grammar_accepts(index, value, field, expected):
    assert getattr(TransferInfo.from_frames(with_part(index, value)), field) == expected


@pytest.mark.parametrize(
    "changes, message",
    [
        ({0: b"x", 2: b"99999"}, "room is not an integer"),
        ({0: b"-1", 1: b"\xff"}, "negative room"),
        ({1: b"\xff", 2: b"x"}, "endpoint must be ASCII"),
        ({2: b"99999", 3: b"\xff"}, "invalid port"),
        ({3: b"\xff", 4: b""}, "session must be ASCII"),
        ({4: b"", 5: b""}, "embedding pointer must be 8 bytes"),
        ({5: b"", 6: b"x"}, "deepstack pointer must be 8 bytes"),
        ({6: b"x", 7: b"x"}, "rows is not an integer"),
        ({7: b"\xff", 8: b"\xff"}, "hidden must be ASCII"),
        ({8: b"\xff", 10: b"x"}, "dtype must be ASCII"),
        ({9: b"\xff", 10: b"x"}, "fanout is not an integer"),
        ({11: b"x", 12: b"\xff"}, "row_start is not an integer"),
        ({0: b"\xff", 12: b"x"}, "room must be ASCII"),
    ],
)
def test_transfer_info_checks_in_order(changes, message):
    frames = list(INFO_FRAMES)
    for index, value in changes.items():
        frames[index] = value
    with wire_error(message):
        TransferInfo.from_frames(frames)


def test_too_few_parts_is_reported_before_bad_parts():
    with wire_error("malformed EmbeddingTransferInfo frame: 3 parts < 13"):
        TransferInfo.from_frames([b"x", b"\xff", b"y"])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"room": -1}, "negative room"),
        ({"room": 2**63}, "room is not an integer"),
        ({"port": 65536}, "invalid port"),
        ({"endpoint": "h\u00e9"}, "endpoint must be ASCII"),
        ({"session_id": "\u20ac"}, "session must be ASCII"),
        ({"dtype": b"torch.float32"}, "dtype must be ASCII"),
        ({"embedding_ptr": -1}, "embedding pointer does not fit 8 bytes"),
        ({"deepstack_ptr": 2**64}, "deepstack pointer does not fit 8 bytes"),
        ({"rows": 1.5}, "rows is not an integer"),
        ({"span": 2**63}, "span is not an integer"),
    ],
)
def test_to_frames_refuses_what_the_parser_would_refuse(change, message):
    fields = dict(INFO.__dict__)
    fields.update(change)
    with wire_error(message):
        TransferInfo(**fields).to_frames()


# Our part 13 (docs/protocol.md 8): the receiver's deepstack row bytes, optional.
WIDE = dataclasses.replace(INFO, deepstack_row_bytes=8192)


@little_endian
def test_deepstack_row_bytes_is_part_13_after_the_spec_parts_unchanged():
    assert INFO.deepstack_row_bytes is None and INFO.to_frames() == INFO_FRAMES  # not set: the 13 parts alone
    frames = WIDE.to_frames()
    assert frames == INFO_FRAMES + [b"8192"]  # parts 0-12 byte for byte what a peer reads
    assert TransferInfo.from_frames(frames) == WIDE
    assert TransferInfo.from_frames(tuple(frames)) == WIDE  # the strict path
    assert TransferInfo.from_frames(INFO_FRAMES).deepstack_row_bytes is None  # a peer's ask
    assert TransferInfo.from_frames(frames + [b"junk", b"\xff"]) == WIDE
    assert dataclasses.replace(INFO, deepstack_row_bytes=0).to_frames()[13:] == [b"0"]


@pytest.mark.parametrize("value, expected", [(b"0", 0), (b"96", 96), (b"+96", 96), (b"-0", 0), (b"00096", 96),
                                             (b"9223372036854775807", I64_MAX)])
def test_deepstack_row_bytes_grammar_accepts(value, expected):
    for frames in (INFO_FRAMES + [value], tuple(INFO_FRAMES + [value])):
        assert TransferInfo.from_frames(frames).deepstack_row_bytes == expected


@pytest.mark.parametrize("value", [*NOT_INTEGERS, *NON_ASCII, b"-1", b"-9223372036854775808"])
def test_a_part_13_that_is_no_length_reads_as_absent(value):
    # SPEC.md 4.2: a peer's parts beyond 13 are ignored, whatever they hold.
    for frames in (INFO_FRAMES + [value], tuple(INFO_FRAMES + [value]), INFO_FRAMES + [value, b"more"]):
        info = TransferInfo.from_frames(frames)
        assert info.deepstack_row_bytes is None
        assert dataclasses.replace(info, deepstack_row_bytes=None) == TransferInfo.from_frames(INFO_FRAMES)


def test_deepstack_row_bytes_is_checked_after_the_spec_parts():
    with wire_error("span is not an integer"):
        TransferInfo.from_frames(with_part(12, b"x") + [b"x"])
    with wire_error("span must be ASCII"):
        TransferInfo.from_frames(tuple(with_part(12, b"\xff") + [b"-1"]))


@pytest.mark.parametrize("value, message", [(-1, "negative deepstack row bytes"),
                                            (2**63, "deepstack row bytes is not an integer"),
                                            (1.5, "deepstack row bytes is not an integer"),
                                            ("64", "deepstack row bytes is not an integer")])
def test_to_frames_refuses_a_deepstack_row_bytes_the_parser_would_refuse(value, message):
    with wire_error(message):
        dataclasses.replace(INFO, deepstack_row_bytes=value).to_frames()


ascii_text = st.text(st.characters(max_codepoint=127), max_size=40)
i64 = st.integers(I64_MIN, I64_MAX)
u64 = st.integers(0, U64_MAX)
infos = st.builds(
    TransferInfo,
    room=st.integers(0, I64_MAX),
    endpoint=ascii_text,
    port=st.integers(0, 65535),
    session_id=ascii_text,
    embedding_ptr=u64,
    deepstack_ptr=u64,
    rows=i64,
    hidden=i64,
    dtype=ascii_text,
    has_deepstack=st.booleans(),
    fanout=i64,
    row_start=i64,
    span=i64,
    deepstack_row_bytes=st.none() | st.integers(0, I64_MAX),
)


@given(infos)
def test_transfer_info_round_trip(info):
    frames = info.to_frames()
    assert len(frames) == (13 if info.deepstack_row_bytes is None else 14) and all(type(f) is bytes for f in frames)
    assert frames[:13] == dataclasses.replace(info, deepstack_row_bytes=None).to_frames()
    assert TransferInfo.from_frames(frames) == info
    assert TransferInfo.from_frames(tuple(frames)) == info


@pytest.mark.parametrize("ptr", [0, 1, 0x7FFF_FFFF_FFFF_FFFF, 0x8000_0000_0000_0000, HIGH_PTR, U64_MAX])
def test_full_64_bit_pointers_round_trip(ptr):
    info = TransferInfo(1, "h", 2, "s", ptr, ptr, 1, 1, "torch.int8", True, 1, 0, 1)
    frames = info.to_frames()
    assert frames[4] == ptr.to_bytes(8, sys.byteorder)
    assert TransferInfo.from_frames(frames).embedding_ptr == ptr
    assert TransferInfo.from_frames(frames).deepstack_ptr == ptr


def reference_i64(part: bytes):
    """An independent reading of SPEC.md 4.2's grammar: sign, then ASCII digits, in i64; else None."""
    digits = part[1:] if part[:1] in (b"+", b"-") else part
    if not digits or any(c not in b"0123456789" for c in digits):
        return None
    value = int(digits.decode("ascii")) * (-1 if part[:1] == b"-" else 1)
    return value if I64_MIN <= value <= I64_MAX else None


number_bytes = st.one_of(
    st.binary(max_size=24),
    st.from_regex(rb"\A[ +\-_0-9]{0,22}\Z"),
    i64.map(lambda n: str(n).encode()),
    st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()),
)


@given(number_bytes)
def test_number_grammar_matches_reference(part):
    expected = reference_i64(part)
    frames = with_part(6, part)
    if expected is None:
        with pytest.raises(WireError) as info:
            TransferInfo.from_frames(frames)
        assert str(info.value) in ("rows is not an integer", "rows must be ASCII")
        assert (str(info.value) == "rows must be ASCII") == (not part.isascii())
    else:
        assert TransferInfo.from_frames(frames).rows == expected


@little_endian
def test_registration_golden():
    assert registration_frames("10.0.0.2", 5555, "10.0.0.2:17000", HIGH_PTR, 0) == [
        b"None", b"10.0.0.2", b"5555", b"10.0.0.2:17000", HIGH_PTR_BYTES, b"\x00\x00\x00\x00\x00\x00\x00\x00"]
    assert registration_frames("10.0.0.2", 5555, "10.0.0.2:17000", HIGH_PTR, 0x1000, 4096, 8192) == [
        b"None", b"10.0.0.2", b"5555", b"10.0.0.2:17000", HIGH_PTR_BYTES, b"\x00\x10\x00\x00\x00\x00\x00\x00",
        b"4096", b"8192"]


def test_registration_missing_deepstack_length_is_sent_as_zero():
    frames = registration_frames("h", 1, "s", 16, 0, 4096)
    assert frames[6:] == [b"4096", b"0"]
    assert parse_registration(frames) == Registration("h", 1, "s", 16, 0, 4096, 0)
    with pytest.raises(WireError, match="deepstack length needs an embedding length"):
        registration_frames("h", 1, "s", 16, 0, None, 4096)


@little_endian
def test_parse_registration_golden():
    frames = [b"None", b"10.0.0.2", b"5555", b"10.0.0.2:17000", HIGH_PTR_BYTES, b"\x00\x10" + b"\x00" * 6]
    reg = parse_registration(frames)
    assert reg == Registration("10.0.0.2", 5555, "10.0.0.2:17000", HIGH_PTR, 0x1000)
    assert reg.embedding_len is None and reg.deepstack_len is None and not reg.has_lengths
    assert parse_registration(frames + [b"100"]) == Registration("10.0.0.2", 5555, "10.0.0.2:17000", HIGH_PTR,
                                                                0x1000, 100, None)
    with_lengths = parse_registration(frames + [b"100", b"200", b"ignored", b"\xff"])
    assert (with_lengths.embedding_len, with_lengths.deepstack_len) == (100, 200) and with_lengths.has_lengths
    assert with_lengths.to_frames() == frames + [b"100", b"200"]


def test_is_registration():
    assert is_registration(registration_frames("h", 1, "s", 0, 0))
    assert is_registration([b"None"])
    assert is_registration([bytearray(b"None"), b"x"])
    assert not is_registration([])
    assert not is_registration([b"none", b"h"])
    assert not is_registration([b"None "])
    assert not is_registration(INFO_FRAMES)


REG_FRAMES = [b"None", b"h", b"1", b"s", b"\x00" * 8, b"\x00" * 8]


@pytest.mark.parametrize(
    "frames, message",
    [
        ([], "malformed registration frame: 0 parts < 6"),
        (REG_FRAMES[:5], "malformed registration frame: 5 parts < 6"),
        ([b"7"] + REG_FRAMES[1:], "registration part 0 must be None"),
        (REG_FRAMES[:1] + [b"\xff"] + REG_FRAMES[2:], "endpoint must be ASCII"),
        (REG_FRAMES[:2] + [b"\xff"] + REG_FRAMES[3:], "port must be ASCII"),
        (REG_FRAMES[:2] + [b" 1"] + REG_FRAMES[3:], "port is not an integer"),
        (REG_FRAMES[:2] + [b"65536"] + REG_FRAMES[3:], "invalid port"),
        (REG_FRAMES[:3] + [b"\xff"] + REG_FRAMES[4:], "session must be ASCII"),
        (REG_FRAMES[:4] + [b"\x00"] + REG_FRAMES[5:], "embedding pointer must be 8 bytes"),
        (REG_FRAMES[:5] + [b"\x00" * 9], "deepstack pointer must be 8 bytes"),
        (REG_FRAMES + [b"x"], "embedding length is not an integer"),
        (REG_FRAMES + [b"\xff"], "embedding length must be ASCII"),
        (REG_FRAMES + [b"-1", b"x"], "negative embedding length"),
        (REG_FRAMES + [b"1", b"1_0"], "deepstack length is not an integer"),
        (REG_FRAMES + [b"1", b"-5"], "negative deepstack length"),
        # order: the first bad part wins
        ([b"None", b"\xff", b"x", b"\xff", b"", b""], "endpoint must be ASCII"),
        ([b"None", b"h", b"99999", b"s", b"", b""], "invalid port"),
    ],
)
def test_parse_registration_errors(frames, message):
    with wire_error(message):
        parse_registration(frames)


registrations = st.builds(
    lambda endpoint, port, session, emb, ds, lengths: Registration(endpoint, port, session, emb, ds, *lengths),
    ascii_text, st.integers(0, 65535), ascii_text, u64, u64,
    st.one_of(st.just((None, None)), st.tuples(st.integers(0, I64_MAX), st.integers(0, I64_MAX))),
)


@given(registrations)
def test_registration_round_trip(reg):
    frames = reg.to_frames()
    assert len(frames) == (8 if reg.has_lengths else 6)
    assert is_registration(frames)
    assert parse_registration(frames) == reg


def test_status_golden():
    assert status_frames(7, TransferPoll.Success, 1) == [b"7", b"5", b"1"]
    assert status_frames(0, TransferPoll.Failed, 0) == [b"0", b"0", b"0"]
    assert status_frames(12, 4, 3, (U64_MAX, 0)) == [b"12", b"4", b"3", b"18446744073709551615", b"0"]
    assert status_frames(12, TransferPoll.Success, 3, [42]) == [b"12", b"5", b"3", b"42"]


# Past 4300 digits int() itself refuses a string (sys.get_int_max_str_digits()) with a ValueError, which
# no caller of these parsers catches: the parts below must read as the grammar says, whatever their length.
ZEROS = b"0" * 5000


@pytest.mark.parametrize(
    "parse, expected",
    [
        (lambda: TransferInfo.from_frames(with_part(0, ZEROS + b"7")).room, 7),
        (lambda: TransferInfo.from_frames(with_part(6, b"-" + ZEROS + b"3")).rows, -3),
        (lambda: TransferInfo.from_frames(with_part(12, b"+" + ZEROS)).span, 0),
        (lambda: parse_status([ZEROS + b"9", b"5", b"1", ZEROS + b"18446744073709551615"]),
         (9, TransferPoll.Success, 1, (U64_MAX,))),
        (lambda: parse_registration(REG_FRAMES[:2] + [ZEROS + b"5555"] + REG_FRAMES[3:]).port, 5555),
    ],
)
def test_leading_zeros_past_ints_digit_limit_read_as_the_number(parse, expected):
    assert parse() == expected


@pytest.mark.parametrize(
    "parse, message",
    [
        (lambda: TransferInfo.from_frames(with_part(0, ZEROS + b"9223372036854775808")), "room is not an integer"),
        (lambda: TransferInfo.from_frames(with_part(7, b"-" + ZEROS + b"9223372036854775809")),
         "hidden is not an integer"),
        (lambda: parse_status([ZEROS + b"99999999999999999999", b"5", b"1"]), "room is not an integer"),
        (lambda: parse_status([b"1", b"5", b"1", ZEROS + b"18446744073709551616"]), "checksum is not an integer"),
        (lambda: parse_registration(REG_FRAMES + [ZEROS + b"99999999999999999999"]),
         "embedding length is not an integer"),
    ],
)
def test_leading_zeros_past_ints_digit_limit_out_of_range_are_not_integers(parse, message):
    with wire_error(message):
        parse()


def test_parse_status_golden():
    assert parse_status([b"7", b"5", b"1"]) == (7, TransferPoll.Success, 1, ())
    room, status, rank, sums = parse_status([b"9", b"0", b"2", b"18446744073709551615", b"0", b"extra", b"\xff"])
    assert (room, status, rank, sums) == (9, TransferPoll.Failed, 2, (U64_MAX, 0))
    assert type(status) is TransferPoll
    assert parse_status([b"+3", b"-0", b"-1"]) == (3, TransferPoll.Failed, -1, ())


@pytest.mark.parametrize(
    "frames, message",
    [
        ([], "an EPD status has 3 frames"),
        ([b"1", b"5"], "an EPD status has 3 frames"),
        ([b"x", b"5", b"0"], "room is not an integer"),
        ([b"\xff\xfe", b"5", b"0"], "room is not an integer"),  # not UTF-8
        ([b"\xef\xbc\x97", b"5", b"0"], "room is not an integer"),  # UTF-8 fullwidth 7
        ([b" 7", b"5", b"0"], "room is not an integer"),
        ([b"1_0", b"5", b"0"], "room is not an integer"),
        ([b"", b"5", b"0"], "room is not an integer"),
        ([b"9223372036854775808", b"5", b"0"], "room is not an integer"),
        ([b"-1", b"5", b"0"], "negative room"),
        ([b"1", b"s", b"0"], "status is not an integer"),
        ([b"1", b"\xff", b"0"], "status is not an integer"),
        ([b"1", b"6", b"0"], "unknown status"),
        ([b"1", b"-1", b"0"], "unknown status"),
        ([b"1", b"9223372036854775807", b"0"], "unknown status"),
        ([b"1", b"5", b"r"], "rank is not an integer"),
        ([b"1", b"5", b"\xc3\xa9"], "rank is not an integer"),
        ([b"1", b"5", b"0", b"x"], "checksum is not an integer"),
        ([b"1", b"5", b"0", b"1", b"-1"], "checksum is not an integer"),
        ([b"1", b"5", b"0", b"18446744073709551616"], "checksum is not an integer"),
        ([b"1", b"5", b"0", b""], "checksum is not an integer"),
        # order of checks
        ([b"x", b"x", b"x"], "room is not an integer"),
        ([b"-1", b"x", b"x"], "negative room"),
        ([b"1", b"x", b"x"], "status is not an integer"),
        ([b"1", b"7", b"x"], "unknown status"),
        ([b"1", b"5", b"x", b"x"], "rank is not an integer"),
    ],
)
def test_parse_status_errors(frames, message):
    with wire_error(message):
        parse_status(frames)


@pytest.mark.parametrize(
    "args, message",
    [
        ((-1, TransferPoll.Success, 0), "negative room"),
        ((1, 6, 0), "unknown status"),
        ((1, TransferPoll.Success, 2**63), "rank is not an integer"),
        ((1, TransferPoll.Success, 0, (1, 2, 3)), "at most 2 checksums, got 3"),
        ((1, TransferPoll.Success, 0, (-1,)), "checksum is not an integer"),
        ((1, TransferPoll.Success, 0, (2**64,)), "checksum is not an integer"),
    ],
)
def test_status_frames_refuses(args, message):
    with wire_error(message):
        status_frames(*args)


@given(st.integers(0, I64_MAX), st.sampled_from(list(TransferPoll)), i64, st.lists(u64, max_size=2))
def test_status_round_trip(room, status, rank, checksums):
    frames = status_frames(room, status, rank, checksums)
    assert len(frames) == 3 + len(checksums)
    assert parse_status(frames) == (room, status, rank, tuple(checksums))


frame_lists = st.lists(st.binary(max_size=24), max_size=16)
PARSERS = [TransferInfo.from_frames, parse_registration, parse_status]


def only_wire_errors(parser, frames):
    """Run a parser; anything but success or WireError fails the test."""
    try:
        parser(frames)
    except WireError:
        pass


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(frame_lists)
def test_parsers_on_arbitrary_frames(frames):
    for parser in PARSERS:
        only_wire_errors(parser, frames)
    is_registration(frames)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_parsers_on_mutated_valid_frames(data):
    # Start from valid frames so the fuzz reaches the later parts, not only the first check.
    valid = {
        TransferInfo.from_frames: INFO_FRAMES,
        parse_registration: registration_frames("h", 1, "s", 5, 6, 7, 8),
        parse_status: status_frames(1, TransferPoll.Success, 0, (1, 2)),
    }
    for parser, frames in valid.items():
        frames = list(frames)
        for index in data.draw(st.sets(st.integers(0, len(frames) - 1), max_size=3)):
            frames[index] = data.draw(st.binary(max_size=24))
        frames = frames[: data.draw(st.integers(0, len(frames) + 1))]
        only_wire_errors(parser, frames)


def outcome(parser, frames):
    """('ok', result) or ('error', message): what a parser made of frames."""
    try:
        return "ok", parser(frames)
    except WireError as exc:
        return "error", str(exc)


# Parts near every bound the shortcuts check: digit counts, i64, u64 and u16 limits, leading zeros.
edge_parts = st.one_of(
    st.from_regex(rb"\A[0-9]{1,22}\Z"),
    st.sampled_from([b"0", b"00", b"-0", b"+1", b"65535", b"65536", b"9223372036854775807", b"9223372036854775808",
                     b"18446744073709551615", b"18446744073709551616", b"000000000000000000000001", b"\xff",
                     b"1\n", b"", b"12345678", b"torch.bfloat16"]),
    st.binary(max_size=10),
)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_shortcuts_agree_with_the_strict_parsers(data):
    # A list of bytes may take the shortcut; the same parts as a tuple always parse strictly.
    valid = {
        TransferInfo.from_frames: INFO_FRAMES,
        parse_status: status_frames(1, TransferPoll.Success, 0, (1, 2)),
    }
    for parser, frames in valid.items():
        frames = list(frames)
        for index in data.draw(st.sets(st.integers(0, len(frames) - 1), max_size=3)):
            frames[index] = data.draw(edge_parts)
        frames = frames[: data.draw(st.integers(max(0, len(frames) - 2), len(frames) + 1))]
        assert outcome(parser, frames) == outcome(parser, tuple(frames))


SPAN, HIDDEN, DTYPE = 10, 4096, "torch.bfloat16"


def receiver(i: int, row_start: int, rows: int, fanout: int = 3, **change) -> TransferInfo:
    """A TransferInfo for receiver i of room 7 with the item's geometry unless changed."""
    fields = dict(room=7, endpoint=f"10.0.0.{i}", port=1000 + i, session_id=f"10.0.0.{i}:1700{i}",
                  embedding_ptr=0x1000 * (i + 1), deepstack_ptr=0, rows=rows, hidden=HIDDEN, dtype=DTYPE,
                  has_deepstack=False, fanout=fanout, row_start=row_start, span=SPAN)
    fields.update(change)
    return TransferInfo(**fields)


def sharded(span: int, fanout: int, **change) -> list[TransferInfo]:
    """The shard_rows set of receivers for an item of `span` rows."""
    return [receiver(r, *shard_rows(span, r, fanout), fanout=fanout, span=span, **change) for r in range(fanout)]


def identity(span: int, fanout: int, **change) -> list[TransferInfo]:
    """The identity set: every receiver gets the whole span."""
    return [receiver(r, 0, span, fanout=fanout, span=span, **change) for r in range(fanout)]


@pytest.mark.parametrize("span", [0, 1, 2, 3, 10, 1000])
@pytest.mark.parametrize("fanout", [1, 2, 3, 8])
def test_valid_sets(span, fanout):
    assert validate_fanout(span, HIDDEN, DTYPE, False, identity(span, fanout), fanout) is None
    infos = sharded(span, fanout)
    assert validate_fanout(span, HIDDEN, DTYPE, False, infos, fanout) is None
    assert validate_fanout(span, HIDDEN, DTYPE, False, list(reversed(infos))) is None
    random.Random(span * 31 + fanout).shuffle(infos)
    assert validate_fanout(span, HIDDEN, DTYPE, False, infos, fanout) is None


def test_valid_with_deepstack():
    infos = sharded(SPAN, 3, has_deepstack=True, deepstack_ptr=0x9000)
    assert validate_fanout(SPAN, HIDDEN, DTYPE, True, infos, 3) is None


@given(span=st.integers(0, 5000), fanout=st.integers(1, 16), seed=st.integers(0, 2**32))
def test_shard_rows_sets_always_valid(span, fanout, seed):
    infos = sharded(span, fanout)
    random.Random(seed).shuffle(infos)
    assert validate_fanout(span, HIDDEN, DTYPE, False, infos, fanout) is None


def reason_of(infos, fanout=3, span=SPAN, hidden=HIDDEN, dtype=DTYPE, has_deepstack=False):
    """validate_fanout's reason, which must exist and name the room."""
    reason = validate_fanout(span, hidden, dtype, has_deepstack, infos, fanout)
    assert reason is not None and reason.startswith("room 7: ")
    return reason


def test_count_mismatch():
    reason = reason_of(sharded(SPAN, 3)[:2], fanout=3)
    assert "2 receivers" in reason and "fanout 3" in reason


def test_fanout_field_mismatch():
    infos = sharded(SPAN, 3)
    infos[1] = receiver(1, *shard_rows(SPAN, 1, 3), fanout=4)
    reason = reason_of(infos)
    assert "10.0.0.1:17001" in reason and "fanout 4" in reason and "fanout 3" in reason
    # Without an explicit fanout the count (2) is the fanout every frame must carry.
    assert "fanout 3 != fanout 2" in validate_fanout(SPAN, HIDDEN, DTYPE, False, sharded(SPAN, 3)[:2])


def test_hidden_mismatch_names_everything():
    infos = sharded(SPAN, 3)
    infos[2] = receiver(2, *shard_rows(SPAN, 2, 3), hidden=2048)
    assert reason_of(infos) == "room 7: receiver 10.0.0.2:17002 hidden 2048 != item hidden 4096"


def test_dtype_mismatch():
    reason = reason_of(sharded(SPAN, 3, dtype="torch.float16"))
    assert "dtype" in reason and "torch.float16" in reason and "torch.bfloat16" in reason


def test_span_mismatch():
    infos = sharded(SPAN, 3)
    infos[0] = receiver(0, 0, 4, span=11)
    reason = reason_of(infos)
    assert "span 11 != item span 10" in reason and "10.0.0.0:17000" in reason


def test_deepstack_mismatch():
    assert "deepstack" in reason_of(sharded(SPAN, 3), has_deepstack=True)
    infos = sharded(SPAN, 3)
    infos[1] = receiver(1, *shard_rows(SPAN, 1, 3), has_deepstack=True)
    assert "deepstack True != item deepstack False" in reason_of(infos)


DS_ROW = 2 * HIDDEN * 2  # two deepstack layers of bfloat16


@pytest.mark.parametrize("width", [DS_ROW // 2, DS_ROW + 2, 0])
def test_deepstack_row_bytes_mismatch_names_both(width):
    infos = sharded(SPAN, 3, has_deepstack=True, deepstack_ptr=0x9000, deepstack_row_bytes=DS_ROW)
    infos[1] = dataclasses.replace(infos[1], deepstack_row_bytes=width)
    reason = validate_fanout(SPAN, HIDDEN, DTYPE, True, infos, 3, DS_ROW)
    assert reason == f"room 7: receiver 10.0.0.1:17001 deepstack row bytes {width} != item deepstack row bytes {DS_ROW}"


def test_deepstack_row_bytes_agreeing_or_absent_is_valid():
    agreeing = sharded(SPAN, 3, has_deepstack=True, deepstack_ptr=0x9000, deepstack_row_bytes=DS_ROW)
    assert validate_fanout(SPAN, HIDDEN, DTYPE, True, agreeing, 3, DS_ROW) is None
    # An ask without part 13 (a peer's) is not checked for the width, alone or among ours.
    peers = sharded(SPAN, 3, has_deepstack=True, deepstack_ptr=0x9000)
    assert validate_fanout(SPAN, HIDDEN, DTYPE, True, peers, 3, DS_ROW) is None
    assert validate_fanout(SPAN, HIDDEN, DTYPE, True, [agreeing[0], peers[1], agreeing[2]], 3, DS_ROW) is None
    # Nor without the item's width, or without deepstack on the item (the flag says the rest).
    assert validate_fanout(SPAN, HIDDEN, DTYPE, True, sharded(SPAN, 3, has_deepstack=True,
                                                             deepstack_row_bytes=1), 3) is None
    assert validate_fanout(SPAN, HIDDEN, DTYPE, False, sharded(SPAN, 3, deepstack_row_bytes=0), 3, None) is None


def test_a_deepstack_presence_mismatch_is_reported_before_the_width():
    infos = sharded(SPAN, 3, has_deepstack=False, deepstack_row_bytes=0)
    assert "deepstack False != item deepstack True" in reason_of(infos, has_deepstack=True)


@pytest.mark.parametrize("row_start, rows", [(8, 3), (-1, 4), (0, -1), (10, 1), (11, 0)])
def test_shard_outside_span(row_start, rows):
    infos = sharded(SPAN, 3)
    infos[2] = receiver(2, row_start, rows)
    reason = reason_of(infos)
    assert "outside [0, 10)" in reason and "10.0.0.2:17002" in reason


def test_duplicate_session():
    infos = sharded(SPAN, 3)
    infos[2] = receiver(2, *shard_rows(SPAN, 2, 3), session_id=infos[0].session_id)
    reason = reason_of(infos)
    assert "twice" in reason and "10.0.0.0:17000" in reason


def test_other_room():
    infos = sharded(SPAN, 3)
    infos[1] = receiver(1, *shard_rows(SPAN, 1, 3), room=8)
    assert "is for room 8" in reason_of(infos)


def test_gap_between_shards():
    infos = [receiver(0, 0, 3), receiver(1, 5, 5), receiver(2, 3, 0)]
    reason = reason_of(infos)
    assert "[3, 5)" in reason and "no receiver" in reason


def test_overlap():
    reason = reason_of([receiver(0, 0, 5), receiver(1, 4, 3), receiver(2, 7, 3)])
    assert "overlap" in reason and "[4, 5)" in reason and "10.0.0.0:17000" in reason and "10.0.0.1:17001" in reason


def test_mixed_identity_and_shards_overlap():
    reason = reason_of([receiver(0, 0, SPAN), receiver(1, 4, 3), receiver(2, 7, 3)])
    assert "overlap" in reason


def test_empty_set():
    assert validate_fanout(SPAN, HIDDEN, DTYPE, False, []) is not None


BASE, REGION = 0x7F00_0000_0000, 10 * 4096


def region_info(ptr: int, rows: int, deepstack_ptr: int = 0, has_deepstack: bool = False,
                session_id: str = "10.0.0.5:17005") -> TransferInfo:
    """A TransferInfo of room 7 writing `rows` rows to `ptr`."""
    return TransferInfo(7, "h", 1, session_id, ptr, deepstack_ptr, rows, 2048, DTYPE, has_deepstack, 1, 0, rows)


REG = Registration("h", 1, "10.0.0.5:17005", BASE, BASE + 0x100_0000, REGION, 3 * REGION)


@pytest.mark.parametrize(
    "ptr, rows",
    [(BASE, 10), (BASE, 1), (BASE + 9 * 4096, 1), (BASE + 4096, 9), (BASE, 0), (0, 0), (BASE + REGION, 0)],
)
def test_region_inside(ptr, rows):
    assert check_region(region_info(ptr, rows), REG, 4096, 3 * 4096) is None


@pytest.mark.parametrize(
    "ptr, rows",
    [(BASE, 11), (BASE + 1, 10), (BASE - 1, 1), (BASE + REGION, 1), (BASE + 9 * 4096 + 1, 1), (0, 1), (BASE, -1),
     (HIGH_PTR, 1)],
)
def test_region_outside(ptr, rows):
    reason = check_region(region_info(ptr, rows), REG, 4096, 3 * 4096)
    assert reason is not None
    assert reason.startswith("room 7: receiver 10.0.0.5:17005 embedding range")
    assert f"{ptr:#x}" in reason and f"[{BASE:#x}, {BASE + REGION:#x})" in reason


def test_region_without_lengths_is_not_checked():
    reg = Registration("h", 1, "10.0.0.5:17005", BASE, 0)
    assert check_region(region_info(0, 1000, has_deepstack=True), reg, 4096, 4096) is None


def test_region_deepstack():
    ds_base = REG.deepstack_base
    fits = region_info(BASE, 10, ds_base, has_deepstack=True)
    assert check_region(fits, REG, 4096, 3 * 4096) is None
    over = region_info(BASE, 10, ds_base + 1, has_deepstack=True)
    reason = check_region(over, REG, 4096, 3 * 4096)
    assert reason is not None and "deepstack range" in reason
    # Deepstack ranges are not checked for an item without deepstack.
    assert check_region(region_info(BASE, 10, 0, has_deepstack=False), REG, 4096, 3 * 4096) is None
    # A registration whose deepstack length is 0 (none registered) refuses any deepstack write.
    no_ds = Registration("h", 1, "s", BASE, 0, REGION, 0)
    assert "deepstack" in check_region(region_info(BASE, 1, 0, has_deepstack=True), no_ds, 4096, 4096)
    # The embedding range is reported first.
    both = region_info(BASE + 1, 10, ds_base + 1, has_deepstack=True)
    assert "embedding range" in check_region(both, REG, 4096, 3 * 4096)


#: A session id a hostile peer might send: lines that would forge log entries, an escape
#: that would clear a terminal, and far more text than any failure reason should carry.
HOSTILE_SESSION = "10.0.0.9:17009\n2026-12-04 INFO transfer: room 7 Success\x1b[2J" + "s" * 30_000


def _hostile(i: int, row_start: int, rows: int, **change) -> TransferInfo:
    return receiver(i, row_start, rows, session_id=f"{HOSTILE_SESSION}{i}", **change)


_HOSTILE_REASONS = {
    "a mismatch": lambda: reason_of([*sharded(SPAN, 3)[:2], _hostile(2, *shard_rows(SPAN, 2, 3), hidden=2048)]),
    "asked twice": lambda: reason_of([receiver(0, 0, 4, session_id=HOSTILE_SESSION), receiver(1, 4, 3),
                                      receiver(2, 7, 3, session_id=HOSTILE_SESSION)]),
    "an overlap": lambda: reason_of([_hostile(0, 0, 5), _hostile(1, 4, 3), receiver(2, 7, 3)]),
    "a gap": lambda: reason_of([receiver(0, 0, 3), _hostile(1, 5, 5), receiver(2, 3, 0)]),
    "a region": lambda: check_region(region_info(BASE, 11, session_id=HOSTILE_SESSION), REG, 4096, 3 * 4096),
}


@pytest.mark.parametrize("reason", _HOSTILE_REASONS.values(), ids=_HOSTILE_REASONS.keys())
def test_a_reason_quotes_a_receivers_session_id_printable_and_cut(reason):
    text = reason()
    assert "10.0.0.9:17009?2026-12-04 INFO" in text
    assert text.isprintable()
    assert len(text) < MAX_REASON_BYTES


@pytest.mark.parametrize("rank, tp, dp, message", [
    (0, 4, 3, "tp size 4 is not a multiple of dp size 3"),
    (0, 4, 0, r"dp size must be at least 1, not 0 \(tp size: "),
    (0, 0, 1, "tp size must be at least 1, not 0"),
    (0, -4, 2, "tp size must be at least 1, not -4"),
    (4, 4, 1, r"engine rank 4 outside \[0, tp size 4\)"),
    (-1, 4, 2, r"engine rank -1 outside \[0, tp size 4\)"),
])
def test_check_parallel_refuses(rank, tp, dp, message):
    from transfer.frames import check_parallel

    with pytest.raises(ValueError, match=message):
        check_parallel(rank, tp, dp)


def test_check_parallel_and_check_room_accept_the_valid():
    from transfer.frames import check_parallel, check_room

    assert check_parallel(3, 4, 2) == (3, 4, 2)
    check_room(0)
    check_room(I64_MAX)
    with pytest.raises(ValueError, match="does not fit"):
        check_room(I64_MAX + 1)


def test_integer_scalars_become_plain_ints_and_other_kinds_are_refused():
    # A tensor or numpy scalar kept as given would key a room's books by identity, not by its number.
    import numpy
    import torch

    from transfer.errors import ConfigTypeError
    from transfer.frames import check_parallel, check_room

    for scalar in (torch.tensor(6), numpy.int64(6)):
        room = check_room(scalar)
        assert type(room) is int and room == 6
    assert [type(v) for v in check_parallel(torch.tensor(1), numpy.int32(4), 2)] == [int, int, int]
    for args in ((0, 1.0, 1), (True, 2, 1), (0, 2, 1.0)):
        with pytest.raises(ConfigTypeError, match=r"must be an int, got (float|bool)"):
            check_parallel(*args)
    with pytest.raises(ConfigTypeError, match="room must be an int, got float 2.0"):
        check_room(2.0)


def test_scalar_ints_turns_each_integer_scalar_into_a_plain_int_and_leaves_the_rest():
    import numpy
    import torch

    from transfer.frames import scalar_ints

    rows = torch.zeros(2, 3)
    plain = scalar_ints(4, None, 0)
    assert plain == (4, None, 0)
    mixed = scalar_ints(numpy.int64(5), 7, None, torch.tensor(3), rows, True, 2.5)
    assert [type(v) for v in mixed[:4]] == [int, int, type(None), int] and mixed[:4] == (5, 7, None, 3)
    assert mixed[4] is rows and mixed[5] is True and mixed[6] == 2.5


def test_numpy_and_torch_bools_are_refused_as_numbers_whatever_numpy_indexes_them_as():
    # numpy before 2.3 (with a DeprecationWarning) and torch both index a bool scalar as 0 or 1.
    import warnings

    import numpy
    import torch

    from transfer.errors import ConfigTypeError
    from transfer.frames import check_parallel, check_room, scalar_ints

    bools = (numpy.bool_(True), numpy.bool_(False), torch.tensor(True), torch.tensor([True]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no index taken of a numpy bool, on any numpy
        for value in bools:
            with pytest.raises(ConfigTypeError, match=r"^room must be an int, got "):
                check_room(value)
            with pytest.raises(ConfigTypeError, match=r"^tp size must be an int, got "):
                check_parallel(0, value, 1)
            assert scalar_ints(value, numpy.int64(2))[0] is value  # left for the size checks to refuse

"""The codecs' shortcuts for the common case agree with the strict codecs: same parts, values, types and errors."""

from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
import pickle
import sys

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transfer.frames import (
    CancelAnswer,
    FAILURE_MARKER,
    Registration,
    TransferInfo,
    WireError,
    _checked_status_frames,
    _outside,
    _receiver_mismatch,
    _tiling_gap,
    cancel_frames,
    cancel_reply_frames,
    check_region,
    is_cancel,
    is_registration,
    parse_cancel_reply,
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

INFO = TransferInfo(123456, "10.0.0.12", 17001, "10.0.0.12:15432", 0x7F00_1234_0000, 0xFFFF_FFFF_FFFF_F000,
                    512, 4096, "torch.bfloat16", True, 4, 1024, 2048)
ASK = INFO.to_frames()
WIDE_ASK = dataclasses.replace(INFO, deepstack_row_bytes=16384).to_frames()  # with our part 13
NUMBER_INDEXES = (0, 2, 6, 7, 10, 11, 12)


def typed(value):
    """A value with the types of everything in it, so that True and 1, or 5 and Success, differ."""
    if dataclasses.is_dataclass(value):
        return type(value), tuple(typed(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, tuple):
        return tuple, tuple(typed(v) for v in value)
    if isinstance(value, list):
        return list, tuple(typed(v) for v in value)
    return type(value), value


def outcome(call, *args):
    """('ok', typed result) or ('error', exception type, message): what a codec made of its input."""
    try:
        return "ok", typed(call(*args))
    except WireError as exc:
        return "error", type(exc), str(exc)


class Code(enum.IntEnum):
    """Another IntEnum, whose members the strict encoders take as their int values."""

    five = 5


class Text(str):
    """A str subclass: the shortcuts leave it to the strict encoders."""


# Parts at every bound the shortcuts check: digit counts, i64, u64 and u16 limits, signs, leading zeros.
number_parts = st.one_of(
    st.from_regex(rb"\A[0-9]{1,22}\Z"),
    st.from_regex(rb"\A[ +\-_0-9]{0,22}\Z"),
    st.sampled_from([
        b"0", b"00", b"-0", b"+0", b"+1", b"-1", b"65535", b"65536", b"0065535", b"9223372036854775807",
        b"09223372036854775807", b"9223372036854775808", b"-9223372036854775808", b"18446744073709551615",
        b"18446744073709551616", b"99999999999999999999", b"000000000000000000000001",
        b"0000000000000000000000000000009223372036854775807", b"1" * 4400, b"\xff", b"\xd9\xa3", b"1\n", b" 1",
        b"1_0", b"", b"12345678", b"None", b"Cancel", b"failure", FAILURE_MARKER, CancelAnswer.CONFIRMED.value,
    ]),
    st.binary(max_size=10),
)
text_parts = st.one_of(
    st.sampled_from([b"", b"10.0.0.12", b"caf\xc3\xa9", b"\xff", b"\x00", b"\x7f"]),
    st.binary(max_size=12),
)
pointer_parts = st.one_of(st.binary(min_size=7, max_size=9), st.binary(min_size=8, max_size=8))
buffer_types = st.sampled_from([bytes, bytearray, memoryview, zmq.Frame])


def near_ask(data, flags=text_parts, fewest: int = 10) -> list:
    """An ask's parts (ours or a peer's), up to four of them drawn at their bounds (part 9 from `flags`), cut
    to `fewest` to 15 parts and given up to two more: what the shortcuts must take exactly as the strict parser."""
    frames = list(data.draw(st.sampled_from([ASK, WIDE_ASK])))
    for index in data.draw(st.sets(st.integers(0, len(frames) - 1), max_size=4)):
        if index in NUMBER_INDEXES or index == 13:
            frames[index] = data.draw(number_parts)
        elif index in (4, 5):
            frames[index] = data.draw(pointer_parts)
        else:
            frames[index] = data.draw(flags if index == 9 else text_parts)
    return frames[: data.draw(st.integers(fewest, 15))] + [b"7"] * data.draw(st.integers(0, 2))


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(st.data())
def test_transfer_info_shortcut_agrees_with_the_strict_parser(data):
    # A list of bytes may take the shortcut; the same parts as a tuple always parse strictly.
    frames = near_ask(data)
    assert outcome(TransferInfo.from_frames, frames) == outcome(TransferInfo.from_frames, tuple(frames))


@given(st.lists(st.integers(0, 13), max_size=3), buffer_types)
def test_transfer_info_from_other_buffer_types_parses_as_bytes(indexes, wrap):
    frames = list(WIDE_ASK)
    for index in indexes:
        frames[index] = wrap(frames[index])
    assert outcome(TransferInfo.from_frames, frames) == outcome(TransferInfo.from_frames, tuple(WIDE_ASK))


@pytest.mark.parametrize("deepstack", [b"1", b"0", b"", b"01", b"true"])
def test_deepstack_flag_is_true_only_for_1_on_both_paths(deepstack):
    frames = ASK[:9] + [deepstack] + ASK[10:]
    assert TransferInfo.from_frames(frames).has_deepstack is (deepstack == b"1")
    assert outcome(TransferInfo.from_frames, frames) == outcome(TransferInfo.from_frames, tuple(frames))


@pytest.mark.parametrize("count", [0, 3, 12, 14, 15])
def test_part_counts_other_than_13(count):
    frames = (ASK * 2)[:count]
    assert outcome(TransferInfo.from_frames, frames) == outcome(TransferInfo.from_frames, tuple(frames))


@pytest.mark.parametrize("width", [b"0", b"16384", b"9223372036854775807", b"9223372036854775808", b"-1", b"+1",
                                   b"", b" 1", b"\xff", b"1" * 4400, b"0" * 30 + b"7"])
def test_part_13_agrees_on_both_paths(width):
    frames = ASK + [width]
    assert outcome(TransferInfo.from_frames, frames) == outcome(TransferInfo.from_frames, tuple(frames))


def test_a_parsed_transfer_info_is_an_ordinary_frozen_instance():
    parsed = TransferInfo.from_frames(ASK)
    assert type(parsed) is TransferInfo
    assert parsed == INFO and hash(parsed) == hash(INFO) and repr(parsed) == repr(INFO)
    assert typed(parsed) == typed(INFO)
    assert list(vars(parsed)) == [f.name for f in dataclasses.fields(TransferInfo)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.room = 8  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(parsed)) == INFO
    assert copy.copy(parsed) == INFO and copy.deepcopy(parsed) == INFO
    assert dataclasses.replace(parsed, room=8) == dataclasses.replace(INFO, room=8)
    assert dataclasses.asdict(parsed) == dataclasses.asdict(INFO)
    assert {parsed: 1}[INFO] == 1
    assert parsed.is_identity is False and parsed.receiver == INFO.session_id
    assert parsed.row_bytes() == INFO.row_bytes() == 4096 * 2


def test_init_takes_every_field_in_order():
    names = [f.name for f in dataclasses.fields(TransferInfo)]
    assert list(inspect.signature(TransferInfo).parameters) == names
    values = list(range(len(names)))
    built = TransferInfo(*values)
    assert vars(built) == dict(zip(names, values)) == vars(TransferInfo(**dict(zip(names, values))))
    assert TransferInfo(*values[:-1]).deepstack_row_bytes is None  # the optional part 13 defaults to unsent
    with pytest.raises(TypeError):
        TransferInfo(*values[:-2])  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        TransferInfo(*values, 14)  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del built.room  # type: ignore[misc]


def test_a_subclass_parses_to_its_own_type():
    class Ask(TransferInfo):
        """A subclass whose construction must stay its own."""

    parsed = Ask.from_frames(ASK)
    assert type(parsed) is Ask and typed(parsed)[1] == typed(INFO)[1]


# Field values at every bound to_frames' shortcut checks, and the types it leaves to the strict encoders.
int_values = st.one_of(
    st.integers(I64_MIN, I64_MAX),
    st.sampled_from([0, -1, 1, 65535, 65536, I64_MAX, I64_MAX + 1, I64_MIN, I64_MIN - 1, U64_MAX, U64_MAX + 1,
                     True, False, Code.five, TransferPoll.Success, 1.0, None, "1", b"1"]),
)
str_values = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "10.0.0.12", "café", "\x00", "\x7f", Text("subclass"), b"bytes", 5, None]),
)
FIELD_VALUES = {"room": int_values, "port": int_values, "embedding_ptr": int_values, "deepstack_ptr": int_values,
                "rows": int_values, "hidden": int_values, "fanout": int_values, "row_start": int_values,
                "span": int_values, "deepstack_row_bytes": int_values, "endpoint": str_values,
                "session_id": str_values, "dtype": str_values,
                "has_deepstack": st.sampled_from([True, False, 0, 1, 2, "", "x", None])}


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(st.data())
def test_to_frames_shortcut_agrees_with_the_strict_encoders(data):
    names = data.draw(st.sets(st.sampled_from(sorted(FIELD_VALUES)), max_size=4))
    info = dataclasses.replace(INFO, **{name: data.draw(FIELD_VALUES[name]) for name in names})
    assert outcome(info.to_frames) == outcome(info._checked_frames)


INT_EDGES = [0, -1, 1, 65535, 65536, I64_MAX, I64_MAX + 1, I64_MIN, I64_MIN - 1, U64_MAX, U64_MAX + 1, True, False,
             Code.five, 1.0, None, "1"]
STR_EDGES = ["", "10.0.0.12", "café", "\x00", "\x7f", Text("subclass"), b"bytes", 5, None]


@pytest.mark.parametrize("name", sorted(FIELD_VALUES))
def test_to_frames_shortcut_agrees_at_every_field_bound(name):
    edges = STR_EDGES if name in ("endpoint", "session_id", "dtype") else INT_EDGES
    for value in edges:
        info = dataclasses.replace(INFO, **{name: value})
        assert outcome(info.to_frames) == outcome(info._checked_frames), (name, value)


@pytest.mark.parametrize("checksums", [(), (0,), (U64_MAX,), (U64_MAX + 1,), (-1,), (1, U64_MAX + 1), (1, -1),
                                       (True,), (1.0,), (None,), (1, 2, 3), [1, 2]])
@pytest.mark.parametrize("room, status, rank", [
    (0, TransferPoll.Failed, 0), (I64_MAX, 5, I64_MIN), (I64_MAX + 1, 5, 0), (-1, 5, 0), (1, 5, I64_MAX + 1),
    (1, 5, I64_MIN - 1), (1, 6, 0), (1, -1, 0), (1, True, 0), (1, Code.five, 0), (True, 5, 0), (1, 5, False),
    (1, 5.0, 0), (1, None, 0),
])
def test_status_frames_shortcut_agrees_at_every_bound(room, status, rank, checksums):
    for reason in (None, ("send_failed", "peer gone")):
        assert (outcome(status_frames, room, status, rank, checksums, reason)
                == outcome(_checked_status_frames, room, status, rank, checksums, reason))


def test_to_frames_golden_on_the_shortcut():
    assert ASK[:4] == [b"123456", b"10.0.0.12", b"17001", b"10.0.0.12:15432"]
    assert ASK[4] == (0x7F00_1234_0000).to_bytes(8, sys.byteorder)
    assert ASK[5] == (0xFFFF_FFFF_FFFF_F000).to_bytes(8, sys.byteorder)
    assert ASK[6:] == [b"512", b"4096", b"torch.bfloat16", b"1", b"4", b"1024", b"2048"]
    assert all(type(part) is bytes for part in ASK)
    assert WIDE_ASK == ASK + [b"16384"]


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(int_values, st.one_of(st.sampled_from(list(TransferPoll)), int_values), int_values,
       st.one_of(st.lists(st.one_of(st.integers(0, U64_MAX), int_values), max_size=3).map(tuple),
                 st.lists(st.integers(0, U64_MAX), max_size=2)),
       st.sampled_from([None, ("send_failed", "peer gone")]))
def test_status_frames_shortcut_agrees_with_the_strict_encoders(room, status, rank, checksums, reason):
    assert (outcome(status_frames, room, status, rank, checksums, reason)
            == outcome(_checked_status_frames, room, status, rank, checksums, reason))


@pytest.mark.parametrize(("args", "parts"), [
    ((7, TransferPoll.Success, 0, (1, U64_MAX)), [b"7", b"5", b"0", b"1", b"18446744073709551615"]),
    ((I64_MAX, TransferPoll.Transferring, -3), [b"9223372036854775807", b"4", b"-3"]),
    ((0, 0, I64_MIN, (0,)), [b"0", b"0", b"-9223372036854775808", b"0"]),
])
def test_status_frames_golden_on_the_shortcut(args, parts):
    frames = status_frames(*args)
    assert frames == parts and all(type(part) is bytes for part in frames)


status_parts = st.one_of(number_parts, st.sampled_from([b"0", b"1", b"5", b"6", b"-5", b"05"]))


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(st.data())
def test_parse_status_shortcut_agrees_with_the_strict_parser(data):
    frames = list(status_frames(1, TransferPoll.Success, 0, (1, 2)))
    for index in data.draw(st.sets(st.integers(0, 4), max_size=3)):
        frames[index] = data.draw(status_parts)
    frames = frames[: data.draw(st.integers(0, 5))] + [data.draw(status_parts)] * data.draw(st.integers(0, 2))
    assert outcome(parse_status, frames) == outcome(parse_status, tuple(frames))
    assert outcome(parse_cancel_reply, frames) == outcome(parse_cancel_reply, tuple(frames))


@given(st.integers(0, 4), buffer_types)
def test_parse_status_of_other_buffer_types_parses_as_bytes(index, wrap):
    frames = status_frames(1, TransferPoll.Success, 0, (1, 2))
    wrapped = list(frames)
    wrapped[index] = wrap(wrapped[index])
    assert outcome(parse_status, wrapped) == outcome(parse_status, frames)


@pytest.mark.parametrize("frames", [
    [b"1", b"5", b"0", b"18446744073709551615", b"18446744073709551616"],
    [b"1", b"0", b"0", FAILURE_MARKER, b"send_failed", b"peer gone"],
    [b"1", b"0", b"0", FAILURE_MARKER],
    [b"+1", b"5", b"0"],
    [b"1", b"5", b"+0"],
    [b"9223372036854775808", b"5", b"0"],
    [b"0009223372036854775807", b"5", b"0"],
    [b"1", b"", b"0"],
    [b"1", b"5", b"0", b""],
])
def test_parse_status_edges(frames):
    assert outcome(parse_status, frames) == outcome(parse_status, tuple(frames))


@pytest.mark.parametrize("frames", [
    cancel_reply_frames(7, 1, CancelAnswer.CONFIRMED),
    cancel_reply_frames(7, 1, CancelAnswer.TOO_LATE),
    [b"7", b"5", b"1", CancelAnswer.CONFIRMED.value],
    [b"7", b"0", b"1", b"12"],
    [b"7", b"0", b"1", zmq.Frame(CancelAnswer.TOO_LATE.value)],
    [b"7", b"0", b"1", CancelAnswer.TOO_LATE.value, b"extra"],
    [b"7", b"0", b"1"],
    [],
])
def test_parse_cancel_reply_agrees_on_lists_and_tuples(frames):
    assert outcome(parse_cancel_reply, frames) == outcome(parse_cancel_reply, tuple(frames))


@pytest.mark.parametrize("frames", [
    ASK,
    registration_frames("h", 1, "s", 5, 6),
    cancel_frames(1, "h", 1, "s"),
    [b"None"],
    [b"Cancel"],
    [bytearray(b"None")],
    [memoryview(b"Cancel")],
    [zmq.Frame(b"None")],
    [zmq.Frame(b"Cancel")],
    [b"none"],
    [b""],
    [],
    ["None"],
])
def test_request_kinds_agree_on_lists_and_tuples(frames):
    assert is_registration(frames) is is_registration(tuple(frames))
    assert is_cancel(frames) is is_cancel(tuple(frames))


def rule_by_rule(span, hidden, dtype, has_deepstack, infos, fanout, deepstack_row_bytes=None):
    """SPEC.md 6 read one rule at a time: count, each receiver in order, duplicates, identity, tiling."""
    room = infos[0].room
    if len(infos) != fanout:
        return f"room {room}: {len(infos)} receivers != fanout {fanout}"
    for info in infos:
        reason = _receiver_mismatch(info, room, fanout, span, hidden, dtype, has_deepstack, deepstack_row_bytes)
        if reason is not None:
            return f"room {room}: receiver {info.session_id} {reason}"
    sessions = [info.session_id for info in infos]
    for index, session in enumerate(sessions):
        if session in sessions[:index]:
            return f"room {room}: receiver {session} asked twice"
    if all(info.is_identity for info in infos):
        return None
    return _tiling_gap(room, infos)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(st.data())
def test_validate_fanout_agrees_with_the_rules_read_one_at_a_time(data):
    span = data.draw(st.integers(0, 12))
    fanout = data.draw(st.integers(1, 4))
    identity = data.draw(st.booleans())
    infos = [TransferInfo(5, "h", 1, f"s{r}", 0, 0, span if identity else shard_rows(span, r, fanout)[1], 64,
                          "torch.int8", False, fanout, 0 if identity else shard_rows(span, r, fanout)[0], span)
             for r in range(fanout)]
    for _ in range(data.draw(st.integers(0, 3))):
        index = data.draw(st.integers(0, fanout - 1))
        name = data.draw(st.sampled_from(["room", "fanout", "hidden", "dtype", "span", "has_deepstack", "rows",
                                          "row_start", "session_id", "deepstack_row_bytes"]))
        value = {"dtype": data.draw(st.sampled_from(["torch.int8", "torch.uint8"])),
                 "session_id": data.draw(st.sampled_from(["s0", "s1", "s9"])),
                 "has_deepstack": data.draw(st.sampled_from([False, True, 0, 1, None])),
                 "deepstack_row_bytes": data.draw(st.sampled_from([None, 0, 64, 128]))}.get(
                     name, data.draw(st.integers(-2, 14)))
        infos[index] = dataclasses.replace(infos[index], **{name: value})
    if fanout > 1 and data.draw(st.booleans()):
        infos[-1] = dataclasses.replace(infos[-1], session_id=infos[0].session_id)
    infos = data.draw(st.permutations(infos))
    deepstack = data.draw(st.sampled_from([False, True, 0, 1]))
    width = data.draw(st.sampled_from([None, 64, 128]))
    assert (validate_fanout(span, 64, "torch.int8", deepstack, infos, fanout, width)
            == rule_by_rule(span, 64, "torch.int8", deepstack, infos, fanout, width))


def _check_room_strictly(room):
    """check_room() as it reads without its shortcut: every value through _integer() and the range checks."""
    from transfer.errors import ConfigError
    from transfer.frames import _integer

    room = _integer("room", room)
    if room < 0:
        raise ConfigError(f"negative room {room}")
    if room > I64_MAX:
        raise ConfigError(f"room {room} does not fit the wire's signed 64 bits")
    return room


def _outcome(call, value):
    """What `call(value)` gives: its result and type, or its refusal's type and text."""
    try:
        result = call(value)
    except Exception as exc:  # noqa: BLE001 - the refusal is compared, type and text
        return "error", type(exc), str(exc)
    return "ok", type(result), result


ROOM_EDGES = [0, 1, -1, I64_MAX, I64_MAX + 1, I64_MIN, U64_MAX, True, False, Code.five, 1.0, None, "1", b"1"]


@given(st.one_of(st.integers(I64_MIN - 1, U64_MAX + 1), st.sampled_from(ROOM_EDGES)))
def test_check_room_shortcut_agrees_with_the_strict_checks(room):
    from transfer.frames import check_room

    assert _outcome(check_room, room) == _outcome(_check_room_strictly, room)


def test_check_room_shortcut_agrees_on_numpy_and_torch_scalars():
    import numpy
    import torch

    from transfer.frames import check_room

    for room in (numpy.int64(7), numpy.int32(-1), numpy.uint64(U64_MAX), torch.tensor(5), torch.tensor(-5),
                 numpy.float64(1.0), numpy.bool_(True)):
        assert _outcome(check_room, room) == _outcome(_check_room_strictly, room), room


def _check_region_strictly(info, registration, row_bytes, deepstack_row_bytes):
    """check_region() as it reads without its shortcut: each range through _outside()."""
    if registration.embedding_len is not None:
        reason = _outside("embedding", info.embedding_ptr, info.rows * row_bytes,
                          registration.embedding_base, registration.embedding_len)
        if reason is not None:
            return f"room {info.room}: receiver {info.session_id} {reason}"
    if info.has_deepstack and registration.deepstack_len is not None:
        reason = _outside("deepstack", info.deepstack_ptr, info.rows * deepstack_row_bytes,
                          registration.deepstack_base, registration.deepstack_len)
        if reason is not None:
            return f"room {info.room}: receiver {info.session_id} {reason}"
    return None


_EDGES = st.one_of(st.integers(-3, 3), st.sampled_from([4096 - 1, 4096, 4096 + 1, 8192]), st.integers(-2**64, 2**64))


@settings(max_examples=500)
@given(ptr=_EDGES, rows=st.integers(-2, 3), row_bytes=st.sampled_from([0, 1, 1024, 4096]), base=_EDGES,
       length=st.one_of(st.none(), _EDGES), deepstack=st.booleans(), deepstack_ptr=_EDGES,
       deepstack_len=st.one_of(st.none(), _EDGES))
def test_check_region_agrees_with_each_range_read_through_outside(ptr, rows, row_bytes, base, length, deepstack,
                                                                 deepstack_ptr, deepstack_len):
    info = TransferInfo(7, "h", 1, "s:1", ptr, deepstack_ptr, rows, 64, "torch.int8", deepstack, 1, 0, max(rows, 0))
    registration = Registration("h", 1, "s:1", base, 0, length, deepstack_len)
    assert (check_region(info, registration, row_bytes, 2 * row_bytes)
            == _check_region_strictly(info, registration, row_bytes, 2 * row_bytes))


def _normalize_dtype_strictly(dtype):
    """normalize_dtype() as its rules read, with no names filed."""
    from transfer.errors import ConfigError
    from transfer.frames import DTYPE_BYTES, _dtype_name

    name = _dtype_name(dtype)
    if name is None:
        raise ConfigError(f"unknown dtype {dtype!r}: the wire carries only "
                          f"{', '.join(n.removeprefix('torch.') for n in DTYPE_BYTES)} (a torch.dtype, or its name "
                          f"with or without 'torch.')")
    return name


def _torch_dtypes():
    import torch

    return sorted({value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str)


@given(st.data())
def test_normalize_dtype_of_a_torch_dtype_taken_before_agrees_with_the_rules(data):
    """The names filed for torch dtypes taken before: every torch dtype (known to the wire or not, first
    taken or again), its names as strings, and what is no dtype, in any order, as the rules read them."""
    import numpy

    from transfer.frames import normalize_dtype

    torch_dtypes = _torch_dtypes()
    others = [*(str(t) for t in torch_dtypes), *(str(t).removeprefix("torch.") for t in torch_dtypes), None, 2,
              [1], {}, numpy.dtype("float16"), numpy.float16, Text("bfloat16"), "float16x"]
    for dtype in data.draw(st.lists(st.sampled_from([*torch_dtypes, *others]), max_size=40)):
        assert _outcome(normalize_dtype, dtype) == _outcome(_normalize_dtype_strictly, dtype), dtype


# Texts equal in value but separate str objects, so that a reuse of the last encoded bytes keyed on
# anything but the very objects would send another ask's endpoint, session or dtype.
ENDPOINTS = ["10.0.0.12", "".join(["10.0.0.", "13"]), "".join(["10.0.0.", "13"]), "café", Text("10.0.0.12")]
SESSIONS = ["10.0.0.12:15432", "".join(["10.0.0.12:", "15433"]), "".join(["10.0.0.12:", "15433"]), "\x7f"]
DTYPES = ["torch.bfloat16", "".join(["torch.", "float16"]), "".join(["torch.", "float16"]), "bfloat16"]


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(st.lists(st.tuples(st.sampled_from(range(len(ENDPOINTS))), st.sampled_from(range(len(SESSIONS))),
                          st.sampled_from(range(len(DTYPES)))), min_size=1, max_size=8))
def test_to_frames_agrees_with_the_strict_encoders_ask_after_ask(asks):
    # to_frames() reuses the bytes of the texts it encoded last: each ask still carries its own.
    for endpoint, session, dtype in asks:
        info = dataclasses.replace(INFO, endpoint=ENDPOINTS[endpoint], session_id=SESSIONS[session],
                                   dtype=DTYPES[dtype])
        assert outcome(info.to_frames) == outcome(info._checked_frames)


@pytest.mark.parametrize("row_start, rows", [(-1, 3), (0, -1), (3, 2), (-2, -1)])
def test_validate_fanout_names_a_shard_outside_the_item_as_the_rules_read_one_at_a_time_do(row_start, rows):
    infos = [TransferInfo(5, "h", 1, "s0", 0, 0, 2, 64, "torch.int8", False, 2, 0, 4),
             TransferInfo(5, "h", 1, "s1", 0, 0, rows, 64, "torch.int8", False, 2, row_start, 4)]
    reason = validate_fanout(4, 64, "torch.int8", False, infos, 2)
    assert reason == rule_by_rule(4, 64, "torch.int8", False, infos, 2, None) and "outside [0, 4)" in reason

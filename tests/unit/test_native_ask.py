"""native/ask.c's plain ask parse (what `_io.take_asks` reads an encode rank's asks with) agrees with
TransferInfo's plain-case parser, `_from_plain_frames`: it accepts exactly the same parts, with the same
values and types. Reading them off a real socket: tests/live/test_ask_intake.py."""

from __future__ import annotations

import dataclasses
import gc
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_frames_shortcuts import ASK, NUMBER_INDEXES, WIDE_ASK, near_ask, typed

from transfer import _native
from transfer.frames import TransferInfo


FLAGS = st.sampled_from([b"1", b"0", b"", b"01", b"11", b"true", b"\x01"])  # part 9, true exactly when b"1"


def agree(frames) -> object:
    """What both parsers made of `frames`, after checking they made the same (None: not a plain ask)."""
    native = _native.ask_parse(frames, TransferInfo)
    assert typed(native) == typed(TransferInfo._from_plain_frames(frames))
    return native


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=1500, deadline=None)
@given(st.data())
def test_the_native_parse_takes_exactly_the_asks_the_python_shortcut_does(data):
    agree(near_ask(data, FLAGS, fewest=11))


def test_a_plain_ask_and_one_with_our_part_13_parse_to_equal_transfer_infos():
    assert agree(ASK) == TransferInfo.from_frames(ASK) and agree(ASK).deepstack_row_bytes is None
    assert agree(WIDE_ASK) == TransferInfo.from_frames(WIDE_ASK) and agree(WIDE_ASK).deepstack_row_bytes == 16384


@pytest.mark.parametrize("total", [159, 160, 161])
@pytest.mark.parametrize("wide", [False, True])
def test_the_digit_bound_counts_an_absent_part_13_as_one_digit(total, wide):
    """The eight numbers hold at most 160 digits in all, leading zeros included; without part 13 it counts
    as the one digit "0"."""
    frames = list(WIDE_ASK if wide else ASK)
    others = sum(len(frames[i]) for i in NUMBER_INDEXES if i != 0) + (len(frames[13]) if wide else 1)
    frames[0] = b"0" * (total - others - 1) + b"7"
    parsed = agree(frames)
    assert (parsed is not None) == (total <= 160)


@pytest.mark.parametrize("index, value, plain", [
    (0, b"9223372036854775807", True), (0, b"9223372036854775808", False), (0, b"18446744073709551616", False),
    (2, b"65535", True), (2, b"65536", False), (2, b"0065535", True), (6, b"-1", False), (6, b"+1", False),
    (7, b" 1", False), (10, b"", False), (11, b"1_0", False), (1, b"caf\xc3\xa9", False), (1, b"", True),
    (3, b"\x00", True), (8, b"\x7f", True), (8, b"\x80", False), (4, b"\x01" * 7, False), (5, b"\xff" * 9, False),
])
def test_each_bound_is_the_shortcuts(index, value, plain):
    frames = list(ASK)
    frames[index] = value
    assert (agree(frames) is not None) is plain


@pytest.mark.parametrize("frames", [tuple(ASK), [bytearray(p) for p in ASK], ASK[:12], ASK + [b"1", b"2"],
                                    [memoryview(ASK[0]), *ASK[1:]], [b"None", *ASK[1:]], [b"Cancel", *ASK[1:]],
                                    "not a list", None])
def test_anything_but_a_list_of_13_or_14_bytes_parts_is_left_to_the_strict_parser(frames):
    assert _native.ask_parse(frames, TransferInfo) is None


def test_the_asks_are_built_by_the_class_handed_in():
    class Ask(TransferInfo):
        """A subclass whose construction must stay its own."""

    parsed = _native.ask_parse(list(WIDE_ASK), Ask)
    assert type(parsed) is Ask and dataclasses.asdict(parsed) == dataclasses.asdict(TransferInfo.from_frames(WIDE_ASK))


def test_a_class_that_refuses_the_fields_raises_its_error():
    def refuse(*fields):
        raise ValueError(f"refused {len(fields)} fields")

    with pytest.raises(ValueError, match="refused 14 fields"):
        _native.ask_parse(list(ASK), refuse)


@pytest.mark.parametrize("frames", [list(ASK), list(WIDE_ASK)], ids=["13 parts", "14 parts"])
def test_a_parsed_asks_fields_are_held_by_it_alone_and_what_was_handed_in_keeps_its_references(frames):
    """The fields the parse builds are the TransferInfo's (one reference each, in its __dict__, plus the
    argument here), and the parts, the list and the class keep the references they had, whatever the parse
    made of them: a plain ask, none (non-ASCII, past a bound) or the class's error."""
    parsed = _native.ask_parse(frames, TransferInfo)
    names = ("room", "endpoint", "port", "session_id", "embedding_ptr", "deepstack_ptr", "rows", "hidden", "dtype",
             "row_start", "span")  # not fanout: 4, one of CPython's shared small ints
    held = {name: sys.getrefcount(getattr(parsed, name)) for name in names}
    assert held == dict.fromkeys(names, 2)  # its __dict__'s, and getrefcount's argument
    del parsed

    def refuse(*fields):
        raise ValueError("refused")

    late_text, past_bound = list(frames), list(frames)
    late_text[8] = b"torch.\xff"  # the last text: the two before it were built
    past_bound[2] = b"65536"
    cases = [(frames, TransferInfo), (late_text, TransferInfo), (past_bound, TransferInfo), (frames, refuse)]
    gc.collect()  # no earlier test's garbage freed meanwhile (it may hold None)
    gc.disable()
    try:
        before = _references(cases)
        none_before = sys.getrefcount(None)
        for case in cases:
            _parse_often(*case)
        none_after = sys.getrefcount(None)
    finally:
        gc.enable()
    assert _references(cases) == before
    assert abs(none_after - none_before) < 100  # 3000 parses: one reference leaked or lost each would show


def _references(cases: list) -> list:
    """The references each list of parts, each part and each class of `cases` has."""
    return [(sys.getrefcount(parts), [sys.getrefcount(part) for part in parts], sys.getrefcount(cls))
            for parts, cls in cases]


def _parse_often(parts: list[bytes], cls) -> None:
    for _ in range(1000):
        try:
            _native.ask_parse(parts, cls)
        except ValueError:
            pass

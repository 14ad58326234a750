"""The native core without sockets: layer checksum, LAYER payloads and the Msg codec (SPEC.md section 9)."""

from __future__ import annotations

import ctypes
import datetime

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import _native, wire
from transfer.errors import ConfigError, ConfigTypeError
from transfer.wire import LayerError, Msg, MsgError


U64 = (1 << 64) - 1


def reference_sum(data: bytes) -> int:
    """Independent checksum: numpy's uint64 sum (which wraps) over the zero-padded bytes."""
    data = bytes(data)
    padded = data + b"\x00" * (-len(data) % 8)
    return int(np.frombuffer(padded, "<u8").sum(dtype=np.uint64))


def random_bytes(n: int, seed: int = 0) -> bytes:
    """Deterministic random bytes."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_kinds_and_limit_match_the_spec():
    assert [(k.name, int(k)) for k in wire.Kind] == [
        ("GEN", 1), ("DECODE", 2), ("PREFILL", 3), ("LAYER", 10), ("FIRST", 11), ("RESULT", 20), ("ERROR", 21),
    ]
    assert (wire.GEN, wire.DECODE, wire.PREFILL, wire.LAYER, wire.FIRST, wire.RESULT, wire.ERROR) == (
        1, 2, 3, 10, 11, 20, 21,
    )
    assert wire.MAX_PAYLOAD == 64 * 1024 * 1024
    assert issubclass(wire.FrameError, OSError)
    assert issubclass(wire.MsgError, ValueError) and issubclass(wire.LayerError, ValueError)


def test_layer_sum_golden_values():
    assert wire.layer_sum(b"") == 0
    assert wire.layer_sum(bytes(range(1, 9))) == 0x0807060504030201
    assert wire.layer_sum(b"\x01" * 9) == 0x0101010101010102  # tail 0x01 zero-padded
    assert wire.layer_sum(b"\xff" * 16) == U64 - 1  # wraps
    assert wire.layer_sum(b"\xff" * 3) == 0xFFFFFF


def test_layer_sum_all_ones_overflows_by_hand():
    n = 8 * 1001 + 3
    expected = (1001 * U64 + 0xFFFFFF) & U64
    assert wire.layer_sum(b"\xff" * n) == expected == reference_sum(b"\xff" * n)


@pytest.mark.parametrize("n", range(65))
def test_layer_sum_small_lengths(n):
    data = random_bytes(n, seed=n)
    assert wire.layer_sum(data) == reference_sum(data)


@pytest.mark.parametrize("offset", range(1, 8))
@pytest.mark.parametrize("tail", range(8))
def test_layer_sum_unaligned_starts_and_tails(offset, tail):
    base = bytearray(random_bytes(600, seed=offset * 8 + tail))
    view = memoryview(base)[offset : offset + 512 + tail]
    assert wire.layer_sum(view) == reference_sum(view.tobytes())


def test_layer_sum_large_buffer_with_tail():
    arr = np.random.default_rng(7).integers(0, 256, (64 << 20) + 5, dtype=np.uint8)
    head = np.frombuffer(arr[: (64 << 20)].data, "<u8").sum(dtype=np.uint64)
    tail = int.from_bytes(arr[(64 << 20) :].tobytes(), "little")
    assert wire.layer_sum(arr) == (int(head) + tail) & U64


def test_layer_sum_large_all_ones():
    arr = np.full((16 << 20) + 7, 0xFF, dtype=np.uint8)
    words = (16 << 20) // 8
    assert wire.layer_sum(arr) == (words * U64 + (1 << 56) - 1) & U64


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.integers(0, 7))
def test_layer_sum_property(data, offset):
    padded = bytes(offset) + data
    assert wire.layer_sum(memoryview(padded)[offset:]) == reference_sum(data)


def test_layer_sum_raw_address_forms():
    data = random_bytes(1003, seed=3)
    buf = ctypes.create_string_buffer(data, len(data))
    addr = ctypes.addressof(buf)
    want = reference_sum(data)
    assert wire.layer_sum(addr, len(data)) == want
    assert wire.layer_sum((addr, len(data))) == want
    assert wire.layer_sum(addr + 1, 1002) == reference_sum(data[1:])
    assert wire.layer_sum(0, 0) == 0


def test_layer_sum_raw_address_rejects_null():
    with pytest.raises(ValueError, match="null address"):
        wire.layer_sum(0, 8)
    with pytest.raises(TypeError):
        wire.layer_sum((1, 2, 3))


def test_layer_sum_numpy_arrays():
    arr = np.random.default_rng(1).standard_normal((33, 17)).astype(np.float32)
    assert wire.layer_sum(arr) == reference_sum(arr.tobytes())
    assert wire.layer_sum(bytearray(arr.tobytes())) == reference_sum(arr.tobytes())


def test_layer_sum_rejects_non_contiguous():
    arr = np.arange(64, dtype=np.uint8).reshape(8, 8)
    with pytest.raises(BufferError, match=r"^layer_sum needs a C-contiguous buffer; this .* is not contiguous$"):
        wire.layer_sum(arr[:, ::2])
    with pytest.raises(BufferError, match="C-contiguous"):
        wire.layer_sum(memoryview(bytes(64))[::2])
    with pytest.raises(TypeError, match="needs a buffer"):
        wire.layer_sum("text")


@pytest.mark.parametrize("call", [
    _native.layer_sum,
    _native.parse_layer,
    _native.msg_decode,
    lambda buf: _native.layer_frame(1, 2, buf),
    lambda buf: _native.write_frame(-1, 1, (b"x", buf), 1.0),
])
def test_a_buffer_whose_export_fails_is_refused_with_the_exporters_own_error_not_as_not_contiguous(call):
    """A released memoryview exports nothing (ValueError): the BufferError says that export failed, with
    the exporter's words and its exception as the cause, rather than blaming a contiguity it does not lack."""
    released = memoryview(b"0123456789abcdef")
    released.release()
    with pytest.raises(BufferError, match=r" could not export the buffer of this memoryview: operation forbidden "
                                          r"on released memoryview object$") as caught:
        call(released)
    assert "contiguous" not in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError)
    strided = np.arange(64, dtype=np.uint8)[::2]
    with pytest.raises(BufferError, match=r" needs a C-contiguous buffer; this numpy.ndarray is not contiguous$"):
        call(strided)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int8])
def test_layer_sum_torch_cpu_tensors(dtype):
    t = (torch.randn(37, 29, generator=torch.Generator().manual_seed(5)) * 100).to(dtype)
    raw = t.view(torch.uint8).numpy().tobytes()
    assert wire.layer_sum(t) == reference_sum(raw)
    assert wire.tensor_layer_sum(t) == reference_sum(raw)
    # a slice with a storage offset sums only its own bytes
    assert wire.layer_sum(t[3:]) == reference_sum(t[3:].contiguous().view(torch.uint8).numpy().tobytes())


def test_layer_sum_non_contiguous_tensor():
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8).t()
    with pytest.raises(BufferError, match="^layer_sum needs a contiguous tensor$"):
        wire.layer_sum(t)
    # tensor_layer_sum checksums the logical (row-major) bytes instead
    assert wire.tensor_layer_sum(t) == reference_sum(t.contiguous().numpy().tobytes())


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 4097, (1 << 20) + 3])
def test_torch_path_equals_native_random(n):
    t = torch.from_numpy(np.frombuffer(random_bytes(n, seed=n), np.uint8).copy())
    assert wire._torch_layer_sum(t) == wire.layer_sum(t) == reference_sum(t.numpy().tobytes())


@pytest.mark.parametrize("n", [8, 13, 8 * 4096 + 5, (1 << 20) + 1])
def test_torch_path_equals_native_overflow_heavy(n):
    t = torch.full((n,), 0xFF, dtype=torch.uint8)
    assert wire._torch_layer_sum(t) == wire.layer_sum(t) == reference_sum(b"\xff" * n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_torch_path_equals_native_dtypes(dtype):
    g = torch.Generator().manual_seed(11)
    t = (torch.randn(129, 7, generator=g) * 1e4).to(dtype)
    assert wire._torch_layer_sum(t) == wire.layer_sum(t)
    assert wire._torch_layer_sum(t.t()) == wire.tensor_layer_sum(t.t())


@pytest.mark.parametrize("offset, n", [(6, 48), (2, 16), (3, 8), (6, 13), (16, 24), (1, 0)])
def test_torch_path_sums_a_slice_at_any_byte_offset(offset, n):
    # A shard's rows (or a deepstack block) start wherever its row bytes put them in the slot.
    whole = torch.from_numpy(np.frombuffer(random_bytes(offset + n + 5, seed=offset), np.uint8).copy())
    part = whole[offset:offset + n]
    assert wire._torch_layer_sum(part) == wire.layer_sum(part) == reference_sum(part.numpy().tobytes())


def test_torch_path_extreme_int64_words():
    t = torch.tensor([-1, -(1 << 63), (1 << 63) - 1, -1, 12345], dtype=torch.int64)
    assert wire._torch_layer_sum(t) == wire.layer_sum(t) == reference_sum(t.numpy().tobytes())


def test_layer_frame_golden():
    data = bytes(range(1, 10))  # word 0x0807060504030201 + tail 0x09
    want = (
        b"\x03\x00\x00\x00"  # layer 3
        + b"\x02\x00\x00\x00"  # rows 2
        + b"\x0a\x02\x03\x04\x05\x06\x07\x08"  # checksum 0x080706050403020a
        + data
    )
    assert wire.layer_frame(3, 2, data) == want
    assert wire.layer_header(3, 2, 0x080706050403020A) == want[:16]
    layer, rows, view = wire.parse_layer(want)
    assert (layer, rows, bytes(view)) == (3, 2, data)


def test_layer_header_full_ranges():
    h = wire.layer_header(0xFFFFFFFF, 0x01020304, U64)
    assert h == b"\xff\xff\xff\xff\x04\x03\x02\x01" + b"\xff" * 8
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError, match=r"^layer must be an int in 0\.\.4294967295"):
            wire.layer_frame(bad, 0, b"")
        with pytest.raises(ValueError, match=r"^rows must be an int in 0\.\.4294967295"):
            wire.layer_header(0, bad, 0)
    for bad in (-1, 1 << 64, (1 << 64) + 5):
        with pytest.raises(ValueError, match=r"^checksum must be an int in 0\.\.18446744073709551615"):
            wire.layer_header(0, 1, bad)


def test_layer_and_rows_take_any_integer_type_as_the_checksum_does():
    want = wire.layer_header(1, 2, 3)
    assert wire.layer_header(np.uint32(1), np.int64(2), np.uint64(3)) == want
    assert wire.layer_header(torch.tensor(1).item(), torch.tensor(2, dtype=torch.int32), 3) == want
    with pytest.raises(TypeError, match=r"^rows must be an int in 0\.\.4294967295, got 2\.0"):
        wire.layer_header(1, 2.0, 3)


@pytest.mark.parametrize("call, named, bound", [
    (lambda bad: wire.layer_header(bad, 2, 3), "layer", 4294967295),
    (lambda bad: wire.layer_header(1, bad, 3), "rows", 4294967295),
    (lambda bad: wire.layer_frame(bad, 2, b"x"), "layer", 4294967295),
    (lambda bad: wire.layer_frame(1, bad, b"x"), "rows", 4294967295),
    (lambda bad: _native.wire_transfer(-1, b"", [(4096, 8)], bad, 8, 1.0), "rows", 4294967295),
    (lambda bad: _native.write_frame(-1, bad, (b"x",), 1.0), "frame kind", 255),
])
def test_a_32_bit_or_byte_argument_that_is_no_integer_is_a_type_error_and_one_out_of_range_a_value_error(
        call, named, bound):
    """As the 64-bit arguments answer: a str or float given for an int is the caller's type mistake
    (TypeError), an int outside the field's range a ValueError; both name the argument and its range."""
    for bad in ("3", 2.0, None, b"\x01"):
        with pytest.raises(TypeError, match=rf"^{named} must be an int in 0\.\.{bound}, got "):
            call(bad)
    for bad in (-1, bound + 1, 1 << 64, np.int64(-2)):
        with pytest.raises(ValueError, match=rf"^{named} must be an int in 0\.\.{bound}, got "):
            call(bad)


def test_wire_write_frame_refuses_a_kind_of_another_type_as_a_config_type_error():
    """Checked in Python before the descriptor is touched (here -1, which any I/O would fail on)."""
    for call in (lambda kind: wire.write_frame(-1, kind, b""), lambda kind: wire.write_frame_parts(-1, kind, [b""])):
        for kind, named in ((True, "bool True"), (1.0, "float 1.0"), ("1", "str '1'")):
            with pytest.raises(ConfigTypeError, match=rf"^frame kind must be an int in 0\.\.255, got {named}$"):
                call(kind)
        for kind in (-1, 256):
            with pytest.raises(ConfigError, match=rf"^frame kind must be an int in 0\.\.255, got {kind}$"):
                call(kind)


@pytest.mark.parametrize("call, named", [
    (lambda: wire.layer_header(1, 2, 3.0), "checksum"),
    (lambda: wire.layer_sum(4096, 8.0), "layer_sum: the length"),
    (lambda: wire.layer_sum("4096", 8), "layer_sum: the address"),
    (lambda: _native.read_frame(-1, 1.0, 1.5), "limit"),
    (lambda: _native.wire_transfer(-1, b"", [(4096.0, 8)], 1, 8, 1.0), "a layer's address"),
    (lambda: _native.wire_transfer(-1, b"", [(4096, 8)], 1, "8", 1.0), "chunk"),
])
def test_a_64_bit_argument_that_is_no_integer_is_a_type_error_naming_it(call, named):
    """Not Python's bare "'float' object cannot be interpreted as an integer", which says neither
    which argument nor what it must be."""
    with pytest.raises(TypeError, match=rf"^{named} must be an int in 0\.\.18446744073709551615, got "):
        call()


def test_a_layer_list_changed_while_its_addresses_are_read_is_sent_as_it_was_given():
    import os

    rows = [ctypes.create_string_buffer(bytes([65 + i]) * 64, 64) for i in range(2)]
    layers: list = []

    class ClearsTheList:
        def __index__(self) -> int:
            layers.clear()
            return ctypes.addressof(rows[0])

    layers.extend([(ClearsTheList(), 64), (ctypes.addressof(rows[1]), 64)])
    r, w = os.pipe()
    try:
        with pytest.raises(wire.FrameError, match="read"):  # the answer is read from a pipe's write end
            _native.wire_transfer(w, b"room=1", layers, 1, 4096, 1.0)
        sent = os.read(r, 1 << 16)
    finally:
        os.close(r)
        os.close(w)
    assert sent.count(b"A" * 64) == 1 and sent.count(b"B" * 64) == 1  # both layers, each once, in order
    assert sent.index(b"A" * 64) < sent.index(b"B" * 64)
    with pytest.raises(TypeError, match=r"^wire_transfer needs a sequence of \(address, length\) pairs$"):
        _native.wire_transfer(w, b"room=1", 5, 1, 4096, 1.0)


def test_a_wire_listener_on_a_host_that_does_not_resolve_closes_no_descriptor_of_ours():
    import os

    r, w = os.pipe()
    saved = os.dup(0)
    os.dup2(r, 0)
    try:
        with pytest.raises(OSError, match="wire listener: cannot resolve"):
            _native.wire_listen("", 0, 1.0, 1.0, 4096, 2)  # fails in getaddrinfo, before any socket
        os.fstat(0)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, r, w):
            os.close(fd)


def test_parse_layer_short_header():
    for n in (0, 1, 15):
        with pytest.raises(LayerError) as err:
            wire.parse_layer(b"\x00" * n)
        assert str(err.value) == f"LAYER payload shorter than its 16-byte header: {n} bytes"


def test_parse_layer_mismatch_message():
    payload = wire.layer_header(1, 1, 0) + b"\x01"
    with pytest.raises(LayerError) as err:
        wire.parse_layer(payload)
    assert str(err.value) == "LAYER checksum mismatch: header 0x0000000000000000, computed 0x0000000000000001"


def test_parse_layer_empty_data_and_view_is_zero_copy():
    payload = bytearray(wire.layer_frame(7, 0, b""))
    assert payload == b"\x07\x00\x00\x00" + bytes(12)
    layer, rows, view = wire.parse_layer(payload)
    assert (layer, rows, view.nbytes) == (7, 0, 0)
    big = bytearray(wire.layer_frame(1, 2, b"abcdefgh"))
    _, _, view = wire.parse_layer(big)
    big[16] = ord("z")
    assert bytes(view) == b"zbcdefgh"  # a view into the payload, not a copy


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFFFFFF), st.binary(max_size=300))
def test_layer_round_trip(layer, rows, data):
    payload = wire.layer_frame(layer, rows, data)
    assert len(payload) == 16 + len(data)
    assert payload[8:16] == reference_sum(data).to_bytes(8, "little")
    got_layer, got_rows, view = wire.parse_layer(payload)
    assert (got_layer, got_rows, bytes(view)) == (layer, rows, data)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.data())
def test_layer_flipped_byte_is_a_mismatch(data, draw):
    payload = bytearray(wire.layer_frame(1, 2, data))
    index = draw.draw(st.integers(8, len(payload) - 1))  # checksum or data
    payload[index] ^= draw.draw(st.integers(1, 255))
    with pytest.raises(LayerError, match=r"^LAYER checksum mismatch: header 0x[0-9a-f]{16}, computed 0x[0-9a-f]{16}$"):
        wire.parse_layer(payload)


def test_msg_encode_golden():
    m = Msg()
    m.set("b", 2)
    m.set("a", 1)
    m.body = b"xy"
    assert m.encode() == b"a=1\nb=2\n\nxy"
    assert Msg().encode() == b"\n"
    assert Msg({"k": "v=w"}).encode() == b"k=v=w\n\n"
    assert Msg({"é": "ü", "z": ""}).encode() == "z=\né=ü\n\n".encode()  # code point order


def test_msg_set_replaces_and_get():
    m = Msg().set("a", "1").set("a", -5)
    assert m.get("a") == "-5" and m.get("zz") is None and m.get("zz", "d") == "d"
    assert m.encode() == b"a=-5\n\n"


def test_msg_set_rejects_bad_fields():
    m = Msg()
    with pytest.raises(ValueError, match=r"^a Msg key must not contain '=' or a newline: 'a=b'$"):
        m.set("a=b", "1")
    with pytest.raises(ValueError, match=r"^a Msg key must not contain '=' or a newline: 'a\\nb'$"):
        m.set("a\nb", "1")
    with pytest.raises(ValueError, match=r"^Msg value of 'k' must not contain a newline$"):
        m.set("k", "1\n2")
    with pytest.raises(TypeError):
        m.set("k", 1.5)
    with pytest.raises(TypeError):
        m.set("k", True)
    with pytest.raises(TypeError):
        m.set(b"k", "1")
    assert m.encode() == b"\n"  # nothing was stored


def test_msg_number():
    m = Msg({"n": "42", "neg": "-7", "plus": "+3", "big": str(U64), "x": "4x", "e": "", "sp": " 1",
             "u": "1_0", "uni": "\u0661", "huge": str(U64 + 1)})
    assert (m.number("n"), m.number("neg"), m.number("plus"), m.number("big")) == (42, -7, 3, U64)
    with pytest.raises(MsgError) as err:
        m.number("absent")
    assert str(err.value) == "missing absent"
    for key in ("x", "e", "sp", "u", "uni", "huge"):
        with pytest.raises(MsgError) as err:
            m.number(key)
        assert str(err.value) == f"{key}: not a number"


def test_msg_number_past_ints_digit_limit():
    """Past 4300 digits int() refuses a string with a ValueError of its own: leading zeros, which the
    grammar allows however many, still give the number, and anything too large is not a number."""
    zeros = "0" * 5000
    m = Msg({"z": zeros + "7", "neg": "-" + zeros + "7", "zero": "+" + zeros, "big": zeros + str(U64),
             "over": zeros + str(U64 + 1), "low": "-" + zeros + str(2**63 + 1), "long": "9" * 5000})
    assert (m.number("z"), m.number("neg"), m.number("zero"), m.number("big")) == (7, -7, 0, U64)
    for key in ("over", "low", "long"):
        with pytest.raises(MsgError) as err:
            m.number(key)
        assert str(err.value) == f"{key}: not a number"


def test_msg_decode_cases():
    m = Msg.decode(b"a=1\nb=2\n\nxy")
    assert (m.fields(), m.body) == ({"a": "1", "b": "2"}, b"xy")
    m = Msg.decode(b"a=1\n\n\n\nbody\n\n")  # the first blank line ends the header
    assert (m.fields(), m.body) == ({"a": "1"}, b"\n\nbody\n\n")
    assert Msg.decode(b"") == Msg()
    assert Msg.decode(b"\n") == Msg()
    assert Msg.decode(b"\nraw") == Msg(body=b"raw")
    assert Msg.decode(b"a=1") == Msg({"a": 1})  # no blank line: all header
    assert Msg.decode(b"a=1\n") == Msg({"a": 1})
    assert Msg.decode(b"a=1\na=2\n\n").get("a") == "2"  # a repeated key keeps its last value
    assert Msg.decode(b"k=v=w\n=e\n\n").fields() == {"k": "v=w", "": "e"}
    assert Msg.decode(b"a=1\r\n\n").get("a") == "1\r"
    assert Msg.decode(b"a=1\n\n\xff\xfe").body == b"\xff\xfe"  # body is raw bytes
    assert Msg.decode(memoryview(b"a=1\n\nxy")).body == b"xy"


def test_msg_decode_errors():
    cases = [
        (b"\xff=1\n\n", "a message that is not UTF-8"),
        (b"a=\xc3\n\n", "a message that is not UTF-8"),
        (b"nokey\n\nbody", "a header line without '=': \"nokey\""),
        (b"a=1\nsecond line\n\n", "a header line without '=': \"second line\""),
        (b"a=1\n\xff", "a message that is not UTF-8"),  # no blank line: all header
        ("é\n\n".encode(), "a header line without '=': \"é\""),
        (b"justtext", "a header line without '=': \"justtext\""),
    ]
    for data, message in cases:
        with pytest.raises(MsgError) as err:
            Msg.decode(data)
        assert str(err.value) == message, data


def test_msg_decode_quotes_a_long_line_without_equals_as_the_listener_does():
    """At most 64 bytes of the line, cut back to the start of a character it would split, then
    `...`: a peer's 64 KiB answer does not become a 64 KiB error (the listener quotes the same)."""
    line = "a" * 63 + "\u00e9" + "b"  # the two bytes of the e-acute straddle the 64-byte cut
    with pytest.raises(MsgError) as err:
        Msg.decode(line.encode() + b"\n\n")
    assert str(err.value) == f"a header line without '=': \"{'a' * 63}...\""
    with pytest.raises(MsgError) as err:
        Msg.decode(b"x" * 65536)
    assert str(err.value) == f"a header line without '=': \"{'x' * 64}...\""
    with pytest.raises(MsgError) as err:  # exactly 64 bytes: quoted whole
        Msg.decode(b"y" * 64 + b"\n\n")
    assert str(err.value) == f"a header line without '=': \"{'y' * 64}\""


def test_msg_utf8_checked_before_lines():
    # both faults present: the whole header's UTF-8 check comes first
    with pytest.raises(MsgError) as err:
        Msg.decode(b"noequals\nk=\xff\n\n")
    assert str(err.value) == "a message that is not UTF-8"


_keys = st.text(st.characters(blacklist_characters="=\n", blacklist_categories=("Cs",)), max_size=12)
_values = st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values | st.integers(-(1 << 70), 1 << 70), max_size=8), st.binary(max_size=200))
def test_msg_round_trip(fields, body):
    m = Msg(fields, body)
    data = m.encode()
    back = Msg.decode(data)
    assert back == m
    assert back.encode() == data
    lines = data.split(b"\n")
    assert [line.split(b"=", 1)[0] for line in lines[: len(fields)]] == sorted(k.encode() for k in fields)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_msg_decode_never_raises_anything_else(data):
    try:
        Msg.decode(data)
    except MsgError:
        pass


def test_msg_encode_sorts_str_subclass_keys_and_keeps_its_errors():
    class Key(str):
        """A plain str subclass key."""

    assert _native.msg_encode({Key("b"): "2", "a": Key("1")}, b"") == b"a=1\nb=2\n\n"
    assert Msg({Key("é"): "v", "z": 1}).encode() == "z=1\né=v\n\n".encode()
    with pytest.raises(TypeError):
        _native.msg_encode({1: "a", "b": "c"}, b"")
    with pytest.raises(TypeError, match="a Msg key must be str, not int"):
        _native.msg_encode({1: "a"}, b"")
    with pytest.raises(TypeError, match="must be str, not bytes"):
        _native.msg_encode({"a": b"x"}, b"")


def test_layer_sum_refuses_addresses_beyond_64_bits_and_keeps_the_valid_ones():
    data = bytes(range(1, 17))
    buf = ctypes.create_string_buffer(data, len(data))
    addr = ctypes.addressof(buf)
    with pytest.raises(ValueError, match=r"the address must be an int in 0\.\.18446744073709551615"):
        wire.layer_sum(addr + (1 << 64), len(data))
    with pytest.raises(ValueError, match=r"the length must be an int in 0\.\.18446744073709551615"):
        wire.layer_sum(addr, -1)
    with pytest.raises(TypeError):
        wire.layer_sum(float(addr), 8)
    want = 0x0807060504030201 + 0x100F0E0D0C0B0A09
    assert wire.layer_sum(addr, len(data)) == want
    assert _native.layer_sum_addr(np.uint64(addr), np.int64(16)) == want  # any __index__ int
    assert wire.layer_sum(U64, 0) == 0  # an empty range at the top does not wrap
    with pytest.raises(ValueError, match="null address"):
        wire.layer_sum(0, 8)


_ROW = ctypes.create_string_buffer(64)


@pytest.mark.parametrize("call", [
    lambda: _native.read_frame(-1, -1.0, None, 1.0),
    lambda: _native.wire_transfer(-1, b"room=1", ((ctypes.addressof(_ROW), 64),), 1, 4096, -1.0, 1.0),
], ids=["read_frame", "wire_transfer"])
def test_a_least_rate_without_a_timeout_is_refused_before_any_io(call):
    """A blocking socket (timeout -1) cannot be stopped mid-call, so a least rate there would bound nothing:
    refused before the (bad) descriptor is touched."""
    with pytest.raises(ValueError, match=r"^(read_frame|wire_transfer): min_rate needs a timeout: a blocking "
                                         r"socket waits on its peer however slowly it goes$"):
        call()


@pytest.mark.parametrize("call", [
    _native.wire_listener_port,
    _native.wire_listener_stats,
    _native.wire_listener_close,
    lambda obj: _native.wire_add_region(obj, 4096, 8),
    lambda obj: _native.wire_remove_region(obj, 4096),
])
@pytest.mark.parametrize("obj", [5, None, datetime.datetime_CAPI], ids=["int", "None", "another capsule"])
def test_a_wire_listener_call_given_something_else_is_a_type_error(call, obj):
    """Not the ValueError of PyCapsule_GetPointer ("called with invalid PyCapsule object"), which says
    nothing of what the call needs."""
    with pytest.raises(TypeError, match=r"^a wire listener \(made by wire_listen\) is needed, not "):
        call(obj)

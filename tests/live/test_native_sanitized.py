"""The native core's memory safety and defined behaviour on the inputs that fuzzing it under
AddressSanitizer and UndefinedBehaviorSanitizer exercises (SPEC.md section 9). They run against the
normal build; a case that could crash runs in a child interpreter so it fails one test, not the session."""

from __future__ import annotations

import ctypes
import math
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

import transfer
from transfer import _native, wire


U64 = (1 << 64) - 1
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(transfer.__file__)))


def run_isolated(code: str) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter that imports this same `transfer` package; bounded in time."""
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, timeout=60,
                          cwd=PACKAGE_ROOT, env=env)


def listener(max_conns: int = 4):
    """A raw native listener on an ephemeral loopback port."""
    return _native.wire_listen("127.0.0.1", 0, 1.0, 1.0, 4096, max_conns)


# The encoder works from one snapshot of the pairs: a str subclass key's __hash__ may run between
# a pass that counts the bytes by dict lookups and one that writes them, and a value that grew
# (heap overflow) or vanished (NULL dereference) meanwhile must not matter.
MUTATING_KEY = """
    import sys
    from transfer import _native

    fields = {}

    class Key(str):
        \"\"\"A key whose every hash after the first changes the other field.\"\"\"

        calls = 0

        def __hash__(self):
            Key.calls += 1
            if Key.calls > 1:
                {action}
            return str.__hash__(self)

        __eq__ = str.__eq__

    fields[Key("a")] = "1"
    fields["b"] = "2"
    Key.calls = 1
    sys.stdout.buffer.write(_native.msg_encode(fields, b"body"))
"""


@pytest.mark.parametrize("action", [
    'fields["b"] = "x" * (1 << 22) if Key.calls % 2 else "2"',  # longer on the second pass
    'fields.pop("b", None)',  # gone on the second pass
])
def test_msg_encode_is_a_snapshot_when_a_key_hash_changes_the_dict(action):
    done = run_isolated(MUTATING_KEY.replace("{action}", action))
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert done.stdout == b"a=1\nb=2\n\nbody"


def test_read_and_write_frame_refuse_a_nan_timeout_before_any_io():
    a, b = socket.socketpair()
    with a, b:
        wire.write_frame(b, wire.GEN, b"x")
        with pytest.raises(ValueError, match=r"^read_frame: the timeout is NaN$"):
            _native.read_frame(a.fileno(), math.nan)
        with pytest.raises(ValueError, match=r"^write_frame: the timeout is NaN$"):
            _native.write_frame(b.fileno(), wire.GEN, (b"y",), math.nan)
        a.settimeout(5)
        assert wire.read_frame(a)[:2] == (wire.GEN, b"x")  # the refused calls moved no byte
        a.setblocking(False)
        with pytest.raises(BlockingIOError):
            a.recv(1)


@pytest.mark.parametrize("timeout", [1e300, math.inf, 3e6])
def test_a_huge_frame_timeout_waits_like_a_long_one(timeout):
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)  # so the read really waits in poll()
        feeder = threading.Timer(0.2, lambda: wire.write_frame(b, wire.LAYER, b"late"))
        feeder.start()
        try:
            kind, payload, _ = _native.read_frame(a.fileno(), timeout)  # one read as 0 gives up before the frame
        finally:
            feeder.join()
        assert (kind, payload) == (wire.LAYER, b"late")


@pytest.mark.parametrize("timeouts", [(math.nan, 1.0), (1.0, math.nan), (-math.nan, 1.0)])
def test_wire_listen_refuses_a_nan_timeout(timeouts):
    with pytest.raises(ValueError, match=r"^wire listener: a timeout is NaN$"):
        _native.wire_listen("127.0.0.1", 0, *timeouts, 4096, 2)


def test_wire_listen_takes_extreme_finite_and_infinite_timeouts():
    for recv, idle in ((1e300, math.inf), (-math.inf, 0.0), (5e-324, -1.0)):
        lst = _native.wire_listen("127.0.0.1", 0, recv, idle, 4096, 2)
        try:
            assert _native.wire_listener_port(lst) > 0
        finally:
            _native.wire_listener_close(lst)


@pytest.mark.parametrize("args, message", [
    ("-1, 8", "layer_sum: the address must be an int in 0..18446744073709551615, got -1"),
    (f"{U64 - 7}, 16", "layer_sum: the range 0xfffffffffffffff8+16 wraps around the address space"),
    (f"{U64}, 2", "layer_sum: the range 0xffffffffffffffff+2 wraps around the address space"),
])
def test_layer_sum_refuses_wild_address_ranges_instead_of_reading_them(args, message):
    code = f"""
        from transfer import wire
        try:
            wire.layer_sum({args})
        except ValueError as exc:
            print(exc)
    """
    done = run_isolated(code)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert done.stdout.decode().strip() == message


def test_wire_regions_refuse_addresses_beyond_64_bits():
    buf = ctypes.create_string_buffer(4096)
    addr = ctypes.addressof(buf)
    lst = listener()
    try:
        for bad_addr, bad_len in ((addr + (1 << 64), 16), (-4096, 4096), (addr, -1), (addr, 1 << 64)):
            with pytest.raises(ValueError, match=r"^wire_add_region: the (address|length) must be an int"):
                _native.wire_add_region(lst, bad_addr, bad_len)
        assert _native.wire_listener_stats(lst)["regions"] == 0
        with pytest.raises(ValueError, match=r"^wire_remove_region: the address must be an int"):
            _native.wire_remove_region(lst, -1)
        _native.wire_add_region(lst, addr, 4096)
        assert _native.wire_remove_region(lst, addr) == 4096
    finally:
        _native.wire_listener_close(lst)


def test_wire_region_errors_print_their_addresses():
    # Python 3.11's PyErr_Format knows no %llx: the message must show the numbers, not "0x%llx+%llu".
    lst = listener()
    try:
        with pytest.raises(ValueError) as err:
            _native.wire_add_region(lst, 0, 8)
        assert str(err.value) == "cannot register region 0x0+8: empty, null or wrapping"
        with pytest.raises(ValueError) as err:
            _native.wire_add_region(lst, U64 - 7, 16)
        assert str(err.value) == "cannot register region 0xfffffffffffffff8+16: empty, null or wrapping"
        with pytest.raises(KeyError) as err:
            _native.wire_remove_region(lst, 0x1000)
        assert err.value.args == ("address 0x1000 is not a registered region",)
    finally:
        _native.wire_listener_close(lst)


def test_wire_region_lengths_stop_where_remove_can_answer_them():
    """wire_remove_region answers a region's length as a signed 64-bit int: a longer region, once
    registered, would be removed and reported as never registered (KeyError)."""
    lst = listener()
    try:
        with pytest.raises(ValueError) as err:
            _native.wire_add_region(lst, 0x1000, 1 << 63)
        assert str(err.value) == ("cannot register region 0x1000+9223372036854775808: longer than "
                                  "9223372036854775807 bytes")
        assert _native.wire_listener_stats(lst)["regions"] == 0
        _native.wire_add_region(lst, 0x1000, (1 << 63) - 1)  # the longest: never copied into here
        assert _native.wire_remove_region(lst, 0x1000) == (1 << 63) - 1
        assert _native.wire_listener_stats(lst)["regions"] == 0
    finally:
        _native.wire_listener_close(lst)


def test_concurrent_closes_stop_a_busy_listener_once():
    for _ in range(20):
        lst = listener(max_conns=8)
        port = _native.wire_listener_port(lst)
        peers = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        barrier = threading.Barrier(4)

        def close() -> None:
            """Closes the shared listener together with the other threads."""
            barrier.wait(timeout=5)
            _native.wire_listener_close(lst)

        closers = [threading.Thread(target=close) for _ in range(4)]
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in closers)
        for peer in peers:
            peer.settimeout(5)
            try:
                assert peer.recv(1) == b""  # the listener shut every connection it accepted down
            except ConnectionResetError:
                pass  # one still in the backlog when the listening socket closed
            peer.close()
        assert _native.wire_listener_stats(lst)["active"] == 0


@pytest.mark.skipif(sys.version_info < (3, 12), reason="a Python class exports a buffer (__buffer__) from 3.12 on")
@pytest.mark.parametrize("action", ["del parts[2:]", "parts.clear()"])
def test_write_frame_writes_the_parts_it_was_given_when_a_buffer_export_changes_the_list(action):
    done = run_isolated(f"""
        import os
        from transfer import _native

        class Shrinking:
            def __buffer__(self, flags):
                {action}
                return memoryview(b"evil")

        parts = [b"a", Shrinking()] + [b"x" * 10] * 8
        r, w = os.pipe()
        _native.write_frame(w, 1, parts, 1.0)
        os.close(w)
        print(len(os.read(r, 1 << 16)))
    """)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert done.stdout.split() == [str(5 + 1 + 4 + 80).encode()]  # header, b"a", the export, 8 x 10 bytes


@pytest.mark.parametrize("kind, error", [(-1, ValueError), (256, ValueError), ((1 << 32) + 3, ValueError),
                                         (1 << 70, ValueError), (2.0, TypeError), ("3", TypeError)])
def test_write_frame_refuses_a_kind_outside_a_byte_and_writes_nothing(kind, error):
    r, w = os.pipe()
    try:
        with pytest.raises(error, match=r"^frame kind must be an int in 0\.\.255, got "):
            _native.write_frame(w, kind, (b"hi",), 1.0)
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 16)
    finally:
        os.close(r)
        os.close(w)


def test_write_frame_takes_a_kind_given_as_any_integer():
    import numpy as np

    r, w = os.pipe()
    try:
        _native.write_frame(w, np.uint8(3), [b"hi"], 1.0)
        assert os.read(r, 16) == b"\x03\x00\x00\x00\x03hi"  # kind, then the little-endian length
    finally:
        os.close(r)
        os.close(w)


def test_layer_frame_refuses_rows_beyond_a_frame_before_allocating():
    base = ctypes.create_string_buffer(16)
    huge = (ctypes.c_char * (1 << 40)).from_address(ctypes.addressof(base))  # a length, never read
    with pytest.raises(ValueError, match=r"^layer_frame: 1099511627776 bytes of rows exceed a frame's "):
        _native.layer_frame(0, 1, huge)
    limit = _native.MAX_PAYLOAD - 16
    over = (ctypes.c_char * (limit + 1)).from_address(ctypes.addressof(base))
    with pytest.raises(ValueError, match=rf"^layer_frame: {limit + 1} bytes of rows exceed a frame's {limit}$"):
        _native.layer_frame(0, 1, over)

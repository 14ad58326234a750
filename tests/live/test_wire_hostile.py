"""A hostile peer speaking raw frames to the wire listener: every lie is refused with a reason, nothing
outside registered memory is written, a frame refused by its checks writes nothing (chunks checked
before it have landed, as a one-sided write cut short would have), and other connections keep being
served."""

from __future__ import annotations

import random
import re
import select
import socket
import struct
import threading
import time

import pytest
import torch
from live_helpers import mutate_bytes

from transfer import wire
from transfer.wire import FrameError, Msg, MsgError
from transfer.wire_engine import WireEngine

PAGE = 4096
GUARD = 0x5A
SENTINEL = 0xA5
CHUNK = 1024  # the listener's bounce limit in these tests
U64 = (1 << 64) - 1


class Target:
    """A listener with one registered region in the middle of a larger tensor, guard bytes around it."""

    def __init__(self, recv_timeout_s: float = 1.0) -> None:
        self.engine = WireEngine("127.0.0.1", recv_timeout_s=recv_timeout_s, chunk_bytes=CHUNK, max_connections=4)
        self.memory = torch.full((3 * PAGE,), GUARD, dtype=torch.uint8)
        self.region = self.memory[PAGE:2 * PAGE]
        self.region.fill_(SENTINEL)
        self.base = self.region.data_ptr()
        self.end = self.base + PAGE
        self.engine.register(self.region)
        self.snapshot = self.memory.clone()

    def connect(self) -> socket.socket:
        """A raw connection to the listener."""
        return socket.create_connection(("127.0.0.1", self.engine.port), timeout=10)

    def unchanged(self) -> bool:
        """Every byte, guards and registered region, is as it was."""
        return torch.equal(self.memory, self.snapshot)

    def guards_unchanged(self) -> bool:
        """The bytes just outside the registered region are untouched."""
        return (torch.equal(self.memory[:PAGE], self.snapshot[:PAGE])
                and torch.equal(self.memory[2 * PAGE:], self.snapshot[2 * PAGE:]))


@pytest.fixture
def target():
    t = Target()
    with t.engine:
        yield t


@pytest.fixture(scope="module")
def sender():
    """A well-behaved sender with a registered source."""
    with WireEngine("127.0.0.1", chunk_bytes=CHUNK) as engine:
        src = torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        engine.register(src)
        yield engine, src


def prefill(dest: int, nbytes: int, **extra) -> bytes:
    """A PREFILL Msg (room 7) for one layer of nbytes at dest (rows 1), with fields overridden by extra."""
    fields = {"room": 7, "layers": 1, "rows": 1, "row_bytes": nbytes, "ptr": dest, "ptr0": dest, "bytes0": nbytes}
    fields.update(extra)
    return Msg({k: v for k, v in fields.items() if v is not None}).encode()


def layer(index: int, data: bytes, rows: int = 1, checksum: int | None = None) -> bytes:
    """A LAYER payload: header (with the data's checksum unless given) and data."""
    return wire.layer_header(index, rows, wire.layer_sum(data) if checksum is None else checksum) + data


def expect_error(sock: socket.socket, pattern: str, room: int | None = 7) -> str:
    """Reads an ERROR answer whose reason matches pattern, then sees the connection dropped."""
    kind, payload, _ = wire.read_frame(sock)
    answer = Msg.decode(payload)
    reason = answer.body.decode()
    assert kind == wire.ERROR, (kind, answer)
    assert re.search(pattern, reason), reason
    assert answer.get("room") == (None if room is None else str(room))
    with pytest.raises(FrameError, match="connection closed"):
        wire.read_frame(sock)
    return reason


def good_write(target: Target, sender) -> None:
    """A well-behaved transfer into the region still lands (the listener is not stalled)."""
    engine, src = sender
    engine.write(target.engine.session_id, [src.data_ptr()], [target.base], [PAGE])
    assert torch.equal(target.region, src)
    assert target.guards_unchanged()


# ---------------------------------------------------------------- out-of-range pointers

OUT_OF_RANGE = {
    "just before": lambda t: (t.base - 8, 8),
    "straddles the start": lambda t: (t.base - 1, 2),
    "just after": lambda t: (t.end, 1),
    "overlaps the end": lambda t: (t.end - 8, 16),
    "the whole tensor": lambda t: (t.base - PAGE, 3 * PAGE),
    "huge pointer": lambda t: (U64 - PAGE, 16),
    "null pointer": lambda t: (0, 16),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_out_of_range_destination_is_refused_before_any_byte(target, sender, case):
    ptr, nbytes = OUT_OF_RANGE[case](target)
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(ptr, nbytes))
        # The peer goes on as if accepted: the data must never land.
        for off in range(0, nbytes, CHUNK):
            wire.write_frame(sock, wire.LAYER, layer(0, b"\xee" * min(CHUNK, nbytes - off)))
        wire.write_frame(sock, wire.FIRST, b"")
        reason = expect_error(sock, r"layer 0: destination \[0x[0-9a-f]+, 0x[0-9a-f]+\) \(\d+ bytes\) "
                                    r"is not inside registered memory")
        assert f"[{ptr:#x}, {ptr + nbytes:#x})" in reason
    assert target.unchanged()
    good_write(target, sender)


def test_wrapping_destination_is_refused(target, sender):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(U64 - 7, 16))
        expect_error(sock, r"layer 0: destination 0xfffffffffffffff8 \+ 16 bytes wraps around the address space")
    assert target.unchanged()
    good_write(target, sender)


def test_second_layer_out_of_range_refuses_the_whole_transfer(target):
    with target.connect() as sock:
        msg = prefill(target.base, 64, layers=2, ptr1=target.end - 32, bytes1=64)
        wire.write_frame(sock, wire.PREFILL, msg)
        wire.write_frame(sock, wire.LAYER, layer(0, b"\x01" * 64))
        expect_error(sock, r"layer 1: destination .* is not inside registered memory")
    assert target.unchanged()


# ---------------------------------------------------------------- lying lengths and fields

def test_layer_larger_than_announced(target, sender):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64))
        wire.write_frame(sock, wire.LAYER, layer(0, b"\x01" * 128))
        expect_error(sock, r"layer 0 overruns its announced 64 bytes: 0 received \+ 128 in this frame")
    assert target.unchanged()
    good_write(target, sender)


def test_layer_frame_longer_than_the_bounce_limit_is_refused_unread(target, sender):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, PAGE))
        # Only the frame header and a few bytes: the size alone condemns it.
        sock.sendall(struct.pack("<IB", 1 + wire.LAYER_HEADER + 2 * CHUNK, wire.LAYER) + b"\x00" * 32)
        expect_error(sock, rf"LAYER frame of {2 * CHUNK} data bytes exceeds the chunk limit of {CHUNK} bytes")
    assert target.unchanged()
    good_write(target, sender)


def test_rows_times_row_bytes_mismatch(target):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 128, rows=4, row_bytes=16))
        expect_error(sock, r"rows 4 x row_bytes 16 = 64 but bytes0 is 128")
    assert target.unchanged()


def test_rows_times_row_bytes_overflow(target):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 128, rows=1 << 31, row_bytes=1 << 40))
        expect_error(sock, r"rows 2147483648 x row_bytes 1099511627776 overflows")
    assert target.unchanged()


def test_ptr_disagreeing_with_ptr0(target):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64, ptr=target.end + 64))
        expect_error(sock, r"PREFILL: ptr 0x[0-9a-f]+ differs from ptr0")
    assert target.unchanged()


@pytest.mark.parametrize("fields, pattern, room", [
    ({"ptr0": None}, r"^PREFILL: missing ptr0$", 7),
    ({"bytes0": "-5"}, r"^PREFILL: bytes0: not a number$", 7),
    ({"rows": "1_0"}, r"^PREFILL: rows: not a number$", 7),
    ({"ptr": str(1 << 64)}, r"^PREFILL: ptr: not a number$", 7),
    ({"layers": 0}, r"PREFILL announces 0 layers; 1..16 are allowed", 7),
    ({"layers": 17}, r"PREFILL announces 17 layers", 7),
    ({"rows": 1 << 32, "row_bytes": 0, "bytes0": 0}, r"rows 4294967296 does not fit the LAYER header", 7),
    ({"rows": 0, "bytes0": 0}, r"^PREFILL: layer 0 announces 0 bytes; every layer must carry some$", 7),
    ({"layers": 2, "ptr1": 0, "bytes1": 0}, r"^PREFILL: layer 1 announces 0 bytes", 7),
    ({"room": None}, r"^PREFILL: missing room$", None),
])
def test_malformed_prefill_fields(target, fields, pattern, room):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64, **fields))
        expect_error(sock, pattern, room=room)
    assert target.unchanged()


def test_a_prefill_with_an_empty_header_is_read_as_one_whose_fields_are_missing(target):
    # Its body holds what would be a valid header, then a blank line: SPEC.md section 9 makes it body.
    fields = prefill(target.base, 64)
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, b"\n" + fields + b"\n")
        expect_error(sock, r"^PREFILL: missing room$", room=None)
    assert target.unchanged()


@pytest.mark.parametrize("header, pattern", [
    (b"junk line\n", r"""^PREFILL: a header line without '=': "junk line"$"""),
    (b"note=\xff\xfe\n", r"^PREFILL: a message that is not UTF-8$"),
    (b"note=\xed\xa0\x80\n", r"^PREFILL: a message that is not UTF-8$"),  # a surrogate, as Msg.decode refuses
])
def test_a_prefill_whose_header_msg_decode_refuses_is_refused(target, header, pattern):
    """Every other field is valid: the listener reads the header as Msg.decode would, not line by line."""
    payload = header + prefill(target.base, 64)
    with pytest.raises(MsgError):
        Msg.decode(payload)
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, payload)
        expect_error(sock, pattern, room=None)
    assert target.unchanged()


def test_a_long_line_without_equals_is_quoted_whole_characters_only(target):
    """The quote stops at 64 bytes, and backs off to the start of a character it would cut: the
    reason a peer reads, and stats() after it, stay UTF-8."""
    line = "a" * 63 + "\u00e9" + "b"  # the two bytes of the e-acute straddle the 64-byte cut
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, line.encode() + b"\n" + prefill(target.base, 64))
        reason = expect_error(sock, r"^PREFILL: a header line without '=': ", room=None)
    assert reason == f"""PREFILL: a header line without '=': "{'a' * 63}..." """.rstrip()
    assert target.engine.stats()["last_error"] == reason
    assert target.unchanged()


def test_a_line_without_equals_quoting_controls_reaches_stats_printable(target):
    """The peer is answered with its line as it sent it (the wire is unchanged); stats(), which
    people read and log, quote it printable: a carriage return or terminal escape forges nothing."""
    line = "a\rWARNING forged\x1b[31m\x07" + "x" * 40
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, line.encode() + b"\n" + prefill(target.base, 64))
        reason = expect_error(sock, r"^PREFILL: a header line without '=': ", room=None)
    assert reason == f'PREFILL: a header line without \'=\': "{line}"'
    last = target.engine.stats()["last_error"]
    assert last.isprintable() and last == reason.replace("\r", "?").replace("\x1b", "?").replace("\x07", "?")
    assert target.unchanged()


def test_a_prefill_field_written_minus_zero_reads_as_zero_like_msg_number(target):
    data = bytes(range(64))
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64, room="-0"))
        wire.write_frame(sock, wire.LAYER, layer(0, data))
        wire.write_frame(sock, wire.FIRST, b"")
        kind, payload, _ = wire.read_frame(sock)
    assert kind == wire.RESULT and Msg.decode(payload) == Msg({"bytes": 64, "room": 0}), Msg.decode(payload)
    assert bytes(target.region[:64].tolist()) == data and target.guards_unchanged()


def test_chunks_that_stop_short_then_first(target, sender):
    data = bytes(range(32))
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64))
        wire.write_frame(sock, wire.LAYER, layer(0, data))
        wire.write_frame(sock, wire.FIRST, b"")
        expect_error(sock, r"early FIRST frame \(kind 11\) with layer 0 at 32 of 64 bytes")
    # The verified first chunk landed inside the region; nothing else moved.
    assert bytes(target.region[:32].tolist()) == data
    assert bool((target.region[32:] == SENTINEL).all())
    assert target.guards_unchanged()
    good_write(target, sender)


def test_data_beyond_the_announced_total(target):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 8))
        wire.write_frame(sock, wire.LAYER, layer(0, b"\xa5" * 8))
        wire.write_frame(sock, wire.LAYER, layer(0, b"\x01" * 8))
        expect_error(sock, r"LAYER data beyond the announced total: a LAYER frame \(kind 10\) after all 8")
    assert target.unchanged()  # the one legal chunk carried the sentinel itself


def test_wrong_layer_index_and_rows_in_the_layer_header(target):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64))
        wire.write_frame(sock, wire.LAYER, layer(1, b"\x01" * 64))
        expect_error(sock, r"LAYER frame for layer 1 while layer 0 has 0 of 64 bytes")
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64))
        wire.write_frame(sock, wire.LAYER, layer(0, b"\x01" * 64, rows=9))
        expect_error(sock, r"LAYER frame of layer 0 says 9 rows; PREFILL announced 1")
    assert target.unchanged()


def test_short_layer_header_and_empty_layer(target):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64))
        wire.write_frame(sock, wire.LAYER, b"\x00" * 5)
        expect_error(sock, r"LAYER payload shorter than its 16-byte header: 5 bytes")
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64))
        wire.write_frame(sock, wire.LAYER, layer(0, b""))
        expect_error(sock, r"empty LAYER frame in layer 0")
    assert target.unchanged()


# ---------------------------------------------------------------- checksums and kinds

def test_bad_checksum_writes_nothing(target, sender):
    data = b"\x11" * 512
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 512))
        wire.write_frame(sock, wire.LAYER, layer(0, data, checksum=wire.layer_sum(data) ^ 1))
        expect_error(sock, r"LAYER checksum mismatch in layer 0 at offset 0: header 0x[0-9a-f]{16}, "
                           r"computed 0x[0-9a-f]{16}")
    assert target.unchanged()
    good_write(target, sender)


def test_bad_checksum_in_a_later_chunk_stops_there(target):
    good = b"\xa5" * CHUNK  # the sentinel itself, so an honest landing leaves the bytes as they were
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 2 * CHUNK))
        wire.write_frame(sock, wire.LAYER, layer(0, good))
        wire.write_frame(sock, wire.LAYER, layer(0, b"\x22" * CHUNK, checksum=0))
        expect_error(sock, rf"LAYER checksum mismatch in layer 0 at offset {CHUNK}")
    assert target.unchanged()


def test_a_chunk_after_its_region_was_registered_again_lands_nowhere(target):
    """The region is unregistered and registered again between two chunks of one transfer (the
    same address, which a new allocation may get): the registration the PREFILL was checked
    against is gone, so the rest of the transfer is refused."""
    first, second = b"\x11" * CHUNK, b"\x22" * CHUNK
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 2 * CHUNK))
        wire.write_frame(sock, wire.LAYER, layer(0, first))
        deadline = time.monotonic() + 30
        while bytes(target.region[:CHUNK].numpy()) != first:
            assert time.monotonic() < deadline, "the first chunk never landed"
            time.sleep(0.01)
        target.engine.unregister(target.base)
        target.engine.register(target.region)
        wire.write_frame(sock, wire.LAYER, layer(0, second))
        wire.write_frame(sock, wire.FIRST, b"")
        expect_error(sock, r"layer 0: destination \[0x[0-9a-f]+, 0x[0-9a-f]+\) was unregistered during the transfer")
    assert bytes(target.region[CHUNK:2 * CHUNK].numpy()) == bytes([SENTINEL]) * CHUNK
    assert target.guards_unchanged()


@pytest.mark.parametrize("kind", [0, 1, wire.RESULT, 99, 255])
def test_unknown_kind_instead_of_prefill(target, kind):
    with target.connect() as sock:
        wire.write_frame(sock, kind, b"room=1\n\n")
        expect_error(sock, rf"^expected a PREFILL frame, got kind {kind}$", room=None)
    assert target.unchanged()


def test_unknown_kind_mid_transfer(target):
    with target.connect() as sock:
        wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64))
        wire.write_frame(sock, 99, b"x" * 64)
        expect_error(sock, r"unexpected frame \(kind 99\) with layer 0 at 0 of 64 bytes")
    assert target.unchanged()


def test_oversized_prefill_and_zero_length_frame(target):
    with target.connect() as sock:
        sock.sendall(struct.pack("<IB", 0xFFFFFFFF, wire.PREFILL))
        expect_error(sock, r"PREFILL payload of 4294967294 bytes exceeds the limit of 65536 bytes", room=None)
    with target.connect() as sock:
        sock.sendall(struct.pack("<I", 0))
        expect_error(sock, r"zero-length frame has no kind byte", room=None)
    assert target.unchanged()


# ---------------------------------------------------------------- stalls and load

def test_peer_that_stops_mid_frame_does_not_stall_others(sender):
    """The stalled peer is given up only at its receive timeout (10 s here); a listener that served
    it before the next connection would answer it first. So the good write must land while the
    stalled peer still has no answer, and its answer (the timeout) comes after."""
    target = Target(recv_timeout_s=10.0)
    with target.engine, target.connect() as stalled:
        wire.write_frame(stalled, wire.PREFILL, prefill(target.base, 512))
        # A LAYER frame that promises 512 data bytes and delivers 100, then silence.
        stalled.sendall(struct.pack("<IB", 1 + wire.LAYER_HEADER + 512, wire.LAYER)
                        + wire.layer_header(0, 1, 0) + b"\x33" * 100)
        deadline = time.monotonic() + 10
        while target.engine.stats()["active"] < 1:  # the stalled connection holds its slot
            assert time.monotonic() < deadline, "the stalled connection was never taken"
            time.sleep(0.01)
        good_write(target, sender)  # another connection is served while the first hangs
        answered, _, _ = select.select([stalled], [], [], 0)
        assert not answered, "the good write waited for the stalled peer (its timeout had already fired)"
        landed = target.memory.clone()
        stalled.settimeout(40)  # the answer comes only at the listener's 10 s receive timeout
        reason = expect_error(stalled, r"read: timed out waiting for the peer mid-frame in layer 0 "
                                       r"after 100 of 512 data bytes")
        assert reason
        assert torch.equal(target.memory, landed)
        stats = target.engine.stats()
        assert stats["transfers_refused"] == 1 and "timed out" in stats["last_error"]


def test_peer_that_goes_silent_inside_prefill(target):
    msg = prefill(target.base, 64)
    with target.connect() as sock:
        sock.sendall(struct.pack("<IB", 1 + len(msg), wire.PREFILL) + msg[:10])
        expect_error(sock, r"read: timed out waiting for the peer inside PREFILL after 10 of \d+ bytes", room=None)
    assert target.unchanged()


def test_connections_beyond_the_limit_are_refused(target, sender):
    """Four pooled connections, each idle after one transfer and less than evict_after (1 s)
    behind, hold every slot: a fifth is answered "listener busy". (Silent connections would not do:
    one that has sent nothing may be closed for a newcomer at any age.)"""
    same = bytes([SENTINEL]) * 64  # what the region holds: the holders change nothing
    idle = [target.connect() for _ in range(4)]
    try:
        for sock in idle:
            wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64))
            wire.write_frame(sock, wire.LAYER, layer(0, same))
            wire.write_frame(sock, wire.FIRST, b"")
            kind, payload, _ = wire.read_frame(sock)
            assert kind == wire.RESULT and Msg.decode(payload) == Msg({"bytes": 64, "room": 7}), Msg.decode(payload)
        assert target.unchanged()
        deadline = time.monotonic() + 5
        while target.engine.stats()["active"] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        with target.connect() as extra:
            expect_error(extra, r"listener busy: all 4 connections in use", room=None)
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 5
    while target.engine.stats()["active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    good_write(target, sender)
    assert target.engine.stats()["refused"] == 1
    assert target.engine.stats()["evicted"] == 0


def test_many_hostile_peers_at_once(target, sender):
    """Hostile connections in parallel threads; the region and guards survive, the listener serves on."""
    errors: list[BaseException] = []

    def attack(i: int) -> None:
        try:
            with target.connect() as sock:
                if i % 3 == 0:
                    wire.write_frame(sock, wire.PREFILL, prefill(target.end - 4, 8))
                elif i % 3 == 1:
                    wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64))
                    wire.write_frame(sock, wire.LAYER, layer(0, b"\x44" * 64, checksum=1))
                else:
                    wire.write_frame(sock, wire.PREFILL, prefill(target.base, 64))
                    wire.write_frame(sock, wire.LAYER, layer(0, b"\x44" * 128))
                expect_error(sock, r".")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    for wave in range(3):
        threads = [threading.Thread(target=attack, args=(wave * 4 + i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert not errors, errors
    assert target.unchanged()
    good_write(target, sender)


def test_a_chunk_dribbled_in_odd_pieces_still_verifies(target):
    """The listener sums bytes as they arrive; odd recv boundaries must not change the checksum."""
    data = bytes((i * 37 + 11) % 256 for i in range(203))  # not a whole number of words
    frame = struct.pack("<IB", 1 + wire.LAYER_HEADER + len(data), wire.LAYER) + layer(0, data)
    with target.connect() as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wire.write_frame(sock, wire.PREFILL, prefill(target.base + 5, len(data)))
        at = 0
        for size in [3, 5, 7, 1, 13, 17, 2, 64, 9] * 20:
            if at >= len(frame):
                break
            sock.sendall(frame[at:at + size])
            at += size
            time.sleep(0.002)
        sock.sendall(frame[at:])
        wire.write_frame(sock, wire.FIRST, b"")
        kind, payload, _ = wire.read_frame(sock)
        assert kind == wire.RESULT, Msg.decode(payload)
        assert Msg.decode(payload) == Msg({"bytes": len(data), "room": 7})
    assert bytes(target.region[5:5 + len(data)].tolist()) == data
    assert bool((target.region[:5] == SENTINEL).all()) and bool((target.region[5 + len(data):] == SENTINEL).all())
    assert target.guards_unchanged()


def stream(*frames: tuple[int, bytes]) -> bytes:
    """Frames as they go on the wire: u32 LE length of kind and payload, the kind, the payload."""
    return b"".join(struct.pack("<IB", 1 + len(payload), kind) + payload for kind, payload in frames)


def answers(sock: socket.socket) -> list[int]:
    """The kinds of the frames read until the listener closes the connection."""
    kinds = []
    while True:
        try:
            kinds.append(wire.read_frame(sock)[0])
        except FrameError as exc:
            assert "connection closed" in str(exc) or "reset" in str(exc), exc
            return kinds


def test_mutated_transfers_are_refused_or_land_inside_the_region_while_a_transfer_beside_them_lands(target, sender):
    """Streams of valid transfers with bytes flipped, inserted, deleted, duplicated or cut, one connection each,
    while a well-behaved sender writes into another region of the same listener the whole time."""
    engine, src = sender
    beside = torch.full((PAGE,), SENTINEL, dtype=torch.uint8)
    target.engine.register(beside)
    rng = random.Random(9)
    data = bytes(rng.randrange(256) for _ in range(64))
    valid = stream((wire.PREFILL, prefill(target.base + 64, 64)), (wire.LAYER, layer(0, data)), (wire.FIRST, b""))
    stop = threading.Event()
    landed: list[bool] = []

    def write_beside() -> None:
        while not stop.is_set():
            beside.fill_(SENTINEL)
            engine.write(target.engine.session_id, [src.data_ptr()], [beside.data_ptr()], [PAGE])
            landed.append(torch.equal(beside, src))

    writer = threading.Thread(target=write_beside)
    writer.start()
    told: dict[int, int] = {}
    try:
        for _ in range(300):
            with target.connect() as sock:
                try:
                    sock.sendall(mutate_bytes(valid, rng))
                    sock.shutdown(socket.SHUT_WR)  # what did not come never will: no wait for the read timeout
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused before all was sent
                for kind in answers(sock) or [0]:
                    told[kind] = told.get(kind, 0) + 1
            assert target.guards_unchanged()
    finally:
        stop.set()
        writer.join(60)
    assert not writer.is_alive() and landed and all(landed), landed
    assert told.get(wire.ERROR, 0) > 100 and set(told) <= {0, wire.ERROR, wire.RESULT}, told
    good_write(target, sender)

"""transfer.wire_engine's constants, the settings it refuses before opening anything, and how it reads a
peer's answer."""

from __future__ import annotations

import errno
import re

import pytest

from transfer import wire
from transfer.errors import ConfigError, EngineError
from transfer.wire_engine import CHUNK_BYTES, WireEngine, _failure_words, _Refused, _split_session


def test_chunk_size_default_is_four_mib():
    assert CHUNK_BYTES == 4 << 20


@pytest.mark.parametrize("kwargs, named", [
    ({"chunk_bytes": 0}, "chunk_bytes"),
    ({"chunk_bytes": (64 << 20) + 1}, "chunk_bytes"),
    ({"max_connections": 0}, "max_connections"),
    ({"max_connections": 4097}, "max_connections"),
    ({"recv_timeout_s": 0.0}, "recv_timeout_s"),
    ({"idle_timeout_s": float("nan")}, "idle_timeout_s"),
    ({"reply_timeout_s": float("inf")}, "reply_timeout_s"),
    ({"connect_timeout_s": -1.0}, "connect_timeout_s"),
    ({"queue_timeout_s": 0.0}, "queue_timeout_s"),
    ({"first_byte_timeout_s": 0.0}, "first_byte_timeout_s"),
    ({"first_byte_timeout_s": -1.0}, "first_byte_timeout_s"),
    ({"min_rate_bps": -1.0}, "min_rate_bps"),
    ({"min_rate_bps": float("nan")}, "min_rate_bps"),
    ({"evict_after_s": float("nan")}, "evict_after_s"),
    ({"evict_after_s": float("inf")}, "evict_after_s"),
])
def test_settings_out_of_range_are_config_errors_before_any_socket(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        WireEngine("127.0.0.1", **kwargs)


def _answer(kind: int, payload: bytes, room: int = 7, total: int | None = 10) -> Exception | None:
    """What WireEngine makes of a peer's answer to room `room`'s transfer of `total` bytes (None: accepted)."""
    try:
        WireEngine._judge(kind, payload, room, total)
    except Exception as exc:  # noqa: BLE001 - the exception is what is checked
        return exc
    return None


def test_a_result_for_the_room_with_its_bytes_is_accepted():
    assert _answer(wire.RESULT, wire.Msg({"room": 7, "bytes": 10}).encode()) is None
    assert _answer(wire.RESULT, wire.Msg({"room": 7}).encode(), total=None) is None


@pytest.mark.parametrize("kind, payload, said", [
    (99, b"hello", "the peer answered with frame kind 99, expected RESULT or ERROR (the peer does not answer as a"),
    (wire.LAYER, b"\xff\xfe", "the peer answered with frame kind 10, expected RESULT or ERROR"),
    (wire.RESULT, b"junk", "the peer's RESULT (4 bytes) is not a Msg: a header line without '=': \"junk\""),
    (wire.RESULT, wire.Msg({"bytes": 10}).encode(), "the peer's RESULT for room 7: missing room"),
    (wire.RESULT, wire.Msg({"room": "x"}).encode(), "the peer's RESULT for room 7: room: not a number"),
    (wire.RESULT, wire.Msg({"room": 8, "bytes": 10}).encode(), "the peer's RESULT names room 8, not room 7"),
    (wire.RESULT, wire.Msg({"room": 7, "bytes": 9}).encode(), "the peer's RESULT for room 7 says 9 bytes, not 10"),
    (wire.ERROR, wire.Msg({"room": 8}, b"slot busy").encode(), "the peer's ERROR names room 8, not room 7: slot busy"),
])
def test_an_answer_that_is_not_this_rooms_is_an_engine_error_naming_what_it_was(kind, payload, said):
    error = _answer(kind, payload)
    assert type(error) is EngineError and str(error).startswith(said), error


def test_a_result_of_one_long_line_is_an_engine_error_quoting_a_short_part_of_it():
    error = _answer(wire.RESULT, b"junk" * 16384)  # 64 KiB, the most an answer may be
    assert type(error) is EngineError
    assert str(error) == f"the peer's RESULT (65536 bytes) is not a Msg: a header line without '=': \"{'junk' * 16}...\""


@pytest.mark.parametrize("payload, reason", [
    (wire.Msg({"room": 7}, b"destination not registered").encode(), "destination not registered"),
    (wire.Msg({}, b"unreadable PREFILL").encode(), "unreadable PREFILL"),  # no room: it could not read ours
    (wire.Msg({"room": 7}).encode(), "no reason given"),
    (b"room=\xff\n\ndestination not registered",
     "destination not registered (its header unreadable: a message that is not UTF-8)"),
])
def test_this_rooms_error_refuses_the_transfer_with_the_peers_reason(payload, reason):
    error = _answer(wire.ERROR, payload)
    assert type(error) is _Refused and str(error) == reason


@pytest.mark.parametrize("hostname", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_hostname_is_refused_before_any_socket(hostname):
    """The session id is host:port for peers to connect to; a wildcard there would send a remote
    peer's writes to a listener on its own host."""
    with pytest.raises(ConfigError, match=f"hostname '{re.escape(hostname)}' is a wildcard address"):
        WireEngine(hostname)


@pytest.mark.parametrize("session_id", ["0.0.0.0:17000", "[::]:17000", ":::17000"])
def test_a_peers_wildcard_session_id_is_refused_rather_than_connected_to(session_id):
    """A peer that advertised a wildcard would have our writes connect to a listener on our own host."""
    with pytest.raises(EngineError, match=f"session id '{re.escape(session_id)}' names a wildcard address"):
        _split_session(session_id)


# Spellings the system's address parser (which connect() and bind() go through) reads as the unspecified
# address, that ipaddress does not take for one: the inet_aton forms of 0.0.0.0 and an IPv4-mapped 0.0.0.0.
OTHER_WILDCARD_SPELLINGS = ["0", "00", "0.0", "0.0.0", "0x0", "000.000.000.000", "::ffff:0.0.0.0", "[::ffff:0:0]"]


@pytest.mark.parametrize("hostname", OTHER_WILDCARD_SPELLINGS)
def test_a_wildcard_hostname_in_another_spelling_is_refused_before_any_socket(hostname):
    """`0` binds every interface as 0.0.0.0 does: advertised in the session id, it names each peer's own host."""
    with pytest.raises(ConfigError, match=f"hostname '{re.escape(hostname)}' is a wildcard address"):
        WireEngine(hostname)


@pytest.mark.parametrize("host", OTHER_WILDCARD_SPELLINGS)
def test_a_peers_wildcard_session_id_in_another_spelling_is_refused_rather_than_connected_to(host):
    """A session id of `0:17000` connects to a listener on our own host, as one of `0.0.0.0:17000` does."""
    session_id = f"{host}:17000"
    with pytest.raises(EngineError, match=f"session id '{re.escape(session_id)}' names a wildcard address"):
        _split_session(session_id)


@pytest.mark.parametrize("session_id, address", [
    ("127.0.0.1:17000", ("127.0.0.1", 17000)), ("10.0.0.0:17000", ("10.0.0.0", 17000)),
    ("[::1]:17000", ("::1", 17000)), ("[::ffff:10.0.0.1]:17000", ("::ffff:10.0.0.1", 17000)),
    ("fe80::1%lo:17000", ("fe80::1%lo", 17000)), ("node0:17000", ("node0", 17000)),
    ("0.example:17000", ("0.example", 17000)),
])
def test_a_session_id_naming_a_host_is_no_wildcard(session_id, address):
    assert _split_session(session_id) == address


def test_a_peers_session_id_port_past_ints_digit_limit_reads_or_is_refused_as_engine_error():
    """The session id comes from a peer's TransferInfo: a port of 5000 digits is no ValueError of int()'s."""
    zeros = "0" * 5000
    assert _split_session(f"127.0.0.1:{zeros}17000") == ("127.0.0.1", 17000)
    for port in (zeros, "9" * 5000, zeros + "65536"):
        with pytest.raises(EngineError, match="is outside 1..65535"):
            _split_session(f"127.0.0.1:{port}")


_HOSTILE = b"a\nWARNING transfer: forged\r\x1b[31m" + b"x" * (10 << 10)


@pytest.mark.parametrize("kind, payload", [
    (wire.ERROR, wire.Msg({"room": 7}, _HOSTILE).encode()),  # the reason the peer gave
    (wire.ERROR, b"junk\r\x1b[2J\n\n" + _HOSTILE),  # its header unreadable too
    (wire.RESULT, b"junk\r\x1b[2J" * 8 + b"\n\n"),  # the decoder's words quote the line
])
def test_a_peers_answer_is_quoted_as_one_printable_bounded_line(kind, payload):
    # The texts go into failures and logs: a peer's newline, carriage return or terminal escape must
    # not forge a log line, nor its 10 KiB make a long one.
    error = _answer(kind, payload)
    assert isinstance(error, (EngineError, _Refused)) and str(error).isprintable(), error
    assert len(str(error)) < 700, len(str(error))


def test_the_peers_read_timing_out_reads_as_a_timeout_and_its_other_errors_as_refusals():
    timed_out = _Refused("read: timed out waiting for the peer mid-frame in layer 0 after 67931 of 131072 data bytes")
    verb, hint = _failure_words(timed_out)
    assert verb == "timed out at the peer" and "refused" not in verb
    assert "did not reach it within its receive timeout: was the link down, or this sender held up?" in hint
    assert _failure_words(_Refused("destination 0x1000+4096 is not inside registered memory")) == (
        "refused by the peer", "")


@pytest.mark.parametrize("exc", [
    TimeoutError("connect to 10.0.0.7:17000: timed out (connect_timeout_s=10)"),
    OSError(errno.ETIMEDOUT, "read: timed out after 60 s without progress"),
])
def test_a_timeout_on_this_side_says_the_peer_did_not_answer_in_time(exc):
    assert _failure_words(exc) == (
        "failed", "; the peer did not answer in time: was the link down, or is the peer stopped or wedged?")


def test_a_reset_mid_transfer_says_the_peer_closed_the_connection():
    verb, hint = _failure_words(ConnectionResetError(errno.ECONNRESET, "write: connection reset by peer"))
    assert verb == "failed" and "the peer closed the connection mid-transfer" in hint

"""The Python face of native/: framed wire on sockets, the Msg codec and the layer checksum (SPEC.md section 9).

Bytes on the wire
-----------------
Frame: u32 little-endian length of what follows (kind byte + payload), a u8 kind, the
payload (at most ``MAX_PAYLOAD`` = 64 MiB). Reads and writes are whole; EINTR is retried
(pending Python signal handlers run, and one that raises aborts the call); the GIL is
released around the blocking I/O. A socket with a Python timeout is honoured as an idle
timeout: the call fails when no byte moved for that long.

Errors (``FrameError``, an ``OSError`` and a ``TransferError``; ``errno`` is set when an OS call failed):

- ``read: connection closed before a frame header``
- ``read: connection closed inside a frame header after N of 4 bytes``
- ``read: zero-length frame has no kind byte``
- ``read: frame payload of N bytes exceeds the limit of 67108864 bytes`` (before any allocation)
- ``read: connection closed mid-payload after N of M bytes`` (N, M count the kind byte and
  payload, i.e. M is the length field)
- ``read: <strerror>`` / ``write: <strerror>`` (e.g. ``write: Broken pipe``)
- ``read: timed out after T s without progress`` / ``write: ...`` (errno ETIMEDOUT)
- ``write: payload of N bytes exceeds the limit of 67108864 bytes`` (nothing is sent; ``of more than
  18446744073709551615 bytes`` when the parts' lengths add up past 64 bits)

Msg: the header is UTF-8 text of ``key=value`` lines, sorted by key (code point order,
which equals UTF-8 byte order), one per key; then an empty line; then the body as raw
bytes. Decoding: the header ends at the first empty line (a message without one is all
header, with an empty body); the whole header is checked as UTF-8 first
(``a message that is not UTF-8``), then each line is split at its first ``=`` (values may
contain ``=``; a line without one is ``a header line without '=': "<line>"``, the line's
first 64 bytes at most, cut back to a whole character and marked ``...``); a repeated
key keeps its last value; no CR stripping. Keys must not contain ``=`` or a newline and
values no newline (``ValueError`` on ``set``). ``number`` accepts an optional sign and
ASCII digits only, in ``-2**63 .. 2**64-1`` (so u64 checksums fit).

LAYER payload: u32 LE layer, u32 LE rows, u64 LE checksum of the data, the data. The
checksum (``layer_sum``) is the wrapping (mod 2**64) sum of the little-endian u64 words
of the bytes, a short tail zero-padded to 8 bytes.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterable, Mapping
from enum import IntEnum
from typing import Any

from . import _native
from .errors import ConfigError, ConfigTypeError

__all__ = [
    "DECODE",
    "ERROR",
    "FIRST",
    "GEN",
    "LAYER",
    "LAYER_HEADER",
    "MAX_PAYLOAD",
    "PREFILL",
    "RESULT",
    "FrameError",
    "Kind",
    "LayerError",
    "Msg",
    "MsgError",
    "layer_frame",
    "layer_header",
    "layer_sum",
    "parse_layer",
    "read_frame",
    "tensor_layer_sum",
    "write_frame",
    "write_frame_parts",
]

MAX_PAYLOAD: int = _native.MAX_PAYLOAD
LAYER_HEADER: int = _native.LAYER_HEADER

FrameError = _native.FrameError
MsgError = _native.MsgError
LayerError = _native.LayerError

_U64 = (1 << 64) - 1


class Kind(IntEnum):
    """Frame kinds of SPEC.md section 9."""

    GEN = 1
    DECODE = 2
    PREFILL = 3
    LAYER = 10
    FIRST = 11
    RESULT = 20
    ERROR = 21


GEN = Kind.GEN
DECODE = Kind.DECODE
PREFILL = Kind.PREFILL
LAYER = Kind.LAYER
FIRST = Kind.FIRST
RESULT = Kind.RESULT
ERROR = Kind.ERROR


def endpoint(sock_or_fd: Any) -> tuple[int, float]:
    """Returns (fd, idle timeout in seconds or -1) for a socket object or an int fd."""
    if isinstance(sock_or_fd, int) and not isinstance(sock_or_fd, bool):
        return sock_or_fd, -1.0
    fileno = getattr(sock_or_fd, "fileno", None)
    if fileno is None:
        raise ConfigTypeError(f"need a socket or an int fd, not {type(sock_or_fd).__name__}")
    fd = fileno()  # a closed socket gives -1, which the OS reports as EBADF
    timeout = sock_or_fd.gettimeout() if isinstance(sock_or_fd, socket.socket) else None
    return fd, -1.0 if timeout is None else float(timeout)


def _kind(kind: int) -> int:
    """Checks that a kind fits the u8 on the wire: ConfigTypeError when it is no int (a bool neither),
    ConfigError when it is one outside 0..255."""
    if isinstance(kind, bool) or not isinstance(kind, int):
        raise ConfigTypeError(f"frame kind must be an int in 0..255, got {type(kind).__name__} {kind!r}")
    if not 0 <= kind <= 255:
        raise ConfigError(f"frame kind must be an int in 0..255, got {kind!r}")
    return int(kind)


def write_frame(sock_or_fd: Any, kind: int, payload: Any) -> None:
    """Writes one whole frame (header and payload in one gather write)."""
    fd, timeout = endpoint(sock_or_fd)
    _native.write_frame(fd, _kind(kind), (payload,), timeout)


def write_frame_parts(sock_or_fd: Any, kind: int, parts: Iterable[Any]) -> None:
    """Writes one frame whose payload is the concatenation of parts, without joining them."""
    fd, timeout = endpoint(sock_or_fd)
    _native.write_frame(fd, _kind(kind), tuple(parts), timeout)


def read_frame(sock_or_fd: Any, limit: int | None = None, min_rate: float = 0.0) -> tuple[int, bytes, int]:
    """Reads one whole frame: (kind, payload, microseconds the payload took after its header).

    `limit` caps the payload's length (default MAX_PAYLOAD), refused before anything is
    allocated. The socket's timeout bounds each wait for progress; `min_rate` > 0 (bytes/s)
    also bounds the whole read, to that timeout plus `limit` bytes at that rate (ValueError on
    a blocking socket, whose wait nothing could cut short)."""
    fd, timeout = endpoint(sock_or_fd)
    return _native.read_frame(fd, timeout, limit, min_rate)


class Msg:
    """A small key=value message with a raw body; encode/decode run in the native core."""

    __slots__ = ("_fields", "body")

    def __init__(self, fields: Mapping[str, str | int] | None = None, body: Any = b"") -> None:
        """Starts a message from optional fields and a body (any buffer)."""
        self._fields: dict[str, str] = {}
        self.body: bytes = bytes(body)
        for key, value in (fields or {}).items():
            self.set(key, value)

    def set(self, key: str, value: str | int) -> Msg:
        """Sets (or replaces) a field; ints are stored as their decimal text."""
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ConfigTypeError(f"Msg value of {key!r} must be str or int, not {type(value).__name__}")
        text = value if isinstance(value, str) else str(int(value))
        _native.msg_check(key, text)
        self._fields[key] = text
        return self

    def get(self, key: str, default: str | None = None) -> str | None:
        """Returns a field's text, or default when absent."""
        return self._fields.get(key, default)

    def number(self, key: str) -> int:
        """Reads a field as a decimal integer (optional sign, ASCII digits, -2**63..2**64-1)."""
        text = self._fields.get(key)
        if text is None:
            raise MsgError(f"missing {key}")
        digits = text[1:] if text[:1] in ("+", "-") else text
        if not digits or not digits.isascii() or not digits.isdigit():
            raise MsgError(f"{key}: not a number")
        # Leading zeros are legal, however many (the listener reads them so): int() gets only the
        # significant digits, which also keeps it clear of its own 4300-digit limit (a ValueError).
        significant = digits.lstrip("0")
        if len(significant) > 20:
            raise MsgError(f"{key}: not a number")
        value = int(significant or "0")
        if text[0] == "-":
            value = -value
        if not -(1 << 63) <= value <= _U64:
            raise MsgError(f"{key}: not a number")
        return value

    def keys(self) -> list[str]:
        """The field names, sorted as they are encoded."""
        return sorted(self._fields)

    def fields(self) -> dict[str, str]:
        """A copy of the fields."""
        return dict(self._fields)

    def __contains__(self, key: object) -> bool:
        """Whether the field is set."""
        return key in self._fields

    def __eq__(self, other: object) -> bool:
        """Equal when fields and body are."""
        if not isinstance(other, Msg):
            return NotImplemented
        return self._fields == other._fields and self.body == other.body

    def __repr__(self) -> str:
        """Shows the fields and the body's size."""
        return f"Msg({self._fields!r}, body={len(self.body)} bytes)"

    def encode(self) -> bytes:
        """Sorted key=value lines, an empty line, then the body."""
        return _native.msg_encode(self._fields, self.body)

    @classmethod
    def decode(cls, data: Any) -> Msg:
        """Parses encoded bytes; raises MsgError with SPEC.md's messages."""
        fields, body = _native.msg_decode(data)
        msg = cls()
        msg._fields = fields
        msg.body = body
        return msg


def _torch_tensor(obj: Any) -> bool:
    """True for a torch.Tensor, without importing torch when nobody else has."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def layer_sum(buf_or_addr: Any, length: int | None = None) -> int:
    """Wrapping u64 sum of the little-endian words of a buffer, a CPU tensor, or (address, length)."""
    if length is not None:
        return _native.layer_sum_addr(buf_or_addr, length)
    if isinstance(buf_or_addr, tuple):
        if len(buf_or_addr) != 2:
            raise ConfigTypeError("layer_sum needs (address, length), a buffer or a CPU tensor")
        return _native.layer_sum_addr(*buf_or_addr)
    if _torch_tensor(buf_or_addr):
        t = buf_or_addr
        if t.device.type != "cpu":
            raise ConfigError(f"layer_sum reads host memory; use tensor_layer_sum for a {t.device} tensor")
        if not t.is_contiguous():
            raise BufferError("layer_sum needs a contiguous tensor")
        # The call reads through the tensor's pointer while `t` keeps its storage alive.
        return _native.layer_sum_addr(t.data_ptr(), t.numel() * t.element_size())
    return _native.layer_sum(buf_or_addr)


def _torch_layer_sum(t: Any) -> int:
    """The checksum computed by torch ops on the tensor's device (bit-identical to layer_sum)."""
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() == 0:
        return 0  # an empty tensor has stride 0 and cannot be viewed as int64
    pad = (-flat.numel()) % 8
    if pad or flat.storage_offset() % 8:
        # An int64 view needs whole words from a word-aligned offset: an aligned, zero-padded copy.
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # int64 adds wrap in two's complement, the same bits as the unsigned sum mod 2**64.
    total = flat.view(torch.int64).sum(dtype=torch.int64)
    return int(total.item()) & _U64


def tensor_layer_sum(t: Any) -> int:
    """layer_sum of a torch tensor's bytes (in logical order) on any device."""
    t = t.detach()
    if t.device.type == "cpu":
        return layer_sum(t if t.is_contiguous() else t.contiguous())
    return _torch_layer_sum(t)


def layer_header(layer: int, rows: int, checksum: int) -> bytes:
    """The 16-byte LAYER header, for streaming the data after it without a copy."""
    return _native.layer_header(layer, rows, checksum)


def layer_frame(layer: int, rows: int, data: Any) -> bytes:
    """A whole LAYER payload: header with the data's checksum, then the data."""
    return _native.layer_frame(layer, rows, data)


def parse_layer(payload: Any) -> tuple[int, int, memoryview]:
    """Verifies a LAYER payload and returns (layer, rows, a view of its data)."""
    layer, rows = _native.parse_layer(payload)
    return layer, rows, memoryview(payload).cast("B")[LAYER_HEADER:]

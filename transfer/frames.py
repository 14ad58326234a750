"""Control-plane frame codecs, shard geometry and fanout validation (SPEC.md sections 2, 4, 6, 8).

Pure: no sockets, no torch. Every parser raises only `WireError`, whose
messages are exactly SPEC.md's because peers' logs and tests match them; a
caller's bad argument (a shard outside its group, a room that does not fit, an
unknown dtype) raises `ConfigError`.
"""

from __future__ import annotations

import operator
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from transfer.core.failure import cut_printable, printable
from transfer.errors import ConfigError, ConfigTypeError, WireError
from transfer.status import TransferPoll

__all__ = [
    "CANCEL_MARKER",
    "CANCEL_PARTS",
    "CANCEL_READS_WRITE_FAILED",
    "CANCEL_UNASKED",
    "DEEPSTACK_ROW_BYTES_PART",
    "DTYPE_BYTES",
    "MAX_REGIONS_PER_SESSION",
    "REGISTRATION_MARKER",
    "REGISTRATION_PARTS",
    "STATUS_PARTS",
    "TRANSFER_INFO_PARTS",
    "Cancel",
    "CancelAnswer",
    "CancelReply",
    "FAILURE_MARKER",
    "MAX_REASON_BYTES",
    "Registration",
    "TransferInfo",
    "UnreadableChecksum",
    "WireError",
    "cancel_frames",
    "cancel_reply_frames",
    "check_parallel",
    "check_region",
    "check_room",
    "dtype_size",
    "is_cancel",
    "is_registration",
    "normalize_dtype",
    "parse_cancel",
    "parse_cancel_reply",
    "parse_failure_reason",
    "parse_registration",
    "parse_status",
    "registration_frames",
    "prefill_shard",
    "receiver_text",
    "scalar_int",
    "scalar_ints",
    "shown",
    "shard_rows",
    "status_frames",
    "validate_fanout",
]

TRANSFER_INFO_PARTS = 13
#: Our TransferInfo part 13 (docs/protocol.md 8): the receiver's deepstack row bytes, optional.
DEEPSTACK_ROW_BYTES_PART = TRANSFER_INFO_PARTS
REGISTRATION_PARTS = 6
STATUS_PARTS = 3
MAX_CHECKSUMS = 2
REGISTRATION_MARKER = b"None"
#: Our cancel (SPEC.md 8, docs/protocol.md 8): 5 parts, part 0 this marker, and optionally
#: CANCEL_READS_WRITE_FAILED as part 5. A peer reads any request whose part 0 is not `None`
#: as a TransferInfo and drops it as malformed (5 or 6 parts < 13), so it never reaches a
#: peer's room rules.
CANCEL_MARKER = b"Cancel"
CANCEL_PARTS = 5
#: A cancel's part 5 when its sender reads CancelAnswer.WRITE_FAILED (earlier releases did not).
CANCEL_READS_WRITE_FAILED = b"reads-write-failed"
#: A cancel's part 5 when its sender failed the room before asking for it (an unasked cancel): the
#: room's fanout cannot complete; no answer is awaited. A rank that does not read it takes a plain cancel
#: of a room that sender has nothing parked for, which stops nothing.
CANCEL_UNASKED = b"unasked"


class CancelAnswer(Enum):
    """A cancel's answer: a Failed status whose part 3 is its value instead of a checksum.

    Only a rank that sent a cancel is ever sent one.
    """

    CONFIRMED = b"cancel-confirmed"  # nothing was or will be written into that receiver's memory now
    TOO_LATE = b"cancel-too-late"  # a write was in flight; CONFIRMED or WRITE_FAILED follows once it is over
    WRITE_FAILED = b"cancel-write-failed"  # a write in flight failed: bytes it carried may still land later


_CANCEL_ANSWERS = {answer.value: answer for answer in CancelAnswer}

#: Why the encode side failed a room (docs/protocol.md 8): a Failed status whose part 3 is this
#: marker carries the encode side's failure kind in part 4 and its detail in part 5. Six parts,
#: so it is never taken for a cancel's answer (exactly four); a peer reads the first three.
FAILURE_MARKER = b"failure"
#: The reason's bounds, on both ends: a detail is cut to this many bytes (UTF-8) when sent and
#: when read, and a kind is a short token, so no peer can make a receiver log more than that.
MAX_REASON_BYTES = 512
MAX_REASON_KIND = 32

#: Regions our encode ranks remember per prefill session, newest announcement last (a
#: main buffer plus per-item fallbacks). Our prefill side announces a region again before
#: it can fall out, so both sides must agree on the number.
MAX_REGIONS_PER_SESSION = 64

_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1
_U64_MAX = (1 << 64) - 1
_ADDRESS_END = 1 << 64  # one past the last byte a u64 pointer names
# Native byte order, standard 8-byte size: SPEC.md's struct.pack("Q", p) without alignment padding.
_POINTER = struct.Struct("=Q")
_POINTER_PAIR = struct.Struct("=QQ")
#: The endpoint, session id and dtype (exact, ASCII strs) TransferInfo.to_frames() encoded last, and their
#: ASCII bytes; replaced whole, so a thread reads one consistent tuple.
_last_ask_texts: tuple[str, str, str, tuple[bytes, bytes, bytes]] = ("", "", "", (b"", b"", b""))
#: The most digits the shortcuts hand to int() at once: every number of a message at its widest.
_PLAIN_DIGITS = 20 * 8
_set_attribute = object.__setattr__
# bytes pattern: [0-9] matches ASCII digits only, and fullmatch rejects a trailing newline.
_DECIMAL = re.compile(rb"[+-]?[0-9]+")

DTYPE_BYTES: dict[str, int] = {
    "torch.bfloat16": 2,
    "torch.float16": 2,
    "torch.float32": 4,
    "torch.float64": 8,
    "torch.int8": 1,
    "torch.uint8": 1,
    "torch.int16": 2,
    "torch.int32": 4,
    "torch.int64": 8,
    "torch.float8_e4m3fn": 1,
    "torch.float8_e5m2": 1,
    "torch.bool": 1,
}


class UnreadableChecksum(WireError):
    """A status whose SPEC parts are sound but whose checksum part (ours, SPEC.md 8) is not.

    Carries what did parse, so the receiver can conclude the room with a reason
    instead of dropping the status and leaving the room to its deadline.
    """

    def __init__(self, message: str, room: int, status: TransferPoll, rank: int) -> None:
        super().__init__(message)
        self.room, self.status, self.rank = room, status, rank


# ---------------------------------------------------------------- geometry


def shard_rows(span: int, rank: int, size: int) -> tuple[int, int]:
    """Return (row_start, row_count) of `rank`'s balanced contiguous shard of `span` rows over `size` ranks."""
    if size <= 0:
        raise ConfigError(f"shard size must be positive, got {size}")
    if not 0 <= rank < size:
        raise ConfigError(f"shard rank {rank} outside [0, {size})")
    if span < 0:
        raise ConfigError(f"span must be >= 0, got {span}")
    base, rem = divmod(span, size)
    return rank * base + min(rank, rem), base + (1 if rank < rem else 0)


def prefill_shard(span: int, tp_rank: int, tp_size: int, encode_tp: int = 1, *,
                  per_block: bool = False) -> tuple[int, int]:
    """Return (row_start, row_count) of the rows prefill tp-rank `tp_rank` receives of a `span`-row item.

    By default the item is split over the whole prefill group, as the reference peer
    does, so each encode rank writes only its block's share and the whole group
    rebuilds the rows. `per_block=True` splits it over the `tp_size // encode_tp`
    ranks of the rank's encode block instead (every encode rank then writes the whole
    item, and each block rebuilds it on its own). With prefill dp groups, `tp_rank` and
    `tp_size` are the rank within its dp group and that group's size (SPEC.md section 5's
    `r % local_tp` and `local_tp`). ConfigError for a rank outside [0, tp_size), by either split.
    """
    if encode_tp <= 0 or tp_size % encode_tp:
        raise ConfigError(f"prefill tp {tp_size} is not a multiple of encode tp {encode_tp}")
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"prefill tp rank {tp_rank} outside [0, tp size {tp_size}): pass the rank within its "
                          f"dp group and that group's tp size")
    if not per_block:
        return shard_rows(span, tp_rank, tp_size)
    fanout = tp_size // encode_tp
    return shard_rows(span, tp_rank % fanout, fanout)


def check_parallel(engine_rank: int, tp_size: int, dp_size: int) -> tuple[int, int, int]:
    """(engine_rank, tp_size, dp_size) as ints; ConfigError unless engine_rank is one of tp_size ranks split
    into dp_size groups (ConfigTypeError: one is not an integer)."""
    engine_rank, tp_size, dp_size = (_integer(name, value) for name, value in
                                     (("engine rank", engine_rank), ("tp size", tp_size), ("dp size", dp_size)))
    for name, size in (("tp size", tp_size), ("dp size", dp_size)):
        if size <= 0:
            raise ConfigError(f"{name} must be at least 1, not {size} (tp size: the ranks of the role's tensor "
                              f"parallel group; dp size: the data parallel groups they are split into)")
    if tp_size % dp_size:
        raise ConfigError(f"tp size {tp_size} is not a multiple of dp size {dp_size}")
    if not 0 <= engine_rank < tp_size:
        raise ConfigError(f"engine rank {engine_rank} outside [0, tp size {tp_size})")
    return engine_rank, tp_size, dp_size


def size_problem(name: str, value: object, least: int = 0) -> str | None:
    """What is wrong with a size given as `value` (a bool or non-integer, or below `least`: 0 or 1), or None."""
    if type(value) is int and value >= least:  # the common case, without a call
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        return f"{name} must be {'a positive' if least else 'a non-negative'} integer, got {value!r}"
    return None


def _boolean(value: object) -> bool:
    """Whether `value` is a bool: Python's, numpy's (`numpy.bool_`) or a torch tensor of `torch.bool` (numpy
    before 2.3 and torch index these as 0 and 1, so they would pass for numbers). Neither is imported here."""
    kind = type(value)
    if kind is bool:
        return True
    module = kind.__module__
    if module == "numpy":
        return kind.__name__ in ("bool", "bool_")  # numpy 2's name, numpy 1's
    return module.startswith("torch") and str(getattr(value, "dtype", None)) == "torch.bool"


def _integer(name: str, value: object) -> int:
    """`value` as a plain int (a numpy or torch integer scalar is one); ConfigTypeError for a bool or a non-integer."""
    if type(value) is int:
        return value
    if _boolean(value) or not hasattr(type(value), "__index__"):
        raise ConfigTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)  # type: ignore[arg-type]


#: torch.Tensor, once scalar_int() was given one (torch is not imported here): a plain tensor is then told by
#: its type, without a call (scalar_ints(), and the session manager's destination checks).
torch_tensor: type[Any] | None = None


def scalar_int(value: Any) -> Any:
    """`value` as a plain int when it is a numpy or torch integer scalar (as a pointer or size computed
    with numpy is), else unchanged: a bool, a float or a tensor of rows is left for the checks to refuse."""
    global torch_tensor
    if value is None or type(value) is int or _boolean(value) or not hasattr(type(value), "__index__"):
        return value
    if type(value).__name__ == "Tensor" and type(value).__module__ == "torch":
        torch_tensor = type(value)
    if hasattr(value, "data_ptr") and value.dim() != 0:
        return value
    try:
        return operator.index(value)
    except TypeError:  # a tensor that is no integer scalar, say
        return value


def scalar_ints(*values: Any) -> tuple:
    """`scalar_int` of each value; plain ints, Nones and plain tensors of one dimension or more (the common
    cases, which scalar_int() leaves as they are) pass without a call each."""
    for value in values:
        if value is not None and type(value) is not int and not (type(value) is torch_tensor and value.ndim):
            return tuple([v if v is None or type(v) is int else scalar_int(v) for v in values])
    return values


def check_room(room: int) -> int:
    """`room` as a plain int (a tensor or numpy scalar would key the room's books by identity, not number);
    ConfigError unless it fits the wire: a non-negative signed 64-bit integer (ConfigTypeError: not an int)."""
    if type(room) is int and 0 <= room <= _I64_MAX:  # the common case, with no call
        return room
    room = _integer("room", room)
    if room < 0:
        raise ConfigError(f"negative room {room}")
    if room > _I64_MAX:
        raise ConfigError(f"room {room} does not fit the wire's signed 64 bits")
    return room


def _dtype_name(dtype: object) -> str | None:
    """The wire's name (`torch.NAME`) of a torch.dtype, `"torch.NAME"` or `"NAME"`; None when unknown."""
    if isinstance(dtype, str):
        name = dtype if dtype.startswith("torch.") else f"torch.{dtype}"
    elif type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch":
        name = str(dtype)  # str(torch.bfloat16) == "torch.bfloat16", without importing torch here
    else:
        return None
    return name if name in DTYPE_BYTES else None


# The wire's name of each torch.dtype normalize_dtype() took (one entry a name of DTYPE_BYTES at most), and the
# type of those (torch.dtype, once one came; torch is not imported here): every receive() names its dtype so.
_torch_dtype_names: dict[object, str] = {}
_torch_dtype: type | None = None


def normalize_dtype(dtype: object) -> str:
    """The wire's dtype name for a `torch.dtype`, `"torch.bfloat16"` or `"bfloat16"`; ConfigError otherwise."""
    global _torch_dtype
    if type(dtype) is _torch_dtype and dtype in _torch_dtype_names:  # a torch.dtype taken before: no call
        return _torch_dtype_names[dtype]
    name = _dtype_name(dtype)
    if name is not None and type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch":
        _torch_dtype = type(dtype)
        _torch_dtype_names[dtype] = name
    if name is None:
        raise ConfigError(f"unknown dtype {dtype!r}: the wire carries only "
                          f"{', '.join(n.removeprefix('torch.') for n in DTYPE_BYTES)} (a torch.dtype, or its name "
                          f"with or without 'torch.')")
    return name


def dtype_size(dtype: object) -> int:
    """Bytes per element of a `torch.dtype`, `"torch.NAME"` or `"NAME"`; WireError when unknown."""
    size = DTYPE_BYTES.get(dtype) if type(dtype) is str else None  # the wire's own spelling: one look-up
    if size is not None:
        return size
    name = _dtype_name(dtype)
    if name is None:
        raise WireError(f"unknown dtype {dtype!r}")
    return DTYPE_BYTES[name]


# ---------------------------------------------------------------- part codecs


def _part(frame: object) -> bytes:
    """One received part as bytes (accepts bytes, bytearray, memoryview, zmq.Frame)."""
    if isinstance(frame, bytes):
        return frame
    return bytes(memoryview(frame))  # type: ignore[arg-type]


def _text(part: bytes, name: str) -> str:
    """Decode an ASCII text part."""
    if not part.isascii():
        raise WireError(f"{name} must be ASCII")
    return part.decode("ascii")


def _decimal(part: bytes, name: str, low: int = _I64_MIN, high: int = _I64_MAX) -> int:
    """Parse an optional sign and ASCII digits within [low, high]; anything else is not an integer."""
    if _DECIMAL.fullmatch(part) is None:
        raise WireError(f"{name} is not an integer")
    # Leading zeros are legal, however many: int() is given only the significant digits, so a huge
    # part costs nothing and never meets int()'s own digit limit (a ValueError past 4300 digits).
    significant = part.lstrip(b"+-").lstrip(b"0")
    if len(significant) > 20:
        raise WireError(f"{name} is not an integer")
    value = int(significant or b"0")
    if part[:1] == b"-":
        value = -value
    if not low <= value <= high:
        raise WireError(f"{name} is not an integer")
    return value


def _number(part: bytes, name: str) -> int:
    """A TransferInfo/registration number: ASCII first, then a signed 64-bit decimal."""
    if not part.isascii():
        raise WireError(f"{name} must be ASCII")
    return _decimal(part, name)


def _pointer(part: bytes, name: str) -> int:
    """An 8-byte native-order pointer part."""
    if len(part) != _POINTER.size:
        raise WireError(f"{name} must be 8 bytes")
    return _POINTER.unpack(part)[0]


def _port(value: int) -> int:
    """Check a port is a u16."""
    if not 0 <= value <= 0xFFFF:
        raise WireError("invalid port")
    return value


def _encode_int(value: object, name: str, low: int = _I64_MIN, high: int = _I64_MAX) -> bytes:
    """Encode an integer as ASCII decimal, refusing what the parser would refuse."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise WireError(f"{name} is not an integer") from None
    if not low <= number <= high:
        raise WireError(f"{name} is not an integer")
    return str(number).encode("ascii")


def _encode_text(value: object, name: str) -> bytes:
    """Encode an ASCII text field."""
    if not isinstance(value, str) or not value.isascii():
        raise WireError(f"{name} must be ASCII")
    return value.encode("ascii")


def _encode_pointer(value: object, name: str) -> bytes:
    """Encode a pointer as 8 native-order bytes."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise WireError(f"{name} is not an integer") from None
    if not 0 <= number <= _U64_MAX:
        raise WireError(f"{name} does not fit 8 bytes")
    return _POINTER.pack(number)


def _encode_room(room: object) -> bytes:
    """Encode a room (non-negative signed 64-bit)."""
    encoded = _encode_int(room, "room")
    if encoded.startswith(b"-"):
        raise WireError("negative room")
    return encoded


def _encode_port(port: object) -> bytes:
    """Encode a port (u16)."""
    encoded = _encode_int(port, "port")
    _port(int(encoded))
    return encoded


# ---------------------------------------------------------------- TransferInfo (4.2)


@dataclass(frozen=True, init=False)
class TransferInfo:
    """One prefill rank's request for one room's rows (SPEC.md 4.2, 13 parts).

    `deepstack_row_bytes` is our optional part 13 (docs/protocol.md 8): the bytes of one
    deepstack row of the receiver's layout, None when the part is absent (a peer's ask).
    """

    room: int
    endpoint: str
    port: int
    session_id: str
    embedding_ptr: int
    deepstack_ptr: int
    rows: int
    hidden: int
    dtype: str
    has_deepstack: bool
    fanout: int
    row_start: int
    span: int
    deepstack_row_bytes: int | None = None

    def __init__(self, room: int, endpoint: str, port: int, session_id: str, embedding_ptr: int, deepstack_ptr: int,
                 rows: int, hidden: int, dtype: str, has_deepstack: bool, fanout: int, row_start: int,
                 span: int, deepstack_row_bytes: int | None = None) -> None:
        """The generated __init__'s signature and fields, set at once rather than one frozen __setattr__ each."""
        # Built for every ask on both sides; the generated __init__ pays one object.__setattr__ per field.
        _set_attribute(self, "__dict__", {
            "room": room, "endpoint": endpoint, "port": port, "session_id": session_id, "embedding_ptr": embedding_ptr,
            "deepstack_ptr": deepstack_ptr, "rows": rows, "hidden": hidden, "dtype": dtype,
            "has_deepstack": has_deepstack, "fanout": fanout, "row_start": row_start, "span": span,
            "deepstack_row_bytes": deepstack_row_bytes})

    @property
    def is_identity(self) -> bool:
        """True when this receiver gets the item's full span (no row sharding)."""
        return self.row_start == 0 and self.rows == self.span

    @property
    def receiver(self) -> str:
        """The receiver's name in reasons and logs (its Mooncake session id)."""
        return self.session_id

    def row_bytes(self) -> int:
        """Bytes of one embedding row: hidden * element size."""
        return self.hidden * dtype_size(self.dtype)

    def to_frames(self) -> list[bytes]:
        """Encode as the 13 parts of SPEC.md 4.2, and part 13 when `deepstack_row_bytes` is set; raises
        WireError for a value the parser would refuse."""
        global _last_ask_texts
        room, port, emb, ds = self.room, self.port, self.embedding_ptr, self.deepstack_ptr
        rows, hidden, fanout, row_start, span = self.rows, self.hidden, self.fanout, self.row_start, self.span
        endpoint, session, dtype = self.endpoint, self.session_id, self.dtype
        # The common case: exact ints in range and ASCII strs, which encode as the strict encoders
        # below would (b"%d" of an exact int is its str() in ASCII; an exact str encodes as ASCII exactly
        # when it is ASCII). Anything else, a bool or an IntEnum among them, takes the strict encoders
        # and their errors.
        if (type(room) is type(port) is type(emb) is type(ds) is type(rows) is type(hidden) is type(fanout)
                is type(row_start) is type(span) is int and type(endpoint) is type(session) is type(dtype) is str
                and 0 <= room <= _I64_MAX and 0 <= port <= 0xFFFF and 0 <= emb <= _U64_MAX and 0 <= ds <= _U64_MAX
                and _I64_MIN <= rows <= _I64_MAX and _I64_MIN <= hidden <= _I64_MAX and _I64_MIN <= fanout <= _I64_MAX
                and _I64_MIN <= row_start <= _I64_MAX and _I64_MIN <= span <= _I64_MAX):
            last_endpoint, last_session, last_dtype, texts = _last_ask_texts
            # The very str objects encoded last: their bytes are those (a prefill rank asks with the same three).
            if endpoint is not last_endpoint or session is not last_session or dtype is not last_dtype:
                try:
                    texts = endpoint.encode("ascii"), session.encode("ascii"), dtype.encode("ascii")
                except UnicodeEncodeError:
                    return self._checked_frames()
                _last_ask_texts = endpoint, session, dtype, texts
            pointers = _POINTER_PAIR.pack(emb, ds)  # "=QQ": the two "=Q" packs back to back, with no padding
            parts = [b"%d" % room, texts[0], b"%d" % port, texts[1],
                     pointers[:8], pointers[8:], b"%d" % rows, b"%d" % hidden, texts[2],
                     b"1" if self.has_deepstack else b"0", b"%d" % fanout, b"%d" % row_start, b"%d" % span]
            width = self.deepstack_row_bytes
            if width is None:
                return parts
            if type(width) is int and 0 <= width <= _I64_MAX:
                parts.append(b"%d" % width)
                return parts
        return self._checked_frames()

    def _checked_frames(self) -> list[bytes]:
        """The parts through the strict encoders, which refuse what the parser would refuse."""
        parts = [
            _encode_room(self.room),
            _encode_text(self.endpoint, "endpoint"),
            _encode_port(self.port),
            _encode_text(self.session_id, "session"),
            _encode_pointer(self.embedding_ptr, "embedding pointer"),
            _encode_pointer(self.deepstack_ptr, "deepstack pointer"),
            _encode_int(self.rows, "rows"),
            _encode_int(self.hidden, "hidden"),
            _encode_text(self.dtype, "dtype"),
            b"1" if self.has_deepstack else b"0",
            _encode_int(self.fanout, "fanout"),
            _encode_int(self.row_start, "row_start"),
            _encode_int(self.span, "span"),
        ]
        if self.deepstack_row_bytes is not None:
            parts.append(_encode_length(self.deepstack_row_bytes, "deepstack row bytes"))
        return parts

    @classmethod
    def from_frames(cls, frames: Sequence[object]) -> TransferInfo:
        """Parse SPEC.md 4.2's parts in order, then our optional part 13; the first failure is the one raised.

        Part 13 is ours when it is a non-negative decimal; anything else there reads as absent,
        since SPEC.md 4.2 has a peer's parts beyond 13 ignored. Later parts are ignored.
        """
        info = cls._from_plain_frames(frames)
        if info is not None:
            return info
        frames = list(frames)
        if len(frames) < TRANSFER_INFO_PARTS:
            raise WireError(f"malformed EmbeddingTransferInfo frame: {len(frames)} parts < {TRANSFER_INFO_PARTS}")
        parts = [_part(f) for f in frames[:TRANSFER_INFO_PARTS + 1]]
        room = _number(parts[0], "room")
        if room < 0:
            raise WireError("negative room")
        endpoint = _text(parts[1], "endpoint")
        port = _port(_number(parts[2], "port"))
        session_id = _text(parts[3], "session")
        embedding_ptr = _pointer(parts[4], "embedding pointer")
        deepstack_ptr = _pointer(parts[5], "deepstack pointer")
        rows = _number(parts[6], "rows")
        hidden = _number(parts[7], "hidden")
        dtype = _text(parts[8], "dtype")
        # Anything but "1" reads as false, as the peers do.
        has_deepstack = parts[9] == b"1"
        fanout = _number(parts[10], "fanout")
        row_start = _number(parts[11], "row_start")
        span = _number(parts[12], "span")
        deepstack_row_bytes = (_optional_length(parts[DEEPSTACK_ROW_BYTES_PART])
                               if len(parts) > DEEPSTACK_ROW_BYTES_PART else None)
        return cls(room, endpoint, port, session_id, embedding_ptr, deepstack_ptr, rows, hidden, dtype,
                   has_deepstack, fanout, row_start, span, deepstack_row_bytes)

    @classmethod
    def _from_plain_frames(cls, frames: Sequence[object]) -> TransferInfo | None:
        """The common case in a few steps: 13 well-formed bytes parts, or 14 with our part 13, or None
        (then parse strictly).

        Accepts only what the strict parser accepts, with the same values: bytes parts
        (a zmq.Frame would not compare equal to b"1"), numbers of plain ASCII digits in
        range, ASCII texts and 8-byte pointers. Anything else returns None.
        """
        if type(frames) is not list:
            return None
        count = len(frames)
        if count == TRANSFER_INFO_PARTS:
            room, endpoint, port, session, emb, ds, rows, hidden, dtype, has_ds, fanout, row_start, span = frames
            width = b"0"  # stands in for the absent part 13 in the checks below; its value is not kept
        elif count == TRANSFER_INFO_PARTS + 1:
            room, endpoint, port, session, emb, ds, rows, hidden, dtype, has_ds, fanout, row_start, span, width = frames
        else:
            return None
        if not (type(room) is type(endpoint) is type(port) is type(session) is type(emb) is type(ds) is type(rows)
                is type(hidden) is type(dtype) is type(has_ds) is type(fanout) is type(row_start) is type(span)
                is type(width) is bytes):
            return None
        # One digit check for all eight numbers: bytes.isdigit() is ASCII digits only, so no sign, space
        # or underscore reaches int(); an empty part is int()'s ValueError. The length bound keeps
        # int()'s work small; the ranges below reject what is too large.
        digits = b"".join((room, port, rows, hidden, fanout, row_start, span, width))
        if not digits.isdigit() or len(digits) > _PLAIN_DIGITS or len(emb) != 8 or len(ds) != 8:
            return None
        try:
            room_n, port_n, rows_n, hidden_n = int(room), int(port), int(rows), int(hidden)
            fanout_n, row_start_n, span_n, width_n = int(fanout), int(row_start), int(span), int(width)
            # UnicodeDecodeError is a ValueError: a non-ASCII text goes to the strict parser's message.
            endpoint_s, session_s, dtype_s = endpoint.decode("ascii"), session.decode("ascii"), dtype.decode("ascii")
        except ValueError:
            return None
        if not (port_n <= 0xFFFF and room_n <= _I64_MAX and rows_n <= _I64_MAX and hidden_n <= _I64_MAX
                and fanout_n <= _I64_MAX and row_start_n <= _I64_MAX and span_n <= _I64_MAX
                and width_n <= _I64_MAX):
            return None
        emb_n, ds_n = _POINTER_PAIR.unpack(emb + ds)
        return cls(room_n, endpoint_s, port_n, session_s, emb_n, ds_n, rows_n, hidden_n, dtype_s, has_ds == b"1",
                   fanout_n, row_start_n, span_n, width_n if count > TRANSFER_INFO_PARTS else None)


# ---------------------------------------------------------------- Registration (4.1, 8)


@dataclass(frozen=True)
class Registration:
    """A prefill rank's registration with an encode rank (SPEC.md 4.1; lengths are section 8's extension)."""

    endpoint: str
    port: int
    session_id: str
    embedding_base: int
    deepstack_base: int
    embedding_len: int | None = None
    deepstack_len: int | None = None

    @property
    def has_lengths(self) -> bool:
        """True when the registration carries region lengths (our peers-ignored extension)."""
        return self.embedding_len is not None

    def to_frames(self) -> list[bytes]:
        """Encode as registration parts (see registration_frames)."""
        return registration_frames(self.endpoint, self.port, self.session_id, self.embedding_base,
                                   self.deepstack_base, self.embedding_len, self.deepstack_len)


def registration_frames(endpoint: str, port: int, session_id: str, embedding_base: int, deepstack_base: int,
                        embedding_len: int | None = None, deepstack_len: int | None = None) -> list[bytes]:
    """Encode a registration: 6 parts, or 8 with region lengths (a missing deepstack length is sent as 0)."""
    parts = [
        REGISTRATION_MARKER,
        _encode_text(endpoint, "endpoint"),
        _encode_port(port),
        _encode_text(session_id, "session"),
        _encode_pointer(embedding_base, "embedding pointer"),
        _encode_pointer(deepstack_base, "deepstack pointer"),
    ]
    if embedding_len is None and deepstack_len is not None:
        raise WireError("a deepstack length needs an embedding length")
    if embedding_len is not None:
        parts.append(_encode_length(embedding_len, "embedding length"))
        parts.append(_encode_length(0 if deepstack_len is None else deepstack_len, "deepstack length"))
    return parts


def _encode_length(value: object, name: str) -> bytes:
    """Encode a region length (non-negative)."""
    encoded = _encode_int(value, name)
    if encoded.startswith(b"-"):
        raise WireError(f"negative {name}")
    return encoded


def _length(part: bytes, name: str) -> int:
    """Parse a region length part."""
    value = _number(part, name)
    if value < 0:
        raise WireError(f"negative {name}")
    return value


def _optional_length(part: bytes) -> int | None:
    """A part of ours past the SPEC's: its length, or None where it is none (a peer's extra part)."""
    try:
        return _length(part, "length")
    except WireError:
        return None


def _starts_with(frames: Sequence[object], marker: bytes) -> bool:
    """True exactly when part 0 is `marker`."""
    if type(frames) is list and frames and type(frames[0]) is bytes:
        return frames[0] == marker  # what a receiver hands in: no copy, no conversion
    frames = list(frames)
    if not frames:
        return False
    try:
        return _part(frames[0]) == marker
    except TypeError:
        return False


def is_registration(frames: Sequence[object]) -> bool:
    """True exactly when part 0 is the literal `None` (SPEC.md 4.1)."""
    return _starts_with(frames, REGISTRATION_MARKER)


def parse_registration(frames: Sequence[object]) -> Registration:
    """Parse a registration's parts in order; parts 6 and 7 (region lengths) are optional, later ones ignored."""
    frames = list(frames)
    if len(frames) < REGISTRATION_PARTS:
        raise WireError(f"malformed registration frame: {len(frames)} parts < {REGISTRATION_PARTS}")
    parts = [_part(f) for f in frames[:REGISTRATION_PARTS + 2]]
    if parts[0] != REGISTRATION_MARKER:
        raise WireError("registration part 0 must be None")
    endpoint = _text(parts[1], "endpoint")
    port = _port(_number(parts[2], "port"))
    session_id = _text(parts[3], "session")
    embedding_base = _pointer(parts[4], "embedding pointer")
    deepstack_base = _pointer(parts[5], "deepstack pointer")
    embedding_len = _length(parts[6], "embedding length") if len(parts) > 6 else None
    deepstack_len = _length(parts[7], "deepstack length") if len(parts) > 7 else None
    return Registration(endpoint, port, session_id, embedding_base, deepstack_base, embedding_len, deepstack_len)


# ---------------------------------------------------------------- Status (4.3, 8)


#: Each status's wire part, looked up by member or by its plain int (an IntEnum hashes as its value).
_STATUS_CODES: dict[int, bytes] = {member: b"%d" % member.value for member in TransferPoll}
#: Each status by its wire value: the member itself, without the enum's call.
_STATUS_MEMBERS: dict[int, TransferPoll] = {member.value: member for member in TransferPoll}


def status_frames(room: int, status: TransferPoll | int, rank: int, checksums: Iterable[int] = (),
                  reason: tuple[str, str] | None = None) -> list[bytes]:
    """Encode a status: 3 parts, plus one ASCII u64 per checksum (embedding, then deepstack).

    `reason` (kind, detail), on a Failed status only, adds the failure-reason parts
    instead: the marker, the kind and the detail cut to MAX_REASON_BYTES.
    """
    # The common case: exact ints in range and a tuple of at most two checksums, encoded as the
    # strict encoders would; anything else (a reason among them) takes them and their errors.
    # (`not checksums[2:]`: at most two, without a call; `in` then `[]`: the code, without one either.)
    if (reason is None and type(room) is type(rank) is int and type(checksums) is tuple and not checksums[2:]
            and 0 <= room <= _I64_MAX and _I64_MIN <= rank <= _I64_MAX
            and (type(status) is TransferPoll or type(status) is int)):
        if status in _STATUS_CODES:
            parts = [b"%d" % room, _STATUS_CODES[status], b"%d" % rank]
            for checksum in checksums:
                if type(checksum) is not int or not 0 <= checksum <= _U64_MAX:
                    break
                parts.append(b"%d" % checksum)
            else:
                return parts
    return _checked_status_frames(room, status, rank, checksums, reason)


def _checked_status_frames(room: object, status: object, rank: object, checksums: Iterable[int],
                           reason: tuple[str, str] | None) -> list[bytes]:
    """status_frames through the strict encoders, which refuse what the parser would refuse."""
    checksums = tuple(checksums)
    if len(checksums) > MAX_CHECKSUMS:
        raise WireError(f"at most {MAX_CHECKSUMS} checksums, got {len(checksums)}")
    encoded_status = _encode_int(status, "status")
    if int(encoded_status) not in TransferPoll._value2member_map_:
        raise WireError("unknown status")
    parts = [_encode_room(room), encoded_status, _encode_int(rank, "rank")]
    parts.extend(_encode_int(c, "checksum", 0, _U64_MAX) for c in checksums)
    if reason is not None:
        if int(encoded_status) != TransferPoll.Failed or checksums:
            raise WireError("only a Failed status without checksums carries a reason")
        kind, detail = reason
        if not _REASON_KIND.fullmatch(kind):
            raise WireError(f"a reason's kind is a lower-case token of at most {MAX_REASON_KIND} characters, "
                            f"got {kind[:MAX_REASON_KIND]!r}")
        parts += [FAILURE_MARKER, kind.encode("ascii"), _cut_detail(detail)]
    return parts


def parse_status(frames: Sequence[object]) -> tuple[int, TransferPoll, int, tuple[int, ...]]:
    """Parse a status into (room, status, rank, checksums); errors in SPEC.md 4.3's order."""
    if type(frames) is list and STATUS_PARTS <= len(frames) <= STATUS_PARTS + MAX_CHECKSUMS:
        plain = _plain_status(frames)
        if plain is not None:
            return plain
    frames = list(frames)
    if len(frames) < STATUS_PARTS:
        raise WireError("an EPD status has 3 frames")
    parts = [_part(f) for f in frames[:STATUS_PARTS + MAX_CHECKSUMS]]
    # Status numbers have no ASCII step: a non-ASCII (or non-UTF-8) part simply fails the digit grammar.
    room = _decimal(parts[0], "room")
    if room < 0:
        raise WireError("negative room")
    code = _decimal(parts[1], "status")
    if code not in TransferPoll._value2member_map_:
        raise WireError("unknown status")
    rank = _decimal(parts[2], "rank")
    if code == TransferPoll.Failed and len(parts) > STATUS_PARTS and parts[STATUS_PARTS] == FAILURE_MARKER:
        return room, TransferPoll.Failed, rank, ()  # a reason, not checksums: parse_failure_reason reads it
    try:
        checksums = tuple(_decimal(p, "checksum", 0, _U64_MAX) for p in parts[STATUS_PARTS:])
    except WireError as exc:
        raise UnreadableChecksum(str(exc), room, TransferPoll(code), rank) from None
    return room, TransferPoll(code), rank, checksums


def _plain_status(frames: list[object]) -> tuple[int, TransferPoll, int, tuple[int, ...]] | None:
    """parse_status's common case: 3 to 5 bytes parts of plain ASCII digits in range, or None (then parse strictly)."""
    for part in frames:
        if type(part) is not bytes:
            return None
    # As in TransferInfo's shortcut: one digit check, int() raising ValueError only for an empty part.
    parts: list[bytes] = frames  # type: ignore[assignment]  # bytes, each checked above (cast() is a call)
    digits = b"".join(parts)
    if not digits.isdigit() or len(digits) > _PLAIN_DIGITS:
        return None
    try:
        room, code, rank, *checksums = map(int, parts)
    except ValueError:
        return None
    status = _STATUS_MEMBERS.get(code)
    if status is None or room > _I64_MAX or rank > _I64_MAX or (checksums and max(checksums) > _U64_MAX):
        return None
    return room, status, rank, tuple(checksums)


def parse_failure_reason(frames: Sequence[object]) -> tuple[str, str] | None:
    """The (kind, detail) a Failed status carries (ours, docs/protocol.md 8), or None when it carries none.

    Never raises: the status itself already said Failed, and a reason that does not
    parse must not cost the room that conclusion. What a peer sent is bounded (a kind
    of at most MAX_REASON_KIND characters, a detail of at most MAX_REASON_BYTES bytes)
    and made printable, since it goes into logs and failure texts.
    """
    try:
        frames = list(frames)
        if len(frames) <= STATUS_PARTS or _part(frames[STATUS_PARTS]) != FAILURE_MARKER:
            return None
        kind = _part(frames[STATUS_PARTS + 1]) if len(frames) > STATUS_PARTS + 1 else b""
        detail = _part(frames[STATUS_PARTS + 2]) if len(frames) > STATUS_PARTS + 2 else b""
    except TypeError:
        return None
    kind_text = printable(kind[:MAX_REASON_KIND].decode("ascii", "replace"))
    # A character the cut splits (or any invalid byte) reads as U+FFFD.
    detail_text = printable(detail[:MAX_REASON_BYTES].decode("utf-8", "replace"))
    if len(detail) > MAX_REASON_BYTES:
        detail_text += "..."
    return kind_text or "other", detail_text


_REASON_KIND = re.compile(rf"[a-z][a-z0-9_]{{0,{MAX_REASON_KIND - 1}}}")


def _cut_detail(detail: str) -> bytes:
    """A reason's detail as UTF-8, cut (marked `...`) to MAX_REASON_BYTES without splitting a character."""
    data = detail.encode("utf-8", "replace")
    if len(data) <= MAX_REASON_BYTES:
        return data
    return data[:MAX_REASON_BYTES - 3].decode("utf-8", "ignore").encode("utf-8") + b"..."


#: How much of a receiver's session id a failure text quotes: real ones are an address and a port.
MAX_SESSION_SHOWN = 128


def receiver_text(session_id: str) -> str:
    """A peer's session id as failure texts quote it: printable, at most MAX_SESSION_SHOWN characters."""
    return shown(session_id, MAX_SESSION_SHOWN)


#: How much of a host a peer announced a log line quotes: real ones are an IP address.
MAX_HOST_SHOWN = 64


def host_text(host: str) -> str:
    """A host a peer announced (its status endpoint) as log lines quote it: printable, at most
    MAX_HOST_SHOWN characters."""
    return shown(host, MAX_HOST_SHOWN)


def shown(text: str, limit: int = MAX_REASON_BYTES) -> str:
    """A text a peer sent, fit for a log line or a failure text: printable, and at most `limit`
    characters (a longer one is cut and marked `...`)."""
    return cut_printable(text, limit)


# ---------------------------------------------------------------- Cancel (ours, docs/protocol.md 8)


@dataclass(frozen=True)
class Cancel:
    """A prefill rank gave up on a room it asked for: write nothing more into its memory for it; or
    (`unasked`) it failed the room before asking for it: it will not ask for the room's item."""

    room: int
    endpoint: str
    port: int
    session_id: str
    reads_write_failed: bool = False  # its sender reads CancelAnswer.WRITE_FAILED
    unasked: bool = False  # its sender never asked for this room: no answer is awaited

    def to_frames(self) -> list[bytes]:
        """Encode as cancel parts (see cancel_frames)."""
        return cancel_frames(self.room, self.endpoint, self.port, self.session_id, self.reads_write_failed,
                             unasked=self.unasked)


def cancel_frames(room: int, endpoint: str, port: int, session_id: str, reads_write_failed: bool = False,
                  *, unasked: bool = False) -> list[bytes]:
    """Encode a cancel: the marker, room, status endpoint, port and session (the ask's), and whether
    its sender reads a WRITE_FAILED answer, or (`unasked`, which takes part 5 instead) that it never asked."""
    frames = [CANCEL_MARKER, _encode_room(room), _encode_text(endpoint, "endpoint"), _encode_port(port),
              _encode_text(session_id, "session")]
    if unasked:
        frames.append(CANCEL_UNASKED)
    elif reads_write_failed:
        frames.append(CANCEL_READS_WRITE_FAILED)
    return frames


def is_cancel(frames: Sequence[object]) -> bool:
    """True exactly when part 0 is the cancel marker."""
    return _starts_with(frames, CANCEL_MARKER)


def parse_cancel(frames: Sequence[object]) -> Cancel:
    """Parse a cancel's parts in order; later parts than the optional part 5 are ignored."""
    frames = list(frames)
    if len(frames) < CANCEL_PARTS:
        raise WireError(f"malformed cancel frame: {len(frames)} parts < {CANCEL_PARTS}")
    parts = [_part(f) for f in frames[:CANCEL_PARTS]]
    if parts[0] != CANCEL_MARKER:
        raise WireError("cancel part 0 must be Cancel")
    room = _number(parts[1], "room")
    if room < 0:
        raise WireError("negative room")
    endpoint = _text(parts[2], "endpoint")
    port = _port(_number(parts[3], "port"))
    session_id = _text(parts[4], "session")
    flag = _part(frames[CANCEL_PARTS]) if len(frames) > CANCEL_PARTS else None
    return Cancel(room, endpoint, port, session_id, flag == CANCEL_READS_WRITE_FAILED, unasked=flag == CANCEL_UNASKED)


@dataclass(frozen=True)
class CancelReply:
    """An encode rank's answer to a cancel."""

    room: int
    rank: int
    answer: CancelAnswer


def cancel_reply_frames(room: int, rank: int, answer: CancelAnswer) -> list[bytes]:
    """Encode a cancel's answer: a Failed status with the answer in part 3."""
    return [_encode_room(room), _encode_int(int(TransferPoll.Failed), "status"), _encode_int(rank, "rank"),
            answer.value]


def parse_cancel_reply(frames: Sequence[object]) -> CancelReply | None:
    """The cancel answer a status carries, or None when it is a plain status (parse it with parse_status)."""
    if type(frames) is list and (len(frames) != STATUS_PARTS + 1 or type(frames[STATUS_PARTS]) is bytes
                                 and frames[STATUS_PARTS] not in _CANCEL_ANSWERS):
        return None  # every plain status, without a copy
    frames = list(frames)
    if len(frames) != STATUS_PARTS + 1:
        return None
    try:
        marker = _part(frames[STATUS_PARTS])
    except TypeError:
        return None
    answer = _CANCEL_ANSWERS.get(marker)
    if answer is None:
        return None
    room, status, rank, _ = parse_status(frames[:STATUS_PARTS])
    if status is not TransferPoll.Failed:
        raise WireError("a cancel answer must be Failed")
    return CancelReply(room, rank, answer)


# ---------------------------------------------------------------- encode-side checks (6, 8)


def validate_fanout(span: int, hidden: int, dtype: str, has_deepstack: bool, infos: Iterable[TransferInfo],
                    fanout: int | None = None, deepstack_row_bytes: int | None = None) -> str | None:
    """Check a room's whole receiver set against its item (SPEC.md 6); return the first violation or None.

    `fanout` defaults to the number of infos. `deepstack_row_bytes` is the item's deepstack
    row bytes: with deepstack on the item, a receiver whose ask carries its own (our part 13)
    must agree with it; an ask without the part (a peer's) is not checked for it.

    A set is valid when every receiver agrees with the item and either all are
    identity, or the non-empty shards, sorted by row_start, tile one contiguous range
    inside [0, span) with no gap or overlap: the block's share of shards taken over
    the whole prefill group, or all of [0, span) when a peer shards per block. A block whose shards are all empty
    (span smaller than the group) is valid and writes nothing. Mixed sets are judged
    by the tiling rule, which is what makes span < fanout valid (shard 0 then holds
    all rows and looks like identity, the others are empty).
    """
    infos = list(infos)
    if not infos:
        return "no receivers to validate"
    room = infos[0].room
    want = len(infos) if fanout is None else fanout
    if len(infos) != want:
        return f"room {room}: {len(infos)} receivers != fanout {want}"
    for info in infos:
        # A receiver agreeing with the item, neither with deepstack: _receiver_mismatch()'s None, without its call.
        if (info.room == room and info.fanout == want and info.hidden == hidden and info.dtype == dtype
                and info.span == span and not has_deepstack and not info.has_deepstack
                and info.rows >= 0 and info.row_start >= 0 and info.row_start + info.rows <= span):
            continue
        reason = _receiver_mismatch(info, room, want, span, hidden, dtype, has_deepstack, deepstack_row_bytes)
        if reason is not None:
            return f"room {room}: receiver {receiver_text(info.session_id)} {reason}"
    if len(set(map(_SESSION, infos))) != want:  # some session asked twice: the first repeat is named
        seen: set[str] = set()
        for info in infos:
            if info.session_id in seen:
                return f"room {room}: receiver {receiver_text(info.session_id)} asked twice"
            seen.add(info.session_id)
    for info in infos:
        if info.row_start != 0 or info.rows != info.span:  # not info.is_identity
            return _tiling_gap(room, infos)
    return None  # every one is identity


def _receiver_mismatch(info: TransferInfo, room: int, fanout: int, span: int, hidden: int, dtype: str,
                       has_deepstack: bool, deepstack_row_bytes: int | None = None) -> str | None:
    """One receiver's disagreement with the item, or None."""
    if info.room != room:
        return f"is for room {info.room}"
    if info.fanout != fanout:
        return f"fanout {info.fanout} != fanout {fanout}"
    if info.hidden != hidden:
        return f"hidden {info.hidden} != item hidden {hidden}"
    if info.dtype != dtype:
        return f"dtype {info.dtype} != item dtype {dtype}"
    if info.span != span:
        return f"span {info.span} != item span {span}"
    if bool(info.has_deepstack) != bool(has_deepstack):
        return f"deepstack {bool(info.has_deepstack)} != item deepstack {bool(has_deepstack)}"
    if (has_deepstack and deepstack_row_bytes is not None and info.deepstack_row_bytes is not None
            and info.deepstack_row_bytes != deepstack_row_bytes):
        return f"deepstack row bytes {info.deepstack_row_bytes} != item deepstack row bytes {deepstack_row_bytes}"
    if info.rows < 0 or info.row_start < 0 or info.row_start + info.rows > span:
        return f"shard rows [{info.row_start}, {info.row_start + info.rows}) outside [0, {span})"
    return None


_SHARD_ORDER = operator.attrgetter("row_start", "rows")
_SESSION = operator.attrgetter("session_id")


def _tiling_gap(room: int, infos: list[TransferInfo]) -> str | None:
    """Check the non-empty shards, sorted by row_start, tile one contiguous range with no gap or overlap."""
    shards = sorted([i for i in infos if i.rows > 0], key=_SHARD_ORDER)
    if not shards:
        return None
    previous = shards[0]
    end = previous.row_start + previous.rows
    for info in shards[1:]:
        if info.row_start < end:
            return (f"room {room}: receivers {receiver_text(previous.session_id)} and "
                    f"{receiver_text(info.session_id)} overlap on rows "
                    f"[{info.row_start}, {min(end, info.row_start + info.rows)})")
        if info.row_start > end:
            return (f"room {room}: rows [{end}, {info.row_start}) have no receiver "
                    f"(gap before {receiver_text(info.session_id)})")
        end, previous = info.row_start + info.rows, info
    return None


def check_region(info: TransferInfo, registration: Registration, row_bytes: int,
                 deepstack_row_bytes: int) -> str | None:
    """Check the write ranges lie inside the registered regions (SPEC.md 8); None when fine or lengths unknown."""
    region_len = registration.embedding_len
    if region_len is not None:
        ptr, length, base = info.embedding_ptr, info.rows * row_bytes, registration.embedding_base
        # Inside, or empty: _outside()'s None, without its call.
        if length and not (length > 0 and base <= ptr and ptr + length <= base + region_len
                           and ptr + length <= _ADDRESS_END):
            reason = _outside("embedding", ptr, length, base, region_len)
            if reason is not None:
                return f"room {info.room}: receiver {receiver_text(info.session_id)} {reason}"
    if info.has_deepstack and registration.deepstack_len is not None:
        reason = _outside("deepstack", info.deepstack_ptr, info.rows * deepstack_row_bytes,
                          registration.deepstack_base, registration.deepstack_len)
        if reason is not None:
            return f"room {info.room}: receiver {receiver_text(info.session_id)} {reason}"
    return None


def _outside(what: str, ptr: int, length: int, base: int, region_len: int) -> str | None:
    """Describe [ptr, ptr+length) escaping [base, base+region_len), or None; an empty write always fits.

    A region announced past the end of the address space ends there: a range beyond it would wrap to
    its bottom, outside the region.
    """
    if length == 0:
        return None  # a zero-row shard writes nothing, so no address is touched
    if length > 0 and base <= ptr and ptr + length <= min(base + region_len, _ADDRESS_END):
        return None
    return (f"{what} range [{ptr:#x}, {ptr + length:#x}) ({length} bytes) outside registered region "
            f"[{base:#x}, {base + region_len:#x})")

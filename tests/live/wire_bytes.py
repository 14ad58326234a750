"""Raw bytes of the framed wire, for tests that play a peer by hand."""

from __future__ import annotations

import struct

from transfer import wire
from transfer.wire import Msg


def frame(kind: int, payload: bytes) -> bytes:
    """One whole frame's bytes."""
    return struct.pack("<IB", 1 + len(payload), kind) + payload


def transfer_bytes(dest: int, data: bytes) -> bytes:
    """A whole well-formed transfer (room 7, one layer, rows 1) of data to dest."""
    msg = Msg({"room": 7, "layers": 1, "rows": 1, "row_bytes": len(data), "ptr": dest, "ptr0": dest,
               "bytes0": len(data)}).encode()
    layer = wire.layer_header(0, 1, wire.layer_sum(data)) + data
    return frame(wire.PREFILL, msg) + frame(wire.LAYER, layer) + frame(wire.FIRST, b"")

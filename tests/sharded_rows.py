"""Items the reassembly tests share (unit and live): reproducible rows, and a rank's destination before reassembly."""

from __future__ import annotations

import torch

from transfer.frames import shard_rows

HIDDEN = 6
GARBAGE = 0xA5  # what a rank's destination holds outside its own shard before reassembly


def original(room: int, span: int, dtype: torch.dtype, cols: int = HIDDEN) -> torch.Tensor:
    """The item's true rows, reproducible from the room number."""
    generator = torch.Generator().manual_seed(1000 + room * 7 + cols)
    raw = torch.randint(0, 256, (span, cols * torch.empty((), dtype=dtype).element_size()),
                        dtype=torch.uint8, generator=generator)
    return raw.view(dtype).contiguous()


def destination(rows: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """A full-size destination holding only this rank's shard of `rows`, garbage elsewhere."""
    dst = torch.full_like(rows.view(torch.uint8), GARBAGE).view(rows.dtype).contiguous()
    start, count = shard_rows(rows.shape[0], rank, size)
    dst[start : start + count] = rows[start : start + count]
    return dst


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

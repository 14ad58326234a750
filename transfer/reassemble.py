"""Rebuilding sharded rows across the prefill ranks of a block (issue 4, SPEC.md sections 1-2).

With row sharding, prefill rank `r` of a block receives only the rows
`shard_rows(span, r, block_size)` of each item. Once every rank's room concluded,
`reassemble` runs on every rank of the block, in the same order with the same
items, and:

1. agrees on the outcome with one MIN all-reduce: an item that failed on any rank
   (or whose geometry differs between ranks) fails on all of them;
2. rebuilds the full rows of every agreed item with ONE all-gather for the whole
   batch: each rank packs its shard rows (embedding, then deepstack) of every
   item into one flat byte buffer padded to the largest rank's size, and unpacks
   the other ranks' shards into place.

A failed item's tensors are never touched, so no rank consumes half-received rows.
Works on gloo (CPU tensors) and NCCL (CUDA tensors); the agreement tensor lives on
the items' device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from transfer.frames import DTYPE_BYTES, shard_rows

log = logging.getLogger(__name__)

__all__ = ["ShardedItem", "agree", "reassemble"]

# Dtype names in a fixed order, so a dtype travels in the agreement as a small integer.
_DTYPE_NAMES = list(DTYPE_BYTES)


@dataclass
class ShardedItem:
    """One room on one rank: its full-size destination (own shard filled), outcome and deepstack."""

    room: int
    full: torch.Tensor  # [span, hidden]
    ok: bool
    deepstack: torch.Tensor | None = None  # [span, hidden * k]


def _default_device(group: Any) -> torch.device:
    """Where a collective's tensors must live for the group's backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(oks: Sequence[bool], group: Any = None, *, keys: Sequence[Sequence[int]] | None = None,
          device: torch.device | str | None = None) -> list[bool]:
    """Per-item outcome agreed by all ranks (one MIN all-reduce): True only where every rank said True.

    `keys`, when given, holds one tuple of integers per item that must be equal on
    every rank (e.g. the item's geometry); an item whose keys differ fails on all
    ranks. Every rank must pass the same number of items (and of keys per item).
    """
    count = len(oks)
    if keys is not None and len(keys) != count:
        raise ValueError(f"agree: {len(keys)} keys for {count} items")
    if count == 0:
        return []
    width = len(keys[0]) if keys else 0
    # Row per item: [ok, k..., -k...]; MIN of -k is -(MAX of k), so one MIN finds disagreement.
    table = torch.zeros((count, 1 + 2 * width), dtype=torch.int64)
    for i, ok in enumerate(oks):
        table[i, 0] = 1 if ok else 0
        if width:
            row = [int(k) for k in keys[i]]
            if len(row) != width:
                raise ValueError(f"agree: item {i} has {len(row)} keys, item 0 has {width}")
            table[i, 1 : 1 + width] = torch.tensor(row, dtype=torch.int64)
            table[i, 1 + width :] = -table[i, 1 : 1 + width]
    target = torch.device(device) if device is not None else _default_device(group)
    reduced = table.to(target)
    dist.all_reduce(reduced, op=dist.ReduceOp.MIN, group=group)
    reduced = reduced.cpu()
    agreed = reduced[:, 0] == 1
    if width:
        agreed &= (reduced[:, 1 : 1 + width] == -reduced[:, 1 + width :]).all(dim=1)
    return [bool(v) for v in agreed]


def _check_item(item: ShardedItem, device: torch.device) -> str | None:
    """Why this rank cannot take part with `item` (None when it can)."""
    full = item.full
    if full.dim() != 2 or not full.is_contiguous():
        return f"full tensor of shape {tuple(full.shape)} is not a contiguous [span, hidden] tensor"
    if full.device != device:
        return f"full tensor is on {full.device}, the batch on {device}"
    ds = item.deepstack
    if ds is not None:
        if ds.dim() != 2 or not ds.is_contiguous() or ds.shape[0] != full.shape[0]:
            return (f"deepstack of shape {tuple(ds.shape)} is not a contiguous "
                    f"[{full.shape[0]}, hidden * k] tensor")
        if ds.device != device:
            return f"deepstack is on {ds.device}, the batch on {device}"
    return None


def _dtype_code(tensor: torch.Tensor | None) -> int:
    """A number for the tensor's dtype that every rank computes alike (-1: none or unlisted)."""
    if tensor is None:
        return -1
    try:
        return _DTYPE_NAMES.index(str(tensor.dtype))
    except ValueError:
        return -1


def _keys(item: ShardedItem) -> tuple[int, int, int, int, int]:
    """Geometry every rank must share: span, row bytes, dtype, deepstack row bytes and dtype."""
    full = item.full
    span = int(full.shape[0]) if full.dim() >= 1 else -1
    row_bytes = full.shape[1] * full.element_size() if full.dim() == 2 else -1
    ds = item.deepstack
    ds_bytes = ds.shape[1] * ds.element_size() if ds is not None and ds.dim() == 2 else -1
    return (span, row_bytes, _dtype_code(full), ds_bytes, _dtype_code(ds))


def _rows_bytes(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of a contiguous 2-D tensor as a flat uint8 view."""
    return tensor.view(torch.uint8)[start : start + count].reshape(-1)


def _shard_views(item: ShardedItem, rank: int, size: int) -> list[torch.Tensor]:
    """The flat byte views of `rank`'s shard of `item`: embedding rows, then deepstack rows."""
    start, count = shard_rows(item.full.shape[0], rank, size)
    views = [_rows_bytes(item.full, start, count)]
    if item.deepstack is not None:
        views.append(_rows_bytes(item.deepstack, start, count))
    return views


def _shard_bytes(items: Sequence[ShardedItem], rank: int, size: int) -> int:
    """Bytes of `rank`'s packed shards of `items` (embedding and deepstack rows)."""
    total = 0
    for item in items:
        _, count = shard_rows(item.full.shape[0], rank, size)
        row = item.full.shape[1] * item.full.element_size()
        if item.deepstack is not None:
            row += item.deepstack.shape[1] * item.deepstack.element_size()
        total += count * row
    return total


def _gather(packed: torch.Tensor, size: int, group: Any) -> list[torch.Tensor]:
    """Every rank's equal-size `packed` buffer, in group rank order, with one collective."""
    out = torch.empty(size * packed.numel(), dtype=torch.uint8, device=packed.device)
    single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
    if single is not None and _gather_into_supported(group):
        single(out, packed, group=group)
        return list(out.view(size, packed.numel()).unbind(0))
    parts = list(out.view(size, packed.numel()).unbind(0))
    dist.all_gather(parts, packed, group=group)
    return parts


def _gather_into_supported(group: Any) -> bool:
    """Whether the backend gathers into one tensor (NCCL always; gloo since torch 2.1)."""
    if dist.get_backend(group) == "nccl":
        return True
    return torch.__version__ >= (2, 1)  # TorchVersion compares with tuples


def reassemble(items: Sequence[ShardedItem], group: Any = None, *, block_size: int | None = None,
               rank_in_block: int | None = None) -> list[bool]:
    """Rebuild the full rows of every item that succeeded on all ranks; returns agreed success flags.

    Call on every rank of the block (the group) with the same items in the same
    order. One all-reduce agrees on the outcome, one all-gather rebuilds the rows.
    An item flagged False is left exactly as it was.
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    block_size = size if block_size is None else block_size
    rank_in_block = rank if rank_in_block is None else rank_in_block
    if block_size != size:
        raise ValueError(f"reassemble: block_size {block_size} differs from the group's {size} ranks "
                         f"(the group must be exactly the block)")
    if rank_in_block != rank:
        raise ValueError(f"reassemble: rank_in_block {rank_in_block} differs from the group rank {rank} "
                         f"(shards are gathered in group rank order)")
    if not items:
        return []
    device = items[0].full.device
    oks = []
    for item in items:
        problem = _check_item(item, device)
        if problem is not None:
            # Not raising: the other ranks are already in the collective; fail the item everywhere.
            log.warning("room %s on rank %d of the block: %s; failing it", item.room, rank, problem)
        oks.append(bool(item.ok) and problem is None)
    agreed = agree(oks, group, keys=[_keys(item) for item in items], device=device)
    chosen = [item for item, ok in zip(items, agreed) if ok]
    if size > 1 and chosen:
        _exchange(chosen, rank, size, group, device)
    return agreed


def _exchange(items: list[ShardedItem], rank: int, size: int, group: Any, device: torch.device) -> None:
    """One all-gather of every rank's packed shards, then unpack the others' rows into place."""
    padded = max(_shard_bytes(items, r, size) for r in range(size))
    if padded == 0:
        return  # nothing but empty shards (every span is 0)
    packed = torch.zeros(padded, dtype=torch.uint8, device=device)
    offset = 0
    for item in items:
        for view in _shard_views(item, rank, size):
            packed[offset : offset + view.numel()].copy_(view)
            offset += view.numel()
    gathered = _gather(packed, size, group)
    for other in range(size):
        if other == rank:
            continue
        source, offset = gathered[other], 0
        for item in items:
            for view in _shard_views(item, other, size):
                view.copy_(source[offset : offset + view.numel()])
                offset += view.numel()

"""Rebuilding sharded rows across the prefill ranks that share an item (SPEC.md sections 1-2).

With row sharding, each prefill rank receives only its shard of each item: by default
`prefill_shard(span, r, P, E)`, a split over the whole prefill group of P ranks (then
the group to pass here is that whole group), or with per-block sharding a split over
the `P // E` ranks of its encode rank's block (then pass the block's group). Either way
rank r of the group holds `shard_rows(span, r, group size)`. Once every rank's room
concluded, `reassemble` runs on every rank of the group, in the same order with the same
items, and:

1. agrees on the outcome with one MIN all-reduce (two for batches of more than
   314 items): an item that failed on any rank (or whose geometry differs between
   ranks, which is logged) fails on all of them; ranks that pass different numbers
   of items, or different rooms at one position, or whose shards are not the group's
   split, raise on every rank (naming the lowest rank that refused the batch, or the
   lowest ranks passing the fewest and the most items);
2. rebuilds the full rows of every agreed item with ONE all-gather for the whole
   batch: each rank packs its shard rows (embedding, then deepstack) of every
   item into one flat byte buffer padded to the largest rank's size, and unpacks
   the other ranks' shards into place.

A failed item's tensors are never touched, so no rank consumes half-received rows; items whose
tensors share memory (with another item's, or full with deepstack) fail on every rank. The
exchange's buffers are allocated before the agreement: a rank that cannot allocate them
fails every item of the batch on every rank (and logs why) instead of leaving its peers
in an all-gather it never joins.
Works on gloo (CPU tensors) and NCCL (CUDA tensors); the agreement tensor lives on
the first item's device (on NCCL: the current CUDA device), unless the group's backend runs
no collective there (the meta device, where a collective does nothing): then on the CPU,
and items on that device fail. Every wait is bounded only by
the group's timeout (`init_process_group`/`new_group` `timeout=`); this module sets none.
A collective the backend fails (a rank that did not make the same call within that
timeout, or that left) raises CollectiveError (a UsageError) on the ranks that were in it,
naming the step, this rank and the batch's rooms; misuse raises UsageError or ConfigError.

Calls on one group run one at a time in a process: `reassemble` and `agree` from several
threads on the same group take turns (a lock per group), so one call's collectives never
pair with another's on a peer. A call waits for its turn at most the group's timeout, then
raises UsageError without entering a collective. The turns are per process: the ranks must
still make their calls on a group in the same order, so threads that share a group must be
ordered by the caller (one thread per group does it); calls taken in another order on
another rank raise UsageError on every rank (other rooms or another number of items at
the agreement) with no row written.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from transfer._forks import free_in_child
from transfer.errors import CollectiveError, ConfigError, UsageError
from transfer.frames import shard_rows
from transfer.status import TransferPoll

log = logging.getLogger(__name__)

__all__ = ["ShardedItem", "agree", "reassemble"]

_I64_MAX = 2**63 - 1
# The first all-reduce has this many int64 elements whatever the batch, so ranks that
# disagree on the number of items still meet in one collective of one size and all see it.
_FIRST_ELEMENTS = 4096
# The lowest refusing rank (the group's size where none refuses), count * size + rank, -count * size + rank,
# width, -width: the MIN names the lowest rank that refused, and the lowest ranks holding the fewest and
# the most items.
_HEADER = 5


@dataclass
class ShardedItem:
    """One room on one rank: its full-size destination (own shard filled), outcome and deepstack.

    `shard`, when given (a ReceiveHandle's `shard`), is the `(row_start, rows)` this rank
    received; reassemble checks it is this rank's split over the group, so a group that is
    not the one the rows were split over raises instead of rebuilding wrong rows. An empty
    shard inside the span matches an empty split wherever it starts.
    """

    room: int
    full: torch.Tensor  # [span, hidden]
    ok: bool  # or the room's TransferPoll: only Success is ok
    deepstack: torch.Tensor | None = None  # [span, hidden * k]
    shard: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self.ok = _is_ok(self.ok)


def _is_ok(ok: object) -> bool:
    """An outcome as a bool: a TransferPoll is an int, and bool() would call Bootstrapping (1) ok."""
    if isinstance(ok, TransferPoll):
        return ok == TransferPoll.Success
    return bool(ok)


_turns_lock = free_in_child(threading.Lock())
# One lock per process group; a destroyed group's lock goes with it.
_turns: weakref.WeakKeyDictionary[dist.ProcessGroup, threading.Lock] = weakref.WeakKeyDictionary()


def _group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The timeout the group's collectives wait under (torch's default for the backend where it cannot be read)."""
    try:
        # getattr: torch's stubs gained Backend.options after 2.4, the oldest torch this package takes.
        timeout = getattr(group._get_backend(_default_device(group)), "options")._timeout
    except Exception:  # noqa: BLE001 - a private attribute of torch's; the default bounds the wait as well
        timeout = None
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        timeout = dist.default_pg_timeout
    return timeout


@contextlib.contextmanager
def _one_call_at_a_time(group: dist.ProcessGroup | None, what: str) -> Iterator[None]:
    """Holds the group's turn for one call: another thread's reassemble/agree on the same group waits for it
    (at most the group's timeout, then UsageError), so two calls' collectives never interleave."""
    key = group if group is not None else dist.distributed_c10d._get_default_group()
    with _turns_lock:
        lock = _turns.get(key)
        if lock is None:
            lock = _turns[key] = threading.Lock()
    timeout = _group_timeout(key)
    if not lock.acquire(timeout=timeout.total_seconds()):
        raise UsageError(
            f"{what}: another thread of this process was in reassemble() or agree() on the same group for the "
            f"group's whole timeout ({timeout.total_seconds():g} s), so this call did not start: calls on one "
            f"group run one at a time in a process, and every rank must make them in the same order. Make the "
            f"calls on a group from one thread (or order the threads), and look for the call that is stuck; "
            f"the peers waiting for this call end with CollectiveError")
    try:
        yield
    finally:
        lock.release()


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective's tensors must live for the group's backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(oks: Sequence[bool], group: dist.ProcessGroup | None = None, *, keys: Sequence[Sequence[int]] | None = None,
          device: torch.device | str | None = None) -> list[bool]:
    """Per-item outcome agreed by all ranks (one MIN all-reduce): True only where every rank said True.

    `keys`, when given, holds one tuple of integers per item that must be equal on
    every rank (e.g. the item's geometry); an item whose keys differ fails on all
    ranks. An outcome may be a TransferPoll (only Success is True). Ranks that pass
    different numbers of items or of keys per item, or a rank with invalid keys, an
    outcome without a truth value or a `device` the group runs no collective on (meta) or
    this process has not (CUDA in a CPU-only torch, an index past the device count), make
    every rank raise.
    """
    _check_member(group, "agree")
    with _one_call_at_a_time(group, "agree"):
        return _agree(oks, group, keys, device)


def _agree(oks: Sequence[bool], group: dist.ProcessGroup | None, keys: Sequence[Sequence[int]] | None,
           device: torch.device | str | None) -> list[bool]:
    """agree(), with the group's turn held."""
    target, refusal = _default_device(group), None
    if device is not None:
        try:  # a device the group cannot use must still reach the collective (on one it can), as a refusal
            chosen = _usable_device(group, torch.device(device))
        except (RuntimeError, TypeError, ValueError) as exc:
            refusal = f"device {device!r}: {exc}"
        else:
            missing = _missing_device(chosen)
            refusal = f"device {device!r}: {missing}" if missing else None
            target = target if refusal else chosen
    reduced = _agreement(oks, keys, group, target, "agree", refusal, rooms=None)
    return _flags(reduced)


def _missing_device(device: torch.device) -> str | None:
    """Why this process cannot hold a tensor on `device` (None when it can): CUDA in a CPU-only build of torch,
    or an index past the device count, raises only once a tensor is put there."""
    try:
        torch.zeros(1, dtype=torch.int64, device=device)
    except Exception as exc:  # noqa: BLE001 - AssertionError without CUDA, RuntimeError past the device count
        return (f"this process cannot hold a tensor there ({type(exc).__name__}: {exc}); pass one of this "
                f"process's devices, or none for the group's default")
    return None


def _usable_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """`device`, or ConfigError (a ValueError) where the group's backend runs no collective on it: on the
    meta device a collective does nothing at all, leaving the peers' call to pair with this rank's next one."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # one backend per device type, e.g. "cpu:gloo,cuda:nccl"
        types: set[str] | None = {part.split(":")[0] for part in backend.split(",")}
    else:
        types = {"gloo": {"cpu", "cuda"}, "nccl": {"cuda"}}.get(backend)
    if device.type == "meta" or (types is not None and device.type not in types):
        raise ConfigError(f"the group's {backend} backend runs no collective on {device.type} tensors")
    return device


def _check_member(group: dist.ProcessGroup | None, what: str) -> None:
    """UsageError where torch.distributed has no process group (torch's own ValueError names neither the call
    nor the way out); ConfigError on a rank outside `group`: torch.distributed would skip its collectives silently."""
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError(f"{what}: torch.distributed has no process group in this process: call "
                         f"torch.distributed.init_process_group() on every rank of the group first (with a "
                         f"timeout=, which bounds how long a rank waits for a dead or late peer here)")
    if dist.get_rank(group) < 0:
        raise ConfigError(f"{what}: this rank (global rank {dist.get_rank()}) is not a member of the group: "
                          f"torch.distributed would skip the group's collectives here, agreeing and rebuilding "
                          f"nothing; call it only on the ranks of the group the rows were split over, or pass "
                          f"the group this rank belongs to")


def _table(oks: Sequence[bool], keys: Sequence[Sequence[int]] | None) -> tuple[int, int, list[int], str | None]:
    """This rank's item count, keys per item, flat [ok, k..., -k...] rows, and why they are
    invalid (None when valid). Never raises: a rank that did would leave its peers in the collective."""
    try:
        count = len(oks)
        width = len(keys[0]) if keys else 0
    except Exception as exc:  # noqa: BLE001 - any bad value must still reach the collective
        return 0, 0, [], f"the items or keys have no length ({type(exc).__name__}: {exc})"
    if keys is not None and len(keys) != count:
        return count, width, [], f"{len(keys)} keys for {count} items"
    flat: list[int] = []
    for i, ok in enumerate(oks):
        key = keys[i] if keys is not None else ()
        try:
            row = [int(k) for k in key] if width else []
            flag = _is_ok(ok)
        except Exception as exc:  # noqa: BLE001 - as above
            problem = f"item {i} has a key that is not an integer or an outcome that is not a truth value"
            return count, width, [], f"{problem} ({type(exc).__name__}: {exc})"
        if len(row) != width:
            return count, width, [], f"item {i} has {len(row)} keys, item 0 has {width}"
        if any(not -_I64_MAX <= k <= _I64_MAX for k in row):
            return count, width, [], f"item {i} has a key outside signed 64 bits: {row}"
        # MIN of -k is -(MAX of k), so one MIN finds disagreement.
        flat += [1 if flag else 0, *row, *(-k for k in row)]
    return count, width, flat, None


def _agreement(oks: Sequence[bool], keys: Sequence[Sequence[int]] | None, group: dist.ProcessGroup | None,
               device: torch.device, what: str, refusal: str | None = None, *,
               rooms: tuple[int, ...] | None) -> torch.Tensor:
    """The MIN over the ranks of every item's [ok, k..., -k...] row, as a [count, 1 + 2 * width] tensor.

    A rank that must refuse the batch (`refusal`, or invalid keys) still takes part in
    the first all-reduce, so every rank raises instead of its peers waiting out the
    group's timeout in a collective it never joins.
    """
    count, width, flat, problem = _table(oks, keys)
    problem = refusal or problem
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if problem is not None:
        log.error("%s on rank %d of the group: %s", what, rank, problem)
    header = [rank if problem else size, *_counted(count, rank, size), width, -width]
    message = torch.tensor(header + flat, dtype=torch.int64)
    first = torch.zeros(_FIRST_ELEMENTS, dtype=torch.int64)
    first[: min(message.numel(), _FIRST_ELEMENTS)] = message[:_FIRST_ELEMENTS]
    batch = _Batch(what, rooms, count)
    first = _min_all_reduce(first, group, device, batch, "the agreement's all-reduce")
    if first[0] != size:
        raise ConfigError(f"{what}: {problem or _refused_by(int(first[0]))}")
    (fewest, fewest_rank), (most, most_rank) = _count_range(int(first[1]), int(first[2]), size)
    if fewest != most:
        raise UsageError(f"{what}: the ranks of the group pass different numbers of items (rank {fewest_rank} "
                         f"of the group passes {fewest}, rank {most_rank} passes {most}; this is rank {rank}, "
                         f"with {count}); they must pass the same items")
    if first[3] != -first[4]:
        raise UsageError(f"{what}: the ranks of the group pass different numbers of keys per item "
                           f"({int(first[3])} to {int(-first[4])})")
    # Every rank now knows the others hold the same count and width: the rest has one size.
    rest = message[_FIRST_ELEMENTS:]
    if rest.numel():
        rest = _min_all_reduce(rest, group, device, batch, "the agreement's second all-reduce")
    return torch.cat([first, rest])[_HEADER : _HEADER + count * (1 + 2 * width)].view(count, 1 + 2 * width)


def _counted(count: int, rank: int, size: int) -> tuple[int, int]:
    """A rank's item count as two agreement elements: their MIN over the group holds the fewest and the most
    items, each with the lowest rank passing it (see _count_range)."""
    return count * size + rank, -count * size + rank


def _count_range(low: int, high: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((fewest items, lowest rank passing them), (most items, lowest rank passing them)) from the MIN of
    every rank's _counted elements: 0 <= rank < size, so divmod splits each back exactly."""
    fewest, fewest_rank = divmod(low, size)
    most, most_rank = divmod(high, size)
    return (fewest, fewest_rank), (-most, most_rank)


def _refused_by(rank: int) -> str:
    """Why a rank whose own batch was fine raises: `rank`, the lowest that refused it, logged why."""
    return (f"rank {rank} of the group refused the batch (its log says why; other ranks may have refused it "
            f"too, each logging why)")


def _min_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device, batch: _Batch,
                    step: str) -> torch.Tensor:
    """The element-wise MIN of `tensor` over the group, back on the CPU."""
    reduced = tensor.to(device)
    _collective(batch, step, group, lambda: dist.all_reduce(reduced, op=dist.ReduceOp.MIN, group=group))
    return reduced.cpu()


@dataclass(frozen=True)
class _Batch:
    """What a failed collective's error names: the call, the batch's rooms (None for agree) and item count."""

    what: str
    rooms: tuple[int, ...] | None
    count: int

    def text(self) -> str:
        """`rooms 1, 2 (2 items)`, at most eight rooms named; `3 items` without rooms."""
        items = f"{self.count} item{'' if self.count == 1 else 's'}"
        if self.rooms is None:
            return items
        named = ", ".join(str(room) for room in self.rooms[:8])
        more = f" and {len(self.rooms) - 8} more" if len(self.rooms) > 8 else ""
        return f"rooms {named}{more} ({items})" if self.rooms else "an empty batch"


def _collective(batch: _Batch, step: str, group: dist.ProcessGroup | None, call: Callable[[], object]) -> None:
    """Runs one collective. The backend's error when a rank of the group never makes the same call
    within the group's timeout, or leaves, names neither: the CollectiveError says which step it
    was, on which rank, for which rooms."""
    try:
        call()
    except RuntimeError as exc:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        raise CollectiveError(
            f"{batch.what}: {step} over the group's {size} ranks did not complete on rank {rank} of the group "
            f"(global rank {dist.get_rank()}) for {batch.text()} ({exc}); every rank of the group must make the "
            f"same call: one that does not within the group's timeout, or that exits, ends it this way. No row "
            f"was written: look in the other ranks' logs for the one that exited or was late, and treat the "
            f"group as broken (a failed collective cannot be resumed)",
            step=step, rank=rank, size=size, rooms=batch.rooms or ()) from exc


def _flags(reduced: torch.Tensor) -> list[bool]:
    """Per item: every rank said ok and every key was equal on every rank."""
    width = (reduced.shape[1] - 1) // 2
    agreed = reduced[:, 0] == 1
    if width:
        agreed &= (reduced[:, 1 : 1 + width] == -reduced[:, 1 + width :]).all(dim=1)
    return [bool(v) for v in agreed]


def _check_item(item: ShardedItem, device: torch.device) -> str | None:
    """Why this rank cannot take part with `item` (None when it can)."""
    full = item.full
    if not isinstance(full, torch.Tensor):
        return f"full is {type(full).__name__}, not a tensor"
    if full.dim() != 2 or not full.is_contiguous():
        return f"full tensor of shape {tuple(full.shape)} is not a contiguous [span, hidden] tensor"
    if full.device != device:
        return f"full tensor is on {full.device}, the batch on {device}"
    ds = item.deepstack
    if ds is not None:
        if not isinstance(ds, torch.Tensor):
            return f"deepstack is {type(ds).__name__}, not a tensor"
        if ds.dim() != 2 or not ds.is_contiguous() or ds.shape[0] != full.shape[0]:
            return (f"deepstack of shape {tuple(ds.shape)} is not a contiguous "
                    f"[{full.shape[0]}, hidden * k] tensor")
        if ds.device != device:
            return f"deepstack is on {ds.device}, the batch on {device}"
    # torch calls a tensor with a size-1 or size-0 dimension contiguous whatever its strides,
    # yet a byte view needs a unit column stride; failing in the exchange instead would leave
    # this rank out of the all-gather the others are in.
    for name, tensor in (("full tensor", full), ("deepstack", ds)):
        if tensor is not None and not _has_byte_view(tensor):
            return f"{name} of strides {tuple(tensor.stride())} has no byte view"
    return None


def _has_byte_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor.view(torch.uint8)` works (the exchange reads and writes through it)."""
    try:
        tensor.view(torch.uint8)
    except RuntimeError:
        return False
    return True


def _dtype_code(tensor: torch.Tensor | None) -> int:
    """A number for the tensor's dtype that every rank computes alike, for every dtype (-1: none)."""
    if tensor is None:
        return -1
    return zlib.crc32(str(tensor.dtype).encode())


def _room_key(room: int) -> int:
    """The room as an agreement key: itself for every room the wire carries, -1 outside 0 .. 2**63 - 1.

    Such a room cannot have been received, and no two distinct rooms may share a key.
    """
    room = operator.index(room)
    return room if 0 <= room <= _I64_MAX else -1


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


def _gather(packed: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup | None,
            batch: _Batch) -> list[torch.Tensor]:
    """Every rank's equal-size `packed` buffer, in group rank order, gathered into `out` with one collective."""
    size = out.numel() // packed.numel()
    single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
    step = "the all-gather of the shards"
    if single is not None and _gather_into_supported(group):
        _collective(batch, step, group, lambda: single(out, packed, group=group))
        return list(out.view(size, packed.numel()).unbind(0))
    parts = list(out.view(size, packed.numel()).unbind(0))
    _collective(batch, step, group, lambda: dist.all_gather(parts, packed, group=group))
    return parts


def _gather_into_supported(group: dist.ProcessGroup | None) -> bool:
    """Whether the backend gathers into one tensor (NCCL always; gloo since torch 2.1)."""
    if dist.get_backend(group) == "nccl":
        return True
    return torch.__version__ >= "2.1"  # TorchVersion compares as a version, not as text


def reassemble(items: Iterable[ShardedItem], group: dist.ProcessGroup | None = None, *, block_size: int | None = None,
               rank_in_block: int | None = None) -> list[bool]:
    """Rebuild the full rows of every item that succeeded on all ranks; returns agreed success flags.

    Call on every rank of the group that shares the items' rows (the whole prefill
    group, or one encode block with per-block shards) with the same items in the same
    order (a list, or any iterable of them). One all-reduce agrees on the outcome, one
    all-gather rebuilds the rows.
    An item flagged False is left exactly as it was; so is an item whose tensors share memory
    with another item's (or whose deepstack shares memory with its full tensor), which fails
    on every rank, as does the other. Ranks that disagree on the
    number of items or on the room at a position raise UsageError (a RuntimeError) on
    every rank, before any row is written; a rank whose `block_size` or `rank_in_block`
    contradicts the group, whose items are not iterable, or that holds an item without an
    integer room or a readable outcome, makes every rank raise ConfigError (a ValueError, naming the reason on that
    rank). A rank outside `group` raises ConfigError.
    Calls on one group from several threads of a process run one at a time (see the module's text).
    """
    _check_member(group, "reassemble")
    with _one_call_at_a_time(group, "reassemble"):
        return _reassemble(items, group, block_size, rank_in_block)


def _reassemble(items: Iterable[ShardedItem], group: dist.ProcessGroup | None, block_size: int | None,
                rank_in_block: int | None) -> list[bool]:
    """reassemble(), with the group's turn held."""
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    refusal = _check_block(size, rank, block_size, rank_in_block)
    try:  # any iterable of items; what is none must still reach the collective
        items = list(items)
    except Exception as exc:  # noqa: BLE001 - as above
        refusal = refusal or f"the items are not a sequence of ShardedItem ({type(exc).__name__}: {exc})"
        items = []
    # An empty batch still takes part in the agreement: a peer with items is waiting in it.
    device = _batch_device(items, group)
    oks, keys, usable = [], [], []
    unusable: list[tuple[int, str]] = []  # (position, why) of the items this rank fails on its own
    for i, item in enumerate(items):
        try:
            room, ok = _room_key(item.room), _is_ok(item.ok)
            problem = _check_item(item, device) or _check_room_number(item.room, room)
            refusal = refusal or _check_shard(item, i, rank, size, problem)
        except Exception as exc:  # noqa: BLE001 - any bad value must still reach the collective
            # Without a room the position cannot be agreed: refuse the batch on every rank.
            refusal = refusal or f"item {i} is not a usable ShardedItem ({type(exc).__name__}: {exc})"
            oks.append(False)
            keys.append((-1,) * 6)
            continue
        if problem is not None:
            # Not raising: the other ranks are already in the collective; fail the item everywhere.
            unusable.append((i, problem))
        oks.append(ok and problem is None)
        keys.append((room, *(_keys(item) if problem is None else (-1,) * 5)))
        if problem is None:
            usable.append(i)
    try:
        shared = _shared_memory(items, usable)
    except Exception as exc:  # noqa: BLE001 - as above
        refusal = refusal or f"the items' memory could not be compared ({type(exc).__name__}: {exc})"
        shared = {}
    for i, problem in shared.items():
        unusable.append((i, problem))
        oks[i] = False
    _log_unusable(items, sorted(unusable), rank)
    # Allocated before the agreement, for every item that may be agreed: a rank that cannot
    # allocate once agreed would leave its peers in an all-gather it never joins.
    buffers = None
    if refusal is None and size > 1:
        allocated = _exchange_buffers([item for item, ok in zip(items, oks) if ok], rank, size, device)
        if isinstance(allocated, str):
            log.error("reassemble on rank %d of the group: %s; failing every item of the batch", rank, allocated)
            oks = [False] * len(oks)
        else:
            buffers = allocated
    reduced = _agreement(oks, keys, group, device, "reassemble", refusal, rooms=tuple(key[0] for key in keys))
    _check_rooms(reduced)
    agreed = _flags(reduced)
    _log_disagreements(items, oks, reduced, rank)
    chosen = [item for item, ok in zip(items, agreed) if ok]
    if buffers is not None and chosen:
        _exchange(chosen, rank, size, group, buffers)
    return agreed


def _shared_memory(items: Sequence[ShardedItem], usable: Sequence[int]) -> dict[int, str]:
    """Why each of the `usable` items (positions) fails: its tensors share memory with another's, or
    with each other (deepstack and full). The exchange writes every row another rank holds into place,
    so one item's rows would land on the other's; both fail, whatever their outcome.
    """
    spans = []  # (device, first byte, end, position, which tensor)
    for i in usable:
        for name, tensor in (("full tensor", items[i].full), ("deepstack", items[i].deepstack)):
            if tensor is not None and tensor.numel():
                start = tensor.data_ptr()
                spans.append((str(tensor.device), start, start + tensor.numel() * tensor.element_size(), i, name))
    spans.sort(key=operator.itemgetter(0, 1))
    problems: dict[int, str] = {}
    reach = None  # the span reaching furthest so far on the current device
    for span in spans:
        if reach is not None and reach[0] == span[0] and span[1] < reach[2]:
            for (i, name), (j, other) in ((span[3:], reach[3:]), (reach[3:], span[3:])):
                problems.setdefault(i, "its full tensor and its deepstack share memory: give each its own" if i == j
                                    else f"its {name} shares memory with room {items[j].room}'s {other}, so the "
                                         f"rows rebuilt for one would land on the other's: give each item a "
                                         f"destination of its own")
        if reach is None or reach[0] != span[0] or span[2] > reach[2]:
            reach = span
    return problems


def _check_room_number(room: int, key: int) -> str | None:
    """Why the item's room cannot be one that was received (None when it can)."""
    if key < 0:
        return f"room {room} is outside the wire's 0 .. 2**63 - 1"
    return None


def _check_shard(item: ShardedItem, index: int, rank: int, size: int, problem: str | None) -> str | None:
    """Why the item's received shard is not this rank's split of its span over the group (None when it is).

    A wrong group would rebuild other rows into place on every rank with no other sign,
    so this refuses the batch rather than failing the item. An empty shard inside the span
    is this rank's split wherever it starts, when that split is empty too (a span smaller
    than the group leaves ranks without rows).
    """
    if item.shard is None or problem is not None:
        return None
    row_start, rows = (operator.index(v) for v in item.shard)
    span = item.full.shape[0]
    expected = shard_rows(span, rank, size)
    if (row_start, rows) == expected:
        return None
    if rows == expected[1] == 0 and 0 <= row_start <= span:
        return None  # an empty shard places no row: the exchange takes every offset from shard_rows
    return (f"item {index} (room {item.room}) holds rows [{row_start}, {row_start + rows}) of {item.full.shape[0]}, "
            f"but rank {rank} of a group of {size} holds rows [{expected[0]}, {expected[0] + expected[1]}): pass the "
            f"group the rows were split over (with per-block shards, the encode rank's block)")


def _log_unusable(items: Sequence[ShardedItem], unusable: Sequence[tuple[int, str]], rank: int) -> None:
    """Log why this rank fails items of its own (positions, in order), in one line per batch: the room
    and reason of one, or how many and the first rooms' reasons."""
    if len(unusable) == 1:
        i, problem = unusable[0]
        log.warning("room %s on rank %d of the group: %s; failing it", items[i].room, rank, problem)
    elif unusable:
        log.warning("%d rooms are unusable on rank %d of the group (%s); failing them", len(unusable), rank,
                    _first([f"room {items[i].room}: {problem}" for i, problem in unusable], _NAMED_GEOMETRIES,
                           "; "))


_KEY_NAMES = ("span", "row bytes", "dtype", "deepstack row bytes", "deepstack dtype")


def _log_disagreements(items: Sequence[ShardedItem], oks: list[bool], reduced: torch.Tensor, rank: int) -> None:
    """Log why items that were ok on this rank failed, in at most two lines per batch: those another rank
    failed (how many, the first rooms), and those whose geometry differs (how many, the first rooms' parts)."""
    width = (reduced.shape[1] - 1) // 2 if reduced.numel() else 0
    failed: list[object] = []
    differ: list[tuple[object, str]] = []
    for i, ok in enumerate(oks):
        if not ok:
            continue
        row = reduced[i]
        if row[0] != 1:
            failed.append(items[i].room)
            continue
        parts = [f"{name} {int(row[k])} .. {int(-row[width + k])}"
                 for k, name in enumerate(_KEY_NAMES, start=2) if row[k] != -row[width + k]]
        if parts:
            differ.append((items[i].room, ", ".join(parts)))
    if len(failed) == 1:
        log.warning("room %s failed on another rank of the group; failing it on rank %d", failed[0], rank)
    elif failed:
        log.warning("%d rooms failed on another rank of the group (rooms %s); failing them on rank %d",
                    len(failed), _first(failed, _NAMED_ROOMS), rank)
    if len(differ) == 1:
        log.warning("room %s has another geometry on another rank of the group (%s); failing it on rank %d",
                    differ[0][0], differ[0][1], rank)
    elif differ:
        log.warning("%d rooms have another geometry on another rank of the group (%s); failing them on rank %d",
                    len(differ), _first([f"room {room}: {parts}" for room, parts in differ], _NAMED_GEOMETRIES,
                                        "; "), rank)


_NAMED_ROOMS = 8  # rooms one line names
_NAMED_GEOMETRIES = 3  # rooms whose differing geometry, or reason to fail on this rank, one line spells out


def _first(things: Sequence[object], count: int, sep: str = ", ") -> str:
    """The first `count` of `things`, joined, and how many more: `1, 2, 3 and 5 more`."""
    more = f" and {len(things) - count} more" if len(things) > count else ""
    return sep.join(str(thing) for thing in things[:count]) + more


def _check_block(size: int, rank: int, block_size: int | None, rank_in_block: int | None) -> str | None:
    """Why this rank's view of its block contradicts the group (None when it agrees)."""
    if block_size is not None and block_size != size:
        return (f"block_size {block_size} differs from the group's {size} ranks (the group must be exactly "
                f"the ranks the item's rows are split over)")
    if rank_in_block is not None and rank_in_block != rank:
        return f"rank_in_block {rank_in_block} differs from the group rank {rank} (shards are gathered in group rank order)"
    return None


def _batch_device(items: Sequence[ShardedItem], group: dist.ProcessGroup | None) -> torch.device:
    """Where the batch's collectives run: NCCL's current CUDA device, else the first item's device where
    the group runs collectives on it (else the CPU, and that item fails as on another device)."""
    first = getattr(items[0], "full", None) if items else None
    if dist.get_backend(group) != "nccl" and isinstance(first, torch.Tensor):
        try:
            return _usable_device(group, first.device)
        except ValueError:
            pass
    return _default_device(group)


def _check_rooms(reduced: torch.Tensor) -> None:
    """UsageError (on every rank alike) where the ranks hold different rooms at one position."""
    if not reduced.numel():
        return
    width = (reduced.shape[1] - 1) // 2
    low, high = reduced[:, 1], -reduced[:, 1 + width]
    differ = (low != high).nonzero()
    if differ.numel():
        i = int(differ[0, 0])
        raise UsageError(f"reassemble: the ranks of the group hold different rooms at position {i} "
                           f"(rooms {int(low[i])} to {int(high[i])}); they must pass the same items "
                           f"in the same order")


def _exchange_buffers(items: list[ShardedItem], rank: int, size: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | str | None:
    """The exchange's (packed, gathered) byte buffers, big enough for any of `items` agreed; None when
    there is nothing to exchange, or why they could not be allocated."""
    padded = max(_shard_bytes(items, r, size) for r in range(size))
    if padded == 0:
        return None
    try:
        return (torch.empty(padded, dtype=torch.uint8, device=device),
                torch.empty(size * padded, dtype=torch.uint8, device=device))
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        return (f"could not allocate the exchange's {(size + 1) * padded} bytes on {device} for {len(items)} "
                f"items ({type(exc).__name__}: {exc}); free memory or pass smaller batches")


def _exchange(items: list[ShardedItem], rank: int, size: int, group: dist.ProcessGroup | None,
              buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One all-gather of every rank's packed shards, then unpack the others' rows into place."""
    padded = max(_shard_bytes(items, r, size) for r in range(size))
    if padded == 0:
        return  # nothing but empty shards (every span is 0)
    packed = buffers[0][:padded]
    offset = 0
    for item in items:
        for view in _shard_views(item, rank, size):
            packed[offset : offset + view.numel()].copy_(view)
            offset += view.numel()
    packed[offset:].zero_()  # the padding: no stale memory leaves this rank
    batch = _Batch("reassemble", tuple(item.room for item in items), len(items))
    gathered = _gather(packed, buffers[1][: size * padded], group, batch)
    for other in range(size):
        if other == rank:
            continue
        source, offset = gathered[other], 0
        for item in items:
            for view in _shard_views(item, other, size):
                view.copy_(source[offset : offset + view.numel()])
                offset += view.numel()

"""Loopback runs of whole deployments: a bootstrap server, E encode ranks and P prefill
ranks, each rank its own process, moving deterministic items and checking every landed
byte. The demo, the benchmark, the launch scripts and the live tests all run on this.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transfer.frames import dtype_size, prefill_shard

if TYPE_CHECKING:
    import torch

#: The byte every receive slot is filled with before an ask, so that writes outside
#: the rank's shard show up.
SENTINEL = 0xA5


@dataclass
class Scenario:
    """One run: the deployment's shape, the items, and the knobs."""

    encode_ranks: int = 1
    prefill_ranks: int = 4
    items: int = 64
    span: int = 1024
    hidden: int = 4096
    dtype: str = "torch.bfloat16"
    sharded: bool = True
    per_block: bool = False  # shard over each encode rank's block instead of the whole prefill group
    deepstack: int = 0  # deepstack rows are hidden * deepstack wide; 0: no deepstack
    inflight: int = 8
    protocol: str = "auto"
    host: str = "127.0.0.1"
    integrity: bool = True
    deadline_s: float = 60.0
    fanout_timeout_s: float = 60.0  # the sender pools' (SenderPool fanout_timeout_s)
    register_timeout_s: float | None = None  # the sender pools' registration (None: $EPD_REGISTER_TIMEOUT_S, 30)
    first_room: int = 0
    spans: list[int] | None = None  # per-item spans (mixed sizes); default: `span` for all
    token: str | None = None
    timeout_s: float = 300.0  # the whole run's bound
    device: str = ""  # Mooncake RDMA device(s), e.g. "mlx5_0"; "": every device found
    ports: int | str | tuple[int, int] = 0  # each rank's listeners (transfer.ports): 0, a port or a range

    def span_of(self, index: int) -> int:
        """The span of the index-th item."""
        return self.spans[index % len(self.spans)] if self.spans else self.span

    @property
    def rooms(self) -> range:
        """The run's rooms in order, made as they are reached (a count of items from the command line may
        be any size)."""
        return range(self.first_room, self.first_room + self.items)

    @property
    def max_span(self) -> int:
        return max(self.spans) if self.spans else self.span

    @property
    def fanout(self) -> int:
        return self.prefill_ranks // self.encode_ranks

    @property
    def row_bytes(self) -> int:
        return self.hidden * dtype_size(self.dtype)


# ------------------------------------------------------------------ item data


#: Consecutive rooms an ItemSource gives distinct items by default (its `distinct`).
DISTINCT_ROOMS = 1024


class ItemSource:
    """Deterministic items: room r's rows are a window of one seeded random pool.

    Both ends build the same pool from the seed, so a prefill rank can check every
    byte without the item being shipped twice; distinct rooms start at distinct rows,
    so a row delivered to the wrong room is caught. Items repeat only every `distinct`
    rooms or more (the pool has at least `max_span + distinct - 1` rows): a receive slot
    reused by fewer rooms in flight never holds the item its next room is checked
    against unless that room landed.
    """

    def __init__(self, max_span: int, hidden: int, dtype: str, seed: int = 1234, width_factor: int = 1,
                 distinct: int = DISTINCT_ROOMS) -> None:
        import torch

        self.hidden = hidden * width_factor
        self.dtype = getattr(torch, dtype.removeprefix("torch."))
        self.rows = self.pool_rows(max_span, distinct)
        gen = torch.Generator().manual_seed(seed)
        nbytes = self.rows * self.hidden * dtype_size(dtype)
        raw = allocate(lambda: torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen), nbytes,
                       f"an item pool of {self.rows} x {self.hidden} {dtype}")
        self.pool = raw.view(self.dtype).view(self.rows, self.hidden)

    @staticmethod
    def pool_rows(max_span: int, distinct: int = DISTINCT_ROOMS) -> int:
        """Rows of the pool of items of up to `max_span` rows, `distinct` rooms apart."""
        return max(2 * max_span, max_span + max(1, distinct) - 1)

    @classmethod
    def pool_bytes(cls, max_span: int, hidden: int, dtype: str, width_factor: int = 1,
                   distinct: int = DISTINCT_ROOMS) -> int:
        """Bytes of the pool an ItemSource of these arguments allocates."""
        return cls.pool_rows(max_span, distinct) * hidden * width_factor * dtype_size(dtype)

    def offset(self, room: int, span: int) -> int:
        """The pool row where room's item starts: rooms step 131 rows apart (or another step prime
        to the count of starts), so the starts repeat only after every one of them was used."""
        starts, step = self.offset_steps(span)
        return (room * step) % starts

    def offset_steps(self, span: int) -> tuple[int, int]:
        """(starts, step) of offset(): room r's item starts at row (r * step) % starts."""
        starts = self.rows - span + 1
        return starts, next((s for s in (131, 137, 139) if starts % s), 1)

    def item(self, room: int, span: int):
        """Room's rows `[span, hidden]`, a view of the pool (no copy)."""
        start = self.offset(room, span)
        return self.pool[start : start + span]


# ------------------------------------------------------------------- memory


#: What to do when the ranks' buffers do not fit this host.
SMALLER_ITEMS = "give a smaller --span, --hidden, --inflight or --deepstack, or run fewer ranks on this host"


class NoMemory(MemoryError):
    """A rank's buffer that could not be allocated; the message names it and its size, on one line."""


def allocate(make: Callable[[], Any], nbytes: int, what: str) -> Any:
    """make(), which allocates `what` (`nbytes`); NoMemory naming it when the allocation fails (torch
    raises RuntimeError for memory it cannot get, or a size past its range)."""
    try:
        return make()
    except (MemoryError, RuntimeError):
        raise NoMemory(f"cannot allocate {what}, {size_text(nbytes)}") from None


def size_text(nbytes: int) -> str:
    """`1.5 GiB (1610612736 bytes)`."""
    return f"{nbytes / 2**30:,.1f} GiB ({nbytes} bytes)"


def host_memory() -> int | None:
    """Bytes the processes of this host can hold at most between them: its RAM and swap, less where its
    cgroup's memory.max is lower; None where this system does not say."""
    try:
        with open("/proc/meminfo") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        ram, swap = (int(fields[key].split()[0]) * 1024 for key in ("MemTotal", "SwapTotal"))
    except (OSError, KeyError, ValueError):
        try:
            ram, swap = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), 0
        except (OSError, ValueError, AttributeError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            ram = min(ram, int(fh.read().strip()))  # "max": no limit
    except (OSError, ValueError):
        pass
    return ram + swap


def rank_memory(sc: Scenario, role: str) -> int:
    """Bytes one rank of `role` allocates and fills: the item pools (its items, or the items it checks against),
    and a prefill rank's receive slots (those its rooms use)."""
    pools = ItemSource.pool_bytes(sc.max_span, sc.hidden, sc.dtype) * (1 + sc.deepstack)
    if role == "encode":
        return pools
    return pools + min(sc.inflight, sc.items) * sc.max_span * sc.row_bytes * (1 + sc.deepstack)


def memory_refusal(need: int, whose: str, limit: int | None = None) -> str | None:
    """Why `need` bytes (`whose`) cannot be held on this host, or None (also where its memory is unknown)."""
    limit = host_memory() if limit is None else limit
    if limit is None or need <= limit:
        return None
    return f"{whose} need {size_text(need)} of memory, more than this host's RAM and swap, {size_text(limit)}"


# --------------------------------------------------------------- rank bodies


def make_engine(sc: Scenario):
    """The data-path engine the scenario asks for: Mooncake, or the framed wire (a bench setup has no device)."""
    if sc.protocol == "wire":
        from transfer.wire_engine import WireEngine

        return WireEngine(hostname=sc.host, port=sc.ports)
    from transfer.engine import Engine

    return Engine(hostname=sc.host, protocol=sc.protocol, device_name=getattr(sc, "device", ""))


def encode_rank(sc: Scenario, rank: int, bootstrap_addr: str, ready, go, finished, abandoned=None,
                say=None, rank_left=None) -> dict:
    """Body of one encode rank: offers every room's item to its block of prefill ranks.

    `abandoned()` turns true once no prefill rank will ask for anything any more (every
    one finished): the rooms still open, and those not sent yet, are then reported
    failed at once instead of waiting out the fanout timeout for asks that cannot come.
    `say(line)`, where given, is told every WAIT_SAY_S that a room it waits for has not
    concluded yet, and what it waits for; `rank_left()`, where given, the seconds left before the rank's
    --timeout ends it (0: none), which the line names where that comes before the fanout timeout.
    """
    from transfer.metrics import total as metric_total
    from transfer.sender import SenderPool

    source = ItemSource(sc.max_span, sc.hidden, sc.dtype)
    deep = ItemSource(sc.max_span, sc.hidden, sc.dtype, seed=99, width_factor=sc.deepstack) if sc.deepstack else None
    report: dict[str, Any] = {"role": "encode", "rank": rank, "rooms": [], "failed": []}
    with make_engine(sc) as engine:
        engine.register(source.pool)
        if deep is not None:
            engine.register(deep.pool)
        pool = SenderPool(
            engine, rank, sc.encode_ranks, 1, bootstrap_addr, host=sc.host, port=sc.ports, token=sc.token,
            fanout_timeout_s=sc.fanout_timeout_s, register_timeout_s=sc.register_timeout_s, integrity=sc.integrity,
        )
        try:
            ready()
            go()
            given_up = _GiveUp(abandoned, None if say is None else _waiting_line(sc, rank, say, rank_left))
            window: deque = deque()
            for index, room in enumerate(sc.rooms):
                if given_up.now():
                    report["rooms"].append(room)
                    report["failed"].append((room, f"not sent: {ABANDONED}"))
                    continue
                span = sc.span_of(index)
                ds = deep.item(room, span) if deep is not None else None
                window.append(pool.send(room, source.item(room, span), ds))
                if len(window) >= sc.inflight:
                    _settle_send(window.popleft(), sc, report, given_up)
            while window:
                _settle_send(window.popleft(), sc, report, given_up)
            report["stats"] = pool.stats()
            report["bytes_written"] = int(metric_total(report["stats"], pool.metrics.full_name("bytes_written_total")))
            finished()
        finally:
            close_by = time.monotonic() + pool.close_timeout_s
            pool.close()
            if sc.protocol != "wire":
                # Within what is left of the pool's close_timeout_s: a write the pool abandoned is not waited
                # for until its transfer timeout (Mooncake's engine takes a timeout; the wire's bounds its own).
                engine.close(timeout_s=max(0.0, close_by - time.monotonic()))
    return report


#: Why an encode rank of a run stops waiting for its rooms' asks.
ABANDONED = "every prefill rank had finished without it"

#: How long an encode rank still waits for its open rooms once every prefill rank
#: finished: a room whose Success a prefill rank already read concludes here at the
#: same moment, so this only covers the report's way back.
ABANDON_GRACE_S = 1.0


#: How often an encode rank told to (encode_rank's `say`) says a room it waits for has not concluded yet.
WAIT_SAY_S = 10.0


def _waiting_line(sc: Scenario, rank: int, say, rank_left=None):
    """`waiting(handle, waited_s)` for _GiveUp: says what a room not concluded after waited_s waits for, and
    what ends that wait: the fanout timeout (--bootstrap-timeout), or --timeout where `rank_left()` (the
    seconds left of it; 0: none) ends the rank before the room's fanout timeout can."""
    from transfer.status import TransferPoll

    first = rank * sc.fanout
    ranks = f"prefill rank {first}" if sc.fanout == 1 else f"prefill ranks {first}-{first + sc.fanout - 1}"

    def waiting(handle, waited_s: float) -> None:
        status = handle.poll()
        left = rank_left() if rank_left is not None else 0.0
        if status < TransferPoll.Transferring and 0 < left < sc.fanout_timeout_s - waited_s:
            what = (f"waits for {ranks} to ask for it (at most {left:.0f}s more: --timeout ends the rank before "
                    f"the fanout timeout, {sc.fanout_timeout_s:g}s, --bootstrap-timeout)")
        elif status < TransferPoll.Transferring:
            what = (f"waits for {ranks} to ask for it (each room at most the fanout timeout, "
                    f"{sc.fanout_timeout_s:g}s, --bootstrap-timeout)")
        else:
            what = f"its writes to {ranks} go on (each at most --deadline {sc.deadline_s:g}s)"
        say(f"encode rank {rank}: room {handle.room} not concluded after {waited_s:.0f}s ({status.name}): {what}")

    return waiting


def _receiving_line(sc: Scenario, rank: int, say, rank_left=None):
    """`waiting(handle, waited_s)` for _GiveUp, for a prefill rank: says what a room not concluded after
    waited_s waits for, and what ends that wait: the room's deadline (--deadline), or --timeout where
    `rank_left()` (the seconds left of it; 0: none) ends the rank first."""
    encode = rank // sc.fanout

    def waiting(handle, waited_s: float) -> None:
        left = rank_left() if rank_left is not None else 0.0
        if 0 < left < sc.deadline_s - waited_s:
            bound = (f"at most {left:.0f}s more: --timeout ends the rank before the room's deadline, "
                     f"{sc.deadline_s:g}s, --deadline")
        else:
            bound = f"each room at most its deadline, {sc.deadline_s:g}s, --deadline"
        say(f"prefill rank {rank}: room {handle.room} not concluded after {waited_s:.0f}s ({handle.poll().name}): "
            f"waits for encode rank {encode} to be sent the item and write it ({bound})")

    return waiting


class _GiveUp:
    """An encode rank's view of `abandoned()`: when it turned true, and its grace from then; `waiting(handle,
    waited_s)`, where given, is called every WAIT_SAY_S a wait for a handle goes on."""

    def __init__(self, abandoned, waiting=None) -> None:
        self._abandoned = abandoned
        self._waiting = waiting
        self.grace_end: float | None = None

    def now(self) -> bool:
        """Whether nothing will ask for the rank's rooms any more."""
        if self.grace_end is None and self._abandoned is not None and self._abandoned():
            self.grace_end = time.monotonic() + ABANDON_GRACE_S
        return self.grace_end is not None

    def wait(self, handle, bound_s: float):
        """The handle's status after waiting for it up to `bound_s`, or to the grace's end once abandoned."""
        from transfer.status import TransferPoll

        start = time.monotonic()
        end = start + bound_s
        say_at = start + WAIT_SAY_S
        while True:
            grace_end = self.grace_end if self.now() else None
            if grace_end is not None:
                end = min(end, grace_end)
            now = time.monotonic()
            left = max(0.0, end - now)
            if self._waiting is not None:  # in slices up to the next line
                left = min(left, max(0.0, say_at - now))
            # In slices when it may be abandoned, so that is seen within one.
            status = handle.wait(left if self._abandoned is None else min(left, 0.1))
            if status in (TransferPoll.Success, TransferPoll.Failed) or time.monotonic() >= end:
                return status
            if self._waiting is not None and time.monotonic() >= say_at:
                self._waiting(handle, time.monotonic() - start)
                say_at += WAIT_SAY_S


def _settle_send(handle, sc: Scenario, report: dict, given_up: _GiveUp | None = None) -> None:
    from transfer.core.failure import without_room
    from transfer.status import TransferPoll

    status = (given_up or _GiveUp(None)).wait(handle, sc.fanout_timeout_s + sc.deadline_s + 5)
    report["rooms"].append(handle.room)
    if status != TransferPoll.Success:
        why = handle.failure
        if why is None:
            why = ABANDONED if given_up is not None and given_up.now() else f"still {status.name}"
        report["failed"].append((handle.room, without_room(handle.room, why)))  # its lines name the room
    handle.clear()


def prefill_rank(sc: Scenario, rank: int, bootstrap_addr: str, ready, go, finished, say=None,
                 rank_left=None) -> dict:
    """Body of one prefill rank: asks for every room, then checks every landed byte.

    `say(line)`, where given, is told every WAIT_SAY_S that a room it waits for has not concluded yet;
    `rank_left()`, where given, the seconds left before the rank's --timeout ends it (0: none), which the
    line names where that comes before the room's deadline.

    A room that failed because its bootstrap server was paused (handle.retry_at: a look-up of it failed slowly)
    is asked for again, in the same slot, once the pause is over, at most PAUSE_RETRIES times and within what is
    left of the rank (pause_retry_wait), each said to `say`; report["retried"] counts them, and a room counts once
    in its rooms, with its last outcome.
    """
    import torch

    from transfer.receiver import SessionManager

    source = ItemSource(sc.max_span, sc.hidden, sc.dtype)
    deep = ItemSource(sc.max_span, sc.hidden, sc.dtype, seed=99, width_factor=sc.deepstack) if sc.deepstack else None
    # No more rooms than items are ever in flight: slots past them would never be used (rank_memory counts
    # these), and an --inflight past any tensor's size would fail the allocation.
    count = min(sc.inflight, sc.items)
    nbytes = count * sc.max_span * sc.row_bytes
    slots = allocate(lambda: torch.empty((count, sc.max_span, sc.hidden), dtype=source.dtype), nbytes,
                     f"{count} receive slots of {sc.max_span} x {sc.hidden} {sc.dtype}")
    ds_slots = None
    if deep is not None:
        ds_slots = allocate(lambda: torch.empty((count, sc.max_span, deep.hidden), dtype=source.dtype),
                            nbytes * sc.deepstack,
                            f"{count} deepstack receive slots of {sc.max_span} x {deep.hidden} {sc.dtype}")
    report: dict[str, Any] = {
        "role": "prefill", "rank": rank, "rooms": [], "failed": [], "latencies": [],
        "bytes": 0, "verified_bytes": 0, "bad": [], "retried": 0,
    }
    ends = time.monotonic() + sc.timeout_s
    with make_engine(sc) as engine, SessionManager(
        engine, rank, sc.prefill_ranks, 1, buffer=slots, deepstack_buffer=ds_slots, host=sc.host,
        status_port=sc.ports, deadline_s=sc.deadline_s, integrity=sc.integrity,
    ) as manager:
        ready()
        go()
        waits = _GiveUp(None, None if say is None else _receiving_line(sc, rank, say, rank_left))
        # Rooms asked for, not yet settled, in order: (handle, slot, span, row_start, rows, retries).
        window: deque = deque()
        free = list(range(count))
        # Slots of failed rooms whose memory a late write may still reach (README: reuse a failed room's
        # dst only once handle.safe_to_reuse), oldest first, as (handle, slot).
        held: deque = deque()

        def ask(room: int, slot: int, span: int, retries: int = 0) -> None:
            row_start, rows = (prefill_shard(span, rank, sc.prefill_ranks, sc.encode_ranks, per_block=sc.per_block)
                               if sc.sharded else (0, span))
            slots[slot].view(torch.uint8).fill_(SENTINEL)
            ds_dst = None
            if ds_slots is not None:
                ds_slots[slot].view(torch.uint8).fill_(SENTINEL)
                ds_dst = ds_slots[slot, row_start : row_start + rows]
            handle = manager.receive(
                room, bootstrap_addr, slots[slot, row_start : row_start + rows],
                row_start=row_start, span=span, deepstack_dst=ds_dst,
            )
            window.append((handle, slot, span, row_start, rows, retries))

        def again(entry: tuple) -> bool:
            """Asks for a room that failed while its bootstrap server was paused again, in the same slot, once
            the pause is over (pause_retry_wait); False where it stays failed."""
            from transfer.core.failure import without_room

            handle, slot, span, _, _, retries = entry
            now = time.monotonic()
            alarm = rank_left() if rank_left is not None else 0.0  # what is left of --timeout (0: none)
            left = min(ends - now, alarm) if alarm > 0 else ends - now
            wait = pause_retry_wait(handle.retry_at, retries, now, left)
            if wait is None or not handle.safe_to_reuse:  # a room never asked for is safe at once
                return False
            if say is not None:
                why = without_room(handle.room, handle.failure or "")
                say(f"prefill rank {rank}: room {handle.room} failed: {why}; its bootstrap server is paused after a "
                    f"slow failure: asking for the room again in {wait:.1f}s, once that pause is over (retry "
                    f"{retries + 1} of {PAUSE_RETRIES})")
            handle.clear()
            time.sleep(wait)
            report["retried"] += 1
            ask(handle.room, slot, span, retries + 1)
            return True

        report["t_start"] = time.time()
        for index, room in enumerate(sc.rooms):
            while not free:
                free += _safe_slots(held)
                if free:
                    break
                if window:
                    settled = _settle_receive(window.popleft(), sc, source, deep, slots, ds_slots, report, waits,
                                              again)
                    if settled is not None:
                        _settle_into(settled, free, held)
                else:
                    free += _wait_safe(held, sc, rank, say)
            ask(room, free.pop(), sc.span_of(index))
        while window:
            _settle_receive(window.popleft(), sc, source, deep, slots, ds_slots, report, waits, again)
        report["t_end"] = time.time()
        report["stats"] = manager.stats()
        finished()
    return report


#: How many times a prefill rank asks again for a room that failed because its bootstrap server was paused
#: (handle.retry_at): a look-up that failed slowly pauses the server for about a second (UNREACHABLE_RETRY_S),
#: and every room asked for meanwhile, back to back, fails at once.
PAUSE_RETRIES = 3


def pause_retry_wait(retry_at: float | None, retries: int, now: float, left_s: float) -> float | None:
    """Seconds a prefill rank waits before asking again for a room that failed, or None where the room stays
    failed: it failed for anything but its bootstrap server's pause (`retry_at`, when the pause ends, None), it
    was asked for again PAUSE_RETRIES times already (`retries`), or the pause outlasts what is left of the rank
    (`left_s`)."""
    if retry_at is None or retries >= PAUSE_RETRIES:
        return None
    wait = max(0.0, retry_at - now)
    return wait if wait < left_s else None


def _settle_into(settled: tuple, free: list, held: deque) -> None:
    """Files a settled (handle, slot): free when no write can land in its memory any more, else held."""
    handle, slot = settled
    if handle.safe_to_reuse:
        free.append(slot)
    else:
        held.append(settled)


def _safe_slots(held: deque) -> list[int]:
    """Takes out of `held` the slots whose rooms' memory became safe to reuse; returns them."""
    safe = [slot for handle, slot in held if handle.safe_to_reuse]
    if safe:
        kept = [(handle, slot) for handle, slot in held if not handle.safe_to_reuse]
        held.clear()
        held.extend(kept)
    return safe


#: How often a prefill rank whose every slot is held re-reads whether one became safe to reuse.
SAFE_POLL_S = 0.05


def _wait_safe(held: deque, sc: Scenario, rank: int, say=None) -> list[int]:
    """The slots of `held` that became safe to reuse, waiting for the first: each is, at the latest, once its
    room's quarantine passed (its encode rank confirming the cancel makes it sooner)."""
    start = time.monotonic()
    say_at = start + WAIT_SAY_S
    while True:
        safe = _safe_slots(held)
        if safe:
            return safe
        now = time.monotonic()
        if say is not None and now >= say_at:
            say(f"prefill rank {rank}: every receive slot ({len(held)}, --inflight) holds a failed room whose "
                f"cancel encode rank {rank // sc.fanout} has not confirmed, so a late write may still land there; "
                f"waiting {now - start:.0f}s so far for one to be safe to reuse (each at most its quarantine, "
                f"EPD_QUARANTINE_S, from its failure)")
            say_at += WAIT_SAY_S
        time.sleep(SAFE_POLL_S)


def _settle_receive(entry, sc: Scenario, source, deep, slots, ds_slots, report: dict,
                    waits: _GiveUp | None = None, again: Callable[[tuple], bool] | None = None) -> tuple | None:
    """Waits for one room (through `waits`, which may say how the wait goes), checks its bytes, clears it;
    returns (handle, slot): the slot is for reuse once handle.safe_to_reuse. A failed room that `again(entry)`
    asked for again is not settled: None."""
    from transfer.status import TransferPoll

    handle, slot, span, row_start, rows = entry[:5]
    status = (waits or _GiveUp(None)).wait(handle, sc.deadline_s + 5)
    if status == TransferPoll.Failed and again is not None and again(entry):
        return None
    report["rooms"].append(handle.room)
    if status != TransferPoll.Success:
        report["failed"].append((handle.room, handle.failure or f"still {status.name}"))
    else:
        report["latencies"].append(handle.latency_s)
        bad = check_landed(slots[slot], source.item(handle.room, span), row_start, rows)
        if ds_slots is not None and not bad:
            bad = check_landed(ds_slots[slot], deep.item(handle.room, span), row_start, rows)
        nbytes = rows * sc.row_bytes * (1 + sc.deepstack)
        report["bytes"] += nbytes
        if bad:
            report["bad"].append(f"room {handle.room}: {bad}")
        else:
            report["verified_bytes"] += nbytes
    handle.clear()
    return handle, slot


def check_landed(slot, item, row_start: int, rows: int) -> str | None:
    """None when slot rows [row_start, +rows) equal the item's and every other row is untouched."""
    import torch

    landed = slot.view(torch.uint8)
    want = item.view(torch.uint8)
    shard = slice(row_start, row_start + rows)
    if not same_bytes(landed[shard], want[shard]):
        differs = (landed[shard] != want[shard]).any(dim=1).nonzero()
        return f"row {row_start + int(differs[0])} differs from the item"
    for outside in (landed[:row_start], landed[row_start + rows :]):
        if outside.numel() and not same_bytes(outside, _sentinel(outside.numel())):
            return "bytes outside the shard were written"
    return None


def same_bytes(a, b) -> bool:
    """Whether two contiguous host tensors hold the same bytes (memcmp: several times torch.equal's speed)."""
    nbytes = a.numel() * a.element_size()
    if nbytes != b.numel() * b.element_size():
        return False
    return nbytes == 0 or _libc().memcmp(ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(b.data_ptr()), nbytes) == 0


@functools.lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL(None)
    libc.memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    libc.memcmp.restype = ctypes.c_int
    return libc


_SENTINELS: dict[int, torch.Tensor] = {}


def _sentinel(nbytes: int) -> torch.Tensor:
    """A host buffer of at least `nbytes` SENTINEL bytes, flattened to exactly nbytes."""
    import torch

    size = max((n for n in _SENTINELS if n >= nbytes), default=None)
    if size is None:
        size = nbytes
        _SENTINELS.clear()
        _SENTINELS[size] = torch.full((size,), SENTINEL, dtype=torch.uint8)
    return _SENTINELS[size][:nbytes]


# -------------------------------------------------------------- orchestration

#: Seconds the ranks get to stop (SIGTERM unwinds them) after a failure or an interrupt
#: before they are killed.
STOP_GRACE_S = 5.0
#: Lines of a failing rank's log quoted in the error.
LOG_TAIL_LINES = 25

_BODIES: dict[str, Callable[..., dict]] = {"encode": encode_rank, "prefill": prefill_rank}


class _Flag:
    """A one-way flag the run raises for its ranks, which no rank's death can wedge.

    Not multiprocessing.Event: its set() waits for every process asleep in wait() to
    acknowledge, and one killed there (the OOM killer, a test's SIGKILL) never does, so
    the run hung for ever in set() instead of reporting the dead rank. A shared byte,
    polled, has no lock to be left held.
    """

    POLL_S = 0.01

    def __init__(self, ctx: Any) -> None:
        self._raised = ctx.RawValue(ctypes.c_byte, 0)

    def set(self) -> None:
        self._raised.value = 1

    def is_set(self) -> bool:
        return bool(self._raised.value)

    def wait(self, timeout: float) -> bool:
        """Whether the flag was raised within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self._raised.value:
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.POLL_S)
        return True


def _rank_process(role, sc, rank, bootstrap_addr, results, ready_q, go_evt, finished_q, done_evt, log_path) -> None:
    """Runs one rank's body in its own process, its output in log_path; reports its result or its traceback."""
    _log_to(log_path)
    # The run's process decides when ranks stop: Ctrl-C reaches it, and it stops them with SIGTERM.
    # Ignoring SIGINT drops one that came while this process started (held back: ctrl_c_held).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGTERM, _raise_interrupt)
    faulthandler.enable()  # a crash in C code leaves the Python stacks in the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the run asks a rank that hangs where it is
    exit_with_parent()
    body = _BODIES[role]
    try:
        import torch

        # Several ranks share the host's cores: torch's own thread pool would fight them.
        torch.set_num_threads(1)

        def ready():
            ready_q.put((role, rank))

        def go():
            if not go_evt.wait(sc.timeout_s):
                raise TimeoutError("never told to start")

        def finished():
            finished_q.put((role, rank))
            # Encode ranks keep serving until every prefill rank is done.
            if role == "encode":
                done_evt.wait(sc.timeout_s)

        if role == "encode":
            results.put(body(sc, rank, bootstrap_addr, ready, go, finished, abandoned=done_evt.is_set))
        else:
            results.put(body(sc, rank, bootstrap_addr, ready, go, finished))
    except NoMemory as error:  # one line, no traceback: it names what and how much
        sys.stderr.write(f"{error}\n")
        sys.stderr.flush()
        results.put({"role": role, "rank": rank, "error": str(error), "no_memory": str(error)})
    except BaseException:  # noqa: BLE001 - the parent must hear about it
        text = traceback.format_exc()
        sys.stderr.write(text)
        sys.stderr.flush()
        results.put({"role": role, "rank": rank, "error": text})


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Holds SIGINT back from this thread while it starts rank processes.

    A spawned process starts with the signal mask of the thread that started it, so a Ctrl-C
    (which reaches every process of the terminal's group) stays pending in a rank until it
    has set up how it takes one, instead of ending it in the middle of its start with a
    traceback on the terminal. The run's own process takes that Ctrl-C once the block ends,
    and stops its ranks. Start every rank inside the block and record it there too, so a
    Ctrl-C taken at the block's end finds every started rank recorded.
    """
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _log_to(path: str) -> None:
    """Sends this process's stdout and stderr (C code's included) to the file at path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _raise_interrupt(*_: object) -> None:
    """SIGTERM handler: unwinds through the context managers, so engines and sockets close."""
    raise KeyboardInterrupt


def exit_with_parent() -> None:
    """Ends this rank process when the run's process dies without stopping it (SIGKILL, the OOM killer)."""
    import multiprocessing.connection

    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


@dataclass
class _Rank:
    """One rank process of a run and the log its output goes to."""

    role: str
    rank: int
    proc: Any
    log: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.role, self.rank)

    @property
    def name(self) -> str:
        return f"{self.role} rank {self.rank}"


def run(sc: Scenario) -> dict:
    """Runs the scenario end to end in separate processes; returns the summary.

    Each rank's output goes to a log of its own. A rank that crashes or dies ends the
    run at once (RuntimeError), as does one that exits with an error after its report;
    one that hangs ends it at sc.timeout_s (TimeoutError); each error names the rank and
    quotes the end of its log. Every rank is stopped on the way out (Ctrl-C included),
    and the logs go with the run.
    """
    from transfer.bootstrap import BootstrapServer

    ctx = mp.get_context("spawn")
    results, ready_q, finished_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    go_evt, done_evt = _Flag(ctx), _Flag(ctx)
    deadline = time.monotonic() + sc.timeout_s
    ranks: list[_Rank] = []
    try:
        server = BootstrapServer(sc.host, 0, token=sc.token)
    except OSError as error:
        raise OSError(f"cannot serve the run's bootstrap on {sc.host}: {error}") from None
    with server, tempfile.TemporaryDirectory(prefix="epd-run-") as log_dir:
        try:
            with ctrl_c_held():
                for role, count in (("encode", sc.encode_ranks), ("prefill", sc.prefill_ranks)):
                    for rank in range(count):
                        log = os.path.join(log_dir, f"{role}-{rank}.log")
                        proc = ctx.Process(
                            target=_rank_process,
                            args=(role, sc, rank, server.address, results, ready_q, go_evt, finished_q, done_evt,
                                  log),
                            name=f"{role}-{rank}", daemon=True,
                        )
                        proc.start()
                        ranks.append(_Rank(role, rank, proc, log))
            watch = _Watch(ranks, results, deadline, sc.timeout_s)
            watch.until(ready_q, ranks, "to be ready")
            go_evt.set()
            watch.until(finished_q, [r for r in ranks if r.role == "prefill"], "to finish")
            done_evt.set()
            reports = watch.all_reports()
        except BaseException:
            _stop(ranks)
            raise
        finally:
            done_evt.set()
            go_evt.set()
            for r in ranks:
                r.proc.join(timeout=max(1.0, deadline - time.monotonic()))
            exits = [(r, r.proc.exitcode) for r in ranks]  # before _stop, whose signals are not a rank's failure
            _stop(ranks)
        # A rank that crashed after its report (in its engine's close, at its interpreter's exit) is a failed run.
        for exited, code in exits:
            if code:
                raise RuntimeError(f"{exited.name} died ({_exit_text(code)}) after its report; {_log_tail(exited)}")
    return summarize(sc, reports)


class _Watch:
    """The run's view of its ranks: their reports, their deaths and the run's deadline."""

    def __init__(self, ranks: list[_Rank], results, deadline: float, timeout_s: float) -> None:
        self.ranks = ranks
        self.results = results
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.reports: list[dict] = []

    def until(self, q, waiting: list[_Rank], what: str) -> None:
        """Waits until every rank of `waiting` put its (role, rank) on q."""
        pending = {r.key: r for r in waiting}
        while pending:
            try:
                pending.pop(tuple(q.get(timeout=0.2)), None)
            except queue_mod.Empty:
                pass
            self._check(list(pending.values()), what)

    def all_reports(self) -> list[dict]:
        """Waits for every rank's report."""
        while True:
            reported = {(r["role"], r["rank"]) for r in self.reports}
            pending = [r for r in self.ranks if r.key not in reported]
            if not pending:
                return self.reports
            try:
                self._take(self.results.get(timeout=0.2))
            except queue_mod.Empty:
                pass
            self._check(pending, "to report")

    def _take(self, report: dict) -> None:
        """Files one report; a crash report ends the run."""
        self.reports.append(report)
        if "error" in report:
            rank = next(r for r in self.ranks if r.key == (report["role"], report["rank"]))
            if "no_memory" in report:
                raise RuntimeError(f"{rank.name}: {report['no_memory']}: {SMALLER_ITEMS}")
            raise RuntimeError(f"{rank.name} crashed; {_log_tail(rank)}")

    def _check(self, pending: list[_Rank], what: str) -> None:
        """Ends the run when a rank crashed, died without a report, or the deadline passed."""
        codes = [(r, r.proc.exitcode) for r in self.ranks]  # before draining: a report precedes its exit
        while True:
            try:
                self._take(self.results.get_nowait())
            except queue_mod.Empty:
                break
        reported = {(r["role"], r["rank"]) for r in self.reports}
        for rank, code in codes:
            if code is not None and rank.key not in reported:
                raise RuntimeError(f"{rank.name} died ({_exit_text(code)}) without a report; {_log_tail(rank)}")
        if time.monotonic() > self.deadline:
            raise TimeoutError(_hang_message(pending, what, self.timeout_s))


def _exit_text(code: int) -> str:
    """`exit code 3` or `killed by SIGKILL`."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _hang_message(pending: list[_Rank], what: str, timeout_s: float) -> str:
    """Names the ranks the run still waits for, with where each is (their stacks, when they answer)."""
    for rank in pending:
        try:
            os.kill(rank.proc.pid, signal.SIGUSR1)  # faulthandler writes its threads' stacks to its log
        except OSError:
            pass
    time.sleep(0.5)
    names = ", ".join(r.name for r in pending)
    tails = "\n".join(f"{r.name}: {_log_tail(r)}" for r in pending[:4])
    return f"the run did not finish within {timeout_s:g}s; still waiting for {names} {what}\n{tails}"


def _log_tail(rank: _Rank) -> str:
    """`the last lines of its log:` and them, or a note that it wrote nothing."""
    try:
        with open(rank.log, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode(errors="replace")
    except OSError:
        text = ""
    lines = [line for line in text.splitlines() if line.strip()][-LOG_TAIL_LINES:]
    if not lines:
        return "its log is empty"
    return "the last lines of its log:\n" + "\n".join(f"  {line}" for line in lines)


def _stop(ranks: list[_Rank]) -> None:
    """Asks every live rank to stop (SIGTERM), then kills what is left after STOP_GRACE_S."""
    for r in ranks:
        if r.proc.is_alive():
            r.proc.terminate()
    grace_end = time.monotonic() + STOP_GRACE_S
    for r in ranks:
        r.proc.join(timeout=max(0.0, grace_end - time.monotonic()))
    for r in ranks:
        if r.proc.is_alive():
            r.proc.kill()  # a stopped (SIGSTOP) or wedged rank ignores SIGTERM
            r.proc.join(timeout=5)


def summarize(sc: Scenario, reports: list[dict]) -> dict:
    """The run's figures: items, bytes, failures, verification, GB/s and latency percentiles."""
    errors = [r for r in reports if "error" in r]
    if errors:
        raise RuntimeError(f"{errors[0]['role']} rank {errors[0]['rank']} crashed:\n{errors[0]['error']}")
    prefill = [r for r in reports if r["role"] == "prefill"]
    encode = [r for r in reports if r["role"] == "encode"]
    latencies = sorted(lat for r in prefill for lat in r["latencies"])
    failed = sorted({room for r in prefill + encode for room, _ in r["failed"]})
    reasons = [f"{r['role']} {r['rank']} room {room}: {why}" for r in prefill + encode for room, why in r["failed"]]
    bad = [f"prefill {r['rank']} {b}" for r in prefill for b in r["bad"]]
    nbytes = sum(r["bytes"] for r in prefill)
    wall = max(r["t_end"] for r in prefill) - min(r["t_start"] for r in prefill)
    return {
        "items": sc.items,
        "bytes": nbytes,
        "failed": len(failed),
        "retried": sum(r["retried"] for r in prefill),  # asks again of rooms failed while a bootstrap was paused
        # No room landed is nothing verified: a run whose every room failed must not read as checked. A room
        # that landed no bytes (an empty shard: a span smaller than the group) was checked, its slot untouched.
        "verified": bool(latencies) and sum(r["verified_bytes"] for r in prefill) == nbytes and not bad,
        "gbps": nbytes / wall / 1e9 if wall > 0 else 0.0,
        "p50_ms": _percentile(latencies, 50) * 1e3,
        "p99_ms": _percentile(latencies, 99) * 1e3,
        "protocol": _resolved_protocol(sc.protocol, getattr(sc, "device", "")),
        "encode_ranks": sc.encode_ranks,
        "prefill_ranks": sc.prefill_ranks,
        "wall_s": wall,
        "rooms_per_s": sc.items / wall if wall > 0 else 0.0,
        "encode_bytes": [r.get("bytes_written", 0) for r in sorted(encode, key=lambda r: r["rank"])],
        "failures": reasons[:20],
        "mismatches": bad[:20],
    }


def _percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(pct / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def _resolved_protocol(protocol: str, device: str = "") -> str:
    """What the ranks' engines ran (auto resolved, rdma only where a device is usable)."""
    if protocol == "wire":
        return protocol
    from transfer.engine import effective_protocol

    return effective_protocol(protocol, device)[0]


__all__ = ["SENTINEL", "ItemSource", "Scenario", "check_landed", "encode_rank", "prefill_rank", "run"]

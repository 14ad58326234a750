"""An in-memory encode<->prefill pair: EncodeCores and PrefillCores joined with no network.

`Pair` plays both drivers. What a prefill core asks to send (registrations, asks,
cancels) and what an encode core pushes (statuses, cancel answers) travels as the frames
the wire would carry (`transfer.frames`' codecs, both ways), each on a FIFO channel of
its own per connection, as ZMQ keeps them; a write copies the source rows into the
prefill session's memory (bytearrays per registered region; odd rooms carry deepstack
rows too, written to a region of their own). Nothing moves until the test says which
pending step happens next (`moves()`, `do()`), so a test picks the interleaving: which
message is delivered, which write lands or completes, which look-up answers, when the
caller offers, receives or clears, how far the fake clock moves, and faults (a
connection that loses what it queued, a message delivered twice (a Success only with
integrity checks on), a failed write or
look-up, a rank that dies or restarts as a new session, a prefill rank's connection to
an encode rank that drops while what it carried may still arrive late, an encode rank
stopped a while: it reads, writes, pushes and ticks nothing until resumed).

Each step is checked as it happens (`Violation` says which rule broke) and logged;
`trace()` tells the whole run, one line a step, for a failing example.
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fakes import Region, Regions

from transfer.core import encode as enc
from transfer.core import lane
from transfer.core import prefill as pre
from transfer.frames import (
    TransferInfo,
    UnreadableChecksum,
    WireError,
    cancel_reply_frames,
    is_cancel,
    is_registration,
    parse_cancel,
    parse_cancel_reply,
    parse_registration,
    parse_status,
    prefill_shard,
    status_frames,
)
from transfer.status import TransferPoll
from transfer.wire import layer_sum

BOOT = "10.0.0.1:8998"
HIDDEN = 4
DTYPE = "torch.float16"
ROW = HIDDEN * 2
MAX_SPAN = 6
DS_ROW = 2 * ROW  # a deepstack row: two layers of a row
SLOT = MAX_SPAN * ROW  # one room's destination; every receive gets a fresh one, so no two rooms share bytes
DS_SLOT = MAX_SPAN * DS_ROW
SLOTS = 64
SRC_BASE = 0x7000_0000
DS_SRC_BASE = 0x7800_0000

# status_frames' parameters beyond the SPEC's parts that a PushStatus also carries pass through by name,
# so an extension of the status frame reaches the prefill side without this file changing.
_STATUS_EXTRAS = [name for name in inspect.signature(status_frames).parameters
                  if name not in ("room", "status", "rank", "checksums")]


def _is_success(frames: list[bytes]) -> bool:
    """Whether a status message is a Success (one whose checksum part does not parse too: with integrity off it
    stands); a cancel's answer is not."""
    if parse_cancel_reply(frames) is not None:
        return False
    try:
        return parse_status(frames)[1] is TransferPoll.Success
    except UnreadableChecksum as exc:
        return exc.status is TransferPoll.Success
    except WireError:
        return False


class Violation(AssertionError):
    """A rule of the pair broke; the message says which, with the step that broke it."""


def item_bytes(room: int, span: int) -> bytes:
    """The rows every encode rank holds for `room` (the same on each: tp-replicated output)."""
    return bytes((room * 37 + i * 11 + 1) % 251 for i in range(span * ROW))


def deepstack_bytes(room: int, span: int) -> bytes:
    """The deepstack rows every encode rank holds for `room`, when it has them."""
    return bytes((room * 53 + i * 7 + 3) % 241 for i in range(span * DS_ROW))


def has_deepstack(room: int) -> bool:
    """Odd rooms carry deepstack rows too."""
    return room % 2 == 1


def source(room: int, src: int, length: int) -> tuple[bytes, int, bool] | None:
    """(the rows `src` points into, its offset there, whether deepstack) for a read of `length` bytes, or None
    when the read is not inside that room's rows."""
    span = span_of(room)
    for data, base, deep in ((item_bytes(room, span), SRC_BASE + room * SLOT, False),
                             (deepstack_bytes(room, span), DS_SRC_BASE + room * DS_SLOT, True)):
        if base <= src and src + length <= base + len(data) and (not deep or has_deepstack(room)):
            return data, src - base, deep
    return None


def span_of(room: int) -> int:
    """Rooms of 1..MAX_SPAN rows, so some shards are empty when the prefill tp is larger."""
    return 1 + room % MAX_SPAN


def status_message(push: enc.PushStatus, rank: int) -> list[bytes]:
    """The frames the encode driver pushes for a PushStatus."""
    if push.cancel is not None:
        return cancel_reply_frames(push.room, rank, push.cancel)
    extras = {name: getattr(push, name) for name in _STATUS_EXTRAS if hasattr(push, name)}
    return status_frames(push.room, push.status, rank, push.checksums, **extras)


@dataclass(eq=False)
class Receive:
    """One receive() of a room on one prefill rank: where its rows land and how it ended."""

    rank: int
    session: str
    room: int
    token: int
    ptr: int
    row_start: int
    rows: int
    ds_ptr: int = 0  # its deepstack rows' destination, 0 without deepstack
    cleared: bool = False
    concluded: list = field(default_factory=list)  # the Failure (None: Success) of each Conclude
    safe_at: int | None = None  # the step its MemorySafe came
    landed: int = 0  # writes that landed in it

    @property
    def nbytes(self) -> int:
        return self.rows * ROW

    @property
    def ds_nbytes(self) -> int:
        return self.rows * DS_ROW if self.ds_ptr else 0

    def holds(self, dst: int, length: int) -> bool:
        """Whether [dst, dst + length) is exactly the start of one of its destinations, and fits in it."""
        return (dst == self.ptr and length <= self.nbytes) or (self.ds_ptr and dst == self.ds_ptr
                                                               and length <= self.ds_nbytes)

    def outcome(self) -> str:
        if not self.concluded:
            return "open"
        return "Success" if self.concluded[0] is None else f"Failed({self.concluded[0].kind.value})"


@dataclass(eq=False)
class Send:
    """One offer of a room on one encode rank, and how it ended."""

    rank: int
    room: int
    concluded: list = field(default_factory=list)  # (status, failure, step)
    cleared: bool = False


@dataclass(eq=False)
class Flight:
    """A write started on an encode rank: lands (copies its bytes), then completes."""

    encode: int
    write: enc.StartWrite
    checksums: tuple[int, ...]
    landed: bool = False


@dataclass(eq=False)
class PrefillRank:
    """A prefill rank: its core, the memory of its announced region, and what its driver holds."""

    rank: int
    core: pre.PrefillCore
    memory: bytearray
    base: int
    endpoint: tuple[str, int]
    alive: bool = True
    generation: int = 0  # restarts so far: each process has a session of its own
    next_slot: int = 0
    lookups: deque = field(default_factory=deque)
    verifies: deque = field(default_factory=deque)
    conns: dict = field(default_factory=dict)  # encode address -> connection number in use
    receives: dict = field(default_factory=dict)  # room -> the Receive held now

    @property
    def session(self) -> str:
        return self.core.session_id


@dataclass(eq=False)
class EncodeRank:
    """An encode rank: its core, the rooms its caller sent, and what it has seen and started."""

    rank: int
    core: enc.EncodeCore
    addr: tuple[str, int]
    alive: bool = True
    sends: dict = field(default_factory=dict)  # room -> the Send held now
    announced: dict = field(default_factory=dict)  # session -> [(base, nbytes)] registrations delivered
    flights: dict = field(default_factory=dict)  # session -> deque of Flight (a session's writes settle in order)
    late: list = field(default_factory=list)  # writes that failed before they landed: over tcp they still may


class Pair:
    """`encode_tp` EncodeCores serving `prefill_tp` PrefillCores, with a fake clock and a chosen schedule."""

    def __init__(self, *, encode_tp: int = 1, prefill_tp: int = 1, deadline_s: float = 10.0,
                 fanout_timeout_s: float = 5.0, integrity: bool = True, late_requests: bool = False,
                 lanes: bool = True, depth: int = 32) -> None:
        """`late_requests`: what a connection the prefill core lets go (Disconnect) had queued may still be
        delivered, late, or lost (a fault), as bytes already on their way over tcp may; else it is dropped.
        `lanes`: a status its lane settles (transfer.core.lane) goes to `lanes_settled`, as the driver's
        does; else every status goes to `status`. `depth`: each encode core's writes in flight at most."""
        self.now = 0.0
        self.integrity = integrity
        self.lanes = lanes
        self.settled_in_lanes = 0
        self.late_requests = late_requests
        self.stopped: set[int] = set()  # encode ranks stopped now (SIGSTOP): nothing of theirs moves
        self.step = 0
        self.log: list[str] = []
        self.encode_tp, self.prefill_tp = encode_tp, prefill_tp
        self.encodes = [EncodeRank(e, enc.EncodeCore(fanout_timeout_s=fanout_timeout_s, depth=depth, now=self.now),
                                   (f"10.0.1.{e}", 7000 + e)) for e in range(encode_tp)]
        self.prefills = []
        for p in range(prefill_tp):
            base = 0x1000_0000 * (p + 1)
            core = pre.PrefillCore(p, prefill_tp, 1, host=f"10.0.2.{p}", status_port=5000 + p,
                                   session_id=f"10.0.2.{p}:{17000 + p}", deadline_s=deadline_s, integrity=integrity)
            # The announced regions sit inside a larger allocation, so a stray write has somewhere to land.
            self.prefills.append(PrefillRank(p, core, bytearray((SLOTS + 2) * (SLOT + DS_SLOT)), base - SLOT,
                                             (core.host, core.status_port)))
        self.regions = [Regions(Region(p.base + SLOT, SLOTS * SLOT),
                                Region(p.base + (SLOTS + 2) * SLOT + DS_SLOT, SLOTS * DS_SLOT)) for p in self.prefills]
        # (prefill, encode address, connection) -> frames in flight, and (encode, status endpoint) -> frames.
        self.requests: dict[tuple[int, tuple[str, int], int], deque] = {}
        self.statuses: dict[tuple[int, tuple[str, int]], deque] = {}
        self.all_receives: list[Receive] = []
        self.all_sends: list[Send] = []
        self.rows_written: dict[tuple[int, int], int] = {}  # (room, row) -> times written
        self.cancels_delivered: list[tuple[int, int, str, int]] = []  # (encode, room, session, step)

    # ---------------------------------------------------------------- log

    def note(self, text: str) -> None:
        self.log.append(f"{self.step:4d} t={self.now:6.2f}  {text}")

    def trace(self) -> str:
        return "\n".join(self.log)

    def fail(self, rule: str) -> None:
        raise Violation(f"step {self.step}: {rule}\n--- trace ---\n{self.trace()}")

    def expect(self, ok: bool, rule: str) -> None:
        if not ok:
            self.fail(rule)

    # ---------------------------------------------------------- the callers

    def offer(self, e: int, room: int) -> None:
        """Encode rank `e`'s caller sends `room`'s item."""
        rank = self.encodes[e]
        span = span_of(room)
        send = Send(e, room)
        rank.sends[room] = send
        self.all_sends.append(send)
        self.note(f"encode {e}: offer room {room} ({span} rows)")
        deep = has_deepstack(room)
        offer = enc.Offer(room, send, SRC_BASE + room * SLOT, span, HIDDEN, DTYPE, ROW,
                          DS_SRC_BASE + room * DS_SLOT if deep else None, DS_ROW if deep else 0, sources=(room,))
        self.carry_encode(rank, rank.core.offer(offer, self.now))

    def clear_send(self, e: int, room: int) -> None:
        """Encode rank `e`'s caller clears `room`."""
        rank = self.encodes[e]
        send = rank.sends.pop(room)
        send.cleared = True
        self.note(f"encode {e}: clear room {room} ({'concluded' if send.concluded else 'open'})")
        self.carry_encode(rank, rank.core.clear(room, send, self.now))

    def receive(self, p: int, room: int) -> None:
        """Prefill rank `p`'s caller receives `room` into a fresh slot."""
        rank = self.prefills[p]
        if rank.next_slot == SLOTS:
            self.fail(f"prefill {p} has no fresh slot left; give the pair more SLOTS")
        span = span_of(room)
        row_start, rows = prefill_shard(span, p, self.prefill_tp, self.encode_tp)
        regions = self.regions[p]
        ptr = regions.embedding.addr + rank.next_slot * SLOT
        ds_ptr = regions.deepstack.addr + rank.next_slot * DS_SLOT if has_deepstack(room) else 0
        rank.next_slot += 1
        spec = pre.RoomSpec(room, BOOT, ptr, rows=rows, hidden=HIDDEN, dtype=DTYPE, row_bytes=ROW,
                            row_start=row_start, span=span, regions=regions, deepstack_ptr=ds_ptr,
                            deepstack_nbytes=rows * DS_ROW if ds_ptr else 0, has_deepstack=bool(ds_ptr),
                            deepstack_row_bytes=DS_ROW if ds_ptr else None)
        token, actions = rank.core.receive(self.now, spec)
        rec = rank.receives[room] = Receive(p, rank.session, room, token, ptr, row_start, rows, ds_ptr)
        self.all_receives.append(rec)
        self.note(f"prefill {p}: receive room {room} token {token} rows {row_start}+{rows} at {ptr:#x}")
        self.carry_prefill(rank, actions)

    def clear_receive(self, p: int, room: int) -> None:
        """Prefill rank `p`'s caller clears `room` (giving it up unless it concluded Success), as its driver does."""
        rank = self.prefills[p]
        rec = rank.receives.pop(room)
        rec.cleared = True
        self.note(f"prefill {p}: clear room {room} token {rec.token} ({rec.outcome()})")
        self.carry_prefill(rank, rank.core.abandon(self.now, room, rec.token))
        if rank.core.safe(room, rec.token):
            self.memory_safe(rank, rec)
        rank.core.clear(self.now, room, rec.token)

    # ------------------------------------------------------ the prefill driver

    def carry_prefill(self, rank: PrefillRank, actions: list) -> None:
        for action in actions:
            kind = type(action)
            if kind in (pre.LookUpParallel, pre.LookUpRoute):
                rank.lookups.append(action)
            elif kind is pre.Announce:
                self.send_request(rank, action.addr, action.frames, f"registration {action.region[0]:#x}")
            elif kind is pre.SendAsk:
                if rank.core.asking(action.room, action.token):
                    self.send_request(rank, action.addr, action.info.to_frames(), f"ask room {action.room}")
            elif kind is pre.SendCancel:
                # A socket a drop left stays and connects again (one the core let go of is closed); an unasked
                # cancel goes on it then, where the core still holds a connection to that address.
                if action.addr in rank.conns or (action.unasked and rank.core.connected(action.addr)):
                    self.send_request(rank, action.addr, action.frames, f"cancel room {action.room}")
            elif kind is pre.Disconnect:
                conn = rank.conns.pop(action.addr, None)
                if conn is not None and action.flush:
                    self.note(f"prefill {rank.rank}: disconnect {action.addr} once its cancel went out")
                elif conn is not None and self.late_requests:
                    queued = len(self.requests.get((rank.rank, action.addr, conn), ()))
                    self.note(f"prefill {rank.rank}: disconnect {action.addr}, {queued} unsent may arrive late")
                elif conn is not None:
                    dropped = self.requests.pop((rank.rank, action.addr, conn), ())
                    self.note(f"prefill {rank.rank}: disconnect {action.addr}, {len(dropped)} unsent dropped")
            elif kind is pre.Conclude:
                self.prefill_concluded(rank, action)
            elif kind is pre.Warn and action.key == "lane outlived":
                self.fail(f"prefill {rank.rank}: {action.message}")
            elif kind is pre.Verify:
                rank.verifies.append(action)
            elif kind is pre.MemorySafe:
                rec = next((r for r in self.all_receives if r.session == rank.session and r.token == action.token),
                           None)
                if rec is not None:
                    self.memory_safe(rank, rec)

    def send_request(self, rank: PrefillRank, addr: tuple[str, int], frames: list[bytes], what: str) -> None:
        conn = rank.conns.get(addr)
        if conn is None:
            conn = rank.conns[addr] = 1 + max((c for (p, a, c) in self.requests if p == rank.rank and a == addr),
                                              default=0)
        self.requests.setdefault((rank.rank, addr, conn), deque()).append((list(frames), what))

    def prefill_concluded(self, rank: PrefillRank, action: pre.Conclude) -> None:
        rec = rank.receives.get(action.room)
        self.expect(rec is not None and rec.token == action.token,
                    f"prefill {rank.rank} concluded room {action.room} token {action.token}, which it does not hold")
        rec.concluded.append(action.failure)
        self.note(f"prefill {rank.rank}: room {action.room} token {action.token} concluded {rec.outcome()}"
                  + (f": {action.failure.detail}" if action.failure else ""))
        self.expect(len(rec.concluded) == 1, f"prefill {rank.rank} concluded room {action.room} twice")
        if action.failure is None:
            # A Success is this ask's only when a write of this ask landed in this ask's memory (integrity
            # on or off): one for an earlier ask of the same room number wrote the earlier ask's memory.
            self.expect(rec.landed > 0 or rec.rows == 0,
                        f"prefill {rank.rank} concluded room {rec.room} token {rec.token} Success, but no write "
                        f"landed in its memory")
            span = span_of(rec.room)
            rows = slice(rec.row_start, rec.row_start + rec.rows)
            wanted = [("rows", rec.ptr, item_bytes(rec.room, span)[rows.start * ROW:rows.stop * ROW])]
            if rec.ds_ptr:
                wanted.append(("deepstack rows", rec.ds_ptr,
                               deepstack_bytes(rec.room, span)[rows.start * DS_ROW:rows.stop * DS_ROW]))
            for what, addr, want in wanted:
                landed = bytes(self.read(rank, addr, len(want)))
                self.expect(landed == want, f"prefill {rank.rank} concluded room {rec.room} Success, but its {what} "
                                            f"hold {landed.hex()} instead of {want.hex()}")

    def memory_safe(self, rank: PrefillRank, rec: Receive) -> None:
        if rec.safe_at is None:
            rec.safe_at = self.step
            self.note(f"prefill {rank.rank}: room {rec.room} token {rec.token}: memory safe")

    def read(self, rank: PrefillRank, addr: int, nbytes: int) -> bytearray:
        return rank.memory[addr - rank.base:addr - rank.base + nbytes]

    # ------------------------------------------------------- the encode driver

    def carry_encode(self, rank: EncodeRank, actions: list) -> None:
        work = deque(actions)
        while work:
            action = work.popleft()
            kind = type(action)
            if kind is enc.PushStatus:
                self.push_status(rank, action)
            elif kind is enc.StartWrite:
                work.extend(self.start_write(rank, action))
            elif kind is enc.Conclude:
                send = action.token
                send.concluded.append((action.status, action.failure, self.step))
                self.note(f"encode {rank.rank}: room {action.room} concluded {action.status.name}"
                          + (f" ({action.failure.kind.value}): {action.failure.detail}" if action.failure else ""))
                self.expect(len(send.concluded) == 1, f"encode {rank.rank} concluded room {action.room} twice")
        # The queue_depth gauge counts the queued writes that may still start, and only those.
        may_start = sum(1 for queue in rank.core.scheduler._queues.values() for _, job, _ in queue
                        if not rank.core._unwanted(job))
        self.expect(rank.core.writes_to_start == may_start,
                    f"encode {rank.rank}: {rank.core.writes_to_start} writes counted waiting to start, {may_start} may")

    def push_status(self, rank: EncodeRank, push: enc.PushStatus) -> None:
        endpoint = (push.endpoint, push.port)
        target = next((p for p in self.prefills if p.endpoint == endpoint), None)
        what = "cancel answer " + push.cancel.name if push.cancel is not None \
            else push.status.name
        send = rank.sends.get(push.room)
        if push.status is TransferPoll.Failed and push.cancel is None and send is not None and send.concluded:
            # A room served in full stays served (Failed is sticky on the wire); one write failing still
            # tells every receiver of its room Failed (SPEC.md 6), those told Success before included.
            self.expect(send.concluded[0][0] is not TransferPoll.Success,
                        f"encode {rank.rank} pushed Failed for room {push.room} after serving all of it")
        self.note(f"encode {rank.rank}: push {what} for room {push.room} to {endpoint}")
        if target is None or not target.alive:
            return  # nobody listens there: a push to a dead rank is dropped
        frames = status_message(push, rank.rank)
        self.statuses.setdefault((rank.rank, endpoint), deque()).append(frames)

    def start_write(self, rank: EncodeRank, write: enc.StartWrite) -> list:
        if not rank.core.wants(write.wid):
            self.note(f"encode {rank.rank}: write {write.wid} (room {write.room}) skipped")
            return rank.core.write_skipped(write.wid, self.now)
        sums = []
        for src, length in zip(write.srcs, write.lengths):
            found = source(write.room, src, length)
            self.expect(found is not None, f"encode {rank.rank} reads [{src:#x}, +{length}) outside room "
                                           f"{write.room}'s rows")
            data, offset, _ = found
            sums.append(layer_sum(data[offset:offset + length]))
        self.note(f"encode {rank.rank}: write {write.wid} room {write.room} to {write.session_id} "
                  f"{[(hex(d), n) for d, n in zip(write.dsts, write.lengths)]}")
        rank.flights.setdefault(write.session_id, deque()).append(Flight(rank.rank, write, tuple(sums)))
        return []

    def land(self, flight: Flight) -> None:
        """The write's bytes reach the prefill rank's memory (checked against every rule they could break)."""
        write, rank = flight.write, self.encodes[flight.encode]
        flight.landed = True
        target = next((p for p in self.prefills if p.session == write.session_id), None)
        if target is None or not target.alive:
            self.note(f"encode {rank.rank}: write {write.wid} finds no one at {write.session_id}")
            return
        owner = None
        for src, dst, length in zip(write.srcs, write.dsts, write.lengths):
            if length == 0:
                continue
            announced = rank.announced.get(write.session_id, [])
            self.expect(any(base <= dst and dst + length <= base + n for base, n in announced),
                        f"encode {rank.rank} wrote [{dst:#x}, +{length}) into {write.session_id} outside every "
                        f"region it announced ({[(hex(b), n) for b, n in announced]})")
            owners = [r for r in self.all_receives if r.session == target.session and r.holds(dst, length)]
            self.expect(len(owners) == 1 and owners[0].room == write.room,
                        f"encode {rank.rank} wrote room {write.room}'s [{dst:#x}, +{length}) outside that room's "
                        f"destination at {write.session_id}")
            owner = owners[0]
            self.expect(owner.safe_at is None, f"encode {rank.rank} wrote into room {owner.room} token {owner.token} "
                                               f"at {write.session_id} after its memory was declared safe (step "
                                               f"{owner.safe_at})")
            data, offset, deep = source(write.room, src, length)
            target.memory[dst - target.base:dst - target.base + length] = data[offset:offset + length]
            if not deep:
                for row in range(offset // ROW, (offset + length) // ROW):
                    self.rows_written[(write.room, row)] = self.rows_written.get((write.room, row), 0) + 1
        if owner is not None:
            owner.landed += 1
        self.note(f"encode {rank.rank}: write {write.wid} landed at {write.session_id}")

    def settle_write(self, flight: Flight, error: str | None = None) -> None:
        """The engine reports the write over: done, or failed with `error`."""
        rank = self.encodes[flight.encode]
        queue = rank.flights[flight.write.session_id]
        assert queue[0] is flight
        queue.popleft()
        target = next((p for p in self.prefills if p.session == flight.write.session_id), None)
        if error is None and (target is None or not target.alive):
            error = "peer gone"
        if error is None:
            self.note(f"encode {rank.rank}: write {flight.write.wid} done")
            self.carry_encode(rank, rank.core.write_done(flight.write.wid, flight.checksums, self.now))
        else:
            self.note(f"encode {rank.rank}: write {flight.write.wid} failed: {error}")
            if not flight.landed:
                rank.late.append(flight)
            self.carry_encode(rank, rank.core.write_failed(flight.write.wid, error, 0.01, self.now))

    # ---------------------------------------------------------------- delivery

    def deliver_request(self, key: tuple, duplicate: bool = False) -> None:
        queue = self.requests[key]
        frames, what = queue[0] if duplicate else queue.popleft()
        if not queue:
            del self.requests[key]
        p, addr, conn = key
        rank = next(e for e in self.encodes if e.addr == addr)
        if not rank.alive:
            self.note(f"prefill {p} -> encode {rank.rank} (conn {conn}): {what} lost")
            return
        self.note(f"prefill {p} -> encode {rank.rank} (conn {conn}): {what}" + (" (again)" if duplicate else ""))
        try:
            if is_registration(frames):
                reg = parse_registration(frames)
                rank.announced.setdefault(reg.session_id, []).extend(
                    [(reg.embedding_base, reg.embedding_len or 0), (reg.deepstack_base, reg.deepstack_len or 0)])
                self.carry_encode(rank, rank.core.registration(reg, self.now))
            elif is_cancel(frames):
                cancel = parse_cancel(frames)
                self.cancels_delivered.append((rank.rank, cancel.room, cancel.session_id, self.step))
                self.carry_encode(rank, rank.core.cancel(cancel, self.now))
            else:
                self.carry_encode(rank, rank.core.ask(TransferInfo.from_frames(frames), self.now))
        except WireError as exc:
            self.fail(f"a request our own prefill core made does not parse: {exc}")

    def deliver_status(self, key: tuple, duplicate: bool = False) -> None:
        queue = self.statuses[key]
        frames = queue[0] if duplicate else queue.popleft()
        if not queue:
            del self.statuses[key]
        e, endpoint = key
        rank = next(p for p in self.prefills if p.endpoint == endpoint)
        if not rank.alive:
            self.note(f"encode {e} -> prefill {rank.rank}: status lost")
            return
        core = rank.core
        answer = parse_cancel_reply(frames)
        if answer is not None:
            self.note(f"encode {e} -> prefill {rank.rank}: cancel answer room {answer.room} "
                      f"{answer.answer.name}" + (" (again)" if duplicate else ""))
            self.carry_prefill(rank, core.cancel_answered(self.now, answer.room, answer.rank, answer.answer))
            return
        settled = lane.settles(frames, core.lanes) if self.lanes else None
        if settled is not None:
            del core.lanes[settled]
            self.settled_in_lanes += 1
            self.note(f"encode {e} -> prefill {rank.rank}: room {settled} Success" + (" (again)" if duplicate else ""))
            self.carry_prefill(rank, core.lanes_settled(self.now, [settled]))
            return
        unreadable = None
        try:
            room, status, sender, sums = parse_status(frames)[:4]
        except UnreadableChecksum as exc:
            room, status, sender, sums, unreadable = exc.room, exc.status, exc.rank, (), str(exc)
        self.note(f"encode {e} -> prefill {rank.rank}: room {room} {status.name}" + (" (again)" if duplicate else ""))
        self.carry_prefill(rank, core.status(self.now, room, status, sender, sums, unreadable=unreadable))

    def lose_requests(self, key: tuple) -> None:
        """The connection drops what it queued; the prefill driver sees the drop and tells its core (unless
        that connection was let go or dropped before: then only what it still carried is lost)."""
        p, addr, conn = key
        lost = self.requests.pop(key)
        rank = self.prefills[p]
        if rank.conns.get(addr) != conn:
            self.note(f"prefill {p} -> encode {addr} (old conn {conn}): {len(lost)} late requests lost")
            return
        self.note(f"prefill {p} -> encode {addr} (conn {conn}): connection lost, {len(lost)} requests with it")
        rank.conns.pop(addr)
        self.carry_prefill(rank, rank.core.connection_dropped(self.now, addr))

    def drop_connection(self, p: int, addr: tuple[str, int]) -> None:
        """Prefill rank `p`'s connection to `addr` drops (its driver sees the drop and tells its core); what it
        had queued is not lost: it may still reach the encode rank, late, after what goes on the fresh one."""
        rank = self.prefills[p]
        conn = rank.conns.pop(addr)
        queued = len(self.requests.get((p, addr, conn), ()))
        self.note(f"prefill {p} -> encode {addr} (conn {conn}): connection dropped, {queued} requests may arrive late")
        self.carry_prefill(rank, rank.core.connection_dropped(self.now, addr))

    def stop_encode(self, e: int) -> None:
        """Encode rank `e`'s process is stopped: what reaches it waits unread, its writes and pushes wait."""
        self.stopped.add(e)
        self.note(f"encode {e}: stopped")

    def resume_encode(self, e: int) -> None:
        self.stopped.discard(e)
        self.note(f"encode {e}: resumed")

    def ask_outside(self, p: int, room: int) -> None:
        """Prefill rank `p`'s session asks for `room` with a destination that runs past its region's end."""
        rank = self.prefills[p]
        span = span_of(room)
        row_start, rows = prefill_shard(span, p, self.prefill_tp, self.encode_tp)
        regions = self.regions[p]
        e = p // (self.prefill_tp // self.encode_tp)
        deep = has_deepstack(room)
        info = TransferInfo(room, rank.endpoint[0], rank.endpoint[1], rank.session,
                            regions.embedding.addr + regions.embedding.nbytes - ROW,
                            regions.deepstack.addr if deep else 0, max(rows, 2), HIDDEN, DTYPE, deep,
                            self.prefill_tp // self.encode_tp, row_start, span)
        self.note(f"prefill {p}: asks for room {room} into {info.embedding_ptr:#x}, past its region")
        self.send_request(rank, self.encodes[e].addr, info.to_frames(), f"ask room {room} past the region")

    def lose_statuses(self, key: tuple) -> None:
        lost = self.statuses.pop(key)
        self.note(f"encode {key[0]} -> {key[1]}: connection lost, {len(lost)} statuses with it")

    def verify(self, rank: PrefillRank) -> None:
        """Prefill rank checksums the landed bytes, as its driver does after a Success."""
        v = rank.verifies.popleft()
        for what, _, addr, nbytes, expected in v.checks:
            landed = layer_sum(bytes(self.read(rank, addr, nbytes)))
            if landed != expected:
                self.note(f"prefill {rank.rank}: room {v.room} {what} checksum {landed} != {expected}")
                self.carry_prefill(rank, rank.core.checksum_mismatched(self.now, v.room, v.token, what, expected,
                                                                       landed))
                return
        self.note(f"prefill {rank.rank}: room {v.room} verified")
        self.carry_prefill(rank, rank.core.checksum_verified(self.now, v.room, v.token))

    def answer_lookup(self, rank: PrefillRank, error: str | None = None) -> None:
        action = rank.lookups.popleft()
        core = rank.core
        if error is not None:
            key = action.key if type(action) is pre.LookUpRoute else None
            self.note(f"prefill {rank.rank}: look-up {key or 'sizes'} failed: {error}")
            self.carry_prefill(rank, core.lookup_failed(self.now, BOOT, key, error, 0.01))
        elif type(action) is pre.LookUpParallel:
            self.note(f"prefill {rank.rank}: look-up: encode tp {self.encode_tp}, dp 1")
            self.carry_prefill(rank, core.parallel_resolved(self.now, BOOT, self.encode_tp, 1))
        else:
            addr = self.encodes[action.key[2]].addr
            self.note(f"prefill {rank.rank}: look-up: encode rank {action.key[2]} at {addr}")
            # Our bootstrap server names the registration of each of our encode ranks.
            self.carry_prefill(rank, core.route_resolved(self.now, action.key, addr, f"encode-{action.key[2]}"))

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.note(f"tick +{seconds:g}s")
        for rank in self.encodes:
            if rank.alive and rank.rank not in self.stopped:
                self.carry_encode(rank, rank.core.tick(self.now))
        for rank in self.prefills:
            if rank.alive:
                self.carry_prefill(rank, rank.core.tick(self.now))

    def kill_prefill(self, p: int) -> None:
        """Prefill rank `p`'s process dies: its rooms never conclude, its memory and unsent requests are gone."""
        rank = self.prefills[p]
        rank.alive = False
        for key in [k for k in self.requests if k[0] == p]:
            del self.requests[key]
        for key in [k for k in self.statuses if k[1] == rank.endpoint]:
            del self.statuses[key]
        rank.lookups.clear()
        rank.verifies.clear()
        self.note(f"prefill {p}: dies")

    def restart_prefill(self, p: int) -> None:
        """Prefill rank `p` dies and a new process takes its place: a new session at the same status endpoint,
        its memory at the same addresses, its rooms received afresh."""
        self.kill_prefill(p)
        old = self.prefills[p]
        generation = old.generation + 1
        core = pre.PrefillCore(p, self.prefill_tp, 1, host=old.core.host, status_port=old.core.status_port,
                               session_id=f"{old.core.host}:{17000 + p + 100 * generation}",
                               deadline_s=old.core.deadline_s, integrity=old.core.integrity)
        self.prefills[p] = PrefillRank(p, core, bytearray(len(old.memory)), old.base, old.endpoint,
                                       generation=generation)
        self.note(f"prefill {p}: restarted as session {core.session_id}")

    def live_session(self, session: str) -> bool:
        """Whether a live prefill process holds `session`."""
        return any(p.alive and p.session == session for p in self.prefills)

    def kill_encode(self, e: int) -> None:
        """Encode rank `e`'s process dies: writes it started may or may not have landed; nothing more comes."""
        rank = self.encodes[e]
        rank.alive = False
        rank.flights.clear()
        for key in [k for k in self.statuses if k[0] == e]:
            del self.statuses[key]
        self.note(f"encode {e}: dies")

    # ------------------------------------------------------------- schedule

    def moves(self, *, faults: bool = False) -> list[tuple[str, tuple, Any]]:
        """Every step that could happen next, in a stable order: (kind, description, action)."""
        moves = self._moves(faults=faults)
        return [move for move in moves if not self._involves_stopped(move)] if self.stopped else moves

    def _moves(self, *, faults: bool = False) -> list[tuple[str, tuple, Any]]:
        moves: list[tuple[str, tuple, Any]] = []
        for key in sorted(self.requests, key=repr):
            moves.append(("request", key, lambda k=key: self.deliver_request(k)))
        for key in sorted(self.statuses, key=repr):
            moves.append(("status", key, lambda k=key: self.deliver_status(k)))
        for rank in self.encodes:
            for session, queue in sorted(rank.flights.items()):
                if queue:
                    flight = queue[0]
                    if not flight.landed:
                        moves.append(("land", (rank.rank, session), lambda f=flight: self.land(f)))
                    else:
                        moves.append(("complete", (rank.rank, session), lambda f=flight: self.settle_write(f)))
        for rank in self.prefills:
            if rank.lookups:
                moves.append(("lookup", (rank.rank,), lambda r=rank: self.answer_lookup(r)))
            if rank.verifies:
                moves.append(("verify", (rank.rank,), lambda r=rank: self.verify(r)))
        if faults:
            for key in sorted(self.requests, key=repr):
                moves.append(("lose requests", key, lambda k=key: self.lose_requests(k)))
                moves.append(("duplicate request", key, lambda k=key: self.deliver_request(k, duplicate=True)))
            for key in sorted(self.statuses, key=repr):
                moves.append(("lose statuses", key, lambda k=key: self.lose_statuses(k)))
                # Statuses name only the room: with integrity checks off, a Success that came twice would be taken
                # by a later ask of its room number from the same rank, which nothing on the wire tells apart
                # (docs/guarantees.md, "Stale messages stay stale"). No encode rank of ours sends one twice, nor
                # does TCP repeat one; this network repeats any other message, and with integrity on, a Success.
                if self.integrity or not _is_success(self.statuses[key][0]):
                    moves.append(("duplicate status", key, lambda k=key: self.deliver_status(k, duplicate=True)))
            for rank in self.encodes:
                for session, queue in sorted(rank.flights.items()):
                    if queue:
                        moves.append(("fail write", (rank.rank, session),
                                      lambda f=queue[0]: self.settle_write(f, "transfer failed")))
                for flight in rank.late:
                    moves.append(("land late", (rank.rank, flight.write.wid),
                                  lambda r=rank, f=flight: (r.late.remove(f), self.land(f))))
            for rank in self.prefills:
                e = rank.rank // (self.prefill_tp // self.encode_tp)
                if rank.alive and self.encodes[e].announced.get(rank.session):  # a peer's unannounced ask goes anywhere
                    for room in (1, 2):
                        moves.append(("ask outside", (rank.rank, room),
                                      lambda p=rank.rank, room=room: self.ask_outside(p, room)))
                if rank.lookups:
                    moves.append(("fail lookup", (rank.rank,),
                                  lambda r=rank: self.answer_lookup(r, "connection refused")))
        return moves

    def _involves_stopped(self, move: tuple[str, tuple, Any]) -> bool:
        """Whether the move needs an encode rank that is stopped now."""
        if not self.stopped:
            return False
        kind, key = move[0], move[1]
        if kind in ("request", "lose requests", "duplicate request"):
            return any(e.addr == key[1] and e.rank in self.stopped for e in self.encodes)
        if kind in ("status", "land", "complete", "lose statuses", "duplicate status", "fail write", "land late"):
            return key[0] in self.stopped
        return False

    def do(self, move: tuple[str, tuple, Any]) -> None:
        self.step += 1
        move[2]()

    def drain(self, *kinds: str, max_steps: int = 10_000) -> None:
        """Carries out the pending steps of these kinds (see `moves()`), first first, until none is left."""
        for _ in range(max_steps):
            moves = [move for move in self.moves() if move[0] in kinds]
            if not moves:
                return
            self.do(moves[0])
        self.fail(f"{kinds} never drained")

    def settle(self, *, max_steps: int = 10_000) -> None:
        """Delivers everything pending in order and lets time pass until every deadline and sweep has run."""
        self.note("settle: everything pending is delivered, then time passes")
        for e in sorted(self.stopped):
            self.resume_encode(e)
        start, horizon = self.now, 4 * max(self.prefills[0].core.deadline_s, self.encodes[0].core.fanout_timeout_s)
        for _ in range(max_steps):
            moves = self.moves()
            if moves:
                self.do(moves[0])
            elif self.now < start + horizon:
                self.step += 1
                self.tick(horizon / 16)
            else:
                return
        self.fail("the pair did not settle")

    # ------------------------------------------------------------- verdicts

    def check_concluded(self) -> None:
        """Every send concluded exactly once; every receive on a live rank not cleared first concluded once."""
        for send in self.all_sends:
            if self.encodes[send.rank].alive:
                self.expect(len(send.concluded) == 1, f"encode {send.rank} room {send.room} concluded "
                                                      f"{len(send.concluded)} times")
        for rec in self.all_receives:
            if self.live_session(rec.session) and not (rec.cleared and not rec.concluded):
                self.expect(len(rec.concluded) == 1, f"prefill {rec.rank} room {rec.room} token {rec.token} "
                                                     f"concluded {len(rec.concluded)} times")


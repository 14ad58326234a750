"""The encode core's shortcuts for the plain case answer every event as its rules read without them.

`StrictCore` is EncodeCore with each rule that has a shortcut read the long way (the
Breaker, scheduler and parked-ask book behind it as they are); Hypothesis drives both
with the same events (items with and without ready events, asks that agree or disagree,
restarts, registrations, cancels, clears, writes that land, fail or are skipped, ticks
and time past the timeouts) and every answer must be the same, action for action, as
must be whether each write started and not yet over is still wanted, and the scheduler's counts
(the writes waiting and in flight, each session's slots and its work this turn).
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from transfer.core.encode import (CLEARED_GRACE_S, REASK_GRACE_S, SWEEP_S, EncodeCore, Offer, Progress, StartWrite,
                                   _grace_over, _HeldItem, _Job, _late_item, _Room)
from transfer.core.failure import CLEARED
from transfer.status import TransferPoll
from transfer.core.failure import Failure, FailureKind
from transfer.frames import Cancel, Registration, TransferInfo, receiver_text, shard_rows

HIDDEN = 4
DTYPE = "torch.int8"
ROW = HIDDEN
SRC = 0x1000
BASE = 0x10_0000
SLOT = 0x100
SESSIONS = ["10.0.0.1:100", "10.0.0.1:101", "10.0.0.2:100", "10.0.0.1:102"]


class StrictCore(EncodeCore):
    """EncodeCore with the rules its shortcuts skip read in full."""

    def ask(self, info: TransferInfo, now: float) -> list:
        self.breaker.heard_from(info.session_id, now)  # it reaches us: a pause after a slow failure may end
        if info.fanout > self.parked.max_receivers:
            # No room takes that many receivers: it would wait out the fanout timeout.
            self._warn("receivers", "room %d: %s asked with fanout %d, more than the %d receivers a room may have",
                       info.room, receiver_text(info.session_id), info.fanout, self.parked.max_receivers)
            self._tell_failed([info], Failure(FailureKind.GEOMETRY, f"room {info.room}: asked with fanout "
                                                                    f"{info.fanout}, more than the "
                                                                    f"{self.parked.max_receivers} receivers a room "
                                                                    f"may have"))
            return self._flush(now)
        room = self._rooms.get(info.room)
        if room is None and self._recent(self._cleared_failures.get(info.room), now) is not None:
            # A receiver's cancel failed the room's item, or it came late, and the caller has cleared it since:
            # parked like any ask, this one is told why after CLEARED_GRACE_S unless the caller sends the room
            # again meanwhile (a retry).
            self._reasks_due.append((info, now))
        if room is not None and not room.failed and info.session_id not in room.served and info in room.receivers:
            # A copy of an ask its room is writing now (the message came twice): parked, it would wait
            # for the room's next send and be told Failed when none came.
            self._warn("repeated ask", "room %d: %s asked again for the write under way; ignoring the copy",
                       info.room, receiver_text(info.session_id))
            return self._flush(now)
        predecessor = self._predecessor_by_shard(info)
        if predecessor is not None:
            self._supersede(predecessor, info.session_id, "shard",
                            f"asking for room {info.room}'s shard (rows {info.row_start}+{info.rows} of fanout "
                            f"{info.fanout}) it had asked for", now)
        admission = self.parked.add(info, now)
        if admission.refused:
            self._warn("receivers", "room %d: more than %d receivers asked; telling %s Failed",
                       info.room, self.parked.max_receivers, receiver_text(info.session_id))
            self._tell_failed([info], Failure(FailureKind.GEOMETRY, f"room {info.room}: more than "
                                                                    f"{self.parked.max_receivers} receivers asked"))
            return self._flush(now)
        self._forget_cancel(info)
        for asks in admission.evicted:
            self._warn("parked", "room %d: %d rooms (%d bytes of asks) were asked for and not served yet; "
                       "failing the oldest ask", asks.room, len(self.parked) + 1, self.parked.nbytes + asks.nbytes)
            failure = Failure(FailureKind.OTHER, f"room {asks.room}: dropped unserved, the oldest of more than "
                                                 f"{len(self.parked)} rooms asked for and not served yet")
            self._tell_failed(asks.infos.values(), failure)
            evicted = self._rooms.get(asks.room)
            if evicted is not None and asks.room in self._unserved:  # sent: told Failed, its ranks ask no more
                self._fail_with(evicted, failure, now)
        for dropped in admission.dropped:
            self._drop_over_share(dropped, now)
        self._dispatch(info.room, now, asked=info)
        return self._flush(now)

    def _start(self, job: _Job, now: float) -> None:
        room, info = job.room, job.info
        if job in room.queued:
            del room.queued[job]
        offer = room.offer
        since = self.breaker.open_since(info.session_id, now)
        if since is not None:
            self._skip(job, FailureKind.WRITE, self._paused_detail(info.session_id, room.room, since, now), now)
            return
        outside = (None if job.regions_checked == self.regions.version
                   else self.regions.check([info], offer.row_bytes, offer.deepstack_row_bytes))
        if outside is not None:
            self._skip(job, FailureKind.REGION, f"{outside} (found as its queued write was to start)", now)
            return
        srcs: tuple[int, ...] = (offer.src_addr + info.row_start * offer.row_bytes,)
        dsts: tuple[int, ...] = (info.embedding_ptr,)
        lengths: tuple[int, ...] = (info.rows * offer.row_bytes,)
        if offer.deepstack_addr is not None:
            srcs += (offer.deepstack_addr + info.row_start * offer.deepstack_row_bytes,)
            dsts += (info.deepstack_ptr,)
            lengths += (info.rows * offer.deepstack_row_bytes,)
        wid, self._next_wid = self._next_wid, self._next_wid + 1
        self._writes[wid] = job
        self._out.append(StartWrite(wid, room.room, info.session_id, srcs, dsts, lengths, sum(lengths), offer.sources,
                                    offer.token))

    def wants(self, wid: int) -> bool:
        job = self._writes.get(wid)
        return job is not None and not (job.room.failed or not self._serves(job))

    def _pump(self, now: float) -> None:
        if self._closed or self._writes_stopped or not self.scheduler.waiting:
            return
        picked = self.scheduler.pick(now, cancelled=lambda job: job.room.failed or not self._serves(job),
                                     ready=lambda job: self._ready(job, now), expired=lambda job, waited:
                                     self._expired(job, waited, now))
        for job in picked.dropped:
            self._job_done(job, now)
        for job in picked.start:
            self._start(job, now)

    def tick(self, now: float, unread: bool = False) -> list:
        self.scheduler.new_turn()
        if self._unread.holds(now, unread, self._rules_due()):
            return self._flush(now)
        while self._clears_due and now >= self._clears_due[0][1] + CLEARED_GRACE_S:
            self._fail_cleared_asks(*self._clears_due.popleft())
        while self._reasks_due and now >= self._reasks_due[0][1] + CLEARED_GRACE_S:
            self._tell_reask(*self._reasks_due.popleft())
        if self._held:
            self._fail_unclaimed_held(now)
        self._destinations.expire(now)
        if now >= self._next_sweep:
            self._sweep(now)
            self._next_sweep = now + SWEEP_S
        return self._flush(now)

    def _rules_due(self) -> float:
        due = self._next_sweep
        if self._clears_due:
            due = min(due, self._clears_due[0][1] + CLEARED_GRACE_S)
        if self._reasks_due:
            due = min(due, self._reasks_due[0][1] + CLEARED_GRACE_S)
        for held in self._held.values():  # items sent right after a cancel: MAX_CANCELLED_ROOMS at most
            due = min(due, held.cancelled_at + REASK_GRACE_S)
        return due

    def _dispatch(self, room_number: int, now: float, asked: TransferInfo | None = None,
                  room: _Room | None = None) -> None:  # the room looked up here, whatever the caller holds
        asks = self.parked.get(room_number)
        if asks is None:
            return
        room = self._rooms.get(room_number)
        if room is None or room.succeeded or (room.receivers and not room.failed and not room.orphans):
            return  # a served room's sources may be released: later asks wait for its next send
        # Read before the newcomers' asks are dropped below.
        fanout, first_at, last_at = asks.fanout, asks.first_at, asks.last_at
        kept = [] if room.failed else room.receivers  # being served: their asks wait for the next send
        sessions = {info.session_id for info in kept}
        if not room.failed:
            if asked is not None and not kept:
                # The first ask's fanout is the room's (asks.fanout): a later ask that agrees with it agrees.
                if asked.fanout != fanout or asked.session_id == asks.first:
                    self._check_fanouts_agree(room, asks, [asked], now)
            else:
                self._check_fanouts_agree(room, asks, [*kept, *asks.infos.values()], now)
        if not room.failed:
            asked_now = len(asks.infos) if not sessions else sum(1 for s in asks.infos if s not in sessions)
            if len(kept) + asked_now < fanout:
                return
        newcomers = sorted((info for info in asks.infos.values() if info.session_id not in sessions),
                           key=lambda i: (i.row_start, i.session_id))
        if sessions:  # the asks of receivers being served stay parked for the room's next send
            for info in newcomers:
                self.parked.drop_ask(room_number, info.session_id)
        else:
            self.parked.take(room_number)
        if room.failed:
            for info in newcomers:
                self._tell_failed([info], self._reask_failure(room, info, now))
            return
        infos = sorted(kept + newcomers, key=lambda i: (i.row_start, i.session_id)) if kept else newcomers
        room.receivers = infos
        room.orphans = []
        self._unserved.discard(room_number)
        offer = room.offer
        ranges = [self._ranges_one(info, offer) for info in newcomers]
        if (self._fanout_too_late(room, fanout, first_at, last_at, len(infos), now)
                or self._refused(room, infos, newcomers, ranges, fanout, now)):
            return
        if not kept:
            self._out.append(Progress(room_number, offer.token, TransferPoll.Transferring, first_at, now))
        # A fanout let in past its time-out while the rules were held back: its writes' wait starts now.
        self._queue_writes(room, newcomers, ranges, first_at if now - first_at <= self.fanout_timeout_s else now,
                           now)

    @staticmethod
    def _ranges_one(info: TransferInfo, offer: Offer) -> list[tuple[int, int]]:
        length = info.rows * offer.row_bytes
        ranges = [(info.embedding_ptr, info.embedding_ptr + length)] if length > 0 else []
        if offer.deepstack_addr is not None:
            length = info.rows * offer.deepstack_row_bytes
            if length > 0:
                ranges.append((info.deepstack_ptr, info.deepstack_ptr + length))
        return ranges

    def _queue_writes(self, room: _Room, newcomers: list[TransferInfo], ranges: list[list[tuple[int, int]]],
                      first_at: float, now: float) -> None:  # every job queued: the pick in _flush starts them
        room.pending += len(newcomers)
        version, hold, queued, push = self.regions.version, self._destinations.hold, room.queued, self.scheduler.push
        for info, spans in zip(newcomers, ranges):
            session = info.session_id
            job = _Job(room, info, hold(session, room.room, spans), version)
            queued[job] = None
            push(job, session, first_at)

    def _flush(self, now: float) -> list:
        self._pump(now)
        out, self._out = self._out, []
        return out

    def write_done(self, wid: int, checksums: tuple[int, ...], now: float) -> list:
        job = self._writes.pop(wid, None)
        if job is not None:
            self.scheduler.finished(job.info.session_id)
            self.breaker.succeeded(job.info.session_id)
            if not job.room.failed and self._serves(job):
                self._push(job.info, TransferPoll.Success, checksums)
                job.room.served.add(job.info.session_id)
            self.regions.served(job.info.session_id)
            self._job_over(job)
            self._job_done(job, now)
        return self._flush(now)

    def offer(self, offer: Offer, now: float) -> list:
        old = self._rooms.get(offer.room)
        if old is not None:  # the caller clears before sending again; a stale one is failed, not kept
            self._fail_with(old, CLEARED, now)
            self._unserved.discard(old.room)
        room = self._rooms[offer.room] = _Room(offer, now)
        if self._closed:  # sent while the driver was closing: nothing will serve it
            self._fail(room, FailureKind.CLOSED, self._close_detail, now)
            return self._out_take()
        self._cleared_failures.pop(offer.room, None)
        timed_out = self._recent(self._asks_timed_out.pop(offer.room, None), now)
        cancelled = self._recent(self._cancelled.pop(offer.room, None), now)
        if cancelled is not None and _grace_over(cancelled.cancelled_at, now):
            self._fail_cancelled_item(room, cancelled.session, cancelled.cancelled_at, now)
            return self._flush(now)
        if timed_out is not None and cancelled is None and self.parked.get(offer.room) is None:
            room.late = True
            self._fail(room, FailureKind.OTHER, _late_item(room.room, now - timed_out.first_at, self.fanout_timeout_s,
                                                           f"{timed_out.asked}, told Failed "
                                                           f"{now - timed_out.told_at:.1f}s ago"), now)
            return self._flush(now)
        if cancelled is not None:  # its receiver may be asking for it again right now: the item waits for it
            self._held[offer.room] = _HeldItem(cancelled.session, cancelled.cancelled_at, room)
        self._unserved.add(offer.room)
        self._dispatch(room.room, now)
        return self._flush(now)


class Event:
    """A ready event whose query() answers from a script, then True (or raises, scripted so)."""

    def __init__(self, script: tuple) -> None:
        self.script = list(script)

    def query(self) -> bool:
        answer = self.script.pop(0) if self.script else True
        if answer is None:
            raise RuntimeError("broken event")
        return answer


_ROOM = st.integers(0, 3)
_SESSION = st.integers(0, len(SESSIONS) - 1)
_READY = st.one_of(st.none(), st.tuples(st.sampled_from([False, True, None]), st.booleans()))
EVENTS = st.lists(st.one_of(
    st.tuples(st.just("offer"), _ROOM, st.sampled_from([4, 4, 3, 1]), st.booleans(), _READY),
    st.tuples(st.just("ask"), _ROOM, _SESSION, st.sampled_from([1, 2, 2, 3, 4, 2000]), st.integers(0, 3),
              st.sampled_from(["plain"] * 6 + ["span", "hidden", "ptr", "slot", "rows"]), st.booleans()),
    st.tuples(st.just("room"), _ROOM, st.integers(1, 4), st.integers(0, 4), _SESSION, st.booleans(), _READY),
    st.tuples(st.just("room"), _ROOM, st.integers(1, 4), st.integers(0, 4), _SESSION, st.booleans(), _READY),
    st.tuples(st.just("clear"), _ROOM),
    st.tuples(st.just("register"), _SESSION, st.integers(0, 2), st.sampled_from([None, 8 * SLOT, SLOT // 2])),
    st.tuples(st.just("cancel"), _ROOM, _SESSION, st.booleans(), st.booleans()),
    st.tuples(st.just("write"), st.integers(0, 7), st.sampled_from(["done", "done", "done", "failed", "slow", "stall",
                                                                     "skipped", "checksum"])),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.6, 3.0, 11.0]), st.booleans()),
    st.tuples(st.just("wait"), st.sampled_from([0.05, 11.0])),  # a driver held up: time passes without a tick
), max_size=40)


def _rounds(events: list) -> list:
    """The events, each ("room", room, fanout, offer after this many asks, first session, deepstack) spelled
    out: a plain round of the room, its whole fanout asking from sessions in turn, its item among them."""
    spelled: list = []
    for event in events:
        if event[0] != "room":
            spelled.append(event)
            continue
        _, room, fanout, offer_at, first, deepstack, ready = event
        asks = [("ask", room, (first + rank) % len(SESSIONS), fanout, rank, "plain", deepstack)
                for rank in range(fanout)]
        asks.insert(min(offer_at, fanout), ("offer", room, 4, deepstack, ready))
        spelled += asks
    return spelled


def _drive(core: EncodeCore, events: list, tokens: list) -> list:
    """Every answer the core gives to `events`, in order (with its queries' outcomes)."""
    now = 0.0
    answers: list = []
    offered: dict[int, object] = {}
    writes: list[int] = []
    for event in _rounds(events):
        kind = event[0]
        if kind == "offer":
            _, room, span, deepstack, ready = event
            token = tokens[len(answers) % len(tokens)]
            offered[room] = token
            script = None if ready is None else ((ready[0],) * 3 if ready[1] else (ready[0],))
            out = core.offer(Offer(room, token, SRC, span, HIDDEN, DTYPE, ROW, 0x8000 if deepstack else None,
                                   2 * ROW if deepstack else 0, None if script is None else Event(script)), now)
        elif kind == "ask":
            _, room, session, fanout, rank, variant, deepstack = event
            span = 3 if variant == "span" else 4
            start, rows = shard_rows(span, rank % min(fanout, 4), min(fanout, 4))
            if variant == "rows":
                rows += 1
            slot = (room + (1 if variant == "slot" else 0)) % 4
            ptr = BASE + slot * SLOT + (7 * SLOT if variant == "ptr" else 0) + start * ROW
            out = core.ask(TransferInfo(room, "10.0.0.9", 6000 + session, SESSIONS[session], ptr,
                                        0x9000 + start * 2 * ROW if deepstack else 0, rows,
                                        HIDDEN + (1 if variant == "hidden" else 0), DTYPE, deepstack, fanout, start,
                                        span, 2 * ROW if deepstack else None), now)
        elif kind == "clear":
            out = core.clear(event[1], offered.get(event[1]), now)
        elif kind == "register":
            _, session, port, length = event
            out = core.registration(Registration("10.0.0.9", 6000 + port, SESSIONS[session], BASE, 0x9000, length,
                                                 None if length is None else 0x1000), now)
        elif kind == "cancel":
            _, room, session, unasked, reads = event
            out = core.cancel(Cancel(room, "10.0.0.9", 6000 + session, SESSIONS[session], reads, unasked=unasked),
                              now)
        elif kind == "write":
            if not writes:
                continue
            wid = writes.pop(event[1] % len(writes))
            how = event[2]
            if how == "done":
                out = core.write_done(wid, (), now)
            elif how == "failed":
                out = core.write_failed(wid, "refused", 0.01, now)
            elif how == "slow":
                out = core.write_failed(wid, "timed out", 2.0, now)
            elif how == "stall":
                out = core.write_failed(wid, "no handshake", 2.0, now, blocking=True)
            elif how == "skipped":
                out = core.write_skipped(wid, now)
            else:
                writes.append(wid)
                out = core.checksum_failed(wid, "bad rows", now)
        elif kind == "wait":
            now += event[1]
            continue
        else:
            _, passed, unread = event
            now += passed
            out = core.tick(now, unread)
        writes += [action.wid for action in out if isinstance(action, StartWrite)]
        scheduler = core.scheduler
        answers.append((out, core.next_wakeup(), [core.wants(wid) for wid in writes], scheduler.waiting,
                        scheduler.in_flight, dict(scheduler._flying), dict(scheduler._turn)))
    return answers


# Each shortcut's edge: a session paused by a stall (its ask ends no pause) and one by a slow failure (its
# ask does), each asked for again; items whose ready events complete late or raise.
@example([("room", 0, 1, 1, 0, False, None), ("write", 0, "stall"), ("tick", 0.01, False),
          ("room", 1, 2, 1, 0, False, None)], 2)
@example([("room", 0, 1, 1, 0, False, None), ("write", 0, "slow"), ("tick", 0.01, False),
          ("room", 1, 2, 2, 0, False, None), ("room", 2, 1, 0, 1, False, None)], 4)
@example([("room", 0, 2, 1, 0, True, (False, True)), ("tick", 0.01, False), ("tick", 0.01, False),
          ("room", 1, 1, 0, 2, False, (None, False))], 1)
@example([("ask", 0, 0, 2, 0, "plain", False), ("cancel", 0, 0, False, True), ("offer", 0, 4, False, None),
          ("ask", 0, 0, 2, 0, "plain", False), ("ask", 0, 1, 2, 1, "plain", False), ("tick", 0.2, False)], 2)
@example([("ask", 0, 0, 2, 0, "plain", False), ("cancel", 0, 0, False, True), ("offer", 0, 4, False, None),
          ("tick", 0.05, False), ("tick", 0.2, False)], 2)
# A rank restarted while its room's write flies: its successor's ask joins the receivers kept. A room whose
# fanout completes past the fanout timeout, its item sent in time, and one whose item came late.
@example([("register", 0, 0, None), ("room", 0, 2, 2, 0, False, None), ("register", 3, 0, None),
          ("ask", 0, 3, 2, 0, "plain", False), ("write", 0, "done"), ("write", 0, "done")], 4)
@example([("offer", 0, 4, False, None), ("ask", 0, 0, 2, 0, "plain", False), ("wait", 11.0),
          ("ask", 0, 1, 2, 1, "plain", False), ("ask", 1, 2, 2, 0, "plain", False), ("wait", 11.0),
          ("ask", 1, 3, 2, 1, "plain", False), ("offer", 1, 4, False, None)], 2)
# The first ask asked again with another fanout, held to the next one.
@example([("offer", 0, 4, False, None), ("ask", 0, 0, 3, 0, "plain", False), ("ask", 0, 1, 3, 1, "plain", False),
          ("ask", 0, 0, 2, 0, "plain", False)], 2)
# A restarted rank asking for its shard of a fanout parked in full, and of one being written.
@example([("ask", 0, 0, 2, 0, "plain", False), ("ask", 0, 1, 2, 1, "plain", False), ("ask", 0, 3, 2, 0, "plain", False),
          ("offer", 0, 4, False, None)], 2)
@example([("room", 0, 2, 2, 0, False, None), ("ask", 0, 3, 2, 0, "plain", False), ("write", 0, "done")], 2)
# An item sent after its asks were told Failed for want of it; a room a cancel failed, cleared, sent again and
# cleared again, then asked for.
@example([("ask", 0, 0, 2, 0, "plain", False), ("tick", 11.0, False), ("offer", 0, 4, False, None)], 2)
@example([("offer", 0, 4, False, None), ("ask", 0, 0, 2, 0, "plain", False), ("cancel", 0, 0, False, True),
          ("clear", 0), ("offer", 0, 4, False, None), ("clear", 0), ("wait", 0.05), ("ask", 0, 1, 2, 1, "plain", False),
          ("tick", 0.2, False)], 2)
# A write a cancel found in flight, answered once it lands; a session paused by a stall while another write to
# it flies, which lands (ending the pause), then asked for again; a session whose slow failure a word ended, a
# write to it landing (its breaker forgets it), then failing slowly again and asked for again.
@example([("room", 0, 1, 1, 0, False, None), ("cancel", 0, 0, False, True), ("write", 0, "done")], 2)
@example([("room", 0, 1, 1, 0, False, None), ("tick", 0.0, False), ("room", 1, 1, 1, 0, False, None),
          ("write", 0, "stall"), ("write", 0, "done"), ("room", 2, 1, 1, 0, False, None)], 4)
@example([("room", 0, 1, 1, 0, False, None), ("write", 0, "slow"), ("tick", 0.01, False),
          ("room", 1, 1, 1, 0, False, None), ("write", 0, "done"), ("room", 2, 1, 1, 0, False, None),
          ("write", 0, "slow"), ("tick", 0.01, False), ("room", 3, 1, 1, 0, False, None)], 2)
# A room's write to a session holding its share of the slots waits; the next room's to another starts.
@example([("room", 0, 1, 1, 0, False, None), ("room", 1, 1, 1, 0, False, None), ("room", 2, 1, 1, 1, False, None)],
         2)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=EVENTS, depth=st.integers(1, 4))
def test_the_core_answers_every_event_as_its_rules_read_without_shortcuts(events, depth):
    tokens = [object() for _ in range(3)]
    fast = _drive(EncodeCore(fanout_timeout_s=10.0, depth=depth), events, tokens)
    strict = _drive(StrictCore(fanout_timeout_s=10.0, depth=depth), events, tokens)
    assert fast == strict

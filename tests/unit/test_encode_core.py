"""The encode side's room rules on EncodeCore: events in with a fake clock, actions out, no I/O."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from transfer.core import encode as encode_core
from transfer.core.breaker import Breaker
from transfer import config
from transfer.core.encode import (
    CLEARED_GRACE_S,
    FAILED_WRITE_QUARANTINE_S,
    Conclude,
    Count,
    EncodeCore,
    Offer,
    Progress,
    PushStatus,
    Release,
    StartWrite,
    Warn,
)
from transfer.core.failure import FailureKind
from transfer.core.parked import ParkedAsks
from transfer.frames import Cancel, Registration, TransferInfo, shard_rows
from transfer.status import TransferPoll

HIDDEN = 256
DTYPE = "torch.bfloat16"
ROW = HIDDEN * 2
SRC = 0x7000_0000


class Token:
    """The caller's object for one send of a room."""


def _offer(room: int, span: int = 4, deepstack: bool = False, ready_event=None) -> Offer:
    return Offer(room, Token(), SRC, span, HIDDEN, DTYPE, ROW, 0x9000_0000 if deepstack else None,
                 2 * ROW if deepstack else 0, ready_event)


def _ask(room: int, rank: int = 0, fanout: int = 1, span: int = 4, session: str | None = None,
         ptr: int = 0x10000, hidden: int = HIDDEN, port: int = 6000) -> TransferInfo:
    start, rows = shard_rows(span, rank, fanout)
    return TransferInfo(room, "10.0.0.7", port + rank, session or f"10.0.0.7:{17000 + rank}", ptr, 0, rows, hidden,
                        DTYPE, False, fanout, start, span)


class Run:
    """A core, a fake clock and what it asked for, by kind."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("fanout_timeout_s", 10.0)
        self.now = 0.0
        self.core = EncodeCore(now=self.now, **kwargs)
        self.actions: list = []

    def __call__(self, actions: list) -> list:
        self.actions.extend(actions)
        return actions

    def at(self, t: float) -> Run:
        self.now = t
        return self

    def offer(self, offer: Offer) -> list:
        return self(self.core.offer(offer, self.now))

    def ask(self, info: TransferInfo) -> list:
        return self(self.core.ask(info, self.now))

    def tick(self) -> list:
        return self(self.core.tick(self.now))

    def of(self, kind: type, actions: list | None = None) -> list:
        return [a for a in (self.actions if actions is None else actions) if isinstance(a, kind)]

    def statuses(self, actions: list | None = None) -> list[tuple[int, int, TransferPoll]]:
        return [(a.room, a.port, a.status) for a in self.of(PushStatus, actions)]

    def conclusions(self) -> list[tuple[int, TransferPoll, FailureKind | None]]:
        return [(c.room, c.status, c.failure and c.failure.kind) for c in self.of(Conclude)]

    def complete(self, write: StartWrite, sums: tuple[int, ...] = (7,)) -> list:
        return self(self.core.write_done(write.wid, sums, self.now))


def test_an_ask_before_its_item_parks_until_the_item_comes_then_writes_its_shard():
    run = Run()
    assert run.ask(_ask(1, ptr=0x20000)) == []
    offer = _offer(1)
    out = run.at(0.25).offer(offer)
    [write] = run.of(StartWrite, out)
    assert (write.srcs, write.dsts, write.lengths) == ((SRC,), (0x20000,), (4 * ROW,))
    # Asked at 0, writing once the item came.
    assert run.of(Progress, out) == [Progress(1, offer.token, TransferPoll.Transferring, 0.0, 0.25)]
    out = run.at(0.5).complete(write, (0xABC,))
    assert run.of(PushStatus, out) == [PushStatus("10.0.0.7", 6000, 1, TransferPoll.Success, (0xABC,))]
    assert run.of(Conclude, out) == [Conclude(1, offer.token, TransferPoll.Success, None, 0.5)]
    assert run.of(Release, out) == [Release(1, offer.token)]


def test_an_item_before_its_asks_waits_for_the_whole_fanout_and_writes_each_shard():
    run = Run()
    run.offer(_offer(2, span=10, deepstack=True))
    assert run.core.parked_rooms == 1
    infos = [_ask(2, rank, fanout=3, span=10, ptr=0x40000 * (rank + 1)) for rank in range(3)]
    infos = [TransferInfo(*(getattr(i, f) for f in ("room", "endpoint", "port", "session_id", "embedding_ptr")),
                          0x80000, i.rows, i.hidden, i.dtype, True, i.fanout, i.row_start, i.span) for i in infos]
    assert run.at(1.0).ask(infos[2]) == [] and run.at(1.5).ask(infos[0]) == []
    out = run.at(2.0).ask(infos[1])
    writes = run.of(StartWrite, out)
    # Asked first at 1.0; writing once the last of the fanout asked.
    assert [(p.asked_at, p.at) for p in run.of(Progress, out)] == [(1.0, 2.0)]
    assert run.core.parked_rooms == 0
    # Sorted by row_start; each shard's rows at its own offset, embedding then deepstack.
    assert [w.srcs for w in writes] == [(SRC + i.row_start * ROW, 0x9000_0000 + i.row_start * 2 * ROW) for i in infos]
    assert [w.lengths for w in writes] == [(i.rows * ROW, i.rows * 2 * ROW) for i in infos]
    for write in writes[:2]:
        run.complete(write)
    assert run.conclusions() == []  # one receiver still writing
    run.complete(writes[2])
    assert run.conclusions() == [(2, TransferPoll.Success, None)]
    assert sorted(p for _, p, s in run.statuses() if s == TransferPoll.Success) == [6000, 6001, 6002]


def test_a_success_carries_the_embedding_then_the_deepstack_checksum():
    run = Run()
    run.offer(_offer(3, deepstack=True))
    info = dataclasses.replace(_ask(3), deepstack_ptr=0x80000, has_deepstack=True)
    [write] = run.of(StartWrite, run.ask(info))
    out = run.complete(write, (0xE, 0xD))
    assert run.of(PushStatus, out) == [PushStatus("10.0.0.7", 6000, 3, TransferPoll.Success, (0xE, 0xD))]


def test_geometry_that_disagrees_with_the_item_fails_the_room_and_tells_every_receiver():
    run = Run()
    run.offer(_offer(3))
    out = run.ask(_ask(3, hidden=512))
    assert run.of(StartWrite, out) == []
    [conclusion] = run.of(Conclude, out)
    assert conclusion.failure.kind is FailureKind.GEOMETRY and "hidden 512 != item hidden 256" in conclusion.failure.detail
    assert run.statuses(out) == [(3, 6000, TransferPoll.Failed)]


DS_ROW = 2 * ROW  # _offer's deepstack: two layers of the item's rows


def _deep_ask(room: int, rank: int = 0, fanout: int = 1, span: int = 4, width: int | None = DS_ROW) -> TransferInfo:
    """An ask with deepstack whose part 13 says `width` deepstack row bytes (None: no part 13, a peer's ask)."""
    start, rows = shard_rows(span, rank, fanout)
    return TransferInfo(room, "10.0.0.7", 6000 + rank, f"10.0.0.7:{17000 + rank}", 0x10000 * (rank + 1),
                        0x80000 * (rank + 1), rows, HIDDEN, DTYPE, True, fanout, start, span, width)


@pytest.mark.parametrize("width", [3 * ROW, ROW, DS_ROW + 2, 0])
@pytest.mark.parametrize("item_first", [True, False])
def test_a_deepstack_width_that_disagrees_with_the_item_fails_the_room_before_any_write(width, item_first):
    # Wider: the write would run past the receiver's rows into its neighbour's; narrower: it would
    # land rows of another width that a checksum over the zeroed rest cannot tell apart.
    run = Run()
    asks = [_deep_ask(6, 0, fanout=2, span=8), _deep_ask(6, 1, fanout=2, span=8, width=width)]
    if item_first:
        run.offer(_offer(6, span=8, deepstack=True))
    for info in asks:
        run.ask(info)
    if not item_first:
        run.offer(_offer(6, span=8, deepstack=True))
    assert run.of(StartWrite) == []  # not even the receiver that agrees is written
    [conclusion] = run.of(Conclude)
    assert conclusion.failure.kind is FailureKind.GEOMETRY
    assert conclusion.failure.detail == (f"room 6: receiver 10.0.0.7:17001 deepstack row bytes {width} != item "
                                         f"deepstack row bytes {DS_ROW}")
    assert sorted(run.statuses()) == [(6, 6000, TransferPoll.Failed), (6, 6001, TransferPoll.Failed)]


@pytest.mark.parametrize("width", [None, DS_ROW])
def test_an_ask_without_the_deepstack_width_or_agreeing_with_it_is_served(width):
    # None: a peer's ask, which carries no part 13, is written as the peers write.
    run = Run()
    run.offer(_offer(7, span=8, deepstack=True))
    run.ask(_deep_ask(7, 0, fanout=2, span=8, width=width))
    out = run.ask(_deep_ask(7, 1, fanout=2, span=8))
    writes = run.of(StartWrite, out)
    assert [w.lengths for w in writes] == [(4 * ROW, 4 * DS_ROW), (4 * ROW, 4 * DS_ROW)]
    assert [w.dsts for w in writes] == [(0x10000, 0x80000), (0x20000, 0x100000)]
    for write in writes:
        run.complete(write, (1, 2))
    assert run.conclusions() == [(7, TransferPoll.Success, None)]


def test_an_item_without_deepstack_does_not_read_the_width():
    run = Run()
    run.offer(_offer(8))
    out = run.ask(dataclasses.replace(_ask(8), deepstack_row_bytes=0))
    assert len(run.of(StartWrite, out)) == 1


@pytest.mark.parametrize("first, second", [(4, 2), (2, 4)])
def test_asks_that_disagree_on_the_fanout_fail_the_room_at_once_naming_both(first, second):
    # Whichever comes first, the room would otherwise wait out the fanout timeout for ranks that do not exist.
    run = Run()
    run.offer(_offer(5, span=8))
    run.ask(_ask(5, 0, fanout=first, span=8))
    out = run.ask(_ask(5, 1, fanout=second, span=8))
    assert run.of(StartWrite) == []
    [conclusion] = run.of(Conclude, out)
    assert conclusion.failure.kind is FailureKind.GEOMETRY
    assert conclusion.failure.detail == (f"room 5: receiver 10.0.0.7:17001 asked with fanout {second}, "
                                         f"receiver 10.0.0.7:17000 with fanout {first}")
    assert sorted(run.statuses(out)) == [(5, 6000, TransferPoll.Failed), (5, 6001, TransferPoll.Failed)]
    assert run.core.parked.get(5) is None


def test_the_first_ask_repeated_with_another_fanout_fails_the_room_naming_the_one_it_disagrees_with():
    run = Run()
    run.offer(_offer(5, span=8))
    run.ask(_ask(5, 0, fanout=4, span=8))
    run.ask(_ask(5, 1, fanout=4, span=8))
    out = run.ask(_ask(5, 0, fanout=2, span=8))  # the first session again, now with fanout 2
    assert run.of(StartWrite) == []
    [conclusion] = run.of(Conclude, out)
    assert conclusion.failure.kind is FailureKind.GEOMETRY
    assert conclusion.failure.detail == ("room 5: receiver 10.0.0.7:17000 asked with fanout 2, "
                                         "receiver 10.0.0.7:17001 with fanout 4")


def test_an_ask_that_does_not_complete_its_fanout_costs_the_same_however_many_asked_before_it():
    # Counted in Python calls (deterministic): a cost per ask that grew with the asks before it would
    # make a room of fanout F cost F squared on the encode driver.
    fanout = 256
    run = Run()
    run.offer(_offer(5, span=fanout))
    calls = []

    def ask_counted(rank: int) -> None:
        count = 0

        def hook(frame, event, arg):
            nonlocal count
            if event in ("call", "c_call"):
                count += 1

        info = _ask(5, rank, fanout=fanout, span=fanout)
        sys.setprofile(hook)
        try:
            run.core.ask(info, run.now)
        finally:
            sys.setprofile(None)
        calls.append(count)

    for rank in range(fanout - 1):
        ask_counted(rank)
    assert run.of(StartWrite) == []
    assert calls[10] == calls[100] == calls[-1], calls
    out = run.ask(_ask(5, fanout - 1, fanout=fanout, span=fanout))
    assert run.of(StartWrite, out) != []  # the last ask completed the fanout: its writes start


def test_an_ask_with_a_fanout_no_room_may_have_is_told_failed_at_once():
    # Parked, it would wait out the fanout timeout for receivers the bound refuses.
    run = Run()
    run.offer(_offer(5, span=8))
    limit = run.core.parked.max_receivers
    out = run.ask(_ask(5, 0, fanout=limit + 1, span=8))
    [push] = run.of(PushStatus, out)
    assert (push.room, push.port, push.status) == (5, 6000, TransferPoll.Failed)
    assert push.failure.kind is FailureKind.GEOMETRY
    assert push.failure.detail == f"room 5: asked with fanout {limit + 1}, more than the {limit} receivers a room may have"
    assert run.of(Conclude, out) == [] and run.core.parked.get(5) is None
    # The room itself still takes the receivers it may have.
    assert len(run.of(StartWrite, run.ask(_ask(5, 0, fanout=1, span=8)))) == 1


def test_a_destination_outside_the_announced_region_is_refused_before_any_write():
    run = Run()
    run(run.core.registration(Registration("10.0.0.7", 6000, "10.0.0.7:17000", 0x10000, 0, 4 * ROW, 0), run.now))
    run.offer(_offer(4))
    out = run.ask(_ask(4, ptr=0x10000 + ROW))  # runs one row past the region
    assert run.of(StartWrite, out) == []
    [conclusion] = run.of(Conclude, out)
    assert conclusion.failure.kind is FailureKind.REGION and "outside registered region" in conclusion.failure.detail
    run.offer(_offer(5))
    assert len(run.of(StartWrite, run.ask(_ask(5, ptr=0x10000)))) == 1  # inside: written


def test_a_queued_write_whose_session_registered_elsewhere_meanwhile_is_refused_when_it_would_start():
    """The manager was made again on the same engine with another buffer: the old one may be freed by now."""
    session, old, new = "10.0.0.7:17000", 0x10000, 0x90_0000
    run = Run(depth=1)
    run(run.core.registration(Registration("10.0.0.7", 6000, session, old, 0, 1 << 16, 0), run.now))
    run.offer(_offer(1))
    [first] = run.of(StartWrite, run.ask(_ask(1, ptr=old)))
    run.offer(_offer(2))
    assert run.of(StartWrite, run.ask(_ask(2, ptr=old + 4 * ROW))) == []  # queued behind the first
    run(run.core.registration(Registration("10.0.0.7", 6001, session, new, 0, 1 << 16, 0), run.at(0.1).now))
    out = run.at(0.2).complete(first)
    assert run.of(StartWrite, out) == []
    conclusions = {c.room: c.failure for c in run.of(Conclude, out)}
    assert conclusions[2].kind is FailureKind.REGION
    assert conclusions[2].detail.endswith("outside registered region [0x900000, 0x910000) (found as its queued write "
                                          "was to start)")
    run.offer(_offer(3))
    assert [w.dsts for w in run.of(StartWrite, run.ask(_ask(3, ptr=new, port=6001)))] == [(new,)]


def test_an_item_nobody_asked_for_fails_at_the_fanout_timeout_with_specs_text():
    run = Run(fanout_timeout_s=10.0)
    run.offer(_offer(6, span=4))
    run.ask(_ask(6, rank=0, fanout=2))  # half the fanout
    assert run.at(10.0).tick() == []
    out = run.at(10.6).tick()
    [conclusion] = run.of(Conclude, out)
    assert conclusion.failure.kind is FailureKind.FANOUT_TIMEOUT
    assert conclusion.failure.detail == "receiver never registered within 10s (1 of 2 prefill ranks asked)"
    assert run.statuses(out) == [(6, 6000, TransferPoll.Failed)]  # the one that asked is told
    assert 6 not in run.core.parked


def test_the_item_bound_counts_from_the_rooms_first_ask_when_that_came_first():
    run = Run(fanout_timeout_s=10.0)
    run.ask(_ask(7, rank=0, fanout=2))
    run.at(8.0).offer(_offer(7))
    out = run.at(10.6).tick()
    assert run.conclusions() == [(7, TransferPoll.Failed, FailureKind.FANOUT_TIMEOUT)]
    assert run.statuses(out) == [(7, 6000, TransferPoll.Failed)]


def test_asks_whose_item_never_comes_are_told_failed_with_a_warning():
    run = Run(fanout_timeout_s=10.0)
    run.ask(_ask(8))
    out = run.at(11.0).tick()
    assert run.statuses(out) == [(8, 6000, TransferPoll.Failed)]
    assert [w.key for w in run.of(Warn, out)] == ["unserved"] and 8 not in run.core.parked


def test_a_fanout_completed_past_the_bound_fails_rather_than_writing_late():
    run = Run(fanout_timeout_s=10.0)
    run.ask(_ask(9, rank=0, fanout=2))
    run.at(10.2).offer(_offer(9))  # before the next sweep
    out = run.ask(_ask(9, rank=1, fanout=2))
    assert run.of(StartWrite, out) == [] and [w.key for w in run.of(Warn, out)] == ["late fanout"]
    assert run.conclusions() == [(9, TransferPoll.Failed, FailureKind.FANOUT_TIMEOUT)]
    assert sorted(run.statuses(out)) == [(9, 6000, TransferPoll.Failed), (9, 6001, TransferPoll.Failed)]


def test_at_most_depth_writes_start_and_a_completion_starts_the_next():
    run = Run(depth=2)
    for room in range(3):
        run.offer(_offer(room))
    writes = [w for room in range(3) for w in run.of(StartWrite, run.ask(_ask(room, session=f"s{room}")))]
    assert [w.room for w in writes] == [0, 1] and run.core.waiting == 1
    [third] = run.of(StartWrite, run.complete(writes[0]))
    assert third.room == 2 and run.core.waiting == 0


def test_writes_that_will_never_start_are_not_counted_waiting_to_start_while_every_slot_is_taken():
    """The queue_depth gauge reads writes_to_start: a failed room's queued writes leave the scheduler's queue only
    at a pick, and no pick runs while every slot is in flight, so they are left out of the count at once."""
    run = Run(depth=1)
    offers = [_offer(room) for room in range(3)]
    for offer in offers:
        run.offer(offer)
    writes = [w for room in range(3) for w in run.of(StartWrite, run.ask(_ask(room, session=f"s{room}")))]
    assert [w.room for w in writes] == [0] and run.core.writes_to_start == 2
    run(run.core.clear(1, offers[1].token, run.now))
    assert run.core.writes_to_start == 1
    run(run.core.clear(2, offers[2].token, run.now))
    run(run.core.clear(0, offers[0].token, run.now))
    # Every room cleared: the write in flight is not waiting, and the other two never start.
    assert run.core.writes_to_start == 0 and run.core.waiting == 2
    assert run.of(StartWrite, run.complete(writes[0])) == []
    assert run.core.writes_to_start == 0 and run.core.waiting == 0


def test_a_superseded_receivers_queued_write_is_not_counted_waiting_to_start():
    run = Run(depth=1)
    old, new = "10.0.0.7:17000", "10.0.0.7:18000"
    run(run.core.registration(Registration("10.0.0.7", 6000, old, 0x10000, 0, 8 * ROW, 0), 0.0))
    run.offer(_offer(7))
    run.offer(_offer(8))
    (first,) = run.of(StartWrite, run.ask(_ask(7, session=old)))
    assert run.of(StartWrite, run.ask(_ask(8, session=old, ptr=0x10000 + 4 * ROW))) == []
    assert run.core.writes_to_start == 1
    run(run.core.registration(Registration("10.0.0.7", 6000, new, 0x10000, 0, 8 * ROW, 0), 1.0))
    assert run.core.writes_to_start == 0  # room 8 waits for the successor's ask, not for its old write
    run(run.core.write_done(first.wid, (5,), 1.5))
    assert run.core.waiting == 0 and run.core.writes_to_start == 0
    (retry,) = run.of(StartWrite, run.at(2.0).ask(_ask(8, session=new, ptr=0x10000 + 4 * ROW)))
    assert retry.session_id == new and run.core.writes_to_start == 0


def test_a_write_waits_for_its_ready_event_without_holding_up_others():
    class Event:
        done = False

        def query(self) -> bool:
            return self.done

    event = Event()
    run = Run()
    run.offer(_offer(1, ready_event=event))
    run.offer(_offer(2))
    assert run.of(StartWrite, run.ask(_ask(1, session="a"))) == []
    assert [w.room for w in run.of(StartWrite, run.ask(_ask(2, session="b")))] == [2]
    assert run.core.busy and run.of(StartWrite, run.at(1.0).tick()) == []
    event.done = True
    assert [w.room for w in run.of(StartWrite, run.at(1.1).tick())] == [1]


def test_a_ready_item_behind_many_whose_ready_events_have_not_completed_is_written_at_once():
    class Pending:
        def query(self) -> bool:
            return False

    run = Run()
    for room in range(1, 21):
        run.offer(_offer(room, ready_event=Pending()))
        run.ask(_ask(room, session="a", ptr=0x10000 * room))
    run.offer(_offer(21))
    run.ask(_ask(21, session="a", ptr=0x10000 * 21))
    # Written by the driver's next turn at the latest, long before the others' deadline.
    [write] = run.of(StartWrite, run.at(0.01).tick())
    assert write.room == 21 and run.of(StartWrite) == [write] and run.conclusions() == []


def test_a_ready_event_that_never_completes_fails_its_room_and_tells_the_receiver():
    class Never:
        def query(self) -> bool:
            return False

    run = Run(fanout_timeout_s=10.0)
    run.offer(_offer(1, ready_event=Never()))
    run.at(1.0).ask(_ask(1))
    out = run.at(10.4).tick()
    assert run.conclusions() == [(1, TransferPoll.Failed, FailureKind.WRITE)]
    assert "ready event did not complete within 10s" in run.of(Conclude)[0].failure.detail
    assert run.statuses(out) == [(1, 6000, TransferPoll.Failed)] and run.of(Release, out)


def test_a_ready_event_whose_query_raises_fails_its_room_only_naming_the_error_and_is_not_asked_again():
    class Broken:
        queries = 0

        def query(self) -> bool:
            self.queries += 1
            raise RuntimeError()  # no text of its own, as some errors have

    broken = Broken()
    run = Run(fanout_timeout_s=10.0)
    run.offer(_offer(1, ready_event=broken))
    run.offer(_offer(2))
    out = run.at(1.0).ask(_ask(1))
    [write] = run.of(StartWrite, run.at(1.0).ask(_ask(2, ptr=0x20000)))
    assert write.room == 2, "the other room is written"
    assert run.conclusions() == [(1, TransferPoll.Failed, FailureKind.WRITE)]
    assert run.of(Conclude)[0].failure.detail == "room 1: its ready event's query() raised RuntimeError()"
    assert run.statuses(out) == [(1, 6000, TransferPoll.Failed)] and run.of(Release, out)
    run.at(2.0).tick()
    assert broken.queries == 1 and run.of(StartWrite) == [write]


def test_a_write_waiting_past_the_bound_since_the_first_ask_is_never_started():
    run = Run(depth=1, fanout_timeout_s=10.0)
    run.offer(_offer(1))
    run.offer(_offer(2))
    [first] = run.of(StartWrite, run.ask(_ask(1, session="a")))
    run.ask(_ask(2, session="b"))
    out = run.at(11.0).complete(first)
    assert run.of(StartWrite, out) == []
    [_, failed] = run.of(Conclude)
    assert failed.room == 2 and "waited 11.0s since the room's first ask" in failed.failure.detail
    assert (2, 6000, TransferPoll.Failed) in run.statuses(out)


def test_a_slow_write_failure_pauses_the_session_until_it_asks_again_and_a_repeat_until_it_registers_again():
    run = Run(breaker=Breaker(pause_s=5.0, slow_after_s=0.25))
    run.offer(_offer(1))
    [write] = run.of(StartWrite, run.ask(_ask(1)))
    run.ask(_ask(2, ptr=0x20000))  # room 1's destination is held in its quarantine: another one
    out = run(run.core.write_failed(write.wid, "connection reset", took=1.0, now=1.0))
    [failed] = run.of(Conclude, out)
    assert failed.failure.kind is FailureKind.WRITE
    assert failed.failure.detail == "write to 10.0.0.7:17000 (room 1) failed: connection reset"
    out = run.at(2.0).offer(_offer(2))  # asked before the failure: its write is paused
    assert run.of(StartWrite, out) == []
    detail = run.of(Conclude, out)[0].failure.detail
    assert "skipped: a write to it failed 1.0s ago (connection reset)" in detail, "the cause is kept"
    assert detail.endswith("; writes to it fail at once for 4.0s more, or until its prefill rank asks or registers "
                           "again: is the prefill rank whose engine is 10.0.0.7:17000 still running, and that "
                           "session's host and port reachable from this encode node?"), "how long, what ends it"
    # It asks again: it reaches this rank, so the link is back; its write starts.
    run.offer(_offer(3))
    [write] = run.of(StartWrite, run.ask(_ask(3, ptr=0x30000)))
    # Failing slowly again, it is paused the whole time: only registering again ends that.
    run(run.core.write_failed(write.wid, "connection reset", took=1.0, now=3.0))
    run.at(4.0).offer(_offer(4))
    out = run.ask(_ask(4, ptr=0x40000))
    assert run.of(StartWrite, out) == []
    assert "; writes to it fail at once for 4.0s more, or until its prefill rank registers again: " in \
        run.of(Conclude, out)[0].failure.detail
    run(run.core.registration(Registration("10.0.0.7", 6000, "10.0.0.7:17000", 0x10000, 0), run.now))
    run.offer(_offer(5))
    assert len(run.of(StartWrite, run.ask(_ask(5, ptr=0x50000)))) == 1


def test_a_write_that_lands_ends_its_sessions_pause():
    run = Run(breaker=Breaker(pause_s=5.0, slow_after_s=0.25))
    run.offer(_offer(1))
    run.offer(_offer(2))
    [first] = run.of(StartWrite, run.ask(_ask(1)))
    [second] = run.of(StartWrite, run.ask(_ask(2, ptr=0x20000)))
    run.ask(_ask(3, ptr=0x30000))  # its item comes during the pause
    run(run.core.write_failed(first.wid, "timed out", took=1.0, now=1.0))
    run(run.core.write_done(second.wid, (), now=1.5))
    assert len(run.of(StartWrite, run.at(2.0).offer(_offer(3)))) == 1


def test_a_quick_write_failure_leaves_the_session_usable_and_a_stall_is_logged():
    run = Run()
    run.offer(_offer(1))
    [write] = run.of(StartWrite, run.ask(_ask(1)))
    run(run.core.write_failed(write.wid, "bad destination", took=0.001, now=0.0))
    run.offer(_offer(2))
    [write] = run.of(StartWrite, run.ask(_ask(2, ptr=0x20000)))  # room 1's destination is in its quarantine
    out = run(run.core.write_failed(write.wid, "handshake timed out", took=60.0, now=60.0, blocking=True))
    assert [w.key for w in run.of(Warn, out)] == ["stall"]
    assert run.core.breaker.open_since("10.0.0.7:17000", 60.0 + 239.0) == 60.0


def test_a_clear_before_the_whole_fanout_asked_fails_the_parked_asks_after_the_grace():
    run = Run()
    offer = _offer(1, span=4)
    run.offer(offer)
    run.ask(_ask(1, rank=0, fanout=2))
    out = run(run.core.clear(1, offer.token, run.now))
    assert run.conclusions() == [(1, TransferPoll.Failed, FailureKind.CLEARED)] and run.statuses(out) == []
    assert run.core.next_wakeup() == pytest.approx(CLEARED_GRACE_S)
    out = run.at(CLEARED_GRACE_S).tick()
    assert run.statuses(out) == [(1, 6000, TransferPoll.Failed)] and [w.key for w in run.of(Warn, out)] == ["cleared"]


def test_the_failure_of_a_clear_before_the_whole_fanout_asked_counts_the_asks_made_by_the_clear():
    run = Run()
    offer = _offer(1, span=4)
    run.offer(offer)
    run.ask(_ask(1, rank=0, fanout=2))
    run(run.core.clear(1, offer.token, run.now))
    run.at(0.05).ask(_ask(1, rank=1, fanout=2))  # the rest of the fanout asks within the grace
    out = run.at(CLEARED_GRACE_S).tick()
    [detail] = {a.failure.detail for a in run.of(PushStatus, out)}
    assert detail == ("room 1: the encode side cleared it before its whole fanout asked (1 of 2 prefill ranks "
                      "asked; 1 more since)")
    [warn] = run.of(Warn, out)
    assert "(1 of 2 prefill ranks asked; 1 more since:" in warn.message % warn.args


def test_a_clear_then_a_send_again_keeps_the_parked_asks_for_the_retry():
    run = Run()
    first = _offer(1)
    run.offer(first)
    run.ask(_ask(1, rank=0, fanout=2))
    run(run.core.clear(1, first.token, run.now))
    run.at(0.01).offer(_offer(1))
    assert run.at(1.0).tick() == []
    assert len(run.of(StartWrite, run.ask(_ask(1, rank=1, fanout=2)))) == 2


def test_asks_that_came_after_the_clear_are_kept_for_the_next_send():
    run = Run()
    offer = _offer(1)
    run.offer(offer)
    run(run.core.clear(1, offer.token, run.now))
    run.at(0.05).ask(_ask(1, rank=0, fanout=2))
    assert run.statuses(run.at(1.0).tick()) == [] and 1 in run.core.parked


def test_a_clear_after_the_asks_tells_the_receivers_failed_and_releases_once_writes_are_over():
    run = Run()
    offer = _offer(1)
    run.offer(offer)
    [write] = run.of(StartWrite, run.ask(_ask(1)))
    out = run(run.core.clear(1, offer.token, run.now))
    assert run.statuses(out) == [(1, 6000, TransferPoll.Failed)] and run.of(Release, out) == []
    out = run.complete(write)
    assert run.statuses(out) == [] and run.of(Release, out) == [Release(1, offer.token)]


def test_a_room_served_in_full_is_told_nothing_more_when_cleared_or_closed():
    run = Run()
    offer = _offer(1)
    run.offer(offer)
    [write] = run.of(StartWrite, run.ask(_ask(1)))
    run.complete(write)
    out = run(run.core.clear(1, offer.token, run.now)) + run(run.core.close(run.now))
    assert run.statuses(out) == [] and run.conclusions() == [(1, TransferPoll.Success, None)]


def test_one_failed_write_tells_every_receiver_failed_even_one_already_told_success():
    """SPEC.md 6: the room fails as a whole, so no rank of the group takes its shard for the item."""
    run = Run()
    run.offer(_offer(2, span=8))
    writes = run.of(StartWrite, run.ask(_ask(2, 0, fanout=2, span=8)) + run.ask(_ask(2, 1, fanout=2, span=8)))
    run.complete(writes[0])
    out = run(run.core.write_failed(writes[1].wid, "peer gone", 0.01, run.now))
    assert sorted(run.statuses(out)) == [(2, 6000, TransferPoll.Failed), (2, 6001, TransferPoll.Failed)]
    assert run.conclusions() == [(2, TransferPoll.Failed, FailureKind.WRITE)]


def test_a_clear_of_an_older_send_does_not_touch_the_room_sent_again():
    run = Run()
    old, new = _offer(1), _offer(1)
    run.offer(old)
    run(run.core.clear(1, old.token, run.now))
    run.offer(new)
    assert run(run.core.clear(1, old.token, run.now)) == [] and run.core.rooms() == [1]


def test_a_session_asking_twice_counts_once_and_its_latest_ask_wins():
    run = Run()
    run.offer(_offer(1, span=4))
    run.ask(_ask(1, rank=0, fanout=2, ptr=0x1000))
    assert run.ask(_ask(1, rank=0, fanout=2, ptr=0x2000)) == []  # still one of two
    writes = run.of(StartWrite, run.ask(_ask(1, rank=1, fanout=2, ptr=0x3000)))
    assert [w.dsts for w in writes] == [(0x2000,), (0x3000,)]


def test_asks_for_a_room_already_served_wait_for_its_next_send_and_for_a_failed_one_are_refused():
    run = Run()
    run.offer(_offer(1))
    [write] = run.of(StartWrite, run.ask(_ask(1)))
    run.complete(write)
    assert run.ask(_ask(1, session="late", port=6100)) == [] and 1 in run.core.parked
    run.offer(_offer(2))
    run.ask(_ask(2, hidden=512))  # fails the room
    assert run.statuses(run.ask(_ask(2, session="again"))) == [(2, 6000, TransferPoll.Failed)]


def test_a_receiver_past_the_per_room_bound_is_told_failed():
    run = Run(parked=ParkedAsks(max_receivers=2))
    run.ask(_ask(1, rank=0, fanout=4, span=8))
    run.ask(_ask(1, rank=1, fanout=4, span=8))
    out = run.ask(_ask(1, rank=2, fanout=4, span=8))
    assert run.statuses(out) == [(1, 6002, TransferPoll.Failed)] and [w.key for w in run.of(Warn, out)] == ["receivers"]


def test_a_copy_of_an_ask_whose_write_is_under_way_is_ignored_not_parked_for_a_next_send():
    # Parked, it would be told Failed ("no item was sent") after the room was cleared, its Success overturned.
    run = Run()
    offer = _offer(1)
    run.offer(offer)
    [write] = run.of(StartWrite, run.ask(_ask(1)))
    out = run.at(0.1).ask(_ask(1))
    assert [w.key for w in run.of(Warn, out)] == ["repeated ask"] and 1 not in run.core.parked
    run.at(0.2).complete(write)
    run(run.core.clear(1, offer.token, 0.3))
    for step in range(1, 60):
        run.at(step * 0.5).tick()
    assert run.statuses() == [(1, 6000, TransferPoll.Success)]


def test_evicted_parked_asks_are_told_failed():
    run = Run(parked=ParkedAsks(max_rooms=2))
    for room in range(3):  # each of another receiver: one receiver's share is a quarter
        out = run.ask(_ask(room, fanout=2, span=4, session=f"10.0.0.7:{17100 + room}"))
    assert run.statuses(out) == [(0, 6000, TransferPoll.Failed)] and run.core.parked.rooms() == [1, 2]


def test_a_write_skipped_because_its_room_failed_first_is_not_submitted():
    run = Run()
    offer = _offer(1, span=4)
    run.offer(offer)
    run.ask(_ask(1, rank=0, fanout=2))
    first, second = run.of(StartWrite, run.ask(_ask(1, rank=1, fanout=2)))
    run(run.core.write_failed(first.wid, "refused", took=0.0, now=0.0, blocking=True))
    assert not run.core.wants(second.wid)
    out = run(run.core.write_skipped(second.wid, run.now))
    assert run.of(Release, out) == [Release(1, offer.token)] and run.core.in_flight() == 0


def test_a_checksum_failure_fails_the_room_but_keeps_its_sources_until_the_write_is_over():
    run = Run()
    offer = _offer(1)
    run.offer(offer)
    [write] = run.of(StartWrite, run.ask(_ask(1)))
    out = run(run.core.checksum_failed(write.wid, "device error", run.now))
    assert run.conclusions() == [(1, TransferPoll.Failed, FailureKind.CHECKSUM)] and run.of(Release, out) == []
    out = run.complete(write)
    assert run.statuses(out) == [] and run.of(Release, out) == [Release(1, offer.token)]


def test_close_fails_open_rooms_and_parked_asks_but_keeps_sources_with_writes_in_flight():
    run = Run()
    flying, parked = _offer(1), _offer(2)
    run.offer(flying)
    run.of(StartWrite, run.ask(_ask(1, session="a")))
    run.offer(parked)
    run.ask(_ask(3, session="b"))
    out = run(run.core.close(1.0))
    assert sorted(run.conclusions()) == [(1, TransferPoll.Failed, FailureKind.CLOSED),
                                         (2, TransferPoll.Failed, FailureKind.CLOSED)]
    assert sorted(run.statuses(out)) == [(1, 6000, TransferPoll.Failed), (3, 6000, TransferPoll.Failed)]
    assert run.of(Release, out) == [Release(2, parked.token)]


def test_close_fails_a_room_whose_write_it_abandons_with_its_own_reason_and_tells_its_receiver():
    """A close that gives up on writes in flight says so for their rooms, to the caller and to the
    receivers; a room only parked fails with the plain detail."""
    run = Run()
    flying, parked = _offer(1), _offer(2)
    run.offer(flying)
    run.of(StartWrite, run.ask(_ask(1, session="a")))
    run.offer(parked)
    assert run.core.writing() == [(1, "a")]
    out = run(run.core.close(1.0, stuck="write abandoned"))
    details = {c.room: c.failure.detail for c in run.of(Conclude)}
    assert details == {1: "write abandoned", 2: "sender pool closed"}
    assert [(a.room, a.failure.detail) for a in run.of(PushStatus, out)] == [(1, "write abandoned")]
    assert run.of(Release, out) == [Release(2, parked.token)]  # the abandoned write still reads room 1's source
    assert run.core.writing() == []


@pytest.mark.parametrize("give_up_writes", [True, False])
def test_a_room_failed_by_close_is_released_after_its_write_only_when_the_driver_still_settles_it(give_up_writes):
    run = Run()
    flying = _offer(1)
    run.offer(flying)
    (write,) = run.of(StartWrite, run.ask(_ask(1, session="a")))
    closed = run(run.core.close(1.0, "sender pool stopped: boom", give_up_writes=give_up_writes))
    assert run.conclusions() == [(1, TransferPoll.Failed, FailureKind.CLOSED)] and run.of(Release, closed) == []
    over = run(run.core.write_done(write.wid, (), 2.0))
    assert run.of(Release, over) == ([] if give_up_writes else [Release(1, flying.token)])
    assert run.statuses(over) == []  # the room failed: its receiver was told so at the close


class _Source:
    """Stands for a source tensor: the core must let go of it once nothing reads it."""


@pytest.mark.parametrize("give_up_writes", [True, False])
def test_close_lets_go_of_every_item_but_a_write_left_to_settle_keeps_its_own(give_up_writes):
    """Once closed, the core holds no room's item (its sources), served, parked or failed, never
    cleared; a write the driver still settles keeps its room's until it is over."""
    import gc
    import weakref

    run = Run()
    sources = [_Source() for _ in range(3)]
    held = [weakref.ref(source) for source in sources]
    served, flying, parked = (dataclasses.replace(_offer(room), sources=(source,))
                              for room, source in zip((1, 2, 3), sources))
    run.offer(served)
    run.complete(*run.of(StartWrite, run.ask(_ask(1, session="a"))))
    run.offer(flying)
    (wid,) = [write.wid for write in run.of(StartWrite, run.ask(_ask(2, session="b")))]
    run.offer(parked)
    del sources, served, flying, parked
    run.actions.clear()  # its StartWrites carry the sources
    run(run.core.close(1.0, give_up_writes=give_up_writes))
    gc.collect()
    assert run.core.rooms() == []
    assert [ref() is not None for ref in held] == [False, not give_up_writes, False]
    run(run.core.write_done(wid, (), 2.0))
    gc.collect()
    assert held[1]() is None


def test_next_wakeup_is_the_sweep_or_a_clears_grace():
    run = Run()
    assert run.core.next_wakeup() == pytest.approx(0.5)
    run.tick()
    run.at(0.6).tick()
    assert run.core.next_wakeup() == pytest.approx(1.1)


def test_close_releases_a_cleared_room_whose_write_never_left_the_queue():
    run = Run(depth=1)
    busy, cleared = _offer(1), _offer(2)
    run.offer(busy)
    run.ask(_ask(1, session="a"))
    run.offer(cleared)
    run.ask(_ask(2, session="b"))  # waits behind room 1's write
    run(run.core.clear(2, cleared.token, run.now))
    out = run(run.core.close(1.0))
    assert run.of(Release, out) == [Release(2, cleared.token)]


def test_a_registration_without_lengths_after_lengths_is_refused_warned_and_counted():
    run = Run()
    session = "10.0.0.7:17000"
    run(run.core.registration(Registration("10.0.0.7", 6000, session, 0x10000, 0, 4 * ROW, 0), run.now))
    out = run(run.core.registration(Registration("10.0.0.7", 6000, session, 0x900000, 0), run.now))
    assert [w.key for w in run.of(Warn, out)] == ["registration without lengths"]
    assert run.of(Count, out) == [Count("registrations_refused_total", "no_lengths")]
    run.offer(_offer(1))
    out = run.ask(_ask(1, ptr=0x900000))  # the forged destination the refused registration named
    assert run.of(StartWrite, out) == []
    assert run.conclusions() == [(1, TransferPoll.Failed, FailureKind.REGION)]


def test_a_destination_overlapping_another_room_in_flight_for_the_session_is_refused():
    run = Run()
    run.offer(_offer(1))
    [first] = run.of(StartWrite, run.ask(_ask(1, ptr=0x10000)))
    run.offer(_offer(2))
    out = run.ask(_ask(2, ptr=0x10000 + 3 * ROW))  # its first row is room 1's last
    assert run.of(StartWrite, out) == []
    [conclusion] = run.of(Conclude, out)
    assert conclusion.failure.kind is FailureKind.REGION
    assert "overlaps room 1" in conclusion.failure.detail and "10.0.0.7:17000" in conclusion.failure.detail
    assert run.statuses(out) == [(2, 6000, TransferPoll.Failed)]
    run.offer(_offer(3))
    assert len(run.of(StartWrite, run.ask(_ask(3, ptr=0x10000 + 4 * ROW)))) == 1  # adjacent: written
    run.offer(_offer(4))
    assert len(run.of(StartWrite, run.ask(_ask(4, ptr=0x10000, session="other")))) == 1  # another session
    run.complete(first)
    run.offer(_offer(5))
    assert len(run.of(StartWrite, run.ask(_ask(5, ptr=0x10000)))) == 1  # room 1 is over


@pytest.mark.parametrize("took, blocking", [(0.01, False), (30.0, False), (0.01, True)],
                         ids=["reported failed", "timed out", "submission failed"])
def test_a_failed_writes_destination_is_held_from_other_rooms_for_its_quarantine(took, blocking):
    """A write reported failed may still land (over tcp Mooncake reports a write over once its bytes are
    with the kernel; a write our own timeout gave up on is still in Mooncake's hands): no other room
    writes into its destination until FAILED_WRITE_QUARANTINE_S after the failure, the session's
    breaker closed or not."""
    run = Run()
    run.offer(_offer(1))
    [first] = run.of(StartWrite, run.ask(_ask(1, ptr=0x10000)))
    run.at(40.0)(run.core.write_failed(first.wid, "it failed", took, run.now, blocking=blocking))
    # The session registers again (a new region): a slow failure's breaker closes, the quarantine stays.
    run(run.core.registration(Registration("10.0.0.7", 6000, "10.0.0.7:17000", 0x10000, 0), run.now))
    run.at(41.0).offer(_offer(2))
    out = run.ask(_ask(2, ptr=0x10000 + 3 * ROW))  # its first row is room 1's last
    assert run.of(StartWrite, out) == []
    [conclusion] = run.of(Conclude, out)
    assert conclusion.failure.kind is FailureKind.REGION
    assert conclusion.failure.detail == (
        f"room 2: receiver 10.0.0.7:17000 destination [{0x10000 + 3 * ROW:#x}, {0x10000 + 7 * ROW:#x}) overlaps "
        f"room 1's [{0x10000:#x}, {0x10000 + 4 * ROW:#x}), whose write there failed 1.0s ago: its bytes may still "
        f"land for {FAILED_WRITE_QUARANTINE_S - 1.0:.1f}s more; give the room another destination, or ask again "
        f"then")
    assert run.statuses(out) == [(2, 6000, TransferPoll.Failed)]
    run.offer(_offer(3))
    assert len(run.of(StartWrite, run.ask(_ask(3, ptr=0x10000 + 4 * ROW)))) == 1  # adjacent: written
    run.offer(_offer(4))
    assert len(run.of(StartWrite, run.ask(_ask(4, ptr=0x10000, session="other")))) == 1  # another session
    run.offer(_offer(1))  # room 1 sent again: its retry may reuse its own rows
    [retry] = run.of(StartWrite, run.ask(_ask(1, ptr=0x10000)))
    run.complete(retry)
    run.at(40.0 + FAILED_WRITE_QUARANTINE_S - 0.1).offer(_offer(5))
    assert run.of(StartWrite, run.ask(_ask(5, ptr=0x10000))) == [], "held until the quarantine's end"
    run.at(40.0 + FAILED_WRITE_QUARANTINE_S).offer(_offer(6))
    assert len(run.of(StartWrite, run.ask(_ask(6, ptr=0x10000)))) == 1


def test_a_failed_writes_destination_let_go_before_its_quarantine_ended_is_warned(monkeypatch):
    """Past MAX_QUARANTINED_RANGES the oldest failed write's destination is let go early: another room may then
    be written there while its bytes may still land, and the log says so."""
    monkeypatch.setattr(encode_core, "MAX_QUARANTINED_RANGES", 2)
    run = Run()
    for room in (1, 2, 3):
        run.at(40.0 + room).offer(_offer(room))
        [write] = run.of(StartWrite, run.ask(_ask(room, ptr=0x10000 * room)))
        assert [w.key for w in run.of(Warn, run(run.core.write_failed(write.wid, "it failed", 0.01, run.now)))
                if w.key == "destinations let go"] == ([] if room < 3 else ["destinations let go"])
    [warn] = [w for w in run.of(Warn) if w.key == "destinations let go"]
    assert warn.message % warn.args == (
        f"more than 2 failed writes' destinations held: room 1's [{0x10000:#x}, {0x10000 + 4 * ROW:#x}) at "
        f"receiver 10.0.0.7:17000 is let go {FAILED_WRITE_QUARANTINE_S - 2.0:.0f}s before its quarantine ends, "
        f"and another room may be written there while that write's bytes may still land")
    run.offer(_offer(4))
    assert len(run.of(StartWrite, run.ask(_ask(4, ptr=0x10000)))) == 1


def test_a_failed_writes_quarantine_is_the_receive_pools_default():
    """Our prefill ranks hold a failed room's slot that long from when they hear of the failure: the
    encode side's hold ends no later, so it never refuses a slot one of ours hands out again."""
    assert FAILED_WRITE_QUARANTINE_S == config.setting("EPD_QUARANTINE_S").default


def test_a_fanout_that_never_completed_says_how_many_of_it_asked():
    run = Run(fanout_timeout_s=10.0)
    run.offer(_offer(1, span=4))
    run.ask(_ask(1, rank=0, fanout=2))
    run.offer(_offer(2))
    run.at(10.6).tick()
    details = {c.room: c.failure.detail for c in run.of(Conclude)}
    assert details[1] == "receiver never registered within 10s (1 of 2 prefill ranks asked)"
    assert details[2] == "receiver never registered within 10s (no prefill rank asked)"
    run.ask(_ask(3, rank=0, fanout=2))
    run.at(21.0).offer(_offer(3))
    out = run.ask(_ask(3, rank=1, fanout=2))
    assert run.of(Conclude, out)[0].failure.detail == "receiver never registered within 10s (2 of 2 prefill ranks " \
                                                      "asked, the last 10.4s after the first)"


def test_an_item_sent_past_the_fanout_timeout_after_asks_that_all_came_in_time_is_what_is_named_late():
    """The whole fanout asked at once and the item came 10.6 s later, before the sweep told the asks
    Failed: the room fails naming the item, not receivers that never registered."""
    run = Run(fanout_timeout_s=10.0)
    run.ask(_ask(1, rank=0, fanout=2))
    run.at(0.5).ask(_ask(1, rank=1, fanout=2))
    run.at(10.0).tick()
    out = run.at(10.6).offer(_offer(1))
    [conclusion] = run.of(Conclude, out)
    assert (conclusion.failure.kind, conclusion.failure.detail) == (
        FailureKind.OTHER, "room 1: its item was sent 10.6s after its first ask, past the fanout timeout 10s (its "
                           "whole fanout of 2 asked in time)")
    assert run.of(StartWrite, out) == [] and sorted(run.statuses(out)) == [(1, 6000, TransferPoll.Failed),
                                                                           (1, 6001, TransferPoll.Failed)]


def test_an_item_whose_asks_were_told_failed_for_want_of_it_fails_when_it_comes_unless_asked_again():
    """Asks told Failed by the sweep (no item within the fanout timeout) leave the room remembered: its
    late item fails at once, saying so, rather than waiting a whole timeout more for asks that concluded.
    A receiver that asks again for the room is served by the item as usual."""
    run = Run(fanout_timeout_s=10.0)
    run.ask(_ask(1))
    run.ask(_ask(2))
    out = run.at(10.6).tick()
    assert sorted(run.statuses(out)) == [(1, 6000, TransferPoll.Failed), (2, 6000, TransferPoll.Failed)]
    out = run.at(12.0).offer(_offer(1))
    [conclusion] = run.of(Conclude, out)
    assert (conclusion.failure.kind, conclusion.failure.detail) == (
        FailureKind.OTHER, "room 1: its item was sent 12.0s after its first ask, past the fanout timeout 10s (1 of 1 "
                           "prefill ranks asked, told Failed 1.4s ago)")
    run.at(13.0).ask(_ask(2, ptr=0x20000))  # asked again: the next item is for that ask
    out = run.at(13.5).offer(_offer(2))
    assert [w.dsts for w in run.of(StartWrite, out)] == [(0x20000,)] and run.of(Conclude, out) == []
    run.ask(_ask(3))
    run.at(24.0).tick()
    run.at(34.6).tick()  # a whole timeout after the asks were told Failed: the room is forgotten
    run.at(34.7).offer(_offer(3))
    assert run.of(Conclude, run.at(45.0).tick())[0].failure.detail == (
        "receiver never registered within 10s (no prefill rank asked)")


def test_asks_for_a_late_item_the_caller_cleared_are_told_its_failure_unless_it_is_sent_again():
    run = Run(fanout_timeout_s=10.0)
    run.ask(_ask(1))
    run.at(10.6).tick()  # its ask is told Failed: no item within the fanout timeout
    item = _offer(1)
    run.at(12.0).offer(item)  # the late item fails at once
    run(run.core.clear(1, item.token, 12.1))
    assert run.statuses(run.at(12.2).ask(_ask(1, ptr=0x20000))) == []
    [told] = run.statuses(run.at(12.3).tick())
    assert told[2] is TransferPoll.Failed
    failure = run.of(PushStatus)[-1].failure
    assert (failure.kind, failure.detail) == (FailureKind.OTHER, "room 1: its item was sent 12.0s after its first ask, "
                                                                 "past the fanout timeout 10s (1 of 1 prefill ranks "
                                                                 "asked, told Failed 1.4s ago)")

def test_a_late_ask_for_an_item_that_waited_out_its_fanout_and_was_cleared_is_told_why_unless_it_is_sent_again():
    """The item came first and no receiver asked within the fanout timeout; the caller cleared the failed
    room as it concluded. A receiver asking after that (its scheduler ran behind) is told the room's failure
    once the clear's grace passed, not left parked until its own deadline; an ask followed by the room sent
    again (a retry) is served, and a whole timeout after the clear the room is forgotten."""
    run = Run(fanout_timeout_s=10.0)
    item = _offer(1)
    run.offer(item)
    [conclusion] = run.of(Conclude, run.at(10.5).tick())
    assert conclusion.failure.kind is FailureKind.FANOUT_TIMEOUT
    run(run.core.clear(1, item.token, 10.6))
    assert run.statuses(run.at(11.0).ask(_ask(1))) == []
    assert run.statuses(run.at(11.0 + CLEARED_GRACE_S / 2).tick()) == []
    assert run.core.next_wakeup() == pytest.approx(11.0 + CLEARED_GRACE_S), "the driver wakes for it"
    out = run.at(11.0 + CLEARED_GRACE_S).tick()
    assert run.statuses(out) == [(1, 6000, TransferPoll.Failed)]
    [told] = [push for push in run.of(PushStatus, out) if push.cancel is None]
    assert told.failure.kind is FailureKind.FANOUT_TIMEOUT
    assert told.failure.detail == ("room 1: its item was sent but failed, and was cleared, before this ask came "
                                   "(receiver never registered within 10s (no prefill rank asked)): a prefill rank "
                                   "must ask within the encode side's fanout_timeout_s of the item's send")
    assert run.core.parked.get(1) is None
    retried = _offer(2)
    run.at(20.0).offer(retried)
    run.at(30.5).tick()
    run(run.core.clear(2, retried.token, 30.6))
    run.at(30.7).ask(_ask(2))
    out = run.at(30.72).offer(_offer(2))  # sent again: the ask waits for it, and is served
    assert [w.dsts for w in run.of(StartWrite, out)] == [(0x10000,)]
    assert run.statuses(run.at(31.0).tick()) == []
    item = _offer(3)
    run.at(40.0).offer(item)
    run.at(50.5).tick()
    run(run.core.clear(3, item.token, 50.6))
    run.at(60.7).tick()
    run.at(60.8).ask(_ask(3))  # past the fanout timeout of the clear: parked as any ask
    assert run.statuses(run.at(61.0).tick()) == []


def test_a_dead_sessions_backlog_is_worked_through_in_bounded_turns_and_a_healthy_write_starts_in_the_first():
    run = Run(depth=32, fanout_timeout_s=120.0)
    for room in range(6000):
        run.offer(_offer(room))
        run.ask(_ask(room, session="dead", ptr=0x10000 + room * 4 * ROW))
    flying = run.of(StartWrite)
    assert len(flying) == 24 and run.core.waiting == 6000 - 24
    run.offer(_offer(9999))

    def carry(actions: list, now: float) -> list[StartWrite]:
        """Carries actions out as the driver does: the dead peer refuses every write at once."""
        work, started = list(actions), []
        while work:
            action = work.pop(0)
            if isinstance(action, StartWrite):
                started.append(action)
                if action.session_id == "dead":
                    work.extend(run.core.write_failed(action.wid, "connection refused", 0.001, now, blocking=True))
        return started

    # One driver turn: the writes in flight are found failed, then a healthy receiver's ask comes.
    now = 1.0
    started = carry(run.core.tick(now), now)
    for write in flying:
        started += carry(run.core.write_failed(write.wid, "connection reset", 0.001, now), now)
    started += carry(run.core.ask(_ask(9999, session="live", ptr=0x10000), now), now)
    assert [w.room for w in started if w.session_id == "live"] == [9999]
    assert len(started) <= 200, len(started)
    turns = 1
    while run.core.waiting:
        turns += 1
        now += 1e-3
        assert len(carry(run.core.tick(now), now)) <= 200
    assert turns > 1


def _reask(info: TransferInfo, session: str, port: int | None = None) -> TransferInfo:
    """The same ask from a successor process: a new Mooncake session, maybe a new status port."""
    return TransferInfo(info.room, info.endpoint, info.port if port is None else port, session, info.embedding_ptr,
                        info.deepstack_ptr, info.rows, info.hidden, info.dtype, info.has_deepstack, info.fanout,
                        info.row_start, info.span)


def test_a_successor_at_the_same_status_endpoint_supersedes_its_predecessors_parked_asks():
    run = Run()
    old, new = "10.0.0.7:17000", "10.0.0.7:17555"
    run(run.core.registration(Registration("10.0.0.7", 6000, old, 0x10000, 0, 64 * ROW, 0), run.now))
    asks = [_ask(room, ptr=0x10000 + room * 4 * ROW) for room in range(3)]
    for info in asks:
        run.ask(info)
    out = run(run.core.registration(Registration("10.0.0.7", 6000, new, 0x10000, 0, 64 * ROW, 0), run.now))
    assert run.core.parked.rooms() == [] and run.statuses(out) == []  # its endpoint is the successor's now
    assert [w.key for w in run.of(Warn, out)] == ["successor"]
    assert run.of(Count, out) == [Count("sessions_superseded_total", "status_endpoint")]
    for info in asks[:2]:  # the successor retries two of them
        run.ask(_reask(info, new))
        run.offer(_offer(info.room))
    writes = run.of(StartWrite)
    assert [(w.room, w.session_id) for w in writes] == [(0, new), (1, new)]
    for write in writes:
        run.complete(write)
    assert run.conclusions() == [(0, TransferPoll.Success, None), (1, TransferPoll.Success, None)]


def _restarted_mid_write(run: Run) -> tuple[StartWrite, StartWrite]:
    """Room 7's write to a rank in flight when the rank restarts at the same status endpoint under a
    new session and asks for room 7 again: (the predecessor's write, the successor's)."""
    old, new = "10.0.0.7:17000", "10.0.0.7:18000"
    run(run.core.registration(Registration("10.0.0.7", 6000, old, 0x10000, 0, 4 * ROW, 0), 0.0))
    run.offer(_offer(7))
    (first,) = run.of(StartWrite, run.ask(_ask(7, session=old)))
    run(run.core.registration(Registration("10.0.0.7", 6000, new, 0x10000, 0, 4 * ROW, 0), 1.0))
    (retry,) = run.of(StartWrite, run.at(1.0).ask(_ask(7, session=new)))
    assert retry.session_id == new
    return first, retry


def _superseded_mid_write(run: Run) -> tuple[StartWrite, str]:
    """Room 7's write to a rank in flight when the rank restarts at the same status endpoint under a
    new session, which has not asked yet: (the predecessor's write, the successor's session)."""
    old, new = "10.0.0.7:17000", "10.0.0.7:18000"
    run(run.core.registration(Registration("10.0.0.7", 6000, old, 0x10000, 0, 4 * ROW, 0), 0.0))
    run.offer(_offer(7))
    (first,) = run.of(StartWrite, run.ask(_ask(7, session=old)))
    run(run.core.registration(Registration("10.0.0.7", 6000, new, 0x10000, 0, 4 * ROW, 0), 1.0))
    return first, new


def _end_predecessors_write(run: Run, first: StartWrite, how: str, at: float) -> list:
    """The predecessor's write fails or lands at `at`; what the core did."""
    if how == "fails":
        return run(run.core.write_failed(first.wid, "peer gone", at - 1.0, at))
    return run(run.core.write_done(first.wid, (5,), at))


@pytest.mark.parametrize("old_write", ["fails", "lands"])
def test_a_room_whose_only_receiver_restarted_mid_write_waits_for_the_successor_and_serves_it(old_write):
    """The predecessor's write ends before the successor asks: nobody was served, so the room neither
    concludes nor lets its sources go, and the successor's ask is written from them and told."""
    run = Run()
    first, new = _superseded_mid_write(run)
    over = _end_predecessors_write(run, first, old_write, 1.5)
    assert run.of(Conclude, over) == [] and run.of(Release, over) == [] and run.of(PushStatus, over) == []
    (retry,) = run.of(StartWrite, run.at(2.0).ask(_ask(7, session=new)))
    assert retry.session_id == new and retry.srcs == first.srcs
    done = run(run.core.write_done(retry.wid, (9,), 2.5))
    assert [(s.room, s.status) for s in run.of(PushStatus, done)] == [(7, TransferPoll.Success)]
    assert run.conclusions() == [(7, TransferPoll.Success, None)] and run.of(Release, done)


def test_a_room_whose_only_receiver_restarted_fails_at_the_fanout_timeout_if_no_successor_asks():
    run = Run()
    first, new = _superseded_mid_write(run)
    run(run.core.write_done(first.wid, (5,), 1.5))
    run(run.core.tick(30.0))
    assert run.conclusions() == [(7, TransferPoll.Failed, FailureKind.FANOUT_TIMEOUT)] and run.of(Release)


@pytest.mark.parametrize("old_write", ["fails", "lands"])
def test_a_successors_retry_is_served_while_its_predecessors_write_tells_nobody_anything(old_write):
    run = Run()
    first, retry = _restarted_mid_write(run)
    over = _end_predecessors_write(run, first, old_write, 31.0)
    assert run.of(PushStatus, over) == [] and run.of(Conclude, over) == [] and run.of(Release, over) == []
    done = run(run.core.write_done(retry.wid, (9,), 32.0))
    assert [(p.port, p.status, p.checksums) for p in run.of(PushStatus, done)] == [(6000, TransferPoll.Success, (9,))]
    assert [(c.room, c.status) for c in run.of(Conclude, done)] == [(7, TransferPoll.Success)]
    assert [r.room for r in run.of(Release, done)] == [7]


def test_a_room_is_released_only_once_its_predecessors_write_is_over_too():
    run = Run()
    first, retry = _restarted_mid_write(run)
    done = run(run.core.write_done(retry.wid, (9,), 2.0))
    assert [p.status for p in run.of(PushStatus, done)] == [TransferPoll.Success]
    assert run.of(Release, done) == []  # the predecessor's write still reads the item
    over = run(run.core.write_failed(first.wid, "peer gone", 30.0, 31.0))
    assert [r.room for r in run.of(Release, over)] == [7] and run.of(PushStatus, over) == []
    assert [(c.room, c.status) for c in run.of(Conclude)] == [(7, TransferPoll.Success)]


def _two_writes_in_flight(run: Run, span: int = 8) -> list[StartWrite]:
    """Room 7 at fanout 2 from ranks 0 and 1 (status ports 6000, 6001), both writes in flight."""
    for rank in range(2):
        run(run.core.registration(Registration("10.0.0.7", 6000 + rank, f"10.0.0.7:{17000 + rank}",
                                               0x10000 * (rank + 1), 0, span * ROW, 0), 0.0))
    run.offer(_offer(7, span=span))
    for rank in range(2):
        run.ask(_ask(7, rank, fanout=2, span=span, ptr=0x10000 * (rank + 1)))
    return run.of(StartWrite)


def _rank_one_restarts(run: Run, at: float, span: int = 8) -> TransferInfo:
    """Rank 1 restarts at the same status endpoint under a new session that has not asked yet: its ask."""
    new = "10.0.0.7:18001"
    run(run.core.registration(Registration("10.0.0.7", 6001, new, 0x90000, 0, span * ROW, 0), at))
    return _ask(7, 1, fanout=2, span=span, session=new, ptr=0x90000)


def _one_of_two_restarted_mid_write(run: Run) -> tuple[list[StartWrite], TransferInfo]:
    """Room 7 at fanout 2, both writes in flight, when rank 1 restarts at the same status endpoint
    under a new session that has not asked yet: (the two writes, the successor's ask)."""
    writes = _two_writes_in_flight(run)
    return writes, _rank_one_restarts(run, 1.0)


@pytest.mark.parametrize("old_write", ["fails", "lands"])
def test_a_room_one_of_whose_receivers_restarted_mid_write_writes_that_shard_to_the_successor(old_write):
    run = Run()
    (served, orphaned), successor = _one_of_two_restarted_mid_write(run)
    out = run(run.core.write_done(served.wid, (3,), 1.2))
    out += _end_predecessors_write(run, orphaned, old_write, 1.5)
    assert [(p.port, p.status) for p in run.of(PushStatus, out)] == [(6000, TransferPoll.Success)]
    assert run.of(Conclude, out) == [] and run.of(Release, out) == []  # rank 1's rows reached nobody alive
    (retry,) = run.of(StartWrite, run.at(2.0).ask(successor))
    assert (retry.session_id, retry.srcs, retry.dsts) == (successor.session_id, orphaned.srcs, (0x90000,))
    done = run(run.core.write_done(retry.wid, (9,), 2.5))
    assert [(p.port, p.status, p.checksums) for p in run.of(PushStatus, done)] == [(6001, TransferPoll.Success, (9,))]
    assert run.conclusions() == [(7, TransferPoll.Success, None)] and [r.room for r in run.of(Release, done)] == [7]


def test_a_served_receivers_next_ask_stays_parked_when_a_successor_takes_the_orphaned_shard():
    """Rank 0, served, asks again (for the room's next send) before rank 1's successor asks: the successor's
    ask is taken for the orphaned shard, rank 0's stays parked for the next send."""
    run = Run()
    (served, orphaned), successor = _one_of_two_restarted_mid_write(run)
    run(run.core.write_done(served.wid, (3,), 1.2))
    again = _ask(7, 0, fanout=2, ptr=0x50000)
    assert run.of(StartWrite, run.at(1.3).ask(again)) == []
    (retry,) = run.of(StartWrite, run.at(1.4).ask(successor))
    assert retry.session_id == successor.session_id
    assert list(run.core.parked.get(7).infos.values()) == [again]


def test_a_successor_asking_while_its_predecessors_write_flies_is_written_and_the_room_released_after_both():
    run = Run()
    (served, orphaned), successor = _one_of_two_restarted_mid_write(run)
    (retry,) = run.of(StartWrite, run.at(1.1).ask(successor))
    run(run.core.write_done(served.wid, (3,), 1.2))
    done = run(run.core.write_done(retry.wid, (9,), 1.3))
    assert [(p.port, p.status) for p in run.of(PushStatus, done)] == [(6001, TransferPoll.Success)]
    assert run.of(Release) == []  # the predecessor's write still reads the item
    over = run(run.core.write_done(orphaned.wid, (5,), 1.4))
    assert run.of(PushStatus, over) == [] and [r.room for r in run.of(Release, over)] == [7]
    assert run.conclusions() == [(7, TransferPoll.Success, None)]


def test_a_successors_write_holds_its_own_destination_beside_a_receiver_still_being_served():
    """Rank 1's successor asks while rank 0's write of room 7 still flies: the successor's write holds the
    successor's destination (not rank 0's, which sorts before it among the room's receivers), so another
    room asking for the same rows of that session is refused until the successor's write is over."""
    run = Run()
    (served, orphaned), successor = _one_of_two_restarted_mid_write(run)
    (retry,) = run.of(StartWrite, run.at(1.1).ask(successor))
    assert retry.dsts == (0x90000,)
    run.offer(_offer(8, span=8))
    out = run.at(1.2).ask(_ask(8, 0, fanout=1, span=8, session=successor.session_id, ptr=0x90000, port=6001))
    assert run.of(StartWrite, out) == []
    [conclusion] = run.of(Conclude, out)
    assert conclusion.failure.kind is FailureKind.REGION and "overlaps room 7" in conclusion.failure.detail


def test_a_room_one_of_whose_receivers_restarted_fails_everywhere_at_the_fanout_timeout_if_no_successor_asks():
    run = Run()
    (served, orphaned), _ = _one_of_two_restarted_mid_write(run)
    run(run.core.write_done(served.wid, (3,), 1.2))
    run(run.core.write_done(orphaned.wid, (5,), 1.3))
    out = run(run.core.tick(30.0))
    assert run.conclusions() == [(7, TransferPoll.Failed, FailureKind.FANOUT_TIMEOUT)] and run.of(Release, out)
    # All or nothing: rank 0's rows are no use without rank 1's, so it hears the room failed too.
    assert run.statuses(out) == [(7, 6000, TransferPoll.Failed)]
    [conclusion] = run.of(Conclude, out)
    assert conclusion.failure.detail == ("receiver never registered within 10s (1 receiver(s) restarted before they "
                                         "were served and no successor asked for their shards: rows "
                                         "4+4 of 10.0.0.7:17001)")


def test_a_receiver_that_restarts_after_it_was_served_leaves_its_room_to_succeed():
    """Rank 1's rows landed and it was told Success before it restarted: its shard is done, so the room
    concludes Success when rank 0's write lands, and nobody is told Failed."""
    run = Run()
    first, second = _two_writes_in_flight(run)
    run(run.core.write_done(second.wid, (5,), 1.0))
    _rank_one_restarts(run, 1.1)
    done = run(run.core.write_done(first.wid, (3,), 1.2))
    assert run.conclusions() == [(7, TransferPoll.Success, None)] and [r.room for r in run.of(Release, done)] == [7]
    run(run.core.tick(30.0))
    assert run.statuses() == [(7, 6001, TransferPoll.Success), (7, 6000, TransferPoll.Success)]


def test_a_rank_restarted_at_another_status_port_mid_write_is_known_by_its_shard_and_served():
    run = Run()
    span = 8
    run.offer(_offer(7, span=span))
    for rank in range(2):
        run.ask(_ask(7, rank, fanout=2, span=span, ptr=0x10000 * (rank + 1)))
    served, orphaned = run.of(StartWrite)
    successor = _reask(_ask(7, 1, fanout=2, span=span, ptr=0x90000), "10.0.0.7:18001", port=6101)
    out = run.at(1.0).ask(successor)
    assert run.of(Count, out) == [Count("sessions_superseded_total", "shard")]
    (retry,) = run.of(StartWrite, out)
    assert (retry.session_id, retry.srcs, retry.dsts) == ("10.0.0.7:18001", orphaned.srcs, (0x90000,))
    for write, at in ((served, 1.1), (orphaned, 1.2), (retry, 1.3)):
        run.at(at).complete(write)
    assert run.statuses() == [(7, 6000, TransferPoll.Success), (7, 6101, TransferPoll.Success)]
    assert run.conclusions() == [(7, TransferPoll.Success, None)]


def test_a_queued_write_to_a_rank_that_restarted_never_starts_and_its_successor_is_written_instead():
    run = Run(depth=1)
    run.offer(_offer(7, span=8))
    for rank in range(2):
        run.ask(_ask(7, rank, fanout=2, span=8, ptr=0x10000 * (rank + 1)))
    (first,) = run.of(StartWrite)  # rank 1's write waits for the only slot
    successor = _reask(_ask(7, 1, fanout=2, span=8, ptr=0x90000), "10.0.0.7:18001", port=6101)
    run.at(1.0).ask(successor)
    out = run.at(1.1).complete(first)
    (retry,) = run.of(StartWrite, out)
    assert retry.session_id == "10.0.0.7:18001" and run.core.waiting == 0  # nothing left for the dead rank
    run.at(1.2).complete(retry)
    assert run.statuses() == [(7, 6000, TransferPoll.Success), (7, 6101, TransferPoll.Success)]
    assert run.conclusions() == [(7, TransferPoll.Success, None)] and [r.room for r in run.of(Release)] == [7]


def test_a_started_write_not_yet_submitted_to_a_rank_that_restarted_is_skipped():
    run = Run()
    (served, orphaned), successor = _one_of_two_restarted_mid_write(run)
    assert run.core.wants(served.wid) and not run.core.wants(orphaned.wid)
    out = run(run.core.write_skipped(orphaned.wid, 1.1))
    assert run.of(PushStatus, out) == [] and run.of(Conclude, out) == []
    run.at(1.2).complete(served)
    (retry,) = run.of(StartWrite, run.at(1.3).ask(successor))
    run.at(1.4).complete(retry)
    assert run.conclusions() == [(7, TransferPoll.Success, None)] and [r.room for r in run.of(Release)] == [7]


def test_a_new_session_asking_for_a_served_rooms_shard_waits_for_its_next_send():
    run = Run()
    run.offer(_offer(7, span=8))
    for rank in range(2):
        run.ask(_ask(7, rank, fanout=2, span=8, ptr=0x10000 * (rank + 1)))
    for write in run.of(StartWrite):
        run.complete(write)
    out = run.at(1.0).ask(_reask(_ask(7, 1, fanout=2, span=8, ptr=0x90000), "10.0.0.7:18001", port=6101))
    assert out == [] and run.core.parked.rooms() == [7]


def test_a_session_that_registered_again_at_another_endpoint_is_not_superseded_at_its_old_one():
    """A session manager made again on the same engine registers from a new status port; another rank
    that binds the freed old port is not its successor: the live session keeps its asks and regions."""
    run = Run()
    live, other = "10.0.0.7:17000", "10.0.0.7:17001"
    run(run.core.registration(Registration("10.0.0.7", 6000, live, 0x10000, 0, 4 * ROW, 0), run.now))
    run(run.core.registration(Registration("10.0.0.7", 6001, live, 0x10000, 0, 4 * ROW, 0), run.now))
    run.ask(_ask(1, session=live, port=6001))
    out = run(run.core.registration(Registration("10.0.0.7", 6000, other, 0x80000, 0, 4 * ROW, 0), run.now))
    assert run.of(Count, out) == [] and run.core.parked.rooms() == [1]
    run.ask(_ask(2, session=live, port=6001, ptr=0xDEAD0000))  # outside what it announced
    run.offer(_offer(2))
    assert run.of(StartWrite) == [] and run.conclusions()[-1][2] is FailureKind.REGION


def test_a_successor_asking_for_the_same_shard_of_a_full_fanout_supersedes_only_that_rank():
    run = Run()
    span, fanout = 8, 2
    ranks = [_ask(room, rank, fanout=fanout, span=span, ptr=0x10000 * (rank + 1)) for room in (1, 2)
             for rank in range(fanout)]
    for info in ranks:
        run.ask(info)
    dead = ranks[1].session_id  # rank 1 restarts: a new session and a new status port
    out = run.ask(_reask(ranks[1], "10.0.0.7:17999", port=6100))
    assert run.statuses(out) == [] and run.of(Count, out) == [Count("sessions_superseded_total", "shard")]
    assert all(dead not in run.core.parked[room].infos for room in (1, 2))
    assert len(run.core.parked[2].infos) == 1  # room 2 waits for the successor's retry
    run.offer(_offer(1, span=span))
    writes = run.of(StartWrite)
    assert sorted(w.session_id for w in writes) == ["10.0.0.7:17000", "10.0.0.7:17999"]
    for write in writes:
        run.complete(write)
    assert run.conclusions() == [(1, TransferPoll.Success, None)]
    assert sorted(p for _, p, s in run.statuses() if s is TransferPoll.Success) == [6000, 6100]


def test_a_new_receiver_that_matches_no_rank_is_not_taken_for_a_successor():
    run = Run()
    run.ask(_ask(1, 0, fanout=2, span=8))
    out = run.ask(_ask(1, 1, fanout=2, span=8))  # the fanout's second rank, not a successor
    assert run.of(Count, out) == [] and len(run.core.parked[1].infos) == 2
    run.ask(_ask(2, 0, fanout=1, span=4))
    for index in range(2):  # asks that disagree on the fanout are not a restarted rank's
        run.ask(_reask(_ask(2, 0, fanout=4, span=4), f"10.0.0.8:{index}", port=6100 + index))
    assert run.of(Count) == [] and len(run.core.parked[2].infos) == 3


def test_a_session_on_another_host_asking_for_a_parked_shard_supersedes_nobody():
    """A stray ask (another prefill instance's room under the same number, or a forged one) for a
    shard a live session asked for: the contested room fails on its receiver count, loudly on both,
    and the live session keeps its other rooms and its regions."""
    run = Run()
    live = "10.0.0.7:17000"
    run(run.core.registration(Registration("10.0.0.7", 6000, live, 0x10000, 0, 64 * ROW, 0), run.now))
    for room in (1, 2):
        run.ask(_ask(room, ptr=0x10000 + room * 4 * ROW))
    stray = dataclasses.replace(_ask(1, ptr=0x10000 + 4 * ROW), endpoint="10.0.0.9", session_id="10.0.0.9:17000")
    assert run.at(0.1).ask(stray) == [] and run.core.parked[2].infos.keys() == {live}
    (write,) = run.of(StartWrite, run.at(0.2).offer(_offer(2)))
    assert write.session_id == live
    run.at(0.3).offer(_offer(1))
    assert sorted((endpoint, kind) for _, endpoint, kind in
                  [(a.room, a.endpoint, a.failure.kind) for a in run.of(PushStatus) if a.room == 1]) == [
        ("10.0.0.7", FailureKind.GEOMETRY), ("10.0.0.9", FailureKind.GEOMETRY)]
    assert run.of(Count) == []


def test_a_predecessors_cancel_does_not_fail_its_successors_retry():
    run = Run()
    old, new = "10.0.0.7:17000", "10.0.0.7:17999"
    run(run.core.registration(Registration("10.0.0.7", 6000, old, 0x10000, 0, 64 * ROW, 0), run.now))
    run.ask(_ask(1, session=old))
    run(run.core.cancel(Cancel(1, "10.0.0.7", 6000, old), 0.1))  # it cancels, then restarts
    run(run.core.registration(Registration("10.0.0.7", 6000, new, 0x10000, 0, 64 * ROW, 0), 1.0))
    run.at(1.1).ask(_ask(1, session=new))
    (write,) = run.of(StartWrite, run.at(2.0).offer(_offer(1)))
    assert write.session_id == new
    run.at(2.1).complete(write)
    assert run.conclusions() == [(1, TransferPoll.Success, None)]


def test_a_predecessors_cancel_that_failed_a_room_cleared_since_does_not_fail_its_successors_retry():
    """The old session's cancel failed room 1 with its write in flight, and the caller cleared the room;
    the rank restarts and asks again: its ask waits for the room's send again, which serves it."""
    run = Run()
    old, new = "10.0.0.7:17000", "10.0.0.7:17999"
    run(run.core.registration(Registration("10.0.0.7", 6000, old, 0x10000, 0, 64 * ROW, 0), run.now))
    item = _offer(1)
    run.offer(item)
    (first,) = run.of(StartWrite, run.at(0.1).ask(_ask(1, session=old)))
    run(run.core.cancel(Cancel(1, "10.0.0.7", 6000, old), 0.2))
    run.at(0.25).complete(first)
    run(run.core.clear(1, item.token, 0.3))
    assert run.conclusions() == [(1, TransferPoll.Failed, FailureKind.CANCELLED)]
    run(run.core.registration(Registration("10.0.0.7", 6000, new, 0x10000, 0, 64 * ROW, 0), 1.0))
    run.at(1.1).ask(_ask(1, session=new))
    assert run.statuses(run.at(1.25).tick()) == []
    (write,) = run.of(StartWrite, run.at(1.4).offer(_offer(1)))
    assert write.session_id == new

def _restarted_late(new: str) -> Run:
    """Room 1 sent at 0, its only rank asking at 9 s of a 10 s fanout timeout, restarting at 10.2 s as `new`."""
    run = Run(fanout_timeout_s=10.0)
    old = "10.0.0.7:17000"
    run(run.core.registration(Registration("10.0.0.7", 6000, old, 0x10000, 0, 64 * ROW, 0), run.now))
    run.offer(_offer(1))
    run.at(9.0).ask(_ask(1, session=old))
    run(run.core.registration(Registration("10.0.0.7", 6000, new, 0x10000, 0, 64 * ROW, 0), 10.2))
    return run


def test_a_rank_restarted_late_in_its_rooms_life_leaves_its_successor_the_whole_fanout_timeout():
    new = "10.0.0.7:17999"
    run = _restarted_late(new)
    run.at(19.0).tick()
    assert run.conclusions() == []  # 8.8 s after the restart: the successor may still ask
    (retry,) = run.of(StartWrite, run.at(19.5).ask(_ask(1, session=new, ptr=0x14000)))
    assert retry.session_id == new
    run.at(20.6).tick()
    assert run.conclusions() == []  # the successor is being written; the predecessor's write tells nobody


def test_an_orphaned_shard_nobody_asks_for_fails_its_room_a_fanout_timeout_after_the_restart():
    run = _restarted_late("10.0.0.7:17999")
    run.at(20.0).tick()
    assert run.conclusions() == []
    run.at(20.6).tick()
    assert run.conclusions() == [(1, TransferPoll.Failed, FailureKind.FANOUT_TIMEOUT)]


def test_a_sent_room_whose_parked_asks_are_evicted_fails_at_once():
    run = Run(fanout_timeout_s=120.0, parked=ParkedAsks(max_rooms=1))
    offer = _offer(1)
    run.offer(offer)
    run.at(0.1).ask(_ask(1, fanout=2))
    out = run.at(0.2).ask(_ask(2, fanout=2, ptr=0x40000))  # pushes room 1's ask out
    assert run.statuses(out) == [(1, 6000, TransferPoll.Failed)]
    (conclusion,) = run.of(Conclude, out)
    assert (conclusion.room, conclusion.failure.kind) == (1, FailureKind.OTHER)
    assert "dropped unserved" in conclusion.failure.detail and run.of(Release, out) == [Release(1, offer.token)]


def test_an_overlap_with_a_long_write_behind_shorter_ones_is_found():
    run = Run()
    run.offer(_offer(1, span=16))
    run.ask(_ask(1, span=16, ptr=0x10000))  # 16 rows from 0x10000, still in flight
    run.offer(_offer(1, span=1))  # room 1 sent again: its retry may reuse its own rows
    assert len(run.of(StartWrite, run.ask(_ask(1, span=1, ptr=0x10000 + 2 * ROW)))) == 1
    run.offer(_offer(3, span=1))
    out = run.ask(_ask(3, span=1, ptr=0x10000 + 8 * ROW))
    assert run.of(StartWrite, out) == [] and "overlaps room 1" in run.of(Conclude, out)[0].failure.detail


def test_an_item_is_expected_only_once_an_ask_for_it_is_parked():
    run = Run()
    assert not run.core.expects(7)  # an offer now would only wait: the driver may take it later
    run.ask(_ask(7, rank=0, fanout=2))
    assert run.core.expects(7)  # its fanout may be complete when the item comes: wake the driver
    assert not run.core.expects(8)
    run.offer(_offer(7))
    run.ask(_ask(7, rank=1, fanout=2))
    assert not run.core.expects(7)  # served: its asks left the parking
    assert run.statuses() == []  # nothing concluded on the receivers' side before the writes settle


def test_every_item_is_expected_once_the_core_closed():
    run = Run()
    run(run.core.close(run.now))
    assert run.core.expects(3)  # it fails at once: its caller must hear it now


def test_a_clear_of_a_send_never_filed_releases_its_sources_at_once():
    """send() that raised after queueing its clear, its item never queued: no write reads its sources."""
    run = Run()
    token = Token()
    out = run(run.core.clear(1, token, run.now))
    assert run.of(Release, out) == [Release(1, token)] and run.conclusions() == [] and run.core.rooms() == []


def test_a_clear_of_a_send_never_filed_releases_nothing_once_closed():
    run = Run()
    run(run.core.close(run.now))
    assert run.of(Release, run(run.core.clear(1, Token(), run.now))) == []


def test_an_offered_room_whose_parked_asks_are_evicted_fails_and_lets_go_of_its_item():
    """Its receivers were told Failed, so they never ask again: left waiting for the rest of its fanout, the room
    would hold its item (and its sources) until the fanout timeout, and conclude only then."""
    run = Run(fanout_timeout_s=120.0, parked=ParkedAsks(max_rooms=4))
    offer = _offer(1000)
    run.offer(offer)
    run.ask(_ask(1000, fanout=2))  # half its fanout: parked, the room waits for the other half
    out = []
    for room in range(4):  # other sessions' asks for rooms not sent yet: the fifth room parked evicts the oldest
        out += run.at(0.1).ask(_ask(room, session=f"10.0.0.9:{17000 + room}", port=7000 + room))
    assert run.statuses(out) == [(1000, 6000, TransferPoll.Failed)]
    assert run.conclusions() == [(1000, TransferPoll.Failed, FailureKind.OTHER)]
    assert run.of(Release, out) == [Release(1000, offer.token)]


def test_a_superseded_receivers_write_still_queued_never_starts_and_its_successor_is_written():
    """The process that asked for it is gone (its memory may be the successor's): the write waits for a slot, but
    when one frees it is dropped, and the successor's ask for the same shard gets it."""
    run = Run(depth=1)
    run.offer(_offer(1, span=4))
    run.ask(_ask(1, rank=0, fanout=2))
    [first] = run.of(StartWrite, run.ask(_ask(1, rank=1, fanout=2)))  # the other waits for the slot
    successor = "10.0.0.7:27001"
    assert run.of(StartWrite, run.ask(_ask(1, rank=1, fanout=2, session=successor, ptr=0x90000))) == []
    out = run.complete(first)
    assert [(w.session_id, w.dsts) for w in run.of(StartWrite, out)] == [(successor, (0x90000,))]
    assert run.conclusions() == []


def test_a_write_failed_or_skipped_after_close_gave_it_up_is_ignored():
    """close() forgets the writes in flight unless told the driver still settles them; a driver that reports one
    failing or not submitted afterwards must not find a room to fail twice, a slot to free, nor a breaker to
    trip."""
    run = Run()
    run.offer(_offer(1))
    [write] = run.of(StartWrite, run.ask(_ask(1)))
    run(run.core.close(1.0))
    assert run(run.core.write_failed(write.wid, "connection reset", took=1.0, now=2.0)) == []
    assert run.core.breaker.open_since("10.0.0.7:17000", 2.0) is None
    assert run(run.core.write_skipped(write.wid, 2.0)) == []


def test_a_checksum_failure_of_a_superseded_receivers_write_does_not_fail_the_room():
    """The write was to a process that is gone: its rows are nobody's now, and the successor's own write decides
    the room."""
    run = Run()
    run.offer(_offer(1, span=4))
    run.ask(_ask(1, rank=0, fanout=2))
    [_, old] = run.of(StartWrite, run.ask(_ask(1, rank=1, fanout=2)))
    successor = "10.0.0.7:27001"
    out = run.ask(_ask(1, rank=1, fanout=2, session=successor, ptr=0x90000))
    [new] = run.of(StartWrite, out)
    assert run(run.core.checksum_failed(old.wid, "device error", run.now)) == []
    assert run.conclusions() == []
    for write in run.of(StartWrite):
        run.complete(write)
    assert run.conclusions() == [(1, TransferPoll.Success, None)] and new.session_id == successor


def test_status_endpoints_remembered_are_bounded_the_least_recently_registered_forgotten(monkeypatch):
    """A peer registering sessions at new ports by the thousand must not grow the core's memory without bound; an
    endpoint forgotten only means a successor there is not recognised as one (its predecessor's asks then wait
    out their own deadline)."""
    monkeypatch.setattr(encode_core, "MAX_ENDPOINTS", 2)
    run = Run()

    def register(port: int, session: str) -> list:
        return run(run.core.registration(Registration("10.0.0.7", port, session, 0x10000, 0, 64 * ROW, 0), run.now))

    for number in range(3):
        register(6000 + number, f"old{number}")
        run.ask(_ask(10 + number, session=f"old{number}", port=6000 + number))
    out = register(6000, "new0")  # at the endpoint forgotten: not a successor
    assert run.of(Count, out) == [] and 10 in run.core.parked
    out = register(6002, "new2")  # at one remembered: supersedes its session
    assert run.of(Count, out) == [Count("sessions_superseded_total", "status_endpoint")]
    assert 12 not in run.core.parked and 11 in run.core.parked


def test_writes_waiting_for_a_slot_when_writes_stop_never_start():
    """stop_writes() is the close's first step: the writes in flight settle, and none that waited for their slot
    may start meanwhile (the engine is going away)."""
    run = Run(depth=1)
    run.offer(_offer(1))
    [first] = run.of(StartWrite, run.ask(_ask(1)))
    run.offer(_offer(2))
    run.ask(_ask(2, session="10.0.0.7:17001", port=6001, ptr=0x90000))
    assert len(run.of(StartWrite)) == 1
    run.core.stop_writes()
    out = run.complete(first)
    assert run.of(StartWrite, out) == [] and run.core.waiting == 1

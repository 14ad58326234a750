"""EncodeCore's rule for asks its driver may not have read yet: a tick told so (the driver was held
up past the tick's time, or left requests queued) holds back the rules that conclude rooms for want
of an ask, for UNREAD_GRACE_S and once in a row; writes waiting still start meanwhile."""

from __future__ import annotations

import pytest

from transfer.core.encode import (
    CLEARED_GRACE_S,
    SWEEP_S,
    UNREAD_GRACE_S,
    Conclude,
    EncodeCore,
    Offer,
    PushStatus,
    StartWrite,
)
from transfer.core.failure import FailureKind
from transfer.frames import TransferInfo
from transfer.status import TransferPoll

HIDDEN = 256
DTYPE = "torch.bfloat16"
ROW = HIDDEN * 2
LIMIT = 10.0


class Token:
    """The caller's object for one send of a room."""


def _offer(room: int, ready_event=None) -> Offer:
    return Offer(room, Token(), 0x7000_0000, 4, HIDDEN, DTYPE, ROW, None, 0, ready_event)


def _ask(room: int) -> TransferInfo:
    return TransferInfo(room, "10.0.0.7", 6000, "10.0.0.7:17000", 0x10000, 0, 4, HIDDEN, DTYPE, False, 1, 0, 4)


def _of(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


def _failed(actions: list) -> list[tuple[int, FailureKind]]:
    return [(c.room, c.failure.kind) for c in _of(Conclude, actions) if c.status == TransferPoll.Failed]


def test_asks_read_after_a_late_tick_past_the_fanout_timeout_are_served():
    core = EncodeCore(fanout_timeout_s=LIMIT)
    core.offer(_offer(1), 0.0)
    # The driver was held up: its first tick comes long past the sweep that would fail the room.
    late = LIMIT + 5.0
    assert core.tick(late, unread=True) == []
    assert core.next_wakeup() == pytest.approx(late + UNREAD_GRACE_S)
    # The ask that waited in its socket is read within the grace: the room is served.
    served = core.ask(_ask(1), late + 0.01)
    assert len(_of(StartWrite, served)) == 1 and _failed(served) == []
    assert _failed(core.tick(late + UNREAD_GRACE_S, unread=True)) == []


def test_the_rules_are_held_back_once_in_a_row_so_a_flood_of_requests_delays_them_by_the_grace_at_most():
    core = EncodeCore(fanout_timeout_s=LIMIT)
    core.offer(_offer(1), 0.0)
    late = LIMIT + 5.0
    assert core.tick(late, unread=True) == []
    assert core.tick(late + UNREAD_GRACE_S / 2, unread=True) == []
    # Still requests unread at the grace's end: the rules apply all the same.
    out = core.tick(late + UNREAD_GRACE_S, unread=True)
    assert _failed(out) == [(1, FailureKind.FANOUT_TIMEOUT)]
    assert "no prefill rank asked" in _of(Conclude, out)[0].failure.detail
    # The next due tick may be held back again, by the grace once more.
    core.offer(_offer(2), late)
    again = late + LIMIT + SWEEP_S + 1.0
    assert core.tick(again, unread=True) == []
    assert _failed(core.tick(again + UNREAD_GRACE_S)) == [(2, FailureKind.FANOUT_TIMEOUT)]


def test_a_tick_with_nothing_unread_applies_the_rules_at_once():
    core = EncodeCore(fanout_timeout_s=LIMIT)
    core.offer(_offer(1), 0.0)
    assert _failed(core.tick(LIMIT + 5.0)) == [(1, FailureKind.FANOUT_TIMEOUT)]


def test_a_cleared_rooms_parked_asks_wait_for_the_grace_too():
    core = EncodeCore(fanout_timeout_s=LIMIT)
    token = Token()
    offer = Offer(1, token, 0x7000_0000, 8, HIDDEN, DTYPE, ROW, None, 0, None)
    core.offer(offer, 0.0)
    half = TransferInfo(1, "10.0.0.7", 6000, "10.0.0.7:17000", 0x10000, 0, 4, HIDDEN, DTYPE, False, 2, 0, 8)
    core.ask(half, 0.0)
    core.clear(1, token, 1.0)
    late = 1.0 + CLEARED_GRACE_S + 2.0
    assert _of(PushStatus, core.tick(late, unread=True)) == []
    told = core.tick(late + UNREAD_GRACE_S)
    assert [(p.room, p.status) for p in _of(PushStatus, told)] == [(1, TransferPoll.Failed)]


def test_writes_waiting_for_their_ready_event_still_start_while_the_rules_are_held_back():
    class Event:
        done = False

        def query(self) -> bool:
            return self.done

    event = Event()
    core = EncodeCore(fanout_timeout_s=LIMIT)
    core.offer(_offer(1, ready_event=event), 0.0)
    assert _of(StartWrite, core.ask(_ask(1), 0.1)) == []
    event.done = True
    assert len(_of(StartWrite, core.tick(3.0, unread=True))) == 1


def _half(room: int, rank: int) -> TransferInfo:
    """Rank `rank`'s ask for half of an 8-row item, its fanout 2."""
    return TransferInfo(room, "10.0.0.7", 6000 + rank, f"10.0.0.7:{17000 + rank}", 0x10000, 0, 4, HIDDEN, DTYPE,
                        False, 2, 4 * rank, 8)


def test_the_ask_completing_a_fanout_read_after_a_late_tick_is_served_though_the_first_was_read_in_time():
    core = EncodeCore(fanout_timeout_s=LIMIT)
    core.offer(Offer(1, Token(), 0x7000_0000, 8, HIDDEN, DTYPE, ROW, None, 0, None), 0.0)
    assert core.ask(_half(1, 0), 0.5) == []  # the first half's ask, read in time
    # The driver was held up past the fanout timeout; the other half's ask waited in its socket.
    late = LIMIT + 5.0
    assert core.tick(late, unread=True) == []
    served = core.ask(_half(1, 1), late + 0.01)
    assert _failed(served) == []
    assert len(_of(StartWrite, served)) == 2


def test_a_fanout_completed_past_its_timeout_with_nothing_unread_still_fails():
    core = EncodeCore(fanout_timeout_s=LIMIT)
    core.offer(Offer(1, Token(), 0x7000_0000, 8, HIDDEN, DTYPE, ROW, None, 0, None), 0.0)
    core.ask(_half(1, 0), 0.5)
    out = core.ask(_half(1, 1), LIMIT + 1.0)  # no sweep ran between: the ask itself is judged late
    assert _failed(out) == [(1, FailureKind.FANOUT_TIMEOUT)]


def test_an_item_taken_after_a_late_tick_past_the_fanout_timeout_is_served():
    core = EncodeCore(fanout_timeout_s=LIMIT)
    assert core.ask(_ask(1), 0.0) == []
    # The driver was held up past the fanout timeout; the caller's send() of the item, made meanwhile,
    # waited in the driver's queue of commands and is taken within the grace, as a waiting ask is.
    late = LIMIT + 5.0
    assert core.tick(late, unread=True) == []
    served = core.offer(_offer(1), late + 0.01)
    assert len(_of(StartWrite, served)) == 1 and _failed(served) == []

"""PrefillCore's rule for statuses its driver may not have read yet: a tick told so (the driver was held
up past the tick's time, or left statuses queued) holds back the rules that act for want of a status
(deadlines, asks held for a cancel's answer) for UNREAD_GRACE_S and once in a row; asks waiting for a
socket are still looked up again meanwhile."""

from __future__ import annotations

import pytest
from prefill_rooms import ENCODE, KEY0, core, routed, spec

from transfer.core.failure import FailureKind
from transfer.core.prefill import (
    CANCEL_ANSWER_WAIT_S,
    QUEUED_LOOKUP_S,
    UNREAD_GRACE_S,
    Conclude,
    LookUpRoute,
    MemorySafe,
    SendAsk,
    SendCancel,
)
from transfer.frames import CancelAnswer
from transfer.status import TransferPoll

DEADLINE_S = 10.0


def _failed(actions: list) -> list[tuple[int, FailureKind]]:
    return [(a.room, a.failure.kind) for a in actions if isinstance(a, Conclude) and a.failure is not None]


def _asked(room: int, now: float = 1.0):
    """A core whose room `room` was asked at `now`, on a cached route: (core, the room's token)."""
    c = core(deadline_s=DEADLINE_S, integrity=False)
    routed(c)
    token, actions = c.receive(now, spec(room, slot=1))
    assert [type(a) for a in actions] == [SendAsk]
    return c, token


def test_a_status_read_after_a_late_tick_past_the_deadline_concludes_the_room():
    c, token = _asked(1)
    # The driver was held up: its first tick comes long past the room's deadline.
    late = 1.0 + DEADLINE_S + 5.0
    assert c.tick(late, unread=True) == []
    assert c.next_wakeup() == pytest.approx(late + UNREAD_GRACE_S)
    # The Success that waited in its socket is read within the grace: the room succeeds.
    assert c.status(late + 0.01, 1, TransferPoll.Success, 0) == [Conclude(1, token, None)]
    assert c.tick(late + UNREAD_GRACE_S, unread=True) == []


def test_the_deadline_is_held_back_once_in_a_row_so_a_flood_of_statuses_delays_it_by_the_grace_at_most():
    c, _ = _asked(1)
    late = 1.0 + DEADLINE_S + 5.0
    assert c.tick(late, unread=True) == []
    assert c.tick(late + UNREAD_GRACE_S / 2, unread=True) == []
    # Still statuses unread at the grace's end: the room fails all the same.
    out = c.tick(late + UNREAD_GRACE_S, unread=True)
    assert _failed(out) == [(1, FailureKind.DEADLINE)]
    assert "no status from encode rank 0" in next(a for a in out if isinstance(a, Conclude)).failure.detail


def test_a_hold_that_ran_out_still_fails_the_rooms_it_held_when_its_end_tick_comes_late():
    c, _ = _asked(1)
    late = 1.0 + DEADLINE_S + 5.0
    assert c.tick(late, unread=True) == []
    # The driver was held up again across the grace's end: the room it held fails now.
    assert _failed(c.tick(late + 3.0, unread=True)) == [(1, FailureKind.DEADLINE)]


def test_a_room_due_after_a_hold_that_ran_out_unseen_is_held_back_too():
    c, first = _asked(1)
    late = 1.0 + DEADLINE_S + 5.0
    assert c.tick(late, unread=True) == []
    assert c.status(late + 0.01, 1, TransferPoll.Success, 0) == [Conclude(1, first, None)]
    second, actions = c.receive(late + 0.02, spec(2, slot=2))
    assert [type(a) for a in actions] == [SendAsk]
    # Held up again before the tick at the grace's end came, now past the second room's deadline.
    again = late + 0.02 + DEADLINE_S + 2.0
    assert c.tick(again, unread=True) == []
    assert c.status(again + 0.01, 2, TransferPoll.Success, 0) == [Conclude(2, second, None)]
    assert c.tick(again + UNREAD_GRACE_S) == [] and c.next_wakeup() is None


def test_a_tick_with_nothing_unread_fails_the_room_at_once():
    c, _ = _asked(1)
    assert _failed(c.tick(1.0 + DEADLINE_S + 5.0)) == [(1, FailureKind.DEADLINE)]


def test_an_ask_held_for_a_cancels_answer_waits_for_the_grace_too():
    c, old = _asked(7)
    assert [type(a) for a in c.abandon(1.0, 7, old)] == [SendCancel]
    assert c.clear(1.0, 7, old)
    token, actions = c.receive(1.0, spec(7, slot=2))
    assert actions == [] and c.stage(7) == "held"
    late = 1.0 + CANCEL_ANSWER_WAIT_S + 2.0
    assert c.tick(late, unread=True) == [] and c.stage(7) == "held"
    # The answer that waited in the socket lets the ask go.
    safe, ask = c.cancel_answered(late + 0.01, 7, 0, CancelAnswer.CONFIRMED)
    assert safe == MemorySafe(7, old) and isinstance(ask, SendAsk) and ask.token == token


def test_asks_waiting_for_a_socket_are_still_looked_up_again_while_the_rules_are_held_back():
    c = core(deadline_s=DEADLINE_S)
    routed(c)
    _, actions = c.receive(1.0, spec(1, slot=1))
    assert c.refused(1.0, ENCODE, actions) == [] and c.stage(1) == "queued"
    late = 1.0 + QUEUED_LOOKUP_S + 1.0
    assert c.tick(late, unread=True) == [LookUpRoute(KEY0)]
    assert c.stage(1) == "queued"


def _rooms_asked_then_held_up(rooms: int):
    """A core with rooms 1..`rooms` asked at 1.0, and the time 5 s past their deadline (a held-up rank's)."""
    c = core(deadline_s=DEADLINE_S, integrity=False)
    routed(c)
    for room in range(1, rooms + 1):
        c.receive(1.0, spec(room, slot=room))
    return c, 1.0 + DEADLINE_S + 5.0


def test_rooms_a_hold_held_past_a_ticks_limit_are_not_held_again_under_a_flood_of_statuses():
    limit, rooms = 4, 10
    c, late = _rooms_asked_then_held_up(rooms)
    assert c.tick(late, limit, unread=True) == []
    # The grace's end: a batch of the rooms it held fails; statuses still flood in.
    end = late + UNREAD_GRACE_S
    failed = _failed(c.tick(end, limit, unread=True))
    assert len(failed) == limit
    # The rest were due before the grace ended as well: the next turns go on failing them, a batch a turn,
    # rather than holding them back for a grace more each batch.
    assert c.next_wakeup() <= end
    for turn in range(1, 3):
        failed += _failed(c.tick(end + turn * 0.001, limit, unread=True))
    assert sorted(room for room, _ in failed) == list(range(1, rooms + 1))
    assert {kind for _, kind in failed} == {FailureKind.DEADLINE}


def test_a_room_due_while_the_rank_was_held_up_again_is_held_back_while_an_earlier_holds_rest_fails():
    limit, rooms = 4, 6
    c, late = _rooms_asked_then_held_up(rooms)
    later, actions = c.receive(late - DEADLINE_S + 1.0, spec(20, slot=20))  # due a second after the hold ends
    assert [type(a) for a in actions] == [SendAsk]
    assert c.tick(late, limit, unread=True) == []
    end = late + UNREAD_GRACE_S
    failed = _failed(c.tick(end, limit, unread=True))
    # Held up again past room 20's deadline, whose Success came in time and waits unread.
    again = end + 2.0
    failed += _failed(c.tick(again, limit, unread=True))
    assert c.status(again + 0.01, 20, TransferPoll.Success, 0) == [Conclude(20, later, None)]
    failed += _failed(c.tick(again + 0.02, limit, unread=True))
    assert sorted(room for room, _ in failed) == list(range(1, rooms + 1))

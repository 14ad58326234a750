"""PrefillCore giving up on a room: a cancel on the socket it asked on, and when its memory is safe again."""

from __future__ import annotations

import dataclasses

from prefill_rooms import BOOT, ENCODE, KEY0, asked, spec
from prefill_rooms import core as prefill_core

import transfer.core.cancels as cancels
import transfer.core.prefill as prefill
from transfer.core.failure import Failure, FailureKind
from transfer.core.prefill import (
    Conclude,
    Disconnect,
    LookUpParallel,
    LookUpRoute,
    MemorySafe,
    PrefillCore,
    SendAsk,
    SendCancel,
    Verify,
    Warn,
)
from transfer.frames import Cancel, CancelAnswer, parse_cancel
from transfer.status import TransferPoll

CONFIRMED, TOO_LATE, WRITE_FAILED = CancelAnswer.CONFIRMED, CancelAnswer.TOO_LATE, CancelAnswer.WRITE_FAILED


def core() -> PrefillCore:
    return prefill_core(deadline_s=10.0)


def of(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


def test_a_room_past_its_deadline_sends_its_cancel_before_the_socket_closes():
    c = core()
    token = asked(c, 1)
    actions = c.tick(10.0)
    [cancel] = of(SendCancel, actions)
    assert cancel.addr == ENCODE and cancel.token == token
    assert parse_cancel(cancel.frames) == Cancel(1, "10.0.0.3", 5555, "10.0.0.3:1234", reads_write_failed=True)
    kinds = [type(a) for a in actions]
    assert kinds.index(SendCancel) < kinds.index(Disconnect)
    [disconnect] = of(Disconnect, actions)
    assert disconnect.flush
    assert of(Conclude, actions)[0].failure.kind is FailureKind.DEADLINE
    assert not c.safe(1, token) and c.pending_cancels == 1


def test_a_confirmed_cancel_makes_the_memory_safe_and_a_too_late_one_does_not():
    c = core()
    token = asked(c, 1)
    c.tick(10.0)
    assert c.cancel_answered(10.1, 1, 0, TOO_LATE) == []
    assert c.cancel_answered(10.1, 1, 3, CONFIRMED) == []  # another encode rank's answer
    assert c.cancel_answered(10.2, 1, 0, CONFIRMED) == [MemorySafe(1, token)]
    assert c.pending_cancels == 0
    assert c.cancel_answered(10.3, 1, 0, CONFIRMED) == []  # answered once


def test_a_cancel_whose_write_failed_is_answered_but_its_memory_waits_out_the_quarantine():
    c = core()
    token = asked(c, 1)
    c.tick(10.0)
    assert c.cancel_answered(10.1, 1, 0, TOO_LATE) == []
    assert c.cancel_answered(10.2, 1, 0, WRITE_FAILED) == []  # its bytes may still land
    assert not c.safe(1, token) and c.pending_cancels == 0
    assert c.cancel_answered(10.3, 1, 0, CONFIRMED) == []  # nothing left to confirm


def test_a_confirmation_after_the_room_was_cleared_still_counts():
    c = core()
    token = asked(c, 1)
    c.tick(10.0)
    c.clear(10.0, 1, token)
    assert c.cancel_answered(10.5, 1, 0, CONFIRMED) == [MemorySafe(1, token)]


def test_clear_before_a_terminal_status_sends_a_cancel():
    c = core()
    token = asked(c, 2)
    c.status(1.0, 2, TransferPoll.Transferring, 0)
    actions = c.abandon(1.0, 2, token)
    assert [type(a) for a in actions] == [SendCancel]
    assert c.abandon(1.0, 2, token) == []  # once
    assert c.clear(1.0, 2, token)


def test_a_room_never_asked_is_safe_at_once():
    c = core()
    token, actions = c.receive(0.0, spec(3))
    assert actions == [LookUpParallel(BOOT)]
    assert c.abandon(0.5, 3, token) == [MemorySafe(3, token)]


def test_a_room_that_failed_before_its_ask_is_safe_without_a_cancel():
    c = core()
    token, _ = c.receive(0.0, spec(4))
    c.lookup_failed(0.1, BOOT, None, "connection refused", 0.1)
    assert c.stage(4) == "concluded" and c.safe(4, token)
    assert c.abandon(0.2, 4, token) == []


def test_a_room_that_succeeded_sends_no_cancel():
    c = core()
    c.integrity = False
    token = asked(c, 5)
    assert of(Conclude, c.status(1.0, 5, TransferPoll.Success, 0)) == [Conclude(5, token, None)]
    assert c.abandon(1.0, 5, token) == []


def test_a_success_whose_bytes_do_not_verify_is_cancelled_when_cleared():
    """It may be an earlier ask's Success under the same room number: this ask's write can still come."""
    c = core()
    token = asked(c, 7)
    (verify,) = c.status(1.0, 7, TransferPoll.Success, 0, (11,))
    failure = of(Conclude, c.checksum_mismatched(1.1, 7, token, "embedding", 11, 0))[0].failure
    assert failure.kind is FailureKind.CHECKSUM and not c.safe(7, token)
    assert [type(a) for a in c.abandon(1.2, 7, token)] == [SendCancel]


def test_a_room_cleared_while_its_success_is_verified_is_cancelled():
    """Until its bytes verify, its Success may be an earlier ask's under the same room number:
    the memory is safe only once the encode rank confirms the cancel."""
    c = core()
    token = asked(c, 8)
    c.status(1.0, 8, TransferPoll.Success, 0, (11,))
    assert c.stage(8) == "verifying"
    assert [type(a) for a in c.abandon(1.1, 8, token)] == [SendCancel]
    assert not c.safe(8, token) and c.pending_cancels == 1
    assert c.clear(1.1, 8, token)
    assert c.cancel_answered(1.2, 8, 0, CONFIRMED) == [MemorySafe(8, token)]


def test_a_room_failed_by_its_encode_rank_is_cancelled_when_cleared():
    """A Failed from the encode rank may come while its write is still in flight."""
    c = core()
    token = asked(c, 6)
    c.status(1.0, 6, TransferPoll.Failed, 0)
    assert not c.safe(6, token)
    assert [type(a) for a in c.abandon(1.0, 6, token)] == [SendCancel]


def test_closing_concludes_open_rooms_and_cancels_every_room_not_known_safe():
    """close() gives up each room held as clear() would: open ones fail, and those asked and not
    known safe (open, or failed by the encode rank and not cleared) get their cancel; a Success and
    a room never asked get none, and no room gets two."""
    c = core()
    c.integrity = False
    closed = Failure(FailureKind.CLOSED, "session manager closed")
    waiting = asked(c, 1)
    failed = asked(c, 2)
    c.status(0.5, 2, TransferPoll.Failed, 0)
    asked(c, 3)
    c.status(0.5, 3, TransferPoll.Success, 0)
    elsewhere = dataclasses.replace(spec(5, slot=5), bootstrap_addr="10.0.0.9:8998")
    unasked, _ = c.receive(5.0, elsewhere)  # waits for its look-up
    actions = c.close(5.0, closed)
    assert of(Conclude, actions) == [Conclude(1, waiting, closed), Conclude(5, unasked, closed)]
    assert [(a.room, a.token) for a in of(SendCancel, actions)] == [(1, waiting), (2, failed)]
    assert all(a.addr == ENCODE for a in of(SendCancel, actions))
    assert c.safe(5, unasked) and c.stage(3) == "concluded"
    assert not c.safe(1, waiting) and not c.safe(2, failed) and c.pending_cancels == 2
    assert c.close(5.1, closed) == []


def test_rooms_past_their_deadline_together_all_send_their_cancels_before_the_silent_socket_closes():
    """The first room to expire finds the rank silent and closes the socket; the rooms asked on it whose
    deadlines passed at the same time cancel on it first, so each one's memory is safe once confirmed."""
    c = core()
    token1 = asked(c, 1, now=0.0)
    token2 = asked(c, 2, now=0.0)
    actions = c.tick(10.0)
    cancels = of(SendCancel, actions)
    assert sorted(cancel.token for cancel in cancels) == [token1, token2]
    kinds = [type(a) for a in actions]
    assert max(i for i, kind in enumerate(kinds) if kind is SendCancel) < kinds.index(Disconnect)
    [disconnect] = of(Disconnect, actions)
    assert disconnect.flush
    assert sorted(conclude.room for conclude in of(Conclude, actions)) == [1, 2]
    assert of(MemorySafe, c.cancel_answered(10.1, 2, 0, CONFIRMED)) == [MemorySafe(2, token2)]


def test_a_room_expired_on_a_socket_dropped_since_sends_no_cancel():
    """A fresh connection could overtake the old one's ask: only the quarantine bound helps then."""
    c = core()
    asked(c, 1, now=0.0)
    token2 = asked(c, 2, now=4.0)
    assert of(Disconnect, c.tick(10.0))  # room 1's deadline drops the socket room 2 was asked on too
    actions = c.tick(14.0)
    assert of(Conclude, actions)[0].failure.kind is FailureKind.DEADLINE
    assert of(SendCancel, actions) == [] and not c.safe(2, token2)


def test_cancels_awaiting_an_answer_are_bounded(monkeypatch):

    monkeypatch.setattr(cancels, "MAX_PENDING_CANCELS", 2)
    c = core()
    tokens = [asked(c, room, now=float(room)) for room in (1, 2, 3)]
    for room, token in zip((1, 2, 3), tokens):
        assert [type(a) for a in c.abandon(5.0, room, token)] == [SendCancel]
    assert c.pending_cancels == 2
    assert c.cancel_answered(6.0, 1, 0, CONFIRMED) == []  # the oldest was forgotten
    assert c.cancel_answered(6.0, 3, 0, CONFIRMED) == [MemorySafe(3, tokens[2])]


def _cleared_and_asked_again(c: PrefillCore, room: int, now: float) -> tuple[int, int, list]:
    """Asks for `room`, gives it up before any status (a cancel goes out), clears it and asks again
    on the same socket; (old token, new token, the new ask's actions)."""
    old = asked(c, room, now)
    assert [type(a) for a in c.abandon(now, room, old)] == [SendCancel]
    assert c.clear(now, room, old)
    token, actions = c.receive(now, spec(room, slot=room + 1))
    return old, token, actions


def _answering(c: PrefillCore) -> None:
    """The encode rank has answered a cancel before (room 90's)."""
    old = asked(c, 90)
    c.abandon(0.0, 90, old)
    assert c.clear(0.0, 90, old)
    assert c.cancel_answered(0.0, 90, 0, CONFIRMED) == [MemorySafe(90, old)]


def test_a_status_before_the_cancels_answer_is_the_cancelled_asks_and_concludes_nothing():
    """An encode rank that answers cancels reads the cancel before the new ask (one socket, in
    order) and answers it before anything about that ask: a status that comes before the answer
    is the old ask's, and must not conclude (or verify) the new one."""
    c = core()
    _answering(c)
    old, token, actions = _cleared_and_asked_again(c, 7, 1.0)
    assert [type(a) for a in actions] == [SendAsk], "a rank known to answer cancels is asked at once"
    for status in (TransferPoll.Success, TransferPoll.Failed, TransferPoll.Transferring):
        assert c.status(1.1, 7, status, 0, (11,) if status is TransferPoll.Success else ()) == []
    assert c.stage(7) == "asked"
    assert c.cancel_answered(1.2, 7, 0, CONFIRMED) == [MemorySafe(7, old)]
    (verify,) = c.status(1.3, 7, TransferPoll.Success, 0, (11,))
    assert isinstance(verify, Verify) and verify.token == token


def test_the_cancelled_asks_status_while_the_new_ask_waits_for_its_socket_is_stale_not_suspect():
    """The new ask has not left yet (its socket was full): the old ask's Success, which comes before the
    cancel's answer, is dropped as stale, with no warning of a status for a room never asked for."""
    c = core()
    _answering(c)
    old, token, actions = _cleared_and_asked_again(c, 7, 1.0)
    c.refused(1.0, ENCODE, actions)
    assert c.stage(7) == "queued"
    assert c.status(1.1, 7, TransferPoll.Success, 0, (11,)) == []
    assert c.cancel_answered(1.2, 7, 0, CONFIRMED) == [MemorySafe(7, old)]
    [warning] = c.status(1.3, 7, TransferPoll.Success, 0, (11,))
    assert isinstance(warning, Warn) and "before this rank asked for the room; ignored" in warning.message

def test_a_too_late_answer_is_the_cancels_answer_and_the_new_asks_statuses_count_after_it():
    c = core()
    c.integrity = False
    _answering(c)
    old, token, _ = _cleared_and_asked_again(c, 7, 1.0)
    assert c.cancel_answered(1.1, 7, 0, TOO_LATE) == []
    assert of(Conclude, c.status(1.2, 7, TransferPoll.Success, 0)) == [Conclude(7, token, None)]
    assert c.cancel_answered(1.3, 7, 0, CONFIRMED) == [MemorySafe(7, old)]


def test_an_ask_again_waits_for_the_cancels_answer_from_a_rank_not_known_to_answer():
    """The first cancel to a rank: the room's new ask waits for its answer, so the old ask's Success,
    which comes first, finds the room not asked for; the answer lets the ask go."""
    c = core()
    c.integrity = False
    old, token, actions = _cleared_and_asked_again(c, 7, 1.0)
    assert actions == [] and c.stage(7) == "held"
    assert c.next_wakeup() == 1.0 + prefill.CANCEL_ANSWER_WAIT_S
    assert c.status(1.1, 7, TransferPoll.Success, 0) == [] and c.stage(7) == "held"
    safe, ask = c.cancel_answered(1.2, 7, 0, CONFIRMED)
    assert safe == MemorySafe(7, old) and isinstance(ask, SendAsk) and ask.token == token
    assert of(Conclude, c.status(1.3, 7, TransferPoll.Success, 0)) == [Conclude(7, token, None)]


def test_a_held_asks_wait_is_read_by_wakes_before_as_next_wakeup_reads_it():
    """The held ask's wait ends before any deadline: wakes_before() answers for it as next_wakeup() does."""
    c = core()
    c.integrity = False
    _cleared_and_asked_again(c, 7, 1.0)
    wakeup = 1.0 + prefill.CANCEL_ANSWER_WAIT_S
    for t in (wakeup - 0.01, wakeup, wakeup + 0.01, c.deadline_s + 2.0):
        assert c.wakes_before(t) == (wakeup < t), t
    assert c.next_wakeup() == wakeup


def test_an_ask_held_for_a_cancels_answer_goes_when_none_comes_in_time():
    """A peer drops cancels unanswered: the ask goes once the wait is over, and its statuses count; a Success,
    which may be the cancelled ask's, only with checksums that show the bytes landed in this ask's memory."""
    c = core()
    c.integrity = False
    _, token, actions = _cleared_and_asked_again(c, 7, 1.0)
    assert actions == []
    assert c.tick(1.0 + prefill.CANCEL_ANSWER_WAIT_S - 0.01) == []
    (ask,) = c.tick(1.0 + prefill.CANCEL_ANSWER_WAIT_S)
    assert isinstance(ask, SendAsk) and ask.token == token and c.stage(7) == "asked"
    (concluded,) = of(Conclude, c.status(2.0, 7, TransferPoll.Success, 0))
    assert concluded.failure is not None and concluded.failure.kind is FailureKind.OTHER
    assert "earlier ask of room 7" in concluded.failure.detail
    c.receive(2.0, spec(8, slot=9))
    assert c.stage(8) == "asked", "a room with no cancel before it is asked at once"


def test_a_held_ask_stays_held_while_the_cancel_it_waits_for_is_unanswered_though_an_earlier_one_is_answered():
    """Room 7 asked three times of a rank not known to answer cancels: the third ask waits for the second
    ask's cancel. The first cancel's answer (they come in the order sent) says nothing of the second ask,
    whose statuses may still come and would be taken for the third's: the ask stays held until its own."""
    c = core()
    c.integrity = False
    wait = prefill.CANCEL_ANSWER_WAIT_S
    first, second, actions = _cleared_and_asked_again(c, 7, 1.0)
    assert actions == [] and c.stage(7) == "held"
    (ask,) = c.tick(1.0 + wait)
    assert isinstance(ask, SendAsk) and ask.token == second
    now = 1.0 + wait + 0.1
    assert [type(a) for a in c.abandon(now, 7, second)] == [SendCancel]
    assert c.clear(now, 7, second)
    third, actions = c.receive(now, spec(7, slot=9))
    assert actions == [] and c.stage(7) == "held"
    assert c.cancel_answered(now + 0.1, 7, 0, CONFIRMED) == [MemorySafe(7, first)]
    assert c.stage(7) == "held", "the second ask's cancel is still unanswered"
    safe, ask = c.cancel_answered(now + 0.2, 7, 0, CONFIRMED)
    assert safe == MemorySafe(7, second) and isinstance(ask, SendAsk) and ask.token == third


def test_a_cancel_on_a_dropped_connection_holds_nothing_back_on_the_fresh_one():
    """The cancel went out on a socket dropped since (its room's deadline): the new ask goes on a
    fresh connection, which the cancel does not travel ahead of, so its statuses count as they come
    (a Success only once verified: tests/unit/test_prefill_reask_statuses.py)."""
    c = core()
    c.integrity = False
    _answering(c)
    old = asked(c, 7, now=0.0)
    actions = c.tick(10.0)
    assert of(SendCancel, actions) and of(Disconnect, actions)
    c.clear(10.0, 7, old)
    token, actions = c.receive(10.1, spec(7, slot=8))
    if actions == [LookUpParallel(BOOT)]:
        actions = c.parallel_resolved(10.1, BOOT, 1, 1)
    assert actions == [LookUpRoute(KEY0)]
    assert SendAsk in [type(a) for a in c.route_resolved(10.2, KEY0, ENCODE)]
    assert of(Conclude, c.status(10.3, 7, TransferPoll.Failed, 0))[0].failure.kind is FailureKind.PEER_FAILED


def test_a_cancel_lost_with_a_dropped_connection_holds_back_no_later_ask_of_its_room():
    """The encode rank restarted at the same address before it read the cancel: room 7 asked again
    goes at once on the fresh connection and its Success counts, though the cancel is never answered."""
    c = core()
    c.integrity = False
    _answering(c)
    old = asked(c, 7, now=0.0)
    assert of(SendCancel, c.abandon(0.1, 7, old))
    c.clear(0.1, 7, old)
    assert c.connection_dropped(0.2, ENCODE) == []
    token = asked(c, 7, now=0.3)
    # The earlier ask may have been read and served before its cancel was lost: with integrity off a Success
    # cannot be told from this ask's, so it fails rather than being taken (a Failed counts as it comes).
    (concluded,) = of(Conclude, c.status(0.4, 7, TransferPoll.Success, 0))
    assert concluded.token == token and concluded.failure.kind is FailureKind.OTHER


def test_a_room_asked_on_a_fresh_connection_sends_no_cancel_while_one_from_the_old_waits():
    """An answer names only the room and the encode rank: one to the new cancel could be taken for the
    unanswered one's, so the new room's memory waits out the quarantine instead."""
    c = core()
    _answering(c)
    old = asked(c, 7, now=0.0)
    c.abandon(0.1, 7, old)
    c.clear(0.1, 7, old)
    c.connection_dropped(0.2, ENCODE)
    token = asked(c, 7, now=0.3)
    assert c.abandon(0.4, 7, token) == [] and c.pending_cancels == 1
    assert not c.safe(7, token)


def test_cancels_lost_with_their_encode_rank_are_set_aside_and_take_their_late_answers():
    """The encode rank went away with three cancels unread: they stop counting as pending, and an answer that
    still comes for one is never taken for a later cancel of the same room (answers name only room and rank)."""
    c = core()
    _answering(c)
    old = {}
    for room in (7, 8, 9):
        old[room] = asked(c, room, now=0.0)
        c.abandon(0.1, room, old[room])
        c.clear(0.1, room)
    c.connection_dropped(0.2, ENCODE)
    assert c.pending_cancels == 3
    c.tick(0.1 + cancels.STALE_CANCEL_S - 0.01)
    assert c.pending_cancels == 3
    c.tick(0.1 + cancels.STALE_CANCEL_S)
    assert c.pending_cancels == 0 and c.idle(ENCODE, 0.1 + cancels.STALE_CANCEL_S)
    token = asked(c, 7, now=400.0)
    assert c.abandon(400.1, 7, token) == []  # no cancel a late answer could be taken for: the quarantine frees it
    assert c.cancel_answered(400.2, 7, 0, TOO_LATE) == [] and c.cancel_answered(401.0, 7, 0, CONFIRMED) == []
    assert not c.safe(7, token)
    c.clear(401.0, 7, token)
    again = asked(c, 7, now=402.0)  # the set-aside cancel's last answer came: room 7 is cancelled again
    assert of(SendCancel, c.abandon(402.1, 7, again)) and c.pending_cancels == 1


def test_a_cancel_answered_too_late_on_a_lost_connection_is_set_aside_until_its_last_answer():
    """Its write may outlast STALE_CANCEL_S (MC_TRANSFER_TIMEOUT is the encode side's to raise): its CONFIRMED
    is taken by the set-aside cancel, never by a later one."""
    c = core()
    _answering(c)
    old = asked(c, 7, now=0.0)
    c.abandon(0.1, 7, old)
    c.clear(0.1, 7, old)
    c.cancel_answered(0.2, 7, 0, TOO_LATE)
    c.connection_dropped(0.3, ENCODE)
    c.tick(2 * cancels.STALE_CANCEL_S)
    assert c.pending_cancels == 0
    token = asked(c, 7, now=2 * cancels.STALE_CANCEL_S)
    assert c.abandon(2 * cancels.STALE_CANCEL_S + 0.1, 7, token) == []
    assert c.cancel_answered(3 * cancels.STALE_CANCEL_S, 7, 0, CONFIRMED) == []
    assert not c.safe(7, token)


def _past_the_pending_bound(first_room: int, others: tuple[int, ...]) -> tuple[PrefillCore, int]:
    """A core whose `first_room` was cancelled and answered too late, then `others` cancelled past a pending
    bound of 2 (monkeypatched by the caller); returns it and the first room's token."""
    c = prefill_core(deadline_s=10 * cancels.STALE_CANCEL_S)
    _answering(c)
    first = asked(c, first_room, now=0.0)
    c.abandon(0.1, first_room, first)
    c.cancel_answered(0.2, first_room, 0, TOO_LATE)
    for room in others:
        c.abandon(0.3, room, asked(c, room, now=0.3))
    return c, first


def test_past_the_pending_bound_the_oldest_cancels_are_set_aside_not_dropped(monkeypatch):
    monkeypatch.setattr(cancels, "MAX_PENDING_CANCELS", 2)
    c, first = _past_the_pending_bound(7, (8, 9))
    assert c.pending_cancels == 2  # room 7's cancel set aside
    c.clear(0.4, 7, first)
    token = asked(c, 7, now=0.5)
    assert c.abandon(0.6, 7, token) == []
    assert c.cancel_answered(20.0, 7, 0, CONFIRMED) == [] and not c.safe(7, token)


def test_at_the_ghost_bound_no_cancel_is_sent_and_no_ghost_is_dropped(monkeypatch):
    """A dropped ghost would let its late CONFIRMED be taken for a later cancel of its room (a write in flight)."""
    monkeypatch.setattr(cancels, "MAX_PENDING_CANCELS", 2)
    monkeypatch.setattr(cancels, "MAX_GHOSTS", 2)
    c, first = _past_the_pending_bound(1, (2, 3, 4))
    assert c.pending_cancels == 2  # rooms 1 and 2 set aside as ghosts: the bound is reached
    out = c.abandon(0.4, 5, asked(c, 5, now=0.4))
    assert of(SendCancel, out) == [] and of(Warn, out)
    c.clear(0.5, 1, first)
    again = asked(c, 1, now=0.6)
    assert c.abandon(0.7, 1, again) == []  # room 1's ghost is still there
    assert c.cancel_answered(20.0, 1, 0, CONFIRMED) == [] and not c.safe(1, again)


def test_the_rooms_whose_cancels_are_set_aside_are_counted_until_their_last_answers_came(monkeypatch):
    """What the cancels_set_aside gauge reads: rooms set aside as ghosts, each until its last answer."""
    monkeypatch.setattr(cancels, "MAX_PENDING_CANCELS", 2)
    c, _ = _past_the_pending_bound(1, (2, 3, 4))
    assert c.cancels_set_aside == 2  # rooms 1 (answered too late so far) and 2
    c.cancel_answered(20.0, 2, 0, CONFIRMED)
    assert c.cancels_set_aside == 1
    c.cancel_answered(20.0, 1, 0, CONFIRMED)
    assert c.cancels_set_aside == 0


def test_an_unanswered_cancel_on_a_connection_still_in_use_is_kept():
    c = prefill_core(deadline_s=10 * cancels.STALE_CANCEL_S)
    _answering(c)
    token = asked(c, 7, now=0.0)
    c.abandon(0.1, 7, token)
    asked(c, 8, now=0.2)  # keeps the connection in use
    c.tick(0.1 + cancels.STALE_CANCEL_S)
    assert c.pending_cancels == 1
    assert c.cancel_answered(0.2 + cancels.STALE_CANCEL_S, 7, 0, CONFIRMED) == [MemorySafe(7, token)]


def test_stale_cancels_are_set_aside_at_most_limit_a_tick():
    c = core()
    _answering(c)
    for room in range(10, 15):
        c.abandon(0.1, room, asked(c, room, now=0.0))
        c.clear(0.1, room)
    c.connection_dropped(0.2, ENCODE)
    c.tick(0.1 + cancels.STALE_CANCEL_S, limit=2)
    assert c.pending_cancels == 3
    c.tick(0.2 + cancels.STALE_CANCEL_S, limit=2)
    c.tick(0.3 + cancels.STALE_CANCEL_S, limit=2)
    assert c.pending_cancels == 0


def test_a_room_given_up_at_another_node_while_a_cancel_waits_for_the_same_rank_gets_none():
    """Answers name only the room and the encode rank number: with a cancel for room 7 waiting at
    one node, room 7 given up at another node's rank 0 is not cancelled (its memory waits out the
    quarantine), so the first node's answer can only make the first ask's memory safe."""
    from dataclasses import replace

    c = core()
    first = asked(c, 7)
    assert [type(a) for a in c.abandon(0.1, 7, first)] == [SendCancel]
    assert c.clear(0.1, 7, first)
    other_boot, other_encode = "10.0.0.9:8998", ("10.0.0.8", 7000)
    second, actions = c.receive(0.2, replace(spec(7, slot=8), bootstrap_addr=other_boot))
    assert actions == [LookUpParallel(other_boot)]
    assert c.parallel_resolved(0.2, other_boot, 1, 1) == [LookUpRoute((other_boot, 0, 0))]
    assert SendAsk in [type(a) for a in c.route_resolved(0.2, (other_boot, 0, 0), other_encode)]
    assert c.abandon(0.3, 7, second) == [] and not c.safe(7, second)
    assert c.cancel_answered(0.4, 7, 0, CONFIRMED) == [MemorySafe(7, first)]
    assert not c.safe(7, second) and c.pending_cancels == 0


def test_an_encode_rank_that_leaves_a_cancel_unanswered_is_sent_no_more_until_it_answers_one():
    """A peer without the extension answers none and logs each cancel as a malformed frame: past
    CANCEL_SILENCE_S without an answer, rooms given up there wait out the quarantine instead."""
    c = core()
    first = asked(c, 1, now=0.0)
    assert of(SendCancel, c.abandon(0.0, 1, first))
    second = asked(c, 2, now=1.0)
    assert of(SendCancel, c.abandon(1.0, 2, second)), "still within CANCEL_SILENCE_S of the first"
    third = asked(c, 3, now=prefill.CANCEL_SILENCE_S)
    assert c.abandon(prefill.CANCEL_SILENCE_S, 3, third) == [] and not c.safe(3, third)
    assert c.cancel_answered(6.0, 1, 0, CONFIRMED) == [MemorySafe(1, first)]
    fourth = asked(c, 4, now=7.0)
    assert of(SendCancel, c.abandon(7.0, 4, fourth)), "it answered one: it is sent cancels again"


def test_a_fresh_connection_is_sent_cancels_again():
    c = core()
    first = asked(c, 1, now=0.0)
    c.abandon(0.0, 1, first)
    c.connection_dropped(6.0, ENCODE)
    second = asked(c, 2, now=6.5)
    assert of(SendCancel, c.abandon(6.5, 2, second))


def test_a_cancel_the_socket_did_not_take_starts_no_silence_and_holds_nothing_back():
    """No answer can come for a cancel never sent: the rank is not taken for one that answers none,
    and a room asked again does not wait for that answer."""
    c = core()
    _answering(c)
    first = asked(c, 1, now=0.0)
    (cancel,) = of(SendCancel, c.abandon(0.0, 1, first))
    c.clear(0.0, 1, first)
    assert c.cancel_unsent(0.0, 1, cancel.rank, cancel.token) == [] and c.pending_cancels == 0
    assert not c.safe(1, first)
    second = asked(c, 1, now=0.1)  # not held for an answer
    assert of(SendCancel, c.abandon(prefill.CANCEL_SILENCE_S + 1, 1, second))


def test_a_rank_known_to_answer_cancels_is_sent_them_whatever_one_lost_cancel():
    c = core()
    _answering(c)
    first = asked(c, 1, now=0.0)
    c.abandon(0.0, 1, first)  # its cancel is lost on the way
    second = asked(c, 2, now=prefill.CANCEL_SILENCE_S + 1)
    assert of(SendCancel, c.abandon(prefill.CANCEL_SILENCE_S + 1, 2, second))


def test_an_ask_that_waited_through_a_dropped_connection_goes_on_the_fresh_one():
    """Room 5's earlier ask was cancelled, and that cancel was lost with the connection: the ask
    made again waited for the socket meanwhile, so it leaves on the fresh connection and its
    statuses count."""
    c = core()
    c.integrity = False
    _answering(c)
    old = asked(c, 5, now=0.0)
    c.abandon(0.1, 5, old)
    c.clear(0.1, 5, old)
    token, actions = c.receive(0.2, spec(5, slot=6))
    c.refused(0.2, ENCODE, actions)
    assert c.stage(5) == "queued"
    c.connection_dropped(0.3, ENCODE)
    assert c.route_resolved(0.4, KEY0, ENCODE) == []  # the rank is back where it was
    assert SendAsk in [type(a) for a in c.writable(0.5, ENCODE)]
    # The earlier ask may have been read and served before its cancel was lost: with integrity off a Success
    # cannot be told from this ask's, so it fails rather than being taken (a Failed counts as it comes).
    (concluded,) = of(Conclude, c.status(0.6, 5, TransferPoll.Success, 0))
    assert concluded.token == token and concluded.failure.kind is FailureKind.OTHER


def test_an_unsent_cancel_leaves_the_silence_of_those_before_it_counting():
    c = core()
    for room in range(1, 5):
        token = asked(c, room, now=float(room - 1))
        assert of(SendCancel, c.abandon(float(room - 1), room, token))
    token = asked(c, 5, now=4.0)
    (cancel,) = of(SendCancel, c.abandon(4.0, 5, token))
    c.cancel_unsent(4.0, 5, cancel.rank, cancel.token)
    late = asked(c, 6, now=prefill.CANCEL_SILENCE_S)
    assert c.abandon(prefill.CANCEL_SILENCE_S, 6, late) == [], "the first cancel, at 0 s, is still unanswered"


def test_an_unsent_oldest_cancel_moves_the_silence_clock_to_the_next_oldest_unanswered():
    c = core()
    cancels = []
    for room in (1, 2, 3):
        token = asked(c, room, now=float(room))
        cancels += of(SendCancel, c.abandon(float(room), room, token))
    assert [cancel.room for cancel in cancels] == [1, 2, 3]
    c.cancel_unsent(3.0, 1, cancels[0].rank, cancels[0].token)  # the oldest was never sent
    # The silence counts from room 2's cancel, sent at 2 s.
    t = 2.0 + prefill.CANCEL_SILENCE_S
    late = asked(c, 4, now=t - 0.01)
    assert of(SendCancel, c.abandon(t - 0.01, 4, late))
    later = asked(c, 5, now=t)
    assert c.abandon(t, 5, later) == [], "room 2's cancel went unanswered 5 s"


def test_a_cancel_lost_with_its_connection_does_not_start_the_fresh_connections_silence():
    """A cancel unanswered when its connection dropped may never have been read: when a cancel on the
    fresh connection is not sent after all, the silence clock does not go back to the lost one's."""
    c = core()
    first = asked(c, 1, now=0.0)
    of(SendCancel, c.abandon(0.0, 1, first))
    c.clear(0.0, 1, first)
    c.connection_dropped(0.1, ENCODE)
    c.route_resolved(0.1, KEY0, ENCODE)
    second = asked(c, 2, now=0.2)
    (unsent,) = of(SendCancel, c.abandon(0.2, 2, second))
    c.clear(0.2, 2, second)
    c.cancel_unsent(0.2, 2, unsent.rank, unsent.token)
    third = asked(c, 3, now=prefill.CANCEL_SILENCE_S + 1)
    assert of(SendCancel, c.abandon(prefill.CANCEL_SILENCE_S + 1, 3, third)), "no cancel went unanswered here"


def test_cancels_answered_behind_one_never_answered_are_not_kept_for_its_silence_clock():
    """One cancel's answer is lost on a connection that stays up; thousands answered after it do not pile
    up behind it in the address's queue (which only its oldest unanswered cancel matters to)."""
    c = core()
    lost = asked(c, 1, now=0.0)
    c.abandon(0.0, 1, lost)
    c.clear(0.0, 1, lost)
    now = 0.0
    for i in range(5000):
        now += 0.05
        room = 2 + i % 1000
        token = asked(c, room, now)
        assert of(SendCancel, c.abandon(now, room, token))
        c.clear(now, room, token)
        c.cancel_answered(now, room, 0, CONFIRMED)
        if i % 20 == 0:
            c.tick(now)
    assert c.pending_cancels == 1
    assert len(c.cancels._sent_to[ENCODE]._cancels) <= 2 * cancels._MIN_COMPACT


def test_an_encode_rank_restarting_at_new_ports_leaves_no_cancels_behind_at_the_old_ones():
    """Each restart of the encode rank at another port: a room given up there and its cancel confirmed,
    then the connection drops and the rank is found at the next port. What the book kept of each old
    address's cancels (for its silence clock) goes with its connection."""
    c = core()
    c.parallel_resolved(0.0, BOOT, 1, 1)
    now = 0.0
    for port in range(7000, 7200):
        now += 1.0
        addr = (ENCODE[0], port)
        c.route_resolved(now, KEY0, addr)
        token, actions = c.receive(now, spec(1))
        assert of(SendAsk, actions)[0].addr == addr
        assert of(SendCancel, c.abandon(now, 1, token))
        c.clear(now, 1, token)
        assert of(MemorySafe, c.cancel_answered(now, 1, 0, CONFIRMED))
        c.connection_dropped(now, addr)
        c.tick(now)
    assert c.pending_cancels == 0
    assert len(c.cancels._sent_to) <= 1


def test_rooms_given_up_without_a_cancel_are_remembered_only_while_an_earlier_asks_status_may_count():
    """A rank that answers no cancel (a peer without the extension) is sent none: each room given up there is
    remembered, so a Success for the room asked again under its number is not taken for the new ask's
    unverified; past STALE_CANCEL_S that no longer counts, and the room is forgotten as later ones come."""
    c = core()
    c.integrity = False
    first = asked(c, 1, now=0.0)
    assert of(SendCancel, c.abandon(0.0, 1, first))
    c.clear(0.0, 1)
    last = 2 + int(3 * cancels.STALE_CANCEL_S)
    for room in range(2, last + 1):
        now = prefill.CANCEL_SILENCE_S + room
        token = asked(c, room, now=now)
        assert c.abandon(now, room, token) == [], "a silent rank is sent no cancel"
        c.clear(now, room)
    assert len(c._unfenced_asks) <= cancels.STALE_CANCEL_S + 1, "rooms given up long ago are kept until MAX_ROUTES"
    now = prefill.CANCEL_SILENCE_S + last + 1.0
    again = asked(c, last, now=now)
    (concluded,) = of(Conclude, c.status(now, last, TransferPoll.Success, 0))
    assert concluded.token == again and concluded.failure.kind is FailureKind.OTHER
    assert "given up with no cancel" in concluded.failure.detail

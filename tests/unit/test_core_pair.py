"""Whole rooms through EncodeCores and PrefillCores joined in memory (tests/core_pair.py), over random schedules.

Every step is checked as it happens: a room concludes at most once on each side, a
write lands only inside a region its session announced and inside its own room's
destination, never after that room's memory was declared safe (its cancel confirmed),
and a Success on the prefill side means its exact rows landed. After a run the pair
settles (everything delivered, every deadline passed) and each test checks what must
hold then. A failing example prints the run's trace, one line a step.
"""

from __future__ import annotations

import re

import pytest
from core_pair import MAX_SPAN, SLOTS, Pair, Violation, span_of
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from transfer.core.failure import FailureKind
from transfer.status import TransferPoll

ROOMS = (1, 2, 3)
TICKS = (0.05, 0.5, 2.0, 6.0)

# What a step of a random schedule does, weighted by repetition: mostly the network and the writes.
NET, OFFER, RECEIVE, CLEAR_SEND, CLEAR_RECEIVE, TICK, FAULT, KILL, DROP, STOP, LOSE_LATE = range(11)
RELIABLE = [NET] * 6 + [OFFER, OFFER, RECEIVE, RECEIVE, CLEAR_SEND, CLEAR_RECEIVE, TICK]
HOSTILE = RELIABLE + [FAULT, FAULT, KILL]
# Connections that drop with their requests delivered late (or lost), encode ranks stopped and resumed, time
# passing past the cancel answer wait and the deadlines: rooms given up and asked again then.
CHURN = RELIABLE + [DROP, DROP, STOP, LOSE_LATE, TICK, TICK, CLEAR_RECEIVE]

# A step: its low byte picks the kind of step, the rest which one of that kind.
SCHEDULE = st.lists(st.integers(0, 1 << 16), min_size=30, max_size=120)
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run(pair: Pair, schedule, table, *, retries: bool = False, give_up_every: int = 5) -> None:
    """Plays `schedule` on `pair`: each step picks a kind of step from `table`, then which one of that kind.

    A caller clears rooms that concluded; one clear in `give_up_every` may pick an open room (giving it up).
    """
    offered: set[tuple[int, int]] = set()
    stopped_at: dict[int, int] = {}  # encode rank -> the step of the schedule it was stopped at
    received: set[tuple[int, int]] = set()
    for i, step in enumerate(schedule):
        kind, which = table[(step & 0xFF) % len(table)], step >> 8
        if kind == NET:
            moves = pair.moves()
            if moves:
                pair.do(moves[which % len(moves)])
        elif kind == OFFER:
            options = [(e.rank, room) for e in pair.encodes for room in ROOMS if e.alive and room not in e.sends
                       and e.rank not in pair.stopped and (retries or (e.rank, room) not in offered)]
            if options:
                e, room = options[which % len(options)]
                offered.add((e, room))
                pair.do(("offer", (e, room), lambda e=e, room=room: pair.offer(e, room)))
        elif kind == RECEIVE:
            options = [(p.rank, room) for p in pair.prefills for room in ROOMS if p.alive and room not in p.receives
                       and (retries or (p.rank, room) not in received) and p.next_slot < SLOTS]
            if options:
                p, room = options[which % len(options)]
                received.add((p, room))
                pair.do(("receive", (p, room), lambda p=p, room=room: pair.receive(p, room)))
        elif kind == CLEAR_SEND:
            options = [(e.rank, room) for e in pair.encodes if e.rank not in pair.stopped
                       for room, send in sorted(e.sends.items()) if send.concluded or which % give_up_every == 0]
            if options:
                e, room = options[which % len(options)]
                pair.do(("clear", (e, room), lambda e=e, room=room: pair.clear_send(e, room)))
        elif kind == CLEAR_RECEIVE:
            options = [(p.rank, room) for p in pair.prefills if p.alive for room, rec in sorted(p.receives.items())
                       if rec.concluded or which % give_up_every == 0]
            if options:
                p, room = options[which % len(options)]
                pair.do(("clear", (p, room), lambda p=p, room=room: pair.clear_receive(p, room)))
        elif kind == TICK:
            pair.do(("tick", (), lambda dt=TICKS[which % len(TICKS)]: pair.tick(dt)))
        elif kind == FAULT:
            faults = [m for m in pair.moves(faults=True) if m[0] not in ("request", "status", "land", "complete",
                                                                         "lookup", "verify")]
            if faults:
                pair.do(faults[which % len(faults)])
        elif kind == KILL and which % 4 == 0:  # a prefill rank restarts, or one rank of a side dies for good
            options = [("restart", p.rank, pair.restart_prefill) for p in pair.prefills if p.alive]
            if all(p.alive for p in pair.prefills):
                options += [("die", p.rank, pair.kill_prefill) for p in pair.prefills]
            if all(e.alive for e in pair.encodes):
                options += [("die", e.rank, pair.kill_encode) for e in pair.encodes]
            if options:  # none once a side's one rank died for good and the other side already lost one
                what, rank, act = options[(which // 4) % len(options)]
                if act == pair.restart_prefill:
                    received -= {(rank, room) for room in ROOMS}  # the new process receives its rooms again
                pair.do((what, (rank,), lambda act=act, rank=rank: act(rank)))
        elif kind == DROP:
            options = [(p.rank, addr) for p in pair.prefills if p.alive for addr in sorted(p.conns)]
            if options:
                p, addr = options[which % len(options)]
                pair.do(("drop connection", (p, addr), lambda p=p, addr=addr: pair.drop_connection(p, addr)))
        elif kind == STOP:  # an encode rank stops (SIGSTOP) for a while, or one stopped resumes
            stopped = [e for e in sorted(pair.stopped) if i - stopped_at[e] >= 3]
            if stopped:
                e = stopped[which % len(stopped)]
                pair.do(("resume", (e,), lambda e=e: pair.resume_encode(e)))
            else:
                e = which % pair.encode_tp
                if pair.encodes[e].alive and e not in pair.stopped:
                    stopped_at[e] = i
                    pair.do(("stop", (e,), lambda e=e: pair.stop_encode(e)))
        elif kind == LOSE_LATE:  # what a connection let go or dropped still carried is lost after all
            options = [key for key in sorted(pair.requests, key=repr)
                       if pair.prefills[key[0]].conns.get(key[1]) != key[2]]
            if options:
                key = options[which % len(options)]
                pair.do(("lose requests", key, lambda k=key: pair.lose_requests(k)))
    pair.settle()
    pair.check_concluded()


def fanout(pair: Pair) -> int:
    """Prefill ranks per encode rank."""
    return pair.prefill_tp // pair.encode_tp


def block(pair: Pair, encode_rank: int) -> range:
    """The prefill ranks encode rank `encode_rank` serves."""
    return range(encode_rank * fanout(pair), (encode_rank + 1) * fanout(pair))


def check_agreement(pair: Pair) -> None:
    """What both sides must agree on once a run on a reliable network settled (each room sent and received once).

    A send that concluded Success served every receiver: each one concluded Success, unless it
    gave up first (its deadline, or its caller cleared it). A cancel that reached the encode rank
    before its send concluded leaves that send Failed, never Success.
    """
    for send in pair.all_sends:
        status, failure, at = send.concluded[0]
        receivers = [r for r in pair.all_receives if r.room == send.room and r.rank in block(pair, send.rank)]
        if status is TransferPoll.Success:
            for rec in receivers:
                gave_up = rec.cleared and not rec.concluded or \
                    rec.concluded and rec.concluded[0] is not None and rec.concluded[0].kind is FailureKind.DEADLINE
                pair.expect(rec.outcome() == "Success" or gave_up,
                            f"encode {send.rank} concluded room {send.room} Success, but prefill {rec.rank} "
                            f"concluded it {rec.outcome()}")
        cancelled_before = [step for e, room, _, step in pair.cancels_delivered
                            if e == send.rank and room == send.room and step < at]
        if cancelled_before:
            pair.expect(status is TransferPoll.Failed,
                        f"encode {send.rank} concluded room {send.room} {status.name} although a cancel for it "
                        f"arrived at step {cancelled_before[0]}, before it concluded (step {at})")


def check_rows_once(pair: Pair) -> None:
    """Each row of an item is written once in all (each room sent once per encode rank, no duplicates)."""
    for (room, row), times in pair.rows_written.items():
        pair.expect(times == 1, f"room {room} row {row} was written {times} times")
    for room in ROOMS:
        receives = [r for r in pair.all_receives if r.room == room]
        if len(receives) == pair.prefill_tp and all(r.outcome() == "Success" for r in receives):
            written = sorted(row for (r, row) in pair.rows_written if r == room)
            pair.expect(written == list(range(span_of(room))),
                        f"room {room} succeeded on every prefill rank, but rows {written} of "
                        f"{span_of(room)} were written")


# ----------------------------------------------------------------- by hand


def test_one_room_goes_end_to_end_and_its_rows_land():
    pair = Pair()
    pair.offer(0, 5)
    pair.receive(0, 5)
    pair.settle()
    pair.check_concluded()
    [send], [rec] = pair.all_sends, pair.all_receives
    assert send.concluded[0][0] is TransferPoll.Success and rec.outcome() == "Success"
    assert rec.landed == 1 and sorted(pair.rows_written) == [(5, row) for row in range(span_of(5))]


def test_two_encode_ranks_serve_four_prefill_ranks_and_write_each_row_once():
    pair = Pair(encode_tp=2, prefill_tp=4)
    for room in ROOMS:
        for p in range(4):
            pair.receive(p, room)
        for e in range(2):
            pair.offer(e, room)
    pair.settle()
    pair.check_concluded()
    assert {rec.outcome() for rec in pair.all_receives} == {"Success"}
    check_rows_once(pair)
    check_agreement(pair)


def test_a_room_given_up_before_its_write_is_cancelled_and_nothing_lands_in_it():
    pair = Pair()
    pair.receive(0, 1)
    pair.drain("lookup", "request")  # its registration and ask reach the encode rank
    pair.clear_receive(0, 1)
    pair.drain("request")  # the cancel reaches it before the item is offered
    pair.offer(0, 1)
    pair.settle()
    [send], [rec] = pair.all_sends, pair.all_receives
    assert send.concluded[0][1].kind is FailureKind.CANCELLED
    assert rec.landed == 0 and rec.safe_at is not None


def test_a_room_given_up_while_its_write_flies_is_not_declared_safe_when_that_write_fails():
    """The write fails after the cancel found it in flight; over tcp its bytes may still land
    afterwards, so the cancel's last answer must not make the memory safe."""
    pair = Pair()
    pair.receive(0, 1)
    pair.drain("lookup", "request")
    pair.offer(0, 1)  # its write starts
    pair.clear_receive(0, 1)
    pair.drain("request")  # the cancel finds the write in flight: too late
    [flight] = pair.encodes[0].flights[pair.prefills[0].session]
    pair.settle_write(flight, "still in flight after the transfer timeout")
    pair.drain("status")
    [rec] = pair.all_receives
    assert rec.safe_at is None, "a failed write's memory was declared safe"
    pair.land(pair.encodes[0].late.pop())  # its bytes arrive after all: no rule is broken
    pair.settle()
    assert rec.landed == 1 and rec.safe_at is None


def test_a_retry_under_the_same_room_number_is_not_served_by_the_given_up_send():
    """The retry's ask waits for the answer to the first ask's cancel: the first ask's Success, which
    comes before that answer, concludes nothing, and the room's next send serves the retry."""
    pair = Pair()
    pair.receive(0, 1)
    pair.drain("lookup", "request")
    pair.offer(0, 1)
    pair.drain("land", "complete")  # served: its Success is on the way
    pair.clear_receive(0, 1)  # given up before the Success came: a cancel follows the ask
    pair.receive(0, 1)  # the retry waits for the cancel's answer
    pair.drain("status", "verify")
    first, retry = pair.all_receives
    assert retry.outcome() == "open" and retry.landed == 0, "the first ask's Success is not the retry's"
    pair.drain("request", "status")  # the cancel is answered: the first ask's memory is safe, the retry asks
    assert first.safe_at is not None
    pair.drain("request")
    pair.clear_send(0, 1)
    pair.offer(0, 1)
    pair.settle()
    pair.check_concluded()
    assert retry.outcome() == "Success"
    assert [send.concluded[0][0] for send in pair.all_sends] == [TransferPoll.Success, TransferPoll.Success]


def test_a_restarted_prefill_rank_retrying_its_room_is_served_and_its_predecessor_gets_nothing():
    pair = Pair()
    pair.receive(0, 1)
    pair.drain("lookup", "request")  # the first process's ask is parked at the encode rank
    pair.restart_prefill(0)
    pair.receive(0, 1)
    pair.drain("lookup", "request")  # its registration at the same status endpoint supersedes the first
    pair.offer(0, 1)
    pair.settle()
    pair.check_concluded()
    first, retry = pair.all_receives
    assert retry.outcome() == "Success" and retry.landed == 1
    assert first.outcome() == "open" and first.landed == 0
    assert pair.all_sends[0].concluded[0][0] is TransferPoll.Success


def test_a_rank_restarted_while_its_rooms_write_flies_gets_its_shard_and_the_room_succeeds_everywhere():
    pair = Pair(prefill_tp=2)
    for p in range(2):
        pair.receive(p, 3)
    pair.drain("lookup", "request")
    pair.offer(0, 3)  # both shards' writes start
    assert sorted(pair.encodes[0].flights) == sorted(p.session for p in pair.prefills)
    pair.restart_prefill(1)
    pair.receive(1, 3)
    pair.drain("lookup", "request")  # the successor registers and asks before the old write is over
    pair.settle()
    pair.check_concluded()
    first0, first1, retry = pair.all_receives
    assert (first0.outcome(), retry.outcome(), first1.outcome()) == ("Success", "Success", "open")
    assert pair.all_sends[0].concluded[0][0] is TransferPoll.Success
    assert retry.landed == 1


def test_an_ask_past_its_announced_region_fails_its_room_and_nothing_is_written():
    pair = Pair()
    pair.receive(0, 1)
    pair.drain("lookup", "request")  # the session announced its region
    pair.ask_outside(0, 2)
    pair.offer(0, 2)
    pair.settle()
    [send] = [send for send in pair.all_sends if send.room == 2]
    assert send.concluded[0][1].kind is FailureKind.REGION
    assert not any(room == 2 for room, _ in pair.rows_written)


def test_the_pair_catches_a_write_outside_the_room_destination():
    """The checks themselves can fail: a write the encode core never asked for is refused by the pair."""
    from core_pair import Flight

    from transfer.core.encode import StartWrite

    pair = Pair()
    pair.receive(0, 1)
    pair.drain("lookup", "request")
    rec = pair.all_receives[0]
    stray = StartWrite(99, 1, pair.prefills[0].session, (0x7000_0000 + 1 * 6 * 8,), (rec.ptr + 8,), (8,), 8)
    with pytest.raises(Violation, match="outside that room's destination"):
        pair.land(Flight(0, stray, ()))


# ------------------------------------------------------ random schedules


@FAST
@given(SCHEDULE)
def test_random_schedules_on_a_reliable_network_keep_every_rule_and_both_sides_agree(schedule):
    pair = Pair(encode_tp=1, prefill_tp=2)
    run(pair, schedule, RELIABLE)
    check_agreement(pair)


@FAST
@given(SCHEDULE)
def test_encode_tp_2_writes_each_row_once_and_both_sides_agree(schedule):
    pair = Pair(encode_tp=2, prefill_tp=4)
    run(pair, schedule, RELIABLE)
    check_rows_once(pair)
    check_agreement(pair)


@FAST
@given(SCHEDULE)
def test_rooms_given_up_at_any_step_get_no_write_once_their_cancel_is_confirmed(schedule):
    pair = Pair(deadline_s=3.0)
    run(pair, schedule, RELIABLE + [CLEAR_RECEIVE] * 3, give_up_every=1)
    check_agreement(pair)


#: A prefill rank clears a room it asked for again while a Success meant for the room's
#: earlier ask is being verified; the encode rank then writes the new ask's shard.
STALE_SUCCESS_WHILE_VERIFYING = [138, 16318, 0, 0, 0, 0, 0, 0, 0, 0, 741, 0, 21, 32, 0, 0, 0, 190, 0, 10, 128, 0,
                                 136, 177, 0, 0, 0, 0, 0, 306, 60, 141]


@FAST
@given(SCHEDULE)
@example(STALE_SUCCESS_WHILE_VERIFYING)
def test_rooms_sent_and_received_again_under_their_number_keep_every_rule(schedule):
    pair = Pair(encode_tp=1, prefill_tp=2)
    run(pair, schedule, RELIABLE, retries=True)


@FAST
@given(SCHEDULE)
def test_lost_and_repeated_messages_failed_writes_and_dying_ranks_break_no_rule(schedule):
    pair = Pair(encode_tp=2, prefill_tp=4)
    run(pair, schedule, HOSTILE)


@FAST
@given(SCHEDULE)
def test_writes_queued_behind_one_slot_through_faults_break_no_rule_and_are_counted_while_they_may_start(schedule):
    """With one write in flight at a time, writes queue behind it while their rooms fail, are cleared or their
    receivers restart: every step checks that the queue's count (the queue_depth gauge) holds exactly those that
    may still start (Pair.carry_encode)."""
    pair = Pair(encode_tp=2, prefill_tp=4, depth=1)
    run(pair, schedule, HOSTILE + [CLEAR_RECEIVE] * 2)


#: A room's ask is queued on a connection that drops while its encode rank is stopped; the caller gives the
#: room up (no cancel: nothing was asked on the fresh connection) and receives it again; the resumed rank
#: reads the old connection's ask first and serves it: its Success is the earlier ask's, not the new one's.
EARLIER_ASK_READ_LATE = [0] * 18 + [26, 175, 47448, 0, 0, 33, 155, 282, 19, 35, 5128, 0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SCHEDULE, st.booleans())
@example(EARLIER_ASK_READ_LATE, False)
@example(EARLIER_ASK_READ_LATE, True)
def test_dropped_connections_stopped_encode_ranks_and_rooms_asked_again_keep_every_rule(schedule, integrity):
    """Requests of a dropped connection arrive late (after the fresh connection's) or never, an encode rank
    stops while deadlines and the cancel answer wait pass, rooms are given up and asked again under their
    number: no Success is taken over bytes that did not land in that ask's memory, integrity on or off."""
    pair = Pair(deadline_s=2.0, integrity=integrity, late_requests=True)
    run(pair, schedule, CHURN, retries=True)


#: At tp 1x1: both sides offer and ask for room 1, the prefill rank dies for good, then the encode rank, then a
#: third KILL step finds no rank to kill or restart; the schedule goes on offering, asking, ticking.
EVERY_RANK_KILLED = [6, 8, 0, 0, 4 << 8 | 15, 15, 15, 6, 8, 0, 12, 0]


def test_a_kill_step_with_no_rank_left_to_kill_does_nothing_and_the_schedule_goes_on():
    pair = Pair()
    run(pair, EVERY_RANK_KILLED, HOSTILE)
    said = [re.sub(r"^\s*\d+ t=\s*[\d.]+  ", "", line) for line in pair.log]
    assert said[:said.index("settle: everything pending is delivered, then time passes")] == [
        "encode 0: offer room 1 (2 rows)", "prefill 0: receive room 1 token 1 rows 0+2 at 0x10000000",
        "prefill 0: look-up: encode tp 1, dp 1", "prefill 0: look-up: encode rank 0 at ('10.0.1.0', 7000)",
        "prefill 0: dies", "encode 0: dies", "tick +0.05s"]


def test_spans_cover_empty_shards():
    """Rooms span 1..MAX_SPAN rows, so with four prefill ranks some shards are empty."""
    assert min(span_of(room) for room in ROOMS) < 4 <= MAX_SPAN


def _lanes_on_and_off(schedule, table, **pair_options) -> Pair:
    """Plays `schedule` with integrity checks off twice, statuses settled in lanes and all through `status`:
    every step must go the same way. Returns the run with lanes."""
    runs = []
    for lanes in (True, False):
        pair = Pair(integrity=False, lanes=lanes, **pair_options)
        run(pair, schedule, table, retries=True)
        runs.append(pair)
    with_lanes, without = runs
    assert with_lanes.log == without.log, with_lanes.trace()
    assert without.settled_in_lanes == 0
    return with_lanes


@FAST
@given(SCHEDULE)
def test_lanes_settle_successes_as_the_status_rules_would_on_a_reliable_network(schedule):
    _lanes_on_and_off(schedule, RELIABLE, encode_tp=2, prefill_tp=4)


#: A Success delivered twice, its room concluded, cleared and received again under its number in between:
#: with integrity checks off nothing tells the repeat from the new ask's Success, and this network repeats a
#: Success only with integrity on (tests/core_pair.py, Pair.moves).
SUCCESS_REPEATED_TO_A_REUSED_NUMBER = [8, 0, 0, 0, 0, 1048, 1528, 0, 0, 0, 0, 0, 0, 0, 0, 424, 0, 11, 566, 0, 0, 0,
                                       0, 0, 0, 0, 8, 0, 8, 8, 315, 0, 3517, 347, 648]


@FAST
@given(SCHEDULE)
@example(SUCCESS_REPEATED_TO_A_REUSED_NUMBER)
def test_lanes_settle_successes_as_the_status_rules_would_with_lost_messages_and_dying_ranks(schedule):
    _lanes_on_and_off(schedule, HOSTILE, encode_tp=2, prefill_tp=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SCHEDULE)
@example(EARLIER_ASK_READ_LATE)
def test_lanes_settle_successes_as_the_status_rules_would_with_dropped_connections_and_rooms_asked_again(schedule):
    _lanes_on_and_off(schedule, CHURN, deadline_s=2.0, late_requests=True)


def test_a_room_asked_in_the_plain_case_is_settled_in_its_lane():
    """The comparisons above can fail only if lanes are used: a plain room's Success is settled in one."""
    pair = _lanes_on_and_off([6, 8] + [0] * 20, RELIABLE)
    assert pair.settled_in_lanes >= 1
    assert all(not p.core.lanes for p in pair.prefills)


def _block_whose_second_rank_fails_room_2_unasked(offer_first: bool) -> Pair:
    """Prefill tp 2 over encode tp 1 (fanout 2): room 1 goes through, then prefill rank 1's bootstrap server
    is not asked for a while (a look-up of it timed out after its connection dropped) and its room 2 fails
    before any ask, while rank 0 asks for room 2 and the encode rank is sent its item (before or after)."""
    pair = Pair(encode_tp=1, prefill_tp=2, deadline_s=60.0, fanout_timeout_s=120.0)
    for p in (0, 1):
        pair.receive(p, 1)
    pair.offer(0, 1)
    pair.drain("lookup", "request", "land", "complete", "status", "verify")
    assert [rec.outcome() for rec in pair.all_receives] == ["Success", "Success"]
    for p in (0, 1):
        pair.clear_receive(p, 1)
    pair.clear_send(0, 1)
    rank1 = pair.prefills[1]
    addr = pair.encodes[0].addr
    pair.drop_connection(1, addr)  # its route is looked up again by the next room
    rank1.core.lookup_failed(pair.now, "10.0.0.1:8998", None, "timed out", 2.0)  # the server is not asked for a while
    if offer_first:
        pair.offer(0, 2)
    pair.receive(0, 2)
    pair.receive(1, 2)
    if not offer_first:
        pair.tick(0.5)
        pair.drain("request")
        pair.offer(0, 2)  # the item waits a moment for that rank's ask, in case it asks again at once
        pair.tick(0.2)
    pair.drain("lookup", "request", "land", "complete", "status", "verify")
    return pair


@pytest.mark.parametrize("offer_first", [True, False])
def test_a_rank_that_fails_a_room_before_asking_fails_it_at_once_for_the_rest_of_its_block(offer_first):
    pair = _block_whose_second_rank_fails_room_2_unasked(offer_first)
    rank0, rank1 = (next(rec for rec in pair.all_receives if rec.room == 2 and rec.rank == p) for p in (0, 1))
    assert rank1.outcome() == "Failed(bootstrap)"
    # Rank 0 hears of it from the encode rank at once, not at its deadline; the item is not held for the fanout.
    assert rank0.outcome() == "Failed(peer_failed)", pair.trace()
    [send] = [send for send in pair.all_sends if send.room == 2]
    assert send.concluded[0][1].kind is FailureKind.CANCELLED
    assert "receiver 10.0.2.1:17001" in send.concluded[0][1].detail
    assert pair.now < 1.0
    pair.settle()
    pair.check_concluded()

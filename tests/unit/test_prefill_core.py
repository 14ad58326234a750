"""The prefill side's room rules (transfer.core.prefill.PrefillCore), with a fake clock."""

from __future__ import annotations

import dataclasses
import heapq
import math

import pytest
from fakes import Region, Regions
from prefill_rooms import BOOT, ENCODE, KEY0, MAIN, core, routed, spec

from transfer.core.failure import Failure, FailureKind
from transfer.core.prefill import (
    CANCEL_SILENCE_S,
    ENCODE_FAILED,
    QUEUED_LOOKUP_S,
    Advance,
    Announce,
    Conclude,
    Disconnect,
    LookUpParallel,
    LookUpRoute,
    Overturn,
    PrefillCore,
    SendAsk,
    SendCancel,
    Verify,
    Warn,
    checksum_failed_detail,
)
from transfer.errors import ConfigError
from transfer.frames import CancelAnswer, TransferInfo, parse_registration
from transfer.status import TransferPoll


def kinds(actions) -> list[type]:
    return [type(a) for a in actions]


def concluded(actions) -> dict[int, object]:
    return {a.room: a.failure for a in actions if isinstance(a, Conclude)}


# --------------------------------------------------------------- route look-up


def test_a_first_room_looks_up_sizes_then_route_then_announces_and_asks():
    c = core()
    token, actions = c.receive(0.0, spec(1))
    assert actions == [LookUpParallel(BOOT)] and c.stage(1) == "lookup"
    assert c.parallel_resolved(0.1, BOOT, 1, 1) == [LookUpRoute(KEY0)]
    announce, ask = c.route_resolved(0.2, KEY0, ENCODE)
    assert isinstance(announce, Announce) and announce.addr == ENCODE
    assert parse_registration(announce.frames).embedding_len == MAIN.embedding.nbytes
    assert isinstance(ask, SendAsk) and ask.token == token and ask.addr == ENCODE
    assert ask.info == TransferInfo(1, "10.0.0.3", 5555, "10.0.0.3:1234", MAIN.embedding.addr, 0, 4, 8,
                                    "torch.float16", False, 1, 0, 4)
    assert c.stage(1) == "asked"


def test_an_ask_with_deepstack_carries_the_receivers_deepstack_row_bytes_as_part_13():
    c = core()
    routed(c)
    deep = Regions(MAIN.embedding, Region(0x900000, 4096))
    announce, ask = c.receive(0.0, spec(1, slot=1, regions=deep, deepstack=True))[1]
    assert isinstance(announce, Announce) and isinstance(ask, SendAsk)
    assert ask.info == TransferInfo(1, "10.0.0.3", 5555, "10.0.0.3:1234", MAIN.embedding.addr + 64, 0x900000 + 32,
                                    4, 8, "torch.float16", True, 1, 0, 4, deepstack_row_bytes=8)
    frames = ask.info.to_frames()
    assert len(frames) == 14 and frames[13] == b"8" and frames[9] == b"1"
    # Without deepstack the ask is the SPEC's 13 parts, whatever the spec says of a width.
    [plain] = c.receive(0.0, dataclasses.replace(spec(2, slot=2), deepstack_row_bytes=8))[1]
    assert plain.info.deepstack_row_bytes is None and len(plain.info.to_frames()) == 13
    # A width nothing tells (an empty shard in raw memory) is not sent.
    [unknown] = c.receive(0.0, dataclasses.replace(spec(3, slot=3, regions=deep, deepstack=True),
                                                   deepstack_row_bytes=None))[1]
    assert unknown.info.has_deepstack and unknown.info.deepstack_row_bytes is None


def test_rooms_waiting_on_one_look_up_share_it():
    c = core()
    assert c.receive(0.0, spec(1))[1] == [LookUpParallel(BOOT)]
    assert c.receive(0.0, spec(2, slot=1))[1] == []
    assert c.parallel_resolved(0.1, BOOT, 1, 1) == [LookUpRoute(KEY0)]
    actions = c.route_resolved(0.2, KEY0, ENCODE)
    assert kinds(actions) == [Announce, SendAsk, SendAsk], "the region is announced once"
    assert [a.room for a in actions if isinstance(a, SendAsk)] == [1, 2]


def test_a_cached_route_and_region_ask_at_once():
    c = core()
    routed(c)
    assert kinds(c.receive(1.0, spec(1, slot=2))[1]) == [SendAsk]


def test_routes_are_keyed_by_dp_group_and_encode_rank():
    c = core(engine_rank=3, tp_size=8, dp_size=1)
    c.receive(0.0, spec(5))
    # local tp 8 over encode tp 4: fanout 2, this rank's encode rank is 3 // 2 = 1; room 5 of dp 2 is group 1.
    assert c.parallel_resolved(0.0, BOOT, 4, 2) == [LookUpRoute((BOOT, 1, 1))]
    ask = c.route_resolved(0.0, (BOOT, 1, 1), ENCODE)[-1]
    assert ask.info.fanout == 2


def test_a_rank_pairing_with_a_tp_rank_no_dp_group_has_fails_its_rooms_without_a_look_up():
    # Encode world 2 in dp 2 has one rank a group; prefill rank 1 of tp 2 pairs with tp rank 1.
    c = core(engine_rank=1, tp_size=2, dp_size=1)
    c.receive(0.0, spec(5))
    (conclude,) = c.parallel_resolved(0.0, BOOT, 2, 2)
    assert conclude.failure == Failure(FailureKind.GEOMETRY, "prefill rank 1 pairs with encode tp rank 1 (local tp 2 "
                                       "over encode tp 2), but each of the encode side's 2 dp groups has 1 rank(s)")
    _, actions = c.receive(0.1, spec(6, slot=1))
    assert [type(a) for a in actions] == [Conclude] and actions[0].failure.kind is FailureKind.GEOMETRY


def test_with_encode_dp_a_status_carries_the_encode_ranks_engine_rank_and_concludes_the_room():
    # Encode world 4 in dp 2: the server files engine rank e under group e // 2, tp rank e % 2, and e is
    # what its statuses (and cancel answers) carry. Prefill rank 1 of tp 4 pairs with tp rank 1; room 7
    # goes to group 1, whose tp rank 1 is engine rank 3.
    c = core(engine_rank=1, tp_size=4, dp_size=1)
    c.receive(0.0, spec(7))
    assert c.parallel_resolved(0.0, BOOT, 4, 2) == [LookUpRoute((BOOT, 1, 1))]
    assert isinstance(c.route_resolved(0.0, (BOOT, 1, 1), ENCODE)[-1], SendAsk)
    (warn,) = c.status(0.1, 7, TransferPoll.Success, 1)
    assert warn.message == "room 7: status from encode rank 1, expected 3; ignored"
    (conclude,) = c.status(0.2, 7, TransferPoll.Success, 3)
    assert isinstance(conclude, Conclude) and conclude.room == 7 and conclude.failure is None
    # Group 0's tp rank 1 is engine rank 1.
    c.receive(0.3, spec(8, slot=1))
    assert isinstance(c.route_resolved(0.3, (BOOT, 0, 1), ENCODE)[-1], SendAsk)
    (conclude,) = c.status(0.4, 8, TransferPoll.Success, 1)
    assert isinstance(conclude, Conclude) and conclude.room == 8


def test_a_prefill_tp_that_is_not_a_multiple_of_the_encode_tp_fails_the_room():
    c = core(engine_rank=0, tp_size=3)
    c.receive(0.0, spec(1))
    (conclude,) = c.parallel_resolved(0.0, BOOT, 2, 1)
    assert conclude.failure.kind is FailureKind.GEOMETRY
    assert conclude.failure.detail == "prefill local tp 3 is not a multiple of encode tp 2"


@pytest.mark.parametrize("engine_rank, encode_rank", [(0, 0), (1, 0), (2, 1), (3, 1), (4, 0), (5, 0), (6, 1), (7, 1)])
def test_with_prefill_dp_a_rank_pairs_within_its_own_dp_group(engine_rank, encode_rank):
    # SPEC.md 5, prefill tp P=8 in Dp=2 groups, encode tp E=2 in D=1: local_tp = P // Dp = 4,
    # fanout = local_tp // E = 2, encode_rank = (r % local_tp) // fanout, target_dp_group = room % D = 0.
    c = core(engine_rank=engine_rank, tp_size=8, dp_size=2)
    c.receive(0.0, spec(5))
    assert c.parallel_resolved(0.0, BOOT, 2, 1) == [LookUpRoute((BOOT, 0, encode_rank))]
    ask = c.route_resolved(0.0, (BOOT, 0, encode_rank), ENCODE)[-1]
    assert isinstance(ask, SendAsk) and ask.info.fanout == 2
    (conclude,) = c.status(0.1, 5, TransferPoll.Success, encode_rank)
    assert isinstance(conclude, Conclude) and conclude.failure is None


@pytest.mark.parametrize("engine_rank", [1, 5])
@pytest.mark.parametrize("room", [4, 5])
def test_with_prefill_dp_and_encode_dp_the_group_is_the_room_modulo_the_encode_dp(engine_rank, room):
    # P=8 in Dp=2 (local_tp 4), E=2 in D=2: fanout 2, encode_rank (r % 4) // 2 = 0, target_dp_group = room % 2.
    c = core(engine_rank=engine_rank, tp_size=8, dp_size=2)
    c.receive(0.0, spec(room))
    assert c.parallel_resolved(0.0, BOOT, 2, 2) == [LookUpRoute((BOOT, room % 2, 0))]


def test_a_failed_look_up_fails_every_room_behind_it_as_bootstrap():
    c = core()
    c.receive(0.0, spec(1))
    c.receive(0.0, spec(2, slot=1))
    actions = c.lookup_failed(0.1, BOOT, None, "unreachable: connection refused", took_s=0.01)
    failures = concluded(actions)
    assert set(failures) == {1, 2}
    assert all(f.kind is FailureKind.BOOTSTRAP for f in failures.values())
    assert failures[1].detail == f"bootstrap {BOOT}: unreachable: connection refused"
    # A quick refusal does not hold the next room back.
    assert c.receive(0.2, spec(3, slot=2))[1] == [LookUpParallel(BOOT)]


def test_after_a_slow_failure_rooms_fail_at_once_until_the_pause_is_over():
    c = core()
    c.receive(0.0, spec(1))
    c.lookup_failed(2.0, BOOT, None, "unreachable: timed out", took_s=2.0)
    _, actions = c.receive(2.5, spec(2, slot=1))
    failure = concluded(actions)[2]
    assert failure.kind is FailureKind.BOOTSTRAP and "not asked again for 1s" in failure.detail
    assert c.receive(3.0, spec(3, slot=2))[1] == [LookUpParallel(BOOT)]


def test_failures_of_a_paused_bootstrap_server_say_when_its_pause_ends():
    c = core()
    c.receive(0.0, spec(1))
    c.receive(0.0, spec(2, slot=1))
    # The slow look-up's own rooms, and a room asked for during the pause it opened: retry_at is its end.
    failures = concluded(c.lookup_failed(2.0, BOOT, None, "unreachable: timed out", took_s=2.0))
    assert {room: f.retry_at for room, f in failures.items()} == {1: 3.0, 2: 3.0}
    assert concluded(c.receive(2.5, spec(3, slot=2))[1])[3].retry_at == 3.0
    # A quick failure pauses nothing: its rooms carry no retry_at.
    c.receive(3.0, spec(4, slot=3))
    quick = concluded(c.lookup_failed(3.1, BOOT, None, "unreachable: connection refused", took_s=0.01))
    assert quick[4].kind is FailureKind.BOOTSTRAP and quick[4].retry_at is None


def test_a_look_up_answered_for_a_cleared_room_asks_nothing():
    c = core()
    c.receive(0.0, spec(1))
    assert c.clear(0.1, 1)
    assert c.parallel_resolved(0.2, BOOT, 1, 1) == []
    assert c.route(KEY0) is None


# ------------------------------------------------------------------ deadlines


def test_a_room_without_a_status_fails_at_its_deadline_and_not_before():
    c = core(deadline_s=10.0)
    routed(c)
    c.receive(1.0, spec(1, slot=1))
    assert c.next_wakeup() == 11.0
    assert c.tick(10.9) == []
    actions = c.tick(11.0)
    failure = concluded(actions)[1]
    assert failure.kind is FailureKind.DEADLINE
    assert failure.detail.startswith(f"no status from encode rank 0 at {ENCODE[0]}:{ENCODE[1]} within 10s for room 1: "
                                     f"nothing came from that rank since the room was asked: is it alive and serving, "
                                     f"and did the encode side call send() for room 1?"), failure.detail
    assert Disconnect(ENCODE) in actions, "the rank went silent on it: a fresh look-up and socket next time"
    assert c.next_wakeup() is None


def test_a_silent_rank_is_looked_up_afresh_and_told_its_regions_again():
    c = core(deadline_s=10.0)
    routed(c)
    c.receive(1.0, spec(1, slot=1))
    c.tick(11.0)
    assert c.receive(12.0, spec(2, slot=2))[1] == [LookUpParallel(BOOT)]
    c.parallel_resolved(12.0, BOOT, 1, 1)
    assert kinds(c.route_resolved(12.0, KEY0, ENCODE)) == [Announce, SendAsk]


def test_a_room_asked_late_does_not_tear_the_socket_down():
    c = core(deadline_s=10.0)
    routed(c, now=0.0)
    c.receive(0.0, spec(1, slot=1))
    actions = c.tick(10.0)
    assert Disconnect(ENCODE) in actions
    # A fresh route, then a room whose own deadline passes but which waited less than half of it.
    c.receive(10.0, spec(2, slot=2))
    c.parallel_resolved(10.0, BOOT, 1, 1)
    c.route_resolved(18.0, KEY0, ENCODE)  # slow look-up: asked 8 s into a 10 s deadline
    actions = c.tick(20.0)
    assert concluded(actions)[2].kind is FailureKind.DEADLINE
    assert not any(isinstance(a, Disconnect) for a in actions)


@pytest.mark.parametrize("answered_at", [0.5, 1.5])
def test_a_room_that_expires_on_a_rank_still_answering_others_leaves_its_socket_and_their_cancels(answered_at):
    """An item never sent fails its room at the deadline; the encode rank answered another room after
    that room was asked (early in its deadline, or within the last half of it), so it is not silent:
    the socket stays, and a room given up on later is still cancelled there (its memory safe once the
    cancel is confirmed)."""
    c = core(deadline_s=2.0)
    routed(c, now=0.0)
    c.receive(0.0, spec(1, slot=1))  # its item never comes
    token3, _ = c.receive(0.2, spec(3, slot=3))  # nor this one's, given up on below
    c.receive(0.4, spec(2, slot=2))
    assert kinds(c.status(answered_at, 2, TransferPoll.Success, 0)) == [Conclude]
    actions = c.tick(2.0)
    assert concluded(actions)[1].kind is FailureKind.DEADLINE
    assert not any(isinstance(a, Disconnect) for a in actions) and c.connected(ENCODE)
    detail = concluded(actions)[1].detail
    if answered_at >= 1.0:  # answered within the last half of room 1's deadline: the rank runs, its item never came
        assert "so it runs but was not given room 1's item: did the encode side call send() for room 1" in detail
    else:  # answered after room 1 was asked, and nothing for half a deadline since: it may have stopped
        assert "that rank answered other rooms after this one was asked, and nothing in the 1.5s since its last " \
               "answer: it may have stopped or wedged since" in detail, detail
    assert kinds(c.abandon(2.1, 3, token3)) == [SendCancel]
    # Silent since: the next room to expire, asked after the last answer, tears it down.
    c.clear(2.1, 3, token3)
    c.receive(2.2, spec(4, slot=4))
    assert Disconnect(ENCODE) in c.tick(4.2)


def test_a_rank_that_answered_just_after_a_room_was_asked_and_then_stopped_is_not_said_to_run():
    """An encode rank stopped (SIGSTOP, wedged) mid-run: the statuses of rooms already written reach this rank just
    after the next room was asked, then nothing. That room's deadline names the quiet since the last answer and a
    stopped rank first, not `it runs but was not given the item`, which sends the operator to the router."""
    c = core(deadline_s=25.0)
    routed(c, now=0.0)
    c.receive(10.0, spec(1, slot=1))
    c.receive(10.0, spec(2, slot=2))
    c.status(10.004, 1, TransferPoll.Success, 0)  # written before the stop; room 2 is never answered
    failure = concluded(c.tick(35.0))[2]
    assert failure.kind is FailureKind.DEADLINE
    assert failure.detail == (
        f"no status from encode rank 0 at {ENCODE[0]}:{ENCODE[1]} within 25s for room 2: that rank answered other "
        f"rooms after this one was asked, and nothing in the 25s since its last answer: it may have stopped or "
        f"wedged since (a stopped process, a debugger, a hung device), or runs and was not given room 2's item: is "
        f"it alive and serving, and did the encode side call send() for room 2, on that rank, under that number?")


@pytest.mark.parametrize("deadline", [0.3, 0.7, 2.2, 9.9, 60.0])
@pytest.mark.parametrize("t0", [0.0, 128279.44, 402137.54987701763])
def test_a_rank_that_never_answered_loses_its_socket_at_a_rooms_deadline_whatever_the_clock(deadline, t0):
    c = core(deadline_s=deadline)
    routed(c, now=t0)
    c.receive(t0, spec(1, slot=1))
    assert Disconnect(ENCODE) in c.tick(t0 + deadline)


def test_an_answer_on_a_lost_connection_does_not_vouch_for_the_fresh_one():
    c = core(deadline_s=10.0)
    routed(c, now=0.0)
    c.receive(0.0, spec(2, slot=2))  # asked on the first connection
    _, actions = c.receive(0.0, spec(1, slot=1))
    c.refused(0.0, ENCODE, actions)  # the socket does not take room 1's ask: it waits
    assert kinds(c.status(6.0, 2, TransferPoll.Success, 0)) == [Conclude]
    c.connection_dropped(7.0, ENCODE)
    c.route_resolved(7.1, KEY0, ENCODE)  # the rank is still filed there
    assert SendAsk in kinds(c.writable(8.0, ENCODE))  # room 1 goes out on the fresh connection
    assert Disconnect(ENCODE) in c.tick(10.0), "the fresh connection answered nothing"


def test_a_room_of_a_fanout_says_its_encode_rank_holds_the_item_until_every_rank_asked():
    c = core(tp_size=2, deadline_s=10.0)
    c.receive(0.0, spec(1))
    c.parallel_resolved(0.0, BOOT, 1, 1)
    c.route_resolved(0.0, KEY0, ENCODE)
    detail = concluded(c.tick(10.0))[1].detail
    assert "holds the item until all 2 prefill ranks of its fanout asked for it" in detail, detail


def test_a_room_whose_look_up_never_answered_fails_at_its_deadline():
    c = core(deadline_s=5.0)
    c.receive(0.0, spec(1))
    failure = concluded(c.tick(5.0))[1]
    assert failure.kind is FailureKind.DEADLINE and f"bootstrap {BOOT}" in failure.detail


def test_concluded_rooms_leave_the_deadline_heap():
    c = core(deadline_s=600.0)
    routed(c)
    for room in range(5000):
        c.receive(1.0, spec(room, slot=room % 100))
        c.status(1.0, room, TransferPoll.Failed, 0)
        c.clear(1.0, room)
        c.tick(1.0)
    assert c.deadline_entries() <= 1024 + 2 and len(c) == 0
    assert c.next_wakeup() is None


def test_concluded_rooms_behind_an_open_rooms_earlier_deadline_do_not_pile_up_in_the_heap():
    """One room left open (its encode rank never answers) keeps its deadline at the heap's top, so entries of
    rooms concluded since never reach the top to be popped: without compacting, a busy receiver's heap would
    hold every room of the last deadline_s, and tick() would sift through them all."""
    c = core(deadline_s=600.0)
    routed(c)
    stuck, _ = c.receive(0.0, spec(0))
    for room in range(1, 5000):
        c.receive(1.0, spec(room, slot=room % 100))
        c.status(1.0, room, TransferPoll.Failed, 0)
        c.clear(1.0, room)
        c.tick(1.0)
    assert c.deadline_entries() <= 2 * 1 + 1024 + 1 and len(c) == 1
    assert c.next_wakeup() == 600.0
    assert concluded(c.tick(600.0))[0].kind is FailureKind.DEADLINE, "the open room's entry is kept"


def test_a_room_being_verified_is_left_to_its_verification():
    c = core(deadline_s=10.0)
    routed(c)
    token, _ = c.receive(0.0, spec(1, slot=1))
    (verify,) = c.status(1.0, 1, TransferPoll.Success, 0, (123,))
    assert c.tick(20.0) == []
    assert concluded(c.checksum_verified(20.0, 1, token)) == {1: None}


# --------------------------------------------------------------------- statuses


def test_a_status_from_the_wrong_encode_rank_is_ignored_with_a_warning():
    c = core()
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    (warn,) = c.status(0.1, 1, TransferPoll.Success, 3)
    assert isinstance(warn, Warn) and warn.message == "room 1: status from encode rank 3, expected 0; ignored"
    assert c.status(0.1, 1, TransferPoll.Failed, 4)[0].key == "status from the wrong encode rank"
    assert c.stage(1) == "asked"


def test_a_status_for_an_unknown_room_is_ignored():
    c = core()
    assert c.status(0.0, 77, TransferPoll.Success, 0) == []


def test_encode_failed_concludes_as_peer_failed_and_stays_failed():
    c = core()
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    failure = concluded(c.status(0.1, 1, TransferPoll.Failed, 0))[1]
    assert failure.kind is FailureKind.PEER_FAILED
    assert failure.detail == f"{ENCODE_FAILED} (encode rank 0 at {ENCODE[0]}:{ENCODE[1]})"
    assert c.status(0.2, 1, TransferPoll.Success, 0) == [], "Failed is sticky"
    assert c.tick(100.0) == []


def test_intermediate_statuses_advance_the_room():
    c = core()
    routed(c)
    token, _ = c.receive(0.0, spec(1, slot=1))
    assert c.status(0.1, 1, TransferPoll.Transferring, 0) == [Advance(1, token, TransferPoll.Transferring)]


# --------------------------------------------------------------------- checksums


def test_success_with_checksums_is_verified_before_it_counts():
    c = core()
    routed(c)
    token, _ = c.receive(0.0, spec(1, slot=1, regions=Regions(MAIN.embedding, Region(0x900000, 4096)),
                                     deepstack=True))
    (verify,) = c.status(0.1, 1, TransferPoll.Success, 0, (11, 22))
    assert isinstance(verify, Verify) and verify.token == token
    assert [(what, addr, n, expected) for what, _, addr, n, expected in verify.checks] == [
        ("embedding", MAIN.embedding.addr + 64, 64, 11), ("deepstack", 0x900000 + 32, 32, 22)]
    assert c.status(0.2, 1, TransferPoll.Success, 0, (11, 22)) == [], "a Success during verification changes nothing"
    failure = concluded(c.checksum_mismatched(0.3, 1, token, "deepstack", 22, 23))[1]
    assert failure.kind is FailureKind.CHECKSUM
    assert failure.detail == (f"checksum mismatch: room 1, prefill rank 0, deepstack from encode rank 0 at "
                              f"{ENCODE[0]}:{ENCODE[1]}: sent 22, landed 23")


def test_a_failed_during_verification_concludes_the_room_failed_and_its_checksum_then_changes_nothing():
    c = core()
    routed(c)
    token, _ = c.receive(0.0, spec(1, slot=1))
    c.status(0.1, 1, TransferPoll.Success, 0, (11,))
    failure = concluded(c.status(0.2, 1, TransferPoll.Failed, 0, reason=("write", "write to rank 1 failed")))[1]
    assert failure.kind is FailureKind.PEER_FAILED and failure.detail.endswith("write: write to rank 1 failed")
    assert c.checksum_verified(0.3, 1, token) == []


def test_a_failed_after_success_overturns_it_once_and_only_from_the_paired_encode_rank():
    """SPEC.md section 3: Failed overrides any state. Another receiver's write failed after this
    rank's landed (section 6 tells every receiver): this rank's rows are no use to the item."""
    c = core(integrity=False)
    routed(c)
    token, _ = c.receive(0.0, spec(1, slot=1))
    assert concluded(c.status(0.1, 1, TransferPoll.Success, 0)) == {1: None}
    assert kinds(c.status(0.2, 1, TransferPoll.Failed, 3)) == [Warn], "another encode rank's is ignored"
    (overturn,) = c.status(0.3, 1, TransferPoll.Failed, 0)
    assert isinstance(overturn, Overturn) and (overturn.room, overturn.token) == (1, token)
    assert overturn.failure.kind is FailureKind.PEER_FAILED and overturn.failure.detail.endswith("(after its Success)")
    assert c.status(0.4, 1, TransferPoll.Failed, 0) == [], "once"
    assert c.abandon(0.5, 1, token) == [], "its write was over, as its Success said: nothing to cancel"


def test_a_room_concluded_failed_is_not_moved_by_a_later_status():
    c = core()
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    c.status(0.1, 1, TransferPoll.Failed, 0)
    assert c.status(0.2, 1, TransferPoll.Success, 0, (11,)) == [] and c.status(0.3, 1, TransferPoll.Failed, 0) == []


def test_success_without_checksums_or_integrity_concludes_at_once():
    c = core()
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    assert concluded(c.status(0.1, 1, TransferPoll.Success, 0, ())) == {1: None}
    off = core(integrity=False)
    routed(off)
    off.receive(0.0, spec(1, slot=1))
    assert concluded(off.status(0.1, 1, TransferPoll.Success, 0, (5,))) == {1: None}


def test_an_unreadable_checksum_part_fails_a_success_as_checksum():
    c = core()
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    failure = concluded(c.status(0.1, 1, TransferPoll.Success, 0, (), unreadable="checksum is not a number"))[1]
    assert failure.kind is FailureKind.CHECKSUM and "cannot be verified" in failure.detail


def test_a_verification_for_a_cleared_and_reused_room_number_changes_nothing():
    c = core()
    routed(c)
    old, _ = c.receive(0.0, spec(1, slot=1))
    c.status(0.1, 1, TransferPoll.Success, 0, (7,))
    c.clear(0.2, 1)
    new, _ = c.receive(0.3, spec(1, slot=2))
    assert new != old
    assert c.checksum_verified(0.4, 1, old) == [] and c.stage(1) == "asked"
    assert c.checksum_mismatched(0.4, 1, old, "embedding", 7, 8) == [] and c.stage(1) == "asked"


def test_a_checksum_that_raised_fails_the_room_naming_its_memory_and_what_to_check():
    """The driver fails a room whose landed bytes could not be checksummed (a device error, memory freed) with
    checksum_failed_detail(): the one line an operator sees must name the room, the bytes and where they lie,
    whose Success it was, the error, and what to look at, rather than take the bytes unverified."""
    c = core()
    routed(c)
    token, _ = c.receive(0.0, spec(1, slot=1))
    (verify,) = c.status(0.1, 1, TransferPoll.Success, 0, (11,))
    (what, _, addr, nbytes, _), = verify.checks
    detail = checksum_failed_detail(1, what, addr, nbytes, verify.where, RuntimeError("CUDA error: an illegal "
                                                                                      "memory access"))
    failure = Failure(FailureKind.OTHER, detail)
    assert c.fail(0.2, 1, token, failure) == [Conclude(1, token, failure)]
    assert failure.detail == (
        f"room 1: checksumming its landed embedding (64 bytes at {MAIN.embedding.addr + 64:#x}) to verify the "
        f"Success from encode rank 0 at {ENCODE[0]}:{ENCODE[1]} failed: RuntimeError: CUDA error: an illegal memory "
        f"access; the room is failed rather than taken unverified: is its receive memory still allocated, and its "
        f"device usable?")


# ------------------------------------------------------------------------ clear


def test_clear_before_the_ask_means_it_never_goes_out():
    c = core()
    c.receive(0.0, spec(1))
    c.clear(0.1, 1)
    assert c.parallel_resolved(0.2, BOOT, 1, 1) == []
    c = core()
    routed(c)
    c.receive(0.0, spec(2, slot=1))
    c.refused(0.0, ENCODE, c.receive(0.0, spec(3, slot=2))[1])
    c.receive(0.0, spec(4, slot=3))
    c.clear(0.1, 4)
    assert [a.room for a in c.writable(0.2, ENCODE) if isinstance(a, SendAsk)] == [3]


def test_clear_after_the_ask_drops_its_statuses_and_deadline():
    c = core(deadline_s=10.0)
    routed(c)
    token, _ = c.receive(0.0, spec(1, slot=1))
    assert c.clear(0.1, 1, token)
    assert c.status(0.2, 1, TransferPoll.Success, 0) == []
    assert c.tick(20.0) == [] and c.next_wakeup() is None
    assert not c.clear(0.3, 1)


def test_clear_with_a_stale_token_keeps_the_new_room():
    c = core()
    old, _ = c.receive(0.0, spec(1))
    c.clear(0.0, 1, old)
    c.receive(0.0, spec(1))
    assert not c.clear(0.0, 1, old) and 1 in c


# -------------------------------------------------------------------- ask queue


def test_asks_the_socket_refused_go_first_and_in_order_when_it_can_take_them():
    c = core()
    routed(c)
    first = c.receive(0.0, spec(1, slot=1))[1]
    c.refused(0.0, ENCODE, first)
    assert c.stage(1) == "queued" and c.waiting(ENCODE) == 1
    assert c.receive(0.1, spec(2, slot=2))[1] == [], "a newer ask waits behind it"
    assert [a.room for a in c.writable(0.2, ENCODE)] == [1, 2]
    assert c.waiting(ENCODE) == 0


def test_a_refused_registration_is_announced_again():
    c = core()
    routed(c)
    other = Regions(Region(0x800000, 4096))
    actions = c.receive(0.0, spec(1, regions=other))[1]
    assert kinds(actions) == [Announce, SendAsk]
    c.refused(0.0, ENCODE, actions)
    assert kinds(c.writable(0.1, ENCODE)) == [Announce, SendAsk]


def test_a_dropped_connection_is_looked_up_again_and_has_its_regions_announced_again():
    """The encode rank may have restarted at another port: the route of the room asked there is looked
    up at once, and the next room joins that look-up; found elsewhere, the room asked on the dropped
    connection fails at once (the process it was asked of is gone, nothing will answer it), and the
    old address's socket, which nothing needs, is closed."""
    c = core()
    routed(c)
    token, actions = c.receive(0.0, spec(1, slot=1))
    assert kinds(actions) == [SendAsk]
    assert c.connection_dropped(0.1, ENCODE) == [LookUpRoute(KEY0)]
    assert c.receive(0.2, spec(2, slot=2))[1] == []
    moved = ("10.0.0.2", 7001)
    failed, disconnect, *actions = c.route_resolved(0.3, KEY0, moved)
    assert isinstance(failed, Conclude) and (failed.room, failed.token) == (1, token)
    assert failed.failure.kind is FailureKind.NO_CONNECTION
    assert "now at 10.0.0.2:7001" in failed.failure.detail and "ask again" in failed.failure.detail
    assert disconnect == Disconnect(ENCODE)
    assert kinds(actions) == [Announce, SendAsk] and {a.addr for a in actions} == {moved}
    assert c.stage(2) == "asked"


def test_a_room_asked_of_a_process_that_restarted_at_the_same_address_fails_once_the_server_names_the_new_one():
    """Our bootstrap servers name each registration (its instance): a dropped connection whose rank is found
    at the same address under another registration is a restart in place, and the room asked of the process
    before it fails at once; under the same registration (a dropped connection only) it waits."""
    c = core()
    c.parallel_resolved(0.0, BOOT, 1, 1)
    c.route_resolved(0.0, KEY0, ENCODE, "first")
    token, _ = c.receive(0.0, spec(1, slot=1))
    assert c.connection_dropped(0.1, ENCODE) == [LookUpRoute(KEY0)]
    assert not any(isinstance(a, Conclude) for a in c.route_resolved(0.2, KEY0, ENCODE, "first"))
    assert c.stage(1) == "asked", "the same registration: its process may still answer"
    c.receive(0.3, spec(2, slot=2))  # looks the route up again
    failed = [a for a in c.route_resolved(0.4, KEY0, ENCODE, "second") if isinstance(a, Conclude)]
    assert [(a.room, a.token) for a in failed] == [(1, token)]
    assert failed[0].failure.kind is FailureKind.NO_CONNECTION
    assert f"a new process at {ENCODE[0]}:{ENCODE[1]}" in failed[0].failure.detail
    assert c.stage(2) == "asked", "asked of the new process"


def test_a_room_asked_where_the_server_names_no_registration_waits_when_its_rank_is_found_there_again():
    """A peer's bootstrap server names no registration: a rank found at the same address after a dropped
    connection may be the same process, and the room asked of it keeps waiting for its status."""
    c = core()
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    c.connection_dropped(0.1, ENCODE)
    c.route_resolved(0.2, KEY0, ENCODE)
    c.receive(0.3, spec(2, slot=2))
    assert not any(isinstance(a, Conclude) for a in c.route_resolved(0.4, KEY0, ENCODE, "second"))
    assert c.stage(1) == "asked"


def test_rooms_whose_asks_never_left_for_a_dropped_connection_are_looked_up_again():
    """An encode rank restarted at another port: asks that waited for the old socket go to the new one,
    in their order, before any room received later, behind one look-up."""
    c = core()
    routed(c)
    c.refused(0.0, ENCODE, c.receive(0.0, spec(1, slot=1))[1])
    c.receive(0.1, spec(2, slot=2))
    assert c.stage(1) == c.stage(2) == "queued"
    assert c.connection_dropped(0.2, ENCODE) == [LookUpRoute(KEY0)]
    assert c.stage(1) == c.stage(2) == "queued", "they wait where they are until the look-up says otherwise"
    assert c.receive(0.3, spec(3, slot=3))[1] == [], "it joins the look-up under way"
    moved = ("10.0.0.2", 7001)
    disconnect, *actions = c.route_resolved(0.4, KEY0, moved)
    assert disconnect == Disconnect(ENCODE), "nothing needs the old address's socket any more"
    assert kinds(actions) == [Announce, SendAsk, SendAsk, SendAsk] and {a.addr for a in actions} == {moved}
    assert [a.room for a in actions if isinstance(a, SendAsk)] == [1, 2, 3]
    assert c.idle(ENCODE, 0.5)


def test_asks_waiting_for_a_socket_are_read_by_wakes_before_as_next_wakeup_reads_them():
    """Their look-up again comes due before any deadline: wakes_before() answers for it as next_wakeup() does."""
    c = core()
    routed(c)
    c.refused(0.0, ENCODE, c.receive(0.0, spec(1, slot=1))[1])
    for t in (QUEUED_LOOKUP_S - 0.01, QUEUED_LOOKUP_S, QUEUED_LOOKUP_S + 0.01, c.deadline_s + 1.0):
        assert c.wakes_before(t) == (QUEUED_LOOKUP_S < t), t
    assert c.next_wakeup() == QUEUED_LOOKUP_S


def test_asks_that_waited_for_a_socket_too_long_are_looked_up_again():
    """No connection was ever made at the address the bootstrap server named (a stale one): after
    QUEUED_LOOKUP_S their route is looked up again, and they are asked wherever the rank is now."""
    c = core()
    routed(c)
    c.refused(0.0, ENCODE, c.receive(0.0, spec(1, slot=1))[1])
    c.refused(0.5, ENCODE, c.receive(0.5, spec(2, slot=2))[1])
    assert c.next_wakeup() == QUEUED_LOOKUP_S
    assert c.tick(QUEUED_LOOKUP_S - 0.01) == [] and c.stage(1) == "queued"
    assert c.tick(QUEUED_LOOKUP_S) == [LookUpRoute(KEY0)] and c.stage(1) == c.stage(2) == "queued"
    assert c.next_wakeup() == 2 * QUEUED_LOOKUP_S, "and again as long after, while they wait"
    moved = ("10.0.0.2", 7001)
    actions = c.route_resolved(2.1, KEY0, moved)
    assert [(type(a), a.addr) for a in actions] == [(Disconnect, ENCODE), (Announce, moved), (SendAsk, moved),
                                                    (SendAsk, moved)]
    assert c.route(KEY0) == moved and c.next_wakeup() == c.deadline_s


def test_asks_whose_route_is_unchanged_or_cannot_be_looked_up_wait_where_they_are():
    """A look-up that names the same address, fails, or is not made (its server's breaker is open)
    costs the waiting asks nothing: they go out once the socket takes them."""
    c = core()
    routed(c)
    c.refused(0.0, ENCODE, c.receive(0.0, spec(1, slot=1))[1])
    c.tick(QUEUED_LOOKUP_S)
    assert c.route_resolved(2.1, KEY0, ENCODE) == [] and c.stage(1) == "queued"
    assert c.tick(2 * QUEUED_LOOKUP_S - 0.01) == [], "not again before another QUEUED_LOOKUP_S"
    assert c.tick(2 * QUEUED_LOOKUP_S) == [LookUpRoute(KEY0)]
    assert c.lookup_failed(5.9, BOOT, KEY0, "timed out", took_s=1.9) == [] and c.stage(1) == "queued"
    assert c.tick(3 * QUEUED_LOOKUP_S) == [], "the breaker that slow failure opened: no look-up, the asks stay"
    assert kinds(c.writable(6.1, ENCODE)) == [SendAsk] and c.stage(1) == "asked"


def _old_address_asks_and_a_new_look_up() -> PrefillCore:
    """Room 1's ask waits at ENCODE, whose connection dropped and whose look-up failed; room 2 looks the same
    route up afresh."""
    c = core()
    routed(c)
    c.refused(0.0, ENCODE, c.receive(0.0, spec(1, slot=1))[1])
    assert c.connection_dropped(0.1, ENCODE) == [LookUpRoute(KEY0)]
    assert c.lookup_failed(0.2, BOOT, KEY0, "refused", took_s=0.0) == [] and c.stage(1) == "queued"
    assert c.receive(0.3, spec(2, slot=2))[1] == [LookUpRoute(KEY0)]
    return c


def _moved_with_both_asks(c: PrefillCore, now: float) -> None:
    """The route's look-up finds the rank at another address: the old socket goes, both rooms are asked there."""
    moved = ("10.0.0.2", 7001)
    disconnect, *actions = c.route_resolved(now, KEY0, moved)
    assert disconnect == Disconnect(ENCODE)
    assert [(type(a), a.addr, a.room) for a in actions] == [(Announce, moved, 1), (SendAsk, moved, 1),
                                                            (SendAsk, moved, 2)]


def test_asks_waiting_at_an_old_address_move_with_their_key_whichever_look_up_finds_it():
    """The look-up made for them failed; a later room's own look-up finds the rank elsewhere: the
    older asks go there first, not to the old address when its socket takes asks again."""
    c = _old_address_asks_and_a_new_look_up()
    _moved_with_both_asks(c, 0.4)
    assert c.writable(0.5, ENCODE) == []


def test_asks_waiting_too_long_make_no_second_look_up_of_a_route_a_room_is_looking_up_already():
    """Room 1's ask waits at the old address; room 2 is looking the same route up when room 1's wait comes due:
    that look-up's answer moves room 1's ask too, so a second one would only double the bootstrap server's
    load (and its answer would find nothing left to do)."""
    c = _old_address_asks_and_a_new_look_up()
    assert c.tick(0.1 + QUEUED_LOOKUP_S) == [] and c.stage(1) == "queued" and c.stage(2) == "lookup"
    _moved_with_both_asks(c, 2.2)


def test_a_queued_room_cleared_before_its_connection_dropped_is_not_looked_up_again():
    c = core()
    routed(c)
    token, actions = c.receive(0.0, spec(1, slot=1))
    c.refused(0.0, ENCODE, actions)
    c.clear(0.1, 1, token)
    assert c.connection_dropped(0.2, ENCODE) == [] and c.idle(ENCODE, 0.5)


def test_the_oldest_route_and_sizes_are_forgotten_past_their_bounds(monkeypatch):
    from transfer.core import prefill

    monkeypatch.setattr(prefill, "MAX_ROUTES", 2)
    monkeypatch.setattr(prefill, "MAX_SIZES", 2)
    c = core()
    for i, boot in enumerate(["10.0.1.1:8998", "10.0.1.2:8998", "10.0.1.3:8998"]):
        c.parallel_resolved(0.0, boot, 1, 1)
        c.route_resolved(0.0, (boot, 0, 0), ("10.0.1.9", 7000 + i))
    assert c.route(("10.0.1.1:8998", 0, 0)) is None and c.route(("10.0.1.3:8998", 0, 0)) == ("10.0.1.9", 7002)
    first = dataclasses.replace(spec(1, slot=1), bootstrap_addr="10.0.1.1:8998")
    assert c.receive(1.0, first)[1] == [LookUpParallel("10.0.1.1:8998")]
    last = dataclasses.replace(spec(2, slot=2), bootstrap_addr="10.0.1.3:8998")
    assert kinds(c.receive(1.0, last)[1]) == [Announce, SendAsk]


def test_what_a_rank_was_told_is_kept_by_its_address_whatever_its_route(monkeypatch):
    """The book of announcements follows the process at an address: a forgotten route costs no
    registration at the same address, its restart (a dropped connection) costs one, and a route
    that moved elsewhere announces there whatever was told at the old address."""
    from transfer.core import prefill

    monkeypatch.setattr(prefill, "MAX_ROUTES", 1)
    c = core()
    routed(c)  # KEY0's encode rank at ENCODE was told of the region
    other = ("10.0.1.1:8998", 0, 0)
    c.parallel_resolved(0.1, other[0], 1, 1)
    c.route_resolved(0.1, other, ("10.0.1.9", 7000))  # KEY0's route is forgotten
    assert c.receive(0.2, spec(2, slot=2))[1] == [LookUpRoute(KEY0)]
    assert kinds(c.route_resolved(0.3, KEY0, ENCODE)) == [SendAsk], "the same process heard it"
    c.connection_dropped(0.4, ENCODE)
    c.receive(0.5, spec(3, slot=3))
    assert kinds(c.route_resolved(0.6, KEY0, ENCODE)) == [Announce, SendAsk], "a restarted one did not"
    c.receive(0.7, spec(4, slot=4))
    assert kinds(c.receive(0.8, spec(5, slot=5))[1]) == [SendAsk]
    moved = ("10.0.0.2", 7001)
    c.connection_dropped(0.9, ENCODE)
    c.receive(1.0, spec(6, slot=6))
    actions = c.route_resolved(1.1, KEY0, moved)
    assert [a.room for a in actions if isinstance(a, Conclude)] == [2, 3, 4, 5], "asked on dropped connections"
    assert [(type(a), a.addr) for a in actions if not isinstance(a, Conclude)] == [
        (Disconnect, ENCODE), (Announce, moved), (SendAsk, moved)]


def test_an_address_is_idle_only_with_nothing_under_way_there():
    c = core()
    routed(c)
    token, actions = c.receive(0.0, spec(1, slot=1))
    assert kinds(actions) == [SendAsk] and not c.idle(ENCODE, 0.5)
    c.status(0.1, 1, TransferPoll.WaitingForInput, 0)
    assert kinds(c.abandon(0.2, 1, token)) == [SendCancel]  # given up before its status
    c.clear(0.2, 1, token)
    assert not c.idle(ENCODE, 0.5), "its cancel waits for an answer"
    c.cancel_answered(0.3, 1, 0, CancelAnswer.CONFIRMED)
    assert c.idle(ENCODE, 0.5)


@pytest.mark.parametrize("lost", ["with its connection", "to a rank that never answers"])
def test_a_cancel_that_will_not_be_answered_keeps_its_address_busy_no_longer(lost):
    c = core()
    routed(c)
    token, _ = c.receive(1.0, spec(1, slot=1))
    c.status(1.1, 1, TransferPoll.WaitingForInput, 0)
    assert kinds(c.abandon(2.0, 1, token)) == [SendCancel]
    c.clear(2.0, 1, token)
    assert not c.idle(ENCODE, 2.1)
    if lost == "with its connection":
        c.connection_dropped(2.1, ENCODE)
        assert c.idle(ENCODE, 2.2)
    else:
        assert not c.idle(ENCODE, 2.0 + CANCEL_SILENCE_S - 0.1)
        assert c.idle(ENCODE, 2.0 + CANCEL_SILENCE_S)


def test_after_its_idle_socket_was_closed_a_room_announces_its_regions_again():
    c = core()
    routed(c)
    assert c.idle(ENCODE, 0.5)
    c.connection_closed(1.0, ENCODE)
    assert kinds(c.receive(2.0, spec(1, slot=1))[1]) == [Announce, SendAsk], "no look-up: the route is kept"


def test_a_full_queue_fails_new_rooms_at_once():
    from transfer.core.ask_queue import AskQueues

    c = core(asks=AskQueues(limit=2))
    routed(c)
    c.refused(0.0, ENCODE, c.receive(0.0, spec(1, slot=1))[1])
    c.receive(0.0, spec(2, slot=2))
    failure = concluded(c.receive(0.0, spec(3, slot=3))[1])[3]
    assert failure.kind is FailureKind.NO_CONNECTION and "2 asks already wait" in failure.detail


def test_asks_of_rooms_cleared_while_they_waited_do_not_fill_the_queue():
    from transfer.core.ask_queue import AskQueues

    c = core(asks=AskQueues(limit=2))
    routed(c)
    first, actions = c.receive(0.0, spec(1, slot=1))
    c.refused(0.0, ENCODE, actions)
    c.receive(0.0, spec(2, slot=2))
    assert c.waiting(ENCODE) == 2
    assert c.clear(0.5, 1, first)
    assert c.receive(1.0, spec(3, slot=3))[1] == [] and c.stage(3) == "queued", "behind room 2, not failed"
    assert [a.room for a in c.writable(1.1, ENCODE)] == [2, 3]
    c.refused(1.2, ENCODE, c.receive(1.2, spec(4, slot=1))[1])
    c.receive(1.2, spec(5, slot=4))
    assert c.waiting(ENCODE) == 2
    for room in (4, 5):
        assert c.clear(1.5, room)
    assert kinds(c.receive(2.0, spec(6, slot=5))[1]) == [SendAsk], "nobody left ahead of it"


def test_a_full_queue_is_looked_through_again_only_after_one_of_its_rooms_was_let_go():
    """An encode rank that stopped reading keeps its queue full: a room refused there does not look
    through the whole queue again, only the first one after a queued room was cleared or concluded."""
    from transfer.core.ask_queue import AskQueues

    c = core(asks=AskQueues(limit=2))
    routed(c)
    c.refused(0.0, ENCODE, c.receive(0.0, spec(1, slot=1))[1])
    second, _ = c.receive(0.0, spec(2, slot=2))
    looked_at: list[int] = []
    queued = c._queued
    c._queued = lambda state: looked_at.append(state.room) or queued(state)
    for room in (3, 4, 5):
        assert concluded(c.receive(0.1, spec(room, slot=room))[1])[room].kind is FailureKind.NO_CONNECTION
    assert looked_at == [1, 2], "looked through once, for the first room refused"
    assert c.clear(0.2, 2, second)
    assert c.receive(0.3, spec(6, slot=6))[1] == [] and c.stage(6) == "queued", "room 2's place is room 6's"
    assert looked_at == [1, 2, 1, 2]
    assert concluded(c.receive(0.4, spec(7, slot=7))[1])[7].kind is FailureKind.NO_CONNECTION
    assert looked_at == [1, 2, 1, 2]
    assert set(concluded(c.tick(60.0))) == {1, 6}  # at their deadline: their places are free again
    assert 8 not in concluded(c.receive(60.1, spec(8, slot=8))[1])


def test_rooms_never_asked_fail_as_no_connection_with_the_silent_rank():
    c = core(deadline_s=10.0)
    routed(c)
    c.refused(0.0, ENCODE, c.receive(0.0, spec(1, slot=1))[1])
    c.receive(1.0, spec(2, slot=2))
    failures = concluded(c.tick(10.0))
    assert failures[1].kind is FailureKind.NO_CONNECTION
    assert failures[1].detail.startswith(f"no connection to encode rank 0 at {ENCODE[0]}:{ENCODE[1]} within 10s")
    assert failures[2].kind is FailureKind.NO_CONNECTION and "went silent" in failures[2].detail
    assert c.waiting(ENCODE) == 0 and c.tick(11.0) == []


def test_rooms_whose_asks_the_socket_refused_are_safe_to_reuse_when_they_fail():
    c = core(deadline_s=10.0)
    routed(c)
    first = c.receive(0.0, spec(1, slot=1))
    c.refused(0.0, ENCODE, first[1])
    second = c.receive(1.0, spec(2, slot=2))
    failed = c.tick(10.0) + c.tick(11.0)
    assert sorted(concluded(failed)) == [1, 2]
    assert not [a for a in failed if isinstance(a, SendCancel)]  # nothing to cancel: nothing was asked
    assert c.safe(1, first[0]) and c.safe(2, second[0])


def test_writable_sends_at_most_a_batch():
    c = core(ask_batch=3)
    routed(c)
    c.refused(0.0, ENCODE, c.receive(0.0, spec(1, slot=1))[1])
    for room in range(2, 6):
        c.receive(0.0, spec(room, slot=room))
    assert [a.room for a in c.writable(0.1, ENCODE)] == [1, 2, 3]
    assert [a.room for a in c.writable(0.1, ENCODE)] == [4, 5]


def test_a_socket_that_cannot_be_made_fails_its_rooms_and_the_route_is_looked_up_afresh():
    c = core()
    c.receive(0.0, spec(1))
    c.parallel_resolved(0.0, BOOT, 1, 1)
    c.route_resolved(0.0, KEY0, ENCODE)
    failure = concluded(c.connect_failed(0.0, ENCODE, "Invalid argument"))[1]
    assert failure.kind is FailureKind.NO_CONNECTION
    assert failure.detail == (f"encode rank 0 at {ENCODE[0]}:{ENCODE[1]} (from bootstrap {BOOT}): "
                              f"cannot connect: Invalid argument")
    assert c.receive(0.1, spec(2, slot=1))[1] == [LookUpRoute(KEY0)]


def test_rooms_whose_socket_could_not_be_made_are_safe_to_reuse_at_once():
    c = core()
    token, _ = c.receive(0.0, spec(1))
    c.parallel_resolved(0.0, BOOT, 1, 1)
    c.route_resolved(0.0, KEY0, ENCODE)
    c.connect_failed(0.0, ENCODE, "Invalid argument")
    assert c.safe(1, token), "no ask left: nothing can write into its memory"
    assert c.abandon(0.1, 1, token) == []


def _registration_unsent(other: Regions) -> tuple[PrefillCore, int, SendAsk, Failure]:
    """Room 1 asked into `other`, a region its encode rank was not told of: the socket raised on the
    registration, which fails the room; the core, the room's token, its ask and that failure."""
    c = core()
    routed(c)
    token, (announce, ask) = c.receive(0.0, spec(1, regions=other))
    failure = Failure(FailureKind.OTHER, "room 1: asking for it failed: RuntimeError: injected")
    assert c.unsent(0.0, announce, failure) == [Conclude(1, token, failure)]
    return c, token, ask, failure


def test_an_ask_or_registration_the_socket_raised_on_fails_its_room_only_and_safe():
    other = Regions(Region(0x800000, 4096))
    c, token, ask, failure = _registration_unsent(other)
    assert c.safe(1, token) and c.abandon(0.1, 1, token) == []
    assert c.clear(0.1, 1, token)
    assert kinds(c.receive(0.2, spec(2, regions=other))[1]) == [Announce, SendAsk], "announced again"
    token3, actions = c.receive(0.3, spec(3, slot=3))
    assert kinds(c.unsent(0.3, actions[-1], failure)) == [Conclude] and c.safe(3, token3)


def test_an_ask_the_socket_raised_on_after_its_room_concluded_or_was_cleared_changes_nothing():
    """The driver reports each action the socket raised on, in order: once the registration before an ask failed
    the room, the ask's own failure (or one for a room cleared and received again meanwhile) must not conclude
    it a second time nor touch the room now under that number."""
    c, token, ask, failure = _registration_unsent(Regions(Region(0x800000, 4096)))
    assert c.unsent(0.0, ask, failure) == [] and c.stage(1) == "concluded"
    c.clear(0.1, 1, token)
    assert c.unsent(0.1, ask, failure) == [], "a room no longer held"
    again, _ = c.receive(0.2, spec(1, slot=1))
    assert c.unsent(0.2, ask, failure) == [] and c.stage(1) == "asked", "the room number's new ask"
    assert c.asking(1, again)


def test_asking_holds_only_for_the_held_token_of_a_room_whose_ask_may_go_out():
    """The driver checks asking() before it sends an ask it took from a queue: a room cleared (or concluded,
    or received again under a new token) since must not have its ask sent."""
    c = core()
    assert not c.asking(1, 1), "a room never received"
    token, _ = c.receive(0.0, spec(1))
    assert not c.asking(1, token), "still looking its route up"
    c.parallel_resolved(0.0, BOOT, 1, 1)
    c.route_resolved(0.0, KEY0, ENCODE)
    assert c.asking(1, token) and not c.asking(1, token + 1)
    c.clear(0.1, 1, token)
    assert not c.asking(1, token)


def test_the_same_embedding_region_with_another_deepstack_region_is_announced_again():
    c = core()
    routed(c)
    first = Regions(MAIN.embedding, Region(0x900000, 4096))
    second = Regions(MAIN.embedding, Region(0xA00000, 4096))
    _, actions = c.receive(0.1, spec(1, regions=first, deepstack=True))
    assert kinds(actions) == [Announce, SendAsk]
    _, actions = c.receive(0.2, spec(2, regions=second, deepstack=True, slot=1))
    assert kinds(actions) == [Announce, SendAsk], "the encode rank must hear of the second deepstack region"
    registration = parse_registration(actions[0].frames)
    assert (registration.embedding_base, registration.deepstack_base) == (MAIN.embedding.addr, 0xA00000)
    assert kinds(c.receive(0.3, spec(3, regions=first, deepstack=True, slot=2))[1]) == [SendAsk]


def test_a_room_number_in_flight_is_refused():
    c = core()
    c.receive(0.0, spec(1))
    with pytest.raises(ValueError, match="already being received"):
        c.receive(0.0, spec(1))


def test_a_room_number_is_refused_while_held_and_taken_again_once_cleared():
    c = core()
    token, _ = c.receive(0.0, spec(1))
    with pytest.raises(ConfigError, match=r"^room 1 is already being received; clear\(\) it first$"):
        c.refuse_held(1)
    c.refuse_held(2)
    assert c.clear(0.1, 1, token)
    c.refuse_held(1)
    assert c.receive(0.2, spec(1))[0] == token + 1


def test_a_room_that_raised_while_it_started_is_not_held(monkeypatch):
    c = core()

    def broken(now, state, defer=False):
        raise RuntimeError("broken route")

    monkeypatch.setattr(c, "_route", broken)
    with pytest.raises(RuntimeError, match="broken route"):
        c.receive(0.0, spec(1))
    assert 1 not in c and len(c) == 0
    c.refuse_held(1)


def test_fail_all_concludes_only_open_rooms():
    from transfer.core.failure import Failure

    c = core()
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    c.receive(0.0, spec(2, slot=2))
    c.status(0.0, 1, TransferPoll.Failed, 0)
    failures = concluded(c.fail_all(0.1, Failure(FailureKind.CLOSED, "session manager closed")))
    assert list(failures) == [2] and failures[2].kind is FailureKind.CLOSED


def test_a_look_up_answered_for_many_rooms_asks_a_batch_and_queues_the_rest_in_order():
    c = core(ask_batch=2)
    for room in range(1, 6):
        c.receive(0.0, spec(room, slot=room))
    c.parallel_resolved(0.0, BOOT, 1, 1)
    actions = c.route_resolved(0.0, KEY0, ENCODE)
    assert [a.room for a in actions if isinstance(a, SendAsk)] == [1, 2]
    assert c.waiting(ENCODE) == 3
    assert [a.room for a in c.writable(0.0, ENCODE)] == [3, 4]
    assert [a.room for a in c.writable(0.0, ENCODE)] == [5]


def test_a_tick_fails_at_most_its_limit_and_says_more_are_due():
    c = core(deadline_s=1.0)
    routed(c)
    for room in range(10):
        c.receive(0.0, spec(room, slot=room))
    assert len(concluded(c.tick(5.0, limit=4))) == 4
    assert c.next_wakeup() <= 5.0
    assert len(concluded(c.tick(5.0))) == 6 and c.next_wakeup() is None


# ------------------------------------------------------ sockets to encode ranks

B_ADDR, C_ADDR = ("10.0.0.4", 7000), ("10.0.0.5", 7000)


def test_an_encode_rank_that_keeps_moving_holds_one_socket_not_one_per_address():
    """Each time its connection drops and its route is found at a new port, the old address's socket is
    closed at once, and the room asked on the dropped connection fails (no cancel is sent on it)."""
    c = core()
    routed(c)
    old = ENCODE
    for i in range(1, 50):
        _, actions = c.receive(float(i), spec(i, slot=i % 8))
        assert [(type(a), a.addr) for a in actions][-1] == (SendAsk, old)
        # The rank may come back where it was last found, elsewhere, or not at all: room i's route is looked up.
        assert c.connection_dropped(i + 0.1, old) == [LookUpRoute(KEY0)]
        assert c.receive(i + 0.2, spec(1000 + i, slot=8))[1] == []
        new = ("10.0.0.2", 7000 + i)
        failed, *actions = c.route_resolved(i + 0.3, KEY0, new)
        assert isinstance(failed, Conclude) and failed.room == i, "asked of the process that went away"
        assert [(type(a), a.addr) for a in actions] == [(Disconnect, old), (Announce, new), (SendAsk, new)]
        assert c.connected(new) and not c.connected(old)
        c.clear(i + 0.4, 1000 + i)
        old = new


def test_an_encode_rank_found_again_at_the_same_address_keeps_its_socket():
    c = core()
    routed(c)
    c.receive(0.1, spec(1, slot=1))
    assert c.connection_dropped(0.2, ENCODE) == [LookUpRoute(KEY0)] and c.connected(ENCODE)
    assert c.receive(0.3, spec(2, slot=2))[1] == []
    assert kinds(c.route_resolved(0.4, KEY0, ENCODE)) == [Announce, SendAsk] and c.connected(ENCODE)
    assert c.stage(1) == "asked", "room 1 waits for its status where its rank is still registered"


@pytest.mark.parametrize("need", ["a room asked on its connection", "a cancel awaiting its answer"])
def test_an_address_a_route_moved_from_is_kept_while_its_socket_is_needed_and_closed_when_it_drops(need):
    """Found elsewhere while its connection is up: a room asked on it may yet be cancelled there, a
    cancel sent on it may not have left. Once that connection drops, nothing can need it."""
    c = core()
    routed(c)
    token, _ = c.receive(0.1, spec(1, slot=1))
    if need == "a cancel awaiting its answer":
        assert kinds(c.abandon(0.2, 1, token)) == [SendCancel]
        c.clear(0.2, 1, token)
    moved = ("10.0.0.2", 7001)
    assert c.route_resolved(0.3, KEY0, moved) == [] and c.connected(ENCODE)
    if need == "a room asked on its connection":
        assert kinds(c.abandon(0.4, 1, token)) == [SendCancel], "its cancel goes on the connection it was asked on"
        c.clear(0.4, 1, token)
    assert c.connection_dropped(0.5, ENCODE) == [Disconnect(ENCODE)]
    assert not c.connected(ENCODE)


def test_an_address_another_encode_rank_was_found_at_keeps_its_socket_when_one_moves_away():
    c = core(tp_size=3)
    routed(c, tp=3, dp=3)  # dp group 0 at ENCODE
    assert c.receive(0.1, spec(1, slot=1))[1] == [LookUpRoute((BOOT, 1, 0))]
    assert kinds(c.route_resolved(0.2, (BOOT, 1, 0), ENCODE)) == [SendAsk]
    assert c.route_resolved(0.3, KEY0, ("10.0.0.2", 7001)) == [] and c.connected(ENCODE)
    assert c.connection_dropped(0.4, ENCODE) == [LookUpRoute((BOOT, 1, 0))] and c.connected(ENCODE)


def _routed_at(c: PrefillCore, now: float, room: int, group: int, addr) -> list:
    """Room `room` of dp group `group` (of 3, one encode rank each), its route looked up and found at `addr`:
    the actions."""
    assert c.receive(now, spec(room, slot=room))[1] == [LookUpRoute((BOOT, group, 0))]
    return c.route_resolved(now, (BOOT, group, 0), addr)


def test_past_the_socket_cap_the_least_recently_used_connection_with_nothing_under_way_is_closed():
    c = core(tp_size=3, integrity=False, max_sockets=2)
    routed(c, tp=3, dp=3)  # dp group 0 at ENCODE, connected first
    assert kinds(_routed_at(c, 0.1, 1, 1, B_ADDR)) == [Announce, SendAsk]
    assert kinds(c.receive(0.2, spec(6, slot=6))[1]) == [SendAsk]  # dp group 0: ENCODE, used after B
    for room, rank in ((1, 1), (6, 0)):  # held, but their writes are over: nothing is under way at either address
        assert kinds(c.status(0.3, room, TransferPoll.Success, rank)) == [Conclude]
    actions = _routed_at(c, 0.4, 2, 2, C_ADDR)
    assert [(type(a), a.addr) for a in actions] == [(Disconnect, B_ADDR), (Announce, C_ADDR), (SendAsk, C_ADDR)]
    assert c.connected(ENCODE) and c.connected(C_ADDR) and not c.connected(B_ADDR)
    # B's route is kept: a room there connects afresh, in place of the least recently used one.
    actions = c.receive(0.5, spec(4, slot=4))[1]
    assert [(type(a), a.addr) for a in actions] == [(Disconnect, ENCODE), (Announce, B_ADDR), (SendAsk, B_ADDR)]


def test_past_the_socket_cap_with_something_under_way_on_every_connection_a_new_room_fails_at_once():
    c = core(tp_size=3, max_sockets=2)
    routed(c, tp=3, dp=3)
    c.receive(0.0, spec(3, slot=3))  # asked at ENCODE, waiting for its status
    token1, _ = c.receive(0.1, spec(1, slot=1))
    c.refused(0.2, B_ADDR, c.route_resolved(0.2, (BOOT, 1, 0), B_ADDR))  # room 1's ask waits for B's socket
    token2, actions = c.receive(0.3, spec(2, slot=2))
    assert actions == [LookUpRoute((BOOT, 2, 0))]
    [conclude] = c.route_resolved(0.4, (BOOT, 2, 0), C_ADDR)
    assert conclude.room == 2 and conclude.failure.kind is FailureKind.NO_CONNECTION
    assert conclude.failure.detail == ("room 2: not connecting to encode rank 2 at 10.0.0.5:7000: this prefill rank "
                                       "already holds 2 sockets to encode ranks, its cap, each with rooms under way")
    assert c.safe(2, token2), "it was never asked for"
    assert c.connected(ENCODE) and c.connected(B_ADDR) and not c.connected(C_ADDR)
    c.clear(0.5, 1, token1)  # the ask left waiting at B is a cleared room's: nothing is under way there now
    c.clear(0.5, 2, token2)
    [disconnect, *asks] = c.receive(0.6, spec(5, slot=5))[1]  # C's route is known
    assert disconnect == Disconnect(B_ADDR) and kinds(asks) == [Announce, SendAsk]
    assert c.writable(0.7, B_ADDR) == [], "what waited there is forgotten with it"


# ------------------------------------------------------- random interleavings

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("receive"), st.integers(0, 3)),
        st.tuples(st.just("clear"), st.integers(0, 3)),
        st.tuples(st.just("resolve"), st.booleans()),
        st.tuples(st.just("fail_lookup"), st.booleans()),
        st.tuples(st.just("route_missing"),),
        st.tuples(st.just("dropped"),),
        st.tuples(st.just("status"), st.integers(0, 3), st.sampled_from(list(TransferPoll)), st.integers(0, 1)),
        st.tuples(st.just("verified"), st.integers(0, 3), st.booleans()),
        st.tuples(st.just("socket"), st.booleans()),
        st.tuples(st.just("writable"),),
        st.tuples(st.just("tick"), st.floats(0.0, 30.0)),
        st.tuples(st.just("late tick"), st.floats(0.0, 30.0)),
    ),
    max_size=60,
)


def next_wakeup_by_its_rules(c: PrefillCore) -> float | None:
    """next_wakeup() as its rules read, through the calls its plain case makes without (_open(), defer(),
    heads()): the earliest open room's deadline or held ask, at the end of an unread grace while one holds,
    and the asks waiting for a socket and the stranded rooms' look-ups."""
    heap, held = c._deadlines, c._held
    while heap and not c._open(heap[0][2]):
        heapq.heappop(heap)
    while held and not c._in(held[0][2], "held"):
        heapq.heappop(held)
    rules = c._unread.defer(min([entries[0][0] for entries in (heap, held) if entries], default=None))
    due = [c._recheck_due(addr, head) for addr, head in c.asks.heads(c._queued)]
    if c._stranded:
        due.append(c._stranded_next)
    if rules is not None:
        due.append(rules)
    return min(due, default=None)


def next_wakeup_unpopped(c: PrefillCore) -> float | None:
    """next_wakeup_by_its_rules() with nothing popped or pruned: a heap's top once the entries no longer due left
    it is its earliest entry still due, and a queue's head once the asks no longer waiting left it is its
    oldest ask still waiting."""
    due = [entry[0] for entry in c._deadlines if c._open(entry[2])]
    due += [entry[0] for entry in c._held if c._in(entry[2], "held")]
    rules = c._unread.defer(min(due, default=None))
    due = [c._recheck_due(addr, next(state for state in queue if c._queued(state)))
           for addr, queue in c.asks.queues.items() if any(c._queued(state) for state in queue)]
    if c._stranded:
        due.append(c._stranded_next)
    if rules is not None:
        due.append(rules)
    return min(due, default=None)


class FakeDriver:
    """Carries out a core's actions as the real driver does, with a socket that takes asks or not."""

    def __init__(self, c: PrefillCore) -> None:
        self.c = c
        self.accepting = True
        self.lookups: list = []
        self.verifies: dict[int, Verify] = {}
        self.concluded: list[int] = []
        self.sent: list[int] = []  # tokens whose TransferInfo went out, in order
        self.gone: set[int] = set()  # tokens cleared or concluded

    def carry(self, now: float, actions: list) -> None:
        refused: list = []
        for action in actions:
            if isinstance(action, (Announce, SendAsk)):
                if refused or not self.accepting:
                    refused.append(action)
                elif isinstance(action, SendAsk) and self.c.asking(action.room, action.token):
                    assert action.token not in self.gone, "asked for a room given up"
                    self.sent.append(action.token)
            elif isinstance(action, Conclude):
                assert action.token not in self.concluded, "a room concluded twice"
                self.concluded.append(action.token)
                self.gone.add(action.token)
            elif isinstance(action, (LookUpParallel, LookUpRoute)):
                self.lookups.append(action)
            elif isinstance(action, Verify):
                self.verifies[action.room] = action
        if refused:
            self.carry(now, self.c.refused(now, ENCODE, refused))


@settings(max_examples=500, deadline=None)
@given(EVENTS)
def test_random_interleavings_keep_the_room_invariants(events):
    c = core(deadline_s=10.0, ask_batch=2)
    d = FakeDriver(c)
    now = 0.0
    for event in events:
        kind = event[0]
        if kind == "receive" and event[1] not in c:
            token, actions = c.receive(now, spec(event[1], slot=event[1]))
            d.carry(now, actions)
        elif kind == "clear":
            token = c.token(event[1])
            if token is not None and c.clear(now, event[1]):
                d.gone.add(token)
        elif kind == "resolve" and d.lookups:
            action = d.lookups.pop(0 if event[1] else -1)
            if isinstance(action, LookUpParallel):
                d.carry(now, c.parallel_resolved(now, BOOT, 1, 1))
            else:
                d.carry(now, c.route_resolved(now, action.key, ENCODE))
        elif kind == "fail_lookup" and d.lookups:
            action = d.lookups.pop(0)
            key = action.key if isinstance(action, LookUpRoute) else None
            d.carry(now, c.lookup_failed(now, BOOT, key, "refused", 2.0 if event[1] else 0.0))
        elif kind == "route_missing" and any(isinstance(a, LookUpRoute) for a in d.lookups):
            action = next(a for a in d.lookups if isinstance(a, LookUpRoute))
            d.lookups.remove(action)
            d.carry(now, c.route_missing(now, action.key, "no route"))
        elif kind == "dropped":
            d.carry(now, c.connection_dropped(now, ENCODE))
        elif kind == "status":
            d.carry(now, c.status(now, event[1], event[2], event[3], (1,)))
        elif kind == "verified" and event[1] in d.verifies:
            v = d.verifies.pop(event[1])
            d.carry(now, c.checksum_verified(now, v.room, v.token) if event[2]
                    else c.checksum_mismatched(now, v.room, v.token, "embedding", 1, 2))
        elif kind == "socket":
            d.accepting = event[1]
        elif kind == "writable":
            d.carry(now, c.writable(now, ENCODE))
        elif kind == "tick" or kind == "late tick":
            now += event[1]
            d.carry(now, c.tick(now, unread=kind == "late tick"))
        # Asked while the heaps still hold the entries no longer due (until a wakes_before() reads next_wakeup()).
        wakeup = next_wakeup_unpopped(c)
        for t in (now, now + 5.0, now + 10.0, now + 10.5, math.inf):
            assert c.wakes_before(t) == (wakeup is not None and wakeup < t), t
        assert c.next_wakeup() == next_wakeup_by_its_rules(c) == wakeup
    # Asks reach an encode rank in the order the rooms were asked for.
    assert d.sent == sorted(d.sent) and len(set(d.sent)) == len(d.sent)
    # Every room still open concludes by its deadline, except one whose bytes are being checked.
    d.carry(now + 10.0, c.tick(now + 10.0))
    for room in range(6):
        assert c.stage(room) in (None, "concluded", "verifying")
    assert c.next_wakeup() is None


def test_a_status_for_a_room_not_yet_asked_for_is_ignored_and_the_room_is_asked_for():
    c = core(deadline_s=10.0)
    c.receive(0.0, spec(0))
    (warn,) = c.status(0.0, 0, TransferPoll.Success, 0, (1,))
    assert isinstance(warn, Warn) and "before this rank asked for the room; ignored" in warn.message
    c.parallel_resolved(0.0, BOOT, 1, 1)
    (warn,) = c.status(0.5, 0, TransferPoll.Success, 0, ())  # unverified, from the rank it will pair with
    assert isinstance(warn, Warn) and c.stage(0) == "lookup"
    assert [type(a) for a in c.route_resolved(1.0, KEY0, ENCODE)] == [Announce, SendAsk]
    assert c.stage(0) == "asked"


def test_a_closed_core_that_forgot_its_rooms_keeps_none_of_their_destinations():
    """A room's spec names its destination memory (a pool's fallback buffer): once closed and told to forget
    its rooms, the core holds none of it (rooms asked, or waiting for a look-up; their deadline entries)."""
    import gc
    import weakref

    c = core()
    routed(c)
    buffers = [Regions(Region(0x900000 + i * 0x1000, 64)) for i in range(3)]
    c.receive(0.0, spec(1, regions=buffers[0]))  # asked: the route is known
    c.receive(0.0, dataclasses.replace(spec(2, regions=buffers[1]), bootstrap_addr="10.0.0.9:8998"))  # a look-up
    c.receive(0.0, spec(3, regions=buffers[2]))
    kept = [weakref.ref(regions) for regions in buffers]
    del buffers
    c.close(1.0, Failure(FailureKind.CLOSED, "closed"))
    c.forget_rooms()
    gc.collect()
    assert [ref() for ref in kept] == [None, None, None]
    assert len(c) == 0 and not c.clear(1.0, 1)
    assert c.tick(120.0) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=30, unique=True))
def test_a_room_asked_at_once_goes_on_its_addresss_connection_of_now_made_the_most_recently_used(rooms):
    """An ask that goes out at once takes the connection its _ask found (no second look): the address's
    connection in use, which is now the most recently used, as for an ask that waited in a queue."""
    c = core(engine_rank=0, tp_size=2, dp_size=1)  # encode tp 2 in 2 dp groups: one rank each, fanout 1
    addrs = {0: ("10.0.0.2", 7000), 1: ("10.0.0.4", 7000)}
    c.receive(0.0, spec(100))
    c.parallel_resolved(0.0, BOOT, 2, 2)
    for group, addr in addrs.items():
        c.route_resolved(0.0, (BOOT, group, 0), addr)
    for room in rooms:
        _, actions = c.receive(1.0, spec(room, slot=room))
        assert kinds(actions)[-1] is SendAsk
        addr = addrs[room % 2]
        assert actions[-1].addr == addr
        assert c._rooms[room].conn == c._conns[addr]
        assert list(c._conns)[-1] == addr


_LET_GO_EVENTS = st.lists(st.one_of(
    st.tuples(st.just("receive"), st.integers(0, 3)),
    st.tuples(st.just("status"), st.integers(0, 3), st.sampled_from(list(TransferPoll))),
    st.tuples(st.just("socket"), st.booleans()),
    st.tuples(st.just("clear"), st.integers(0, 3), st.booleans()),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_LET_GO_EVENTS, st.booleans())
def test_let_go_is_safe_then_clear(events, integrity):
    """let_go() is the driver's clear() with one look-up: what safe() then clear() answer and leave behind."""
    cores = [core(deadline_s=10.0, integrity=integrity), core(deadline_s=10.0, integrity=integrity)]
    for c in cores:
        routed(c)
    accepting = True
    for event in events:
        kind = event[0]
        if kind == "socket":
            accepting = event[1]
            continue
        answers = []
        for i, c in enumerate(cores):
            if kind == "receive":
                if event[1] in c:
                    continue
                _, actions = c.receive(1.0, spec(event[1], slot=event[1]))
                refused = [a for a in actions if isinstance(a, (Announce, SendAsk))]
                if refused and not accepting:
                    c.refused(1.0, ENCODE, refused)
            elif kind == "status":
                c.status(1.0, event[1], event[2], 0, (1,) if integrity else ())
            else:
                token = c.token(event[1])
                token = (0 if token is None else token) + (0 if event[2] else 1)  # a stale token, or none held
                c.abandon(1.0, event[1], token)
                answers.append(c.let_go(1.0, event[1], token) if i else
                               (c.safe(event[1], token), c.clear(1.0, event[1], token))[0])
        assert len(set(answers)) <= 1
        a, b = cores
        assert [(a.token(r), a.stage(r)) for r in range(4)] == [(b.token(r), b.stage(r)) for r in range(4)]
        assert a.lanes == b.lanes and a._let_go == b._let_go and a.next_wakeup() == b.next_wakeup()

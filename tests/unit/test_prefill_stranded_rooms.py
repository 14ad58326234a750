"""Rooms asked on a connection that dropped, while no room is received: the prefill core looks their encode
rank's route up again while they wait (transfer.core.prefill.PrefillCore._stranded_look_ups), so they fail
soon after a successor registers, at another address or under another registration, rather than at their
deadlines; with a fake clock."""

from __future__ import annotations

from prefill_rooms import BOOT, ENCODE, KEY0, core, routed, spec

from transfer.core.failure import FailureKind
from transfer.core.prefill import (
    STRANDED_LOOKUP_MAX_S,
    STRANDED_LOOKUP_S,
    Announce,
    Conclude,
    Disconnect,
    LookUpRoute,
    SendAsk,
)
from transfer.status import TransferPoll

MOVED = ("10.0.0.2", 7001)


def concluded(actions) -> dict[int, object]:
    return {a.room: a.failure for a in actions if isinstance(a, Conclude)}


def stranded(deadline_s: float = 60.0, instance: str | None = "first"):
    """A core whose room 1 was asked at 0.0 on a connection that dropped at 0.1, the drop's look-up
    answering at 0.2 with the same address and registration (the successor had not registered yet)."""
    c = core(deadline_s=deadline_s)
    c.parallel_resolved(0.0, BOOT, 1, 1)
    c.route_resolved(0.0, KEY0, ENCODE, instance)
    token, actions = c.receive(0.0, spec(1, slot=1))
    assert [type(a) for a in actions] == [Announce, SendAsk]
    assert c.connection_dropped(0.1, ENCODE) == [LookUpRoute(KEY0)]
    assert c.route_resolved(0.2, KEY0, ENCODE, instance) == [] and c.stage(1) == "asked"
    return c, token


def test_the_route_is_looked_up_again_a_second_after_the_drop_and_a_successor_in_place_fails_the_room():
    c, token = stranded()
    due = 0.1 + STRANDED_LOOKUP_S
    assert c.next_wakeup() == due, "not the 60 s deadline"
    assert c.tick(due - 0.01) == []
    assert c.tick(due) == [LookUpRoute(KEY0)]
    failures = concluded(c.route_resolved(due + 0.1, KEY0, ENCODE, "second"))
    assert list(failures) == [1] and failures[1].kind is FailureKind.NO_CONNECTION
    assert f"a new process at {ENCODE[0]}:{ENCODE[1]}" in failures[1].detail
    assert failures[1].detail.endswith("ask again (send the item to the new rank)")
    assert not c.safe(1, token), "it was asked: only its quarantine makes its memory safe"
    assert c.tick(10.0) == [] and c.next_wakeup() is None, "nothing left to look up for"


def test_a_successor_at_another_address_fails_the_room_and_the_old_address_is_let_go():
    c, _ = stranded()
    assert c.tick(1.1) == [LookUpRoute(KEY0)]
    actions = c.route_resolved(1.2, KEY0, MOVED, "second")
    assert f"now at {MOVED[0]}:{MOVED[1]}" in concluded(actions)[1].detail
    assert Disconnect(ENCODE) in actions
    assert c.route(KEY0) == MOVED, "the next room goes to the successor without a look-up"
    assert c.next_wakeup() is None


def test_under_the_same_registration_the_room_waits_and_the_look_ups_slow_down_to_every_few_seconds():
    """A dropped connection only: its process may still answer. Look-ups 1, 2 and then 4 s apart, until
    the deadline fails the room as before."""
    c, _ = stranded(deadline_s=30.0)
    at, times = 0.1, []
    while at < 30.0:
        at = c.next_wakeup()
        actions = c.tick(at)
        if actions != [LookUpRoute(KEY0)]:
            break
        times.append(round(at - 0.1, 6))
        assert c.route_resolved(at + 0.05, KEY0, ENCODE, "first") == [] and c.stage(1) == "asked"
    assert times[:4] == [1.0, 3.0, 7.0, 11.0]
    assert all(b - a == STRANDED_LOOKUP_MAX_S for a, b in zip(times[2:], times[3:])), times
    assert len(times) <= 2 + 30.0 / STRANDED_LOOKUP_MAX_S
    failures = concluded(actions)
    assert at == 30.0 and failures[1].kind is FailureKind.DEADLINE, "its deadline, as before"
    assert c.tick(60.0) == [] and c.next_wakeup() is None


def test_a_peers_server_naming_no_registration_still_fails_the_room_once_the_rank_moved():
    c, _ = stranded(instance=None)
    assert c.tick(1.1) == [LookUpRoute(KEY0)]
    assert c.route_resolved(1.2, KEY0, ENCODE) == [] and c.stage(1) == "asked", "maybe the same process"
    assert c.tick(3.1) == [LookUpRoute(KEY0)]
    assert f"now at {MOVED[0]}:{MOVED[1]}" in concluded(c.route_resolved(3.2, KEY0, MOVED))[1].detail


def test_one_look_up_at_a_time_whoever_made_it():
    c, _ = stranded()
    assert c.tick(1.1) == [LookUpRoute(KEY0)]
    assert c.tick(3.1) == [], "the look-up under way has not answered"
    assert c.tick(4.0) == []
    assert c.route_resolved(4.1, KEY0, ENCODE, "first") == []
    assert c.tick(c.next_wakeup()) == [LookUpRoute(KEY0)], "the next one, once the last answered"
    c.route_resolved(5.2, KEY0, ENCODE, "first")
    # A room received meanwhile looks the route up itself: that look-up answers for the stranded room too.
    assert c.receive(6.0, spec(2, slot=2))[1] == [LookUpRoute(KEY0)]
    assert c.tick(c.next_wakeup()) == []
    failures = concluded(c.route_resolved(9.5, KEY0, MOVED, "second"))
    assert list(failures) == [1] and c.stage(2) == "asked"


def test_a_failed_look_up_is_retried_and_a_server_that_failed_slowly_is_left_alone_meanwhile():
    c, _ = stranded()
    assert c.tick(1.1) == [LookUpRoute(KEY0)]
    assert c.lookup_failed(3.1, BOOT, KEY0, "timed out", took_s=2.0) == [], "the room is no look-up's"
    assert c.stage(1) == "asked"
    assert c.tick(3.5) == [], "its breaker is open"
    assert c.tick(c.next_wakeup()) == [LookUpRoute(KEY0)]


def test_a_route_the_server_no_longer_has_fails_the_room_at_the_next_look_up():
    c, _ = stranded()
    assert c.tick(1.1) == [LookUpRoute(KEY0)]
    failures = concluded(c.route_missing(1.2, KEY0, f"no route for encode rank 0 in dp group 0 at {BOOT}"))
    assert failures[1].kind is FailureKind.BOOTSTRAP and "is no longer registered" in failures[1].detail


def test_no_look_ups_once_the_rooms_concluded_or_were_cleared():
    c, token = stranded()
    c.clear(0.5, 1, token)
    # No open room is left for a deadline: the look-up's wake may still come (it finds nothing), none later.
    assert c.next_wakeup() in (None, 0.1 + STRANDED_LOOKUP_S)
    assert c.tick(1.1) == [] and c.next_wakeup() is None
    c, _ = stranded()
    assert c.status(0.5, 1, TransferPoll.Success, 0) != [], "the same process answered after all"
    assert c.tick(1.1) == [] and c.next_wakeup() is None


def test_a_room_asked_on_the_fresh_connection_is_not_looked_up_for():
    c, _ = stranded()
    routed_again = c.receive(0.5, spec(2, slot=2))[1]
    assert routed_again == [LookUpRoute(KEY0)]
    c.route_resolved(0.6, KEY0, ENCODE, "first")
    assert c.stage(2) == "asked"
    c.status(0.7, 1, TransferPoll.Failed, 0)  # room 1 concludes: only room 2 is left, on a connection up
    assert c.tick(1.1) == [] and c.next_wakeup() == 60.5


def test_a_later_drop_starts_the_waits_over_and_its_rooms_join():
    c, _ = stranded()
    assert c.tick(1.1) == [LookUpRoute(KEY0)]
    c.route_resolved(1.2, KEY0, ENCODE, "first")  # the route is forgotten: the next room looks it up
    assert c.receive(2.0, spec(2, slot=2))[1] == [LookUpRoute(KEY0)]
    c.route_resolved(2.1, KEY0, ENCODE, "first")
    assert c.stage(2) == "asked"
    assert c.connection_dropped(2.5, ENCODE) == [LookUpRoute(KEY0)]
    c.route_resolved(2.6, KEY0, ENCODE, "first")
    assert c.next_wakeup() == 2.5 + STRANDED_LOOKUP_S
    assert c.tick(3.5) == [LookUpRoute(KEY0)]
    assert sorted(concluded(c.route_resolved(3.6, KEY0, ENCODE, "second"))) == [1, 2]

"""A route the bootstrap server no longer has (its encode rank's sender pool closed and withdrew it): the
prefill core fails the rooms that waited on it at once, saying so, instead of at their deadlines, and
keeps the server's breaker shut (transfer.core.prefill.PrefillCore.route_missing), with a fake clock."""

from __future__ import annotations

from prefill_rooms import BOOT, ENCODE, KEY0, core, routed, spec

from transfer.core.failure import FailureKind
from transfer.core.prefill import (
    QUEUED_LOOKUP_S,
    Announce,
    Conclude,
    Disconnect,
    LookUpParallel,
    LookUpRoute,
    SendAsk,
    SendCancel,
)

NO_ROUTE = f"no route for encode rank 0 in dp group 0 at {BOOT}"
GONE = (f"encode rank 0 (dp group 0) is no longer registered at bootstrap {BOOT} (it was at 10.0.0.2:7000): "
        f"its sender pool closed, or the bootstrap server restarted; room {{room}} {{what}}")
NEVER_ASKED, ASKED_THERE = "was never asked for", "was asked there and that connection dropped"


def concluded(actions) -> dict[int, object]:
    return {a.room: a.failure for a in actions if isinstance(a, Conclude)}


def gone(room: int, what: str) -> str:
    return GONE.format(room=room, what=what)


def test_a_room_looking_up_a_route_gone_fails_saying_its_rank_is_no_longer_registered_and_where_it_was():
    c = core()
    routed(c)
    c.connection_dropped(0.1, ENCODE)  # nothing asked there: its route is forgotten, looked up by the next room
    assert c.receive(0.2, spec(1, slot=1))[1] == [LookUpRoute(KEY0)]
    [failure] = concluded(c.route_missing(0.3, KEY0, NO_ROUTE)).values()
    assert failure.kind is FailureKind.BOOTSTRAP and failure.detail == gone(1, NEVER_ASKED)
    # The next room too, however many look-ups say so.
    assert c.receive(0.4, spec(2, slot=2))[1] == [LookUpRoute(KEY0)]
    assert concluded(c.route_missing(0.5, KEY0, NO_ROUTE))[2].detail == gone(2, NEVER_ASKED)


def test_a_route_never_found_fails_its_rooms_with_the_servers_answer():
    c = core(tp_size=3)
    routed(c, tp=3, dp=3)  # dp group 0 found; group 1 (room 1's) never was
    assert c.receive(0.1, spec(1, slot=1))[1] == [LookUpRoute((BOOT, 1, 0))]
    [failure] = concluded(c.route_missing(0.2, (BOOT, 1, 0), "no route for encode rank 0 in dp group 1 at "
                                                              f"{BOOT}")).values()
    assert failure.kind is FailureKind.BOOTSTRAP
    assert failure.detail == f"bootstrap {BOOT}: no route for encode rank 0 in dp group 1 at {BOOT}"


def test_asks_queued_at_the_last_address_fail_at_their_re_look_up_not_at_their_deadline():
    """The rank's socket is gone (its pool closed): the asks wait for a socket, their route is looked up
    again after QUEUED_LOOKUP_S, and the server's answer that it has none fails them then, unasked (their
    memory is safe at once), and the old address's socket is closed."""
    c = core(deadline_s=60.0)
    routed(c)
    first, actions = c.receive(0.0, spec(1, slot=1))
    c.refused(0.0, ENCODE, actions)
    second, _ = c.receive(0.5, spec(2, slot=2))
    assert c.stage(1) == c.stage(2) == "queued"
    assert c.tick(QUEUED_LOOKUP_S) == [LookUpRoute(KEY0)]
    actions = c.route_missing(QUEUED_LOOKUP_S + 0.01, KEY0, NO_ROUTE)
    assert concluded(actions) == {1: concluded(actions)[1], 2: concluded(actions)[2]}
    assert [a.room for a in actions if isinstance(a, Conclude)] == [1, 2], "oldest first"
    assert concluded(actions)[1].detail == gone(1, NEVER_ASKED)
    assert actions[-1] == Disconnect(ENCODE) and not c.connected(ENCODE)
    assert c.safe(1, first) and c.safe(2, second)
    assert c.writable(3.0, ENCODE) == [] and c.next_wakeup() is None


def test_asks_queued_behind_a_dropped_connection_fail_on_the_look_up_the_drop_made():
    c = core()
    routed(c)
    c.refused(0.0, ENCODE, c.receive(0.0, spec(1, slot=1))[1])
    assert c.connection_dropped(0.1, ENCODE) == [LookUpRoute(KEY0)]
    assert c.receive(0.2, spec(2, slot=2))[1] == [], "it joins the look-up under way"
    failures = concluded(c.route_missing(0.3, KEY0, NO_ROUTE))
    assert failures[1].detail == gone(1, NEVER_ASKED) and failures[2].detail == gone(2, NEVER_ASKED)


def test_rooms_asked_on_a_connection_that_dropped_are_looked_up_at_once_and_fail_when_the_route_is_gone():
    """Nothing triggered a look-up for them before: they waited out their deadlines for a rank that is gone."""
    c = core(deadline_s=60.0)
    routed(c)
    token, actions = c.receive(10.0, spec(1, slot=1))
    assert [type(a) for a in actions] == [SendAsk]
    assert c.connection_dropped(10.5, ENCODE) == [LookUpRoute(KEY0)]
    assert c.stage(1) == "asked"
    actions = c.route_missing(10.6, KEY0, NO_ROUTE)
    assert concluded(actions)[1].detail == gone(1, ASKED_THERE)
    assert Disconnect(ENCODE) in actions, "nothing needs the old address's socket any more"
    assert not c.safe(1, token), "it was asked: only its quarantine makes its memory safe"
    assert c.abandon(10.7, 1, token) == [], "no cancel on a fresh connection, which could overtake the ask"


def test_a_room_asked_on_a_connection_still_up_keeps_waiting_when_its_route_is_gone():
    """Its rank may serve on while the server lost its table (a restarted server): the room that waited for a
    socket there fails, the one the rank has keeps waiting, and so does the socket it was asked on."""
    c = core()
    routed(c)
    asked, _ = c.receive(0.0, spec(1, slot=1))
    c.refused(0.1, ENCODE, c.receive(0.1, spec(2, slot=2))[1])  # the socket takes no more for now
    assert c.tick(0.1 + QUEUED_LOOKUP_S) == [LookUpRoute(KEY0)]
    actions = c.route_missing(2.2, KEY0, NO_ROUTE)
    assert list(concluded(actions)) == [2] and c.stage(1) == "asked"
    assert c.connected(ENCODE) and Disconnect(ENCODE) not in actions
    assert [type(a) for a in c.abandon(2.3, 1, asked)] == [SendCancel], "its cancel goes on its connection"


def test_a_held_ask_for_a_route_gone_fails_with_the_others():
    c = core()
    routed(c)
    first, _ = c.receive(0.0, spec(1, slot=1))
    assert [type(a) for a in c.abandon(0.1, 1, first)] == [SendCancel]
    c.clear(0.1, 1, first)
    c.receive(0.2, spec(1, slot=1))
    assert c.stage(1) == "held", "it waits for the answer to the cancel of the earlier ask"
    c.connection_dropped(0.3, ENCODE)
    assert c.receive(0.3, spec(2, slot=2))[1] == [LookUpRoute(KEY0)]
    failures = concluded(c.route_missing(0.4, KEY0, NO_ROUTE))
    assert failures[1].detail == gone(1, NEVER_ASKED) and failures[2].detail == gone(2, NEVER_ASKED)
    assert c.tick(1.0) == [], "the held ask does not go out once its wait is over"


def test_a_missing_route_is_an_answer_the_servers_other_routes_are_still_asked():
    """A 404 is the server answering, however slowly (a loaded host): it opens no breaker for the server's
    other routes, and it closes one a slow failure opened."""
    c = core(tp_size=3)
    routed(c, tp=3, dp=3)  # room r is of dp group r % 3; group 0's route is found
    c.receive(0.1, spec(3, slot=3))  # asked of group 0's rank
    assert c.connection_dropped(0.5, ENCODE) == [LookUpRoute(KEY0)]
    assert c.receive(0.6, spec(1, slot=1))[1] == [LookUpRoute((BOOT, 1, 0))]
    c.lookup_failed(2.0, BOOT, (BOOT, 1, 0), "timed out", took_s=1.4)
    assert "not asked again" in concluded(c.receive(2.1, spec(4, slot=4))[1])[4].detail
    assert list(concluded(c.route_missing(2.2, KEY0, NO_ROUTE))) == [3]  # its answer took 1.7 s
    assert c.breaker.refusal(BOOT, 2.3) is None
    assert c.receive(2.3, spec(7, slot=7))[1] == [LookUpRoute((BOOT, 1, 0))], "group 1's route is asked for"
    assert [type(a) for a in c.route_resolved(2.4, (BOOT, 1, 0), ("10.0.0.2", 7001))] == [Announce, SendAsk]


def test_the_look_up_threads_deliver_a_404_as_a_missing_route_however_long_it_took(monkeypatch):
    from transfer.bootstrap import BootstrapClient
    from transfer.drive.prefill import _LookUps
    from transfer.errors import BootstrapNoRoute

    clock = iter([10.0, 12.5])

    def registration(client, engine_rank, dp_group):
        raise BootstrapNoRoute(f"no route for encode rank {engine_rank} in dp group {dp_group} at {client.address}")
    monkeypatch.setattr(BootstrapClient, "registration", registration)
    lookups = _LookUps("test", 5.0, lambda: next(clock), lambda result: None, 1)
    assert lookups._look_up(LookUpRoute(KEY0)) == ("missing", KEY0, NO_ROUTE)


def test_a_rank_registered_again_after_its_route_was_gone_serves_the_next_rooms():
    c = core()
    routed(c)
    c.connection_dropped(0.1, ENCODE)
    c.receive(0.2, spec(1, slot=1))
    c.route_missing(0.3, KEY0, NO_ROUTE)
    c.receive(1.0, spec(2, slot=2))
    moved = ("10.0.0.2", 7001)
    assert [(type(a), a.addr) for a in c.route_resolved(1.1, KEY0, moved)] == [(Announce, moved), (SendAsk, moved)]
    assert c.stage(2) == "asked" and c.route(KEY0) == moved
    c.connection_dropped(1.2, moved)
    failures = concluded(c.route_missing(1.3, KEY0, NO_ROUTE))
    assert "(it was at 10.0.0.2:7001)" in failures[2].detail and failures[2].detail.endswith(ASKED_THERE)


def test_the_look_up_a_drop_made_for_its_asked_rooms_leaves_a_route_to_the_same_address_forgotten():
    """The server still names the address that dropped (a rank restarting elsewhere has not registered
    yet): the asked room keeps waiting, and the next room looks the route up again, finding it where it
    registered meanwhile, rather than being asked where nothing listens; the room asked of the process
    that went away fails then."""
    c = core()
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    assert c.connection_dropped(0.1, ENCODE) == [LookUpRoute(KEY0)]
    assert c.route_resolved(0.2, KEY0, ENCODE) == [] and c.stage(1) == "asked"
    assert c.route(KEY0) is None
    assert c.receive(1.0, spec(2, slot=2))[1] == [LookUpRoute(KEY0)]
    moved = ("10.0.0.2", 7001)
    failed, *actions = c.route_resolved(1.1, KEY0, moved)
    assert isinstance(failed, Conclude) and failed.room == 1
    assert [(type(a), a.addr) for a in actions] == [(Disconnect, ENCODE), (Announce, moved), (SendAsk, moved)]
    assert c.route(KEY0) == moved


def test_with_encode_dp_a_route_gone_names_the_engine_rank_its_statuses_carry():
    # Encode world 4 in dp 2: room 7 goes to group 1, whose tp rank 1 is engine rank 3.
    c = core(engine_rank=1, tp_size=4)
    c.receive(0.0, spec(7))
    c.parallel_resolved(0.0, BOOT, 4, 2)
    c.route_resolved(0.1, (BOOT, 1, 1), ENCODE)
    c.connection_dropped(0.2, ENCODE)
    [failure] = concluded(c.route_missing(0.3, (BOOT, 1, 1), "no route")).values()
    assert failure.detail.startswith(f"encode rank 3 (dp group 1) is no longer registered at bootstrap {BOOT}")


def _two_groups_found(c) -> None:
    """Prefill tp 2 over an encode side of 2 ranks in 2 dp groups: rooms go by their parity, each group's one
    rank found (group 0's at ENCODE, group 1's at GROUP1), and those rooms cleared."""
    assert c.receive(0.0, spec(0))[1] == [LookUpParallel(BOOT)]
    assert c.parallel_resolved(0.0, BOOT, 2, 2) == [LookUpRoute(KEY0)]
    assert SendAsk in [type(a) for a in c.route_resolved(0.0, KEY0, ENCODE)]
    assert c.receive(0.0, spec(1, slot=1))[1] == [LookUpRoute(KEY1)]
    assert SendAsk in [type(a) for a in c.route_resolved(0.0, KEY1, GROUP1)]
    c.clear(0.0, 0)
    c.clear(0.0, 1)


KEY1, GROUP1 = (BOOT, 1, 0), ("10.0.0.4", 7000)


def test_a_missing_route_has_the_sizes_read_again_and_rooms_follow_a_deployment_resized_since():
    """The encode side restarted with one dp group where it had two: group 1's route is gone, and the rooms
    that would go there fail. The 404 has the sizes read again, rooms waiting for nothing meanwhile, and
    once the server tells the new sizes every room goes to group 0, not to the gone group for ever."""
    c = core(tp_size=2)
    _two_groups_found(c)
    c.connection_dropped(0.1, GROUP1)
    assert c.receive(0.2, spec(3, slot=3))[1] == [LookUpRoute(KEY1)]
    actions = c.route_missing(0.3, KEY1, f"no route for encode rank 0 in dp group 1 at {BOOT}")
    assert list(concluded(actions)) == [3]
    assert LookUpParallel(BOOT) in actions
    # Rooms of the route still found meanwhile go as before, on the sizes known.
    assert SendAsk in [type(a) for a in c.receive(0.35, spec(4, slot=4))[1]]
    assert c.route_missing(0.36, KEY1, "no route") == [], "one read of the sizes at a time"
    assert c.parallel_resolved(0.4, BOOT, 2, 1) == []
    # Group 0's one route was computed under the old sizes too: it is looked up again, then every room goes there.
    assert c.receive(0.5, spec(5, slot=5))[1] == [LookUpRoute(KEY0)]
    assert SendAsk in [type(a) for a in c.route_resolved(0.6, KEY0, ENCODE)]
    assert SendAsk in [type(a) for a in c.receive(0.7, spec(7, slot=7))[1]]


def test_sizes_read_again_and_found_unchanged_keep_every_route_and_a_failed_read_fails_no_room():
    c = core(tp_size=2)
    _two_groups_found(c)
    c.connection_dropped(0.1, GROUP1)
    c.receive(0.2, spec(3, slot=3))
    assert LookUpParallel(BOOT) in c.route_missing(0.3, KEY1, "no route")
    assert c.lookup_failed(0.4, BOOT, None, "bootstrap server unreachable for parallel info: timed out", 0.01) == []
    assert SendAsk in [type(a) for a in c.receive(0.5, spec(4, slot=4))[1]], "the sizes known still serve"
    c.receive(0.6, spec(5, slot=5))
    assert LookUpParallel(BOOT) in c.route_missing(0.7, KEY1, "no route"), "read again after the failed read"
    assert c.parallel_resolved(0.8, BOOT, 2, 2) == []
    assert SendAsk in [type(a) for a in c.receive(0.9, spec(6, slot=6))[1]], "group 0's route kept"

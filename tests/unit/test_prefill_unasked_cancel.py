"""PrefillCore failing a room before its ask went out: an unasked cancel tells its encode rank (ours), which
would otherwise hold the item, and the asks of the rest of the room's fanout, until its fanout timeout."""

from __future__ import annotations

from prefill_rooms import BOOT, ENCODE, KEY0, spec
from prefill_rooms import core as prefill_core

from transfer.core.failure import FailureKind
from transfer.core.prefill import Conclude, LookUpParallel, LookUpRoute, PrefillCore, SendAsk, SendCancel
from transfer.frames import Cancel, parse_cancel

INSTANCE = "5f0c" * 8  # the nonce our bootstrap server names an encode rank's registration by


def of(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


def _asked_then_cut(c: PrefillCore, instance: str | None) -> None:
    """Room 1 asked of the encode rank (its route found, named `instance`), then its connection dropped and a
    look-up of its bootstrap server timed out: the server is not asked again for a while."""
    _, actions = c.receive(0.0, spec(1, slot=1))
    assert actions == [LookUpParallel(BOOT)]
    assert c.parallel_resolved(0.0, BOOT, 1, 1) == [LookUpRoute(KEY0)]
    assert SendAsk in [type(a) for a in c.route_resolved(0.0, KEY0, ENCODE, instance)]
    assert c.connection_dropped(5.0, ENCODE) == [LookUpRoute(KEY0)]
    c.lookup_failed(7.0, BOOT, KEY0, "timed out", took_s=2.0)
    assert c.route(KEY0) is None and c.connected(ENCODE)


def test_a_room_failed_before_its_ask_tells_its_encode_rank_with_an_unasked_cancel():
    c = prefill_core()
    _asked_then_cut(c, INSTANCE)
    token, actions = c.receive(7.5, spec(2, slot=2))
    [conclude] = of(Conclude, actions)
    assert conclude.failure.kind is FailureKind.BOOTSTRAP
    [cancel] = of(SendCancel, actions)
    assert (cancel.addr, cancel.room, cancel.rank, cancel.token, cancel.unasked) == (ENCODE, 2, 0, token, True)
    assert parse_cancel(cancel.frames) == Cancel(2, "10.0.0.3", 5555, "10.0.0.3:1234", unasked=True)
    # Nothing awaits an answer: the room's memory was never offered.
    assert c.safe(2, token) and c.pending_cancels == 0
    c.clear(7.5, 2, token)


def test_no_unasked_cancel_goes_to_an_encode_rank_the_bootstrap_server_did_not_name_as_ours():
    c = prefill_core()
    _asked_then_cut(c, None)  # a peer's registration, or a peer's bootstrap server: a cancel is a malformed ask there
    token, actions = c.receive(7.5, spec(2, slot=2))
    assert of(SendCancel, actions) == [] and of(Conclude, actions)[0].failure.kind is FailureKind.BOOTSTRAP


def test_no_unasked_cancel_without_a_known_encode_rank_or_a_connection_to_it():
    c = prefill_core()
    _, actions = c.receive(0.0, spec(1, slot=1))
    actions = c.lookup_failed(2.0, BOOT, None, "timed out", took_s=2.0)  # the sizes: no encode rank known
    assert of(SendCancel, actions) == [] and len(of(Conclude, actions)) == 1
    c2 = prefill_core()
    c2.receive(0.0, spec(1, slot=1))
    c2.parallel_resolved(0.0, BOOT, 1, 1)
    actions = c2.lookup_failed(2.0, BOOT, KEY0, "timed out", took_s=2.0)  # never found: no address, no connection
    assert of(SendCancel, actions) == [] and len(of(Conclude, actions)) == 1


def test_a_room_asked_for_again_while_its_earlier_asks_cancel_awaits_answers_sends_no_unasked_one():
    c = prefill_core(deadline_s=10.0)
    _, actions = c.receive(0.0, spec(1, slot=1))
    c.parallel_resolved(0.0, BOOT, 1, 1)
    c.route_resolved(0.0, KEY0, ENCODE, INSTANCE)
    token = c.token(1)
    assert len(of(SendCancel, c.abandon(1.0, 1, token))) == 1  # given up: its cancel awaits answers
    c.clear(1.0, 1, token)
    c.receive(1.0, spec(1, slot=2))
    assert c.stage(1) == "held"  # its ask waits for that cancel's answer
    actions = c.tick(11.0)
    assert of(Conclude, actions)[0].failure.kind is FailureKind.DEADLINE
    # An encode rank of an earlier release would answer an unasked cancel as a plain one, taken for the other's.
    assert [a for a in of(SendCancel, actions) if a.unasked] == []

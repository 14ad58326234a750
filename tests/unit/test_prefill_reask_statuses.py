"""A room asked for again while an earlier ask of its number may still be served by its encode rank.

Statuses name only the room and the encode rank, so a Success for the earlier ask (written
into that ask's memory) looks like one for the new ask. The prefill core holds such statuses
back while the earlier ask's cancel waits for its answer on the same connection from a rank
known to answer cancels; these are the cases where it cannot: the earlier ask was given up with
no cancel (its connection was dropped first), its cancel went on a connection dropped since, or
its rank never answered a cancel and the new ask stopped waiting. The encode rank (stopped a
while, say) then reads the earlier ask first and serves it. Such a Success must not conclude the
new ask Success over memory nothing was written to.
"""

from __future__ import annotations

import pytest
from core_pair import Pair

from transfer.core.failure import FailureKind

ROOM, OTHER = 1, 3


def given_up_without_cancel(pair: Pair) -> None:
    """The earlier ask is parked at the encode rank; another room's silence drops the connection before the
    caller gives the room up, so no cancel is sent; the new ask goes on a fresh connection."""
    pair.receive(0, OTHER)  # never sent: its deadline finds the rank silent
    pair.drain("lookup", "request")
    pair.tick(1.0)
    pair.receive(0, ROOM)
    pair.drain("request")  # the earlier ask reaches the (stopped) encode rank's socket
    pair.tick(1.0)  # OTHER's deadline: nothing came from the rank since it was asked, so the connection goes
    pair.clear_receive(0, ROOM)  # asked on the dropped connection: no cancel
    pair.receive(0, ROOM)
    pair.drain("lookup")


def cancelled_on_a_dropped_connection(pair: Pair) -> None:
    """The earlier ask's own deadline passes with the rank silent: its cancel goes out ahead of the
    connection's close, unread yet; the new ask goes on a fresh connection."""
    pair.receive(0, ROOM)
    pair.drain("lookup", "request")
    pair.tick(2.0)
    pair.clear_receive(0, ROOM)
    pair.receive(0, ROOM)
    pair.drain("lookup")


def cancel_unanswered_past_the_wait(pair: Pair) -> None:
    """The earlier ask is cancelled on the same connection; the rank, never seen to answer a cancel, leaves
    it unanswered past CANCEL_ANSWER_WAIT_S, so the new ask goes out behind the cancel."""
    pair.receive(0, ROOM)
    pair.drain("lookup", "request")
    pair.clear_receive(0, ROOM)
    pair.receive(0, ROOM)
    pair.tick(0.6)


@pytest.mark.parametrize("integrity", [False, True])
@pytest.mark.parametrize("earlier", [given_up_without_cancel, cancelled_on_a_dropped_connection,
                                     cancel_unanswered_past_the_wait])
def test_the_earlier_asks_success_does_not_conclude_the_new_ask_success(earlier, integrity):
    pair = Pair(deadline_s=2.0, integrity=integrity)
    earlier(pair)
    retry = pair.all_receives[-1]
    assert retry.outcome() == "open"
    pair.offer(0, ROOM)  # the encode rank, resumed, serves the earlier ask it read first
    pair.drain("land", "complete")
    assert retry.landed == 0
    pair.drain("status", "verify")  # the pair raises Violation on a Success over bytes that did not land
    assert retry.outcome() != "Success"
    failure = retry.concluded[0] if retry.concluded else None
    assert failure is not None
    assert failure.kind is (FailureKind.CHECKSUM if integrity else FailureKind.OTHER)
    assert "earlier ask" in failure.detail and f"room {ROOM}" in failure.detail
    pair.settle()
    assert retry.outcome() != "Success" and retry.landed == 0


def test_the_new_ask_served_itself_is_taken_once_its_bytes_are_verified():
    """With integrity on, the checksums tell the new ask's own Success from the earlier ask's."""
    pair = Pair(deadline_s=2.0, integrity=True)
    given_up_without_cancel(pair)
    pair.drain("request")  # the new ask reaches the rank before the item: it replaces the earlier one
    pair.offer(0, ROOM)
    pair.settle()
    retry = pair.all_receives[-1]
    assert retry.outcome() == "Success" and retry.landed == 1

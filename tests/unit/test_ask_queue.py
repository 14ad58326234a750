"""Asks waiting for their encode rank's connection (transfer.core.ask_queue)."""

from __future__ import annotations

from transfer.core.ask_queue import MAX_UNSENT_ASKS, AskQueues


def test_asks_leave_in_the_order_they_came_per_address():
    queues = AskQueues()
    for ask in ("a1", "a2", "a3"):
        queues.push("A", ask)
    queues.push("B", "b1")
    assert queues.waiting("A") == 3 and queues.waiting("B") == 1 and len(queues) == 4
    assert queues.take("A", 2) == ["a1", "a2"]
    assert queues.take("A", 5) == ["a3"]
    assert queues.waiting("A") == 0 and queues.addresses() == ["B"]


def test_asks_put_back_go_first_in_their_order():
    queues = AskQueues()
    queues.push("A", "a3")
    queues.put_back("A", ["a1", "a2"])
    assert queues.take("A", 10) == ["a1", "a2", "a3"]


def test_a_full_queue_says_so_at_its_limit():
    queues = AskQueues(limit=2)
    queues.push("A", 1)
    assert not queues.full("A")
    queues.push("A", 2)
    assert queues.full("A") and not queues.full("B")
    assert AskQueues().limit == MAX_UNSENT_ASKS


def test_dropping_an_address_hands_back_everything_it_held():
    queues = AskQueues()
    queues.push("A", 1)
    queues.push("A", 2)
    assert queues.drop("A") == [1, 2]
    assert queues.drop("A") == [] and queues.take("A", 1) == [] and len(queues) == 0


def test_removing_takes_the_picked_asks_in_order_and_leaves_the_rest_in_theirs():
    """The prefill core moves a rank's waiting asks to its new address with remove(): those it picks must leave
    oldest first, the others keep their place, an address left empty is forgotten, and one with nothing
    waiting gives nothing (rather than raising)."""
    queues = AskQueues()
    for ask in (1, 2, 3, 4):
        queues.push("A", ask)
    assert queues.remove("A", lambda ask: ask % 2 == 0) == [2, 4]
    assert queues.items("A") == [1, 3]
    assert queues.remove("A", lambda ask: ask > 10) == [] and queues.items("A") == [1, 3]
    assert queues.remove("A", lambda ask: True) == [1, 3] and queues.addresses() == []
    assert queues.remove("B", lambda ask: True) == [] and len(queues) == 0

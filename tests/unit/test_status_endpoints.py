"""Which status endpoints keep a connection (transfer._io.StatusEndpoints), on a fake clock."""

from __future__ import annotations

import pytest

from transfer._io import StatusEndpoints


def test_a_new_endpoint_is_connecting_until_it_connects():
    table = StatusEndpoints(limit=4, idle_s=60.0, connect_s=5.0)
    assert table.use("a", now=0.0) == []
    assert table.is_connecting("a") and table.connecting() == ["a"]
    table.connected("a")
    assert not table.is_connecting("a") and "a" in table


def test_beyond_the_limit_the_least_recently_used_is_closed_for_a_new_one():
    table = StatusEndpoints(limit=3)
    for t, key in enumerate("abc"):
        table.use(key, now=float(t))
    table.use("a", now=3.0)  # a is now the most recently used
    assert table.use("d", now=4.0) == ["b"]
    assert table.use("e", now=5.0) == ["c"]
    assert len(table) == 3 and {"a", "d", "e"} == {k for k in "abcde" if k in table}


def test_endpoints_that_never_connected_make_room_before_a_connected_one():
    # A peer naming a new endpoint nobody listens at in each ask told Failed at once would otherwise
    # close every receiver's live connection (dropping the statuses queued on it) within `limit` asks.
    table = StatusEndpoints(limit=4)
    table.use("receiver", now=0.0)
    table.connected("receiver")
    closed = []
    for i in range(100):
        closed += table.use(("dead", i), now=1.0 + i)
    assert "receiver" in table and "receiver" not in closed and len(table) == 4
    for key in "abcd":  # every one connected: the least recently used goes
        table.use(key, now=200.0)
        table.connected(key)
    assert "receiver" not in table


def test_a_new_endpoint_is_always_admitted_even_among_thousands():
    table = StatusEndpoints(limit=8)
    closed = []
    for i in range(5000):
        closed += table.use(("dead", i), now=i * 0.001)
    assert table.use("receiver", now=10.0) == [("dead", 4992)]
    assert "receiver" in table and len(table) == 8 and len(closed) == 5000 - 8


def test_an_endpoint_that_does_not_connect_in_time_is_unreachable():
    table = StatusEndpoints(limit=8, idle_s=60.0, connect_s=5.0)
    table.use("dead", now=0.0)
    table.use("live", now=1.0)
    table.connected("live")
    assert table.expired(now=4.9) == []
    assert table.expired(now=5.0) == [("dead", "unreachable")]
    assert "dead" not in table and "live" in table


def test_an_endpoint_unused_for_the_idle_time_is_closed_oldest_first():
    table = StatusEndpoints(limit=8, idle_s=60.0, connect_s=5.0)
    for t, key in enumerate("abc"):
        table.use(key, now=float(t))
        table.connected(key)
    table.use("a", now=30.0)
    assert table.expired(now=61.0) == [("b", "idle")]
    assert table.expired(now=62.0) == [("c", "idle")]
    assert table.expired(now=89.0) == []
    assert table.expired(now=90.0) == [("a", "idle")]
    assert len(table) == 0 and table.next_expiry() is None


def test_next_expiry_is_the_earliest_deadline():
    table = StatusEndpoints(limit=8, idle_s=60.0, connect_s=5.0)
    assert table.next_expiry() is None
    table.use("a", now=0.0)
    assert table.next_expiry() == 5.0
    table.connected("a")
    assert table.next_expiry() == 60.0
    table.use("b", now=100.0)
    assert table.next_expiry() == 60.0  # a's idle time ends first
    table.expired(now=60.0)
    assert table.next_expiry() == 105.0


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="at least one status connection"):
        StatusEndpoints(limit=0)

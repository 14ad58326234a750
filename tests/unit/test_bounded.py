"""remember(): a bounded dict of recent entries, newest last, the oldest forgotten first."""

from __future__ import annotations

from transfer.core.bounded import remember


def test_entries_are_kept_in_the_order_filed():
    cache: dict = {}
    for key in "abc":
        remember(cache, key, key.upper(), limit=3)
    assert list(cache.items()) == [("a", "A"), ("b", "B"), ("c", "C")]


def test_past_the_limit_the_oldest_is_forgotten():
    cache: dict = {}
    for number in range(5):
        remember(cache, number, number * 10, limit=3)
    assert cache == {2: 20, 3: 30, 4: 40}


def test_a_key_filed_again_becomes_the_newest_with_its_new_value():
    cache: dict = {}
    for key in "abc":
        remember(cache, key, 0, limit=3)
    remember(cache, "a", 1, limit=3)
    remember(cache, "d", 0, limit=3)
    assert list(cache.items()) == [("c", 0), ("a", 1), ("d", 0)]


def test_a_cache_over_its_limit_is_cut_down_to_it():
    cache = {number: None for number in range(5)}
    remember(cache, "new", None, limit=2)
    assert list(cache) == [4, "new"]

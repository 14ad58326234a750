"""remember() and forget_before(): a bounded dict of recent entries, newest last, the oldest forgotten first."""

from __future__ import annotations

from typing import NamedTuple

from transfer.core.bounded import forget_before, remember


class _Entry(NamedTuple):
    filed_at: float


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


def test_entries_filed_before_the_cutoff_are_forgotten_and_the_rest_kept():
    cache: dict = {}
    for key, at in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        remember(cache, key, _Entry(at), limit=10)
    forget_before(cache, 2.0)
    assert list(cache) == ["b", "c"]
    forget_before(cache, 10.0)
    assert cache == {}


def test_forgetting_stops_at_the_first_entry_filed_in_time():
    cache = {"late": _Entry(5.0), "early": _Entry(1.0)}  # filed out of time order
    forget_before(cache, 3.0)
    assert list(cache) == ["late", "early"]

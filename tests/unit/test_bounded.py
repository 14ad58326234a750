"""remember() and forget_before(): a bounded dict of recent entries, newest last, the oldest forgotten first;
BySession: such a dict whose entries are also found by the sessions they name."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from transfer.core.bounded import BySession, forget_before, remember


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


class _Cancel(NamedTuple):
    sessions: tuple[str, ...]
    filed_at: float = 0.0


def _by_session() -> BySession[int, _Cancel]:
    return BySession(lambda entry: entry.sessions)


def test_entries_are_found_by_each_session_they_name():
    cache = _by_session()
    cache[1] = _Cancel(("a",))
    cache[2] = _Cancel(("a", "b"))
    cache[3] = _Cancel(("c",))
    assert (cache.of("a"), cache.of("b"), cache.of("c"), cache.of("d")) == ([1, 2], [2], [3], [])


def test_an_entry_replaced_or_deleted_is_found_by_its_sessions_no_more():
    cache = _by_session()
    cache[1] = _Cancel(("a",))
    cache[2] = _Cancel(("a",))
    cache[1] = _Cancel(("b",))
    del cache[2]
    assert (cache.of("a"), cache.of("b")) == ([], [1])
    assert list(cache.items()) == [(1, _Cancel(("b",)))]  # kept its place, as a dict does
    cache.clear()
    assert (cache.of("b"), len(cache)) == ([], 0)
    cache[4] = _Cancel(("d",))  # filed after a clear: `get` (the entries' own) finds it
    assert (cache.get(4), cache.get(1), cache.get(1, "none")) == (_Cancel(("d",)), None, "none")


def test_a_bounded_memory_by_session_forgets_like_a_dict():
    cache, plain = _by_session(), {}
    for number in range(6):
        for memory in (cache, plain):
            remember(memory, number % 4, _Cancel((f"s{number % 2}",), float(number)), limit=3)
    forget_before(cache, 4.0)
    forget_before(plain, 4.0)
    assert list(cache.items()) == list(plain.items()) and 99 not in cache and cache.get(99) is None
    assert (cache.of("s0"), cache.of("s1")) == ([0], [1])


def test_views_by_session_are_the_entries_own():
    cache = _by_session()
    cache[1] = _Cancel(("a",))
    cache[2] = _Cancel(("b",), 2.0)
    del cache[1]
    cache[3] = _Cancel(("a",), 3.0)
    assert list(cache.keys()) == [2, 3]
    assert [entry.filed_at for entry in cache.values()] == [2.0, 3.0]
    assert dict(cache.items()) == {2: _Cancel(("b",), 2.0), 3: _Cancel(("a",), 3.0)}


def test_pop_takes_an_entry_and_its_sessions_as_a_dict_pops():
    cache = _by_session()
    cache[1] = _Cancel(("a", "b"))
    cache[2] = _Cancel(("a",))
    assert cache.pop(1) == _Cancel(("a", "b"))
    assert (cache.of("a"), cache.of("b"), list(cache)) == ([2], [], [2])
    assert cache.pop(1, None) is None and cache.pop(1, "none") == "none"
    with pytest.raises(KeyError):
        cache.pop(1)
    assert cache.pop(2, None) == _Cancel(("a",)) and cache.of("a") == [] and len(cache) == 0


def test_entries_is_the_book_itself_through_every_change():
    book: BySession[int, _Entry] = BySession(lambda entry: ("s",))
    assert not book.entries
    book[1] = _Entry(1.0)
    remember(book, 2, _Entry(2.0), limit=2)
    assert book.entries == {1: _Entry(1.0), 2: _Entry(2.0)}
    del book[1]
    assert book.entries == {2: _Entry(2.0)}
    forget_before(book, 3.0)
    assert not book.entries
    book[3] = _Entry(3.0)
    book.clear()
    assert not book.entries and len(book) == 0
    book[4] = _Entry(4.0)
    assert book.pop(4) == _Entry(4.0) and not book.entries


def test_an_entry_is_read_back_by_its_key_and_a_key_never_filed_is_a_key_error():
    """The cores read an entry by key (`cache[key]`) where they know it is filed: a key not filed must raise, not
    answer a default that a rule would take for an entry."""
    cache = _by_session()
    cache[1] = _Cancel(("a",))
    assert cache[1] == _Cancel(("a",))
    with pytest.raises(KeyError):
        cache[2]


def test_an_entry_naming_a_session_twice_is_filed_once_under_it_and_forgotten_cleanly():
    """`sessions` may name a session more than once (a room's receivers, say): unfiling such an entry meets the
    session again after its index went, which must not raise and must leave no index behind."""
    cache = _by_session()
    cache[1] = _Cancel(("a", "a", "b"))
    assert (cache.of("a"), cache.of("b")) == ([1], [1])
    del cache[1]
    assert (cache.of("a"), cache.of("b"), len(cache)) == ([], [], 0)
    cache[2] = _Cancel(("a", "a"))
    assert cache.pop(2) == _Cancel(("a", "a")) and cache.of("a") == []

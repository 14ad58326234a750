"""Bounded memories of recent entries: newest last, the oldest forgotten first."""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, MutableMapping, ValuesView
from typing import Any, Protocol, TypeVar


class Filed(Protocol):
    """An entry that says when it was filed."""

    @property
    def filed_at(self) -> float: ...


_F = TypeVar("_F", bound=Filed)


def remember(cache: MutableMapping, key: Any, value: Any, limit: int) -> None:
    """Files `value` under `key` as the newest entry, forgetting the oldest past `limit`.

    A key filed again moves to the newest place (a dict keeps insertion order).
    """
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > limit:
        del cache[next(iter(cache))]


def forget_before(cache: MutableMapping[Any, _F], oldest: float) -> None:
    """Forgets the entries filed before `oldest`, oldest first (each entry's `filed_at` says when)."""
    while cache:
        key, value = next(iter(cache.items()))
        if value.filed_at >= oldest:
            return
        del cache[key]


_K = TypeVar("_K")
_V = TypeVar("_V")
_ABSENT: Any = object()


class BySession(MutableMapping[_K, _V]):
    """A dict whose entries are also found by the sessions each names, without a scan of the others.

    `sessions` says which sessions an entry names; it must not change while the entry is
    filed. Insertion order is the dict's, so `remember` and `forget_before` work on it.
    """

    def __init__(self, sessions: Callable[[_V], Iterable[str]]) -> None:
        self._sessions = sessions
        self._entries: dict[_K, _V] = {}
        # The same dict, read-only to others: its truth says whether any entry is filed without __len__'s call.
        self.entries = self._entries
        # The dict's own get, which the method below only documents: one call on the rules' hot path.
        self.get = self._entries.get  # type: ignore[method-assign,assignment]
        self._by_session: dict[str, dict[_K, None]] = {}  # session -> keys of the entries naming it

    def of(self, session: str) -> list[_K]:
        """The keys of the entries that name `session`, oldest filed first."""
        return list(self._by_session.get(session, ()))

    def __getitem__(self, key: _K) -> _V:
        return self._entries[key]

    def __setitem__(self, key: _K, value: _V) -> None:
        if key in self._entries:
            self._unindex(key, self._entries[key])
        self._entries[key] = value
        for session in self._sessions(value):
            self._by_session.setdefault(session, {})[key] = None

    def __delitem__(self, key: _K) -> None:
        self._unindex(key, self._entries.pop(key))

    def __contains__(self, key: object) -> bool:
        return key in self._entries  # one dict look-up: safe to ask from another thread

    def get(self, key: _K, default: Any = None) -> Any:
        return self._entries.get(key, default)

    def __iter__(self) -> Iterator[_K]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    # The dict's own views: Mapping's would cost four Python calls an iteration (the rules' hot paths walk these).
    def keys(self) -> KeysView[_K]:
        return self._entries.keys()

    def values(self) -> ValuesView[_V]:
        return self._entries.values()

    def items(self) -> ItemsView[_K, _V]:
        return self._entries.items()

    def clear(self) -> None:
        self._entries.clear()
        self._by_session.clear()

    def pop(self, key: _K, default: Any = _ABSENT) -> Any:
        """MutableMapping's pop in one dict look-up: its own raises a KeyError inside for every key absent."""
        value = self._entries.pop(key) if default is _ABSENT else self._entries.pop(key, _ABSENT)
        if value is _ABSENT:
            return default
        self._unindex(key, value)
        return value

    def _unindex(self, key: _K, value: _V) -> None:
        for session in self._sessions(value):
            keys = self._by_session.get(session)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._by_session[session]

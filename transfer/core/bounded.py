"""A bounded memory of recent entries: newest last, the oldest forgotten first."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar


class Filed(Protocol):
    """An entry that says when it was filed."""

    @property
    def filed_at(self) -> float: ...


_F = TypeVar("_F", bound=Filed)


def remember(cache: dict, key: Any, value: Any, limit: int) -> None:
    """Files `value` under `key` as the newest entry, forgetting the oldest past `limit`.

    A key filed again moves to the newest place (a dict keeps insertion order).
    """
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > limit:
        del cache[next(iter(cache))]


def forget_before(cache: dict[Any, _F], oldest: float) -> None:
    """Forgets the entries filed before `oldest`, oldest first (each entry's `filed_at` says when)."""
    while cache:
        key, value = next(iter(cache.items()))
        if value.filed_at >= oldest:
            return
        del cache[key]

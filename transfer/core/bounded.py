"""A bounded memory of recent entries: newest last, the oldest forgotten first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def remember(cache: dict, key: Any, value: Any, limit: int) -> None:
    """Files `value` under `key` as the newest entry, forgetting the oldest past `limit`.

    A key filed again moves to the newest place (a dict keeps insertion order).
    """
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > limit:
        del cache[next(iter(cache))]


def forget_before(cache: dict, oldest: float, filed_at: Callable[[Any], float]) -> None:
    """Forgets the entries filed before `oldest` (`filed_at(value)` says when one was), oldest first."""
    while cache:
        key, value = next(iter(cache.items()))
        if filed_at(value) >= oldest:
            return
        del cache[key]

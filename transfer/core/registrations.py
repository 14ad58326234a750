"""An engine's registered regions, found by address in logarithmic time."""

from __future__ import annotations

import bisect
from typing import Any

__all__ = ["Registrations"]


class Registrations(dict[int, int]):
    """Registered regions, base address -> length, that also keep their bases sorted.

    The regions are disjoint (both engines refuse a registration that overlaps another), so
    the one region that may hold or overlap a range is the last that starts before its end:
    `holding()` and `overlapping()` look at that one only, however many are registered. A
    sender pool registers each source outside registered memory for its room, so an engine
    may hold thousands while items wait for their receivers; each send and each write looks
    its source up here.
    """

    __slots__ = ("_bases",)

    def __init__(self) -> None:
        super().__init__()
        self._bases: list[int] = []

    def __setitem__(self, base: int, nbytes: int) -> None:
        if base not in self:
            bisect.insort(self._bases, base)
        super().__setitem__(base, nbytes)

    def __delitem__(self, base: int) -> None:
        super().__delitem__(base)
        del self._bases[bisect.bisect_left(self._bases, base)]

    def pop(self, base: int, *default: Any) -> Any:
        if base in self:
            del self._bases[bisect.bisect_left(self._bases, base)]
        return super().pop(base, *default)

    def clear(self) -> None:
        super().clear()
        self._bases.clear()

    def popitem(self) -> tuple[int, int]:
        base, nbytes = super().popitem()
        del self._bases[bisect.bisect_left(self._bases, base)]
        return base, nbytes

    def setdefault(self, base: int, nbytes: int = 0) -> int:
        if base not in self:
            self[base] = nbytes
        return self[base]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for base, nbytes in dict(*args, **kwargs).items():
            self[base] = nbytes

    def _last_before(self, end: int) -> int | None:
        """The last base below `end`, or None."""
        index = bisect.bisect_left(self._bases, end)
        return self._bases[index - 1] if index else None

    def holding(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """(base, length) of the region that holds [addr, addr + nbytes) whole, or None."""
        base = self._last_before(addr + 1)
        if base is None:
            return None
        length = self[base]
        return (base, length) if addr + nbytes <= base + length else None

    def overlapping(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """(base, length) of a region that shares a byte with [addr, addr + nbytes), or None."""
        if nbytes <= 0:
            return None
        base = self._last_before(addr + nbytes)
        if base is None:
            return None
        length = self[base]
        return (base, length) if base + length > addr else None

"""Source registration counts: temporary registrations the encode side made, and who holds them."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SourceCounts"]


class SourceCounts:
    """Refcounts of registrations made for sources outside registered memory.

    A region inside one of these holds it (another room's rows, say), so it stays
    registered until every room reading from it is done. One the engine would not drop
    yet (a write it gave up on still reads it) stays here at refcount 0 as unreleased,
    and is retried.
    """

    def __init__(self) -> None:
        self._held: dict[int, int] = {}  # base address -> rooms holding it
        self._unreleased: set[int] = set()

    def base_for(self, addr: int, end: int, registered: Mapping[int, int]) -> int | None:
        """Start of a registered region holding [addr, end) wholly, the caller's own first; None if none."""
        bases = [a for a, n in registered.items() if a <= addr and end <= a + n]
        return next((a for a in bases if a not in self._held), bases[0] if bases else None)

    def is_ours(self, base: int) -> bool:
        """Whether `base` is a registration we made (held or not)."""
        return base in self._held

    def hold(self, base: int) -> None:
        """One more room reads from `base` (registering it first is the caller's job)."""
        self._held[base] = self._held.get(base, 0) + 1

    def release(self, base: int) -> bool:
        """One room fewer reads from `base`; True when none does and it should be unregistered."""
        self._held[base] -= 1
        return not self._held[base]

    def idle(self, base: int) -> bool:
        """Whether `base` is ours and no room holds it."""
        return self._held.get(base) == 0

    def dropped(self, base: int) -> None:
        """The engine let go of `base` (or it is gone anyway): forget it."""
        self._held.pop(base, None)
        self._unreleased.discard(base)

    def kept(self, base: int) -> bool:
        """The engine refused to drop `base` for now; True the first time (worth a log line)."""
        first = base not in self._unreleased
        self._unreleased.add(base)
        return first

    def retry(self) -> list[int]:
        """Unreleased bases still at refcount 0, to try again; those held again leave the list."""
        due = []
        for base in list(self._unreleased):
            if self._held.get(base) == 0:
                due.append(base)
            else:
                self._unreleased.discard(base)
        return due

    @property
    def unreleased(self) -> frozenset[int]:
        return frozenset(self._unreleased)

    def counts(self) -> dict[int, int]:
        """base -> rooms holding it (a copy)."""
        return dict(self._held)

    def __len__(self) -> int:
        return len(self._held)

"""Region re-announcement, the prefill side's half of MAX_REGIONS_PER_SESSION.

An encode rank keeps only the newest MAX_REGIONS_PER_SESSION regions each session
announced (SPEC.md section 7). This book remembers, per encode rank, which regions it
was told of and in what order, and says when a region must be announced again: once
REANNOUNCE_AFTER others were announced after it, leaving the rest of the window for
rooms already asked for to be written.
"""

from __future__ import annotations

from collections.abc import Hashable

from transfer.frames import MAX_REGIONS_PER_SESSION

__all__ = ["REANNOUNCE_AFTER", "AnnounceBook", "Announcements"]

REANNOUNCE_AFTER = MAX_REGIONS_PER_SESSION // 2


class Announcements:
    """The regions one encode rank was told of, filed as it files them: newest last, bounded."""

    def __init__(self, window: int = MAX_REGIONS_PER_SESSION, reannounce_after: int = REANNOUNCE_AFTER) -> None:
        self.window = window
        self.reannounce_after = reannounce_after
        self.count = 0  # announcements made
        self.regions: dict[int, tuple[int, int]] = {}  # addr -> (length, its announcement's count)

    def holds(self, addr: int, nbytes: int) -> bool:
        """Whether the encode rank still holds the region with room to spare."""
        entry = self.regions.get(addr)
        return entry is not None and entry[0] == nbytes and self.count - entry[1] < self.reannounce_after

    def add(self, addr: int, nbytes: int) -> None:
        """Records an announcement of the region; it replaces one at the same address."""
        self.count += 1
        self.regions.pop(addr, None)
        self.regions[addr] = (nbytes, self.count)
        while len(self.regions) > self.window:
            del self.regions[next(iter(self.regions))]

    def withdraw(self, addr: int) -> None:
        """Forgets an announcement that never went out (its socket refused it)."""
        self.regions.pop(addr, None)


class AnnounceBook:
    """Announcements per encode rank (its address: the process that heard them); forgotten when its
    connection is lost, since a rank restarted there heard nothing."""

    def __init__(self, window: int = MAX_REGIONS_PER_SESSION, reannounce_after: int = REANNOUNCE_AFTER) -> None:
        self.window = window
        self.reannounce_after = reannounce_after
        self._ranks: dict[Hashable, Announcements] = {}

    def needs(self, rank: Hashable, addr: int, nbytes: int) -> bool:
        """Whether the region must be announced to `rank` before a room may land in it."""
        known = self._ranks.get(rank)
        return known is None or not known.holds(addr, nbytes)

    def announced(self, rank: Hashable, addr: int, nbytes: int) -> None:
        """Records that `rank` was told of the region."""
        known = self._ranks.get(rank)
        if known is None:
            known = self._ranks[rank] = Announcements(self.window, self.reannounce_after)
        known.add(addr, nbytes)

    def withdraw(self, rank: Hashable, addr: int) -> None:
        """Forgets one announcement that did not go out."""
        known = self._ranks.get(rank)
        if known is not None:
            known.withdraw(addr)

    def forget(self, rank: Hashable) -> None:
        """Forgets everything `rank` was told (a rank restarted there never heard it)."""
        self._ranks.pop(rank, None)

    def __len__(self) -> int:
        return len(self._ranks)

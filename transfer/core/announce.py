"""Region re-announcement, the prefill side's half of MAX_REGIONS_PER_SESSION.

An encode rank keeps only the newest MAX_REGIONS_PER_SESSION regions each session
announced (SPEC.md section 7). This book remembers, per encode rank, which regions it
was told of and in what order, and says when a region must be announced again: once
REANNOUNCE_AFTER others were announced after it, leaving the rest of the window for
rooms already asked for to be written. A region is its pair of bases (embedding,
deepstack; 0 without one), as the encode rank files it, with the pair's lengths.
"""

from __future__ import annotations

from collections.abc import Hashable

from transfer.frames import MAX_REGIONS_PER_SESSION

__all__ = ["REANNOUNCE_AFTER", "AnnounceBook", "Announcements", "Lengths", "Region"]

REANNOUNCE_AFTER = MAX_REGIONS_PER_SESSION // 2

Region = tuple[int, int]  # (embedding base, deepstack base or 0)
Lengths = tuple[int, int]  # (embedding bytes, deepstack bytes or 0)


class Announcements:
    """The regions one encode rank was told of, filed as it files them: newest last, bounded."""

    def __init__(self, window: int = MAX_REGIONS_PER_SESSION, reannounce_after: int = REANNOUNCE_AFTER) -> None:
        self.window = window
        self.reannounce_after = reannounce_after
        self.count = 0  # announcements made
        self.regions: dict[Region, tuple[Lengths, int]] = {}  # region -> (lengths, its announcement's count)

    def holds(self, region: Region, lengths: Lengths) -> bool:
        """Whether the encode rank still holds the region with room to spare."""
        entry = self.regions.get(region)
        return entry is not None and entry[0] == lengths and self.count - entry[1] < self.reannounce_after

    def add(self, region: Region, lengths: Lengths) -> None:
        """Records an announcement of the region; it replaces one at the same bases."""
        self.count += 1
        self.regions.pop(region, None)
        self.regions[region] = (lengths, self.count)
        while len(self.regions) > self.window:
            del self.regions[next(iter(self.regions))]

    def withdraw(self, region: Region) -> None:
        """Forgets an announcement that never went out (its socket refused it)."""
        self.regions.pop(region, None)


class AnnounceBook:
    """Announcements per encode rank (its address: the process that heard them); forgotten when its
    connection is lost, since a rank restarted there heard nothing."""

    def __init__(self, window: int = MAX_REGIONS_PER_SESSION, reannounce_after: int = REANNOUNCE_AFTER) -> None:
        self.window = window
        self.reannounce_after = reannounce_after
        self._ranks: dict[Hashable, Announcements] = {}

    def needs(self, rank: Hashable, region: Region, lengths: Lengths) -> bool:
        """Whether the region must be announced to `rank` before a room may land in it."""
        # known.holds(region, lengths), read by key with `in` (the books hold no None), without a call.
        if rank not in self._ranks:
            return True
        known = self._ranks[rank]
        regions = known.regions
        if region not in regions:
            return True
        entry = regions[region]
        return entry[0] != lengths or known.count - entry[1] >= known.reannounce_after

    def announced(self, rank: Hashable, region: Region, lengths: Lengths) -> None:
        """Records that `rank` was told of the region."""
        known = self._ranks.get(rank)
        if known is None:
            known = self._ranks[rank] = Announcements(self.window, self.reannounce_after)
        known.add(region, lengths)

    def withdraw(self, rank: Hashable, region: Region) -> None:
        """Forgets one announcement that did not go out."""
        known = self._ranks.get(rank)
        if known is not None:
            known.withdraw(region)

    def forget(self, rank: Hashable) -> None:
        """Forgets everything `rank` was told (a rank restarted there never heard it)."""
        self._ranks.pop(rank, None)

    def __len__(self) -> int:
        return len(self._ranks)

"""A circuit breaker keyed by anything hashable: a peer that failed slowly is skipped for a while.

The encode side keys it by prefill session (a dead peer costs the engine a reconnect
timeout per write); the prefill side keys it by bootstrap server (core/prefill_breaker.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["Breaker", "Trip"]

#: After a failure that took this long the key is paused for PAUSE_S (or until reset).
PAUSE_S = 5.0

#: Only a failure that took this long trips the breaker: a peer that refuses one request
#: (a bad destination, say) answers within milliseconds and stays usable.
SLOW_AFTER_S = 0.25

#: A failure that held its caller for `t` seconds pauses the key for STALL_FACTOR * t
#: (at most MAX_PAUSE_S) when that is longer than PAUSE_S: a peer that never answers a
#: handshake would otherwise stall everyone again each time its pause ends.
STALL_FACTOR = 4.0
MAX_PAUSE_S = 600.0


@dataclass(frozen=True)
class Trip:
    """A key the breaker just opened: since when, until when, and whether a stall set its length."""

    key: Hashable
    failed_at: float
    until: float
    stalled: bool


class Breaker:
    """Keys that failed slowly, each paused until its time is up, a reset, or a sweep forgets it."""

    def __init__(self, *, pause_s: float | None = None, slow_after_s: float | None = None,
                 stall_factor: float | None = None, max_pause_s: float | None = None,
                 max_keys: int | None = None) -> None:
        """Settings left out are the module's, read now; `max_keys` bounds the keys held (None: unbounded)."""
        self.pause_s = PAUSE_S if pause_s is None else pause_s
        self.slow_after_s = SLOW_AFTER_S if slow_after_s is None else slow_after_s
        self.stall_factor = STALL_FACTOR if stall_factor is None else stall_factor
        self.max_pause_s = MAX_PAUSE_S if max_pause_s is None else max_pause_s
        self.max_keys = max_keys
        self._open: dict[Hashable, tuple[float, float]] = {}  # key -> (failed at, paused until), oldest first
        # The same dict, for a caller's cheap test: while it is empty no key is paused or revivable, so
        # heard_from() does nothing and open_since() says None (read it; the breaker keeps it).
        self.tripped = self._open
        self._detail: dict[Hashable, str] = {}
        self._revivable: set[Hashable] = set()  # open keys whose pause a word from them ends (`heard_from`)
        self._revived: dict[Hashable, float] = {}  # key -> when a word from it ended its pause, oldest first
        # The same dict, for a caller's cheap test: while it and `tripped` are empty, succeeded() does nothing.
        self.revived = self._revived

    def failed(self, key: Hashable, took: float, now: float, *, blocking: bool = False,
               detail: str = "") -> Trip | None:
        """Records a failure that took `took` seconds; returns the trip when it opened the breaker.

        `blocking`: the call held its caller all along, so a long one scales the pause.
        `detail`: why it failed, for the refusals the pause causes.

        A word from the key (`heard_from`) ends the pause unless it is a stall's (a peer that
        accepts connections and never answers still talks) or the key failed slowly again
        after a word from it ended an earlier pause: such a key waits its pauses out until
        a write to it succeeds, it is reset, or MAX_PAUSE_S passed since.
        """
        if took < self.slow_after_s:
            return None
        pause, stalled = self.pause_s, False
        if blocking and took * self.stall_factor > pause:
            pause, stalled = min(self.max_pause_s, took * self.stall_factor), True
        self._close(key)
        if self.max_keys is not None and len(self._open) >= self.max_keys:
            self.sweep(now)
            while len(self._open) >= self.max_keys:
                self.reset(next(iter(self._open)))  # the oldest failure goes first
        self._open[key] = (now, now + pause)
        if detail:
            self._detail[key] = detail
        if not stalled and key not in self._revived:
            self._revivable.add(key)
        return Trip(key, now, now + pause, stalled)

    def heard_from(self, key: Hashable, now: float) -> bool:
        """`key` spoke (it reached us): ends its pause if a word from it may (see `failed`); True when it did."""
        if key not in self._revivable:
            return False
        if now >= self._open[key][1]:
            return False
        self._close(key)
        self._revived.pop(key, None)
        self._revived[key] = now
        if self.max_keys is not None and len(self._revived) > self.max_keys:
            del self._revived[next(iter(self._revived))]
        return True

    def revivable(self, key: Hashable) -> bool:
        """Whether a word from `key` ends its pause now."""
        return key in self._revivable

    def succeeded(self, key: Hashable) -> None:
        """A call to `key` succeeded: it is usable, its pause over and earlier ones forgiven."""
        if key in self._open or key in self._revived:
            self.reset(key)

    def detail(self, key: Hashable) -> str | None:
        """Why `key` failed, as recorded, or None."""
        return self._detail.get(key)

    def open_since(self, key: Hashable, now: float) -> float | None:
        """When the failure that pauses `key` happened, or None when `key` may be tried."""
        entry = self._open.get(key)
        if entry is None or now >= entry[1]:
            return None
        return entry[0]

    def reset(self, key: Hashable) -> None:
        """Forgets `key`'s failures (it came back)."""
        self._close(key)
        self._revived.pop(key, None)

    def _close(self, key: Hashable) -> None:
        """Ends `key`'s pause."""
        self._open.pop(key, None)
        self._detail.pop(key, None)
        self._revivable.discard(key)

    def sweep(self, now: float) -> None:
        """Forgets keys whose pause is over, and revivals MAX_PAUSE_S old; they only take memory."""
        for key in [k for k, (_, until) in self._open.items() if now >= until]:
            self._close(key)
        while self._revived:
            key, at = next(iter(self._revived.items()))
            if now - at < self.max_pause_s:
                break
            del self._revived[key]

    def next_expiry(self) -> float | None:
        """When the earliest pause ends (a sweep then frees memory), or None."""
        return min((until for _, until in self._open.values()), default=None)

    def entry(self, key: Hashable) -> tuple[float, float] | None:
        """(failed at, paused until) for `key`, or None."""
        return self._open.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._open

    def __len__(self) -> int:
        return len(self._open)

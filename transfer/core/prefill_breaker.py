"""The prefill side's breaker: bootstrap servers that did not answer (core/breaker.py keyed by address).

After a look-up failed and that took a while (a timeout, or an error answered slowly),
rooms that would look that server up fail at once for `retry_s` instead of each
spending as long on a look-up. A quick failure (a server not up yet refusing) costs
little, so every room still tries.
"""

from __future__ import annotations

from transfer.core.breaker import Breaker

__all__ = ["SLOW_FAILURE_S", "UNREACHABLE_RETRY_S", "BootstrapBreaker"]

UNREACHABLE_RETRY_S = 1.0
SLOW_FAILURE_S = 0.25


class BootstrapBreaker:
    """Bootstrap servers not asked again for a while after a slow failure."""

    def __init__(self, retry_s: float = UNREACHABLE_RETRY_S, slow_s: float = SLOW_FAILURE_S,
                 max_servers: int = 1024) -> None:
        self.retry_s = retry_s
        self._breaker = Breaker(pause_s=retry_s, slow_after_s=slow_s, max_keys=max_servers)

    def failed(self, addr: str, now: float, took_s: float, why: str) -> bool:
        """Records a failed look-up; True when it opened the breaker for `addr`."""
        return self._breaker.failed(addr, took_s, now, detail=f"{why} (after {took_s:.1f}s)") is not None

    def succeeded(self, addr: str) -> None:
        """A look-up answered: the server is asked freely again."""
        self._breaker.reset(addr)

    def refusal(self, addr: str, now: float) -> str | None:
        """Why `addr` is not asked now, or None when it may be."""
        paused = self.paused(addr, now)
        return None if paused is None else paused[0]

    def paused(self, addr: str, now: float) -> tuple[str, float] | None:
        """(why `addr` is not asked now, when it is asked again), or None when it may be asked now."""
        since = self._breaker.open_since(addr, now)
        if since is None:
            self._breaker.reset(addr)  # its pause is over: it only takes memory
            return None
        why = f"{self._breaker.detail(addr)} ({now - since:.1f}s ago; not asked again for {self.retry_s:g}s)"
        return why, since + self.retry_s

    def __len__(self) -> int:
        return len(self._breaker)

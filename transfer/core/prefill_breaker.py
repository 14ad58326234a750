"""The prefill side's breaker: bootstrap servers that did not answer.

After a look-up failed and that took a while (a timeout, or an error answered slowly),
rooms that would look that server up fail at once for `retry_s` instead of each
spending as long on a look-up. A quick failure (a server not up yet refusing) costs
little, so every room still tries.
"""

from __future__ import annotations

__all__ = ["SLOW_FAILURE_S", "UNREACHABLE_RETRY_S", "BootstrapBreaker"]

UNREACHABLE_RETRY_S = 1.0
SLOW_FAILURE_S = 0.25


class BootstrapBreaker:
    """Bootstrap servers not asked again for a while after a slow failure."""

    def __init__(self, retry_s: float = UNREACHABLE_RETRY_S, slow_s: float = SLOW_FAILURE_S,
                 max_servers: int = 1024) -> None:
        self.retry_s = retry_s
        self.slow_s = slow_s
        self.max_servers = max_servers
        self._open: dict[str, tuple[float, str]] = {}  # address -> (when it failed, why)

    def failed(self, addr: str, now: float, took_s: float, why: str) -> bool:
        """Records a failed look-up; True when it opened the breaker for `addr`."""
        if took_s < self.slow_s:
            return False
        if len(self._open) >= self.max_servers:
            self._open = {a: e for a, e in self._open.items() if now - e[0] < self.retry_s}
            if len(self._open) >= self.max_servers:
                del self._open[next(iter(self._open))]
        self._open.pop(addr, None)
        self._open[addr] = (now, f"{why} (after {took_s:.1f}s)")
        return True

    def succeeded(self, addr: str) -> None:
        """A look-up answered: the server is asked freely again."""
        self._open.pop(addr, None)

    def refusal(self, addr: str, now: float) -> str | None:
        """Why `addr` is not asked now, or None when it may be."""
        entry = self._open.get(addr)
        if entry is None:
            return None
        ago = now - entry[0]
        if ago >= self.retry_s:
            del self._open[addr]
            return None
        return f"{entry[1]} ({ago:.1f}s ago; not asked again for {self.retry_s:g}s)"

    def __len__(self) -> int:
        return len(self._open)

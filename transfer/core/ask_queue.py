"""Asks waiting, in order, for their encode rank's connection to take them.

The sockets to encode ranks queue nothing while disconnected (ZMQ would hand such a
queue to whoever listens at the address next, rooms cleared meanwhile included), so
asks the socket could not take yet wait here. They go out in the order they were
made, before any newer ask for the same rank; past `limit` waiting for one rank, new
asks are refused (once the asks of rooms cleared while they waited are forgotten).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any

__all__ = ["MAX_UNSENT_ASKS", "AskQueues"]

MAX_UNSENT_ASKS = 4096


class AskQueues:
    """One FIFO of waiting asks per encode address."""

    def __init__(self, limit: int = MAX_UNSENT_ASKS) -> None:
        self.limit = limit
        #: The queue of each address with asks waiting (read, never changed, outside).
        self.queues: dict[Hashable, deque[Any]] = {}

    def waiting(self, addr: Hashable) -> int:
        """How many asks wait for `addr` (a newer ask must queue behind any)."""
        queue = self.queues.get(addr)
        return 0 if queue is None else len(queue)

    def full(self, addr: Hashable) -> bool:
        """Whether `addr` has as many asks waiting as it may."""
        return self.waiting(addr) >= self.limit

    def push(self, addr: Hashable, ask: Any) -> None:
        """Queues `ask` behind those waiting for `addr` (check full() first)."""
        self.queues.setdefault(addr, deque()).append(ask)

    def put_back(self, addr: Hashable, asks: Iterable[Any]) -> None:
        """Returns asks that were taken but not sent to the front, in their order."""
        asks = list(asks)
        if asks:
            queue = self.queues.setdefault(addr, deque())
            queue.extendleft(reversed(asks))

    def take(self, addr: Hashable, budget: int) -> list[Any]:
        """Takes up to `budget` asks from the front, oldest first."""
        queue = self.queues.get(addr)
        if not queue:
            return []
        taken = [queue.popleft() for _ in range(min(budget, len(queue)))]
        if not queue:
            del self.queues[addr]
        return taken

    def prune(self, addr: Hashable, keep: Callable[[Any], bool]) -> int:
        """Forgets the asks waiting for `addr` that `keep` refuses (rooms cleared since); how many are left."""
        queue = self.queues.get(addr)
        if queue is None:
            return 0
        kept = deque(ask for ask in queue if keep(ask))
        if kept:
            self.queues[addr] = kept
        else:
            del self.queues[addr]
        return len(kept)

    def items(self, addr: Hashable) -> list[Any]:
        """The asks waiting for `addr`, oldest first."""
        return list(self.queues.get(addr, ()))

    def remove(self, addr: Hashable, taken: Callable[[Any], bool]) -> list[Any]:
        """Takes the asks waiting for `addr` that `taken` picks (they move elsewhere), oldest first."""
        queue = self.queues.get(addr)
        if queue is None:
            return []
        out = [ask for ask in queue if taken(ask)]
        if out:
            self.prune(addr, lambda ask: not taken(ask))
        return out

    def drop(self, addr: Hashable) -> list[Any]:
        """Takes every ask waiting for `addr` (its connection is given up)."""
        return list(self.queues.pop(addr, ()))

    def heads(self, live: Callable[[Any], bool]) -> list[tuple[Any, Any]]:
        """Each address with asks waiting and its oldest one that `live` keeps (older ones it refuses,
        rooms cleared since, are forgotten)."""
        if not self.queues:
            return []
        out = []
        for addr, queue in list(self.queues.items()):
            while queue and not live(queue[0]):
                queue.popleft()
            if queue:
                out.append((addr, queue[0]))
            else:
                del self.queues[addr]
        return out

    def addresses(self) -> list[Hashable]:
        """The addresses with asks waiting, in the order they first queued."""
        return list(self.queues)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self.queues.values())

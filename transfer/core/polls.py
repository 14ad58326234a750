"""When the sender pool looks at its writes in flight again: Mooncake gives no completion callback."""

from __future__ import annotations

import math

#: Writes of at most this many bytes are short: over tcp they take a few hundred
#: microseconds, over RDMA tens, so a backoff would mostly poll them late.
SHORT_WRITE_BYTES = 1 << 20

#: How long after a short write started its receivers are polled at the shortest gap; a
#: write still in flight after that (a stopped receiver) is polled on the backoff.
SHORT_WRITE_S = 2e-3


class PollSchedule:
    """How long the driver sleeps before its next round of polls.

    Each round checks the first unfinished write of every receiver with one in flight.
    For SHORT_WRITE_S after a short write started, rounds come every `min_s` per receiver
    still being waited on, so a room of short writes is found done soon after it is, at
    about one check every `min_s`. Otherwise the sleep starts at `min_s` after a round that
    found a write done and doubles after each that found none, up to `max_s`. A sleep is
    never longer than the backoff's of the moment, nor shorter than `min_s`.
    """

    def __init__(self, min_s: float, max_s: float) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self._backoff = min_s
        self._short_until = -math.inf
        self._waited_on = 1  # receivers the last round found a write in flight to

    def started(self, nbytes: int, now: float) -> None:
        """A write of `nbytes` went out at `now`."""
        if nbytes <= SHORT_WRITE_BYTES:
            self._short_until = now + SHORT_WRITE_S

    def polled(self, found_done: bool, waited_on: int) -> None:
        """A round of polls ended: whether it found a write over, and how many receivers
        still have one in flight."""
        self._backoff = self.min_s if found_done else min(2 * self._backoff, self.max_s)
        self._waited_on = max(1, waited_on)

    def idle(self) -> None:
        """A round with nothing to poll but writes held back (their ready events): back off."""
        self.polled(False, 1)

    def sleep_s(self, now: float) -> float:
        """How long to sleep before the next round."""
        if now < self._short_until:
            return min(self._backoff, self.min_s * self._waited_on)
        return self._backoff

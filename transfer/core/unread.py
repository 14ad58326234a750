"""Messages a driver may not have read yet when it ticks late: the rule both cores keep.

A driver held up past its tick's time (its process stopped, its thread inside a slow call),
or whose bounded read of its socket left messages queued, may have messages waiting there
that came before a room's time-out: asks on the encode side, statuses on the prefill side
(ZMQ's own I/O thread, held up as long, may not even have handed them over yet). Those count.
The driver says so (`unread`), and its core then holds back the rules that conclude rooms
for want of such a message for UNREAD_GRACE_S while the driver reads them (`UnreadGrace`).
Once in a row: the tick at the grace's end applies them whatever is still unread, so a flood
of messages delays them by that much at most.
"""

from __future__ import annotations

from typing import overload

__all__ = ["LATE_TICK_S", "UNREAD_GRACE_S", "UnreadGrace", "unread"]

#: A tick due this long ago or more found its driver held up (a stopped process, a slow call):
#: messages may have come meanwhile that it has not read yet.
LATE_TICK_S = 0.05

#: How long a tick whose driver may have messages unread holds back the rules that conclude
#: rooms for want of one: the driver reads them first.
UNREAD_GRACE_S = 0.1


def unread(now: float, due: float | None, queued: bool, since: float = float("-inf")) -> bool:
    """Whether a tick at `now`, due at `due` (None: nothing due), may find messages unread in its driver's
    socket: it is due, and either its driver's last bounded read left messages `queued`, or it comes
    LATE_TICK_S or more after `due`, or after `since` (the driver's previous tick) when that came later: a
    backlog of due work the driver is going through a batch a turn is no sign that it was held up."""
    if due is None or now < due:
        return False
    return queued or now - max(due, since) >= LATE_TICK_S


class UnreadGrace:
    """A core's hold on its rules for want of a message while its driver may not have read them all."""

    def __init__(self) -> None:
        #: Till when a tick with messages maybe unread holds the rules back (None: no hold on); read, never set,
        #: outside.
        self.until: float | None = None
        #: When the last hold ended: rules due by then were held once already, and are not held again.
        self.ended = float("-inf")

    def holds(self, now: float, unread: bool, due: float | None) -> bool:
        """Whether the rules wait at this tick; `due`: when the earliest of them came due (None: none).

        `unread` starts a hold of UNREAD_GRACE_S. The first tick at its end or later applies the
        rules it held, whatever is still unread (once in a row); only rules that came due after it
        ended may be held again (its driver was held up again before that tick came). A core whose
        tick applies a limited number goes on applying those due by `ended` while a later hold is on."""
        if self.until is not None and now >= self.until:
            ended, self.until = self.until, None
            self.ended = ended
            if due is None or due <= ended:
                return False
        if unread and self.until is None:
            self.until = now + UNREAD_GRACE_S
        return self.until is not None

    def holding(self, now: float) -> bool:
        """Whether a hold is on at `now`: a message read now may have waited unread since before its rule's time."""
        return self.until is not None and now < self.until

    @overload
    def defer(self, due: float) -> float: ...

    @overload
    def defer(self, due: float | None) -> float | None: ...

    def defer(self, due: float | None) -> float | None:
        """When the core next needs a tick for rules due at `due`: at the hold's end while one is on (that
        tick ends it, or applies them)."""
        return due if self.until is None else self.until

"""When the prefill I/O thread sleeps, and what a step on another thread must wake it for.

The I/O thread sleeps until the core's next wakeup, rounded up to the next millisecond so
that it wakes just after the work comes due rather than just before it (at most a second;
less while a caller reads the status socket in its stead). A caller's step (receive(),
progress(), a waiting caller's turn) that leaves the core with work due before what that
sleep answers for wakes the thread; work due at or after it does not need to: the thread
wakes for it by itself, within the plan's own rounding.
"""

from __future__ import annotations

import math

__all__ = ["IDLE_SLEEP_MS", "sleep_plan"]

#: The longest the I/O thread sleeps with nothing due: it looks at its monitors and the
#: pool's quarantines that often.
IDLE_SLEEP_MS = 1000


def sleep_plan(now: float, wakeup: float | None, *, waiter: bool, caller_at: float, lease_s: float,
               look_s: float, busy: bool) -> tuple[int, bool, float]:
    """The I/O thread's next sleep in ms, whether it watches the status socket meanwhile, and the
    earliest due time the sleep answers for (a step that leaves work due before it wakes the thread).

    `wakeup`: the core's next wakeup (None: nothing due). `waiter`: a caller sleeps on the status
    socket in wait(): the thread looks again after `look_s` whether it left. Else a caller that read
    the socket at `caller_at` keeps it for `lease_s`: the thread watches it only once that ran out,
    and looks again then. `busy`: the thread has work queued already, and does not sleep.
    """
    timeout_ms = IDLE_SLEEP_MS if wakeup is None else max(0, min(IDLE_SLEEP_MS, int((wakeup - now) * 1000) + 1))
    watch = not waiter and now - caller_at >= lease_s
    if waiter:
        timeout_ms = min(timeout_ms, math.ceil(look_s * 1000))
    elif not watch:
        timeout_ms = min(timeout_ms, max(1, math.ceil((caller_at + lease_s - now) * 1000)))
    if busy:
        timeout_ms = 0
    wakes_at = now + timeout_ms / 1000
    # A sleep planned for `wakeup` ends just after it: that wakeup, and any later one, needs no wake-up.
    return timeout_ms, watch, wakes_at if wakeup is None or wakeup > wakes_at else wakeup

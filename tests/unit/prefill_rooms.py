"""What the PrefillCore tests share: one bootstrap server, one encode rank, a region and rooms in it."""

from __future__ import annotations

from fakes import Region, Regions

from transfer.core.prefill import Announce, LookUpParallel, LookUpRoute, PrefillCore, RoomSpec, SendAsk

BOOT = "10.0.0.1:8998"
ENCODE = ("10.0.0.2", 7000)
KEY0 = (BOOT, 0, 0)

MAIN = Regions(Region(0x10000, 1 << 20))


def spec(room: int, *, regions: Regions = MAIN, slot: int = 0, deepstack: bool = False) -> RoomSpec:
    """Room `room`'s 4 rows of 16 bytes at slot `slot` of `regions` (and 4 deepstack rows of 8 bytes when asked)."""
    ptr = regions.embedding.addr + slot * 64
    ds_ptr = regions.deepstack.addr + slot * 32 if deepstack else 0
    return RoomSpec(room, BOOT, ptr, rows=4, hidden=8, dtype="torch.float16", row_bytes=16, row_start=0, span=4,
                    regions=regions, deepstack_ptr=ds_ptr, deepstack_nbytes=32 if deepstack else 0,
                    has_deepstack=deepstack, deepstack_row_bytes=8 if deepstack else None)


def core(**kw) -> PrefillCore:
    """Prefill rank 0 of tp 1 (unless told otherwise), deadline 60 s."""
    kw.setdefault("deadline_s", 60.0)
    return PrefillCore(kw.pop("engine_rank", 0), kw.pop("tp_size", 1), kw.pop("dp_size", 1),
                       host="10.0.0.3", status_port=5555, session_id="10.0.0.3:1234", **kw)


def routed(c: PrefillCore, now: float = 0.0, tp: int = 1, dp: int = 1) -> None:
    """Resolves the sizes and rank 0's route, as a first room would."""
    _, actions = c.receive(now, spec(999))
    assert actions == [LookUpParallel(BOOT)]
    actions = c.parallel_resolved(now, BOOT, tp, dp)
    assert actions == [LookUpRoute(KEY0)]
    actions = c.route_resolved(now, KEY0, ENCODE)
    assert [type(a) for a in actions] == [Announce, SendAsk]
    c.clear(now, 999)


def asked(c: PrefillCore, room: int, now: float = 0.0) -> int:
    """Receives `room` (at its own slot) and resolves its route: its ask goes out. Returns its token."""
    token, actions = c.receive(now, spec(room, slot=room))
    if actions == [LookUpParallel(BOOT)]:
        actions = c.parallel_resolved(now, BOOT, 1, 1)
    if actions == [LookUpRoute(KEY0)]:
        actions = c.route_resolved(now, KEY0, ENCODE)
    assert SendAsk in [type(a) for a in actions]
    return token


def status_driver(kind: type | None = None):
    """A prefill driver (of `kind`, a PrefillDriver by default) with what its status steps use: a real core
    (deadline 10 s, integrity off), room table and Metrics, and no I/O thread or sockets."""
    import logging
    import math
    from collections import deque

    from transfer import _io
    from transfer.core.quarantine import AwaitingConfirmation
    from transfer.drive.prefill import PrefillDriver
    from transfer.metrics import Metrics
    from transfer.status import RoomTable

    kind = PrefillDriver if kind is None else kind
    d = kind.__new__(kind)
    d.core = core(deadline_s=10.0, integrity=False)
    d.rooms, d.table, d.metrics, d.conclusions = {}, RoomTable(), Metrics("epd_prefill"), _io.Conclusions()
    d._watcher = None
    d._failures = d._complaints = _io.ThrottledLog(logging.getLogger("transfer.test"))
    d._thread, d._cancels_out, d._sockets, d._watching = None, deque(), {}, {}
    d._awaiting_safe = AwaitingConfirmation(math.inf, 16)
    return d


def reading_driver():
    """A status_driver() for scripted reads of its status socket (what `_io.take_statuses` hands over): no
    socket, a clock at 1.0, nothing read yet, and the rooms a read settles in lanes left alone."""
    d = status_driver()
    d._status_sock = None
    d.clock = lambda: 1.0
    d._statuses_left = d._drained = False
    d._settle_lanes = lambda now, settled: []
    return d

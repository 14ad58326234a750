"""A peer that registers many sessions of its own must not take another session's regions down with them."""

from __future__ import annotations

from transfer.core.encode import Conclude, EncodeCore, Offer, StartWrite
from transfer.core.regions import RegionBook
from transfer.frames import Registration, TransferInfo
from transfer.status import TransferPoll

ROW = 512
VICTIM = "10.0.0.7:17000"
BASE = 0x10000


class Token:
    """The caller's object for one send of a room."""


def _offer(room: int) -> Offer:
    return Offer(room, Token(), 0x7000_0000, 4, 256, "torch.bfloat16", ROW)


def _ask(room: int, session: str = VICTIM, ptr: int = BASE) -> TransferInfo:
    return TransferInfo(room, "10.0.0.7", 6000, session, ptr, 0, 4, 256, "torch.bfloat16", False, 1, 0, 4)


def _flood(core: EncodeCore, count: int, now: float) -> None:
    """`count` registrations with lengths, each a new session at a new status endpoint of another host."""
    for index in range(count):
        core.registration(Registration("10.9.0.1", 10000 + index, f"10.9.0.1:{20000 + index}", BASE, 0, 1 << 20, 0),
                          now)


def _served(core: EncodeCore, room: int, now: float) -> list:
    """Sends the room's item and the victim's ask; lands its write if one started. The core's actions."""
    out = core.offer(_offer(room), now) + core.ask(_ask(room), now)
    for write in [a for a in out if isinstance(a, StartWrite)]:
        out += core.write_done(write.wid, (), now)
    return out


def test_a_flood_of_new_sessions_does_not_retire_a_session_that_was_served():
    core = EncodeCore(regions=RegionBook(max_sessions=64))
    core.registration(Registration("10.0.0.7", 6000, VICTIM, BASE, 0, 4 * ROW, 0), 0.0)
    assert [c.status for c in _served(core, 1, 0.0) if isinstance(c, Conclude)] == [TransferPoll.Success]
    _flood(core, 64, 0.1)
    out = _served(core, 2, 0.2)
    assert [(c.status, c.failure) for c in out if isinstance(c, Conclude)] == [(TransferPoll.Success, None)]
    # Its regions are still checked.
    out = core.offer(_offer(3), 0.3) + core.ask(_ask(3, ptr=0xDEAD0000), 0.3)
    assert [a for a in out if isinstance(a, StartWrite)] == []


def test_a_flood_of_new_sessions_does_not_fail_a_session_not_served_yet():
    # Registered and asked, its item still to come: the flood must not turn its rooms into failures.
    core = EncodeCore(regions=RegionBook(max_sessions=64))
    core.registration(Registration("10.0.0.7", 6000, VICTIM, BASE, 0, 4 * ROW, 0), 0.0)
    core.ask(_ask(1), 0.0)
    _flood(core, 64, 0.1)
    out = core.offer(_offer(1), 0.2)
    assert [c.failure for c in out if isinstance(c, Conclude)] == []
    assert len([a for a in out if isinstance(a, StartWrite)]) == 1

"""One receiver that asks for rooms this encode rank never sends must not push out the asks of the others."""

from __future__ import annotations

from transfer.core.encode import Conclude, EncodeCore, Offer, PushStatus, StartWrite
from transfer.core.parked import ParkedAsks
from transfer.frames import TransferInfo
from transfer.status import TransferPoll

ROW = 512


class Token:
    """The caller's object for one send of a room."""


def _offer(room: int) -> Offer:
    return Offer(room, Token(), 0x7000_0000, 4, 256, "torch.bfloat16", ROW)


def _ask(room: int, session: str, port: int, fanout: int = 1, rank: int = 0, endpoint: str = "10.0.0.7"
         ) -> TransferInfo:
    rows = 4 // fanout
    return TransferInfo(room, endpoint, port, session, 0x10000, 0, rows, 256, "torch.bfloat16", False, fanout,
                        rank * rows, 4)


def _failed(out: list) -> list[tuple[int, int]]:
    return [(a.room, a.port) for a in out if isinstance(a, PushStatus) and a.status == TransferPoll.Failed]


def test_a_receiver_asking_for_rooms_never_sent_drops_its_own_oldest_asks_not_another_receivers():
    # A misrouted prefill rank asks this encode rank for every room of its own instance: none ever comes.
    core = EncodeCore(fanout_timeout_s=120.0, parked=ParkedAsks(max_rooms=16))
    assert core.ask(_ask(1000, "10.0.0.7:17000", 6000), 0.0) == []  # a good ask, its item still to come
    out = []
    for room in range(40):
        out += core.ask(_ask(room, "10.0.0.9:17000", 7000), 0.1)
    assert all(port == 7000 for _, port in _failed(out)), _failed(out)
    out = core.offer(_offer(1000), 0.2)
    assert len([a for a in out if isinstance(a, StartWrite)]) == 1 and _failed(out) == []


def test_a_room_offered_waiting_for_its_fanout_is_not_failed_by_another_receivers_flood():
    core = EncodeCore(fanout_timeout_s=120.0, parked=ParkedAsks(max_rooms=16))
    core.offer(_offer(1000), 0.0)
    core.ask(_ask(1000, "10.0.0.7:17000", 6000, fanout=2, rank=0), 0.0)
    out = []
    for room in range(40):
        out += core.ask(_ask(room, "10.0.0.9:17000", 7000), 0.1)
    assert [c for c in out if isinstance(c, Conclude) and c.room == 1000] == []
    out = core.ask(_ask(1000, "10.0.0.7:17001", 6001, fanout=2, rank=1), 0.2)
    assert len([a for a in out if isinstance(a, StartWrite)]) == 2


def test_a_receiver_whose_asks_are_big_cannot_push_out_another_receivers_by_bytes():
    core = EncodeCore(fanout_timeout_s=120.0, parked=ParkedAsks(max_bytes=64 << 10))
    core.ask(_ask(1000, "10.0.0.7:17000", 6000), 0.0)
    out = []
    for room in range(40):  # 8 KiB of endpoint each
        out += core.ask(_ask(room, "10.0.0.9:17000", 7000, endpoint="h" * (8 << 10)), 0.1)
    assert all(port == 7000 for _, port in _failed(out)), _failed(out)
    out = core.offer(_offer(1000), 0.2)
    assert len([a for a in out if isinstance(a, StartWrite)]) == 1

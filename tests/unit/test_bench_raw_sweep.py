"""`epd-transfer bench`, raw path (--raw-issue async): a room is stamped when its last shard completes,
whichever room completes first, and settles only once every shard of it is over, a failed one included.

Over a fake clock (the bench's `time`, which sleeps advance) and an engine whose writes complete
at set times on it.
"""

from __future__ import annotations


import pytest

from bench_fakes import FakeTime

from transfer import bench
from transfer.engine import POLL_MAX_S
from transfer.errors import EngineError


class _Engine:
    """Writes that complete `after(room, session)` seconds after they are issued, or fail then.

    `overlaps` lists each write issued to a destination a write still in flight also lands in;
    `unsettled`, the tickets no poll() or wait() has seen over yet.
    """

    def __init__(self, clock: FakeTime, after, fails=()) -> None:
        self.clock, self.after, self.fails = clock, after, set(fails)
        self.tickets: dict[int, tuple[int, str, int, float]] = {}  # ticket -> (room, session, dst, done at)
        self.unsettled: set[int] = set()
        self.overlaps: list[tuple[int, str]] = []
        self.room = -1

    def write_async(self, session, srcs, dsts, lens) -> int:
        now = self.clock.now
        room = srcs[0]  # the test's batches carry the room as the source address
        if any(d == dsts[0] and done > now for _, _, d, done in self.tickets.values()):
            self.overlaps.append((room, session))
        ticket = len(self.tickets) + 1
        self.tickets[ticket] = (room, session, dsts[0], now + self.after(room, session))
        self.unsettled.add(ticket)
        return ticket

    def poll(self, ticket) -> bool:
        room, session, _, done = self.tickets[ticket]
        if self.clock.now < done:
            return False
        if ticket not in self.unsettled:
            raise EngineError(f"unknown write ticket {ticket}")
        self.unsettled.discard(ticket)
        if (room, session) in self.fails:
            raise EngineError(f"room {room} to {session}: rc=-1")
        return True

    def wait(self, ticket, timeout_s=None) -> None:
        self.clock.now = max(self.clock.now, self.tickets[ticket][3])
        self.poll(ticket)


def _run(monkeypatch, fanout: int, inflight: int, items: int, after, fails=()) -> tuple[dict, _Engine]:
    clock = FakeTime()
    monkeypatch.setattr(bench, "time", clock)
    cell = bench.Cell("raw", 64, 256, "torch.bfloat16", fanout=fanout, inflight=inflight, items=items)
    engine = _Engine(clock, after, fails)

    def batches(room: int):
        return [(f"peer{r}", room, (r << 20) + room % cell.slots, 1) for r in range(fanout)]

    report: dict = {"latencies": [], "latency_rooms": [], "failed": []}
    bench._raw_async(engine, cell, batches, report)
    return report, engine


def test_a_room_that_completes_before_an_older_one_is_stamped_when_it_completes(monkeypatch):
    # Room 0's write takes 5 ms, room 1's 1 ms: waiting for the oldest room first would stamp room 1
    # at 5 ms, raise raw's p50 and so shrink every path's p50 added over raw.
    report, engine = _run(monkeypatch, fanout=1, inflight=2, items=2,
                          after=lambda room, session: 5e-3 if room == 0 else 1e-3)
    latency = dict(zip(report["latency_rooms"], report["latencies"]))
    assert sorted(latency) == [0, 1] and report["failed"] == []
    assert latency[0] == pytest.approx(5e-3, abs=1.1e-3)
    # Found within one of the sweeps' sleeps (engine.wait's, at most POLL_MAX_S) of its completion.
    assert 1e-3 <= latency[1] <= 1e-3 + POLL_MAX_S + 1e-9, latency
    assert not engine.unsettled


def test_a_failed_room_settles_every_shard_before_its_slot_is_written_again(monkeypatch):
    # Room 0's shard to peer0 fails at 1 ms; its shard to peer1 still lands until 5 ms. Room 2 shares
    # room 0's slot: writing it before then would let room 0's late bytes land over room 2's.
    def after(room, session):
        if room == 0:
            return 1e-3 if session == "peer0" else 5e-3
        return 0.5e-3

    report, engine = _run(monkeypatch, fanout=2, inflight=2, items=4, after=after, fails={(0, "peer0")})
    assert engine.overlaps == [], "a room was written into a slot a failed room's write still lands in"
    assert [room for room, _ in report["failed"]] == [0]
    assert "rc=-1" in report["failed"][0][1]
    assert sorted(report["latency_rooms"]) == [1, 2, 3]
    assert not engine.unsettled, "a failed room's other writes were never waited for"


def test_rooms_completing_newest_first_are_each_stamped_within_a_sleep_of_their_own_completion(monkeypatch):
    # Room r's writes take 12 - r ms, so every room completes before the one issued ahead of it; and a
    # room is still only written once the last room in its slot settled.
    report, engine = _run(monkeypatch, fanout=2, inflight=3, items=12,
                          after=lambda room, session: 1e-3 * (12 - room))
    assert engine.overlaps == []
    assert sorted(report["latency_rooms"]) == list(range(12)) and report["failed"] == []
    for room, latency in zip(report["latency_rooms"], report["latencies"]):
        own = 1e-3 * (12 - room)
        assert own <= latency <= own + POLL_MAX_S + 1e-9, (room, latency)
    assert not engine.unsettled

"""Engine: writes reported failed at their transfer timeout while Mooncake still held them (overdue writes),
against a scripted transfer engine that counts the batches it allocated and freed."""

from __future__ import annotations

import pytest
from fakes import FakeTime, MooncakeStandIn, stand_in_mooncake

from transfer import engine as engine_module
from transfer.engine import OVERDUE_CHECK_AT, Engine, EngineError
from transfer.errors import ConfigError, ConfigTypeError

SRC = 0x10000


class _BatchCountingTE(MooncakeStandIn):
    """Each write is a batch of its own; a batch reads "in flight" until the test settles it, and is
    freed (as Mooncake's transfer_check_status frees it) when its status is read once settled."""

    def __init__(self) -> None:
        self.next_batch = 1000
        self.live: set[int] = set()  # allocated, not freed
        self.settled: set[int] = set()  # done in Mooncake, not yet read

    def batch_transfer_async_write(self, session, srcs, dsts, lens) -> int:
        self.next_batch += 1
        self.live.add(self.next_batch)
        return self.next_batch

    def transfer_check_status(self, batch: int) -> int:
        assert batch in self.live, f"status asked of batch {batch}, which Mooncake freed"
        if batch not in self.settled:
            return 0
        self.settled.discard(batch)
        self.live.discard(batch)
        return 1

    def settle_all(self) -> None:
        self.settled |= self.live


@pytest.fixture
def rig(monkeypatch):
    """(engine, fake, clock): an engine with a 5 s transfer timeout on the scripted transfer engine, its source
    memory registered by the caller (no temporary registration comes and goes)."""
    fake = _BatchCountingTE()

    clock = FakeTime(100.0)
    stand_in_mooncake(monkeypatch, fake)
    monkeypatch.setattr(engine_module, "time", clock)
    engine = Engine("127.0.0.1", protocol="tcp", transfer_timeout_s=5.0, open_timeout_s=0)
    engine.register(SRC, 1 << 20)
    yield engine, fake, clock
    engine.close()


def _overdue_write(engine: Engine, clock: FakeTime) -> None:
    """A write polled while in flight, then past its transfer timeout: reported failed."""
    ticket = engine.write_async("peer:1", [SRC], [0x100], [64])
    clock.now += 0.1  # polled often: no gap reads as a hold-up of this process
    assert engine.poll(ticket) is False
    for _ in range(51):
        clock.now += 0.1
        try:
            engine.poll(ticket)
        except EngineError as error:
            assert "still in flight after the transfer timeout of 5s" in str(error)
            return
    raise AssertionError("the write was not reported failed past its transfer timeout")


def test_overdue_writes_mooncake_settled_later_are_freed_without_an_unregister(rig):
    """A peer that stalls past the transfer timeout, again and again, each time catching up after its writes
    were reported failed: the batches Mooncake settled are read and freed, and the engine keeps no more than
    a bounded number of overdue writes, though no region is ever unregistered (the caller's own buffer)."""
    engine, fake, clock = rig
    for _ in range(10 * OVERDUE_CHECK_AT):
        _overdue_write(engine, clock)
        fake.settle_all()  # the peer caught up: Mooncake completed the write after it was reported failed
        assert len(fake.live) <= OVERDUE_CHECK_AT
        assert len(engine._overdue) <= OVERDUE_CHECK_AT


def test_overdue_writes_still_in_mooncake_s_hands_are_kept_and_checked_at_a_cost_bounded_on_average(rig):
    """A peer that never catches up: its overdue writes stay filed (their sources must stay registered), and
    reading their statuses again as more go overdue costs a bounded number of status calls per write."""
    engine, fake, clock = rig
    rereads = 0  # status reads of writes already reported failed
    check = fake.transfer_check_status

    def counted(batch: int) -> int:
        nonlocal rereads
        rereads += batch != fake.next_batch  # the newest batch is the write being polled
        return check(batch)

    fake.transfer_check_status = counted
    writes = 20 * OVERDUE_CHECK_AT
    for _ in range(writes):
        _overdue_write(engine, clock)
    assert len(engine._overdue) == writes and len(fake.live) == writes
    assert 0 < rereads <= 2 * writes
    with pytest.raises(EngineError, match="still being read by a write to peer:1"):
        engine.unregister(SRC)
    fake.settle_all()
    engine.unregister(SRC)
    assert fake.live == set() and engine._overdue == []


def test_close_frees_the_overdue_writes_mooncake_settled(rig):
    engine, fake, clock = rig
    for _ in range(3):
        _overdue_write(engine, clock)
    fake.settle_all()
    engine.close()
    assert fake.live == set()


@pytest.mark.parametrize("timeout_s", [None, 2.0])
def test_close_waits_for_a_write_in_flight_until_its_transfer_timeout_or_its_own_timeout_s(rig, caplog, timeout_s):
    """close() waits for a write still in flight until its deadline; close(timeout_s=) at most that long (a
    rank's stop within its supervisor's grace), then stops the transport with the write still in Mooncake."""
    engine, fake, clock = rig
    engine.write_async("peer:1", [SRC], [0x100], [64])
    started = clock.now
    engine.close(timeout_s=timeout_s)
    waited = clock.now - started
    assert (2.0 <= waited < 2.1) if timeout_s is not None else (5.0 <= waited < 5.1), waited
    assert engine._te is None and fake.live  # the transport went with the write still in it
    assert any("still in flight at close" in m for m in caplog.messages)


@pytest.mark.parametrize("timeout_s", [-1.0, "soon"])
def test_close_refuses_a_timeout_s_that_is_no_time(rig, timeout_s):
    engine, _, _ = rig
    with pytest.raises((ConfigError, ConfigTypeError), match="timeout_s"):
        engine.close(timeout_s=timeout_s)
    assert not engine.closed

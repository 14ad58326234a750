"""Engine: a batch Mooncake took whose id the write may not have filed: the direct calls' segment handle look-up
raising after the binding's write, and a stop signal's exception raised as a submission call returns (a rank's
SIGTERM handler raises KeyboardInterrupt wherever the main thread is). Its source stays registered."""

from __future__ import annotations

import pytest
from fakes import FakeTime, MooncakeStandIn, stand_in_mooncake

from transfer import engine as engine_module
from transfer.engine import Engine, EngineError

SRC = 0x10000


class _BatchCountingTE(MooncakeStandIn):
    """Each write is a batch of its own, "in flight" until the test settles it, freed when its status is read
    once settled (as transfer_check_status frees it)."""

    def __init__(self) -> None:
        self.next_batch = 1000
        self.live: set[int] = set()
        self.settled: set[int] = set()

    def get_engine_ptr(self) -> int:
        return 1

    def batch_transfer_async_write(self, session, srcs, dsts, lens) -> int:
        self.next_batch += 1
        self.live.add(self.next_batch)
        return self.next_batch


class _InterruptedTE(_BatchCountingTE):
    """Its first write is handed to Mooncake, and a stop signal's exception is raised as the call returns."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False
        self.unregistered: list[int] = []

    def batch_transfer_async_write(self, session, srcs, dsts, lens) -> int:
        batch = super().batch_transfer_async_write(session, srcs, dsts, lens)
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return batch

    def unregister_memory(self, addr: int) -> int:
        self.unregistered.append(addr)
        return 0


class _NativeStandIn:
    """The direct calls, on the stand-in's batches; the handle look-up fails."""

    def __init__(self, fake: _BatchCountingTE) -> None:
        self.fake = fake

    def mooncake_open(self, engine: int, session: str) -> int:
        raise MemoryError

    def mooncake_settle(self, engine: int, batches: list[int]) -> int:
        while batches:
            batch = batches[0]
            assert batch in self.fake.live, f"status asked of batch {batch}, which Mooncake freed"
            if batch not in self.fake.settled:
                return 0
            self.fake.settled.discard(batch)
            self.fake.live.discard(batch)
            del batches[0]
        return 1


@pytest.fixture
def rig(monkeypatch):
    """(engine, fake): an engine whose calls go direct, on the stand-ins, its source memory registered."""
    fake = _BatchCountingTE()

    stand_in_mooncake(monkeypatch, fake)
    monkeypatch.setattr(engine_module, "_bind_direct", lambda te, module: (1, "stand-in"))
    monkeypatch.setattr(engine_module, "_native", _NativeStandIn(fake))
    monkeypatch.setattr(engine_module, "time", FakeTime(100.0))
    engine = Engine("127.0.0.1", protocol="tcp", transfer_timeout_s=5.0, open_timeout_s=0)
    engine.register(SRC, 1 << 20)
    yield engine, fake
    engine.close(timeout_s=0)


def test_a_batch_handed_over_before_the_handle_look_up_failed_stays_tracked(rig):
    """The binding's write went out, then the handle look-up raised: the write is not reported refused while
    its batch reads the source, the source stays registered until it settled, and the batch is freed once."""
    engine, fake = rig
    ticket = engine.write_async("peer:1", [SRC], [0x100], [64])
    assert fake.live, "the binding's write went out"
    with pytest.raises(EngineError, match="still being read"):
        engine.unregister(SRC)
    assert engine.poll(ticket) is False
    fake.settled |= fake.live
    with pytest.raises(EngineError, match="submitting failed"):
        engine.poll(ticket)
    assert fake.live == set()
    engine.unregister(SRC)


def test_a_write_whose_submission_a_stop_signal_cut_short_keeps_its_source_until_the_transport_goes(monkeypatch):
    """The batch id the binding answered is lost to the exception: its source may still be read, so it is not
    let go of until close() destroyed the transport; close() does not wait out the write's transfer timeout."""
    fake = _InterruptedTE()

    clock = FakeTime(100.0)
    stand_in_mooncake(monkeypatch, fake)
    monkeypatch.setattr(engine_module, "_bind_direct", lambda te, module: (0, "stand-in"))
    monkeypatch.setattr(engine_module, "time", clock)
    engine = Engine("127.0.0.1", protocol="tcp", transfer_timeout_s=5.0, open_timeout_s=0)
    engine.register(SRC, 1 << 20)
    with pytest.raises(KeyboardInterrupt):
        engine.write_async("peer:1", [SRC], [0x100], [64])
    with pytest.raises(EngineError, match="still being read"):
        engine.unregister(SRC)
    assert engine.unregister_many([SRC]) and fake.unregistered == []
    engine.close()
    assert engine._te is None and engine.registered() == {}
    assert clock.now == 100.0, "close() waited for a write it cannot read"


def test_writes_let_go_together_after_one_whose_submission_was_cut_short_are_submitted_later(monkeypatch):
    """Two writes held back for a new peer's probe, let go by one poll: a stop signal's exception cuts the first's
    submission short. The second was not handed over: a later poll submits it, and close() does not wait for it."""
    fake = _InterruptedTE()
    fake.send_probe = lambda session: 0

    started = []
    stand_in_mooncake(monkeypatch, fake)
    monkeypatch.setattr(engine_module, "_bind_direct", lambda te, module: (0, "stand-in"))
    monkeypatch.setattr(engine_module, "FIRST_ANSWER_S", 0.0)
    monkeypatch.setattr(Engine, "_start_probe", lambda self, probe: started.append(probe))
    fake.transfer_check_status = lambda batch: 1
    engine = Engine("127.0.0.1", protocol="tcp", transfer_timeout_s=5.0)
    engine.register(SRC, 1 << 20)
    first = engine.write_async("new:1", [SRC], [0x100], [64])
    second = engine.write_async("new:1", [SRC + 64], [0x200], [64])
    engine._probe(fake, started[0])
    with pytest.raises(KeyboardInterrupt):
        engine.poll(first)
    assert engine.poll(second) is True and fake.next_batch == 1002
    assert not any(pending.submitting for pending in engine._pending.values()), "close() would wait for it"
    engine.close()
    assert engine._te is None and engine.registered() == {}

"""Engine.close() cut short by a stop signal's exception (a rank's SIGTERM handler raises KeyboardInterrupt
wherever the main thread is) is finished by the next close(). On a stand-in for Mooncake's transfer
engine; with real engines, and a close() that the handler calls inside another: tests/live/test_close_interrupted.py."""

from __future__ import annotations

import pytest
from fakes import MooncakeStandIn, interrupted_once, stand_in_mooncake

from transfer.engine import Engine

ADDR, NBYTES = 0x10000, 1 << 20


class _CountingTE(MooncakeStandIn):
    """Counts the unregistrations, and whether the engine let go of it (its destructor stops Mooncake)."""

    def __init__(self) -> None:
        self.unregistered: list[int] = []

    def unregister_memory(self, addr: int) -> int:
        self.unregistered.append(addr)
        return 0


@pytest.fixture
def rig(monkeypatch):
    """(engine, fake): an engine on the stand-in with one region registered."""
    fake = _CountingTE()

    stand_in_mooncake(monkeypatch, fake)
    engine = Engine("127.0.0.1", protocol="tcp", open_timeout_s=0)
    engine.register(ADDR, NBYTES)
    yield engine, fake
    engine.close()



def test_a_close_cut_short_before_it_let_go_of_anything_is_finished_by_the_next(rig):
    engine, fake = rig
    engine._wait_for_registrations = interrupted_once(engine._wait_for_registrations)
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    assert engine.closed and engine.registered() == {ADDR: NBYTES} and engine._te is fake
    engine.close()
    assert engine.registered() == {} and fake.unregistered == [ADDR]
    assert engine._te is None, "the transport was never let go of"
    engine.close()
    assert fake.unregistered == [ADDR], "a close after a finished one did it again"

"""Engine: a new peer's writes stay out of Mooncake until its probe answered (scripted engine, probes run inline)."""

from __future__ import annotations

import pytest
from fakes import FakeTime, MooncakeStandIn, stand_in_mooncake

from transfer import engine as engine_module
from transfer.engine import Engine, EngineError
from transfer.errors import ConfigError, ConfigTypeError

SRC = 0x10000


class _ProbingTE(MooncakeStandIn):
    """A stand-in for mooncake's TransferEngine that records writes and answers probes as told."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, int]] = []
        self.probe_rc = 0
        self.probed: list[str] = []
        self.refusing = False  # submissions answer batch id 0, as Mooncake does for an unreachable session
        self.in_flight: set[int] = set()  # batches whose status reads "in flight"

    def send_probe(self, session: str) -> int:
        self.probed.append(session)
        return self.probe_rc

    def batch_transfer_async_write(self, session, srcs, dsts, lens) -> int:
        if self.refusing:
            return 0
        self.writes.append((session, dsts[0]))
        return 1000 + len(self.writes)

    def transfer_check_status(self, batch: int) -> int:
        return 0 if batch in self.in_flight else 1  # in flight, or completed


@pytest.fixture
def rig(monkeypatch):
    """(engine, fake, probes started): probes are recorded, and answered by the test."""
    fake = _ProbingTE()

    stand_in_mooncake(monkeypatch, fake)
    monkeypatch.setattr(engine_module, "FIRST_ANSWER_S", 0.0)
    started = []
    monkeypatch.setattr(Engine, "_start_probe", lambda self, probe: started.append(probe))
    engine = Engine("127.0.0.1", protocol="tcp")
    engine.register(SRC, 1 << 20)
    yield engine, fake, started
    engine.close()


def _answer(engine: Engine, fake: _ProbingTE, probe) -> None:
    """Runs the probe the engine would have run on its own thread."""
    engine._probe(fake, probe)


def test_writes_to_a_new_peer_wait_for_its_probe_and_then_go_in_order(rig):
    engine, fake, started = rig
    first = engine.write_async("new:1", [SRC], [0x100], [64])
    second = engine.write_async("new:1", [SRC + 64], [0x200], [64])
    assert [p.session for p in started] == ["new:1"]  # one probe for both
    assert engine.poll(first) is False and engine.poll(second) is False
    assert fake.writes == []
    # A held-back write still reads its source: the region cannot go meanwhile.
    with pytest.raises(EngineError, match="still being read"):
        engine.unregister(SRC)
    _answer(engine, fake, started[0])
    assert fake.probed == ["new:1"]
    assert engine.poll(second) is True  # polling the later one releases both, oldest first
    assert fake.writes == [("new:1", 0x100), ("new:1", 0x200)]
    assert engine.poll(first) is True
    # Open now: the next write goes at once, with no probe.
    engine.write("new:1", [SRC], [0x300], [64])
    assert fake.writes[-1] == ("new:1", 0x300) and len(started) == 1


def test_a_silent_peer_holds_no_write_to_another_peer(rig):
    engine, fake, started = rig
    engine.write_async("silent:1", [SRC], [0x100], [64])
    healthy = engine.write_async("healthy:2", [SRC], [0x500], [64])
    _answer(engine, fake, started[1])
    assert engine.poll(healthy) is True
    assert fake.writes == [("healthy:2", 0x500)]


def test_a_peer_that_does_not_answer_in_time_fails_its_writes_naming_why(rig, monkeypatch):
    engine, fake, started = rig
    engine._openings.open_timeout_s = 1e-9
    ticket = engine.write_async("silent:1", [SRC], [0x100], [64])
    with pytest.raises(EngineError, match=r"write to silent:1 failed \(its Mooncake handshake port did not answer"):
        engine.poll(ticket)
    with pytest.raises(EngineError, match="unknown write ticket"):
        engine.poll(ticket)
    # Its probe is still out: the next write fails at once, without a second probe.
    with pytest.raises(EngineError, match="did not answer"):
        engine.write_async("silent:1", [SRC], [0x100], [64])
    assert len(started) == 1 and fake.writes == []
    engine.unregister(SRC)  # nothing reads the source any more
    engine.register(SRC, 1 << 20)


def test_silent_peers_whose_writes_failed_leave_nothing_held_for_them(rig):
    """Prefill ranks that stop at first contact and never come back (each restart a new session): once their
    held-back writes failed, the engine keeps no entry for them, however many there were."""
    engine, fake, started = rig
    engine._openings.open_timeout_s = 1e-9
    for n in range(100):
        session = f"silent:{n}"
        ticket = engine.write_async(session, [SRC], [0x100], [64])
        with pytest.raises(EngineError, match="did not answer"):
            engine.poll(ticket)
        _answer(engine, fake, started[-1])  # its probe returns at last, unanswered: the peer is gone
    assert engine._held == {} and engine._pending == {}
    assert fake.writes == []


def test_a_probe_refused_at_once_leaves_the_verdict_to_mooncake(rig):
    engine, fake, started = rig
    fake.probe_rc = -102
    ticket = engine.write_async("old-peer:1", [SRC], [0x100], [64])
    _answer(engine, fake, started[0])
    assert engine.poll(ticket) is True
    assert fake.writes == [("old-peer:1", 0x100)]
    # Mooncake accepted a batch: its segment is open, so no further probe.
    engine.write("old-peer:1", [SRC], [0x200], [64])
    assert len(started) == 1


def test_closing_fails_a_held_back_write_without_submitting_it(rig):
    engine, fake, started = rig
    ticket = engine.write_async("silent:1", [SRC], [0x100], [64])
    engine.close()
    with pytest.raises(EngineError, match="closed before the peer answered its probe"):
        engine.poll(ticket)
    _answer(engine, fake, started[0])  # a probe that returns after close() changes nothing
    assert fake.writes == []


def test_probing_can_be_turned_off(monkeypatch):
    fake = _ProbingTE()

    stand_in_mooncake(monkeypatch, fake)
    with Engine("127.0.0.1", protocol="tcp", open_timeout_s=0) as engine:
        engine.register(SRC, 64)
        engine.write("peer:1", [SRC], [0x100], [64])
    assert fake.writes == [("peer:1", 0x100)] and fake.probed == []
    with pytest.raises(ValueError, match="open_timeout_s=-1 is not a non-negative number of seconds"):
        Engine("127.0.0.1", protocol="tcp", open_timeout_s=-1)


@pytest.mark.parametrize("argument", ["open_timeout_s", "transfer_timeout_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 1e300, 10**400])
def test_a_timeout_that_would_bound_nothing_is_refused_before_the_engine_starts(monkeypatch, argument, value):
    monkeypatch.setattr(engine_module, "_import_engine", lambda: pytest.fail("the engine was started"))
    with pytest.raises(ConfigError, match=f"{argument}=.* is not a .*number of seconds up to 1000000"):
        Engine("127.0.0.1", protocol="tcp", **{argument: value})


def test_a_timeout_of_another_type_is_a_type_error(monkeypatch):
    monkeypatch.setattr(engine_module, "_import_engine", lambda: pytest.fail("the engine was started"))
    with pytest.raises(ConfigTypeError, match="transfer_timeout_s='30'"):
        Engine("127.0.0.1", protocol="tcp", transfer_timeout_s="30")


def test_a_write_after_the_answer_goes_behind_the_writes_held_before_it(rig):
    engine, fake, started = rig
    held = engine.write_async("new:1", [SRC], [0x100], [64])
    _answer(engine, fake, started[0])
    later = engine.write_async("new:1", [SRC], [0x200], [64])
    assert fake.writes == [("new:1", 0x100), ("new:1", 0x200)]
    assert engine.poll(held) is True and engine.poll(later) is True


def test_a_session_forgotten_while_its_write_is_in_flight_probes_again_and_holds_the_next(rig):
    engine, fake, started = rig
    opening = engine.write_async("peer:1", [SRC], [0x100], [64])
    _answer(engine, fake, started[0])
    assert engine.poll(opening) is True
    fake.in_flight.add(1002)  # the next write's batch stays in flight
    flying = engine.write_async("peer:1", [SRC], [0x200], [64])
    assert fake.writes[-1] == ("peer:1", 0x200)
    fake.refusing = True
    with pytest.raises(EngineError, match=r"write to peer:1 failed \(Mooncake refused the batch"):
        engine.write_async("peer:1", [SRC], [0x300], [64])
    fake.refusing = False
    # Refused: the session is probed again before Mooncake's next handshake with it.
    later = engine.write_async("peer:1", [SRC], [0x400], [64])
    assert len(started) == 2 and fake.writes[-1] == ("peer:1", 0x200)
    assert engine.poll(flying) is False and engine.poll(later) is False
    fake.in_flight.clear()
    assert engine.poll(flying) is True
    assert engine.poll(later) is False  # still behind its probe
    _answer(engine, fake, started[1])
    assert engine.poll(later) is True
    assert fake.writes == [("peer:1", 0x100), ("peer:1", 0x200), ("peer:1", 0x400)]
    engine.unregister(SRC)  # nothing reads the source any more
    engine.register(SRC, 1 << 20)


def test_a_write_reads_only_from_memory_still_registered(rig):
    engine, fake, started = rig
    engine._openings.opened("peer:1")
    other = SRC + (2 << 20)
    engine.register(other, 4096)
    engine.write("peer:1", [other, SRC], [0x100, 0x200], [64, 64])  # one buffer in each region
    engine.unregister(SRC)
    with pytest.raises(EngineError, match=r"source 0x10040 length 64 is not inside memory registered"):
        engine.write_async("peer:1", [SRC + 64], [0x100], [64])
    with pytest.raises(EngineError, match="is not inside memory registered"):
        engine.write_async("peer:1", [other + 4032], [0x100], [128])  # runs past the region's end
    engine.register(SRC, 1 << 20)
    engine.write("peer:1", [SRC + 64], [0x300], [64])
    assert fake.writes == [("peer:1", 0x100), ("peer:1", 0x200), ("peer:1", 0x300)]


def test_a_write_polled_while_its_session_s_writes_are_being_handed_over_is_not_overdue(rig):
    engine, fake, started = rig
    first = engine.write_async("new:1", [SRC], [0x100], [64])
    second = engine.write_async("new:1", [SRC + 64], [0x200], [64])
    _answer(engine, fake, started[0])
    seen = []
    submit = fake.batch_transfer_async_write

    def submit_and_poll_the_other(session, srcs, dsts, lens):
        # Another thread polls its ticket while this one hands the session's writes over.
        if not seen:
            seen.append(engine.poll(second))
        return submit(session, srcs, dsts, lens)

    fake.batch_transfer_async_write = submit_and_poll_the_other
    assert engine.poll(first) is True
    assert seen == [False]  # not yet handed over: in flight, not past a transfer timeout
    assert engine.poll(second) is True
    assert fake.writes == [("new:1", 0x100), ("new:1", 0x200)]


def _write_held_for_its_probe(engine, monkeypatch, session: str) -> tuple[FakeTime, int]:
    """A fake clock at 100 s, and a write to a new `session` polled once, 1 ms on: held for its probe."""
    clock = FakeTime(100.0)
    monkeypatch.setattr(engine_module, "time", clock)
    ticket = engine.write_async(session, [SRC], [0x100], [64])
    clock.now = 100.001
    assert engine.poll(ticket) is False
    return clock, ticket


@pytest.mark.parametrize("probe_thread_first", [False, True])
def test_a_write_held_back_while_its_own_process_was_held_up_is_not_refused_for_it(rig, monkeypatch,
                                                                                   probe_thread_first):
    """The probe goes out, the writer's process is stopped 8 s (past the 5 s open bound), then runs again:
    whether its poll or the probe's thread comes first, the peer's answer lets the write go."""
    engine, fake, started = rig
    clock, ticket = _write_held_for_its_probe(engine, monkeypatch, "new:1")
    clock.now = 108.0  # the process ran again
    if probe_thread_first:
        _answer(engine, fake, started[0])
    assert engine.poll(ticket) is (True if probe_thread_first else False)
    if not probe_thread_first:
        clock.now = 108.001
        _answer(engine, fake, started[0])
        assert engine.poll(ticket) is True
    assert fake.writes == [("new:1", 0x100)]


def test_a_silent_peer_still_fails_its_writes_a_bound_after_its_prober_was_held_up(rig, monkeypatch):
    engine, fake, started = rig
    clock, ticket = _write_held_for_its_probe(engine, monkeypatch, "silent:1")
    clock.now = 108.0
    assert engine.poll(ticket) is False  # held up 8 s: not the peer's
    while clock.now < 112.99:  # 5 s of its own: 100 to 100.001, and 108.0 on
        clock.now += 0.001
        assert engine.poll(ticket) is False
    clock.now = 113.01
    with pytest.raises(EngineError, match=r"did not answer within 5s \(probed 13.0s ago, 8.0s of which this "
                                          r"process was held up\)"):
        engine.poll(ticket)
    assert fake.writes == []

"""Stand-ins the unit and live tests share: an engine that records registrations (and one that plays a
racing call during one), a clock, copy-out events and receive regions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class RecordingEngine:
    """Stands in for transfer.engine.Engine's register/unregister (pure-logic tests only)."""

    def __init__(self) -> None:
        self.regions: dict[int, int] = {}
        self.log: list[tuple[str, int, int]] = []

    def register(self, buf, length=None):
        addr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        assert addr not in self.regions, f"{addr:#x} registered twice"
        self.regions[addr] = nbytes
        self.log.append(("register", addr, nbytes))
        return addr, nbytes

    def unregister(self, addr):
        nbytes = self.regions.pop(addr)
        self.log.append(("unregister", addr, nbytes))


class InterleavingEngine(RecordingEngine):
    """Runs `during_register` inside register(), once, where the lock is free: there it plays the
    racing thread's call. `lock_free` records whether the pool's lock was free each time."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: Any = None  # a ReceivePool
        self.during_register = None
        self.lock_free: list[bool] = []

    def register(self, buf, length=None):
        racing, self.during_register = self.during_register, None
        if racing is not None:
            free = self.pool._lock.acquire(blocking=False)
            if free:
                self.pool._lock.release()
                racing()  # a held lock would deadlock the racing call: it only runs where the lock is free
            self.lock_free.append(free)
        return super().register(buf, length)


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeTime:
    """Stands in for the `time` module where a module reads its monotonic clock and sleeps: moved by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeEvent:
    """A copy-out event: query() is False until done is set; counts the queries."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


@dataclass(frozen=True)
class Region:
    """A registered receive region: where it starts and how long it is."""

    addr: int
    nbytes: int


@dataclass(frozen=True)
class Regions:
    """The region pair a room's rows land in (embedding, and deepstack when present), as a receive pool leases it."""

    embedding: Region
    deepstack: Region | None = None


class MooncakeStandIn:
    """The part of mooncake's TransferEngine an Engine calls at start and (un)registration, all succeeding."""

    def initialize(self, *args) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 4242

    def register_memory(self, addr: int, nbytes: int) -> int:
        return 0

    def unregister_memory(self, addr: int) -> int:
        return 0


_lazy_ready = False


def on_lazy_device(tensor: Any) -> Any:
    """`tensor` on torch's lazy device: a device other than cpu and cuda that a CPU-only torch has. Its
    backend is initialised once a process (a second init raises)."""
    global _lazy_ready
    import pytest

    lazy = pytest.importorskip("torch._lazy.ts_backend")
    if not _lazy_ready:
        lazy.init()
        _lazy_ready = True
    return tensor.to("lazy")


def interrupted_once(call: Any) -> Any:
    """`call`, whose first call meets a stop signal's exception (KeyboardInterrupt) instead of running."""
    calls = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if not calls:
            calls.append(1)
            raise KeyboardInterrupt
        return call(*args, **kwargs)
    return interrupted


def stand_in_mooncake(monkeypatch: Any, te: Any) -> None:
    """Makes transfer.engine start `te` (a MooncakeStandIn) where it would start Mooncake's TransferEngine."""
    from transfer import engine as engine_module

    class Module:
        TransferEngine = staticmethod(lambda: te)

    monkeypatch.setattr(engine_module, "_import_engine", lambda: Module)

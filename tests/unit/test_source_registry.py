"""The encode driver's source registry: a caller's registration leaves the counts' lock free."""

from __future__ import annotations

import pytest

from transfer import _io
from transfer.drive.encode import SourceRegistry


class FakeEngine:
    """register() / unregister() / registered() over a dict; `during_register` runs inside register()."""

    def __init__(self) -> None:
        self.regions: dict[int, int] = {}
        self.during_register = lambda: None

    def registered(self) -> dict[int, int]:
        return dict(self.regions)

    def register(self, buf: int, nbytes: int) -> None:
        self.during_register()
        self.regions[buf] = nbytes

    def unregister(self, addr: int) -> None:
        del self.regions[addr]


def test_a_registration_leaves_the_lock_to_the_drivers_release_of_another_room():
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    release_first = sources.hold(_io.Region(0x1000, 256))
    seen = []

    def release_meanwhile() -> None:
        free = sources.lock.acquire(blocking=False)  # what the driver's retry and releases take
        if free:
            sources.lock.release()
            release_first()
        seen.append(free)

    engine.during_register = release_meanwhile
    release_second = sources.hold(_io.Region(0x9000, 256))
    assert seen == [True]
    assert engine.regions == {0x9000: 256}
    assert sources.counts.counts() == {0x9000: 1}
    release_second()
    assert engine.regions == {} and len(sources.counts) == 0



def test_a_registration_not_yet_counted_is_not_taken_for_the_callers_own():
    # Another caller's source inside a region the engine has just registered, before the registry
    # counted it: were it taken for the caller's own registration, no room would hold it for that
    # caller, and the first room's release would drop it under the second's source.
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    seen = []

    def look_meanwhile() -> None:
        engine.regions[0x9000] = 256  # the engine has it; the registry has not counted it yet
        seen.append(sources._hold_registered(_io.Region(0x9040, 64)))

    engine.during_register = look_meanwhile
    release = sources.hold(_io.Region(0x9000, 256))
    assert seen == [(False, None)]  # not registered as far as another caller can tell: it waits its turn
    assert sources.hold(_io.Region(0x9040, 64)) is not None  # once counted, held a second time
    assert sources.counts.counts() == {0x9000: 2}
    release()
    assert engine.regions == {0x9000: 256}


def test_registries_on_one_engine_keep_a_shared_source_registered_until_the_last_lets_go():
    # Two sender pools on one engine: the second finds the first's registration around its source.
    # Taken for the caller's own, no room of the second would hold it, and the first's release would
    # unregister it under the second's write.
    engine = FakeEngine()
    first, second = SourceRegistry(engine), SourceRegistry(engine)
    release_first = first.hold(_io.Region(0x9000, 256))
    release_second = second.hold(_io.Region(0x9040, 64))
    assert release_second is not None and second.counts.counts() == {0x9000: 2}
    release_first()
    assert engine.regions == {0x9000: 256}
    release_second()
    assert engine.regions == {} and len(first.counts) == len(second.counts) == 0
    other = SourceRegistry(FakeEngine())  # another engine's registrations are counted apart
    assert other.counts is not first.counts


def test_no_registry_on_the_engine_unregisters_memory_the_caller_registered():
    engine = FakeEngine()
    engine.regions[0x9000] = 256  # the caller's own registration
    first, second = SourceRegistry(engine), SourceRegistry(engine)
    assert first.hold(_io.Region(0x9000, 256)) is None and second.hold(_io.Region(0x9040, 64)) is None
    release = first.hold(_io.Region(0x20000, 128))  # one of ours beside it
    assert release is not None
    release()
    first.retry()
    second.retry()
    assert engine.regions == {0x9000: 256} and len(first.counts) == 0


class RefusingOverlaps(FakeEngine):
    """Refuses a registration that overlaps another, as Mooncake does."""

    def register(self, buf, nbytes: int) -> None:
        addr = buf if isinstance(buf, int) else buf.data_ptr()
        if any(base < addr + nbytes and addr < base + size for base, size in self.regions.items()):
            raise RuntimeError(f"{addr:#x} overlaps a registered region")
        self.regions[addr] = nbytes


def test_overlapping_views_of_one_tensor_share_the_registration_of_its_storage():
    import torch

    engine = RefusingOverlaps()
    sources = SourceRegistry(engine)
    items = torch.zeros(8, 16)
    whole = (items.data_ptr(), 8 * 16 * 4)
    releases = [sources.hold(_io.as_region(items[:2])), sources.hold(_io.as_region(items[:4])),
                sources.hold(_io.as_region(items[1:6]))]
    assert engine.regions == dict([whole])
    assert sources.counts.counts() == {whole[0]: 3}
    for release in releases:
        release()
    assert engine.regions == {} and len(sources.counts) == 0


def test_a_view_whose_storage_is_partly_registered_already_registers_alone():
    import torch

    engine = RefusingOverlaps()
    sources = SourceRegistry(engine)
    items = torch.zeros(8, 16)
    engine.regions[items[6:].data_ptr()] = 2 * 16 * 4  # the caller's own registration of the last rows
    release = sources.hold(_io.as_region(items[:2]))
    assert engine.regions[items.data_ptr()] == 2 * 16 * 4
    release()
    assert items.data_ptr() not in engine.regions and len(engine.regions) == 1


def test_a_source_overlapping_a_registration_it_does_not_lie_inside_is_refused_naming_it_and_the_way_out():
    import pytest

    from transfer.errors import EngineError

    engine = RefusingOverlaps()
    sources = SourceRegistry(engine)
    release = sources.hold(_io.Region(0x9000, 256))  # another room's rows, given by address
    with pytest.raises(EngineError, match=r"^source 0x9080 \(256 bytes\) overlaps memory already registered at 0x9000 "
                                          r"\(256 bytes, a temporary registration held for another room's source\) "
                                          r"without lying inside it, .*: register one region that holds the whole "
                                          r"source before sending it \(engine.register\), or send a copy of it"):
        sources.hold(_io.Region(0x9080, 256))
    assert engine.regions == {0x9000: 256} and sources.counts.counts() == {0x9000: 1}
    release()
    engine.regions[0x20000] = 128  # the caller's own
    with pytest.raises(EngineError, match=r"at 0x20000 \(128 bytes, the caller's own\)"):
        sources.hold(_io.Region(0x1ff80, 256))
    assert engine.regions == {0x20000: 128} and len(sources.counts) == 0


def test_a_stopped_drivers_registry_lets_go_of_every_hold_but_those_a_write_still_reads():
    # A driver that failed never releases the rooms it lost on the way: the pool lets go of
    # them all at once, keeping what a write still in flight reads (the engine may read it).
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    releases = [sources.hold(_io.Region(0x1000, 256)), sources.hold(_io.Region(0x9000, 256), _io.Region(0x1040, 64))]
    sources.hold(_io.Region(0x20000, 128))
    assert sources.release_all(reads=[(0x9080, 16)]) == 2
    assert sources.flush() == 0
    assert engine.regions == {0x9000: 256, 0x1000: 256} and sources.counts.counts() == {0x9000: 1, 0x1000: 1}
    for release in releases:
        release()  # a hold already let go of is not let go of again
    assert engine.regions == {} and len(sources.counts) == 0 and sources.holding == 0
    assert sources.release_all() == 0


def test_letting_go_of_a_stopped_pools_holds_leaves_another_pools_hold_on_a_shared_source():
    engine = FakeEngine()
    stopped, running = SourceRegistry(engine), SourceRegistry(engine)
    lost = stopped.hold(_io.Region(0x9000, 256))
    kept = running.hold(_io.Region(0x9040, 64))
    assert lost is not None and kept is not None
    assert stopped.release_all() == 1
    lost()  # the stopped pool's own release, late: the shared count must not drop twice
    assert engine.regions == {0x9000: 256} and running.counts.counts() == {0x9000: 1}
    assert running.holding == 1 and stopped.holding == 0
    kept()
    assert engine.regions == {} and len(running.counts) == 0


class IndexedEngine(RefusingOverlaps):
    """An engine that finds a registration by address (as Engine and WireEngine do) and counts the snapshots of
    all of them that registered() hands out, region by region."""

    def __init__(self) -> None:
        from transfer.core.registrations import Registrations

        super().__init__()
        self.regions = Registrations()
        self.copied = 0

    def registered(self) -> dict[int, int]:
        self.copied += len(self.regions)
        return dict(self.regions)

    def registration_holding(self, addr: int, nbytes: int):
        return self.regions.holding(addr, nbytes)

    def registration_overlapping(self, addr: int, nbytes: int):
        return self.regions.overlapping(addr, nbytes)


def test_a_sources_look_up_reads_no_snapshot_of_the_registrations_other_rooms_hold():
    # Rooms waiting for their receivers each hold a temporary registration: a send that copied and scanned all
    # of them would cost more with each item waiting, on the caller's thread.
    import torch

    engine = IndexedEngine()
    sources = SourceRegistry(engine)
    held = [sources.hold(_io.Region(0x100000 + i * 0x1000, 256)) for i in range(2000)]
    engine.regions[0x9000000] = 4096  # the caller's own
    items = torch.zeros(8, 16)
    engine.copied = 0
    inside = sources.hold(_io.Region(0x100000 + 7 * 0x1000 + 64, 64))  # another room's rows
    assert inside is not None and sources.counts.counts()[0x100000 + 7 * 0x1000] == 2
    assert sources.hold(_io.Region(0x9000010, 64)) is None
    view = sources.hold(_io.as_region(items[2:4]))  # a view: its whole storage is registered
    assert engine.regions[items.data_ptr()] == 8 * 16 * 4
    import pytest

    from transfer.errors import EngineError

    with pytest.raises(EngineError, match="overlaps memory already registered at 0x9000000"):
        sources.hold(_io.Region(0x8ffff00, 512))
    assert engine.copied == 0
    for release in [*held, inside, view]:
        release()
    assert dict(engine.regions) == {0x9000000: 4096} and len(sources.counts) == 0


class _InterruptedWaiting:
    """The registry's lock, whose next `with` raises KeyboardInterrupt while it waits (a stop signal landing in
    a send() blocked behind another thread's deregistration); acquire() is left alone."""

    def __init__(self, lock) -> None:
        self._lock = lock
        self.armed = False

    def acquire(self, *args) -> bool:
        return self._lock.acquire(*args)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_hold_interrupted_while_it_files_its_registrations_lets_go_of_them():
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    release_first = sources.hold(_io.Region(0x1000, 256))
    sources.lock = lock = _InterruptedWaiting(sources.lock)
    lock.armed = True  # the next `with` is where the second hold files what it holds
    with pytest.raises(KeyboardInterrupt):
        sources.hold(_io.Region(0x1000, 256))
    assert sources.counts.counts() == {0x1000: 1} and sources.holding == 1
    release_first()
    assert engine.regions == {} and len(sources.counts) == 0

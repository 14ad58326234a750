"""The encode driver's failure paths, run on the test's thread: its sockets, waker and status pushers
are stand-ins, and the engine is a dict with a poll() the test answers.

What the thread does with real sockets and Mooncake is in tests/live (test_room_rules.py,
test_source_registration.py, test_encode_driver_fds.py)."""

from __future__ import annotations

import logging
import math

import pytest

from transfer import _io
from transfer.core.encode import Conclude, EncodeCore, Offer, PushStatus, Release, StartWrite
from transfer.core.failure import Failure, FailureKind
from transfer.drive import encode as drive
from transfer.drive.encode import EncodeDriver, RoomBook, RoomState, SourceRegistry
from transfer.metrics import Metrics
from transfer.status import TransferPoll


class FakeEngine:
    """registered()/register()/unregister() over a dict; poll(batch) says done once `polls_left[batch]` ran out."""

    def __init__(self) -> None:
        self.regions: dict[int, int] = {}
        self.polls_left: dict[int, int] = {}  # batch -> polls that still answer "in flight"
        self.events: list[tuple] = []

    def registered(self) -> dict[int, int]:
        return dict(self.regions)

    def register(self, buf: int, nbytes: int) -> None:
        self.regions[buf] = nbytes

    def unregister(self, addr: int) -> None:
        self.events.append(("unregister", addr))
        del self.regions[addr]

    def poll(self, batch: int) -> bool:
        left = self.polls_left.get(batch, 0)
        self.polls_left[batch] = left - 1
        self.events.append(("poll", batch, left <= 0))
        return left <= 0


class FakeCore:
    """What the driver asks of an EncodeCore when settling and closing; write_done raises for `broken` writes."""

    busy = False

    def __init__(self, broken: set[int] | None = None) -> None:
        self.broken = broken if broken is not None else set()
        self.done: list[int] = []

    def write_done(self, wid: int, checksums: tuple, now: float) -> list:
        if wid in self.broken:
            raise RuntimeError(f"injected: write {wid}")
        self.done.append(wid)
        return []

    def write_failed(self, wid: int, error: str, took: float, now: float, *, blocking: bool = False) -> list:
        return self.write_done(wid, (), now)

    def stop_writes(self) -> None:
        pass

    def close(self, now: float, detail: str = "", *, give_up_writes: bool = True, stuck: str | None = None) -> list:
        self.stuck = stuck
        return []

    def writing(self) -> list[tuple[int, str]]:
        return [(7, "s2")]

    def next_wakeup(self) -> float:
        return math.inf


class Closable:
    """A stand-in for the request socket, the waker and the status pushers: records its close."""

    def __init__(self, *args, **kwargs) -> None:
        self.closed = False
        self.dropped = 0

    def fileno(self) -> int:
        return 99

    def close(self, *args, **kwargs) -> None:
        self.closed = True

    def pending(self) -> bool:
        return False

    def wake(self) -> None:
        pass


@pytest.fixture
def make_driver(monkeypatch):
    monkeypatch.setattr(_io, "Waker", Closable)
    monkeypatch.setattr(_io, "Pushers", Closable)
    monkeypatch.setattr(_io, "pull_socket", lambda host, port, what="": (Closable(), 7000))

    def make(core, engine: FakeEngine, sources: SourceRegistry | None = None, clock=lambda: 0.0,
             sleep=None) -> EncodeDriver:
        return EncodeDriver(core, engine, 0, "127.0.0.1", 0, RoomBook(Metrics("epd_test")),
                            sources or SourceRegistry(engine), Metrics("epd_test"), clock=clock,
                            **({} if sleep is None else {"sleep": sleep}))
    return make


def _flight(wid: int, batch: int, session: str, *reads: tuple[int, int]) -> drive._Flight:
    return drive._Flight(wid, batch, session, sum(n for _, n in reads), (), 0.0, tuple(a for a, _ in reads),
                         tuple(n for _, n in reads))


def test_a_failure_settling_one_write_leaves_the_others_in_flight_and_their_sources_held(make_driver):
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    sources.hold(_io.Region(0x9000, 256))  # what the write that completes read
    sources.hold(_io.Region(0x1000, 256))  # what the write still in flight reads
    driver = make_driver(FakeCore(broken={1}), engine, sources)
    done, reading = _flight(1, 11, "s1", (0x9000, 256)), _flight(2, 12, "s2", (0x1000, 256))
    driver._flights = [done, reading]
    engine.polls_left[12] = 5
    with pytest.raises(RuntimeError, match="injected"):
        driver._settle()  # the core raises about the first write: the thread is failing
    assert driver._flights == [reading]
    driver.release_sources()  # what the failing thread's close does with the holds no room released
    assert engine.regions == {0x1000: 256}, "a source was unregistered while a write still reads it"
    sources.retry()  # nothing polls that write now: the hold waits in the engine's book for it to be over
    assert engine.regions == {0x1000: 256}, "a source was unregistered while a write still reads it"


def test_closing_waits_for_every_write_in_flight_though_settling_one_fails(make_driver, caplog):
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    for base in (0x9000, 0x1000, 0x5000):
        sources.hold(_io.Region(base, 256))
    core = FakeCore(broken={1, 3})
    driver = make_driver(core, engine, sources)
    driver._flights = [_flight(1, 11, "s1", (0x9000, 256)), _flight(2, 12, "s2", (0x1000, 256)),
                       _flight(3, 13, "s3", (0x5000, 256))]
    engine.polls_left[12] = 1  # still in flight on the first round, done on the second
    with caplog.at_level(logging.ERROR, logger="transfer.sender"):
        driver._close()
    assert driver._flights == [] and core.done == [2]
    assert engine.events.index(("poll", 12, True)) < engine.events.index(("unregister", 0x1000)), engine.events
    assert engine.regions == {} and sources.holding == 0
    assert driver.pull.closed and driver.waker.closed and driver.statuses.closed
    assert sum("settling a write failed while closing" in m for m in caplog.messages) == 1


class Clock:
    """A fake clock that only a sleep moves on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_closing_gives_up_on_a_stuck_write_at_close_by_and_keeps_what_it_reads(make_driver, caplog):
    """A write that never settles is waited for until CLOSE_AFTER_WRITES_S before the close's deadline (long
    before CLOSE_WAIT_S), then abandoned: the log names it, its room's failure says so, and its source stays
    registered while the done write's is dropped."""
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    sources.hold(_io.Region(0x9000, 256))  # what the write that completes read
    sources.hold(_io.Region(0x1000, 256))  # what the stuck write reads
    core = FakeCore()
    clock = Clock()
    driver = make_driver(core, engine, sources, clock=clock, sleep=clock.sleep)
    driver._flights = [_flight(1, 11, "s1", (0x9000, 256)), _flight(2, 12, "s2", (0x1000, 256))]
    engine.polls_left[12] = 10**9  # never settles
    driver.stop(close_by=5.0)
    with caplog.at_level(logging.ERROR, logger="transfer.sender"):
        driver._close()
    assert 5.0 - drive.CLOSE_AFTER_WRITES_S <= clock.now < drive.CLOSE_WAIT_S
    assert core.done == [1] and [f.wid for f in driver._flights] == [2]
    assert "write still in flight" in core.stuck and "EPD_CLOSE_TIMEOUT_S" in core.stuck
    assert engine.regions == {0x1000: 256}
    sources.retry()
    assert engine.regions == {0x1000: 256}, "a source was unregistered while a write still reads it"
    [line] = [m for m in caplog.messages if "abandoned" in m]
    assert "abandoned 1 writes (256 bytes)" in line and "to s2, of rooms 7" in line
    assert driver.pull.closed and driver.waker.closed and driver.statuses.closed


def test_what_an_abandoned_write_reads_is_let_go_of_by_a_pool_on_the_engine_once_the_engine_is_done_with_it(
        make_driver):
    """Nothing polls a write the close abandoned: its source's temporary registration was kept for the engine's
    life, though the write ended. The next pool on the engine lets go of it once the engine says the write is
    over (or failed), not before; a hold on memory no abandoned write reads is not handed over."""
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    sources.hold(_io.Region(0x1000, 256))  # what the abandoned write reads
    sources.hold(_io.Region(0x5000, 128))  # what the failed one reads
    sources.hold(_io.Region(0x9000, 64))  # what no write reads
    clock = Clock()
    driver = make_driver(FakeCore(), engine, sources, clock=clock, sleep=clock.sleep)
    driver._flights = [_flight(2, 12, "s2", (0x1040, 64)), _flight(3, 13, "s2", (0x5000, 128))]
    engine.polls_left[12] = engine.polls_left[13] = 10**9  # neither settles while the pool closes
    driver.stop(close_by=5.0)
    driver._close()
    assert engine.regions == {0x1000: 256, 0x5000: 128}, "kept while the writes may read them, the rest dropped"
    later = SourceRegistry(engine)  # the next pool's, on the same engine
    later.retry()
    assert engine.regions == {0x1000: 256, 0x5000: 128}
    engine.polls_left[12] = 0  # that write is over

    def failed(batch: int) -> bool:
        if batch == 13:
            raise RuntimeError("write failed")  # the engine refuses to unregister what it may still read
        return FakeEngine.poll(engine, batch)

    engine.poll = failed
    later.retry()
    assert engine.regions == {} and len(later.counts) == 0 and sources.holding == 0
    later.retry()
    assert [e for e in engine.events if e[0] == "unregister"] == [("unregister", 0x9000), ("unregister", 0x1000),
                                                                  ("unregister", 0x5000)]


def _sent(driver: EncodeDriver, room: int, sources: SourceRegistry, base: int) -> RoomState:
    """A room send() published: held in the book, its source held, its item queued for the thread."""
    region = _io.Region(base, 4 * 64 * 2)
    state = RoomState(room, 0.0, sources.hold(region))
    driver.book.held[room] = state
    driver.book.table.start(room, TransferPoll.WaitingForInput)
    driver.offer(Offer(room, state, base, 4, 64, "bfloat16", 128, sources=(region, None)))
    return state


class Broken(Exception):
    pass


@pytest.mark.parametrize("step", ["naming", "request socket"])
def test_a_thread_that_fails_while_setting_up_fails_its_rooms_and_closes(make_driver, monkeypatch, step):
    def broken(*args):
        raise Broken("injected")

    if step == "naming":
        monkeypatch.setattr(_io, "name_this_thread", broken)
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    driver = make_driver(EncodeCore(now=0.0), engine, sources)
    if step == "request socket":
        monkeypatch.setattr(_io, "name_this_thread", lambda name: None)
        monkeypatch.setattr(driver.pull, "fileno", broken)  # the socket's FD option
    state = _sent(driver, 1, sources, 0x9000)
    driver._run()  # what the thread runs, here on the test's
    assert driver.book.stopping
    assert driver.book.table.get(1) is TransferPoll.Failed
    assert driver.book.table.failure(1).detail == "sender pool stopped: Broken: injected"
    assert state.concluded_at is not None
    assert driver.pull.closed and driver.waker.closed and driver.statuses.closed
    assert engine.regions == {} and sources.holding == 0


def test_closing_closes_the_sockets_though_failing_the_rooms_raises(make_driver, monkeypatch):
    driver = make_driver(EncodeCore(now=0.0), FakeEngine())

    def broken(*args):
        raise Broken("injected")

    monkeypatch.setattr(driver.core, "stop_writes", broken)
    monkeypatch.setattr(driver.book, "fail_open", broken)
    with pytest.raises(Broken):
        driver._close()
    assert driver.pull.closed and driver.waker.closed and driver.statuses.closed


def test_a_stopped_driver_drops_the_items_it_never_filed_and_queues_no_later_command(make_driver, monkeypatch, caplog):
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    driver = make_driver(EncodeCore(now=0.0), engine, sources)

    def broken(offer, now):
        raise Broken("injected")

    monkeypatch.setattr(driver.core, "offer", broken)  # each take of an item raises: some are never taken
    states = [_sent(driver, room, sources, 0x1000 * room) for room in (1, 2, 3)]
    with caplog.at_level(logging.WARNING, logger="transfer.sender"):
        driver._close()
    assert not driver.commands
    assert "dropped 1 items its stopped thread never filed" in caplog.text
    assert driver.book.stopping
    assert all(driver.book.table.get(room) is TransferPoll.Failed for room in (1, 2, 3))
    assert engine.regions == {} and sources.holding == 0
    for state in states:
        driver.post("clear", state.room, state)  # what clear() posts on a pool whose thread stopped
    assert not driver.commands


def test_closing_tells_how_many_warnings_were_left_out(make_driver, caplog):
    # A peer's flood of one complaint logs one line and counts its repeats; with no later warning
    # to tell them, the close does.
    driver = make_driver(FakeCore(), FakeEngine())
    with caplog.at_level(logging.WARNING, logger="transfer.sender"):
        for _ in range(100):
            driver._complaints.warning("bad ask", "dropped a malformed request")
        driver._close()
    assert caplog.messages.count("dropped a malformed request") == 1
    assert any(m.startswith("99 more warnings were not logged") for m in caplog.messages), caplog.messages


def test_a_close_shorter_than_its_reserve_still_waits_half_its_time_for_the_writes(make_driver, caplog):
    """close_timeout_s below CLOSE_AFTER_WRITES_S: the writes get half of what is left rather than nothing,
    so one that settles a few polls later is done, not abandoned."""
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    sources.hold(_io.Region(0x1000, 256))
    core = FakeCore()
    clock = Clock()
    driver = make_driver(core, engine, sources, clock=clock, sleep=clock.sleep)
    driver._flights = [_flight(2, 12, "s2", (0x1000, 256))]
    engine.polls_left[12] = 3  # settles on the fourth poll, a few poll gaps from now
    driver.stop(close_by=1.0)
    with caplog.at_level(logging.ERROR, logger="transfer.sender"):
        driver._close()
    assert core.done == [2] and driver._flights == [] and core.stuck is None
    assert engine.regions == {} and sources.holding == 0
    assert not [m for m in caplog.messages if "abandoned" in m]
    assert clock.now <= 0.5


class BatchingEngine(FakeEngine):
    """A FakeEngine with unregister_many (one engine call for many regions, as Engine's batch call), each region
    unregistered moving `clock` on by `cost_s`."""

    def __init__(self, clock: Clock | None = None, cost_s: float = 0.0) -> None:
        super().__init__()
        self.clock = clock
        self.cost_s = cost_s

    def unregister(self, addr: int) -> None:
        super().unregister(addr)
        if self.clock is not None:
            self.clock.sleep(self.cost_s)

    def unregister_many(self, addrs) -> dict[int, str]:
        addrs = list(addrs)
        self.events.append(("unregister_many", len(addrs)))
        for addr in addrs:
            del self.regions[addr]
        if self.clock is not None:
            self.clock.sleep(self.cost_s * len(addrs))
        return {}


def _released_rooms(driver: EncodeDriver, sources: SourceRegistry, rooms: int) -> None:
    """`rooms` rooms, each holding a temporary registration of its own, that the core says nothing reads any more."""
    states = []
    for room in range(rooms):
        state = RoomState(room, 0.0)
        state.release = sources.hold(_io.Region(0x100000 + room * 0x1000, 256))
        states.append(state)
    driver._carry([drive.Release(state.room, state) for state in states])


def test_the_registrations_of_many_rooms_released_at_once_go_in_batches_not_one_engine_call_each(make_driver):
    """Each unregistration of its own rewrites the engine's description of its memory (Mooncake): tens of
    thousands of rooms cleared, or failed by a close, held the driver's thread for seconds."""
    engine = BatchingEngine()
    sources = SourceRegistry(engine)
    driver = make_driver(FakeCore(), engine, sources)
    rooms = 2 * drive.DROP_BATCH + 5
    _released_rooms(driver, sources, rooms)
    driver._close()
    assert engine.events == [("unregister_many", drive.DROP_BATCH), ("unregister_many", drive.DROP_BATCH),
                             ("unregister_many", 5)]
    assert engine.regions == {} and len(sources.counts) == 0 and sources.holding == 0 and sources.dropping == 0


def test_a_registration_released_and_held_again_before_the_flush_stays_registered(make_driver):
    engine = BatchingEngine()
    sources = SourceRegistry(engine)
    driver = make_driver(FakeCore(), engine, sources)
    _released_rooms(driver, sources, 3)
    again = sources.hold(_io.Region(0x101000 + 64, 64))  # a new room's rows inside the second room's source
    assert again is not None
    assert sources.flush() == 0
    assert engine.regions == {0x101000: 256} and sources.counts.counts() == {0x101000: 1}
    again()
    assert engine.regions == {} and len(sources.counts) == 0


def test_closing_drops_registrations_until_its_deadline_and_leaves_the_rest_to_the_next_pool_on_the_engine(
        make_driver, monkeypatch):
    """Unregistering is slow with many registrations: a close that dropped them all overran close_timeout_s
    (its caller then logs the thread stuck in an engine call). It stops before close_by, and what it left is
    dropped by the next flush of a pool on the engine."""
    clock = Clock()
    engine = BatchingEngine(clock, cost_s=1e-3)
    sources = SourceRegistry(engine)
    driver = make_driver(FakeCore(), engine, sources, clock=clock, sleep=clock.sleep)
    monkeypatch.setattr(drive, "DROP_BATCH", 64)
    rooms = 3000
    _released_rooms(driver, sources, rooms)
    driver.stop(close_by=1.0)
    driver._close()
    assert clock.now <= 1.0, "closing dropped registrations past close_by"
    left = sources.dropping
    assert 0 < left < rooms and len(engine.regions) == left
    assert all(n <= 64 for kind, n in engine.events if kind == "unregister_many")
    later = SourceRegistry(engine)  # the next pool's, on the same engine
    assert later.flush() == 0
    assert engine.regions == {} and len(later.counts) == 0
    assert driver.pull.closed and driver.waker.closed and driver.statuses.closed


def test_a_source_overlapping_a_registration_no_room_holds_any_more_is_registered_not_refused(make_driver):
    """A released registration waits for the driver's flush: a caller's memory reused meanwhile at an address
    overlapping it (raw pointers) registers, the old registration dropped first, as it would once flushed."""
    engine = BatchingEngine()
    sources = SourceRegistry(engine)
    driver = make_driver(FakeCore(), engine, sources)
    _released_rooms(driver, sources, 1)
    release = sources.hold(_io.Region(0x100000 + 128, 512))  # overlaps the first room's 256 bytes
    assert release is not None
    assert engine.regions == {0x100000 + 128: 512} and sources.dropping == 0
    release()
    assert engine.regions == {}


class SyncEngine(FakeEngine):
    """An engine without an async API: write() returns once the write is over."""

    def write(self, session: str, srcs, dsts, lens) -> None:
        self.events.append(("write", session, tuple(srcs), tuple(dsts), tuple(lens)))


class AsyncEngine(SyncEngine):
    """An engine whose write_async() answers batch 42."""

    def write_async(self, session: str, srcs, dsts, lens) -> int:
        self.events.append(("write_async", session, tuple(srcs), tuple(dsts), tuple(lens)))
        return 42


class WantingCore(FakeCore):
    def wants(self, wid: int) -> bool:
        return True


@pytest.mark.parametrize("kind, call, batch", [(AsyncEngine, "write_async", 42), (SyncEngine, "write", 0)])
def test_a_write_goes_to_the_engines_async_call_or_to_its_synchronous_one_without(make_driver, kind, call, batch):
    engine = kind()
    driver = make_driver(WantingCore(), engine)
    assert driver._start(StartWrite(5, 1, "s1", (0x9000, 0xA000), (0x2000, 0x3000), (256, 64), 320)) == []
    assert engine.events == [(call, "s1", (0x9000, 0xA000), (0x2000, 0x3000), (256, 64))]
    [flight] = driver._flights
    assert (flight.wid, flight.batch, flight.session, flight.nbytes) == (5, batch, "s1", 320)


class _RefusingMetrics(Metrics):
    """The caller's metrics, whose every count raises (an exporter that is down)."""

    def inc(self, name: str, amount: float = 1, **labels: object) -> None:
        raise Broken(f"cannot count {name}")


def test_closing_with_counts_that_raise_still_fails_every_room_and_lets_go_of_every_source(make_driver, caplog):
    """The first room's count raising stops neither the conclusions of the others (their waiters would wait out
    their timeouts, their handles read them open after the close) nor the release of their sources."""
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    driver = make_driver(EncodeCore(now=0.0), engine, sources)
    driver.book.metrics = _RefusingMetrics("epd_test")
    states = [_sent(driver, room, sources, 0x1000 * room) for room in (1, 2, 3)]
    with caplog.at_level(logging.ERROR, logger="transfer.sender"):
        driver._close()
    assert "closing the sender pool's driver failed" in caplog.text and "cannot count" in caplog.text
    assert [driver.book.table.get(room) for room in (1, 2, 3)] == [TransferPoll.Failed] * 3
    assert all(state.concluded_at is not None for state in states)
    assert engine.regions == {} and sources.holding == 0
    assert driver.pull.closed and driver.waker.closed


def test_a_conclusion_whose_count_raises_stops_none_of_the_actions_after_it(make_driver):
    """The receivers of the other rooms are still told Failed and their sources let go of; the count's error
    is raised after."""
    engine = FakeEngine()
    sources = SourceRegistry(engine)
    driver = make_driver(EncodeCore(now=0.0), engine, sources)
    driver.book.metrics = _RefusingMetrics("epd_test")
    pushed: list = []
    driver.statuses.send = lambda endpoint, port, frames: pushed.append((endpoint, port))
    first, second = (_sent(driver, room, sources, 0x1000 * room) for room in (1, 2))
    failure = Failure(FailureKind.CLOSED, "sender pool closed")
    with pytest.raises(Broken):
        driver._carry([Conclude(1, first, TransferPoll.Failed, failure, 1.0),
                       PushStatus("10.0.0.2", 7100, 2, TransferPoll.Failed, failure=failure),
                       Conclude(2, second, TransferPoll.Failed, failure, 1.0), Release(2, second)])
    assert pushed == [("10.0.0.2", 7100)]
    assert [driver.book.table.get(room) for room in (1, 2)] == [TransferPoll.Failed] * 2
    assert second.release is None
    sources.flush()
    assert engine.regions == {0x1000: 4 * 64 * 2}


def test_a_write_whose_byte_count_raises_is_still_told_to_the_core_as_over(make_driver):
    """The write is over however the count of its bytes went: the core hears of it (its room may conclude
    Success, its receiver be told so), and the count's error is raised after."""
    engine = FakeEngine()
    core = FakeCore()
    driver = make_driver(core, engine)
    driver.metrics = _RefusingMetrics("epd_test")
    driver._flights = [_flight(1, 11, "s1", (0x9000, 256))]
    with pytest.raises(Broken, match="bytes_written_total"):
        driver._settle()
    assert driver._flights == [] and core.done == [1]

"""The session manager and the sender pool called from several threads at once.

Real Mooncake engines (tcp on loopback), a real bootstrap server and real ZMQ sockets.
Threads receive and send, wait on and poll handles, take concluded() and clear, for a few
seconds; then every room must have concluded once, its bytes landed, and every slot,
registration and room the calls held must be let go. Every wait is bounded: a hang fails
the test instead of holding it.
"""

from __future__ import annotations

import random
import threading
import time
import traceback

import torch
from live_helpers import HOST, LIVE, epd_threads, item_tensor, wait_until

from transfer.buffers import ReceivePool
from transfer.errors import UsageError
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll, is_terminal

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
SLOT = SPAN * HIDDEN * 2
SLOTS = 16
ITEMS = 8
BF16 = "torch.bfloat16"
#: How long the threads hammer the calls.
HAMMER_S = 3.0
#: The longest any thread may take to finish once told to stop (a hang shows as more).
JOIN_S = 15.0


class Threads:
    """Runs callables on threads; collects what any of them raised."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, name: str, body) -> None:
        def run() -> None:
            try:
                body()
            except BaseException:  # handed to the test
                self.errors.append(f"{name}: {traceback.format_exc()}")

        thread = threading.Thread(target=run, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self) -> list[str]:
        """Names of the threads still running after JOIN_S in all."""
        end = time.monotonic() + JOIN_S
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        return [thread.name for thread in self._threads if thread.is_alive()]


def _arena(encode):
    arena = torch.stack([item_tensor(i, SPAN, HIDDEN) for i in range(ITEMS)])
    encode.register(arena)
    return arena


def test_rooms_received_waited_on_and_concluded_from_several_threads_each_conclude_once(engines, server):
    encode, prefill = engines
    encode_before, prefill_before = encode.registered(), prefill.registered()
    arena = _arena(encode)
    threads = Threads()
    lock = threading.Lock()
    outstanding: dict[int, tuple] = {}  # room -> (receive handle, send handle)
    started: list[int] = []
    given_up: list[int] = []
    concluded: list[int] = []
    sent_concluded: list[int] = []
    bad: list[str] = []
    room_numbers = iter(range(1, 10**6))
    capacity = threading.Semaphore(SLOTS - 2)
    producing = [1, 2]  # one entry per producer thread still running
    try:
        with ReceivePool(prefill, SLOTS * SLOT, SLOT, quarantine_s=1.0, grace_s=0) as slots, \
                SenderPool(encode, 0, 1, 1, server.address, host=HOST) as sender, \
                SessionManager(prefill, 0, 1, 1, pool=slots, host=HOST, deadline_s=10) as manager:

            def produce() -> None:
                while not threads.stop.is_set():
                    if not capacity.acquire(timeout=0.05):
                        continue
                    with lock:
                        room = next(room_numbers)
                    handle = manager.receive(room, server.address, rows=SPAN, hidden=HIDDEN, dtype=BF16)
                    if room % 5 == 0:  # never sent: given up at once, while the other threads conclude theirs
                        handle.clear()
                        with lock:
                            given_up.append(room)
                        capacity.release()
                        continue
                    sent = sender.send(room, arena[room % ITEMS])
                    with lock:
                        outstanding[room] = (handle, sent)
                        started.append(room)
                with lock:
                    producing.pop()

            def wait_on_some() -> None:
                rng = random.Random(threading.get_ident())
                while not threads.stop.is_set():
                    with lock:
                        pairs = list(outstanding.values())
                    if not pairs:
                        time.sleep(0.001)
                        continue
                    handle, sent = rng.choice(pairs)
                    if rng.random() < 0.5:
                        handle.wait(0.05)
                        sent.wait(0.05)
                    else:
                        handle.poll()
                        sent.poll()

            def take(now_concluded: list[int], early: list[int], side: int, settle) -> None:
                """Settles each room of one side that concluded; a room concluded before its producer filed
                its handles waits in `early` for them."""
                rooms, early[:] = early + now_concluded, []
                for room in rooms:
                    with lock:
                        pair = outstanding.get(room)
                    if pair is None:
                        early.append(room)
                    else:
                        settle(room, pair[side])

            def received(room: int, handle) -> None:
                with lock:
                    concluded.append(room)
                status = handle.poll()
                if status != TransferPoll.Success:
                    bad.append(f"room {room}: {status.name} {handle.failure}")
                elif not torch.equal(handle.rows.view(torch.uint8), arena[room % ITEMS].view(torch.uint8)):
                    bad.append(f"room {room}: landed bytes differ")
                handle.clear()

            def sent_over(room: int, sent) -> None:
                with lock:
                    sent_concluded.append(room)
                if sent.poll() != TransferPoll.Success:
                    bad.append(f"sent room {room}: {sent.poll().name} {sent.failure}")
                sent.clear()

            def collect() -> None:
                received_early: list[int] = []
                sent_early: list[int] = []
                while True:
                    take(manager.concluded(), received_early, 0, received)
                    take(sender.concluded(), sent_early, 1, sent_over)
                    with lock:
                        for room in set(concluded) & set(sent_concluded):
                            if room in outstanding:
                                del outstanding[room]
                                capacity.release()
                        done = not producing and not outstanding
                    if done:
                        return
                    time.sleep(0.0005)

            for i in range(2):
                threads.start(f"produce-{i}", produce)
                threads.start(f"wait-{i}", wait_on_some)
            threads.start("collect", collect)
            time.sleep(HAMMER_S)
            threads.stop.set()
            hung = threads.join()
            assert not hung, f"threads {hung} still running after {JOIN_S:g}s"
            assert not threads.errors, threads.errors
            assert not bad, bad[:10]
            assert len(started) > 20, f"only {len(started)} rooms in {HAMMER_S:g}s"
            assert sorted(concluded) == sorted(started), "rooms concluded other than once each"
            assert sorted(sent_concluded) == sorted(started), "sent rooms concluded other than once each"
            assert given_up and not set(given_up) & set(concluded), "a room cleared before it concluded was handed out"
            assert manager._driver.rooms == {} and sender._book.held == {}
            assert wait_until(lambda: slots.stats()["free"] == SLOTS, 5.0), slots.stats()
    finally:
        encode.unregister(arena.data_ptr())
    assert encode.registered() == encode_before and prefill.registered() == prefill_before


def _closed_error(exc: BaseException) -> bool:
    """Whether `exc` is what a call on a closed manager or pool raises."""
    return isinstance(exc, UsageError) and "closed" in str(exc)


def _act_on_one(mine: list, rng: random.Random, concluded) -> None:
    """One call on one of this thread's handles: a short wait, a poll, the component's concluded(), or its clear()."""
    handle = rng.choice(mine)
    pick = rng.random()
    if pick < 0.3:
        handle.wait(0.02)
    elif pick < 0.5:
        handle.poll()
    elif pick < 0.7:
        concluded()
    else:
        handle.clear()
        mine.remove(handle)


def _noted(exc: BaseException, unexpected: list[str]) -> None:
    if not _closed_error(exc):
        unexpected.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


def _settle_after_close(mine: list, unexpected: list[str]) -> None:
    """Each of this thread's handles concludes once its component closed; cleared then."""
    for handle in mine:
        status = handle.wait(5.0)
        if not is_terminal(status):
            unexpected.append(f"room {handle.room}: still {status.name} 5s after close()")
        handle.clear()


def _close_while_hammered(threads: Threads, hammer, close, handles: list, unexpected: list[str]) -> None:
    """Three threads run `hammer` while two call `close` at once; every call ends, each either worked or
    said the component is closed, and every room concluded."""
    for i in range(3):
        threads.start(f"hammer-{i}", hammer)
    time.sleep(1.5)
    closers = Threads()
    for i in range(2):
        closers.start(f"close-{i}", close)
    threads.stop.set()
    assert not closers.join(), "close() hung"
    assert not closers.errors, closers.errors
    hung = threads.join()
    assert not hung, f"threads {hung} still running after {JOIN_S:g}s"
    assert not threads.errors, threads.errors
    assert not unexpected, unexpected[:5]
    assert len(handles) > 20, f"only {len(handles)} rooms"
    for handle in handles:
        assert is_terminal(handle.poll()), f"room {handle.room}: {handle.poll().name} after close()"


def test_a_session_manager_closed_while_threads_receive_wait_and_clear_leaves_nothing_held(engines, server):
    encode, prefill = engines
    encode_before, prefill_before = encode.registered(), prefill.registered()
    arena = _arena(encode)
    threads = Threads()
    lock = threading.Lock()
    handles: list = []
    unexpected: list[str] = []
    room_numbers = iter(range(1, 10**6))
    try:
        with ReceivePool(prefill, SLOTS * SLOT, SLOT, quarantine_s=1.0, grace_s=0) as slots, \
                SenderPool(encode, 0, 1, 1, server.address, host=HOST) as sender:
            manager = SessionManager(prefill, 0, 1, 1, pool=slots, host=HOST, deadline_s=10)

            def hammer() -> None:
                rng = random.Random(threading.get_ident())
                mine: list = []
                while True:
                    try:
                        if len(mine) < SLOTS // 4:
                            with lock:
                                room = next(room_numbers)
                            handle = manager.receive(room, server.address, rows=SPAN, hidden=HIDDEN, dtype=BF16)
                            mine.append(handle)
                            with lock:
                                handles.append(handle)
                            if rng.random() < 0.7:
                                sender.send(room, arena[room % ITEMS]).wait(0)
                            continue
                        _act_on_one(mine, rng, manager.concluded)
                    except Exception as exc:  # noqa: BLE001 - sorted below
                        _noted(exc, unexpected)
                        if threads.stop.is_set():
                            break
                _settle_after_close(mine, unexpected)

            _close_while_hammered(threads, hammer, manager.close, handles, unexpected)
            stats = slots.stats()
            assert stats["leased"] == 0 and stats["free"] + stats["quarantined"] == SLOTS, stats
            assert not [name for name in epd_threads() if name.startswith("epd-pre")], epd_threads()
    finally:
        encode.unregister(arena.data_ptr())
    assert encode.registered() == encode_before and prefill.registered() == prefill_before


def test_a_sender_pool_closed_while_threads_send_wait_and_clear_leaves_nothing_registered(engines, server):
    """Sources outside registered memory: each send() registers one for the room, which close() must let go."""
    encode, prefill = engines
    encode_before, prefill_before = encode.registered(), prefill.registered()
    threads = Threads()
    lock = threading.Lock()
    handles: list = []
    unexpected: list[str] = []
    room_numbers = iter(range(1, 10**6))
    buffer = torch.zeros(SLOTS, SPAN, HIDDEN, dtype=torch.bfloat16)
    with SessionManager(prefill, 0, 1, 1, buffer=buffer, host=HOST, deadline_s=10) as manager:
        sender = SenderPool(encode, 0, 1, 1, server.address, host=HOST)
        asked: dict[int, object] = {}

        def hammer() -> None:
            rng = random.Random(threading.get_ident())
            mine: list = []
            while True:
                try:
                    if len(mine) < 4:
                        with lock:
                            room = next(room_numbers)
                        handle = sender.send(room, item_tensor(room, SPAN, HIDDEN))
                        mine.append(handle)
                        with lock:
                            handles.append(handle)
                            slot = room % SLOTS
                            if rng.random() < 0.5 and slot not in asked:
                                asked[slot] = manager.receive(room, server.address, buffer[slot])
                        continue
                    _act_on_one(mine, rng, sender.concluded)
                    with lock:
                        for slot, received in list(asked.items()):
                            if is_terminal(received.poll()):
                                received.clear()
                                del asked[slot]
                except Exception as exc:  # noqa: BLE001 - sorted below
                    _noted(exc, unexpected)
                    if threads.stop.is_set():
                        break
            _settle_after_close(mine, unexpected)

        _close_while_hammered(threads, hammer, sender.close, handles, unexpected)
        assert sender._sources.holding == 0
        assert not [name for name in epd_threads() if name.startswith("epd-enc")], epd_threads()
        for received in asked.values():
            received.clear()
    assert encode.registered() == encode_before and prefill.registered() == prefill_before

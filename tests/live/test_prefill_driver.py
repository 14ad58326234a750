"""The prefill side's driver: bootstrap look-ups beside the status and deadline loop,
descriptors past select()'s limit, and close() with a stuck I/O thread.

Real Mooncake engines (tcp on loopback), a real bootstrap server for the encode rank
that answers, and a listener that accepts and never answers for the one that stalls.
"""

from __future__ import annotations

import gc
import os
import socket
import threading

import torch
from live_helpers import HOST, LIVE, free_port, item_tensor, wait_until

from transfer import _io
from transfer.core.failure import FailureKind
from transfer.drive import prefill as drive
from transfer.metrics import Metrics
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll, is_terminal

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
STALL_S = 3.0


def test_a_stalled_bootstrap_server_does_not_delay_another_rooms_success(engines, server):
    """A room whose bootstrap server stalls 3 s waits alone: a room behind a server that answers
    is looked up, written, verified and concluded Success while the stalled look-up still hangs."""
    encode, prefill = engines
    slots = torch.zeros(2, SPAN, HIDDEN, dtype=torch.bfloat16)
    item = item_tensor(2, SPAN, HIDDEN)
    with socket.socket() as silent:
        silent.bind((HOST, 0))
        silent.listen(16)  # the kernel accepts; nobody ever answers
        stalled = f"{HOST}:{silent.getsockname()[1]}"
        with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool, \
                SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST, lookup_timeout_s=STALL_S) as manager:
            waiting = manager.receive(1, stalled, slots[0])
            healthy = manager.receive(2, server.address, slots[1])  # after the stalled one, on purpose
            sent = pool.send(2, item)
            assert wait_until(lambda: is_terminal(healthy.poll()), 2 * STALL_S), "the healthy room never concluded"
            still_waiting = waiting.poll()  # read before asserting on the healthy room
            assert healthy.poll() == TransferPoll.Success, healthy.failure
            assert not is_terminal(still_waiting), "the healthy room concluded only after the stalled look-up"
            assert torch.equal(slots[1].view(torch.uint8), item.view(torch.uint8)), "landed bytes differ"
            assert torch.count_nonzero(slots[0]) == 0, "nothing may land for the room still looking up"
            assert wait_until(lambda: sent.poll() == TransferPoll.Success, 5.0)
            # The stalled look-up ends at its own timeout and fails only its room.
            assert waiting.wait(2 * STALL_S) == TransferPoll.Failed
            assert waiting.failure_kind is FailureKind.BOOTSTRAP
            assert waiting.failure.startswith(f"bootstrap {stalled}: "), waiting.failure
            failed = {row["labels"]["reason"]: row["value"] for row in manager.stats()
                      if row["name"] == "epd_prefill_rooms_failed_total" and row["value"]}
            assert failed == {"bootstrap": 1}


def test_a_session_manager_whose_descriptors_are_past_1024_still_concludes_rooms(engines, server):
    """The driver waits in poll(2), which takes any descriptor number (select() stops at 1024)."""
    encode, prefill = engines
    slots = torch.zeros(1, SPAN, HIDDEN, dtype=torch.bfloat16)
    item = item_tensor(1, SPAN, HIDDEN)
    pipes: list[int] = []
    # The encode side's sockets come first, so only the session manager's land past 1024.
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST) as pool:
        try:
            # Every free descriptor below 1100 taken; a finalizer of an earlier test's objects closing one
            # meanwhile would let the manager's land there, so they run first.
            gc.collect()
            while not pipes or max(pipes) < 1100:
                pipes.extend(os.pipe())
            with SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST, deadline_s=10.0) as manager:
                assert manager._driver._waker.fileno() > 1024  # polled with the status socket
                handle = manager.receive(1, server.address, slots[0])
                sent = pool.send(1, item)
                assert handle.wait(10.0) == TransferPoll.Success, handle.failure
                assert torch.equal(slots[0].view(torch.uint8), item.view(torch.uint8)), "landed bytes differ"
                assert wait_until(lambda: sent.poll() == TransferPoll.Success, 5.0)
        finally:
            for fd in pipes:
                os.close(fd)


def test_close_with_a_stuck_io_thread_concludes_rooms_and_leaves_the_thread_its_sockets(engines, monkeypatch):
    """close() gives up on an I/O thread that does not stop, concludes the rooms through the room
    table, and leaves the sockets to the thread, which closes them once it stops."""
    monkeypatch.setattr(drive, "STOP_WAIT_S", 0.5)
    prefill = engines[1]
    slots = torch.zeros(1, SPAN, HIDDEN, dtype=torch.bfloat16)
    with socket.socket() as silent:
        silent.bind((HOST, 0))
        silent.listen(16)  # the room's look-up hangs: the room stays open
        stalled = f"{HOST}:{silent.getsockname()[1]}"
        manager = SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST, lookup_timeout_s=3.0)
        driver = manager._driver
        entered, release = threading.Event(), threading.Event()
        drain = driver._drain_statuses

        def stuck() -> None:
            entered.set()
            release.wait(30)  # as a thread stuck in a call that does not return would
            drain()

        driver._drain_statuses = stuck
        handle = manager.receive(1, stalled, slots[0])
        poke = _io.push_socket(HOST, manager.status_port)
        try:
            poke.send_multipart([b"99", b"5", b"0"])  # any status wakes the thread into the stuck call
            assert entered.wait(5.0), "the I/O thread never read the status socket"
            manager.close()
            assert handle.poll() == TransferPoll.Failed and handle.failure == "session manager closed"
            assert handle.failure_kind is FailureKind.CLOSED
            assert not driver._status_sock.closed, "closed under a thread that may still use it"
            release.set()
            driver._thread.join(5.0)
            assert not driver._thread.is_alive()
            assert wait_until(lambda: driver._status_sock.closed, 2.0), "the thread left its sockets open"
        finally:
            release.set()
            poke.close(0)


def test_a_driver_that_runs_out_of_descriptors_while_starting_leaves_none_open(monkeypatch):
    """Its second wake-up pipe cannot be made (EMFILE): the driver raises and closes its status
    socket and first pipe, 20 times over, so the descriptors it took are back."""
    import errno
    import gc

    made = []
    real = _io.Waker

    def waker():
        if len(made) % 2:
            made.append(None)
            raise OSError(errno.EMFILE, "Too many open files")
        made.append(real())
        return made[-1]

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    monkeypatch.setattr(_io, "Waker", waker)
    gc.collect()
    before = descriptors()
    for _ in range(20):
        try:
            drive.PrefillDriver(0, 1, 1, host=HOST, status_port=0, session_id=f"{HOST}:1", deadline_s=5.0,
                                lookup_timeout_s=1.0, integrity=True, metrics=Metrics("t"))
        except OSError as exc:
            assert exc.errno == errno.EMFILE
        else:
            raise AssertionError("the driver started without its second pipe")
    gc.collect()
    assert descriptors() - before < 10, "each try left its status socket or pipe open"


def test_a_wait_that_close_overtakes_before_it_watches_the_socket_returns_without_error():
    """close() runs between wait()'s look at the closing flag and its taking the watch: the
    wait touches no descriptor close() closed, and returns by its timeout (the room was never filed)."""
    driver = drive.PrefillDriver(0, 1, 1, host=HOST, status_port=0, session_id=f"{HOST}:1", deadline_s=60.0,
                                 lookup_timeout_s=1.0, integrity=True, metrics=Metrics("t"))
    record = drive.Room(1, started_at=0.0, nbytes=0)
    watch = driver._watch

    class CloseFirst:
        """The watch lock, whose first try to take it runs close() before it."""

        def acquire(self, blocking=True, timeout=-1):
            driver._watch = watch
            driver.close()
            return watch.acquire(blocking, timeout)

        def release(self):
            watch.release()

    driver._watch_woken = True  # a previous wait saw the watch waker readable: this one reads it
    driver._watch = CloseFirst()
    try:
        driver.wait(record, 1.0)
    finally:
        driver.close()


def test_an_ask_made_in_receive_leaves_the_socket_the_io_thread_watches_to_it(engines, server, monkeypatch):
    """The asks for an encode rank that takes no connection wait on a socket the I/O thread polls
    until it can take them. With their rooms cleared, the full queue empties inside the next
    receive(), whose ask still waits for the I/O thread: no other thread touches a socket it polls."""
    from transfer.bootstrap import BootstrapClient

    encode, prefill = engines
    slots = torch.zeros(3, SPAN, HIDDEN, dtype=torch.bfloat16)
    BootstrapClient(server.address).register_rank(1, 1, HOST, free_port(), 0)  # nobody listens there
    with SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST, deadline_s=60.0) as manager:
        driver = manager._driver
        driver.core.asks.limit = 2
        sends_elsewhere = []

        def noting_the_thread(send):
            def send_noting_the_thread(sock, what):  # an ask's TransferInfo, or a registration's frames
                if sock in driver._watching and threading.current_thread() is not driver._thread:
                    sends_elsewhere.append(what)
                return send(sock, what)
            return send_noting_the_thread

        # Every ask and registration the driver sends goes through these, from whichever thread.
        monkeypatch.setattr(_io, "send_ask", noting_the_thread(_io.send_ask))
        monkeypatch.setattr(_io, "send_frames", noting_the_thread(_io.send_frames))
        first = manager.receive(1, server.address, slots[0])
        assert wait_until(lambda: len(driver._watching) == 1, 10.0), "room 1's ask never waited for its socket"
        second = manager.receive(2, server.address, slots[1])  # the route is cached: queued behind room 1's
        first.clear()
        second.clear()
        third = manager.receive(3, server.address, slots[2])
        assert sends_elsewhere == []
        assert not is_terminal(third.poll())


def test_a_cancel_is_not_sent_on_a_connection_made_after_the_rooms_dropped(engines, server, monkeypatch):
    """The encode rank's listener goes and another takes its port; ZMQ connects afresh before the I/O
    thread's periodic look at the drop reports. The room's cancel could overtake its ask there, so it
    is not sent: the new listener hears no cancel, the room's memory waits out the quarantine, and
    the next room goes to the new listener behind a fresh registration."""
    import zmq

    from transfer.bootstrap import BootstrapClient
    from transfer.frames import is_cancel, is_registration

    monkeypatch.setattr(drive, "MONITOR_PERIOD_S", 3600.0)  # only a cancel or an ask reads the drop reports
    _, prefill = engines
    slots = torch.zeros(2, SPAN, HIDDEN, dtype=torch.bfloat16)
    ctx = zmq.Context()
    first = ctx.socket(zmq.PULL)
    port = first.bind_to_random_port(f"tcp://{HOST}")
    BootstrapClient(server.address).register_rank(1, 1, HOST, port, 0)
    second = ctx.socket(zmq.PULL)
    accepted = second.get_monitor_socket(zmq.EVENT_ACCEPTED)
    try:
        with SessionManager(prefill, 0, 1, 1, buffer=slots, host=HOST, deadline_s=60.0) as manager:
            handle = manager.receive(1, server.address, slots[0])
            got = [first.recv_multipart() for _ in range(2) if first.poll(10_000)]
            assert [is_registration(frames) for frames in got] == [True, False], got
            first.close(linger=0)  # ZMQ lets the port go on its own I/O thread, a moment later

            def bound() -> bool:
                try:
                    second.bind(f"tcp://{HOST}:{port}")
                except zmq.ZMQError:
                    return False
                return True

            assert wait_until(bound, 10.0), f"port {port} never came free"
            assert accepted.poll(10_000), "the prefill rank's socket never connected to the new listener"
            handle.clear()
            assert not second.poll(1_000), f"heard {second.recv_multipart()}"
            assert not handle.safe_to_reuse, "no cancel was confirmed: the memory waits out the quarantine"
            manager.receive(2, server.address, slots[1])
            got = [second.recv_multipart() for _ in range(2) if second.poll(10_000)]
            assert [(is_registration(frames), is_cancel(frames)) for frames in got] == [(True, False), (False, False)]
            assert got[1][0] == b"2", got
    finally:
        second.disable_monitor()
        for sock in (accepted, first, second):
            sock.close(linger=0)
        ctx.term()

"""A session manager closed while a caller's wait() sleeps on its status socket: from a signal's handler on
the waiting thread itself (a rank's SIGTERM), and from another thread while the wait() is held up inside a
turn past close_timeout_s. Either way close() returns, the wait() returns Failed, and once it has, the
status socket is closed: its port can be bound again.

Real Mooncake engines (tcp on loopback), a real bootstrap server and real ZMQ sockets; the room asked for
is never sent, so only the close() ends the wait.
"""

from __future__ import annotations

import signal
import threading
import time

from live_helpers import HOST, LIVE, port_rebindable, wait_until

from transfer.core.failure import FailureKind
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
WAIT_S = 60.0  # the wait's own timeout, far past what the test gives it
CLOSE_TIMEOUT_S = 4.0


def test_a_close_from_a_signal_handler_inside_the_wait_returns_at_once_and_the_wait_closes_the_socket(
        engines, server):
    """The handler's close() does not wait for the wait() it interrupted (on its own thread, which cannot
    return before the handler does): it returns well within close_timeout_s, and the wait(), once the
    handler returned, ends Failed (closed) and leaves the status port free."""
    import torch

    encode, prefill = engines
    buffer = torch.zeros(SPAN, HIDDEN, dtype=torch.bfloat16)
    main = threading.get_ident()
    closes: list[float] = []
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST):
        manager = SessionManager(prefill, 0, 1, 1, buffer=buffer, host=HOST, deadline_s=WAIT_S,
                                 close_timeout_s=CLOSE_TIMEOUT_S)
        try:
            handle = manager.receive(1, server.address, buffer)
            assert wait_until(lambda: handle.poll() == TransferPoll.WaitingForInput, 10.0), handle.poll()

            def close_in_handler(signum, frame) -> None:
                started = time.monotonic()
                manager.close()
                closes.append(time.monotonic() - started)

            def signal_once_watching() -> None:
                if wait_until(lambda: manager._driver._watcher == main, 10.0):
                    signal.pthread_kill(main, signal.SIGUSR1)

            previous = signal.signal(signal.SIGUSR1, close_in_handler)
            try:
                threading.Thread(target=signal_once_watching, name="test-signal", daemon=True).start()
                started = time.monotonic()
                status = handle.wait(WAIT_S)
                took = time.monotonic() - started
            finally:
                signal.signal(signal.SIGUSR1, previous)
            assert closes, f"the wait() returned {status.name} after {took:.1f}s without the handler's close()"
            assert closes[0] < CLOSE_TIMEOUT_S / 2, f"close() in the handler took {closes[0]:.1f}s"
            assert status == TransferPoll.Failed and handle.failure_kind is FailureKind.CLOSED, handle.failure
            assert took < CLOSE_TIMEOUT_S, f"the wait() returned {took:.1f}s after it began"
            assert port_rebindable(HOST, manager.status_port), "the status socket was left open"
            handle.clear()
        finally:
            manager.close()


def test_a_wait_held_up_past_close_timeout_closes_the_status_socket_when_it_returns(engines, server):
    """Another thread's close() gives up on a wait() held up inside a turn (a checksum on a wedged device)
    at close_timeout_s and returns, leaving it the status socket; once the wait() returns it closes it."""
    import torch

    encode, prefill = engines
    buffer = torch.zeros(SPAN, HIDDEN, dtype=torch.bfloat16)
    with SenderPool(encode, 0, 1, 1, server.address, host=HOST):
        manager = SessionManager(prefill, 0, 1, 1, buffer=buffer, host=HOST, deadline_s=WAIT_S,
                                 close_timeout_s=1.0)
        driver = manager._driver
        try:
            handle = manager.receive(1, server.address, buffer)
            assert wait_until(lambda: handle.poll() == TransferPoll.WaitingForInput, 10.0), handle.poll()
            inside, go = threading.Event(), threading.Event()
            verify = driver._verify
            take = driver._take_as_caller
            held_up = object()

            def take_one_more(read: bool = True):
                taken = take(read)
                if taken is None or threading.get_ident() == driver._thread.ident or inside.is_set():
                    return taken
                return [held_up, *taken[0]], taken[1]

            def held_up_verify(action) -> None:
                if action is held_up:
                    inside.set()
                    go.wait(WAIT_S)
                    return
                verify(action)

            driver._take_as_caller = take_one_more
            driver._verify = held_up_verify
            got: list[TransferPoll] = []
            waiter = threading.Thread(target=lambda: got.append(handle.wait(WAIT_S)), name="test-wait", daemon=True)
            waiter.start()
            try:
                assert inside.wait(10.0), "the wait() never took a turn"
                manager.close()
                assert handle.poll() == TransferPoll.Failed
            finally:
                go.set()
            waiter.join(10.0)
            assert not waiter.is_alive(), "the wait() did not return"
            assert got == [TransferPoll.Failed], got
            assert port_rebindable(HOST, manager.status_port), "the status socket was left open"
            handle.clear()
        finally:
            go.set()
            manager.close()

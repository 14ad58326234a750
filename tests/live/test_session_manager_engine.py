"""One session manager per engine: encode ranks know a prefill rank by its engine's session."""

from __future__ import annotations

import pytest
import torch
from live_helpers import HOST, LIVE

from transfer.engine import Engine
from transfer.errors import ConfigError, PortsInUse
from transfer.receiver import SessionManager

pytestmark = LIVE


def test_a_second_manager_on_one_engine_is_refused_and_changes_nothing():
    first_buf, second_buf = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    with Engine(HOST, "tcp") as engine:
        with SessionManager(engine, 0, 2, 1, buffer=first_buf) as first:
            registered = engine.registered()
            with pytest.raises(ConfigError, match=r"already has a session manager \(engine rank 0\)"):
                SessionManager(engine, 1, 2, 1, buffer=second_buf)
            assert engine.registered() == registered  # the refused one registered nothing
            assert not first._closed
        # Once the first closed, the engine takes a manager again.
        with SessionManager(engine, 1, 2, 1, buffer=second_buf) as again:
            assert again.engine is engine


def test_managers_on_separate_engines_coexist():
    with Engine(HOST, "tcp") as a, Engine(HOST, "tcp") as b, \
            SessionManager(a, 0, 2, 1, buffer=torch.zeros(1024, dtype=torch.uint8)), \
            SessionManager(b, 1, 2, 1, buffer=torch.zeros(1024, dtype=torch.uint8)) as second:
        assert second.engine is b


def test_a_manager_that_cannot_start_leaves_no_memory_registered():
    """Its status port is taken: the constructor raises and unregisters what it registered, so a
    manager started next owns (and on close unregisters) the same buffers."""
    from transfer import _io

    buf, deepstack = torch.zeros(4096, dtype=torch.uint8), torch.zeros(2048, dtype=torch.uint8)
    taken, port = _io.pull_socket(HOST, 0)
    try:
        with Engine(HOST, "tcp") as engine:
            before = engine.registered()
            with pytest.raises(PortsInUse):
                SessionManager(engine, 0, 1, 1, buffer=buf, deepstack_buffer=deepstack, status_port=port)
            assert engine.registered() == before
            with SessionManager(engine, 0, 1, 1, buffer=buf, deepstack_buffer=deepstack):
                assert {buf.data_ptr(), deepstack.data_ptr()} <= set(engine.registered())
            assert engine.registered() == before
    finally:
        taken.close(0)


def test_both_sides_put_an_ip_address_on_the_wire_for_an_engine_started_by_name():
    """Endpoints go on the wire as IP addresses (SPEC.md 4.1): the peer's ZMQ would otherwise look
    a name up on its one I/O thread, holding every socket of its process meanwhile."""
    from transfer.bootstrap import BootstrapClient, BootstrapServer
    from transfer.sender import SenderPool

    with Engine("localhost", "tcp") as engine, BootstrapServer(HOST, 0) as server, \
            SenderPool(engine, 0, 1, 1, server.address) as sender, \
            SessionManager(engine, 0, 1, 1, buffer=torch.zeros(1024, dtype=torch.uint8)) as manager:
        assert manager.host == sender.host == "127.0.0.1"
        assert BootstrapClient(server.address).route(0, 0) == ("127.0.0.1", sender.port)


def test_a_second_close_returns_only_once_the_manager_is_closed():
    """close() from another thread while the first is stopping the I/O thread waits for it: its
    caller may close the engine next."""
    import threading
    import time

    with Engine(HOST, "tcp") as engine:
        manager = SessionManager(engine, 0, 1, 1, buffer=torch.zeros(1024, dtype=torch.uint8))
        stop = manager._driver.close

        def slow_stop(**kwargs) -> None:
            time.sleep(0.5)  # the first close() is still stopping the driver
            stop(**kwargs)

        manager._driver.close = slow_stop
        first = threading.Thread(target=manager.close)
        first.start()
        try:
            time.sleep(0.1)
            manager.close()
            assert not manager._driver._thread.is_alive(), "close() returned with the I/O thread still running"
            assert engine.registered() == {}, "close() returned with the manager's buffer still registered"
        finally:
            first.join(10)


def test_managers_made_on_one_engine_by_two_threads_at_once_leave_one_and_refuse_the_other():
    """Both threads pass the first look at the engine before either claims it: the one that claims it
    second is refused with ConfigError, and closes what it started (its I/O thread, its memory)."""
    import threading

    attempts, bound_s = 5, 10.0
    with Engine(HOST, "tcp") as engine:
        for _ in range(attempts):
            start = threading.Barrier(2)
            made: list[SessionManager] = []
            refused: list[BaseException] = []

            def make(rank: int) -> None:
                buf = torch.zeros(4096, dtype=torch.uint8)
                start.wait(bound_s)
                try:
                    made.append(SessionManager(engine, rank, 2, 1, buffer=buf))
                except ConfigError as exc:
                    refused.append(exc)

            threads = [threading.Thread(target=make, args=(rank,), daemon=True) for rank in (0, 1)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(bound_s)
            assert not any(thread.is_alive() for thread in threads), (
                f"a SessionManager constructor still runs after {bound_s:g}s (a lock it holds waits for itself)")
            assert len(made) == 1 and len(refused) == 1, (made, refused)
            assert "already has a session manager" in str(refused[0])
            made[0].close()
            assert engine.registered() == {}, "the refused manager left its buffer registered"


def test_a_dropped_manager_collected_while_its_thread_holds_the_claims_lock_is_closed_without_a_deadlock():
    # A collection runs on whichever thread allocates: one inside a constructor's or close()'s hold of the
    # claims lock may finalize a manager dropped in a reference cycle, whose finalizer takes that lock too.
    import gc
    import threading
    import warnings

    from transfer import receiver

    with Engine(HOST, "tcp") as engine:
        cycle: list = [SessionManager(engine, 0, 1, 1, buffer=torch.zeros(4, 64), host=HOST)]
        cycle.append(cycle)  # the cycle collector alone frees it
        del cycle
        collected = threading.Event()

        def collect() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)  # "dropped without close()": expected here
                with receiver._managed_lock:
                    gc.collect()
            collected.set()

        threading.Thread(target=collect, daemon=True).start()
        if not collected.wait(10):
            receiver._managed_lock.release()  # let the rest of the suite go on
            pytest.fail("collecting a dropped session manager deadlocked on the claims lock")
        with SessionManager(engine, 0, 1, 1, buffer=torch.zeros(4, 64), host=HOST) as again:  # it was closed
            assert again.engine is engine

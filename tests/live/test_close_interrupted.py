"""A close() that a stop signal's exception interrupts (a rank's SIGTERM handler raises KeyboardInterrupt
wherever the main thread is, here while close() waits) raises it, and a close() again finishes the job:
the thread stopped, the port free, the memory registered for it unregistered, the route withdrawn; so
does the collection of one dropped after such a close. Likewise a bootstrap server's, and an engine's
(Mooncake's or the wire engine), whose close() that the handler itself calls inside another returns.

Real Mooncake engines (tcp on loopback), a real bootstrap server and real ZMQ sockets, ranks in this
process. The interrupt is played where close() blocks: joining the session manager's I/O thread, waiting
for the bootstrap server's answer to the sender pool's DELETE of its route, and joining the bootstrap
server's serving thread.
"""

from __future__ import annotations

import gc
import socket
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from fakes import interrupted_once
from live_helpers import HOST, LIVE, MOONCAKE_MISSING, epd_threads, port_rebindable, wait_until

from transfer.bootstrap import BootstrapClient, BootstrapServer
from transfer.errors import ConfigError
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll
from transfer.wire_engine import WireEngine

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
WAIT_S = 10.0


def _registered(engine, tensor: torch.Tensor) -> bool:
    addr = tensor.data_ptr()
    return any(base <= addr < base + size for base, size in engine.registered().items())



@contextmanager
def _says_dropped() -> Iterator[None]:
    """Inside: the last reference to a manager or pool goes; it must say it was dropped without close()."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        gc.collect()
    assert any("was dropped without close()" in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.parametrize("then", ["close again", "dropped"])
def test_a_session_manager_close_interrupted_while_its_thread_stops_is_finished_later(engines, server, request,
                                                                                      then):
    encode, prefill = engines
    # The room's encode rank, which is never sent its item: the room is still open when the manager closes.
    pool = SenderPool(encode, 0, 1, 1, server.address, host=HOST)
    request.addfinalizer(pool.close)
    dst = torch.zeros(SPAN, HIDDEN, dtype=torch.bfloat16)
    manager = SessionManager(prefill, 0, 1, 1, buffer=dst, host=HOST, deadline_s=60)
    port = manager.status_port
    handle = manager.receive(1, server.address, dst)
    assert _registered(prefill, dst)
    assert wait_until(lambda: handle.poll() == TransferPoll.WaitingForInput, WAIT_S), handle.failure
    thread = manager._driver._thread
    thread.join = interrupted_once(thread.join)
    with pytest.raises(KeyboardInterrupt):
        manager.close()
    del thread
    # Its buffer is still registered, the next close's to unregister: the engine is not another manager's yet.
    with pytest.raises(ConfigError, match="already has a session manager"):
        SessionManager(prefill, 1, 2, 1, buffer=dst, host=HOST)
    if then == "close again":
        manager.close()
        assert handle.poll() == TransferPoll.Failed and handle.failure == "session manager closed"
    else:
        handle.clear()
        with _says_dropped():
            del handle, manager  # the handle holds its manager
    assert wait_until(lambda: not [name for name in epd_threads() if name.startswith("epd-pre")], WAIT_S), \
        epd_threads()
    assert port_rebindable(HOST, port)
    assert not _registered(prefill, dst)
    with SessionManager(prefill, 0, 1, 1, buffer=dst, host=HOST):  # the engine is free for another
        pass


@pytest.mark.parametrize("then", ["close again", "dropped"])
def test_a_sender_pool_close_interrupted_while_it_withdraws_its_route_is_finished_later(engines, server,
                                                                                         monkeypatch, then):
    encode, _ = engines
    threads = epd_threads()
    src = torch.ones(SPAN, HIDDEN, dtype=torch.bfloat16)
    pool = SenderPool(encode, 0, 1, 1, server.address, host=HOST)
    port = pool.port
    assert server.registered_ranks == 1
    handle = pool.send(1, src)
    assert _registered(encode, src)
    monkeypatch.setattr(BootstrapClient, "unregister_rank", interrupted_once(BootstrapClient.unregister_rank))
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    if then == "close again":
        pool.close()
        assert handle.poll() == TransferPoll.Failed and handle.failure == "sender pool closed"
    else:
        handle.clear()
        with _says_dropped():
            del handle, pool  # the handle holds its pool
    assert wait_until(lambda: epd_threads() == threads, WAIT_S), epd_threads()
    assert port_rebindable(HOST, port)
    assert wait_until(lambda: not _registered(encode, src), WAIT_S)
    assert server.registered_ranks == 0, "the closed pool's route stayed listed"


@pytest.mark.parametrize("then", ["close again", "dropped"])
def test_a_bootstrap_server_close_interrupted_while_its_thread_stops_is_finished_later(then):
    """The interrupted close has stopped the serving thread, not yet closed the listening socket."""
    bootstrap = BootstrapServer(HOST, 0)
    port = bootstrap.port
    thread = bootstrap._thread
    thread.join = interrupted_once(thread.join)
    with pytest.raises(KeyboardInterrupt):
        bootstrap.close()
    del thread
    if then == "close again":
        bootstrap.close()
    else:
        with _says_dropped():
            del bootstrap
    assert wait_until(lambda: _bindable(port), WAIT_S), f"port {port} still bound"
    with BootstrapServer(HOST, port):  # a server again at the same port, as a restarted encode node makes
        pass


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _engine_with_memory(kind: str):
    """(engine, the tensor it registered): a Mooncake tcp Engine or a WireEngine on the loopback."""
    if kind == "Engine":
        if MOONCAKE_MISSING:
            pytest.skip(MOONCAKE_MISSING)
        from transfer.engine import Engine

        engine = Engine(HOST, "tcp")
    else:
        engine = WireEngine(HOST)
    buf = torch.zeros(4096, dtype=torch.uint8)
    engine.register(buf)
    return engine, buf


@pytest.mark.parametrize("kind", ["Engine", "WireEngine"])
def test_an_engine_close_interrupted_while_it_settles_is_finished_by_a_close_again(kind):
    """Cut short while it waited for registrations under way, before it let go of anything: the close again
    unregisters the memory and stops the transport, freeing its port."""
    engine, buf = _engine_with_memory(kind)
    port = engine.rpc_port
    engine._wait_for_registrations = interrupted_once(engine._wait_for_registrations)
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    engine.close()
    assert engine.registered() == {}
    assert wait_until(lambda: _bindable(port), WAIT_S), f"port {port} still bound"


@pytest.mark.parametrize("kind", ["Engine", "WireEngine"])
def test_an_engine_close_a_signals_handler_calls_inside_a_close_returns_and_the_interrupted_one_goes_on(kind):
    """As a SIGTERM handler that closes the engine, run while the main thread's close() unregisters."""
    engine, buf = _engine_with_memory(kind)
    port = engine.rpc_port
    inner: list[str] = []
    wait = engine._wait_for_registrations

    def handler_closes():
        if not inner:
            inner.append("called")
            engine.close()
            inner.append("returned")
        return wait()

    engine._wait_for_registrations = handler_closes
    closing = threading.Thread(target=engine.close, daemon=True)
    closing.start()
    closing.join(WAIT_S)
    assert not closing.is_alive(), f"the close inside close() waits for the close it interrupted: {inner}"
    assert inner == ["called", "returned"]
    assert engine.registered() == {}
    assert wait_until(lambda: _bindable(port), WAIT_S), f"port {port} still bound"

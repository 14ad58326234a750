"""A sender pool's route at the bootstrap server: listed again after the server restarted (and lost
it), never over another instance's, and never after the pool closed."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch
from live_helpers import HOST, wait_until

from transfer import sender as sender_module
from transfer.bootstrap import BootstrapClient, BootstrapServer
from transfer.errors import BootstrapNoRoute
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = pytest.mark.live

CHECK_S = 0.1
#: What a check, once due, may take on a slow host before a test calls it missing.
SETTLE_S = 10.0


@pytest.fixture(autouse=True)
def _frequent_checks(monkeypatch):
    monkeypatch.setattr(sender_module, "ROUTE_CHECK_S", CHECK_S)


@contextmanager
def _restarted(server: BootstrapServer):
    """A new bootstrap server on the port `server` had, once `server` closed: it lists no route."""
    port = server.port
    server.close()
    with BootstrapServer(HOST, port) as again:
        yield again


@contextmanager
def _pool_then_restart(engine):
    """(an open sender pool, a restarted bootstrap server on the port it registered with)."""
    first = BootstrapServer(HOST, 0)
    try:
        with SenderPool(engine, 0, 1, 1, first.address, host=HOST) as pool, _restarted(first) as server:
            yield pool, server
    finally:
        first.close()


def _route(server: BootstrapServer) -> tuple[str, int] | None:
    try:
        return BootstrapClient(server.address, timeout=2.0).route(0, 0)
    except BootstrapNoRoute:
        return None


def test_a_restarted_bootstrap_server_lists_the_pool_again_and_a_new_prefill_rank_gets_its_room(engines):
    encode_engine, prefill_engine = engines
    item = torch.arange(8 * 64, dtype=torch.float32).view(8, 64).to(torch.bfloat16)
    with _pool_then_restart(encode_engine) as (pool, server):
        assert wait_until(lambda: _route(server) == (HOST, pool.port), SETTLE_S), _route(server)
        buf = torch.zeros(8, 64, dtype=torch.bfloat16)
        with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST) as manager:
            sent = pool.send(5, item)
            handle = manager.receive(5, server.address, buf)
            assert handle.wait(30) is TransferPoll.Success, handle.failure
            assert sent.wait(10) is TransferPoll.Success, sent.failure
            assert torch.equal(buf.view(torch.int16), item.view(torch.int16))
            handle.clear()
            sent.clear()


def test_a_route_another_instance_registered_is_left_alone(engines):
    encode_engine, _ = engines
    with _pool_then_restart(encode_engine) as (pool, server):
        other_port = pool.port + 1 if pool.port < 65535 else pool.port - 1
        BootstrapClient(server.address).register_rank(1, 1, HOST, other_port, 0, retry_for=0, instance="another-pool")
        time.sleep(5 * CHECK_S)  # several checks: each finds a route, not this pool's
        assert _route(server) == (HOST, other_port)


def test_a_closed_pool_registers_nothing_again(engines):
    encode_engine, _ = engines
    first = BootstrapServer(HOST, 0)
    try:
        pool = SenderPool(encode_engine, 0, 1, 1, first.address, host=HOST)
        pool.close()
        with _restarted(first) as server:
            time.sleep(5 * CHECK_S)  # a keeper left running would have listed it again by now
            assert _route(server) is None
    finally:
        first.close()

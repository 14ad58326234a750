"""Every listener given a port range binds its first free port: the one in use is passed over."""

from __future__ import annotations

import contextlib
import errno
import socket
import urllib.request

import pytest
import torch
from live_helpers import HOST, LIVE, request_socket, status_socket

from transfer.bootstrap import BootstrapClient, BootstrapServer
from transfer.errors import ConfigError, PortsInUse
from transfer.metrics import Metrics
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll
from transfer.wire_engine import WireEngine

pytestmark = LIVE

#: How far past the occupied port a listener may land (other processes on this host may hold the next few).
SLACK = 20


@contextlib.contextmanager
def occupied():
    """A port someone else listens on (a plain TCP socket), the first of the range under test."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        yield sock.getsockname()[1]


def _get(url: str) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as response:
        return response.read()


def test_the_bootstrap_server_and_metrics_endpoint_pass_over_a_port_in_use():
    with occupied() as first:
        with BootstrapServer(HOST, f"{first}-{first + SLACK}") as server:
            assert first < server.port <= first + SLACK
            assert _get(f"http://{HOST}:{server.port}/health") == b"OK"
        metrics = Metrics("epd_ports_test")
        metrics.inc("probes_total")
        with metrics.serve(HOST, (first, first + SLACK)) as endpoint:
            assert first < endpoint.port <= first + SLACK
            assert b"epd_ports_test_probes_total" in _get(endpoint.url)


def test_a_wire_listener_passes_over_a_port_in_use():
    with occupied() as first:
        with WireEngine(HOST, (first, first + SLACK)) as engine:
            assert first < engine.port <= first + SLACK
            assert engine.session_id == f"{HOST}:{engine.port}"


@pytest.mark.parametrize("listen, what, hint", [
    (lambda port: BootstrapServer(HOST, port), "bootstrap server", " (a bootstrap server running already?)"),
    (lambda port: Metrics("epd_ports_test").serve(HOST, port), "metrics endpoint", ""),
    (lambda port: WireEngine(HOST, port), "wire listener", ""),
    (lambda port: status_socket(HOST, port), "prefill rank 0's status socket", ""),
    (lambda port: request_socket(HOST, port), "encode rank 0's request socket", ""),
], ids=["bootstrap server", "metrics endpoint", "wire listener", "status socket", "request socket"])
def test_a_servers_one_port_in_use_is_named_with_what_to_do(listen, what, hint):
    # The errno stays (what lets a range pass it over); the text names the server, its address, and the way out.
    with occupied() as first:
        with pytest.raises(PortsInUse) as caught:
            listen(first)
    assert caught.value.errno == errno.EADDRINUSE
    assert caught.value.strerror == (
        f"{what} cannot listen on {HOST}:{first}: Address already in use: another process holds it{hint}; give "
        f"another port, 0 (any free one) or a range FIRST-LAST, or find what holds it (ss -ltnp 'sport = :{first}')")


@pytest.mark.parametrize("listen", [status_socket, request_socket], ids=["status socket", "request socket"])
def test_a_zmq_sockets_one_port_in_use_is_still_the_zmq_error_it_raised_before(listen):
    import zmq

    with occupied() as first:
        with pytest.raises(zmq.ZMQError) as caught:
            listen(HOST, first)
    assert isinstance(caught.value, PortsInUse) and caught.value.errno == errno.EADDRINUSE


@pytest.mark.parametrize("listen, what", [
    (BootstrapServer, "bootstrap server"), (WireEngine, "wire listener"),
    (status_socket, "prefill rank 0's status socket"), (request_socket, "encode rank 0's request socket"),
], ids=["bootstrap server", "wire listener", "status socket", "request socket"])
def test_a_server_on_an_address_not_of_this_host_says_so(listen, what):
    with pytest.raises(ConfigError, match=rf"^{what} cannot listen on 192\.0\.2\.1:0: Cannot assign requested "
                                          r"address: give an address of this host"):
        listen("192.0.2.1", 0)  # TEST-NET-1: no host's own


def test_a_metrics_endpoint_on_an_address_not_of_this_host_says_so():
    with pytest.raises(ConfigError, match=r"^metrics endpoint cannot listen on 192\.0\.2\.1:0: Cannot assign requested "
                                          r"address: give an address of this host \(the one peers reach the endpoint on\)"):
        Metrics("epd_ports_test").serve("192.0.2.1", 0)  # TEST-NET-1: no host's own


def test_a_range_whose_every_port_is_in_use_fails_naming_it():
    with occupied() as first, socket.socket() as second:
        try:
            second.bind((HOST, first + 1))
        except OSError:
            pytest.skip(f"port {first + 1} is taken by another process")
        second.listen()
        with pytest.raises(PortsInUse, match=rf"bootstrap server on {HOST}: no free port in {first}-{first + 1}"):
            BootstrapServer(HOST, (first, first + 1))


def test_encode_and_prefill_sockets_in_ranges_serve_a_room(engines):
    import torch

    encode_engine, prefill_engine = engines
    item = torch.arange(8 * 64, dtype=torch.float32).to(torch.bfloat16).view(8, 64)
    slots = torch.zeros((2, 8, 64), dtype=torch.bfloat16)
    with occupied() as first, BootstrapServer(HOST, 0) as server, \
            SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, port=(first, first + SLACK)) as pool, \
            SessionManager(prefill_engine, 0, 1, 1, buffer=slots, host=HOST,
                           status_port=f"{first}-{first + SLACK}") as manager:
        assert first < pool.port <= first + SLACK and first < manager.status_port <= first + SLACK
        assert pool.port != manager.status_port
        # Peers find the request socket through the bootstrap server: it publishes the port bound.
        assert BootstrapClient(server.address).route(0, 0) == (HOST, pool.port)
        received = manager.receive(7, server.address, slots[0])
        sent = pool.send(7, item)
        assert received.wait(20.0) is TransferPoll.Success, received.failure
        assert sent.wait(20.0) is TransferPoll.Success, sent.failure
        assert torch.equal(slots[0], item)
        received.clear()
        sent.clear()

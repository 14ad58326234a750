"""The bootstrap server with its handler slots held by clients that never finish their headers."""

from __future__ import annotations

import json
import socket
import time

import pytest
from live_helpers import wait_until

from transfer import bootstrap
from transfer.bootstrap import BootstrapClient, BootstrapServer

HOST = "127.0.0.1"
SLOW_CLIENTS = 256


@pytest.fixture
def patient_server(monkeypatch):
    """A bootstrap server whose whole-request deadline is far longer than the header deadline."""
    monkeypatch.setattr(bootstrap._Handler, "timeout", 120.0)
    with BootstrapServer(HOST, 0) as server:
        yield server


def _slow_clients(port: int, count: int) -> list[socket.socket]:
    """`count` connections that each send half a request line and then nothing."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection((HOST, port), timeout=5)
        sock.sendall(b"GET /rou")
        socks.append(sock)
    return socks


def test_a_real_rank_registers_while_slow_clients_hold_every_slot(patient_server):
    """Slow clients lose their slots at the header deadline, so a retrying rank gets in long
    before the whole-request deadline would free them."""
    slow = _slow_clients(patient_server.port, SLOW_CLIENTS)
    try:
        client = BootstrapClient(patient_server.address, timeout=2.0)
        started = time.monotonic()
        client.register_rank(2, 1, "10.0.0.7", 17001, 1, retry_for=30.0)
        waited = time.monotonic() - started
        assert patient_server.registered_ranks == 1
        assert client.route(1, 0) == ("10.0.0.7", 17001)
        print(f"registered after {waited:.2f}s with {SLOW_CLIENTS} slow clients open")
    finally:
        for sock in slow:
            sock.close()


def test_a_client_without_headers_is_closed_at_the_header_deadline(patient_server):
    with socket.create_connection((HOST, patient_server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\nX-Slow: a")
        answer = sock.recv(4096)  # the server closes long before the 30 s timeout
        assert answer == b"" or b"408" in answer.split(b"\r\n", 1)[0]


def test_a_body_may_take_longer_than_the_header_deadline(patient_server):
    """Only the headers are held to the short deadline; a PUT's body gets the request's."""
    body = json.dumps({"role": "Prefill", "world_size": 1, "dp_size": 1, "rank_ip": "10.0.0.8",
                       "rank_port": 17002, "engine_rank": 0}).encode()
    head = b"PUT /route HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body)
    with socket.create_connection((HOST, patient_server.port), timeout=30) as sock:
        sock.sendall(head + body[:10])
        time.sleep(2 * bootstrap._Handler.header_timeout)
        sock.sendall(body[10:])
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"200", answer
    assert patient_server.registered_ranks == 1


def _stalled_puts(port: int, sources: list[str], each: int) -> list[socket.socket]:
    """`each` connections from every source address that send a PUT's headers and never its body: each
    holds its handler until the request's deadline, one address under its own cap."""
    socks = []
    for source in sources:
        for _ in range(each):
            sock = socket.create_connection((HOST, port), timeout=5, source_address=(source, 0))
            sock.sendall(b"PUT /route HTTP/1.0\r\nContent-Length: 200\r\n\r\n")
            socks.append(sock)
    return socks


def test_a_look_up_is_answered_while_stalled_requests_from_several_addresses_hold_every_slot(monkeypatch):
    """Clients that never finish their requests, spread over enough addresses that none reaches its own
    cap, hold every handler: the oldest of them gives way to a new connection, which is answered."""
    monkeypatch.setattr(bootstrap._HTTPServer, "max_handlers", 16)  # a quarter of them per address
    with BootstrapServer(HOST, 0) as server:
        client = BootstrapClient(server.address, timeout=2.0)
        client.register_rank(2, 1, "10.0.0.7", 17001, 1, retry_for=5.0)
        stalled = _stalled_puts(server.port, [f"127.0.0.{i}" for i in range(2, 6)], 4)
        try:
            assert wait_until(lambda: server._server._handlers == len(stalled), 5.0)
            # Answered within the client's 2 s timeout, although each stalled request may hold its handler 10 s.
            assert client.parallel_info() == (2, 1)
            assert client.route(1, 0) == ("10.0.0.7", 17001)
            # The oldest stalled request gave way: it is told so, and its body is read no further.
            stalled[0].settimeout(2.0)
            answer = b""
            while chunk := stalled[0].recv(4096):
                answer += chunk
        finally:
            for sock in stalled:
                sock.close()
    assert answer.startswith(b"HTTP/1.0 503 "), answer
    assert answer.endswith(b"bootstrap server busy: too many connections at once: this request was still "
                           b"incomplete when a newer connection needed its place"), answer

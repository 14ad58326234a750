"""Metrics over a real HTTP endpoint, and under threads."""

from __future__ import annotations

import json
import random
import socket
import threading
import urllib.error
import urllib.request

import pytest
from live_helpers import mutate_bytes
from metrics_golden import GOLDEN, GOLDEN_SNAPSHOT, small_example

from transfer.metrics import Metrics, serve, total


def get(url: str) -> tuple[int, str, str]:
    """GET a URL with a bounded wait; return status, content type and body."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read().decode()


def test_http_endpoint_serves_metrics():
    m = small_example()
    with m.serve() as server:
        assert server.port > 0
        status, ctype, body = get(server.url)
        assert status == 200
        assert ctype.startswith("text/plain; version=0.0.4")
        assert body == GOLDEN
        m.inc("rooms_started_total")
        _, _, body = get(server.url)
        assert 'epd_rooms_started_total{rank="0",role="prefill"} 3\n' in body
        status, ctype, body = get(f"http://127.0.0.1:{server.port}/stats")
        assert ctype == "application/json"
        rows = json.loads(body)
        assert [row for row in rows if row["name"] == "epd_rooms_started_total"] == [
            {"name": "epd_rooms_started_total", "type": "counter", "labels": {"rank": "0", "role": "prefill"},
             "value": 3}]
        assert len(rows) == len(GOLDEN_SNAPSHOT)
        with pytest.raises(urllib.error.HTTPError) as err:
            get(f"http://127.0.0.1:{server.port}/nope")
        assert err.value.code == 404
        assert err.value.headers["Content-Type"] == "text/plain; charset=utf-8"
        assert err.value.read() == b"only /metrics and /stats are served"
    with pytest.raises(urllib.error.URLError):
        get(server.url)  # closed: the port no longer answers


@pytest.mark.parametrize("path", ["/metrics", "/stats", "/nowhere"])
def test_a_head_request_is_answered_as_get_without_a_body(path):
    m = small_example()
    with m.serve() as server:
        url = f"http://127.0.0.1:{server.port}{path}"
        request = urllib.request.Request(url, method="HEAD")
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                status, headers, body = resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as error:
            status, headers, body = error.code, error.headers, error.read()
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                got = resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as error:
            got = error.code, error.headers, error.read()
    assert (status, headers["Content-Type"], headers["Content-Length"]) == (got[0], got[1]["Content-Type"],
                                                                            str(len(got[2])))
    assert body == b"" and len(got[2]) > 0


def test_one_endpoint_for_several_sources():
    a, b = Metrics("epd_recv"), Metrics("epd_send")
    a.inc("bytes_received_total", 10)
    b.inc("bytes_written_total", 20)
    with serve(a, b) as server:
        _, _, body = get(server.url)
    assert "epd_recv_bytes_received_total 10\n" in body
    assert "epd_send_bytes_written_total 20\n" in body


def test_thread_safety_smoke():
    m = Metrics("epd")
    threads, per_thread = 8, 2000

    def work(tid: int) -> None:
        for i in range(per_thread):
            m.inc("rooms_started_total")
            m.inc("bytes_written_total", 3, worker=tid % 2)
            m.observe("room_latency_seconds", (i % 100) / 1000)
            if i % 200 == 0:
                m.snapshot()
                m.prometheus_text()

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=60)
        assert not t.is_alive()
    snap = m.snapshot()
    assert total(snap, "epd_rooms_started_total") == threads * per_thread
    assert total(snap, "epd_bytes_written_total") == 3 * threads * per_thread
    assert total(snap, "epd_room_latency_seconds_count") == threads * per_thread


def test_a_burst_of_connections_waits_to_be_answered_while_the_accepting_thread_is_held_up():
    """Connections that come while the accepting thread is held up (by the GIL, say, in a busy process;
    here by the lock its hand-off takes) wait in the listen queue for their answer, a 503 beyond the
    caps; a queue shorter than the caps drops their handshakes, which clients retry after 1 s, 3 s, ...
    so a scrape among them times out."""
    import select
    import socket

    from live_helpers import wait_until

    m = Metrics("epd")
    clients: list[socket.socket] = []

    def connected() -> int:
        _, writable, _ = select.select([], clients, [], 0)
        return sum(1 for c in writable if c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0)

    with m.serve() as server:
        try:
            with server._httpd._handlers_lock:  # the accepting thread stops at its first connection's hand-off
                for _ in range(64):  # the connections it serves at once, by default
                    client = socket.socket()
                    client.setblocking(False)
                    client.connect_ex((server.host, server.port))
                    clients.append(client)
                assert wait_until(lambda: connected() == len(clients), 10), f"{connected()} of {len(clients)}"
        finally:
            for client in clients:
                client.close()


def test_mutated_requests_are_answered_or_dropped_and_the_endpoint_serves_on():
    # Valid requests with bytes flipped, inserted, deleted, duplicated or cut, one connection each.
    rng = random.Random(3)
    requests = [f"{method} {path}?x=1 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".encode()
                for method in ("GET", "HEAD") for path in ("/metrics", "/stats")]
    m = small_example()
    with m.serve() as server:
        for _ in range(200):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                try:
                    sock.sendall(mutate_bytes(rng.choice(requests), rng))
                    sock.shutdown(socket.SHUT_WR)
                    while sock.recv(65536):
                        pass
                except ConnectionResetError:
                    pass  # refused before all was sent or read
            status, _, body = get(server.url)
            assert status == 200 and body == GOLDEN

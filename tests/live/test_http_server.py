"""The bounded HTTP server under the bootstrap and metrics endpoints: how long closing it can take."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

from transfer._http import BoundedHTTPServer


def test_close_waits_for_stuck_handlers_under_one_bound_not_one_each():
    """Handlers stuck in work the connection's shutdown does not end are waited for `close_wait_s` in
    all: four of them at 1 s each would keep close() 4 s."""
    release = threading.Event()
    entered = threading.Semaphore(0)

    class Stuck(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            entered.release()
            release.wait(30)

        def log_message(self, *args: object) -> None:
            pass

    server = BoundedHTTPServer(("127.0.0.1", 0), Stuck)
    server.close_wait_s = 1.0
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    serving.start()
    clients = [socket.create_connection(server.server_address[:2], timeout=5.0) for _ in range(4)]
    try:
        for client in clients:
            client.sendall(b"GET / HTTP/1.0\r\n\r\n")
        for _ in clients:
            assert entered.acquire(timeout=10.0)
        server.shutdown()
        started = time.monotonic()
        server.server_close()
        took = time.monotonic() - started
    finally:
        release.set()
        for client in clients:
            client.close()
    assert took < 2.5, took

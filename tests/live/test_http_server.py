"""The bounded HTTP server under the bootstrap and metrics endpoints: how long closing it can take."""

from __future__ import annotations

import socket
import threading
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
        handlers = [thread for _, thread in server._serving.items()]
        waits: list[float | None] = []
        for thread in handlers:  # each join() called as it is, its timeout noted
            thread.join = (lambda join: lambda timeout=None: (waits.append(timeout), join(timeout))[1])(thread.join)
        server.server_close()
        stuck = [thread.is_alive() for thread in handlers]
    finally:
        release.set()
        for client in clients:
            client.close()
    assert len(handlers) == 4 and stuck == [True] * 4, stuck  # still in their work: given up on, not ended
    # The joins share one deadline: after the first waited it out, the others get nothing left. A bound for
    # each would give them close_wait_s apiece (4 s here). A slow host only makes the later shares smaller.
    assert None not in waits and len(waits) == 4, waits
    assert sum(waits) <= server.close_wait_s + 0.05, waits

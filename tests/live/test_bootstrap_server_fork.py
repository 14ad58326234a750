"""A bootstrap server in a process forked from the one that made it: its serving thread stayed in the
parent, so the child's close() (or the collection of its copy) returns at once, closing only the child's
copies of its sockets, even with the server's lock held at the fork; the parent's server serves on, a
connection it was serving at the fork included.

A real server on loopback; the child is a real fork."""

from __future__ import annotations

import gc
import socket

from live_helpers import HOST, LIVE, in_forked_child

from transfer.bootstrap import BootstrapClient, BootstrapServer

pytestmark = LIVE


def test_a_forked_childs_close_returns_at_once_and_the_parents_server_serves_on():
    with BootstrapServer(HOST, 0) as server:
        client = BootstrapClient(server.address, timeout=5)
        # A connection the server is serving at the fork: its request not yet sent in full.
        held = socket.create_connection((HOST, server.port), timeout=5)
        held.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")

        def child() -> dict:
            server.close()
            return {"closed": "yes"}

        assert in_forked_child(child, (server._lock,)) == {"closed": "yes"}, "the child's close() never returned"

        def let_go() -> dict:  # the child lets its copy go unclosed, to the collector
            nonlocal server
            del server
            gc.collect()
            return {"collected": "yes"}

        assert in_forked_child(let_go) == {"collected": "yes"}
        # The parent's listener and the connection it was serving at the fork are untouched.
        held.sendall(b"\r\n")
        assert held.recv(4096).startswith(b"HTTP/1.0 200"), "the child ended the parent's connection"
        held.close()
        assert client.health()
        client.register_rank(1, 1, HOST, 17000, 0)
        assert server.registered_ranks == 1

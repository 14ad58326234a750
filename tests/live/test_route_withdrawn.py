"""A sender pool that closes (or is dropped) withdraws its route from the bootstrap server (our DELETE
/route): a prefill rank's rooms for it fail within seconds, saying the encode rank is no longer
registered, instead of at their deadlines; a pool that closes after its successor registered at another
port leaves the successor's route, and rooms succeed through it; a server that knows no DELETE (a peer's),
or does not answer one, costs close() one DELETE given about a second, and raises nothing.

Real Mooncake engines (tcp on 127.0.0.1), real ZMQ, a real bootstrap server, ranks in this process."""

from __future__ import annotations

import errno
import gc
import logging
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import zmq
from live_helpers import HOST, LIVE, wait_until

from transfer.bootstrap import BootstrapClient, BootstrapServer
from transfer.core.failure import FailureKind
from transfer.errors import BootstrapError, BootstrapNoRoute
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

ROWS, HIDDEN = 4, 64
#: Far past the bound the tests wait: a room that waits out its deadline shows.
DEADLINE_S = 120.0
#: How long a room for a pool that went away may take to fail (it takes a second or two).
FAIL_WITHIN_S = 20.0


def _item() -> torch.Tensor:
    return torch.randn(ROWS, HIDDEN).to(torch.bfloat16)


def _served(manager: SessionManager, pool: SenderPool, server: BootstrapServer, room: int,
            dst: torch.Tensor, *, ask_again: bool = False) -> None:
    """One room from `pool`, its bytes checked, both handles cleared. With `ask_again`, a room asked of a
    pool that went away, before the manager saw its connection drop, fails at once saying so; it is asked
    again, as the reason says."""
    item = _item()
    sent = pool.send(room, item)
    handle = manager.receive(room, server.address, dst)
    if ask_again and handle.wait(30) == TransferPoll.Failed and handle.failure_kind is FailureKind.NO_CONNECTION:
        assert "registered again" in handle.failure, handle.failure
        handle.clear()
        handle = manager.receive(room, server.address, dst)
    assert handle.wait(30) == TransferPoll.Success, handle.failure
    assert torch.equal(dst.view(torch.uint8), item.view(torch.uint8))
    handle.clear()
    sent.wait(5)
    sent.clear()


def _closed(pools: list[SenderPool], how: str) -> None:
    """Closes the one pool of `pools`, or drops it (it holds the only reference) and waits for its
    finalizer's close to finish."""
    pool = pools.pop()
    if how == "close":
        pool.close()
        return
    name = f"epd-encode-{pool.engine_rank}-close"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del pool
        gc.collect()
    assert any("was dropped without close()" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert wait_until(lambda: not any(t.name == name for t in threading.enumerate()), 15), "its close never ended"


def _failed_within(handle, bound: float) -> float:
    """Seconds the room took to conclude Failed, at most `bound`."""
    started = time.monotonic()
    outcome = handle.wait(bound)
    took = time.monotonic() - started
    assert outcome == TransferPoll.Failed, (outcome, handle.failure, f"{took:.1f} s")
    return took


@pytest.mark.parametrize("how", ["close", "dropped"])
def test_rooms_for_a_pool_that_went_away_fail_within_seconds_saying_its_rank_is_no_longer_registered(engines,
                                                                                                     how):
    encode, prefill = engines
    buf = torch.zeros(3, ROWS, HIDDEN, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server, \
            SessionManager(prefill, 0, 1, 1, buffer=buf, host=HOST, deadline_s=DEADLINE_S) as manager:
        pools = [SenderPool(encode, 0, 1, 1, server.address)]
        port = pools[0].port
        _served(manager, pools[0], server, 1, buf[0])  # its route cached, its connection up
        asked = manager.receive(2, server.address, buf[1])  # an ask the pool parks: nothing is sent for it
        assert wait_until(lambda: asked.poll() == TransferPoll.WaitingForInput, 10), asked.poll()
        _closed(pools, how)
        with pytest.raises(BootstrapNoRoute):
            BootstrapClient(server.address).route(0, 0)
        # Asked at once: the prefill rank may not have seen the connection go yet.
        late = manager.receive(3, server.address, buf[2])
        took = _failed_within(late, FAIL_WITHIN_S)
        # Its ask goes out on the dead connection when the rank has not noticed the drop yet (a loaded host).
        assert late.failure in (f"encode rank 0 (dp group 0) is no longer registered at bootstrap {server.address} "
                                f"(it was at {HOST}:{port}): its sender pool closed, or the bootstrap server "
                                f"restarted; room 3 {how_far}"
                                for how_far in ("was never asked for", "was asked there and that connection dropped")
                                ), late.failure
        assert late.failure_kind.value == "bootstrap"
        # The room the pool had parked was told so by the pool itself as it closed.
        _failed_within(asked, FAIL_WITHIN_S)
        assert "sender pool closed" in asked.failure or "no longer registered" in asked.failure, asked.failure
        # And so is every room asked later, looked up afresh.
        time.sleep(1.5)  # the prefill rank's I/O thread reads its connections' drops once a second
        later = manager.receive(4, server.address, buf[0])
        _failed_within(later, FAIL_WITHIN_S)
        assert "no longer registered" in later.failure, later.failure
        print(f"\nroom 3 failed {took:.2f} s after it was asked (deadline {DEADLINE_S:g} s)")
        for handle in (asked, late, later):
            handle.clear()


@pytest.mark.parametrize("how", ["close", "dropped"])
def test_a_pool_that_goes_away_after_its_successor_registered_leaves_the_successors_route(engines, how):
    encode, prefill = engines
    buf = torch.zeros(2, ROWS, HIDDEN, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server, \
            SessionManager(prefill, 0, 1, 1, buffer=buf, host=HOST, deadline_s=DEADLINE_S) as manager:
        pools = [SenderPool(encode, 0, 1, 1, server.address)]
        _served(manager, pools[0], server, 1, buf[0])
        with SenderPool(encode, 0, 1, 1, server.address) as successor:  # the same rank at a new port
            assert successor.port != pools[0].port
            _closed(pools, how)
            assert BootstrapClient(server.address).route(0, 0) == (HOST, successor.port)
            # Each room waits at most 30 s, far inside DEADLINE_S: one sent to the closed pool fails there.
            for room in (2, 3):
                _served(manager, successor, server, room, buf[room % 2], ask_again=True)


def test_a_late_withdrawal_by_a_pool_whose_successor_registered_at_the_same_endpoint_leaves_the_successors_route(
        engines):
    """A pool's DELETE that reaches the server only after its successor registered at the very same host
    and port (delayed in flight, or sent late by the old pool's close) names the old pool, not the
    endpoint: the successor stays listed and serves."""
    encode, prefill = engines
    buf = torch.zeros(2, ROWS, HIDDEN, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server, \
            SessionManager(prefill, 0, 1, 1, buffer=buf, host=HOST, deadline_s=DEADLINE_S) as manager:
        first = SenderPool(encode, 0, 1, 1, server.address)
        port, withdrawal = first.port, first._route  # what the first pool's DELETE says
        _served(manager, first, server, 1, buf[0])
        first.close()
        with _pool_at(encode, server, port) as successor:
            assert successor.port == port
            withdrawal.unregister()  # the first pool's DELETE, arriving now
            assert BootstrapClient(server.address).route(0, 0) == (HOST, port)
            _served(manager, successor, server, 2, buf[1])


def _pool_at(engine, server: BootstrapServer, port: int, within_s: float = 10.0) -> SenderPool:
    """A pool listening at `port`, which a pool closed just now let go of: ZMQ closes a listener on its
    I/O thread, after close() returned, so the port may be busy for a moment."""
    end = time.monotonic() + within_s
    while True:
        try:
            return SenderPool(engine, 0, 1, 1, server.address, port=port)
        except zmq.ZMQError as error:
            if error.errno != errno.EADDRINUSE or time.monotonic() > end:
                raise
            time.sleep(0.05)


class _PeerHandler(BaseHTTPRequestHandler):
    """A peer's bootstrap server as far as a sender pool sees it: PUT /route answered `OK`, no DELETE (501);
    with `hang`, a DELETE is read and not answered until `release` (the test's end). `deletes` counts the
    DELETEs that arrived, `answered` those whose handling ended (a 501 may be read before it is counted)."""

    hang = threading.Event()
    release = threading.Event()
    deletes: list[str] = []
    answered: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"OK")

    def do_DELETE(self) -> None:
        self.deletes.append(self.path)
        try:
            if not self.hang.is_set():
                self.send_error(501, "Unsupported method ('DELETE')")
                return
            self.release.wait(60)
        finally:
            self.answered.append(self.path)


@contextmanager
def _peer_server(hang: bool) -> Iterator[ThreadingHTTPServer]:
    handler = type("Handler", (_PeerHandler,), {"hang": threading.Event(), "release": threading.Event(),
                                                "deletes": [], "answered": []})
    if hang:
        handler.hang.set()
    httpd = ThreadingHTTPServer((HOST, 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        handler.release.set()
        httpd.shutdown()
        thread.join(10)
        httpd.server_close()


#: What close() logs of the DELETE, by what the server does with it.
_UNREGISTER_SAID = {"no DELETE (501)": "HTTP 501", "never answers a DELETE": "timed out",
                    "stopped": "Connection refused"}


@pytest.mark.parametrize("server", ["no DELETE (501)", "never answers a DELETE", "stopped"])
def test_close_goes_on_after_one_delete_within_its_bound_whatever_the_bootstrap_server_does_with_it(engines, caplog,
                                                                                                   server):
    """close() sends one DELETE and gives it UNREGISTER_TIMEOUT_S: it returns, raising nothing, with a
    DELETE the server holds unanswered still held (it never waits for the server's answer past its
    bound), one DELETE sent to a server that has none (no retries), and a line saying the route may
    stay listed and why."""
    encode, _ = engines
    caplog.set_level(logging.INFO, logger="transfer.sender")
    with _peer_server(hang=server == "never answers a DELETE") as httpd:
        handler = httpd.RequestHandlerClass
        pool = SenderPool(encode, 0, 1, 1, f"{HOST}:{httpd.server_address[1]}")
        if server == "stopped":
            httpd.shutdown()
            httpd.server_close()  # a refused connection
        pool.close()
        deletes, answered = list(handler.deletes), list(handler.answered)  # as close() returned
        if server == "never answers a DELETE":
            # The server holds the DELETE until the test ends: close() returned without its answer.
            assert answered == [], "close() returned only once the server let go of its DELETE"
            assert wait_until(lambda: handler.deletes == ["/route"], 10), handler.deletes
    if server == "stopped":
        assert deletes == []
    elif server == "no DELETE (501)":
        assert deletes == ["/route"], "close() sent the DELETE again"
    [line] = [r.getMessage() for r in caplog.records if "may stay listed" in r.getMessage()]
    assert line.startswith("sender pool of encode rank 0: its route to ")
    assert _UNREGISTER_SAID[server] in line, line


@pytest.mark.parametrize("refusal", ["wrong token (401)", "no server (connection refused)"])
def test_a_pool_whose_registration_was_refused_withdraws_no_route(engines, caplog, refusal):
    """No attempt of the registration was taken (each was answered with a refusal, or refused a
    connection): closing the pool sends no DELETE /route, and logs no route that may stay listed."""
    encode, _ = engines
    caplog.set_level(logging.INFO, logger="transfer.sender")
    caplog.set_level(logging.DEBUG, logger="transfer.bootstrap")  # last: the capture's own level is the last one set
    with BootstrapServer(HOST, 0, token="right") as server:
        address = server.address
        if refusal.startswith("no server"):
            server.close()
        with pytest.raises(BootstrapError, match="HTTP 401" if "401" in refusal else "within 0.3s"):
            SenderPool(encode, 0, 1, 1, address, token="wrong", register_timeout_s=0.3)
    requests = [r.getMessage() for r in caplog.records if r.name == "transfer.bootstrap"]
    assert any("PUT" in line for line in requests) or "401" not in refusal, requests
    assert not any("DELETE" in line for line in requests), requests
    assert not any("may stay listed" in r.getMessage() for r in caplog.records), caplog.text


def _answered_then_stopped(request):
    """BootstrapClient._request that takes the server's answer to a PUT, then meets a stop signal's exception
    (a rank's SIGTERM handler raises KeyboardInterrupt wherever the main thread is)."""

    def answered_then_stopped(client, method, *args, **kwargs):
        answer = request(client, method, *args, **kwargs)
        if method == "PUT":
            raise KeyboardInterrupt
        return answer
    return answered_then_stopped


def _keeper_stopped(route) -> None:
    raise KeyboardInterrupt  # as the signal's handler raises it while the route keeper's thread starts


@pytest.mark.parametrize("where", ["as its registration's answer is read", "as its route keeper starts"])
def test_a_pool_stopped_by_a_signal_after_the_server_took_its_registration_withdraws_its_route(engines, monkeypatch,
                                                                                               where):
    """A rank stopped (SIGTERM) while its sender pool starts, once the server listed its route: the pool's
    construction raises the signal's KeyboardInterrupt, and the route is withdrawn by then, so no prefill
    rank is sent to a rank that is gone."""
    import transfer.sender

    encode, _ = engines
    if where.startswith("as its registration"):
        monkeypatch.setattr(BootstrapClient, "_request", _answered_then_stopped(BootstrapClient._request))
    else:
        monkeypatch.setattr(transfer.sender._Route, "keep", _keeper_stopped)
    with BootstrapServer(HOST, 0) as server:
        with pytest.raises(KeyboardInterrupt):
            SenderPool(encode, 0, 1, 1, server.address)
        monkeypatch.undo()
        assert server.registered_ranks == 0, "the stopped pool's route stayed listed"

"""A sender pool's route at the bootstrap server: listed again after the server restarted (and lost
it), never over another instance's, and never after the pool closed."""

from __future__ import annotations

import logging
import socket
import threading
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
    with BootstrapServer(HOST, 0) as first:  # closed again on leaving: a no-op once restarted
        with SenderPool(engine, 0, 1, 1, first.address, host=HOST) as pool, _restarted(first) as server:
            yield pool, server


@contextmanager
def _relay(port: int, *, delay_s: float = 0.0, puts_wait_for: threading.Event | None = None,
           put_waiting: threading.Event | None = None):
    """The address of a relay on loopback to the bootstrap server at `port`: each connection's bytes go on
    after `delay_s` (a server far away, or busy), and a PUT's only once `puts_wait_for` is set
    (`put_waiting` is set meanwhile)."""
    listener = socket.create_server((HOST, 0))
    links: list[socket.socket] = []

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def relay(client: socket.socket) -> None:
        links.append(client)
        time.sleep(delay_s)
        try:
            if puts_wait_for is not None and client.recv(4, socket.MSG_PEEK) == b"PUT ":
                if put_waiting is not None:
                    put_waiting.set()
                puts_wait_for.wait(SETTLE_S)
            upstream = socket.create_connection((HOST, port), timeout=SETTLE_S)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        links.append(upstream)
        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
        pipe(client, upstream)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=relay, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"{HOST}:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for link in links:
            link.close()


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


def test_a_route_another_instance_registers_while_a_check_is_under_way_is_left_alone(engines):
    # The check found no route, and another instance registered before its registration again reached
    # the server: that one must not replace the other's route.
    encode_engine, _ = engines
    puts_go, put_waiting = threading.Event(), threading.Event()
    puts_go.set()
    with BootstrapServer(HOST, 0) as first:
        with _relay(first.port, puts_wait_for=puts_go, put_waiting=put_waiting) as address, \
                SenderPool(encode_engine, 0, 1, 1, address, host=HOST) as pool:
            puts_go.clear()
            put_waiting.clear()  # set by its first registration
            with _restarted(first) as server:
                assert put_waiting.wait(SETTLE_S), "the pool never registered again"
                other_port = pool.port + 1 if pool.port < 65535 else pool.port - 1
                BootstrapClient(server.address).register_rank(1, 1, HOST, other_port, 0, retry_for=1.0,
                                                              instance="another-pool")
                puts_go.set()
                time.sleep(5 * CHECK_S)  # the held registration arrived, and several checks followed
                assert _route(server) == (HOST, other_port)


def test_a_closed_pool_registers_nothing_again(engines):
    encode_engine, _ = engines
    with BootstrapServer(HOST, 0) as first:
        pool = SenderPool(encode_engine, 0, 1, 1, first.address, host=HOST)
        pool.close()
        with _restarted(first) as server:
            time.sleep(5 * CHECK_S)  # a keeper left running would have listed it again by now
            assert _route(server) is None


def test_a_bootstrap_server_that_answers_slowly_is_registered_with_again(engines, caplog):
    # Its answers take 0.3 s, well within ROUTE_CHECK_TIMEOUT_S (2 s): the registration again waits
    # for its answer, as the look-up does.
    encode_engine, _ = engines
    with BootstrapServer(HOST, 0) as first:
        with _relay(first.port, delay_s=0.3) as address, SenderPool(encode_engine, 0, 1, 1, address, host=HOST) as pool:
            with caplog.at_level(logging.WARNING, "transfer.sender"), _restarted(first) as server:
                again = f"registered {HOST}:{pool.port} again"
                assert wait_until(lambda: again in caplog.text, SETTLE_S), caplog.text
                assert _route(server) == (HOST, pool.port)
                assert "registering again failed" not in caplog.text


def test_a_registration_again_that_keeps_failing_is_logged_once_not_at_every_check(engines, caplog):
    # A server restarted with another token answers every registration again 401: one warning saying what
    # to do, then the repeats counted, not a line per check (every 5 s, for as long as the pool runs).
    encode_engine, _ = engines
    with BootstrapServer(HOST, 0, token="before") as first:
        with SenderPool(encode_engine, 0, 1, 1, first.address, host=HOST, token="before") as pool:
            port = first.port
            first.close()
            with caplog.at_level(logging.WARNING, "transfer.sender"), BootstrapServer(HOST, port, token="after"):
                time.sleep(20 * CHECK_S)  # some 20 checks, each refused
                refused = [r.getMessage() for r in caplog.records if "registering again failed" in r.getMessage()]
                assert len(refused) == 1, refused
                assert "HTTP 401" in refused[0] and "give the sender pool the server's token" in refused[0]
                pool.close()
            told = [r.getMessage() for r in caplog.records if "more warnings were not logged" in r.getMessage()]
            assert told, "its close tells how many it left out"


@contextmanager
def _silent_server(port: int):
    """A listener on `port` that takes each connection, reads its request and never answers: yields the
    (request line, connection) of each request read so far."""
    listener = socket.create_server((HOST, port))
    requests: list[tuple[str, socket.socket]] = []

    def read(conn: socket.socket) -> None:
        data = b""
        try:
            while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                data += chunk
        except OSError:
            return
        requests.append((data.split(b"\r\n", 1)[0].decode("ascii", "replace"), conn))

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=read, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield requests
    finally:
        listener.close()
        for _, conn in requests:
            conn.close()


def _closed_by_its_client(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_close_does_not_wait_for_a_look_up_a_silent_server_leaves_unanswered(engines, monkeypatch):
    # The server takes the look-up and answers nothing (a hung server): close() withdraws the route
    # (UNREGISTER_TIMEOUT_S) and returns with the look-up still waiting for its answer. The look-up is
    # given far longer than the close is (ROUTE_CHECK_TIMEOUT_S), and so is the check period once the
    # look-up is under way: a close() that waited for either would not return within the bound.
    encode_engine, _ = engines
    monkeypatch.setattr(sender_module, "ROUTE_CHECK_TIMEOUT_S", 20 * SETTLE_S)
    with BootstrapServer(HOST, 0) as first:
        pool = SenderPool(encode_engine, 0, 1, 1, first.address, host=HOST)
        port = first.port
        first.close()
        with _silent_server(port) as requests:
            assert wait_until(lambda: any(line.startswith("GET /route") for line, _ in requests), SETTLE_S), \
                requests
            look_up = next(conn for line, conn in requests if line.startswith("GET /route"))
            monkeypatch.setattr(sender_module, "ROUTE_CHECK_S", 20 * SETTLE_S)
            closer = threading.Thread(target=pool.close, daemon=True)
            closer.start()
            closer.join(3 * SETTLE_S)
            assert not closer.is_alive(), "close() waited for the look-up under way, or for a check period"
            assert not _closed_by_its_client(look_up), "close() returned only once the look-up had given up"
            assert pool._route.keeper is not None and pool._route.keeper.is_alive(), "the look-up still waits"
            assert wait_until(lambda: any(line.startswith("DELETE /route") for line, _ in requests), SETTLE_S), \
                f"close() withdrew no route: {requests}"


def test_a_pool_another_instance_replaced_registers_again_once_that_one_withdraws(engines):
    # It leaves the other's route alone while it is listed; once the rank has none, the pool, which still
    # serves its rank's requests, lists its own again (docs/protocol.md section 8, "Keeping a route listed").
    encode_engine, _ = engines
    with BootstrapServer(HOST, 0) as server, \
            SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as pool:
        other_port = pool.port + 1 if pool.port < 65535 else pool.port - 1
        other = BootstrapClient(server.address)
        other.register_rank(1, 1, HOST, other_port, 0, retry_for=0, instance="another-pool")
        time.sleep(5 * CHECK_S)  # several checks: each finds a route, not this pool's
        assert _route(server) == (HOST, other_port)
        assert other.unregister_rank(1, 1, HOST, other_port, 0, instance="another-pool")
        assert wait_until(lambda: _route(server) == (HOST, pool.port), SETTLE_S), _route(server)


@pytest.mark.driver_dies
def test_a_pool_whose_thread_stopped_after_an_error_is_not_registered_again(engines):
    # Its sends are refused and its request socket is closed: a restarted server must not send prefill
    # ranks there (they would wait out their deadlines).
    encode_engine, _ = engines
    with _pool_then_restart(encode_engine) as (pool, server):
        assert wait_until(lambda: _route(server) == (HOST, pool.port), SETTLE_S), "the keeper never ran"

        def broken(*args, **kwargs):
            raise RuntimeError("injected")

        pool._core.offer = broken  # the pool's thread calls it for the item sent next, and fails
        pool.send(3, torch.zeros(2, 64, dtype=torch.bfloat16))
        assert wait_until(lambda: pool._book.failure is not None, SETTLE_S)
        with _restarted(server) as again:
            time.sleep(5 * CHECK_S)  # several checks, each finding no route
            assert _route(again) is None

"""The bootstrap server driven with plain urllib as a peer drives it, and our client."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from transfer.bootstrap import MAX_BODY, BootstrapClient, BootstrapError, BootstrapServer


# urllib honours http_proxy; a peer on loopback never goes through one.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _registration(engine_rank: int, world_size: int = 4, dp_size: int = 2,
                  ip: str = "10.0.0.1", port: int | None = None) -> dict:
    """The JSON body an encode rank PUTs."""
    return {"role": "Prefill", "world_size": world_size, "dp_size": dp_size,
            "rank_ip": ip, "rank_port": 17000 + engine_rank if port is None else port,
            "engine_rank": engine_rank}


def _http(method: str, url: str, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    """One urllib request; returns (status, content type, body text), errors included."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with _OPENER.open(request, timeout=5) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Content-Type", ""), error.read().decode()


def _route_request(method: str, server: BootstrapServer, payload: dict | bytes,
                   token: str | None = None, instance: str | None = None) -> tuple[int, str]:
    """PUT or DELETE /route with a JSON body (and the token and the instance header, if given)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if instance is not None:
        headers["X-EPD-Instance"] = instance
    status, _, text = _http(method, f"http://{server.address}/route", body, headers)
    return status, text


def _put(server: BootstrapServer, payload: dict | bytes, token: str | None = None) -> tuple[int, str]:
    """PUT /route with a JSON body, as a peer's encode rank does."""
    return _route_request("PUT", server, payload, token)


def _get(server: BootstrapServer, query: str) -> tuple[int, str, str]:
    """GET /route?query."""
    return _http("GET", f"http://{server.address}/route?{query}")


@pytest.fixture
def server():
    """A server on an ephemeral loopback port."""
    with BootstrapServer("127.0.0.1", 0) as srv:
        yield srv


def _free_port() -> int:
    """A port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_health_and_unknown_path(server):
    assert _http("GET", f"http://{server.address}/health")[::2] == (200, "OK")
    status, _, text = _http("GET", f"http://{server.address}/nowhere")
    assert status == 404 and "/nowhere" in text
    status, _, text = _http("PUT", f"http://{server.address}/elsewhere", b"{}")
    assert status == 404


def test_sync_is_null_before_registration(server):
    status, ctype, text = _get(server, "engine_rank=-1&target_dp_group=-1")
    assert status == 200 and ctype == "application/json"
    assert json.loads(text) == {"prefill_tp_size": None, "prefill_dp_size": None}


def test_put_then_sync_and_route_keying_e4_d2(server):
    for rank in range(4):
        status, text = _put(server, _registration(rank, ip=f"10.0.0.{rank}"))
        assert status == 200, text
    status, _, text = _get(server, "engine_rank=-1&target_dp_group=-1")
    assert json.loads(text) == {"prefill_tp_size": 4, "prefill_dp_size": 2}
    # E=4, D=2: group size 2; rank e sits at dp_group e // 2, tp_rank e % 2.
    expected = {(0, 0): 0, (1, 0): 1, (0, 1): 2, (1, 1): 3}
    for (tp_rank, group), rank in expected.items():
        status, ctype, text = _get(server, f"engine_rank={tp_rank}&target_dp_group={group}")
        assert status == 200 and ctype == "application/json"
        assert json.loads(text) == {"rank_ip": f"10.0.0.{rank}", "rank_port": 17000 + rank}
    assert server.registered_ranks == 4


def test_unknown_route_is_404(server):
    _put(server, _registration(0))
    status, _, text = _get(server, "engine_rank=1&target_dp_group=1")
    assert status == 404
    assert "no route for encode rank 1 in dp group 1" in text


def test_a_look_up_of_a_rank_numbered_past_any_deployment_is_answered_with_a_short_text(server):
    status, _, text = _get(server, f"engine_rank={'9' * 4000}&target_dp_group=-{'8' * 4000}")
    assert status == 404 and len(text) <= 160, (status, len(text))
    assert text == f"no route for encode rank {'9' * 21}... in dp group -{'8' * 20}..."


@pytest.mark.parametrize("query, needle", [
    ("", "missing query parameter engine_rank"),
    ("engine_rank=0", "missing query parameter target_dp_group"),
    ("target_dp_group=0", "missing query parameter engine_rank"),
    ("engine_rank=x&target_dp_group=0", "engine_rank is not an integer"),
    ("engine_rank=0&target_dp_group=1.5", "target_dp_group is not an integer"),
    ("engine_rank=&target_dp_group=0", "engine_rank is not an integer"),
])
def test_bad_query_is_400(server, query, needle):
    status, _, text = _get(server, query)
    assert status == 400 and needle in text


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({**_registration(0), "role": "Decode"}).encode(), "role"),
    (json.dumps({k: v for k, v in _registration(0).items() if k != "world_size"}).encode(),
     "missing field world_size"),
    (json.dumps({**_registration(0), "dp_size": "2"}).encode(), "dp_size is not an integer"),
    (json.dumps({**_registration(0), "rank_port": True}).encode(), "rank_port is not an integer"),
    (json.dumps({**_registration(0), "rank_port": 70000}).encode(), "rank_port out of range"),
    (json.dumps({**_registration(0), "engine_rank": 4}).encode(), "engine_rank out of range"),
    (json.dumps({**_registration(0), "rank_ip": ""}).encode(), "rank_ip"),
    (json.dumps(_registration(0, world_size=3, dp_size=2)).encode(), "not a multiple"),
])
def test_bad_put_is_400_naming_the_field(server, body, needle):
    status, text = _put(server, body)
    assert status == 400 and needle in text
    # Nothing was stored.
    assert json.loads(_get(server, "engine_rank=-1&target_dp_group=-1")[2])["prefill_tp_size"] is None


def test_put_with_other_sizes_is_409(server):
    assert _put(server, _registration(0))[0] == 200
    status, text = _put(server, _registration(1, world_size=8, dp_size=2))
    assert status == 409 and "world_size=4" in text and "world_size=8" in text
    assert "keeps the sizes of its first registration until it restarts" in text, text
    assert "or restart the bootstrap server" in text, text
    assert json.loads(_get(server, "engine_rank=-1&target_dp_group=-1")[2]) == {
        "prefill_tp_size": 4, "prefill_dp_size": 2}


def test_put_again_replaces_the_route(server):
    _put(server, _registration(0, port=1111))
    _put(server, _registration(0, port=2222))
    assert json.loads(_get(server, "engine_rank=0&target_dp_group=0")[2])["rank_port"] == 2222


def test_oversized_body_is_413(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.putrequest("PUT", "/route")
        conn.putheader("Content-Length", str(MAX_BODY + 1))
        conn.endheaders()  # the body is never sent: the server must answer first
        response = conn.getresponse()
        assert response.status == 413
    finally:
        conn.close()


def test_token_guards_put_but_not_get():
    with BootstrapServer("127.0.0.1", 0, token="s3cret") as srv:
        status, text = _put(srv, _registration(0))
        assert status == 401 and "Bearer" in text
        assert _put(srv, _registration(0), token="wrong")[0] == 401
        assert _put(srv, _registration(0), token="s3cret-and-more")[0] == 401
        assert _put(srv, _registration(0), token="s3cret")[0] == 200
        status, _, text = _get(srv, "engine_rank=-1&target_dp_group=-1")
        assert status == 200 and json.loads(text)["prefill_tp_size"] == 4
        assert json.loads(_get(srv, "engine_rank=0&target_dp_group=0")[2])["rank_ip"] == "10.0.0.1"
        assert _http("GET", f"http://{srv.address}/health")[0] == 200


def test_concurrent_puts_and_gets():
    world, dp = 32, 4
    errors: list[str] = []
    with BootstrapServer("127.0.0.1", 0) as srv:
        def register(rank: int) -> None:
            try:
                status, text = _put(srv, _registration(rank, world, dp, ip=f"10.1.0.{rank}"))
            except OSError as error:
                status, text = -1, repr(error)
            if status != 200:
                errors.append(f"PUT {rank}: {status} {text}")

        def read(_: int) -> None:
            for _ in range(5):
                try:
                    status, _, text = _get(srv, "engine_rank=-1&target_dp_group=-1")
                except OSError as error:
                    errors.append(f"GET: {error!r}")
                    continue
                if status != 200 or json.loads(text)["prefill_tp_size"] not in (None, world):
                    errors.append(f"GET: {status} {text}")

        threads = [threading.Thread(target=register, args=(r,)) for r in range(world)]
        threads += [threading.Thread(target=read, args=(r,)) for r in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors
        group = world // dp
        client = BootstrapClient(srv.address)
        for rank in range(world):
            assert client.route(rank % group, rank // group) == (f"10.1.0.{rank}", 17000 + rank)


def test_close_releases_port_and_joins_thread():
    srv = BootstrapServer("127.0.0.1", 0)
    port = srv.port
    _put(srv, _registration(0))
    thread = srv._thread
    srv.close()
    srv.close()  # idempotent
    assert not thread.is_alive()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # would fail while the server still listened
        sock.listen()
    assert not BootstrapClient(f"127.0.0.1:{port}", timeout=0.5).health()


def test_a_close_from_another_thread_returns_once_the_first_close_let_go_of_the_port():
    srv = BootstrapServer("127.0.0.1", 0)
    port = srv.port
    entered, release = threading.Event(), threading.Event()
    join = srv._thread.join

    def held_join(*args, **kwargs):  # the first close, held while it stops the serving thread
        entered.set()
        release.wait(10)
        return join(*args, **kwargs)

    srv._thread.join = held_join
    first = threading.Thread(target=srv.close)
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=srv.close)
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second close() returned while the first still held the port"
    release.set()
    second.join(10)
    assert not second.is_alive()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # would fail while the server still listened
    first.join(10)


def test_close_ends_the_requests_still_being_read_and_their_threads():
    """A registration whose body was still coming in when the server closed is not answered 200: its
    route went with the closed server, and the rank must learn it is not registered."""
    body = json.dumps(_registration(0)).encode()
    srv = BootstrapServer("127.0.0.1", 0)
    before = set(threading.enumerate())
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5.0) as conn:
        conn.sendall(b"PUT /route HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10])
        time.sleep(0.3)  # its handler is reading the body
        srv.close()
        # Its handler, still reading the body (the server gives a request 10 s), is gone as close() returns:
        # close() ended the request rather than waiting out its own bound (5 s) with the handler still there.
        left = [thread for thread in set(threading.enumerate()) - before if thread.is_alive()]
        answer = b""
        try:
            conn.sendall(body[10:])
            while chunk := conn.recv(4096):
                answer += chunk
        except OSError:
            pass  # reset: the connection is gone
    assert left == [], left
    assert not answer.startswith(b"HTTP/1.0 200 "), answer
    assert srv.registered_ranks == 0


def test_binds_only_the_given_host(server):
    assert BootstrapClient(server.address).health()
    # The whole 127/8 range is loopback, but the server listens on 127.0.0.1 only.
    assert not BootstrapClient(f"127.0.0.2:{server.port}", timeout=0.5).health()


def test_client_round_trip_with_token():
    with BootstrapServer("127.0.0.1", 0, token="t") as srv:
        client = BootstrapClient(srv.address, token="t")
        client.register_rank(2, 1, "10.0.0.9", 5555, 1, retry_for=5)
        assert client.parallel_info() == (2, 1)
        assert client.route(1, 0) == ("10.0.0.9", 5555)
        with pytest.raises(BootstrapError, match="no route for encode rank 0 in dp group 0 at"):
            client.route(0, 0)


def _puts(caplog) -> list[str]:
    """The PUT requests the server logged (at debug, one line per request with its status)."""
    return [r.getMessage() for r in caplog.records if r.name == "transfer.bootstrap" and "PUT /route" in r.getMessage()]


def test_client_without_token_is_refused_at_once(caplog):
    caplog.set_level(logging.DEBUG, logger="transfer.bootstrap")
    with BootstrapServer("127.0.0.1", 0, token="t") as srv:
        with pytest.raises(BootstrapError, match="HTTP 401"):
            BootstrapClient(srv.address).register_rank(1, 1, "10.0.0.1", 5555, 0, retry_for=10)
        puts = _puts(caplog)
        assert len(puts) == 1 and " 401 " in puts[0], puts  # a 4xx is not retried


def test_a_registration_sent_to_a_server_that_takes_no_put_is_refused_at_once_not_retried():
    # A --bootstrap that names another HTTP service of the node (a metrics endpoint answers PUT with 501): no
    # bootstrap server answers 501, so the rank is told at once, not after retrying for its whole wait.
    from transfer.metrics import Metrics, serve

    with serve(Metrics("epd_encode")) as endpoint:
        address = f"127.0.0.1:{endpoint.port}"
        with pytest.raises(BootstrapError) as raised:
            BootstrapClient(address).register_rank(1, 1, "10.0.0.1", 5555, 0, retry_for=5)
    assert str(raised.value).startswith(
        f"{address} answered encode rank 0's registration with HTTP 501 (PUT not implemented), which no bootstrap "
        f"server answers: is it the bootstrap server's address (not a metrics endpoint's, say)? It said: "), raised.value


def test_client_conflict_is_not_retried(server, caplog):
    caplog.set_level(logging.DEBUG, logger="transfer.bootstrap")
    client = BootstrapClient(server.address)
    client.register_rank(4, 2, "10.0.0.1", 5555, 0, retry_for=5)
    caplog.clear()
    with pytest.raises(BootstrapError, match="HTTP 409"):
        client.register_rank(8, 2, "10.0.0.1", 5555, 1, retry_for=10)
    puts = _puts(caplog)
    assert len(puts) == 1 and " 409 " in puts[0], puts


def test_parallel_info_incomplete_before_registration(server):
    with pytest.raises(BootstrapError, match="incomplete parallel info"):
        BootstrapClient(server.address).parallel_info()


def test_register_retries_until_the_server_starts():
    port = _free_port()
    client = BootstrapClient(f"127.0.0.1:{port}", timeout=1.0)
    outcome: dict[str, object] = {}

    def register() -> None:
        try:
            client.register_rank(1, 1, "10.0.0.1", 5555, 0, retry_for=10)
            outcome["ok"] = True
        except BootstrapError as error:
            outcome["error"] = error

    thread = threading.Thread(target=register)
    thread.start()
    time.sleep(0.5)
    with BootstrapServer("127.0.0.1", port) as srv:
        thread.join(10)
        assert outcome == {"ok": True}
        assert srv.registered_ranks == 1
        assert client.route(0, 0) == ("10.0.0.1", 5555)


def test_register_gives_up_after_retry_for():
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(BootstrapError, match=f"127.0.0.1:{port} within 1s \\(\\d+ tries\\), the last: ") as caught:
        BootstrapClient(f"127.0.0.1:{port}", timeout=0.5).register_rank(
            1, 1, "10.0.0.1", 5555, 0, retry_for=1.0)
    assert time.monotonic() - start >= 0.9, "gave up before retry_for"
    assert "Connection" in str(caught.value) or "refused" in str(caught.value)


def test_dead_address_fails_fast():
    """A refused connection is an answer: the call does not wait out its (60 s) timeout."""
    address = f"127.0.0.1:{_free_port()}"
    client = BootstrapClient(address, timeout=60.0)
    for call in (client.parallel_info, lambda: client.route(0, 0)):
        with pytest.raises(BootstrapError, match=address) as raised:
            call()
        assert "Connection refused" in str(raised.value), raised.value  # the refusal, not a timeout
    assert client.health() is False


def test_silent_server_is_bounded_by_the_timeout():
    # Accepts connections (kernel backlog) but never answers: the read must time out.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        client = BootstrapClient(f"127.0.0.1:{silent.getsockname()[1]}", timeout=1.0)
        start = time.monotonic()
        with pytest.raises(BootstrapError, match="unreachable"):
            client.parallel_info()
        assert time.monotonic() - start >= 0.9  # not before its 1 s timeout


def _raw(server: BootstrapServer, request: bytes) -> bytes:
    """Sends `request` in one write and reads the whole answer (the server closes after one)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as conn:
        try:
            conn.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered before it read everything
        answer = b""
        try:
            while chunk := conn.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass  # unread bytes at its close may reset the connection once its answer came
    return answer


def test_a_body_shorter_than_its_content_length_is_a_400_saying_so(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as conn:
        conn.sendall(b"PUT /route HTTP/1.0\r\nContent-Length: 100\r\n\r\n" + b'{"role": "Pr')
        conn.shutdown(socket.SHUT_WR)
        answer = conn.makefile("rb").read()
    assert answer.startswith(b"HTTP/1.0 400 "), answer[:200]
    assert answer.endswith(b"body shorter than Content-Length: 12 of 100 bytes")
    assert server.registered_ranks == 0


def _framed(server: BootstrapServer, framing: bytes, body: bytes, extra: bytes = b"") -> bytes:
    """A PUT /route of `body` with the framing headers `framing` (`%d`: its length), `extra` after it."""
    head = b"PUT /route HTTP/1.1\r\nContent-Type: application/json\r\n" + framing.replace(b"%d", b"%d" % len(body))
    return _raw(server, head + b"\r\n" + body + extra)


_CONFLICT = b"PUT /route has conflicting Content-Length headers"
_CODED = b"PUT /route needs a Content-Length body, not a Transfer-Encoding one"


@pytest.mark.parametrize("framing, extra, status, needle", [
    (b"Content-Length: %d\r\nContent-Length: 999\r\n", b"x" * 200, 400, _CONFLICT),
    (b"Content-Length: 999\r\nContent-Length: %d\r\n", b"", 400, _CONFLICT),
    (b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n", b"", 411, _CODED),
    (b"Content-Length: %d\r\nTransfer-Encoding: identity\r\n", b"", 411, _CODED),
    (b"Transfer-Encoding: chunked\r\n", b"", 411, _CODED),
], ids=["a second length past the body", "a first length past the body", "chunked besides a length",
        "any transfer coding besides a length", "chunked alone"])
def test_a_body_whose_length_its_headers_leave_in_doubt_is_refused_and_registers_nothing(server, framing, extra,
                                                                                           status, needle):
    """A body framed two ways (lengths that disagree, or a transfer coding, which overrides a length) is read no
    way: an intermediary that went by the other framing would have passed on another request than this one."""
    answer = _framed(server, framing, json.dumps(_registration(0)).encode(), extra)
    assert answer.startswith(b"HTTP/1.0 %d " % status), answer[:200]
    assert answer.endswith(needle), answer
    assert server.registered_ranks == 0
    assert _get(server, "engine_rank=-1&target_dp_group=-1")[0] == 200


def _refused_whole(server: BootstrapServer, headers: bytes, why: bytes) -> None:
    """A PUT /route of a registration under `headers` (`%d`: the body's length) is a 400 saying `why`, and the
    server registered nothing and goes on serving."""
    body = json.dumps(_registration(0)).encode()
    answer = _raw(server, b"PUT /route HTTP/1.0\r\n" + headers.replace(b"%d", b"%d" % len(body)) + b"\r\n" + body)
    assert answer.startswith(b"HTTP/1.0 400 "), answer[:200]
    assert answer.endswith(why), answer
    assert server.registered_ranks == 0
    assert _get(server, "engine_rank=-1&target_dp_group=-1")[0] == 200


@pytest.mark.parametrize("headers", [
    b"X-Note: a\rX-EPD-Instance: forged\r\nContent-Length: %d\r\n", b"X-Note: a\rContent-Length: %d\r\n",
    b"X-Note: a\x00b\r\nContent-Length: %d\r\n", b"Content-Length: %d\r\nX-Note: a\r\r\n",
], ids=["an instance behind a CR", "the only length behind a CR", "a NUL", "a CR before the line's end"])
def test_a_header_line_holding_a_cr_or_nul_is_a_400_and_registers_nothing(server, headers):
    """A CR is a line's end only before its LF: read as one elsewhere, it would start a header that a reader
    going by the HTTP spec (which refuses it, or reads it as a space) never saw."""
    _refused_whole(server, headers, b"a CR inside a line, or a NUL, in the request line or headers")


@pytest.mark.parametrize("headers", [
    b"Content-Length: %d\r\nX-Note : a\r\nTransfer-Encoding: chunked\r\n",
    b"Content-Length: %d\r\nno colon\r\nTransfer-Encoding: chunked\r\n",
    b"Content-Length: %d\r\n: a\r\n", b" X-Note: a\r\nContent-Length: %d\r\n",
], ids=["a space before the colon", "no colon", "no name", "a first line that continues none"])
def test_a_header_line_that_is_no_header_is_a_400_and_registers_nothing(server, headers):
    """The stdlib's parser drops such a line, and every header after it (a Transfer-Encoding, say), where a
    reader going by the HTTP spec refuses the request."""
    _refused_whole(server, headers, b"a header line that is no header (a name, a colon right after it, a value)")


def test_a_length_given_twice_alike_is_one_length(server):
    answer = _framed(server, b"Content-Length: %d\r\nContent-Length: %d\r\n", json.dumps(_registration(0)).encode())
    assert answer.startswith(b"HTTP/1.0 200 "), answer[:200]
    assert server.registered_ranks == 1


_FILLED_HEADERS = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 1000) for i in range(20))


def test_headers_over_the_byte_budget_are_431_and_the_server_serves_on(server):
    answer = _raw(server, b"GET /route?engine_rank=0&target_dp_group=0 HTTP/1.0\r\n" + _FILLED_HEADERS + b"\r\n")
    assert answer.startswith(b"HTTP/1.0 431 "), answer[:200]
    assert b"request line and headers over 16384 bytes" in answer
    assert _get(server, "engine_rank=-1&target_dp_group=-1")[0] == 200


def test_a_request_line_over_the_byte_budget_is_414(server):
    answer = _raw(server, b"GET /route?" + b"a" * 20000 + b" HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 414 "), answer[:200]
    assert _get(server, "engine_rank=-1&target_dp_group=-1")[0] == 200


def test_headers_under_the_budget_with_a_body_past_it_are_served(server):
    """The budget counts what is read with the headers; a body read along with them is not cut short."""
    body = json.dumps(_registration(0, port=3333)).encode()
    head = b"PUT /route HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    filler = b"X-Filler: " + b"a" * (16384 - len(head) - 20) + b"\r\n"
    request = head + filler + b"\r\n" + body
    assert len(request) - len(body) < 16384 < len(request)
    answer = _raw(server, request)
    assert answer.startswith(b"HTTP/1.0 200 "), answer[:200]
    assert json.loads(_get(server, "engine_rank=0&target_dp_group=0")[2])["rank_port"] == 3333


@pytest.mark.parametrize("sent, status", [
    (b"POST /route HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}", 501),
    (b"GET /route extra HTTP/1.0\r\n\r\n", 400),
    (b"GET /route?" + b"a" * 20000 + b" HTTP/1.0\r\n\r\n", 414),
    (b"GET /health HTTP/1.0\r\n" + _FILLED_HEADERS + b"\r\n", 431),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /health HTTP/9.9\r\n\r\n", 505),
], ids=["unsupported method", "malformed request line", "request line too long", "headers too large",
        "no version at all", "unknown version"])
def test_every_error_is_answered_as_short_text(server, sent, status):
    head, _, body = _raw(server, sent).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 %d " % status), head
    assert b"\r\nContent-Type: text/plain; charset=utf-8\r\n" in head
    assert body and b"<" not in body and len(body) < 200, body


@pytest.mark.parametrize("target", [b"/health", b"/route?engine_rank=-1&target_dp_group=-1", b"/route?engine_rank=0",
                                    b"/nowhere"])
def test_a_head_request_is_answered_as_get_without_a_body(server, target):
    head, _, body = _raw(server, b"HEAD " + target + b" HTTP/1.0\r\n\r\n").partition(b"\r\n\r\n")
    got_head, _, got_body = _raw(server, b"GET " + target + b" HTTP/1.0\r\n\r\n").partition(b"\r\n\r\n")
    assert body == b"" and got_body
    assert head.split(b"\r\n")[0] == got_head.split(b"\r\n")[0], (head, got_head)
    headers = [line for line in head.split(b"\r\n")[1:] if not line.startswith((b"Server:", b"Date:"))]
    assert headers == [line for line in got_head.split(b"\r\n")[1:] if not line.startswith((b"Server:", b"Date:"))]
    assert b"\r\nContent-Length: %d\r\n" % len(got_body) in head + b"\r\n"


def test_a_method_the_server_does_not_serve_is_answered_501_as_text(server):
    head, _, body = _raw(server, b"OPTIONS /health HTTP/1.0\r\n\r\n").partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 501 ") and b"\r\nContent-Type: text/plain; charset=utf-8\r\n" in head
    assert body == b"Unsupported method ('OPTIONS')", body


@pytest.mark.parametrize("request_line", [b"GET http://[::1/route HTTP/1.0", b"PUT http://[x/route HTTP/1.0"])
def test_a_request_target_that_does_not_parse_is_400_and_the_server_serves_on(server, request_line):
    answer = _raw(server, request_line + b"\r\nContent-Length: 2\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.0 400 ") and answer.endswith(b"bad request target")
    assert _get(server, "engine_rank=-1&target_dp_group=-1")[0] == 200


@contextlib.contextmanager
def _answering(answer: bytes) -> Iterator[str]:
    """A loopback server answering every connection with the bytes `answer`; yields its address."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.1)
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(5.0)
                    conn.recv(65536)
                    conn.sendall(answer)
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(65536):  # until the client closes: no unread bytes reset the answer
                        pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{listener.getsockname()[1]}"
        finally:
            stop.set()
            thread.join(10.0)


def test_a_json_answer_nested_past_the_parser_is_a_bootstrap_error():
    body = b"[" * 5000
    with _answering(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body) as address:
        client = BootstrapClient(address, timeout=5.0)
        for call in (client.parallel_info, lambda: client.route(0, 0)):
            with pytest.raises(BootstrapError, match="not JSON"):
                call()


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_a_json_answer_over_the_body_bound_is_a_bootstrap_error_saying_so_not_that_it_is_no_json(framing):
    """A valid JSON answer padded past MAX_BODY is read only up to that bound: the error says the answer was
    too long for a bootstrap server's, not that it was not JSON (which it was)."""
    from transfer.bootstrap import MAX_BODY

    body = b'{"prefill_tp_size": 4, "prefill_dp_size": 2, "rank_ip": "10.0.0.1", "rank_port": 7000, "pad": "'
    body += b"x" * MAX_BODY + b'"}'
    if framing == "length":
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    elif framing == "chunked":
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    else:
        answer = b"HTTP/1.0 200 OK\r\n\r\n" + body
    with _answering(answer) as address:
        client = BootstrapClient(address, timeout=5.0)
        for call, what in ((client.parallel_info, "parallel info"), (lambda: client.route(0, 0), "encode rank 0")):
            with pytest.raises(BootstrapError, match=rf"^bootstrap server {address} sent an answer over {MAX_BODY} "
                                                     rf"bytes for {what}, longer than any bootstrap server's"):
                call()


def test_an_answer_of_the_body_bound_exactly_is_read_whole():
    from transfer.bootstrap import MAX_BODY

    head = b'{"prefill_tp_size": 4, "prefill_dp_size": 2, "pad": "'
    body = head + b"x" * (MAX_BODY - len(head) - 2) + b'"}'
    assert len(body) == MAX_BODY
    with _answering(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body) as address:
        assert BootstrapClient(address, timeout=5.0).parallel_info() == (4, 2)


def test_an_answer_shorter_than_its_content_length_is_a_transport_error():
    body = b'{"prefill_tp_size": 4, "prefill_dp_size": 2}'
    with _answering(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(body) + 100) + body) as address:
        with pytest.raises(BootstrapError, match="unreachable for parallel info: IncompleteRead"):
            BootstrapClient(address, timeout=5.0).parallel_info()


def test_a_registration_answer_cut_short_is_retried_until_retry_for():
    with _answering(b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\nOK") as address:
        with pytest.raises(BootstrapError, match="within 1s \\(\\d+ tries\\), the last: IncompleteRead"):
            BootstrapClient(address, timeout=5.0).register_rank(1, 1, "10.0.0.1", 5555, 0, retry_for=1.0)


def test_a_server_dropped_without_close_stops_with_a_resource_warning():
    import gc

    from live_helpers import port_rebindable, wait_until

    threads = len(threading.enumerate())
    server = BootstrapServer("127.0.0.1", 0)
    port = server.port
    with pytest.warns(ResourceWarning, match=f"bootstrap server on 127.0.0.1:{port} was dropped without close"):
        del server
        gc.collect()
    assert wait_until(lambda: len(threading.enumerate()) <= threads, 10), threading.enumerate()
    assert port_rebindable("127.0.0.1", port)


def test_a_closed_server_warns_of_nothing_when_dropped(recwarn):
    import gc

    server = BootstrapServer("127.0.0.1", 0)
    server.close()
    del server
    gc.collect()
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]


# ------------------------------------------------------------------ DELETE /route (ours)


def _delete(server: BootstrapServer, payload: dict | bytes, token: str | None = None,
            instance: str | None = None) -> tuple[int, str]:
    """DELETE /route with a PUT's JSON body."""
    return _route_request("DELETE", server, payload, token, instance)


def test_delete_removes_a_route_that_still_leads_to_its_endpoint(server, caplog):
    caplog.set_level(logging.INFO, logger="transfer.bootstrap")
    _put(server, _registration(0, port=1111))
    _put(server, _registration(1, port=1112))
    status, text = _delete(server, _registration(0, port=1111))
    assert (status, json.loads(text)) == (200, {"status": "OK", "removed": True})
    assert _get(server, "engine_rank=0&target_dp_group=0")[0] == 404
    assert json.loads(_get(server, "engine_rank=1&target_dp_group=0")[2])["rank_port"] == 1112
    assert json.loads(_get(server, "engine_rank=-1&target_dp_group=-1")[2]) == {"prefill_tp_size": 4,
                                                                              "prefill_dp_size": 2}
    assert any("encode rank 0 (dp group 0, tp rank 0) unregistered from 10.0.0.1:1111" in r.getMessage()
               and r.levelno == logging.INFO for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert json.loads(_delete(server, _registration(0, port=1111))[1]) == {"status": "OK", "removed": False}


def test_delete_from_an_endpoint_the_route_no_longer_leads_to_keeps_it(server):
    _put(server, _registration(0, port=1111))
    _put(server, _registration(0, port=2222))  # its successor, at another port
    status, text = _delete(server, _registration(0, port=1111))
    assert (status, json.loads(text)) == (200, {"status": "OK", "removed": False})
    assert json.loads(_get(server, "engine_rank=0&target_dp_group=0")[2])["rank_port"] == 2222


def test_a_late_delete_of_a_predecessor_at_the_same_endpoint_leaves_its_successors_route(server):
    """A rank restarted at the very same ip:port registers under a new instance; the old instance's DELETE,
    arriving after that, removes nothing. Only the registering instance's own DELETE does."""
    registration = _registration(0, port=1111)
    assert _route_request("PUT", server, registration, instance="a" * 32)[0] == 200
    assert _route_request("PUT", server, registration, instance="b" * 32)[0] == 200  # its successor
    status, text = _delete(server, registration, instance="a" * 32)
    assert (status, json.loads(text)) == (200, {"status": "OK", "removed": False})
    assert json.loads(_get(server, "engine_rank=0&target_dp_group=0")[2])["rank_port"] == 1111
    assert json.loads(_delete(server, registration, instance="b" * 32)[1]) == {"status": "OK", "removed": True}
    assert _get(server, "engine_rank=0&target_dp_group=0")[0] == 404


def test_instances_and_their_absence_on_either_side(server):
    """A DELETE without the instance header (an older peer of ours) removes by endpoint, as before; one
    with it removes nothing that a registration without it (a peer's, or an older one of ours) made."""
    registration = _registration(0, port=1111)
    _put(server, registration)
    assert json.loads(_delete(server, registration, instance="a" * 32)[1])["removed"] is False
    assert json.loads(_delete(server, registration)[1])["removed"] is True
    _route_request("PUT", server, registration, instance="b" * 32)
    assert json.loads(_delete(server, registration)[1])["removed"] is True


def test_a_registration_that_arrives_after_its_own_instances_delete_lists_nothing(server):
    """A closed pool's PUT held up in flight (here: its body's last byte) until after that pool's DELETE was
    served must not list the rank again: prefill ranks would look up and ask a rank that is gone."""
    body = json.dumps(_registration(0, port=1111)).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as late:
        late.sendall(b"PUT /route HTTP/1.0\r\nContent-Type: application/json\r\nX-EPD-Instance: " + b"a" * 32
                     + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:-1])
        status, text = _delete(server, _registration(0, port=1111), instance="a" * 32)
        assert (status, json.loads(text)) == (200, {"status": "OK", "removed": False}), "nothing listed yet"
        late.sendall(body[-1:])
        answer = b""
        while chunk := late.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.0 410 "), answer
    assert b"withdrew its route (DELETE /route) already" in answer and b"a new sender pool" in answer, answer
    assert _get(server, "engine_rank=0&target_dp_group=0")[0] == 404
    assert json.loads(_get(server, "engine_rank=-1&target_dp_group=-1")[2])["prefill_tp_size"] is None, \
        "the refused registration fixed the sizes"
    assert _route_request("PUT", server, _registration(0, port=1111), instance="b" * 32)[0] == 200, \
        "a new instance (the rank restarted) registers"
    assert _route_request("PUT", server, _registration(1, port=1112))[0] == 200, "a peer's (no instance) registers"


@pytest.mark.parametrize("instance", ["", "x" * 65, "a b", "a\u00e9"])
def test_an_instance_header_that_is_no_instance_is_a_400_and_registers_nothing(server, instance):
    status, text = _route_request("PUT", server, _registration(0), instance=instance)
    assert status == 400 and "X-EPD-Instance" in text, (status, text)
    assert _get(server, "engine_rank=0&target_dp_group=0")[0] == 404


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({**_registration(0), "role": "Decode"}).encode(), 400, "role"),
    (json.dumps({**_registration(0), "rank_port": 70000}).encode(), 400, "rank_port out of range"),
    (json.dumps(_registration(0, world_size=8, dp_size=2)).encode(), 409, "the DELETE says world_size=8"),
])
def test_a_bad_delete_is_refused_as_a_bad_put_is_and_removes_nothing(server, body, status, needle):
    _put(server, _registration(0))
    answer = _delete(server, body)
    assert answer[0] == status and needle in answer[1], answer
    assert _get(server, "engine_rank=0&target_dp_group=0")[0] == 200


def test_the_token_guards_delete_as_it_guards_put():
    with BootstrapServer("127.0.0.1", 0, token="s3cret") as srv:
        assert _put(srv, _registration(0), token="s3cret")[0] == 200
        status, text = _delete(srv, _registration(0))
        assert status == 401 and text == "DELETE /route needs Authorization: Bearer <token>"
        assert _delete(srv, _registration(0), token="wrong")[0] == 401
        assert _get(srv, "engine_rank=0&target_dp_group=0")[0] == 200
        assert json.loads(_delete(srv, _registration(0), token="s3cret")[1])["removed"] is True
        assert _get(srv, "engine_rank=0&target_dp_group=0")[0] == 404


def test_client_unregisters_and_a_server_without_delete_is_a_bootstrap_error(server):
    client = BootstrapClient(server.address)
    client.register_rank(2, 1, "10.0.0.9", 5555, 1, retry_for=5)
    assert client.unregister_rank(2, 1, "10.0.0.9", 5555, 1) is True
    assert client.unregister_rank(2, 1, "10.0.0.9", 5555, 1) is False
    with pytest.raises(BootstrapError, match="no route for encode rank 1 in dp group 0"):
        client.route(1, 0)
    # A peer's server knows no DELETE: aiohttp's and FastAPI's answer 405.
    with _answering(b"HTTP/1.0 405 Method Not Allowed\r\nContent-Length: 18\r\n\r\nMethod Not Allowed") as address:
        with pytest.raises(BootstrapError, match="HTTP 405: Method Not Allowed"):
            BootstrapClient(address).unregister_rank(2, 1, "10.0.0.9", 5555, 1)


def test_a_route_look_up_names_the_registration_that_made_it_in_a_header_the_body_leaves_alone(server):
    """Our GET /route answer for one rank carries the instance its registration named (a prefill rank of ours
    tells a rank restarted at the same endpoint by it), and none for a registration that named none; the body
    is section 5's either way."""
    registration = _registration(0, port=1111)

    def look_up() -> tuple[str | None, dict]:
        request = urllib.request.Request(f"http://{server.address}/route?engine_rank=0&target_dp_group=0")
        with _OPENER.open(request, timeout=5) as response:
            return response.headers.get("X-EPD-Instance"), json.loads(response.read())

    _route_request("PUT", server, registration, instance="a" * 32)
    assert look_up() == ("a" * 32, {"rank_ip": "10.0.0.1", "rank_port": 1111})
    assert BootstrapClient(server.address).registration(0, 0) == ("10.0.0.1", 1111, "a" * 32)
    _route_request("PUT", server, registration, instance="b" * 32)
    assert look_up()[0] == "b" * 32
    _put(server, registration)  # a peer's rank, or an older one of ours
    assert look_up() == (None, {"rank_ip": "10.0.0.1", "rank_port": 1111})
    assert BootstrapClient(server.address).registration(0, 0) == ("10.0.0.1", 1111, None)

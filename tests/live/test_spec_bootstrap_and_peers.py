"""Conformance to SPEC.md section 5 (the bootstrap server and client) and to the peers.

Every expectation is written out by hand from the SPEC text. The last part plays a
hand-rolled TokenSpeed-like peer over real ZMQ sockets, a real bootstrap server and
Mooncake `tcp` on loopback."""

from __future__ import annotations

import http.client
import http.server
import json
import pickle
import struct
import threading
import time

import pytest
import zmq

from transfer.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from transfer.frames import parse_status
from transfer.status import TransferPoll


HOST = "127.0.0.1"


def ptr(value: int) -> bytes:
    """SPEC 4.1/4.2's pointer part, exactly as the SPEC writes it."""
    return struct.pack("Q", value)


@pytest.mark.parametrize("frames, expected", [
    ([b"7", b"5", b"0"], (7, TransferPoll.Success, 0, ())),
    ([b"7", b"0", b"2"], (7, TransferPoll.Failed, 2, ())),
    ([b"+7", b"+4", b"+2"], (7, TransferPoll.Transferring, 2, ())),
    ([b"-0", b"-0", b"-0"], (0, TransferPoll.Failed, 0, ())),
    ([b"0007", b"05", b"-3"], (7, TransferPoll.Success, -3, ())),
    ([b"9223372036854775807", b"1", b"-9223372036854775808"], (2**63 - 1, TransferPoll.Bootstrapping, -(2**63), ())),
    ([b"7", b"5", b"0", b"99"], (7, TransferPoll.Success, 0, (99,))),
    ([b"7", b"5", b"0", b"99", b"18446744073709551615"], (7, TransferPoll.Success, 0, (99, 2**64 - 1))),
])
def test_status_parses(frames, expected):
    assert parse_status(frames) == expected
    assert parse_status([zmq.Frame(f) for f in frames]) == expected
    assert parse_status(tuple(bytearray(f) for f in frames)) == expected


def exchange(server: BootstrapServer, method: str, path: str, body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, bytes]:
    """One raw HTTP exchange, as a peer's client makes it."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def put_body(world_size: int, dp_size: int, ip: str, port: int, engine_rank: int) -> bytes:
    """The PUT /route body of SPEC 5, built by hand."""
    return (b'{"role": "Prefill", "world_size": %d, "dp_size": %d, "rank_ip": "%s", "rank_port": %d, '
            b'"engine_rank": %d}' % (world_size, dp_size, ip.encode(), port, engine_rank))


JSON = {"Content-Type": "application/json"}
SYNC = "/route?engine_rank=-1&target_dp_group=-1"


@pytest.fixture
def server():
    with BootstrapServer(HOST, 0) as srv:
        yield srv


def test_health_is_200_ok(server):
    assert exchange(server, "GET", "/health") == (200, b"OK")


def test_sync_before_any_registration_has_null_sizes(server):
    status, body = exchange(server, "GET", SYNC)
    assert status == 200
    assert json.loads(body) == {"prefill_tp_size": None, "prefill_dp_size": None}


def test_routes_are_keyed_by_dp_group_and_tp_rank(server):
    # E=6 ranks in D=2 groups: engine rank e lives at (e // 3, e % 3).
    for e in range(6):
        status, _ = exchange(server, "PUT", "/route", put_body(6, 2, f"10.0.0.{e}", 17000 + e, e), JSON)
        assert status == 200
    status, body = exchange(server, "GET", SYNC)
    assert (status, json.loads(body)) == (200, {"prefill_tp_size": 6, "prefill_dp_size": 2})
    for group in range(2):
        for tp_rank in range(3):
            e = group * 3 + tp_rank
            status, body = exchange(server, "GET", f"/route?engine_rank={tp_rank}&target_dp_group={group}")
            assert (status, json.loads(body)) == (200, {"rank_ip": f"10.0.0.{e}", "rank_port": 17000 + e})


@pytest.mark.parametrize("query", ["engine_rank=3&target_dp_group=0", "engine_rank=0&target_dp_group=2",
                                   "engine_rank=5&target_dp_group=5", "engine_rank=-1&target_dp_group=0"])
def test_unknown_route_is_404_with_a_text(server, query):
    exchange(server, "PUT", "/route", put_body(6, 2, HOST, 17000, 0), JSON)
    status, body = exchange(server, "GET", f"/route?{query}")
    assert status == 404
    assert body.strip() and b"{" not in body  # a clear text, not a route


@pytest.mark.parametrize("path", ["/route", "/route?engine_rank=0", "/route?target_dp_group=0",
                                  "/route?engine_rank=-1", "/route?other=1"])
def test_missing_query_parameters_are_400(server, path):
    exchange(server, "PUT", "/route", put_body(1, 1, HOST, 17000, 0), JSON)
    assert exchange(server, "GET", path)[0] == 400


def test_the_first_put_fixes_the_sizes(server):
    assert exchange(server, "PUT", "/route", put_body(2, 1, HOST, 17000, 0), JSON)[0] == 200
    assert exchange(server, "PUT", "/route", put_body(4, 2, HOST, 17001, 1), JSON)[0] != 200
    assert json.loads(exchange(server, "GET", SYNC)[1]) == {"prefill_tp_size": 2, "prefill_dp_size": 1}


def test_without_a_token_put_needs_no_authorization(server):
    assert exchange(server, "PUT", "/route", put_body(1, 1, HOST, 17000, 0), JSON)[0] == 200
    headers = {**JSON, "Authorization": "Bearer whatever"}
    assert exchange(server, "PUT", "/route", put_body(1, 1, HOST, 17001, 0), headers)[0] == 200
    assert json.loads(exchange(server, "GET", "/route?engine_rank=0&target_dp_group=0")[1])["rank_port"] == 17001


def test_a_token_guards_put_only():
    with BootstrapServer(HOST, 0, token="s3cr3t") as srv:
        body = put_body(1, 1, HOST, 17000, 0)
        for auth in (None, "Bearer wrong", "s3cr3t", "Bearer s3cr3t ", "bearer s3cr3t", "Basic s3cr3t"):
            headers = dict(JSON) if auth is None else {**JSON, "Authorization": auth}
            assert exchange(srv, "PUT", "/route", body, headers)[0] == 401, auth
        assert json.loads(exchange(srv, "GET", SYNC)[1]) == {"prefill_tp_size": None, "prefill_dp_size": None}
        assert exchange(srv, "PUT", "/route", body, {**JSON, "Authorization": "Bearer s3cr3t"})[0] == 200
        # GETs stay open: a peer reads without a token.
        assert exchange(srv, "GET", "/health") == (200, b"OK")
        assert json.loads(exchange(srv, "GET", SYNC)[1]) == {"prefill_tp_size": 1, "prefill_dp_size": 1}
        status, route = exchange(srv, "GET", "/route?engine_rank=0&target_dp_group=0")
        assert (status, json.loads(route)) == (200, {"rank_ip": HOST, "rank_port": 17000})


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A stand-in peer bootstrap server: records each request and answers what it was told."""

    def log_message(self, *args) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.seen.append((self.command, self.path, body))
        status, payload = self.server.answers.get((self.command, self.path.split("?")[0]), (200, b"OK"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = _answer


@pytest.fixture
def recorder():
    srv = http.server.ThreadingHTTPServer((HOST, 0), _Recorder)
    srv.seen, srv.answers = [], {}
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        thread.join(5)
        srv.server_close()


def test_our_client_speaks_the_spec_requests(recorder):
    address = f"{HOST}:{recorder.server_address[1]}"
    client = BootstrapClient(address, timeout=2.0)
    client.register_rank(4, 2, "10.9.8.7", 17123, 3, retry_for=2.0)
    method, path, body = recorder.seen[-1]
    assert (method, path) == ("PUT", "/route")
    assert json.loads(body) == {"role": "Prefill", "world_size": 4, "dp_size": 2, "rank_ip": "10.9.8.7",
                                "rank_port": 17123, "engine_rank": 3}

    recorder.answers[("GET", "/route")] = (200, b'{"prefill_tp_size": null, "prefill_dp_size": null}')
    with pytest.raises(BootstrapError):  # null sizes: no encode rank registered yet
        client.parallel_info()
    assert recorder.seen[-1][:2] == ("GET", "/route?engine_rank=-1&target_dp_group=-1")
    recorder.answers[("GET", "/route")] = (200, b'{"prefill_tp_size": 4, "prefill_dp_size": 2}')
    assert client.parallel_info() == (4, 2)

    recorder.answers[("GET", "/route")] = (200, b'{"rank_ip": "10.9.8.7", "rank_port": 17123}')
    assert client.route(1, 1) == ("10.9.8.7", 17123)
    assert recorder.seen[-1][:2] == ("GET", "/route?engine_rank=1&target_dp_group=1")
    recorder.answers[("GET", "/route")] = (404, b"Bootstrap info not Found")
    with pytest.raises(BootstrapError):
        client.route(0, 0)
    recorder.answers[("GET", "/health")] = (200, b"OK")
    assert client.health()



UNPICKLED: list[str] = []


def _unpickled(marker: str) -> str:
    UNPICKLED.append(marker)
    return marker


class _Pickled:
    def __reduce__(self):
        return _unpickled, ("unpickled",)


def test_no_http_body_is_ever_unpickled(recorder, server):
    # SPEC 8, never pickle: a live pickle as a PUT /route body, and as each answer our client reads.
    payload = pickle.dumps(_Pickled())
    UNPICKLED.clear()
    assert pickle.loads(payload) == "unpickled" and UNPICKLED == ["unpickled"]  # the payload is live
    UNPICKLED.clear()
    status, _ = exchange(server, "PUT", "/route", payload, JSON)
    assert status == 400
    client = BootstrapClient(f"{HOST}:{recorder.server_address[1]}", timeout=2.0)
    recorder.answers[("PUT", "/route")] = (200, payload)
    with pytest.raises(BootstrapError):
        client.register_rank(1, 1, HOST, 17000, 0, retry_for=0.0)
    recorder.answers[("GET", "/route")] = (200, payload)
    with pytest.raises(BootstrapError):
        client.parallel_info()
    with pytest.raises(BootstrapError):
        client.route(0, 0)
    assert UNPICKLED == []

try:
    import mooncake.engine as _mooncake

    _MOONCAKE_MISSING = ""
except ImportError as _error:  # pragma: no cover - depends on the host
    _mooncake = None
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"

live = pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")

SENTINEL_BYTE = 0xA5
DTYPE = "torch.bfloat16"


def layer_sum_by_hand(data: bytes) -> int:
    """SPEC 9's checksum: the wrapping sum of little-endian u64 words, tail zero-padded."""
    padded = data + b"\x00" * (-len(data) % 8)
    return sum(struct.unpack(f"<{len(padded) // 8}Q", padded)) % 2**64


def pattern(room: int, nbytes: int) -> bytes:
    """Distinct deterministic bytes per room."""
    return bytes((room * 31 + i * 7 + (i >> 8)) % 251 for i in range(nbytes))


class PeerEngine:
    """A peer's own Mooncake engine (tcp, loopback) over one registered bytearray, used raw."""

    def __init__(self, nbytes: int) -> None:
        import ctypes

        self.te = _mooncake.TransferEngine()
        assert self.te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
        self.session_id = f"{HOST}:{self.te.get_rpc_port()}"
        self.memory = (ctypes.c_ubyte * nbytes)()
        ctypes.memset(self.memory, SENTINEL_BYTE, nbytes)
        self.base = ctypes.addressof(self.memory)
        assert self.te.register_memory(self.base, nbytes) == 0

    def put(self, offset: int, data: bytes) -> int:
        """Copies `data` into the registered memory at `offset`; returns its address."""
        import ctypes

        ctypes.memmove(self.base + offset, data, len(data))
        return self.base + offset

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self.memory[offset : offset + nbytes])

    def write(self, session_id: str, src: int, dst: int, nbytes: int) -> None:
        assert self.te.transfer_sync_write(session_id, src, dst, nbytes) == 0

    def close(self) -> None:
        self.te.unregister_memory(self.base)
        self.te = None


def pull(ctx: zmq.Context) -> tuple[zmq.Socket, int]:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, sock.bind_to_random_port(f"tcp://{HOST}")


def push(ctx: zmq.Context, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{HOST}:{port}")
    return sock


def recv(sock: zmq.Socket, timeout: float = 5.0) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), f"nothing arrived within {timeout}s"
    return sock.recv_multipart()


def wait_status(handle, timeout: float = 5.0) -> TransferPoll:
    return handle.wait(timeout)


@live
def test_peer_encode_rank_serves_our_prefill_with_bare_statuses():
    """(a) A TokenSpeed-like encode rank 1 (of 2) serves our prefill rank 3 (of tp 4): fanout 2, shard 1."""
    import numpy as np

    from transfer.engine import Engine
    from transfer.receiver import SessionManager

    span, hidden, row_bytes = 6, 8, 16  # bfloat16
    row_start, rows = 3, 3  # shard_rows(6, 3 % 2, 2), written out
    item = span * row_bytes
    slots = 6
    arena = np.full(slots * item, SENTINEL_BYTE, dtype=np.uint8)
    ctx = zmq.Context.instance()
    stand_in, stand_in_port = pull(ctx)
    peer = PeerEngine(slots * item)
    try:
        with BootstrapServer(HOST, 0) as server, Engine(HOST, protocol="tcp") as ours:
            # The peer registers encode rank 1 of E=2, D=1 with a hand-built PUT.
            assert exchange(server, "PUT", "/route", put_body(2, 1, HOST, stand_in_port, 1), JSON)[0] == 200
            with SessionManager(ours, 3, 4, 1, buffer=(arena.ctypes.data, arena.nbytes), host=HOST,
                                deadline_s=20.0) as manager:
                rooms = [100, 101, 102, 103, 104]
                dst = {room: arena.ctypes.data + slot * item + row_start * row_bytes for slot, room in enumerate(rooms)}
                handles = {room: manager.receive(room, server.address, dst[room], rows, hidden, DTYPE,
                                                 row_start=row_start, span=span) for room in rooms}
                status_port = str(manager.status_port).encode()
                session = ours.session_id.encode()

                registration = recv(stand_in)
                assert registration[:6] == [b"None", HOST.encode(), status_port, session,
                                            ptr(arena.ctypes.data), ptr(0)]
                assert len(registration) in (6, 8)
                for room in rooms:
                    assert recv(stand_in) == [
                        str(room).encode(), HOST.encode(), status_port, session, ptr(dst[room]), ptr(0),
                        b"3", b"8", b"torch.bfloat16", b"0", b"2", b"3", b"6",
                    ]
                assert not stand_in.poll(200), "more than one registration for one encode rank"

                statuses = push(ctx, manager.status_port)
                try:
                    shard = {room: pattern(room, item)[row_start * row_bytes :] for room in rooms}
                    for slot, room in enumerate(rooms):
                        peer.put(slot * item, shard[room])
                    # 100: a status from encode rank 0 is not from the paired rank; then the real write.
                    statuses.send_multipart([b"100", b"5", b"0"])
                    time.sleep(0.3)
                    assert handles[100].poll() == TransferPoll.WaitingForInput
                    peer.write(ours.session_id, peer.base, dst[100], rows * row_bytes)
                    statuses.send_multipart([b"100", b"5", b"1"])
                    # 101: nothing written, a bare peer status: Success, since there is nothing to verify.
                    statuses.send_multipart([b"101", b"5", b"1"])
                    # 102: written, with our checksum extension computed by hand: verified, Success.
                    peer.write(ours.session_id, peer.base + 2 * item, dst[102], rows * row_bytes)
                    statuses.send_multipart([b"102", b"5", b"1", str(layer_sum_by_hand(shard[102])).encode()])
                    # 103: nothing written but a checksum sent: the check runs and fails the room.
                    statuses.send_multipart([b"103", b"5", b"1", str(layer_sum_by_hand(shard[103])).encode()])
                    # 104: the peer reports Failed.
                    statuses.send_multipart([b"104", b"0", b"1"])
                    statuses.send_multipart([b"999", b"5", b"1"])  # an unknown room is ignored

                    assert wait_status(handles[100]) == TransferPoll.Success
                    assert wait_status(handles[101]) == TransferPoll.Success
                    assert wait_status(handles[102]) == TransferPoll.Success
                    assert wait_status(handles[103]) == TransferPoll.Failed
                    assert handles[103].failure.startswith("checksum mismatch")
                    assert wait_status(handles[104]) == TransferPoll.Failed
                    assert handles[104].failure.startswith("encode failed to send embedding")
                    landed = arena.tobytes()
                    for slot, room in enumerate(rooms):
                        head = landed[slot * item : slot * item + row_start * row_bytes]
                        body = landed[slot * item + row_start * row_bytes : (slot + 1) * item]
                        assert head == bytes([SENTINEL_BYTE]) * len(head)  # rows before the shard untouched
                        written = room in (100, 102)
                        assert body == (shard[room] if written else bytes([SENTINEL_BYTE]) * len(body)), room
                    for handle in handles.values():
                        handle.clear()
                finally:
                    statuses.close(0)
    finally:
        stand_in.close(0)
        peer.close()


@live
def test_peer_prefill_rank_is_served_by_our_sender_pool():
    """(b) A TokenSpeed-like prefill rank registers with 6 parts and asks with hand-built 13-part TransferInfos."""
    import numpy as np

    from transfer.engine import Engine
    from transfer.sender import SenderPool

    span, hidden, row_bytes = 5, 8, 16
    item = span * row_bytes
    ctx = zmq.Context.instance()
    peer = PeerEngine(4 * item)
    status_sock, status_port = pull(ctx)
    sources = np.zeros(3 * item, dtype=np.uint8)
    try:
        with BootstrapServer(HOST, 0) as server, Engine(HOST, protocol="tcp") as ours:
            with SenderPool(ours, 1, 2, 1, server.address, host=HOST, fanout_timeout_s=20.0,
                            register_timeout_s=5.0) as pool:
                # The peer reads the rendezvous as SPEC 5 says: prefill rank 1 of tp 2 against E=2 -> fanout 1.
                sync = json.loads(exchange(server, "GET", SYNC)[1])
                assert sync == {"prefill_tp_size": 2, "prefill_dp_size": 1}
                route = json.loads(exchange(server, "GET", "/route?engine_rank=1&target_dp_group=0")[1])
                assert route == {"rank_ip": HOST, "rank_port": pool.port}
                requests = push(ctx, route["rank_port"])
                try:
                    session = peer.session_id.encode()
                    port = str(status_port).encode()
                    requests.send_multipart([b"None", HOST.encode(), port, session, ptr(peer.base), ptr(0)])

                    def ask(room: int, slot: int, hidden_part: bytes, has_ds: bytes, extra=()) -> None:
                        requests.send_multipart([
                            str(room).encode(), HOST.encode(), port, session, ptr(peer.base + slot * item), ptr(0),
                            b"5", hidden_part, b"torch.bfloat16", has_ds, b"1", b"0", b"5", *extra,
                        ])

                    ask(200, 0, b"8", b"0")
                    ask(201, 1, b"8", b"yes", [b"\xffextra part", b""])  # "yes" reads false; parts 13+ ignored
                    ask(202, 2, b"16", b"0")  # a hidden the item does not have: Failed, nothing written
                    sent = {}
                    for i, room in enumerate((200, 201, 202)):
                        sources[i * item : (i + 1) * item] = np.frombuffer(pattern(room, item), dtype=np.uint8)
                        sent[room] = pool.send(room, sources.ctypes.data + i * item, span=span, hidden=hidden,
                                               dtype=DTYPE)

                    got = {}
                    for _ in range(3):
                        frames = recv(status_sock, 10.0)
                        got[frames[0]] = frames
                    assert sorted(got) == [b"200", b"201", b"202"]
                    for room in (b"200", b"201"):
                        assert len(got[room]) >= 3 and got[room][:3] == [room, b"5", b"1"]
                        if len(got[room]) > 3:  # our checksum extension: that of the bytes written
                            want = layer_sum_by_hand(pattern(int(room), item))
                            assert got[room][3] == str(want).encode()
                    assert got[b"202"][:3] == [b"202", b"0", b"1"]
                    assert peer.read(0, item) == pattern(200, item)
                    assert peer.read(item, item) == pattern(201, item)
                    assert peer.read(2 * item, item) == bytes([SENTINEL_BYTE]) * item
                    assert [sent[r].wait(5.0) for r in (200, 201, 202)] == [
                        TransferPoll.Success, TransferPoll.Success, TransferPoll.Failed]
                    for handle in sent.values():
                        handle.clear()
                finally:
                    requests.close(0)
    finally:
        status_sock.close(0)
        peer.close()


@live
def test_prefill_bootstrap_failures_and_deadline_fail_only_their_room():
    """SPEC 7: no sizes, no route or a silent encode rank each fail the room with a reason, never raising."""
    import numpy as np

    from transfer.engine import Engine
    from transfer.receiver import SessionManager

    arena = np.full(4 * 64, SENTINEL_BYTE, dtype=np.uint8)
    ctx = zmq.Context.instance()
    silent, silent_port = pull(ctx)
    try:
        with BootstrapServer(HOST, 0) as empty, BootstrapServer(HOST, 0) as server, \
                Engine(HOST, protocol="tcp") as ours, \
                SessionManager(ours, 1, 2, 1, buffer=(arena.ctypes.data, arena.nbytes), host=HOST,
                               deadline_s=1.5) as manager:
            base = arena.ctypes.data
            # No encode rank registered: the sync call has null sizes.
            no_sizes = manager.receive(1, empty.address, base, 2, 16, DTYPE)
            assert wait_status(no_sizes) == TransferPoll.Failed and no_sizes.failure
            # E=2 registered only rank 0: prefill rank 1 of tp 2 pairs with encode rank 1, which has no route.
            assert exchange(server, "PUT", "/route", put_body(2, 1, HOST, silent_port, 0), JSON)[0] == 200
            no_route = manager.receive(2, server.address, base + 64, 2, 16, DTYPE)
            assert wait_status(no_route) == TransferPoll.Failed and no_route.failure
            # Rank 1 registered but never answers: the deadline fails the room naming encode rank 1.
            assert exchange(server, "PUT", "/route", put_body(2, 1, HOST, silent_port, 1), JSON)[0] == 200
            started = time.monotonic()
            silent_room = manager.receive(3, server.address, base + 128, 2, 16, DTYPE)
            assert wait_status(silent_room, 10.0) == TransferPoll.Failed
            assert time.monotonic() - started >= 1.0
            assert "encode rank 1" in silent_room.failure
            for handle in (no_sizes, no_route, silent_room):
                handle.clear()
    finally:
        silent.close(0)

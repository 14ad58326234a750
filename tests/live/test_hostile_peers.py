"""A hostile peer on every listener at once: mutated requests to a real encode rank's request socket, mutated
statuses to a real prefill session manager's status socket, and mutated HTTP requests to the real bootstrap
server, while a room is in flight between them. Every listener keeps serving, and the room in flight, and
the rooms asked between the bursts, land their bytes exactly.

Real Mooncake `tcp` on 127.0.0.1, real ZMQ, a real BootstrapServer; the encode rank runs in its own process.
The hostile inputs are mutations of valid frames and bodies (tests/unit/test_hostile_inputs.py has their
parsers' properties); a mutation that still parses into a request that may rightly touch a served room (its
number, its receiver's endpoint or session), or a registration the server would accept, is not sent: those
are not malformed, and a peer that may register may also lie.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import socket

import pytest
from live_helpers import (
    HOST,
    LIVE,
    TOKEN,
    Receiver,
    bootstrap_server,
    encode_process,
    junk_pusher,
    mutate_bytes,
    mutate_parts,
    wait_until,
)

from transfer import bootstrap as bs
from transfer.frames import (
    CancelAnswer,
    TransferInfo,
    WireError,
    cancel_frames,
    cancel_reply_frames,
    is_cancel,
    is_registration,
    parse_cancel,
    parse_cancel_reply,
    parse_registration,
    parse_status,
    registration_frames,
    status_frames,
)
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 8, 64
BURSTS = 4
ZMQ_PER_BURST = 400
HTTP_PER_BURST = 40
LIAR = "10.255.0.1"
_rooms = itertools.count(random.randrange(1 << 20, 1 << 40))

def requests(rng: random.Random, room: int) -> list[bytes]:
    """A valid request of a liar's (an ask, a registration or a cancel) for `room`."""
    session = f"{LIAR}:{rng.randrange(1, 65536)}"
    port = rng.randrange(1, 65536)
    return rng.choice([
        TransferInfo(room, LIAR, port, session, 0x1000, 0, 4, HIDDEN, "torch.bfloat16", False, 1, 0, SPAN).to_frames(),
        registration_frames(LIAR, port, session, 0x1000, 0, 4096, 0),
        cancel_frames(room, LIAR, port, session, True),
    ])


def statuses(rng: random.Random, room: int) -> list[bytes]:
    """A valid status or cancel answer for `room`."""
    return rng.choice([
        status_frames(room, rng.choice(list(TransferPoll)), 0, (rng.randrange(1 << 64),)),
        status_frames(room, TransferPoll.Failed, 0, (), ("send_failed", "from a liar")),
        cancel_reply_frames(room, 0, rng.choice(list(CancelAnswer))),
    ])


def touches_encode(frames: list[bytes], served: set[int], receiver: tuple[str, int, str]) -> bool:
    """Whether a request parses into one that may rightly touch a served room or the honest receiver."""
    try:
        if is_registration(frames):
            parsed = parse_registration(frames)
        elif is_cancel(frames):
            parsed = parse_cancel(frames)
        else:
            parsed = TransferInfo.from_frames(frames)
    except WireError:
        return False
    return (getattr(parsed, "room", None) in served or parsed.session_id == receiver[2]
            or (parsed.endpoint, parsed.port) == receiver[:2])


def touches_prefill(frames: list[bytes], served: set[int]) -> bool:
    """Whether a status parses into one that may rightly conclude a served room."""
    try:
        reply = parse_cancel_reply(frames)
        return (reply.room if reply is not None else parse_status(frames)[0]) in served
    except WireError as exc:
        return getattr(exc, "room", None) in served


def put_body(rank_port: int) -> bytes:
    return json.dumps({"role": "Prefill", "world_size": 1, "dp_size": 1, "rank_ip": HOST, "rank_port": rank_port,
                       "engine_rank": 0}).encode()


def http_request(rng: random.Random, rank_port: int) -> bytes:
    """A mutated HTTP request: a route look-up, or a PUT /route with the server's token and a mutated body
    the server would not accept."""
    if rng.random() < 0.4:
        line = f"GET /route?engine_rank={rng.choice(['0', '-1', '9' * 4000])}&target_dp_group=0 HTTP/1.1\r\n"
        return mutate_bytes(f"{line}Host: x\r\nConnection: close\r\n\r\n".encode(), rng)
    while True:
        body = mutate_bytes(put_body(rank_port), rng)
        try:
            bs._parse_registration(body)
        except bs._RequestError:
            break  # malformed: the server refuses it
    head = (f"PUT /route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    if rng.random() < 0.2:
        head = mutate_bytes(head, rng)
        if b"Bearer" in head and b"Content-Length" in head:
            head = head.replace(b"PUT", b"GET", 1)  # a mutated header could make a valid body's PUT count
    return head + body


def send_raw(address: str, request: bytes) -> bytes:
    """Sends one raw request on a connection of its own; what came back within a bounded wait."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return answer


def get(address: str, path: str) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10.0)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def bootstrap():
    with bootstrap_server() as server:
        yield server


@pytest.fixture(scope="module")
def engine():
    from transfer.engine import Engine

    with Engine(HOST, protocol="tcp") as e:
        yield e


@pytest.mark.parametrize("integrity", [True, False], ids=["integrity", "lanes"])
def test_garbage_on_every_listener_leaves_a_room_in_flight_and_the_rooms_between_to_land_their_bytes(bootstrap,
                                                                                                  engine, integrity):
    """With integrity off on the prefill side, the rooms' Successes are settled in lanes, between the garbage."""
    rng = random.Random(20261206)
    with encode_process(bootstrap.address) as encoder, \
            Receiver(engine, 0, 1, fanout=1, slots=BURSTS + 2, integrity=integrity) as r:
        encode_addr = (encoder.info["host"], encoder.info["port"])
        flight = next(_rooms)
        r.ask(flight, bootstrap.address, SPAN)
        assert wait_until(lambda: r.handle(flight).poll() == TransferPoll.WaitingForInput, 10.0)
        receiver = (HOST, r.manager.status_port, engine.session_id)
        encode_junk = junk_pusher(*encode_addr)
        status_junk = junk_pusher(HOST, r.manager.status_port)
        sent = {"encode": 0, "status": 0, "http": 0}
        answers: dict[int, int] = {}
        try:
            for _ in range(BURSTS):
                room = next(_rooms)
                served = {flight, room}
                for _ in range(ZMQ_PER_BURST):
                    frames = mutate_parts(requests(rng, rng.choice([room, flight, next(_rooms)])), rng)
                    if not touches_encode(frames, served, receiver):
                        encode_junk.send_multipart(frames)
                        sent["encode"] += 1
                    frames = mutate_parts(statuses(rng, rng.choice([room, flight, next(_rooms)])), rng)
                    if not touches_prefill(frames, served):
                        status_junk.send_multipart(frames)
                        sent["status"] += 1
                for _ in range(HTTP_PER_BURST):
                    answer = send_raw(bootstrap.address, http_request(rng, encode_addr[1]))
                    code = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.") else 0
                    answers[code] = answers.get(code, 0) + 1
                    sent["http"] += 1
                # Between the bursts: every listener still serves, and a room asked and sent now lands.
                assert get(bootstrap.address, "/health") == (200, b"OK")
                status, body = get(bootstrap.address, "/route?engine_rank=0&target_dp_group=0")
                assert status == 200 and json.loads(body) == {"rank_ip": encode_addr[0], "rank_port": encode_addr[1]}
                r.ask(room, bootstrap.address, SPAN)
                encoder.call("send", [room], SPAN, HIDDEN)
                assert r.wait([room], 20.0) == {room: ("Success", None)}
                assert r.landed(room) is None
                assert encoder.call("wait", [room], 10.0)[room][0] == "Success"
                assert r.handle(flight).poll() == TransferPoll.WaitingForInput  # untouched by any of it
        finally:
            encode_junk.close(0)
            status_junk.close(0)
        # The room asked before the first burst was parked at the encode rank through all of them (in its lane,
        # with integrity off: nothing of the garbage ended it).
        assert (flight in r.manager._driver.core.lanes) is not integrity
        encoder.call("send", [flight], SPAN, HIDDEN)
        assert r.wait([flight], 20.0) == {flight: ("Success", None)}
        assert r.landed(flight) is None
        assert encoder.call("wait", [flight], 10.0)[flight][0] == "Success"
        logs = "\n".join(encoder.call("logs"))
        assert "dropped a malformed request" in logs and "sender pool stopped" not in logs
    assert sent["encode"] > BURSTS * ZMQ_PER_BURST // 2 and sent["status"] > BURSTS * ZMQ_PER_BURST // 2, sent
    # Answered as HTTP/1.x, mostly 400 (a mutation that leaves no request line, or an HTTP/0.9 one, gets none).
    assert sent["http"] == BURSTS * HTTP_PER_BURST and answers.get(400, 0) > sent["http"] // 2, answers

"""The prefill side: the bootstrap server under bad input and slow clients, and
the session manager's announcements, stale asks and handles after a room is cleared.

Bootstrap tests talk raw HTTP over loopback sockets; the session manager tests use real
Mooncake (tcp on loopback), real ZMQ and the real bootstrap server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from live_helpers import wait_until

from transfer.bootstrap import BootstrapServer

HOST = "127.0.0.1"


# ------------------------------------------------------------------ bootstrap server


def _exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Sends `request` on a fresh connection; returns everything the server answers before closing."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(request)
        answer = b""
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return answer
            answer += chunk


def _status_line(answer: bytes) -> bytes:
    return answer.split(b"\r\n", 1)[0]


def test_a_non_ascii_digit_content_length_is_a_400_not_a_dropped_connection(server):
    # '\xb2' (superscript two) is a digit to str.isdigit() but not to int().
    answer = _exchange(server.port, b"PUT /route HTTP/1.0\r\nContent-Length: \xb2\r\n\r\nab")
    assert _status_line(answer).split()[1:2] == [b"400"], answer
    assert b"Content-Length" in answer


def test_a_content_length_too_long_for_int_is_a_400(server):
    answer = _exchange(server.port, b"PUT /route HTTP/1.0\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n")
    assert _status_line(answer).split()[1:2] in ([b"400"], [b"413"]), answer


def test_a_query_number_too_long_for_int_is_a_400(server):
    request = b"GET /route?engine_rank=" + b"9" * 5000 + b"&target_dp_group=0 HTTP/1.0\r\n\r\n"
    answer = _exchange(server.port, request)
    assert _status_line(answer).split()[1:2] == [b"400"], answer
    assert answer.endswith(b"engine_rank is not an integer")


def test_deeply_nested_json_is_a_400(server):
    body = b"[" * 50_000
    answer = _exchange(server.port, b"PUT /route HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert _status_line(answer).split()[1:2] == [b"400"], answer
    assert answer.endswith(b"body is not valid JSON")


def test_a_client_dripping_its_request_is_dropped_after_the_request_timeout(monkeypatch, server):
    """The handler's timeout bounds a whole request, not each read: a client sending a byte
    now and then must not hold a server thread for ever."""
    from transfer import bootstrap

    monkeypatch.setattr(bootstrap._Handler, "timeout", 0.6)
    request = b"GET /health HTTP/1.0\r\nX-Slow: " + b"a" * 1000
    with socket.create_connection((HOST, server.port), timeout=5) as sock:
        started = time.monotonic()
        closed_after = None
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # reset: the server gave up on us
                closed_after = time.monotonic() - started
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(4096) == b"":
                    closed_after = time.monotonic() - started
                    break
            except TimeoutError:
                pass
            if time.monotonic() - started > 4.0:
                break
    # A bound on each read (each byte comes within 0.2 s) would never close it: the whole request takes 200 s.
    assert closed_after is not None, "the server kept a dripping client for 4 s past a 0.6 s timeout"


def test_many_silent_connections_hold_a_bounded_number_of_server_threads(monkeypatch, server):
    """Each connection costs a handler thread: beyond the server's limit, more connections are
    turned away at once (503) instead of each getting a thread, and the server still serves."""
    monkeypatch.setattr(server._server, "max_handlers", 8, raising=False)
    monkeypatch.setattr(server._server, "max_per_client", 8, raising=False)  # every connection comes from HOST
    before = threading.active_count()
    silent = []
    try:
        for _ in range(40):
            silent.append(socket.create_connection((HOST, server.port), timeout=5))
        assert wait_until(lambda: threading.active_count() - before >= 8, 5.0)
        time.sleep(0.3)
        assert threading.active_count() - before <= 8, f"{threading.active_count() - before} handler threads"
        answer = _exchange(server.port, b"")  # turned away on accept, before it says anything
        assert _status_line(answer).split()[1:2] == [b"503"], answer
        assert answer.endswith(b"too many connections at once")
    finally:
        for sock in silent:
            sock.close()
    # Once the silent clients are gone their handlers end and the server answers again.
    assert wait_until(lambda: threading.active_count() - before <= 0, 15.0)
    assert _exchange(server.port, b"GET /health HTTP/1.0\r\n\r\n").endswith(b"\r\n\r\nOK")


def test_one_address_holding_its_share_of_connections_leaves_the_others_served(monkeypatch, server):
    """Past its share of the handlers, one address's next connection is turned away (503) while
    a client from another address is still served, and the first address is served again once
    its connections are gone."""
    monkeypatch.setattr(server._server, "max_handlers", 8, raising=False)
    monkeypatch.setattr(server._server, "max_per_client", 2, raising=False)
    silent = [socket.create_connection((HOST, server.port), timeout=5) for _ in range(2)]
    try:
        assert wait_until(lambda: server._server._per_client.get(HOST) == 2, 5.0)
        answer = _exchange(server.port, b"GET /health HTTP/1.0\r\n\r\n")
        assert _status_line(answer).split()[1:2] == [b"503"], answer
        assert answer.endswith(b"too many connections from this address at once")
        with socket.create_connection((HOST, server.port), timeout=5, source_address=("127.0.0.2", 0)) as other:
            other.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            got = b""
            while chunk := other.recv(4096):
                got += chunk
        assert got.startswith(b"HTTP/1.0 200") and got.endswith(b"\r\n\r\nOK"), got
    finally:
        for sock in silent:
            sock.close()
    assert wait_until(lambda: not server._server._per_client, 15.0)
    assert _exchange(server.port, b"GET /health HTTP/1.0\r\n\r\n").endswith(b"\r\n\r\nOK")


# ------------------------------------------------------------------ session manager (live)

BF16 = "torch.bfloat16"


@pytest.mark.live
def test_many_fallback_buffers_never_make_the_encode_rank_forget_the_pool_region(engines):
    """The encode rank remembers a bounded number of regions per session, newest first: a
    prefill rank that announced more fallback buffers since its pool region must announce
    the pool again, or every pooled room after that is refused."""
    import torch

    from transfer.buffers import ReceivePool
    from transfer.receiver import SessionManager
    from transfer.sender import MAX_REGIONS_PER_SESSION, SenderPool
    from transfer.status import TransferPoll

    encode_engine, prefill_engine = engines
    hidden, small, big = 64, 4, 8  # a small item fits the one slot, a big one needs a fallback
    count = MAX_REGIONS_PER_SESSION + 1
    source = torch.randn(count + 1, big, hidden).to(torch.bfloat16)
    slot = small * hidden * 2
    encode_engine.register(source)
    try:
        with BootstrapServer(HOST, 0) as server, \
                ReceivePool(prefill_engine, slot, slot, quarantine_s=0, grace_s=60) as slots, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=10) as manager:

            def round_trip(room: int, rows: int):
                sender.send(room, source[room, :rows])
                return manager.receive(room, server.address, rows=rows, hidden=hidden, dtype=BF16)

            first = round_trip(0, small)  # announces the pool region
            assert first.wait(10) == TransferPoll.Success, first.failure
            first.clear()
            # More fallback buffers alive at once than the encode rank remembers regions.
            fallbacks = [round_trip(room, big) for room in range(1, count)]
            assert [h.wait(10) for h in fallbacks] == [TransferPoll.Success] * len(fallbacks)
            assert slots.stats()["fallbacks_live"] == len(fallbacks)
            pooled = round_trip(count, small)
            assert pooled.wait(10) == TransferPoll.Success, pooled.failure
            assert torch.equal(pooled.rows.view(torch.uint8), source[count, :small].view(torch.uint8))
            for handle in fallbacks + [pooled]:
                handle.clear()
    finally:
        encode_engine.unregister(source.data_ptr())


def _encode_stand_in(port: int = 0, timeout: float = 5.0):
    """A raw PULL where an encode rank would listen: (socket, port); retries a port still closing."""
    import zmq

    from transfer import _io

    end = time.monotonic() + timeout
    while True:
        try:
            return _io.pull_socket(HOST, port)
        except zmq.ZMQError:
            if time.monotonic() >= end:
                raise
            time.sleep(0.05)


def _bootstrap_below_ephemeral() -> BootstrapServer:
    """A bootstrap server on a port below Linux's ephemeral range (32768-60999): once it
    closes, no connection of this busy process can take the port as its own local port,
    so a server restarted there binds it again."""
    import random

    for port in random.sample(range(20000, 32000), 200):
        try:
            return BootstrapServer(HOST, port)
        except OSError:
            continue
    raise RuntimeError("no free port in 20000-32000")


def _bootstrap_at(port: int, timeout: float = 5.0) -> BootstrapServer:
    """A bootstrap server on `port`, retrying while the previous one's sockets let go of it."""
    end = time.monotonic() + timeout
    while True:
        try:
            return BootstrapServer(HOST, port)
        except OSError:
            if time.monotonic() >= end:
                raise
            time.sleep(0.05)


def _messages(sock, timeout: float, count: int | None = None) -> list[list[bytes]]:
    """The messages that reach `sock` until `count` came or it stays quiet for `timeout` seconds."""
    got = []
    while (count is None or len(got) < count) and sock.poll(int(timeout * 1000)):
        got.append(sock.recv_multipart())
    return got


@contextlib.contextmanager
def _stand_in_session(prefill_engine, buf, **manager_kw):
    """A session manager whose one encode rank (tp 1) is a raw PULL behind a real bootstrap
    server: yields (manager, bootstrap address, the encode rank's socket and port, a PUSH
    to the manager's status port)."""
    from transfer import _io
    from transfer.bootstrap import BootstrapClient
    from transfer.receiver import SessionManager

    with BootstrapServer(HOST, 0) as server:
        encode, port = _encode_stand_in()
        BootstrapClient(server.address).register_rank(1, 1, HOST, port, 0)
        try:
            with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, **manager_kw) as manager:
                statuses = _io.push_socket(HOST, manager.status_port)
                try:
                    yield manager, server.address, encode, port, statuses
                finally:
                    statuses.close(0)
        finally:
            encode.close(0)


@pytest.mark.live
def test_an_ask_left_queued_for_a_dead_encode_rank_never_reaches_its_successor(engines):
    """ZMQ keeps what was queued for a dead peer and hands it to whoever listens at that
    address next: once a room expired, its TransferInfo must not reach an encode rank
    restarted there, which could write the item into memory reused by then."""
    import torch

    from transfer import _io
    from transfer.bootstrap import BootstrapClient
    from transfer.frames import TransferInfo, is_registration, status_frames
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server:
        first, port = _encode_stand_in()
        BootstrapClient(server.address).register_rank(1, 1, HOST, port, 0)
        with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=0.5) as manager:
            statuses = _io.push_socket(HOST, manager.status_port)
            try:
                served = manager.receive(1, server.address, buf[0])
                assert len(_messages(first, 2.0, 2)) == 2  # its registration and TransferInfo
                statuses.send_multipart(status_frames(1, TransferPoll.Success, 0))
                assert served.wait(5) == TransferPoll.Success
                served.clear()

                first.close(0)  # the encode rank dies
                time.sleep(0.3)  # and the manager's socket notices
                lost = manager.receive(2, server.address, buf[1])
                assert lost.wait(5) == TransferPoll.Failed and "no connection to encode rank 0" in lost.failure
                lost.clear()  # buf[1] is the caller's again

                second, _ = _encode_stand_in(port)  # restarted at the same address
                try:
                    stale = [TransferInfo.from_frames(m).room for m in _messages(second, 1.0) if not is_registration(m)]
                    assert 2 not in stale, "room 2's TransferInfo reached the restarted encode rank after it expired"
                    # The next room finds the new encode rank and is served.
                    fresh = manager.receive(3, server.address, buf[2])
                    got = _messages(second, 2.0, 2)
                    assert [is_registration(m) for m in got] == [True, False]
                    assert TransferInfo.from_frames(got[1]).room == 3
                    statuses.send_multipart(status_frames(3, TransferPoll.Success, 0))
                    assert fresh.wait(5) == TransferPoll.Success
                    fresh.clear()
                finally:
                    second.close(0)
            finally:
                statuses.close(0)


@pytest.mark.live
def test_an_encode_node_restarted_with_other_sizes_is_asked_with_the_new_fanout(engines):
    """The encode side's tp size is cached per bootstrap address; once a room expired there,
    the node may have come back with another size, and a stale fanout would park every room."""
    import torch
    from live_helpers import port_rebindable

    from transfer.bootstrap import BootstrapClient
    from transfer.frames import TransferInfo, is_cancel, is_registration
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    sink, port = _encode_stand_in()
    try:
        # prefill tp 2: one encode rank serves both prefill ranks (fanout 2) ...
        with SessionManager(prefill_engine, 0, 2, 1, buffer=buf, host=HOST, deadline_s=0.5) as manager:
            with _bootstrap_below_ephemeral() as first:
                address, bootstrap_port = first.address, first.port
                BootstrapClient(address).register_rank(1, 1, HOST, port, 0)
                lost = manager.receive(1, address, buf[0, :2], row_start=0, span=4)
                asks = [m for m in _messages(sink, 2.0, 2) if not is_registration(m) and not is_cancel(m)]
                assert [TransferInfo.from_frames(m).fanout for m in asks] == [2]
                assert lost.wait(5) == TransferPoll.Failed  # the node went away
                lost.clear()
            # ... and it comes back at the same address with two encode ranks (fanout 1).
            assert port_rebindable(HOST, bootstrap_port)
            with _bootstrap_at(bootstrap_port) as second:
                BootstrapClient(second.address).register_rank(2, 1, HOST, port, 0)
                fresh = manager.receive(2, address, buf[1, :4], row_start=0, span=4)
                # Room 1's cancel (it expired there), the registration, the ask.
                asks = [m for m in _messages(sink, 2.0, 3) if not is_registration(m) and not is_cancel(m)]
                assert [(TransferInfo.from_frames(m).room, TransferInfo.from_frames(m).fanout) for m in asks] == [(2, 1)]
                fresh.clear()
    finally:
        sink.close(0)


@pytest.mark.live
def test_a_cleared_handle_never_reports_the_room_that_reused_its_number(engines):
    """poll() says Failed once a room was cleared; the next room of that number (the router
    reuses them) is another room, whose status the old handle must not show."""
    import torch

    from transfer import wire
    from transfer.frames import TransferInfo, is_cancel, status_frames
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    with _stand_in_session(prefill_engine, buf, deadline_s=10) as (manager, bootstrap, encode, _, statuses):
        old = manager.receive(7, bootstrap, buf[0])
        assert len(_messages(encode, 2.0, 2)) == 2
        old.clear()  # given up before any status came: a cancel, which this stand-in never answers
        assert old.poll() == TransferPoll.Failed
        new = manager.receive(7, bootstrap, buf[1])
        cancel, ask = _messages(encode, 5.0, 2)  # the ask waited for an answer, then went
        assert is_cancel(cancel) and TransferInfo.from_frames(ask).room == 7
        # With the cancel unanswered, a Success may be the earlier ask's: the new room takes it once its
        # checksum matches what landed in its own memory.
        landed = wire.layer_sum(buf[1].data_ptr(), buf[1].nbytes)
        statuses.send_multipart(status_frames(7, TransferPoll.Success, 0, [landed]))
        assert new.wait(5) == TransferPoll.Success, new.failure
        assert old.poll() == TransferPoll.Failed, "the cleared handle reports the new room's Success"
        assert old.wait(0.01) == TransferPoll.Failed
        new.clear()


@pytest.mark.live
def test_a_failed_after_success_turns_the_room_failed_and_reports_it_again(engines):
    """SPEC.md section 3: Failed overrides any state. An encode rank tells every receiver Failed when
    one write of the room failed, those it told Success already included (section 6)."""
    import torch

    from transfer.frames import status_frames
    from transfer.metrics import total
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    with _stand_in_session(prefill_engine, buf, deadline_s=10) as (manager, bootstrap, encode, _, statuses):
        handle = manager.receive(9, bootstrap, buf[0])
        assert len(_messages(encode, 2.0, 2)) == 2  # its registration and its ask
        statuses.send_multipart(status_frames(9, TransferPoll.Success, 0))
        assert handle.wait(5) == TransferPoll.Success and manager.concluded() == [9]
        statuses.send_multipart(status_frames(9, TransferPoll.Failed, 0))
        deadline = time.monotonic() + 5
        while handle.poll() != TransferPoll.Failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.poll() == TransferPoll.Failed
        assert handle.failure.endswith("(after its Success)"), handle.failure
        assert handle.safe_to_reuse, "its write was over when it was told Success"
        assert manager.concluded() == [9], "reported again, as Failed"
        stats = manager.stats()
        assert total(stats, "epd_prefill_rooms_failed_after_success_total") == 1
        assert total(stats, "epd_prefill_rooms_succeeded_total") == 1
        assert total(stats, "epd_prefill_rooms_failed_total") == 0
        handle.clear()


_FLOODER = """
import sys, time, zmq
sock = zmq.Context.instance().socket(zmq.PUSH)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(f"tcp://127.0.0.1:{sys.argv[1]}")
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for _ in range(1000):
        sock.send(b"junk")
"""


@pytest.mark.live
def test_a_flood_of_statuses_does_not_hold_a_room_past_its_deadline(engines):
    """The I/O thread drains statuses, then looks at deadlines: a peer pushing faster than it
    drains must not keep it from ever reaching the deadlines."""
    import subprocess
    import sys

    import torch

    from transfer.bootstrap import BootstrapClient
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server:
        encode, port = _encode_stand_in()
        BootstrapClient(server.address).register_rank(1, 1, HOST, port, 0)
        try:
            with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=0.5) as manager:
                # The flood outlasts any wait here (it is killed at the end): a room held until it
                # stops would still be pending when the wait below gives up.
                flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, str(manager.status_port), "120"],
                                           stdout=subprocess.PIPE, text=True)
                try:
                    assert flooder.stdout.readline().strip() == "ready"
                    time.sleep(0.5)  # the flood is on
                    started = time.monotonic()
                    room = manager.receive(1, server.address, buf[0])
                    status = room.wait(20)
                    took = time.monotonic() - started
                    assert status == TransferPoll.Failed, f"still {status.name} {took:.1f}s into a 0.5s deadline"
                    assert "no status from encode rank 0" in room.failure, room.failure
                    assert flooder.poll() is None, "the flood ended before the room failed"
                    room.clear()
                finally:
                    flooder.kill()
                    flooder.wait(10)
        finally:
            encode.close(0)


@pytest.mark.live
def test_a_room_cleared_while_its_encode_rank_is_looked_up_is_never_asked_for(engines, monkeypatch):
    """The caller may give a room up (clear()) while the I/O thread still waits on the
    bootstrap server for its route: no TransferInfo may go out for it after that, since
    its memory is the caller's again."""
    import torch

    from transfer import bootstrap
    from transfer.bootstrap import BootstrapClient
    from transfer.frames import is_registration
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    looking_up = threading.Event()
    real_registration = bootstrap._RouteTable.registration

    def slow_registration(table, engine_rank, dp_group):
        looking_up.set()
        time.sleep(0.5)
        return real_registration(table, engine_rank, dp_group)

    monkeypatch.setattr(bootstrap._RouteTable, "registration", slow_registration)
    with BootstrapServer(HOST, 0) as server:
        encode, port = _encode_stand_in()
        BootstrapClient(server.address).register_rank(1, 1, HOST, port, 0)
        try:
            with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=10) as manager:
                given_up = manager.receive(1, server.address, buf[0])
                assert looking_up.wait(5)
                given_up.clear()
                assert given_up.poll() == TransferPoll.Failed
                sent = _messages(encode, 1.5)
                assert not [m for m in sent if not is_registration(m)], "a TransferInfo went out for a cleared room"
        finally:
            encode.close(0)


def _default(env: str) -> float:
    """The documented default of a setting (what applies when its EPD_* variable is unset)."""
    from transfer.config import setting

    return setting(env).default


@pytest.mark.live
def test_a_failed_rooms_slot_is_not_written_when_the_encode_rank_gets_its_parked_asks_item(engines):
    """An encode rank keeps an ask whose item has not come for its fanout timeout. The
    prefill rank's deadline failed the room and cancelled it there, so when the item comes
    (the deadline and quarantine scaled down 20 times, the fanout timeout 4 times, so that
    the item surely comes while the ask would still be kept) nothing is written into the
    slot the next room has."""
    import torch

    from transfer.buffers import ReceivePool
    from transfer.core.failure import FailureKind
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    scale = 1 / 20
    parking = _default("EPD_FANOUT_TIMEOUT_S") / 4
    deadline = _default("EPD_DEADLINE_S") * scale
    quarantine = _default("EPD_QUARANTINE_S") * scale
    encode_engine, prefill_engine = engines
    rows, hidden = 4, 64
    slot = rows * hidden * 2
    item = torch.randn(rows, hidden).to(torch.bfloat16)
    encode_engine.register(item)
    try:
        with BootstrapServer(HOST, 0) as server, \
                ReceivePool(prefill_engine, slot, slot, quarantine_s=quarantine, grace_s=0) as slots, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, fanout_timeout_s=parking) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=deadline) as manager:
            late = manager.receive(1, server.address, rows=rows, hidden=hidden, dtype=BF16)
            assert late.wait(deadline + 10) == TransferPoll.Failed and "no status" in late.failure
            late.clear()
            assert wait_until(lambda: sender._core.parked.get(1) is None, 10), "the cancel never reached the rank"
            following = manager.receive(2, server.address, rows=rows, hidden=hidden, dtype=BF16)
            following.rows.zero_()
            # ...room 1's item comes: the encode rank writes it to the ask it kept.
            written = sender.send(1, item)
            assert written.wait(5) == TransferPoll.Failed
            assert written.failure_kind is FailureKind.CANCELLED, written.failure
            written.clear()
            overwritten = torch.equal(following.rows.view(torch.uint8), item.view(torch.uint8))
            assert not overwritten, "room 1's late write landed in room 2's slot"
            assert bool((following.rows.view(torch.uint8) == 0).all())
            following.clear()
    finally:
        encode_engine.unregister(item.data_ptr())


def test_the_default_quarantine_outlasts_an_encode_ranks_parked_ask():
    assert _default("EPD_QUARANTINE_S") > _default("EPD_FANOUT_TIMEOUT_S")


class _DrippingServer:
    """A listener that answers every request correctly, one byte every `interval` seconds."""

    def __init__(self, answer: bytes, interval: float) -> None:
        self._answer, self._interval = answer, interval
        self._listener = socket.create_server((HOST, 0))
        self.address = f"{HOST}:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    request += chunk
                for byte in self._answer:
                    if self._stop.wait(self._interval):
                        return
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        break

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()


def test_a_bootstrap_server_dripping_its_answer_costs_the_client_one_timeout():
    """The client's timeout bounds the whole answer, not each read: the session manager's
    I/O thread, which makes these calls, must not wait on one server for ever."""
    from transfer.bootstrap import BootstrapClient, BootstrapUnreachable

    body = b'{"prefill_tp_size": 1, "prefill_dp_size": 1}'
    answer = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    # Padded so that the drip, each byte well inside the timeout, takes over 30 s in all.
    padding = b"X-Padding: " + b"p" * 300 + b"\r\n"
    answer = answer.replace(b"\r\n\r\n", b"\r\n" + padding + b"\r\n", 1)
    dripping = _DrippingServer(answer, 0.1)
    try:
        client = BootstrapClient(dripping.address, timeout=1.0)
        # Timed out: a bound on each read (each byte comes 0.1 s after the last) would have read the whole
        # answer, 30 s later, and returned it.
        with pytest.raises(BootstrapUnreachable, match="parallel info: timed out"):
            client.parallel_info()
    finally:
        dripping.close()


def test_a_bootstrap_answer_that_comes_in_time_is_read_whole(server):
    """The deadline reader keeps the socket open until the whole answer was read."""
    from transfer.bootstrap import BootstrapClient

    client = BootstrapClient(server.address, timeout=2.0)
    client.register_rank(2, 1, HOST, 4242, 1)
    assert client.parallel_info() == (2, 1)
    assert client.route(1, 0) == (HOST, 4242)
    assert client.health()


@pytest.mark.live
@pytest.mark.parametrize("integrity", [True, False])
def test_a_success_with_an_unreadable_checksum_part_concludes_at_once(engines, integrity):
    """Status part 3 is our checksum (SPEC.md 8). One that does not parse does not drop the
    whole status, which would leave the room to wait out its deadline as if the encode rank
    were silent. With integrity on the room fails at once, saying why; with it off the
    checksum is not read and the Success stands."""
    import torch

    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    with _stand_in_session(prefill_engine, buf, deadline_s=30, integrity=integrity) as (
            manager, bootstrap, encode, port, statuses):
        room = manager.receive(1, bootstrap, buf[0])
        assert len(_messages(encode, 2.0, 2)) == 2
        statuses.send_multipart([b"1", b"5", b"0", b"not-a-sum"])
        status = room.wait(5)
        if integrity:
            assert status == TransferPoll.Failed
            assert "checksum part that does not parse (checksum is not an integer)" in room.failure
            assert f"encode rank 0 at {HOST}:{port}" in room.failure
        else:
            assert status == TransferPoll.Success, room.failure
        room.clear()


@pytest.mark.live
def test_close_gives_back_the_slots_of_rooms_still_in_flight(engines):
    """A pool outliving its session manager keeps working: close() gives back the slots its rooms
    still lease (never cleared) as clear() would: a room no encode rank was asked for frees its slot
    at once, one asked waits out the quarantine."""
    import gc
    import warnings

    from transfer.buffers import ReceivePool
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool

    encode_engine, prefill_engine = engines
    rows, hidden = 4, 64
    slot = rows * hidden * 2
    nobody = socket.socket()
    nobody.bind((HOST, 0))  # bound, never listening: look-ups there are refused
    try:
        with BootstrapServer(HOST, 0) as server, \
                ReceivePool(prefill_engine, 4 * slot, slot, quarantine_s=0.5, max_fallback_bytes=0) as slots, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, fanout_timeout_s=60) as sender:
            manager = SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=60)
            with manager:
                asked = [manager.receive(room, server.address, rows=rows, hidden=hidden, dtype=BF16)
                         for room in (1, 2)]
                unasked = [manager.receive(room, f"{HOST}:{nobody.getsockname()[1]}", rows=rows, hidden=hidden,
                                           dtype=BF16) for room in (3, 4)]
                assert wait_until(lambda: sorted(sender._core.parked) == [1, 2], 10), "the asks never came"
                assert slots.stats()["leased"] == 4
            stats = slots.stats()
            assert (stats["leased"], stats["quarantined"], stats["free"]) == (0, 2, 2), stats
            asked[0].clear()  # a handle cleared after close gives back nothing twice
            assert slots.stats()["leased"] == 0
            assert wait_until(lambda: slots.poll() or slots.stats()["free"] == 4, 10), slots.stats()
            with SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST) as again:
                fresh = [again.receive(room, server.address, rows=rows, hidden=hidden, dtype=BF16)
                         for room in (5, 6, 7, 8)]
                for handle in fresh:
                    handle.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                del asked, unasked  # their manager closed: nothing is kept for them
                gc.collect()
            assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught
    finally:
        nobody.close()


@pytest.mark.live
def test_close_cancels_the_rooms_it_still_holds_at_their_encode_rank(engines):
    """close() gives up its rooms as clear() does: their encode rank drops the asks it parked (it
    would keep them for its fanout timeout) and, when the items come, writes nothing into the
    slots, which outlive the manager in the pool."""
    import torch

    from transfer.buffers import ReceivePool
    from transfer.core.failure import FailureKind
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    encode_engine, prefill_engine = engines
    rows, hidden = 4, 64
    slot = rows * hidden * 2
    with BootstrapServer(HOST, 0) as server, ReceivePool(prefill_engine, 2 * slot, slot) as slots, \
            SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, fanout_timeout_s=60) as sender:
        with SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=60) as manager:
            handles = [manager.receive(room, server.address, rows=rows, hidden=hidden, dtype=BF16)
                       for room in (1, 2)]
            for handle in handles:
                handle.rows.zero_()
            assert wait_until(lambda: sorted(sender._core.parked) == [1, 2], 10), "the asks never came"
        assert wait_until(lambda: len(sender._core.parked) == 0, 10), "close() cancelled no parked ask"
        for room, handle in zip((1, 2), handles):
            sent = sender.send(room, torch.randn(rows, hidden).to(torch.bfloat16))
            assert sent.wait(10) == TransferPoll.Failed
            assert sent.failure_kind is FailureKind.CANCELLED, sent.failure
            sent.clear()
            assert bool((handle.rows.view(torch.uint8) == 0).all()), f"room {room} was written after close()"

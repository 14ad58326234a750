"""The `wire` data path: WireEngine writes between real listeners on loopback, and live runs over it."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import struct
import sys
import textwrap
from collections.abc import Callable
import threading
import time

import pytest
import torch

from transfer import wire
from transfer.engine import TransferError
from transfer.harness import Scenario, run
from transfer.wire_engine import WireEngine


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    """n reproducible random bytes as a uint8 tensor."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)


def _tasks() -> int:
    """Threads of this process, native ones included."""
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def pair():
    """(writer, reader): two engines on ephemeral ports."""
    with WireEngine("127.0.0.1") as writer, WireEngine("127.0.0.1") as reader:
        yield writer, reader


def _src_dst(writer: WireEngine, reader: WireEngine, n: int, seed: int = 1):
    """A registered random source on the writer and a zeroed registered destination on the reader."""
    src = _random_bytes(n, seed)
    dst = torch.zeros(n, dtype=torch.uint8)
    writer.register(src)
    reader.register(dst)
    return src, dst


def test_session_id_names_the_listener(pair):
    writer, reader = pair
    assert writer.protocol == "wire"
    assert reader.session_id == f"127.0.0.1:{reader.port}" and reader.port > 0
    assert writer.port != reader.port
    with socket.create_connection(("127.0.0.1", reader.port), timeout=5):
        pass


def test_several_buffers_offsets_and_zero_lengths_land_exactly(pair):
    writer, reader = pair
    src, dst = _src_dst(writer, reader, 1 << 16)
    s, d = src.data_ptr(), dst.data_ptr()
    # Layer 0 at an odd offset, an empty entry, layer 1 elsewhere with a short (non-word) tail.
    writer.write(reader.session_id, [s + 3, s + 100, s + 5000], [d + 17, d + 9, d + 40000], [4001, 0, 999])
    want = torch.zeros(1 << 16, dtype=torch.uint8)
    want[17:17 + 4001] = src[3:3 + 4001]
    want[40000:40000 + 999] = src[5000:5000 + 999]
    assert torch.equal(dst, want)
    stats = reader.stats()
    assert stats["transfers_received"] == 1 and stats["bytes_received"] == 4001 + 999
    # A batch of only empty entries sends nothing and opens no connection.
    writer.write(reader.session_id, [s], [d], [0])
    assert writer.stats()["connections_opened"] == 1


def test_rows_are_announced_and_checked(pair):
    writer, reader = pair
    src, dst = _src_dst(writer, reader, 4096)
    writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [1024], rows=8)
    assert torch.equal(dst[:1024], src[:1024]) and not dst[1024:].any()
    with pytest.raises(ValueError, match="not multiples of rows 3"):
        writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [1024], rows=3)
    with pytest.raises(ValueError, match=r"rows 4294967296 is outside the PREFILL's 1\.\.4294967295"):
        writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [1024], rows=2**32)
    assert writer.stats()["connections_opened"] == 1  # refused before a connection was taken


def test_64_mib_item_streams_in_bounded_frames(pair):
    writer, reader = pair
    n = 64 << 20  # more than one frame can carry: only chunking gets it across
    assert n + wire.LAYER_HEADER > wire.MAX_PAYLOAD
    src, dst = _src_dst(writer, reader, n, seed=7)
    writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [n])
    assert torch.equal(src, dst)
    assert reader.stats()["bytes_received"] == n
    assert writer.stats()["bytes_sent"] == n


def test_connection_is_reused_across_writes(pair):
    writer, reader = pair
    src, dst = _src_dst(writer, reader, 8192)
    for i in range(6):
        writer.write(reader.session_id, [src.data_ptr() + i], [dst.data_ptr() + 1000 * i], [500])
    for i in range(6):
        assert torch.equal(dst[1000 * i:1000 * i + 500], src[i:i + 500])
    assert reader.stats()["accepted"] == 1
    assert reader.stats()["transfers_received"] == 6
    assert writer.stats()["connections_opened"] == 1


def test_reconnects_after_the_listener_restarted():
    with WireEngine("127.0.0.1") as writer:
        src = _random_bytes(4096, 3)
        writer.register(src)
        dst = torch.zeros(4096, dtype=torch.uint8)
        first = WireEngine("127.0.0.1")
        port = first.port
        first.register(dst)
        writer.write(first.session_id, [src.data_ptr()], [dst.data_ptr()], [1000])
        first.close()
        dst.zero_()
        with WireEngine("127.0.0.1", port=port) as second:
            second.register(dst)
            writer.write(second.session_id, [src.data_ptr() + 1000], [dst.data_ptr()], [2000])
            assert torch.equal(dst[:2000], src[1000:3000]) and not dst[2000:].any()
            assert second.stats()["accepted"] == 1
        assert writer.stats()["connections_opened"] == 2
        # Nobody listens any more: the write fails naming the session.
        with pytest.raises(TransferError, match=re.escape(f"write to 127.0.0.1:{port} failed")):
            writer.write(f"127.0.0.1:{port}", [src.data_ptr()], [dst.data_ptr()], [10])


@pytest.mark.parametrize("nbytes", [3000, 300_000], ids=["one chunk", "several chunks"])
def test_a_pooled_connection_evicted_after_its_check_is_sent_again_on_a_fresh_one(monkeypatch, nbytes):
    """The reader, with one connection slot, evicts the writer's idle pooled connection for a
    newcomer. The pool's check before reuse is taken away, as when the eviction lands just after
    it: the transfer fails on the closed connection, is sent again on a fresh one, and lands."""
    with WireEngine("127.0.0.1", chunk_bytes=65536) as writer, \
            WireEngine("127.0.0.1", max_connections=1, evict_after_s=0.05) as reader:
        src, dst = _src_dst(writer, reader, nbytes, seed=5)
        writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [100])
        time.sleep(0.2)  # the pooled connection is now past evict_after
        with socket.create_connection(("127.0.0.1", reader.port), timeout=5) as newcomer:
            deadline = time.monotonic() + 10
            while reader.stats()["evicted"] < 1:
                assert time.monotonic() < deadline, reader.stats()
                time.sleep(0.01)
        while reader.stats()["active"]:  # the newcomer's slot is free again for the fresh connection
            assert time.monotonic() < deadline, reader.stats()
            time.sleep(0.01)
        monkeypatch.setattr("transfer.wire_engine._Conn.stale", lambda self: False)
        dst.zero_()
        writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [nbytes])
        assert torch.equal(dst, src)
        assert writer.stats()["retries"] == 1 and writer.stats()["connections_opened"] == 2


def _serve_one_transfer(conn: socket.socket) -> None:
    """Plays a listener for one transfer on conn: reads it through FIRST and answers RESULT."""
    _, prefill, _ = wire.read_frame(conn)
    msg = wire.Msg.decode(prefill)
    while wire.read_frame(conn)[0] != wire.FIRST:
        pass
    answer = wire.Msg({"bytes": msg.number("bytes0"), "room": msg.number("room")}).encode()
    conn.sendall(struct.pack("<IB", 1 + len(answer), wire.RESULT) + answer)


def test_a_transfer_sent_again_connects_within_what_is_left_of_the_reply_timeout():
    """A peer that resets a pooled connection after reading a whole transfer, and whose accept queue is
    full (it stopped accepting): the transfer is sent again on a fresh connection, whose connect never
    completes. The connect gets only what the first send left of the reply timeout, not all of
    connect_timeout_s, and the error says both what failed first and why the send again did not go."""
    server = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = server.getsockname()[1]
    queued: list[socket.socket] = []
    failures: list[BaseException] = []

    def peer() -> None:
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(30)
                _serve_one_transfer(conn)
                _, _, _ = wire.read_frame(conn)  # the second transfer, read whole and never answered
                while wire.read_frame(conn)[0] != wire.FIRST:
                    pass
                # One connection nobody accepts fills the queue of a backlog-0 listener: the next SYN is dropped.
                queued.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    try:
        with WireEngine("127.0.0.1", reply_timeout_s=3.0, connect_timeout_s=30.0) as writer:
            src = _random_bytes(1000, 9)
            writer.register(src)
            session = f"127.0.0.1:{port}"
            writer.write(session, [src.data_ptr()], [0x10000], [1000])
            with pytest.raises(TransferError) as failed:
                writer.write(session, [src.data_ptr()], [0x10000], [1000])
            thread.join(30)
            assert not failures, failures
            said = str(failed.value)
            assert said.startswith(f"write to {session} failed: read: "), said
            assert re.search(r"; sent again on a fresh connection, which did not connect within the [0-9.]+ s left "
                             r"of reply_timeout_s=3 \(1 buffer\(s\), 1000 bytes", said), said
            assert writer.stats()["connections_opened"] == 1 and writer.stats()["retries"] == 0  # the connect failed
    finally:
        server.close()
        for sock in queued:
            sock.close()


def test_four_threads_to_two_peers():
    n, per = 1 << 20, 1 << 18
    with WireEngine() as writer, WireEngine() as peer_a, WireEngine() as peer_b:
        src = _random_bytes(n, 11)
        writer.register(src)
        dsts = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
        peer_a.register(dsts[0])
        peer_b.register(dsts[1])
        peers = [peer_a, peer_b]
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                peer, dst = peers[t % 2], dsts[t % 2]
                for k in range(8):  # thread t owns quarter t of each destination
                    off = t * per + (k * 4096) % per
                    writer.write(peer.session_id, [src.data_ptr() + off], [dst.data_ptr() + off], [4096 * (k + 1)])
                writer.write(peer.session_id, [src.data_ptr() + t * per], [dst.data_ptr() + t * per], [per])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        for t in range(4):
            span = slice(t * per, (t + 1) * per)
            assert torch.equal(dsts[t % 2][span], src[span]), f"thread {t}'s quarter"
        for t in range(4):  # quarters no thread wrote to stay zero
            if t % 2 == 0:
                assert not dsts[1][t * per:(t + 1) * per].any()
            else:
                assert not dsts[0][t * per:(t + 1) * per].any()
        assert peer_a.stats()["transfers_received"] == peer_b.stats()["transfers_received"] == 18
        # Concurrent writes to one peer take separate pooled connections, no more than the writers.
        assert 1 <= peer_a.stats()["accepted"] <= 2


def test_unregister_then_write_names_the_range(pair):
    writer, reader = pair
    src, dst = _src_dst(writer, reader, 4096)
    writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [4096])
    dst.zero_()
    reader.unregister(dst.data_ptr())
    assert reader.registered() == {}
    start, end = dst.data_ptr() + 64, dst.data_ptr() + 64 + 128
    with pytest.raises(TransferError) as caught:
        writer.write(reader.session_id, [src.data_ptr()], [start], [128])
    text = str(caught.value)
    assert f"write to {reader.session_id} refused by the peer" in text
    assert f"destination [{start:#x}, {end:#x}) (128 bytes) is not inside registered memory" in text
    assert not dst.any()
    # The refused connection was dropped; the next write reconnects and works once registered.
    reader.register(dst)
    writer.write(reader.session_id, [src.data_ptr()], [start], [128])
    assert torch.equal(dst[64:192], src[:128])
    assert writer.stats()["connections_opened"] == 2


@pytest.mark.parametrize("answer", [
    b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n",  # a first frame header too long to read
    struct.pack("<IB", 1, wire.PREFILL),  # a frame, but no answer
], ids=["http server", "wrong frame kind"])
def test_a_peer_that_is_no_wire_listener_is_named_as_the_likely_cause(answer):
    """The write fails at once and says what to check, whether the first bytes back are another
    protocol's (read as a length past the answer limit) or a frame of the wrong kind."""
    def answer_once(conn: socket.socket) -> None:
        conn.recv(1 << 16)
        conn.sendall(answer)

    with _writer_against(answer_once) as (writer, session, src):
        with pytest.raises(TransferError, match=rf"write to {session} failed: .*the peer does not answer as a "
                                                r"wire listener: is it a Mooncake engine or another server\?"):
            writer.write(session, [src.data_ptr()], [0x1000], [4096])


@contextlib.contextmanager
def _writer_against(serve: Callable[[socket.socket], None]):
    """A WireEngine with 4 KiB of ones registered, and the session of a fake peer that serves its
    first connection with `serve` (then keeps it open while the writer reads)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve_once() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            serve(conn)
            time.sleep(0.5)  # keep the connection open while the sender reads

    thread = threading.Thread(target=serve_once, daemon=True)
    thread.start()
    with server, WireEngine("127.0.0.1") as writer:
        src = torch.ones(4096, dtype=torch.uint8)
        writer.register(src)
        yield writer, f"127.0.0.1:{server.getsockname()[1]}", src
    thread.join(5)


def test_a_result_whose_numbers_run_past_ints_digit_limit_fails_the_write_as_an_engine_error():
    """A RESULT naming the room with 5000 leading zeros is the right answer; one whose byte count
    has 5000 digits is a peer's malformed answer, an EngineError saying so (not int()'s ValueError)."""
    zeros = b"0" * 5000

    def answer(conn: socket.socket, count: bytes) -> None:
        kind, payload, _ = wire.read_frame(conn)
        room = wire.Msg.decode(payload).number("room")
        while kind != wire.FIRST:
            kind, _, _ = wire.read_frame(conn)
        wire.write_frame(conn, wire.RESULT, wire.Msg({"bytes": count.decode(), "room": f"{zeros.decode()}{room}"})
                         .encode())

    def serve(conn: socket.socket) -> None:
        answer(conn, zeros + b"4096")
        answer(conn, b"9" * 5000)

    with _writer_against(serve) as (writer, session, src):
        writer.write(session, [src.data_ptr()], [0x1000], [4096])
        with pytest.raises(TransferError, match=rf"write to {session} failed: the peer's RESULT for room \d+: "
                                                r"bytes: not a number"):
            writer.write(session, [src.data_ptr()], [0x1000], [4096])
        assert writer.stats()["write_failures"] == 1


def test_a_peer_nobody_listens_for_fails_as_a_connect_naming_the_address():
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: the connect is refused
    with WireEngine("127.0.0.1", connect_timeout_s=2.0) as writer:
        src = torch.ones(4096, dtype=torch.uint8)
        writer.register(src)
        with pytest.raises(TransferError, match=rf"write to 127.0.0.1:{port} failed: .*connect to 127.0.0.1:{port}: "
                                                r".*\(connect_timeout_s=2\)"):
            writer.write(f"127.0.0.1:{port}", [src.data_ptr()], [0x1000], [4096])


def test_a_peer_that_closes_mid_transfer_is_named_as_the_likely_cause():
    server = socket.create_server(("127.0.0.1", 0))

    def read_some_then_close() -> None:
        conn, _ = server.accept()
        conn.recv(1024)
        conn.close()  # with unread bytes queued: a reset

    thread = threading.Thread(target=read_some_then_close, daemon=True)
    thread.start()
    with server, WireEngine("127.0.0.1") as writer:
        src = torch.ones(8 << 20, dtype=torch.uint8)
        writer.register(src)
        session = f"127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(TransferError, match=r"the peer closed the connection mid-transfer: did its receiver "
                                                r"stop or close\?$"):
            writer.write(session, [src.data_ptr()], [0x1000], [8 << 20])
    thread.join(5)


def test_unregister_waits_while_writes_stream():
    """Regions come and go while a writer streams into another region of the same listener."""
    n = 16 << 20
    with WireEngine() as writer, WireEngine() as reader:
        src = _random_bytes(n, 5)
        writer.register(src)
        dst = torch.zeros(n, dtype=torch.uint8)
        other = torch.zeros(1 << 20, dtype=torch.uint8)
        reader.register(dst)
        stop = threading.Event()
        errors: list[BaseException] = []

        def churn() -> None:
            try:
                while not stop.is_set():
                    reader.register(other)
                    reader.unregister(other.data_ptr())
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        churner = threading.Thread(target=churn)
        churner.start()
        try:
            for _ in range(3):
                writer.write(reader.session_id, [src.data_ptr()], [dst.data_ptr()], [n])
        finally:
            stop.set()
            churner.join(30)
        assert not errors and torch.equal(dst, src)


def test_bad_arguments_and_host_only_memory(pair):
    writer, reader = pair
    src, dst = _src_dst(writer, reader, 1024)
    with pytest.raises(TransferError, match="host-only: cannot register a tensor on meta"):
        writer.register(torch.empty(16, device="meta"))
    with pytest.raises(TransferError, match="already registered"):
        writer.register(src)
    with pytest.raises(TransferError, match="overlaps the registered region"):
        writer.register(src.data_ptr() + 8, 64)
    with pytest.raises(ValueError, match="2 sources, 1 destinations"):
        writer.write(reader.session_id, [1, 2], [3], [4])
    with pytest.raises(TransferError, match="source 0x10 length 4 is not inside memory registered"):
        writer.write(reader.session_id, [16], [dst.data_ptr()], [4])
    with pytest.raises(TransferError, match="is not host:port"):
        writer.write("nowhere", [src.data_ptr()], [dst.data_ptr()], [4])
    # getaddrinfo would take the port modulo 65536: 70000 would reach whatever listens on 4464.
    for bad in ("127.0.0.1:70000", "127.0.0.1:0", "127.0.0.1:\u0661\u0662"):
        with pytest.raises(TransferError, match=r"outside 1\.\.65535|is not host:port"):
            writer.write(bad, [src.data_ptr()], [dst.data_ptr()], [4])
    with pytest.raises(TransferError, match="is not registered"):
        reader.unregister(12345)
    # A destination outside the address space is refused here, before a connection: no round trip.
    opened = writer.stats()["connections_opened"]
    for bad in (-4096, (1 << 64) - 2):
        with pytest.raises(ValueError, match=f"destination {bad:#x} length 4 is not a range of the 64-bit"):
            writer.write_async(reader.session_id, [src.data_ptr()], [bad], [4])
    assert writer.stats()["connections_opened"] == opened and reader.stats()["transfers_refused"] == 0


def test_close_joins_threads_and_frees_the_port():
    buf = torch.zeros(4096, dtype=torch.uint8)
    src = _random_bytes(4096, 2)  # torch starts its own threads first, before the count
    before = _tasks()
    engine = WireEngine("127.0.0.1")
    writer = WireEngine("127.0.0.1")
    engine.register(buf)
    writer.register(src)
    writer.write(engine.session_id, [src.data_ptr()], [buf.data_ptr()], [4096])
    port = engine.port
    assert _tasks() >= before + 3  # two accept threads and one connection thread
    writer.close()
    engine.close()
    engine.close()  # idempotent
    deadline = time.monotonic() + 5
    while _tasks() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _tasks() == before
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with WireEngine("127.0.0.1", port=port) as again:
        assert again.port == port
    with pytest.raises(TransferError, match=r"is closed: its close\(\) ran; start a new engine \(and new pools and "
                                            r"managers on it\) to register or write more$"):
        engine.register(buf)


def _check(summary: dict, items: int) -> None:
    """A live run delivered every item and every byte checked out."""
    assert summary["protocol"] == "wire"
    assert summary["failed"] == 0, summary["failures"]
    assert summary["verified"] is True, summary["mismatches"]
    assert summary["items"] == items and summary["bytes"] > 0


def test_live_run_sharded():
    sc = Scenario(protocol="wire", encode_ranks=1, prefill_ranks=4, items=16, span=64, hidden=256, timeout_s=240)
    _check(run(sc), 16)


def test_live_run_with_deepstack():
    sc = Scenario(protocol="wire", encode_ranks=1, prefill_ranks=4, items=16, span=64, hidden=256, deepstack=2,
                  timeout_s=240)
    _check(run(sc), 16)


def test_live_run_identity_two_encode_ranks():
    sc = Scenario(protocol="wire", encode_ranks=2, prefill_ranks=4, items=12, span=64, hidden=256, sharded=False,
                  timeout_s=240)
    _check(run(sc), 12)


def test_demo_runs_where_mooncake_cannot_be_imported(tmp_path):
    # sitecustomize runs in the demo and in every rank process it spawns.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['mooncake'] = None\n")
    code = textwrap.dedent("""
        import sys
        try:
            import mooncake.engine
        except ImportError:
            pass
        else:
            raise SystemExit("mooncake is importable: the test proves nothing")
        from transfer.cli import main
        sys.exit(main(['demo', '--protocol', 'wire', '--items', '8', '--span', '64', '--hidden', '256']))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "over wire" in proc.stdout and "verified  yes" in proc.stdout, proc.stdout


def test_write_async_overlaps_peers_and_reports_failures():
    n = 1 << 20
    with WireEngine() as writer, WireEngine() as peer_a, WireEngine() as peer_b:
        src = _random_bytes(n, 21)
        writer.register(src)
        dst_a, dst_b = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
        peer_a.register(dst_a)
        peer_b.register(dst_b)
        batches = [writer.write_async(peer.session_id, [src.data_ptr()], [dst.data_ptr()], [n])
                   for peer, dst in ((peer_a, dst_a), (peer_b, dst_b))]
        assert 0 not in batches
        for batch in batches:
            writer.wait(batch, timeout_s=30)
        assert torch.equal(dst_a, src) and torch.equal(dst_b, src)
        assert writer.write_async(peer_a.session_id, [src.data_ptr()], [dst_a.data_ptr()], [0]) == 0
        writer.wait(0)
        bad = writer.write_async(peer_a.session_id, [src.data_ptr()], [dst_a.data_ptr() + n - 8], [16])
        with pytest.raises(TransferError, match="is not inside registered memory"):
            writer.wait(bad, timeout_s=30)
        with pytest.raises(TransferError, match=f"batch {bad} is unknown"):
            writer.wait(bad)


@pytest.mark.parametrize("pooled", [False, True])
def test_a_managers_default_quarantine_covers_its_wire_listeners_slowest_transfer(pooled, monkeypatch):
    """A failed room's memory is held back until a late write of it, started as late as a peer may start
    one, is over at the listener's least rate: longer than Mooncake's transfer timeout allows for."""
    from transfer.buffers import LATE_START_S, QUARANTINE_S, ReceivePool
    from transfer.receiver import SessionManager

    monkeypatch.delenv("EPD_QUARANTINE_S", raising=False)
    item = 64 << 20
    with WireEngine("127.0.0.1") as engine:
        pool = ReceivePool(engine, 1 << 20, 1 << 20) if pooled else None
        with SessionManager(engine, 0, 1, 1, pool=pool, buffer=None if pooled else torch.zeros(1 << 20),
                            host="127.0.0.1") as manager:
            assert manager.quarantine_of(item) == LATE_START_S + engine.late_write_s(item)
            assert manager.quarantine_of(item) > QUARANTINE_S + 256  # 64 MiB at 256 KiB/s
        if pool is not None:
            pool.close()


class _HangUpThenStall:
    """A hand-rolled peer listener: answers the first transfer, takes the second on the same connection
    and hangs up `hang_up_after` s later without an answer (the writer sends it again), and never
    answers the transfer a fresh connection brings."""

    def __init__(self, hang_up_after: float) -> None:
        self.hang_up_after = hang_up_after
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.connections: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @staticmethod
    def _read_transfer(conn: socket.socket) -> wire.Msg:
        kind, payload, _ = wire.read_frame(conn)
        assert kind == wire.PREFILL, kind
        while wire.read_frame(conn)[0] != wire.FIRST:
            pass
        return wire.Msg.decode(payload)

    def _serve(self) -> None:
        try:
            first, _ = self.server.accept()
            self.connections.append(first)
            prefill = self._read_transfer(first)
            wire.write_frame(first, wire.RESULT, wire.Msg({"room": prefill.number("room"),
                                                           "bytes": prefill.number("bytes0")}).encode())
            self._read_transfer(first)
            self._stop.wait(self.hang_up_after)
            first.close()
            fresh, _ = self.server.accept()
            self.connections.append(fresh)
            self._read_transfer(fresh)
            self._stop.wait(60)  # no answer
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self.server.close()
        for conn in self.connections:
            conn.close()
        self._thread.join(10)


def test_a_transfer_sent_again_keeps_the_one_transfers_reply_bound():
    """The peer took the transfer on a reused connection and hung up 3 s later without an answer: the
    transfer goes again on a fresh connection, which the peer never answers. Both sends together wait
    the 4 s reply timeout (and the bytes' time at the least rate), not 3 s more than it."""
    peer = _HangUpThenStall(hang_up_after=3.0)
    try:
        with WireEngine("127.0.0.1", reply_timeout_s=4.0) as writer:
            src = _random_bytes(4096, 3)
            writer.register(src)
            session = f"127.0.0.1:{peer.port}"
            writer.write(session, [src.data_ptr()], [0x10000], [4096])
            started = time.monotonic()
            with pytest.raises(TransferError) as caught:
                writer.write(session, [src.data_ptr()], [0x10000], [4096])
            took = time.monotonic() - started
            assert writer.stats()["retries"] == 1 and writer.stats()["connections_opened"] == 2
    finally:
        peer.close()
    assert took >= 3.0, took  # the peer's hang-up came 3 s in
    # The send again waited what was left of the 4 s (1 s at most, as the hang-up took 3), not 4 s anew.
    left = re.search(r"read: timed out after ([\d.]+) s without progress", str(caught.value))
    assert left and float(left.group(1)) <= 1.0, str(caught.value)


def test_a_peer_host_name_the_resolver_never_answers_fails_the_write_at_the_connect_timeout(monkeypatch):
    """getaddrinfo() takes no timeout: a session id's host name whose resolver does not answer fails the
    write at connect_timeout_s, naming the look-up, not after the resolver's own retries."""
    unanswered = threading.Event()
    resolve = socket.getaddrinfo

    def stalling_resolver(host, *args, **kwargs):
        if host == "resolver-stalls.example":
            unanswered.wait(30.0)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", stalling_resolver)
    try:
        with WireEngine("127.0.0.1", connect_timeout_s=0.5) as writer:
            src = _random_bytes(64, 4)
            writer.register(src)
            # Failed naming the connect timeout: a write that waited on the resolver would fail with its
            # EAI_AGAIN, 30 s on.
            with pytest.raises(TransferError, match=r"looking up the host name 'resolver-stalls\.example' did not "
                                                    r"answer within 0\.5s \(connect_timeout_s=0\.5\)"):
                writer.write("resolver-stalls.example:17000", [src.data_ptr()], [0x10000], [64])
    finally:
        unanswered.set()


def test_batches_still_queued_when_the_engine_closes_fail_unsent_and_count_as_write_failures():
    """close() fails the write_async() batches still waiting in a peer's queue without sending them: their
    owners hear why, and stats() counts them with the write that timed out ahead of them."""
    nbytes = 32 << 20  # far past what the socket buffers take: the first write stalls on the silent peer
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never reads
        peer = f"127.0.0.1:{silent.getsockname()[1]}"
        writer = WireEngine(reply_timeout_s=2, writers_per_peer=1)
        src = torch.zeros(nbytes, dtype=torch.uint8)
        writer.register(src)
        batches = [writer.write_async(peer, [src.data_ptr()], [4096], [nbytes]) for _ in range(3)]
        time.sleep(0.3)  # the first one is on the wire, the others wait behind it
        writer.close()
        reasons = []
        for batch in batches:
            with pytest.raises(TransferError) as caught:
                writer.wait(batch, timeout_s=10)
            reasons.append(str(caught.value))
    assert "timed out" in reasons[0]
    for reason in reasons[1:]:
        assert reason.startswith(f"write to {peer} not started: wire engine {writer.session_id} was closed "
                                 f"while it waited in the queue"), reason
    assert writer.stats()["write_failures"] == 3

"""The live data path end to end, and the frames our ranks put on the wire.

Happy paths run whole deployments through `transfer.harness.run` (a bootstrap
server, E encode and P prefill ranks, each its own process, real Mooncake `tcp` on
127.0.0.1) and check every landed byte, row by row, and that nothing outside each
shard was touched. The wire tests capture our frames at a raw ZMQ socket standing in
for the peer and compare them with SPEC.md's byte layouts.
"""

from __future__ import annotations

import json
import random
import struct
import sys
import urllib.request

import pytest
from live_helpers import (
    DTYPE,
    HOST,
    LIVE,
    TOKEN,
    RawPrefill,
    bootstrap_server,
    encode_process,
    item_bytes,
)

from transfer.bootstrap import BootstrapClient
from transfer.engine import rdma_device_names
from transfer.frames import dtype_size, shard_rows
from transfer.harness import Scenario, run
from transfer.receiver import ENCODE_FAILED
from transfer.status import TransferPoll

pytestmark = LIVE

NO_RDMA = "no RDMA device under /sys/class/infiniband"


def expected_bytes(sc: Scenario) -> int:
    """What every prefill rank together must receive: group-wide shards tile each item once, per-block ones once per block."""
    copies = (sc.encode_ranks if sc.per_block else 1) if sc.sharded else sc.prefill_ranks
    rows = sum(sc.span_of(i) for i in range(sc.items)) * copies
    return rows * sc.row_bytes * (1 + sc.deepstack)


def run_checked(sc: Scenario) -> dict:
    """Runs the scenario and asserts it passed: nothing failed, every byte verified (how fast is the
    benchmarks' to say)."""
    summary = run(sc)
    assert summary["failures"] == [] and summary["mismatches"] == [], summary
    assert summary["failed"] == 0
    assert summary["verified"] is True
    assert summary["items"] == sc.items
    assert summary["bytes"] == expected_bytes(sc)
    assert summary["encode_ranks"] == sc.encode_ranks and summary["prefill_ranks"] == sc.prefill_ranks
    return summary


def scenario(**kw) -> Scenario:
    """Small items and short bounds: the suite runs on two cores.

    Rooms start at a random number: a rank of another deployment on this host whose
    encode port was reused (ZMQ reconnects by itself) must not ask for our rooms. The
    token keeps another deployment's encode rank, still retrying its PUT against a port
    our bootstrap server reused, from replacing our routes.
    """
    base = dict(first_room=random.randrange(1 << 20, 1 << 40), token=TOKEN, items=12, span=16, hidden=128, inflight=6,
                deadline_s=20.0, fanout_timeout_s=20.0, timeout_s=120.0, protocol="tcp")
    base.update(kw)
    return Scenario(**base)


# spans < fanout leave some ranks an empty shard; mixed spans exercise the tiling.
HAPPY = {
    "fanout1-identity": dict(encode_ranks=1, prefill_ranks=1, sharded=False, spans=[1, 8, 33]),
    "fanout2-identity-deepstack": dict(encode_ranks=1, prefill_ranks=2, sharded=False, deepstack=2, spans=[3, 8, 17]),
    "fanout4-sharded-empty-shards": dict(encode_ranks=1, prefill_ranks=4, spans=[1, 2, 3, 5, 8, 13]),
    "p4-e2-sharded-deepstack-empty-shards": dict(encode_ranks=2, prefill_ranks=4, deepstack=1, spans=[1, 2, 3, 5, 9]),
    "p4-e2-identity": dict(encode_ranks=2, prefill_ranks=4, sharded=False, spans=[4, 7]),
    "p4-e2-per-block": dict(encode_ranks=2, prefill_ranks=4, per_block=True, spans=[1, 3, 8, 13]),
    "p2-e2-sharded-empty-shards": dict(encode_ranks=2, prefill_ranks=2, spans=[1, 2, 7]),
}


@pytest.mark.parametrize("shape", list(HAPPY), ids=list(HAPPY))
def test_happy_path(shape):
    summary = run_checked(scenario(**HAPPY[shape]))
    assert summary["protocol"] == "tcp"


@pytest.mark.rdma
@pytest.mark.skipif(not rdma_device_names(), reason=NO_RDMA)
@pytest.mark.parametrize("shape", ["fanout4-sharded-empty-shards", "p4-e2-sharded-deepstack-empty-shards"])
def test_happy_path_over_rdma(shape):
    summary = run_checked(scenario(protocol="rdma", **HAPPY[shape]))
    assert summary["protocol"] == "rdma"


def test_more_than_100_rooms_in_flight():
    # Both ends keep every room open at once: the prefill ranks ask for all 120 before
    # settling any, the encode rank offers all 120 before waiting for any.
    sc = scenario(encode_ranks=1, prefill_ranks=2, items=120, inflight=120, span=8, hidden=64, spans=None)
    summary = run_checked(sc)
    assert summary["p99_ms"] < 20_000


# ------------------------------------------------------------------ wire


@pytest.fixture(scope="module")
def engine():
    from transfer.engine import Engine

    with Engine(HOST, protocol="tcp") as eng:
        yield eng
        assert eng.registered() == {}


def _recv(sock, timeout: float) -> list[bytes]:
    """One multipart message, or AssertionError after `timeout` seconds."""
    assert sock.poll(int(timeout * 1000)), f"nothing arrived within {timeout}s"
    return sock.recv_multipart()


def test_prefill_frames_match_the_spec_layouts(engine):
    import torch
    import zmq

    from transfer.receiver import SessionManager

    span, hidden, k = 8, 64, 2
    with bootstrap_server() as server:
        ctx = zmq.Context.instance()
        stand_in = ctx.socket(zmq.PULL)  # plays encode rank 0
        stand_in.setsockopt(zmq.LINGER, 0)
        port = stand_in.bind_to_random_port(f"tcp://{HOST}")
        try:
            BootstrapClient(server.address, token=TOKEN).register_rank(1, 1, HOST, port, 0, retry_for=2.0)
            buf = torch.empty((2, span, hidden), dtype=torch.bfloat16)
            ds = torch.empty((2, span, hidden * k), dtype=torch.bfloat16)
            # Prefill tp 2 against encode tp 1: fanout 2, this is rank 1 of the block.
            with SessionManager(engine, 1, 2, 1, buffer=buf, deepstack_buffer=ds, host=HOST, deadline_s=10.0) as m:
                row_start, rows = shard_rows(span, 1, 2)
                handles = [
                    m.receive(room, server.address, buf[slot, row_start : row_start + rows], row_start=row_start,
                              span=span, deepstack_dst=ds[slot, row_start : row_start + rows])
                    for slot, room in enumerate((41, 42))
                ]
                registration = _recv(stand_in, 5.0)
                infos = [_recv(stand_in, 5.0), _recv(stand_in, 5.0)]
                assert not stand_in.poll(200), "a second registration for the same encode rank"

                status_port = str(m.status_port).encode()
                session = engine.session_id.encode()
                assert registration == [  # SPEC.md 4.1 + section 8's region lengths: 8 parts
                    b"None", HOST.encode(), status_port, session,
                    struct.pack("Q", buf.data_ptr()), struct.pack("Q", ds.data_ptr()),
                    str(buf.nbytes).encode(), str(ds.nbytes).encode(),
                ]
                for slot, (room, info) in enumerate(zip((41, 42), infos)):
                    emb = buf[slot, row_start].data_ptr()
                    assert info == [  # SPEC.md 4.2: 13 parts, then ours: the deepstack row bytes
                        str(room).encode(), HOST.encode(), status_port, session,
                        struct.pack("Q", emb), struct.pack("Q", ds[slot, row_start].data_ptr()),
                        str(rows).encode(), str(hidden).encode(), b"torch.bfloat16", b"1",
                        b"2", str(row_start).encode(), str(span).encode(), str(hidden * k * 2).encode(),
                    ]
                    assert info[4] == emb.to_bytes(8, sys.byteorder)  # native order

                # Span 1 leaves rank 1 an empty shard: its slices have data_ptr() 0, yet the
                # item has deepstack rows, so has_deepstack must still say 1.
                empty = m.receive(43, server.address, buf[0, 1:1], row_start=1, span=1, deepstack_dst=ds[0, 1:1])
                assert _recv(stand_in, 5.0) == [
                    b"43", HOST.encode(), status_port, session, struct.pack("Q", 0), struct.pack("Q", 0),
                    b"0", str(hidden).encode(), b"torch.bfloat16", b"1", b"2", b"1", b"1", str(hidden * k * 2).encode(),
                ]
                empty.clear()

                # The status port announced is the real one: a peer's bare statuses conclude rooms.
                pusher = ctx.socket(zmq.PUSH)
                pusher.setsockopt(zmq.LINGER, 0)
                pusher.connect(f"tcp://{HOST}:{m.status_port}")
                try:
                    pusher.send_multipart([b"41", b"0", b"0"])
                    pusher.send_multipart([b"42", b"5", b"0"])  # no checksum parts: a peer, not verified
                    assert handles[0].wait(5.0) == TransferPoll.Failed
                    assert handles[0].failure.startswith(ENCODE_FAILED)
                    assert handles[1].wait(5.0) == TransferPoll.Success
                finally:
                    pusher.close(0)
        finally:
            stand_in.close(0)


@pytest.fixture(scope="module")
def encoder():
    with bootstrap_server() as server, encode_process(server.address) as rank:
        rank.bootstrap = server.address
        yield rank


def test_encode_statuses_match_the_spec_layouts(engine, encoder):
    from transfer.wire import layer_sum

    span, hidden, k = 8, 64, 2
    item = span * hidden * dtype_size(DTYPE)
    with RawPrefill(engine, encoder.info["host"], encoder.info["port"], item * (1 + k)) as raw:
        raw.register((item, item * k), deepstack_base=raw.base + item)
        raw.ask(51, raw.base, span, hidden, span, deepstack_ptr=raw.base + item)
        raw.ask(52, raw.base, span, hidden // 2, span)  # a geometry the item does not have
        encoder.call("send", [51], span, hidden, DTYPE, k)
        encoder.call("send", [52], span, hidden)
        statuses = sorted(raw.statuses(2, 5.0))
        emb, deep = item_bytes(51, item), item_bytes(51, item * k, seed=1)
        assert statuses[0] == [  # SPEC.md 4.3 + section 8: room, Success, encode rank, then both checksums.
            b"51", b"5", b"0", str(layer_sum(emb)).encode(), str(layer_sum(deep)).encode()]
        # Failed: the peers' 3 parts, then why (section 8), which peers do not read.
        assert statuses[1][:3] == [b"52", b"0", b"0"]
        assert statuses[1][3:5] == [b"failure", b"geometry"]
        assert f"hidden {hidden // 2} != item hidden {hidden}".encode() in statuses[1][5]
        landed = raw.buffer.numpy()
        assert bytes(landed[:item]) == bytes(emb) and bytes(landed[item:]) == bytes(deep)
        sent = encoder.call("wait", [51, 52], 5.0)
        assert sent[51][0] == "Success" and sent[52][0] == "Failed"


def test_bootstrap_route_read_with_urllib_as_a_peer_reads_it(encoder):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    base = f"http://{encoder.bootstrap}"
    with opener.open(f"{base}/route?engine_rank=-1&target_dp_group=-1", timeout=5) as response:
        assert json.loads(response.read()) == {"prefill_tp_size": 1, "prefill_dp_size": 1}
    with opener.open(f"{base}/route?engine_rank=0&target_dp_group=0", timeout=5) as response:
        assert json.loads(response.read()) == {"rank_ip": encoder.info["host"], "rank_port": encoder.info["port"]}


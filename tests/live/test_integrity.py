"""Verified one-sided writes (SPEC.md section 8), CUDA ordering, and pooled receives,
over real Mooncake `tcp` on loopback with the encode rank in its own process."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import zmq
from integrity_ranks import encode_process
from live_helpers import LIVE, cuda_mooncake_missing

from transfer.bootstrap import BootstrapClient, BootstrapServer
from transfer.engine import Engine
from transfer.harness import ItemSource
from transfer.metrics import total
from transfer.receiver import SessionManager
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 32, 128
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def engine():
    with Engine("127.0.0.1", "tcp") as eng:
        yield eng


def _same(a, b) -> bool:
    """Bytewise equality (random bf16 bytes hold NaNs, which never compare equal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _serve(bootstrap_addr, rooms, corrupt=(), integrity=True):
    """Starts the encode process; returns (process, results queue, stop event)."""
    ctx = mp.get_context("spawn")
    results, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(
        target=encode_process,
        args=(bootstrap_addr, list(rooms), SPAN, HIDDEN, list(corrupt), integrity, results, stop),
        daemon=True,
    )
    proc.start()
    kind, payload = results.get(timeout=60)
    assert kind == "ready", payload
    return proc, results, stop


def _finish(proc, results, stop):
    kind, outcome = results.get(timeout=60)
    assert kind == "done", outcome
    stop.set()
    proc.join(30)
    assert not proc.is_alive()
    return outcome


def _receive_all(manager, bootstrap_addr, rooms, buf):
    handles = [manager.receive(room, bootstrap_addr, buf[i], span=SPAN) for i, room in enumerate(rooms)]
    return {h.room: (h.wait(30), h.failure) for h in handles}, handles


def test_corrupted_landed_byte_concludes_failed_with_checksum_reason(engine):
    rooms = list(range(6))
    source = ItemSource(SPAN, HIDDEN, "torch.bfloat16")
    buf = torch.zeros(len(rooms), SPAN, HIDDEN, dtype=BF16)
    with BootstrapServer("127.0.0.1", 0) as server, SessionManager(engine, 0, 1, 1, buffer=buf) as manager:
        proc, results, stop = _serve(server.address, rooms, corrupt=[2, 4])
        outcome, handles = _receive_all(manager, server.address, rooms, buf)
        encode = _finish(proc, results, stop)
        for room in rooms:
            status, reason = outcome[room]
            if room in (2, 4):
                assert status == TransferPoll.Failed, (room, reason)
                assert reason.startswith("checksum mismatch")
                assert f"room {room}" in reason and "prefill rank 0" in reason and "encode rank 0" in reason
                # Both sums are named, and they differ.
                sent, landed = reason.split("sent ")[1].split(", landed ")
                assert int(sent) != int(landed)
                # The corruption is real: exactly the first landed byte differs.
                landed_bytes = buf[room].view(torch.uint8).reshape(-1)
                want = source.item(room, SPAN).view(torch.uint8).reshape(-1)
                assert (landed_bytes != want).nonzero().flatten().tolist() == [0]
            else:
                assert status == TransferPoll.Success, (room, reason)
                assert _same(buf[room], source.item(room, SPAN))
            # The encode side did its part for every room: the write and the status went out.
            assert encode[room][0] == "Success"
        failed = {row["labels"]["reason"]: row["value"] for row in manager.stats()
                  if row["name"] == "epd_prefill_rooms_failed_total"}
        assert {reason: n for reason, n in failed.items() if n} == {"checksum": 2}
        assert failed["deadline"] == 0  # every kind's series exists from the start
        for handle in handles:
            handle.clear()
        assert not manager._driver.rooms and len(manager._driver.table) == 0


def test_status_without_checksums_concludes_success_unverified(engine):
    """A peer (or our sender with integrity off) sends 3-part statuses: nothing to verify."""
    rooms = [10, 11, 12]
    source = ItemSource(SPAN, HIDDEN, "torch.bfloat16")
    buf = torch.zeros(len(rooms), SPAN, HIDDEN, dtype=BF16)
    with BootstrapServer("127.0.0.1", 0) as server, SessionManager(engine, 0, 1, 1, buffer=buf) as manager:
        proc, results, stop = _serve(server.address, rooms, corrupt=[11], integrity=False)
        outcome, _ = _receive_all(manager, server.address, rooms, buf)
        _finish(proc, results, stop)
    assert all(status == TransferPoll.Success for status, _ in outcome.values()), outcome
    assert _same(buf[0], source.item(10, SPAN)) and _same(buf[2], source.item(12, SPAN))
    # Unverified: the corrupted byte went unnoticed, which is exactly what checksums are for.
    assert not _same(buf[1], source.item(11, SPAN))


def test_receiver_with_integrity_off_skips_the_check(engine):
    rooms = [20, 21]
    buf = torch.zeros(len(rooms), SPAN, HIDDEN, dtype=BF16)
    with BootstrapServer("127.0.0.1", 0) as server, \
            SessionManager(engine, 0, 1, 1, buffer=buf, integrity=False) as manager:
        proc, results, stop = _serve(server.address, rooms, corrupt=[21])
        outcome, _ = _receive_all(manager, server.address, rooms, buf)
        _finish(proc, results, stop)
    assert [status for status, _ in outcome.values()] == [TransferPoll.Success] * 2


class _SlowEvent:
    """Stands in for a CUDA event: query() is False until the test releases it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.queried_on: set[str] = set()

    def query(self) -> bool:
        self.queried_on.add(threading.current_thread().name)
        return self.release.is_set()

    def synchronize(self) -> None:
        raise AssertionError("the pool blocked on the ready event instead of polling it")


def test_a_pending_ready_event_holds_only_its_own_room(engine):
    from transfer.sender import SenderPool

    item = torch.randn(SPAN, HIDDEN).to(BF16)
    other = torch.randn(SPAN, HIDDEN).to(BF16)
    buf = torch.zeros(2, SPAN, HIDDEN, dtype=BF16)
    event = _SlowEvent()
    with Engine("127.0.0.1", "tcp") as encode_engine, BootstrapServer("127.0.0.1", 0) as server, \
            SenderPool(encode_engine, 0, 1, 1, server.address) as pool, \
            SessionManager(engine, 0, 1, 1, buffer=buf) as manager:
        # The event completes only when this test says so, below: send() returning at all
        # means the caller did not wait for it (bounded, should it wait: the test fails, not hangs).
        returned: list = []
        caller = threading.Thread(target=lambda: returned.append(pool.send(5, item, ready_event=event)),
                                  name="the caller", daemon=True)
        caller.start()
        caller.join(10)
        if not returned:
            event.release.set()  # lets the stuck send() and the pool wind down
        assert returned, "send() did not return within 10 s: it waited for its ready event"
        sent = returned[0]
        assert not event.release.is_set() and sent.poll() != TransferPoll.Success
        received = manager.receive(5, server.address, buf[0])
        # Another room, asked for after room 5, is written while room 5's event is pending.
        sent_other = pool.send(6, other)
        received_other = manager.receive(6, server.address, buf[1])
        assert received_other.wait(10) == TransferPoll.Success and sent_other.wait(10) == TransferPoll.Success
        assert _same(buf[1], other)
        # Room 5's rows were not read before its event completed.
        assert received.poll() != TransferPoll.Success
        assert not _same(buf[0], item)
        event.release.set()
        assert received.wait(10) == TransferPoll.Success
        assert sent.wait(10) == TransferPoll.Success
        assert event.queried_on == {"epd-encode-0"}  # polled by the pool's thread, never the caller's
        assert _same(buf[0], item)


@contextmanager
def _silent_rank(bootstrap_addr: str) -> Iterator[None]:
    """Encode rank 0 at `bootstrap_addr`: a ZMQ PULL that takes every ask and answers nothing."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    BootstrapClient(bootstrap_addr).register_rank(1, 1, "127.0.0.1", port, 0)
    try:
        yield
    finally:
        sock.close(0)


def test_pooled_receives_lease_slots_fall_back_and_quarantine_failures(engine):
    from transfer.buffers import ReceivePool
    from transfer.sender import SenderPool

    item = torch.randn(SPAN, HIDDEN).to(BF16)
    deep = torch.randn(SPAN, 2 * HIDDEN).to(BF16)
    item_bytes = SPAN * HIDDEN * 2 * 3  # embedding + deepstack rows
    slot_bytes = -(-item_bytes // 4096) * 4096
    with Engine("127.0.0.1", "tcp") as encode_engine, BootstrapServer("127.0.0.1", 0) as server, \
            ReceivePool(engine, 2 * slot_bytes, slot_bytes, quarantine_s=0.5, grace_s=0.2) as slots, \
            SenderPool(encode_engine, 0, 1, 1, server.address, fanout_timeout_s=2) as pool, \
            SessionManager(engine, 0, 1, 1, pool=slots, deadline_s=1.5) as manager:
        geometry = dict(rows=SPAN, hidden=HIDDEN, dtype="torch.bfloat16", deepstack_hidden=2 * HIDDEN)
        # Three rooms, two slots: the third lands in a fallback buffer announced on the fly.
        for room in (1, 2, 3):
            pool.send(room, item, deep)
        handles = [manager.receive(room, server.address, **geometry) for room in (1, 2, 3)]
        assert [h.wait(10) for h in handles] == [TransferPoll.Success] * 3
        for handle in handles:
            assert _same(handle.rows, item) and _same(handle.deepstack, deep)
        assert slots.stats()["fallbacks_total"] == 1
        for handle in handles:
            handle.clear()
        assert slots.stats()["free"] == 2
        # A room whose encode rank takes its ask and never answers (nor the cancel that follows its
        # deadline): Failed by the deadline, its slot quarantined.
        with BootstrapServer("127.0.0.1", 0) as silent_server, _silent_rank(silent_server.address):
            lost = manager.receive(9, silent_server.address, **geometry)
            assert lost.wait(5) == TransferPoll.Failed and "within 1.5s" in lost.failure
            lost.clear()
        assert slots.stats()["quarantined"] == 1
        assert total(manager.stats(), "epd_prefill_quarantined_slots") == 1
        assert total(manager.stats(), "epd_prefill_fallback_bytes") == 0
        time.sleep(0.6)
        slots.poll()
        assert slots.stats()["quarantined"] == 0 and slots.stats()["free"] == 2
        assert len(manager._region_sets) == 1  # the fallback's region was dropped


def test_a_wider_encode_deepstack_is_refused_and_the_next_slot_is_untouched(engine):
    # The receiver lays out deepstack rows of 2 * hidden; the encode side's are 3 * hidden. Written
    # anyway, the shard would run past its pool slot into the next one, over another room's rows.
    from transfer.buffers import ReceivePool
    from transfer.sender import SenderPool

    span, hidden = 4, 8
    slot = span * hidden * 4 + span * 2 * hidden * 4  # float32 rows + deepstack rows of 2 * hidden: 384 bytes
    geometry = dict(rows=span, hidden=hidden, dtype="float32", span=span, deepstack_hidden=2 * hidden)
    with Engine("127.0.0.1", "tcp") as encode_engine, BootstrapServer("127.0.0.1", 0) as server, \
            ReceivePool(engine, 2 * slot, slot, quarantine_s=0.1) as slots, \
            SenderPool(encode_engine, 0, 1, 1, server.address, fanout_timeout_s=5) as pool, \
            SessionManager(engine, 0, 1, 1, pool=slots, deadline_s=10) as manager:
        slots.region.tensor.zero_()
        wide = manager.receive(11, server.address, **geometry)  # slot 0
        neighbour = manager.receive(12, server.address, **geometry)  # slot 1, right after it
        rows = torch.randn(span, hidden)
        deep = torch.randn(span, 2 * hidden)
        wide_rows = torch.randn(span, hidden)
        wide_deep = torch.randn(span, 3 * hidden)
        try:
            sent = pool.send(12, rows, deep)
            assert neighbour.wait(10) == TransferPoll.Success and sent.wait(10) == TransferPoll.Success
            landed = slots.region.tensor[slot:].clone()
            assert torch.equal(neighbour.rows, rows) and torch.equal(neighbour.deepstack, deep)

            refused = pool.send(11, wide_rows, wide_deep)
            assert wide.wait(10) == TransferPoll.Failed and refused.wait(10) == TransferPoll.Failed
            assert "geometry" in wide.failure
            assert "deepstack row bytes 64 != item deepstack row bytes 96" in wide.failure
            assert torch.equal(slots.region.tensor[slot:], landed)  # the neighbour's bytes, every one
            assert torch.equal(neighbour.rows, rows) and torch.equal(neighbour.deepstack, deep)
            assert not slots.region.tensor[:slot].any()  # nothing of the refused room was written
        finally:
            for handle in (wide, neighbour):
                handle.clear()


@pytest.mark.cuda
@pytest.mark.skipif(bool(cuda_mooncake_missing()), reason=cuda_mooncake_missing() or "-")
def test_cuda_item_with_event_lands_and_verifies():
    from transfer.sender import SenderPool

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        item = torch.randn(SPAN, HIDDEN, device="cuda").to(BF16)
        ready = torch.cuda.Event()
        ready.record(stream)
    buf = torch.zeros(1, SPAN, HIDDEN, dtype=BF16, device="cuda")
    with Engine("127.0.0.1") as encode_engine, Engine("127.0.0.1") as prefill_engine, \
            BootstrapServer("127.0.0.1", 0) as server, \
            SenderPool(encode_engine, 0, 1, 1, server.address) as pool, \
            SessionManager(prefill_engine, 0, 1, 1, buffer=buf) as manager:
        pool.send(7, item, ready_event=ready)
        handle = manager.receive(7, server.address, buf[0])
        assert handle.wait(30) == TransferPoll.Success, handle.failure
        assert _same(buf[0], item)

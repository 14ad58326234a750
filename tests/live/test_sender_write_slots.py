"""The encode side's sender pool: write slots a dead receiver can hold,
memory a peer can make the pool hold, and rooms re-sent under the same number while the
old item's writes are still in flight.

Real Mooncake engines (protocol tcp on loopback), real ZMQ and the real bootstrap server
throughout; a prefill engine in a process of its own, stopped with SIGSTOP, stands in for
a receiver that stopped reading (its writes stay in flight until it is continued).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from live_helpers import (
    DTYPE,
    HIDDEN,
    HOST,
    ITEM,
    LIVE,
    ROW,
    SENTINEL,
    SPAN,
    RawPrefill,
    item_bytes,
    item_tensor,
    stopped_peer,
    wait_until,
)

from transfer import _io
from transfer.engine import Engine
from transfer.frames import TransferInfo, parse_status
from transfer.sender import SenderPool
from transfer.status import TransferPoll
from transfer.wire import layer_sum

pytestmark = LIVE

@pytest.fixture
def stopped(engines):
    """A prefill engine in a process of its own, handshaken with the encode engine, then stopped.

    Yields (session, landing address); the process is continued and killed afterwards.
    """
    encode, _ = engines
    proc, session, landing = stopped_peer(encode)
    try:
        yield proc, session, landing
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def _ask_stopped(push, status_port: int, room: int, session: str, landing: int) -> None:
    """A TransferInfo for `room`'s full span into the stopped peer's memory."""
    push.send_multipart(TransferInfo(room, HOST, status_port, session, landing + room * ITEM, 0, SPAN, HIDDEN,
                                     DTYPE, False, 1, 0, SPAN).to_frames())


# ---------------------------------------------------------------- write slots


def test_a_receiver_that_stopped_reading_does_not_hold_every_write_slot(engines, server, stopped):
    """Writes to one stopped prefill rank stay in flight until Mooncake's transfer timeout
    (30 s by default). They must not take all `depth` slots: another receiver's room,
    asked for meanwhile, is written at once rather than after that timeout."""
    encode, prefill = engines
    _, session, landing = stopped
    pool = SenderPool(encode, 0, 1, 1, server.address, depth=4)
    statuses, status_port = _io.pull_socket(HOST, 0)
    push = _io.push_socket(pool.host, pool.port)
    raw = RawPrefill(prefill, pool.host, pool.port, 4 * ITEM)
    try:
        stuck = [pool.send(room, item_tensor(room, SPAN, HIDDEN)) for room in range(1, 7)]
        for room in range(1, 7):
            _ask_stopped(push, status_port, room, session, landing)
        assert wait_until(lambda: all(h.poll() == TransferPoll.Transferring for h in stuck), 5.0)
        live = pool.send(9, item_tensor(9, SPAN, HIDDEN))
        raw.ask(9, raw.base, SPAN, HIDDEN, SPAN)
        assert live.wait(3.0) == TransferPoll.Success, (live.poll(), live.failure)
        assert raw.statuses(1, 2.0)[0][:2] == [b"9", b"5"]
        assert bytes(raw.buffer[:ITEM].numpy()) == bytes(item_bytes(9, ITEM))
        assert bool((raw.buffer[ITEM:] == SENTINEL).all())
        assert all(h.poll() == TransferPoll.Transferring for h in stuck)  # still waiting for their peer
    finally:
        os.kill(stopped[0].pid, signal.SIGCONT)  # let the stuck writes finish before close()
        pool.close()
        raw.close()
        push.close(0)
        statuses.close(0)


def test_a_write_in_flight_is_polled_on_the_pools_schedule(engines, server, stopped):
    """poll_min_s and poll_max_s set how often the pool looks at a write in flight: a write
    into a stopped receiver is polled first after poll_min_s, then at doubling intervals,
    never more often than every poll_max_s once there."""
    encode, _ = engines
    _, session, landing = stopped
    polls: list[float] = []
    poll = encode.poll

    def counted(ticket: int) -> bool:
        polls.append(time.monotonic())
        return poll(ticket)

    encode.poll = counted  # the real poll still answers; the pool looks it up on every use
    pool = SenderPool(encode, 0, 1, 1, server.address, poll_min_s=0.02, poll_max_s=0.08)
    statuses, status_port = _io.pull_socket(HOST, 0)
    push = _io.push_socket(pool.host, pool.port)
    try:
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        _ask_stopped(push, status_port, 1, session, landing)
        assert wait_until(lambda: polls, 5.0)
        time.sleep(1.0)
        window = list(polls)
        assert handle.poll() == TransferPoll.Transferring  # still in flight all along
    finally:
        del encode.poll
        os.kill(stopped[0].pid, signal.SIGCONT)  # let the write finish before close()
        pool.close()
        push.close(0)
        statuses.close(0)
    gaps = [later - earlier for earlier, later in zip(window, window[1:])]
    # 1 s at one poll per 80 ms once the backoff is there: about 14 (a busy host makes fewer).
    assert 4 <= len(window) <= 1.0 / 0.08 + 4, gaps
    assert min(gaps) >= 0.02 * 0.9, gaps
    assert min(gaps[3:]) >= 0.08 * 0.9, gaps


def test_a_single_receiver_still_gets_every_write_slot_it_can_use(engines, server):
    """The share kept for other receivers is only kept: one receiver alone still has most
    slots in flight, and all its rooms land."""
    encode, prefill = engines
    rooms = 24
    with SenderPool(encode, 0, 1, 1, server.address, depth=8) as pool, \
            RawPrefill(prefill, pool.host, pool.port, rooms * ITEM) as raw:
        handles = [pool.send(room, item_tensor(room, SPAN, HIDDEN)) for room in range(rooms)]
        for room in range(rooms):
            raw.ask(room, raw.base + room * ITEM, SPAN, HIDDEN, SPAN)
        assert [h.wait(10.0) for h in handles] == [TransferPoll.Success] * rooms
        for room in range(rooms):
            assert bytes(raw.buffer[room * ITEM:(room + 1) * ITEM].numpy()) == bytes(item_bytes(room, ITEM))
        assert not pool._core.waiting and pool._core.parked.nbytes == 0  # nothing left counted


# ------------------------------------------------------------ parked memory


def test_parked_asks_hold_a_bounded_number_of_bytes_whatever_the_peer_sends(engines, server):
    """A peer asking for rooms nobody sends, with 1024 receivers each and long session ids,
    could make the pool hold MAX_PARKED_ASKS * MAX_RECEIVERS_PER_ROOM asks of up to 64 KiB
    (a terabyte). What is parked stays within a byte budget; the oldest rooms' receivers
    are told Failed when they are forgotten."""
    encode, _ = engines
    budget = 8 << 20
    statuses, status_port = _io.pull_socket(HOST, 0)
    statuses.setsockopt(_io.zmq.RCVHWM, 0)
    with SenderPool(encode, 0, 1, 1, server.address, max_parked_bytes=budget) as pool:
        push = _io.push_socket(pool.host, pool.port, hwm=0)
        try:
            rooms, receivers, id_bytes = 12, 128, 8 << 10  # 12 MiB of session ids in all
            for room in range(rooms):
                for index in range(receivers):
                    session = f"{room}-{index}-".encode().ljust(id_bytes, b"x")
                    frames = TransferInfo(room, HOST, status_port, "s", 0x1000, 0, SPAN, HIDDEN, DTYPE, False,
                                          receivers, 0, SPAN).to_frames()
                    frames[3] = session
                    push.send_multipart(frames)
            last = f"{rooms - 1}-{receivers - 1}-".encode().ljust(id_bytes, b"x").decode()
            assert wait_until(lambda: last in getattr(pool._core.parked.get(rooms - 1), "infos", {}), 20.0)
            held = sum(len(i.session_id) for a in list(pool._core.parked.values()) for i in a.infos.values())
            assert held <= budget, (held, len(pool._core.parked))
            told: dict[int, int] = {}
            while statuses.poll(1000):
                room, status, _, _ = parse_status(statuses.recv_multipart())
                assert status == TransferPoll.Failed
                told[room] = told.get(room, 0) + 1
            forgotten = [room for room in range(rooms) if room not in pool._core.parked]
            assert forgotten == list(range(len(forgotten))) and forgotten  # the oldest first
            assert told == {room: receivers for room in forgotten}
        finally:
            push.close(0)
    statuses.close(0)


# ---------------------------------------------- the same room number, sent again


def test_a_room_sent_again_while_the_old_write_is_in_flight(engines, server, stopped):
    """Room 5 is written to a stopped receiver, cleared, and sent again from the same rows:
    the old write completing later must neither conclude nor report the new item, nor drop
    the temporary registration the new item still reads from."""
    encode, prefill = engines
    proc, session, landing = stopped
    rows = item_tensor(5, SPAN, HIDDEN)
    statuses, status_port = _io.pull_socket(HOST, 0)
    pool = SenderPool(encode, 0, 1, 1, server.address)
    push = _io.push_socket(pool.host, pool.port)
    raw = RawPrefill(prefill, pool.host, pool.port, ITEM)
    try:
        old = pool.send(5, rows)
        _ask_stopped(push, status_port, 5, session, landing)
        assert wait_until(lambda: old.poll() == TransferPoll.Transferring, 5.0)
        old.clear()
        assert statuses.poll(3000) and statuses.recv_multipart()[:2] == [b"5", b"0"]
        new = pool.send(5, rows)
        os.kill(proc.pid, signal.SIGCONT)  # the old write completes now
        assert wait_until(lambda: encode._pending == {}, 10.0)
        assert not statuses.poll(500)  # no Success for the cleared item
        assert new.poll() == TransferPoll.WaitingForInput
        assert rows.data_ptr() in encode.registered() and pool._sources.counts.counts() == {rows.data_ptr(): 1}
        raw.ask(5, raw.base, SPAN, HIDDEN, SPAN)
        assert new.wait(5.0) == TransferPoll.Success, new.failure
        got = raw.statuses(1, 2.0)[0]
        assert got[:3] == [b"5", b"5", b"0"] and int(got[3]) == layer_sum(rows.view(torch.uint8).numpy())
        assert bytes(raw.buffer.numpy()) == bytes(item_bytes(5, ITEM))
        new.clear()
        assert wait_until(lambda: rows.data_ptr() not in encode.registered(), 5.0)
    finally:
        pool.close()
        raw.close()
        push.close(0)
        statuses.close(0)


# ----------------------------------------------------------- fanout geometry


def test_zero_row_shards_and_deepstack_with_offsets_land_with_their_checksums(engines, server):
    """span 2 over fanout 4 (two empty shards), with deepstack rows three times as wide: the
    non-empty shards land at their row offsets, the empty ones get Success with the checksum
    of nothing, and every checksum covers exactly the bytes written."""
    encode, prefill = engines
    span, fanout, k = 2, 4, 3
    emb, ds = item_tensor(1, span, HIDDEN), item_tensor(1, span, HIDDEN * k, seed=1)
    peers = [Engine(HOST, "tcp") for _ in range(fanout - 1)]
    try:
        with SenderPool(encode, 0, 1, 1, server.address) as pool:
            handle = pool.send(1, emb, ds)
            raws = [RawPrefill(e, pool.host, pool.port, span * ROW * (1 + k)) for e in [prefill, *peers]]
            try:
                for rank, raw in enumerate(raws):
                    base, rem = divmod(span, fanout)
                    start, rows = rank * base + min(rank, rem), base + (rank < rem)
                    raw.ask(1, raw.base, rows, HIDDEN, span, fanout=fanout, row_start=start,
                            deepstack_ptr=raw.base + span * ROW)
                assert handle.wait(5.0) == TransferPoll.Success, handle.failure
                for rank, raw in enumerate(raws):
                    got = raw.statuses(1, 2.0)[0]
                    landed = raw.buffer.numpy()
                    if rank < span:
                        want = bytes(emb[rank].view(torch.uint8).numpy())
                        want_ds = bytes(ds[rank].view(torch.uint8).numpy())
                        assert bytes(landed[:ROW]) == want and bytes(landed[span * ROW:span * ROW + k * ROW]) == want_ds
                        assert (landed[ROW:span * ROW] == SENTINEL).all()
                        sums = [layer_sum(torch.frombuffer(bytearray(b), dtype=torch.uint8).numpy())
                                for b in (want, want_ds)]
                    else:
                        assert raw.untouched()
                        sums = [0, 0]
                    assert got[:3] == [b"1", b"5", b"0"] and [int(p) for p in got[3:5]] == sums
            finally:
                for raw in raws:
                    raw.close()
    finally:
        for peer in peers:
            peer.close()


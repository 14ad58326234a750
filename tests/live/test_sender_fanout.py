"""The encode side's sender pool and receivers that asked and were never
answered. A room cleared before its whole fanout asked, an ask past the per-room receiver
bound, and a write that waited past the fanout timeout for a free slot (or its ready
event) must each end in a Failed status the receiver actually gets, not in silence until
some far-off timeout (a prefill rank has no deadline of its own on the encode side).

Real Mooncake engines (protocol tcp on loopback), real ZMQ and the real bootstrap server
throughout; prefill ranks are hand-rolled (RawPrefill, or raw PUSH/PULL sockets) so each
status they get can be checked as bytes, or a real SessionManager where what its room concludes is the point. Where the order in which the caller's thread and
the pool's thread act matters, the pool's waker is held back so the order is fixed.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch
from live_helpers import DTYPE, HIDDEN, HOST, ITEM, LIVE, ROW, SPAN, RawPrefill, item_tensor, stopped_peer, wait_until

from transfer import _io
from transfer.core import parked
from transfer.core.failure import FailureKind
from transfer.engine import Engine
from transfer.frames import TransferInfo
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

FAILED = b"0"
SUCCESS = b"5"


def _rows_bytes(rows: torch.Tensor) -> bytes:
    return bytes(rows.contiguous().view(torch.uint8).reshape(-1).numpy())


def _heads(raw: RawPrefill, count: int, timeout: float) -> list[list[bytes]]:
    """(room, status, rank) of the next `count` statuses `raw` gets within `timeout`."""
    return [frames[:3] for frames in raw.statuses(count, timeout)]


class _HeldWaker:
    """Holds the pool's wake-ups back while in use, then wakes it once: whatever the caller
    did meanwhile (clear(), send()) reaches the pool's thread in one round, in a fixed order."""

    def __init__(self, pool: SenderPool) -> None:
        self._waker = pool._driver.waker
        self._wake = pool._driver.waker.wake

    def __enter__(self) -> _HeldWaker:
        self._waker.wake = lambda: None
        return self

    def __exit__(self, *exc: object) -> None:
        del self._waker.wake  # the class's own wake() again
        self._wake()


@pytest.fixture
def second_prefill():
    """A second prefill engine: a fanout of two needs two session ids that can be written to."""
    with Engine(HOST, "tcp") as engine:
        yield engine


# --------------------------------------------- a room cleared before its fanout asked


def test_clearing_a_room_before_its_whole_fanout_asked_tells_the_receiver_that_asked_failed(engines, server,
                                                                                           caplog):
    """Half a fanout of two asked, then the caller clears the room: that receiver hears
    Failed within a round of the pool's thread, not when the 120 s fanout timeout
    sweeps its ask, and the pool says why once."""
    encode, prefill = engines
    caplog.set_level(logging.WARNING, logger="transfer.sender")
    with SenderPool(encode, 0, 1, 1, server.address) as pool, RawPrefill(prefill, pool.host, pool.port, ITEM) as raw:
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        raw.ask(1, raw.base, 2, HIDDEN, SPAN, fanout=2)  # the other half never asks
        assert wait_until(lambda: 1 in pool._core.parked, 5.0)
        assert pool.fanout_timeout_s >= 60  # the 120 s default: the bound below ends long before it
        handle.clear()
        assert _heads(raw, 1, 30.0) == [[b"1", FAILED, b"0"]], "no Failed 30 s after clear()"
        assert handle.poll() == TransferPoll.Failed
        assert raw.untouched()
        assert wait_until(lambda: 1 not in pool._core.parked and pool._core.parked.nbytes == 0, 2.0)
        assert _heads(raw, 1, 0.5) == []  # told once
        said = [m for m in caplog.messages if "cleared it before its whole fanout asked" in m]
        assert len(said) == 1 and "room 1:" in said[0] and "(1 of 2 prefill ranks asked: " in said[0], said
        assert prefill.session_id in said[0]


def test_a_prefill_rank_asking_after_the_item_waited_out_its_fanout_and_was_cleared_is_told_why(engines, server):
    """The item is sent, no prefill rank asks within the fanout timeout, and the encode caller clears the
    failed room as it concludes (as the README's reap() does). A session manager asking for it afterwards
    (its scheduler ran behind) concludes Failed naming the fanout timeout, not at its own deadline."""
    from transfer.receiver import SessionManager

    encode, prefill = engines
    deadline_s = 60.0
    buf = torch.zeros(SPAN, HIDDEN, dtype=torch.bfloat16)
    with SenderPool(encode, 0, 1, 1, server.address, fanout_timeout_s=1.0) as pool, \
            SessionManager(prefill, 0, 1, 1, buffer=buf, deadline_s=deadline_s) as manager:
        sent = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        assert sent.wait(20.0) == TransferPoll.Failed and "never registered" in sent.failure, sent.failure
        sent.clear()
        handle = manager.receive(1, server.address, buf)
        assert handle.wait(deadline_s / 2) == TransferPoll.Failed, "left waiting for its deadline"
        assert handle.failure_kind is FailureKind.PEER_FAILED, handle.failure
        assert "fanout_timeout: room 1: its item was sent but failed, and was cleared, before this ask came" in \
            handle.failure, handle.failure
        assert not buf.any(), "nothing written"
        handle.clear()


def _held_waker_retry(pool, old, rows):
    """clear() and send() reach the pool's thread in the same round (its wake-ups held back)."""
    with _HeldWaker(pool):
        old.clear()
        return pool.send(1, rows)


def _retry_after_the_pool_took_the_clear(pool, old, rows):
    """clear(), then send() only once the pool's thread has taken the clear."""
    old.clear()
    assert wait_until(lambda: not pool._driver.commands, 1.0, interval=0.001)
    return pool.send(1, rows)


@pytest.mark.parametrize("retry", [_held_waker_retry, _retry_after_the_pool_took_the_clear],
                         ids=["clear and send in one round", "send after the pool took the clear"])
def test_a_room_cleared_and_sent_again_keeps_the_asks_for_the_new_item(engines, server, second_prefill,
                                                                       monkeypatch, retry):
    """A retry: the room is cleared and sent again, within CLEARED_GRACE_S (1 s here) even
    when the pool's thread took the clear first. The half of the fanout that asked is not
    failed; it waits for the new item, and once the other half asks both get its rows."""
    from transfer.core import encode as encode_core

    monkeypatch.setattr(encode_core, "CLEARED_GRACE_S", 1.0)
    encode, prefill = engines
    old_rows, new_rows = item_tensor(1, SPAN, HIDDEN), item_tensor(2, SPAN, HIDDEN)
    with SenderPool(encode, 0, 1, 1, server.address) as pool, \
            RawPrefill(prefill, pool.host, pool.port, ITEM) as first, \
            RawPrefill(second_prefill, pool.host, pool.port, ITEM) as second:
        old = pool.send(1, old_rows)
        first.ask(1, first.base, 2, HIDDEN, SPAN, fanout=2)
        assert wait_until(lambda: 1 in pool._core.parked, 5.0)
        new = retry(pool, old, new_rows)
        assert _heads(first, 1, 1.0) == []  # not failed: the asks are the new item's
        assert new.poll() == TransferPoll.WaitingForInput and 1 in pool._core.parked
        second.ask(1, second.base, 2, HIDDEN, SPAN, fanout=2, row_start=2)
        assert new.wait(5.0) == TransferPoll.Success, new.failure
        assert _heads(first, 1, 2.0) == [[b"1", SUCCESS, b"0"]]
        assert _heads(second, 1, 2.0) == [[b"1", SUCCESS, b"0"]]
        assert bytes(first.buffer[:2 * ROW].numpy()) == _rows_bytes(new_rows[:2])
        assert bytes(second.buffer[:2 * ROW].numpy()) == _rows_bytes(new_rows[2:])


@pytest.mark.parametrize("when", ["after its room was served", "after an unserved room was cleared"])
def test_an_ask_for_the_next_send_of_a_room_is_not_failed_by_a_clear(engines, server, when):
    """A prefill reusing the room number for its next request asks while the old item is
    served (or once an unserved one was cleared): clearing the old item fails nothing; the
    ask waits for the room's next send and gets its rows."""
    encode, prefill = engines
    old_rows, new_rows = item_tensor(1, SPAN, HIDDEN), item_tensor(2, SPAN, HIDDEN)
    with SenderPool(encode, 0, 1, 1, server.address) as pool, \
            RawPrefill(prefill, pool.host, pool.port, 2 * ITEM) as raw:
        old = pool.send(1, old_rows)
        if when == "after its room was served":
            raw.ask(1, raw.base, SPAN, HIDDEN, SPAN)
            assert old.wait(5.0) == TransferPoll.Success, old.failure
            assert _heads(raw, 1, 2.0) == [[b"1", SUCCESS, b"0"]]
            raw.ask(1, raw.base + ITEM, SPAN, HIDDEN, SPAN)  # its next request, same room number
            assert wait_until(lambda: 1 in pool._core.parked, 5.0)
            old.clear()
        else:
            # The ask is filed after the clear and before the pool's thread handles it.
            with _HeldWaker(pool):
                old.clear()
                raw.ask(1, raw.base + ITEM, SPAN, HIDDEN, SPAN)
                assert wait_until(lambda: 1 in pool._core.parked, 5.0)
        assert _heads(raw, 1, 1.0) == []
        assert 1 in pool._core.parked
        new = pool.send(1, new_rows)
        assert new.wait(5.0) == TransferPoll.Success, new.failure
        assert _heads(raw, 1, 2.0) == [[b"1", SUCCESS, b"0"]]
        assert bytes(raw.buffer[ITEM:].numpy()) == _rows_bytes(new_rows)


# ------------------------------------------------------ too many receivers for a room


def test_an_ask_past_the_receivers_per_room_bound_is_told_failed(engines, server, monkeypatch, caplog):
    """With room for two receivers per room, a third session asking for the same room is
    told Failed at its own status endpoint (and the pool says so); the two kept still wait."""
    encode, _ = engines
    monkeypatch.setattr(parked, "MAX_RECEIVERS_PER_ROOM", 2)
    caplog.set_level(logging.WARNING, logger="transfer.sender")
    pulls = [_io.pull_socket(HOST, 0) for _ in range(3)]
    try:
        with SenderPool(encode, 0, 1, 1, server.address) as pool:
            push = _io.push_socket(pool.host, pool.port)
            try:
                for index, (_, status_port) in enumerate(pulls):
                    # Three shards of a fanout-2 room: the third receiver is one too many.
                    push.send_multipart(TransferInfo(4, HOST, status_port, f"session-{index}", 0x1000, 0, 1, HIDDEN,
                                                     DTYPE, False, 2, index, 3).to_frames())
                extra = pulls[2][0]
                assert extra.poll(3000), "the third receiver was never told"
                assert extra.recv_multipart()[:3] == [b"4", FAILED, b"0"]
                assert sorted(pool._core.parked[4].infos) == ["session-0", "session-1"]
                assert not any(sock.poll(300) for sock, _ in pulls)  # the kept two wait; nothing else told
                said = [m for m in caplog.messages if "more than 2 receivers asked" in m]
                assert said and "room 4:" in said[0] and "telling session-2 Failed" in said[0], said
            finally:
                push.close(0)
    finally:
        for sock, _ in pulls:
            sock.close(0)


# -------------------------------------------- a write that waited past the fanout timeout


def test_a_write_that_waited_past_the_fanout_timeout_for_a_slot_is_failed_not_started(engines, server):
    """depth 1, and the one slot is held by a write to a stopped receiver for longer than the
    fanout timeout: when the slot frees, the write queued behind it is not started; its
    room fails with a reason that says so and its receiver is told Failed, untouched. The
    stuck write itself still completes and succeeds."""
    encode, prefill = engines
    stuck, session, landing = stopped_peer(encode)
    statuses, status_port = _io.pull_socket(HOST, 0)
    try:
        with SenderPool(encode, 0, 1, 1, server.address, depth=1, fanout_timeout_s=1.5) as pool, \
                RawPrefill(prefill, pool.host, pool.port, ITEM) as raw:
            push = _io.push_socket(pool.host, pool.port)
            try:
                push.send_multipart(TransferInfo(1, HOST, status_port, session, landing, 0, SPAN, HIDDEN, DTYPE,
                                                 False, 1, 0, SPAN).to_frames())
                first = pool.send(1, item_tensor(1, SPAN, HIDDEN))
                assert wait_until(lambda: first.poll() == TransferPoll.Transferring, 5.0)
                second = pool.send(2, item_tensor(2, SPAN, HIDDEN))
                raw.ask(2, raw.base, SPAN, HIDDEN, SPAN)
                assert wait_until(lambda: second.poll() == TransferPoll.Transferring, 5.0)
                time.sleep(2.0)  # past the fanout timeout, the slot still held
                assert second.poll() == TransferPoll.Transferring and raw.untouched()
                os.kill(stuck.pid, signal.SIGCONT)  # the slot frees now
                assert second.wait(10.0) == TransferPoll.Failed
                reason = second.failure
                assert reason.startswith(f"room 2: its write for {prefill.session_id} waited "), reason
                assert reason.endswith("past the fanout timeout 1.5s; not started"), reason
                assert _heads(raw, 1, 2.0) == [[b"2", FAILED, b"0"]]
                assert raw.untouched()
                assert first.wait(10.0) == TransferPoll.Success, first.failure
                assert statuses.poll(2000) and statuses.recv_multipart()[:3] == [b"1", SUCCESS, b"0"]
                assert wait_until(lambda: not pool._core.waiting, 2.0)
            finally:
                push.close(0)
    finally:
        statuses.close(0)
        os.kill(stuck.pid, signal.SIGCONT)
        stuck.kill()
        stuck.wait(10)


class _ReadyAt:
    """A ready event (CUDA-event-like) that completes at a given monotonic time."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.monotonic() >= self.at


def test_a_write_whose_ready_event_completes_past_the_fanout_timeout_of_the_first_ask_is_failed(engines,
                                                                                                     server):
    """The receiver asked 1.5 s before the item was sent, and the item's ready event completes
    2 s after send(): within the ready event's own bound (3 s after send()), but 3.5 s after
    the ask, past the fanout timeout of 3 s. The write is not started; the room fails."""
    encode, prefill = engines
    with SenderPool(encode, 0, 1, 1, server.address, fanout_timeout_s=3.0) as pool, \
            RawPrefill(prefill, pool.host, pool.port, ITEM) as raw:
        raw.ask(1, raw.base, SPAN, HIDDEN, SPAN)
        assert wait_until(lambda: 1 in pool._core.parked, 5.0)
        time.sleep(1.5)  # the ask waits for its item (the sweep would fail it at 3 s)
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN), ready_event=_ReadyAt(time.monotonic() + 2.0))
        assert handle.wait(10.0) == TransferPoll.Failed
        reason = handle.failure
        assert reason.startswith(f"room 1: its write for {prefill.session_id} waited "), reason
        assert reason.endswith("past the fanout timeout 3s; not started"), reason
        assert _heads(raw, 1, 2.0) == [[b"1", FAILED, b"0"]]
        assert raw.untouched()

"""A prefill rank that gives a room up tells its encode rank: the late item writes nothing (real Mooncake tcp)."""

from __future__ import annotations

import time

import pytest
from live_helpers import HOST, bootstrap_server, encode_process, stopped, wait_until

from transfer.bootstrap import BootstrapServer

BF16 = "torch.bfloat16"


def _counter(metrics, name: str) -> dict:
    """A counter's samples by their `reason` label ('' when it has none)."""
    return {row["labels"].get("reason", ""): row["value"] for row in metrics.snapshot()
            if row["name"] == metrics.full_name(name)}


def test_a_room_past_its_deadline_is_never_written_when_its_item_comes_later(engines):
    import torch

    from transfer.core.failure import FailureKind
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    encode_engine, prefill_engine = engines
    rows, hidden = 64, 256
    item = torch.randn(rows, hidden).to(torch.bfloat16)
    encode_engine.register(item)
    buf = torch.full((rows, hidden), 7.0, dtype=torch.bfloat16)
    filled = buf.clone()
    try:
        with BootstrapServer(HOST, 0) as server, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, fanout_timeout_s=30) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=1.0) as manager:
            handle = manager.receive(1, server.address, buf, rows=rows, hidden=hidden, dtype=BF16)
            # The encode rank parks the ask: its item has not come.
            assert wait_until(lambda: sender._core.parked.get(1) is not None, 5), "the ask never reached the rank"
            assert handle.wait(5) == TransferPoll.Failed and handle.failure_kind is FailureKind.DEADLINE
            assert wait_until(lambda: handle.safe_to_reuse, 5), "the encode rank never confirmed the cancel"
            assert _counter(sender.metrics, "cancels_total") == {"confirmed": 1, "too_late": 0, "write_failed": 0}
            handle.clear()
            written = sender.send(1, item)
            assert written.wait(5) == TransferPoll.Failed
            assert written.failure_kind is FailureKind.CANCELLED, written.failure
            time.sleep(0.2)  # a write, had one started, would have landed by now
            assert torch.equal(buf.view(torch.uint8), filled.view(torch.uint8)), "the cancelled room was written"
            counts = _counter(sender.metrics, "rooms_failed_total")
            assert counts.get("cancelled") == 1, counts
            assert not _counter(sender.metrics, "rooms_succeeded_total").get("", 0)
    finally:
        encode_engine.unregister(item.data_ptr())


def test_a_room_cleared_before_its_ask_was_answered_frees_its_pool_slot_at_once(engines):
    import torch

    from transfer.buffers import ReceivePool
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    encode_engine, prefill_engine = engines
    rows, hidden = 4, 64
    slot = rows * hidden * 2
    item = torch.randn(rows, hidden).to(torch.bfloat16)
    encode_engine.register(item)
    try:
        with BootstrapServer(HOST, 0) as server, \
                ReceivePool(prefill_engine, slot, slot, grace_s=0) as slots, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, fanout_timeout_s=30) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=30) as manager:
            given_up = manager.receive(1, server.address, rows=rows, hidden=hidden, dtype=BF16)
            assert wait_until(lambda: sender._core.parked.get(1) is not None, 5), "the ask never reached the rank"
            given_up.clear()
            assert wait_until(lambda: given_up.safe_to_reuse, 5), "the encode rank never confirmed the cancel"
            assert wait_until(lambda: slots.stats()["quarantined"] == 0, 5)
            following = manager.receive(2, server.address, rows=rows, hidden=hidden, dtype=BF16)
            assert following.rows.data_ptr() == given_up.rows.data_ptr()  # the one slot, free again
            following.rows.zero_()
            late = sender.send(1, item)
            assert late.wait(5) == TransferPoll.Failed, "room 1 was cancelled"
            assert bool((following.rows.view(torch.uint8) == 0).all()), "room 1's late write landed in room 2's slot"
            following.clear()
    finally:
        encode_engine.unregister(item.data_ptr())


def test_rooms_no_encode_rank_was_asked_for_give_their_slot_back_at_once(engines):
    """Rooms refused at bootstrap never reached an encode rank: their slots are not quarantined."""
    import socket

    from transfer.buffers import ReceivePool
    from transfer.core.failure import FailureKind
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    rows, hidden = 4, 64
    slot = rows * hidden * 2
    with socket.socket() as closed:  # a port nothing listens on: the look-up is refused at once
        closed.bind((HOST, 0))
        nowhere = f"{HOST}:{closed.getsockname()[1]}"
    with ReceivePool(prefill_engine, slot, slot, grace_s=0, max_fallback_bytes=0) as slots, \
            SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=5) as manager:
        for room in range(1, 7):  # more rooms than the pool has slots, and no fallback allowed
            handle = manager.receive(room, nowhere, rows=rows, hidden=hidden, dtype=BF16)
            assert handle.wait(5) == TransferPoll.Failed
            assert handle.failure_kind is FailureKind.BOOTSTRAP, handle.failure
            assert handle.safe_to_reuse
            handle.clear()
            assert slots.stats()["quarantined"] == 0
        assert slots.stats()["fallbacks_total"] == 0


def test_a_room_asked_again_right_after_its_clear_is_served_not_dropped_by_the_old_cancel(engines):
    """The cancel of the cleared room goes out before the new ask for its number, so the encode
    rank drops the old ask, not the new one; the item sent then lands in the new destination."""
    import torch

    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.status import TransferPoll

    encode_engine, prefill_engine = engines
    rows, hidden = 4, 64
    buf = torch.zeros(3, rows, hidden, dtype=torch.bfloat16)
    items = [torch.randn(rows, hidden).to(torch.bfloat16) for _ in range(3)]
    for item in items:
        encode_engine.register(item)
    try:
        with BootstrapServer(HOST, 0) as server, \
                SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, fanout_timeout_s=30) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=10) as manager:
            # A first cancel answered: this encode rank is known to answer them, so no ask is held for one.
            first = manager.receive(99, server.address, buf[0])
            assert wait_until(lambda: sender._core.parked.get(99) is not None, 5), "the ask never reached the rank"
            first.clear()
            assert wait_until(lambda: first.safe_to_reuse, 5), "the encode rank never confirmed the cancel"
            for room, item in enumerate(items, start=1):
                old = manager.receive(room, server.address, buf[1])
                assert wait_until(lambda room=room: sender._core.parked.get(room) is not None, 5)
                old.clear()
                new = manager.receive(room, server.address, buf[2])  # at once, on the caller's thread
                time.sleep(0.1)  # both reach the encode rank before the item is sent
                sent = sender.send(room, item)
                assert new.wait(8) == TransferPoll.Success, new.failure
                assert sent.wait(5) == TransferPoll.Success, sent.failure
                assert torch.equal(buf[2].view(torch.uint8), item.view(torch.uint8))
                new.clear()
                sent.clear()
    finally:
        for item in items:
            encode_engine.unregister(item.data_ptr())


@pytest.mark.parametrize("given_up", ["cleared before it concluded", "failed at its deadline"])
def test_a_given_up_rooms_slot_is_not_leased_again_until_its_encode_rank_confirms_the_cancel(engines, given_up):
    """The encode rank (its own process) holds the room's ask, then stops (SIGSTOP): it can neither write nor
    confirm. A late write may still land in the slot, so clear() quarantines it: the pool does not lease it
    (nor does its quarantine bound free it meanwhile). Once the rank resumes and confirms the cancel, the
    slot serves the next room."""
    from transfer.buffers import ReceivePool
    from transfer.core.failure import FailureKind
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    rows, hidden = 4, 64
    slot = rows * hidden * 2
    deadline_s = 1.0 if given_up == "failed at its deadline" else 60.0
    with bootstrap_server() as server, encode_process(server.address) as encode, \
            ReceivePool(prefill_engine, slot, slot, grace_s=0, quarantine_s=600, max_fallback_bytes=0) as slots, \
            SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=deadline_s) as manager:
        handle = manager.receive(1, server.address, rows=rows, hidden=hidden, dtype=BF16)
        assert wait_until(lambda: encode.call("state")["asks"] == 1, 10), "the ask never reached the rank"
        with stopped(encode.proc.pid, []):
            if given_up == "failed at its deadline":
                assert handle.wait(10) == TransferPoll.Failed and handle.failure_kind is FailureKind.DEADLINE
            else:
                assert handle.poll() not in (TransferPoll.Failed, TransferPoll.Success)
            handle.clear()
            assert not handle.safe_to_reuse
            assert slots.stats()["quarantined"] == 1
            assert slots.lease(slot) is None, "the slot was leased while a late write may still land in it"
        assert wait_until(lambda: handle.safe_to_reuse, 10), "the encode rank never confirmed the cancel"
        assert wait_until(lambda: slots.stats()["quarantined"] == 0, 10)
        following = manager.receive(2, server.address, rows=rows, hidden=hidden, dtype=BF16)
        assert following.rows.data_ptr() == handle.rows.data_ptr()  # the one slot, free again
        following.clear()

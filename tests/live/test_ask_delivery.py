"""Asks reach only a live encode rank: what could not be delivered waits in the session
manager, in order, and a room cleared meanwhile is never asked for.

Real Mooncake (tcp on loopback), real ZMQ and the real bootstrap server; raw PULL sockets
stand in for encode ranks so the test sees exactly which frames reach them."""

from __future__ import annotations

import time

import pytest
from live_helpers import wait_until
from test_receiver_rooms import HOST, _encode_stand_in, _messages

from transfer.bootstrap import BootstrapClient, BootstrapServer

pytestmark = pytest.mark.live


def _free_port() -> int:
    sock, port = _encode_stand_in()
    sock.close(0)
    return port


def test_a_room_cleared_while_its_encode_rank_is_down_never_reaches_the_rank_that_comes_back(engines):
    """ZMQ queues what is sent to a peer that is not connected and delivers it to whoever
    listens at that address next. A room cleared before its deadline, while its encode rank
    was down, must not reach the rank restarted there: its memory is the caller's again,
    and the new rank would write into it as soon as an item with that room number came."""
    import torch

    from transfer.frames import TransferInfo, is_registration
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    port = _free_port()  # nothing listens there yet: the encode rank is down
    with BootstrapServer(HOST, 0) as server:
        BootstrapClient(server.address).register_rank(1, 1, HOST, port, 0)
        with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=30) as manager:
            given_up = manager.receive(5, server.address, buf[0])
            time.sleep(0.3)  # looked up and (not) sent
            given_up.clear()  # buf[0] is the caller's again
            kept = manager.receive(6, server.address, buf[1])

            rank, _ = _encode_stand_in(port)  # the encode rank comes (back) up
            try:
                got = _messages(rank, 2.0, 3)
                rooms = [TransferInfo.from_frames(m).room for m in got if not is_registration(m)]
                assert 5 not in rooms, "the cleared room's TransferInfo reached the encode rank"
                # The room still held is delivered once the rank listens, its registration first.
                assert [is_registration(m) for m in got] == [True, False] and rooms == [6]
                assert wait_until(lambda: kept.poll() == TransferPoll.WaitingForInput, 2.0)
            finally:
                rank.close(0)
            kept.clear()


def test_a_room_whose_ask_never_left_says_so_when_it_expires(engines):
    """The deadline's reason tells an operator the encode rank was never reachable, not
    merely that it sent nothing."""
    import torch

    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    port = _free_port()
    with BootstrapServer(HOST, 0) as server:
        BootstrapClient(server.address).register_rank(1, 1, HOST, port, 0)
        with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=0.5) as manager:
            first = manager.receive(1, server.address, buf[0])
            time.sleep(0.2)
            later = manager.receive(2, server.address, buf[1])
            assert first.poll() == TransferPoll.Bootstrapping  # not asked yet, so not waiting for input
            assert first.wait(5) == TransferPoll.Failed
            assert f"no connection to encode rank 0 at {HOST}:{port}" in first.failure, first.failure
            assert later.wait(5) == TransferPoll.Failed
            # Queued behind the first, it fails with it: the rank is silent and it was never asked.
            assert f"encode rank 0 at {HOST}:{port} went silent" in later.failure, later.failure
            assert "room 2 was never asked for" in later.failure, later.failure
            first.clear()
            later.clear()
            # Once the rank is up the next room reaches it.
            rank, _ = _encode_stand_in(port)
            try:
                manager.receive(3, server.address, buf[2])
                assert len(_messages(rank, 2.0, 2)) == 2
            finally:
                rank.close(0)


def test_a_room_asked_before_a_reconnect_expiring_spares_the_rooms_asked_after_it(engines):
    """When a room expires its encode rank's socket is replaced and what waited on it fails.
    A room asked on a socket already replaced says nothing about the new one: the rooms
    waiting there were asked after a fresh look-up, and must keep their own deadlines
    (here the rank comes back in time for them)."""
    import torch

    from transfer.frames import TransferInfo, is_registration
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server:
        first, port = _encode_stand_in()
        BootstrapClient(server.address).register_rank(1, 1, HOST, port, 0)
        with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=2.0) as manager:
            try:
                early = manager.receive(1, server.address, buf[0])
                assert len(_messages(first, 2.0, 2)) == 2  # registration and room 1
                time.sleep(0.7)
                later = manager.receive(2, server.address, buf[1])  # expires 0.7 s after room 1
                assert len(_messages(first, 2.0, 1)) == 1
            finally:
                first.close(0)  # the encode rank goes down, nothing answered
            assert early.wait(5) == TransferPoll.Failed and "no status from" in early.failure, early.failure
            # The socket room 1 was asked on is gone; room 3 gets a fresh one, and waits there.
            waiting = manager.receive(3, server.address, buf[2])
            assert later.wait(5) == TransferPoll.Failed and "no status from" in later.failure, later.failure
            assert waiting.poll() != TransferPoll.Failed, waiting.failure
            second, _ = _encode_stand_in(port)  # back, 0.8 s before room 3's deadline
            try:
                got = _messages(second, 1.0, 2)
                assert [is_registration(m) for m in got] == [True, False], got
                assert TransferInfo.from_frames(got[1]).room == 3
                assert wait_until(lambda: waiting.poll() == TransferPoll.WaitingForInput, 2.0), waiting.failure
            finally:
                second.close(0)
            for handle in (early, later, waiting):
                handle.clear()


def test_an_encode_rank_restarted_at_the_same_address_is_registered_with_before_its_first_room(engines):
    """SPEC.md 5: the registration goes to an encode rank the first time the prefill rank
    meets it. A rank restarted at the same address is a new one that knows nothing of this
    session; without the registration it cannot check destinations (SPEC.md 8), and once it
    learns of another region of ours it refuses every room in this one."""
    import torch

    from transfer import _io
    from transfer.frames import (
        TransferInfo,
        is_registration,
        parse_registration,
        status_frames,
    )
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    _, prefill_engine = engines
    buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server:
        first, port = _encode_stand_in()
        BootstrapClient(server.address).register_rank(1, 1, HOST, port, 0)
        with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=10) as manager:
            statuses = _io.push_socket(HOST, manager.status_port)
            try:
                served = manager.receive(1, server.address, buf[0])
                assert [is_registration(m) for m in _messages(first, 2.0, 2)] == [True, False]
                statuses.send_multipart(status_frames(1, TransferPoll.Success, 0))
                assert served.wait(5) == TransferPoll.Success
                served.clear()
            finally:
                first.close(0)  # the encode rank restarts between rooms: no room of ours waits on it
            time.sleep(0.3)
            second, _ = _encode_stand_in(port)
            try:
                time.sleep(0.5)  # the manager's socket reconnects
                fresh = manager.receive(2, server.address, buf[1])
                got = _messages(second, 2.0, 2)
                assert [is_registration(m) for m in got] == [True, False], [len(m) for m in got]
                assert parse_registration(got[0]).embedding_base == buf.data_ptr()
                assert TransferInfo.from_frames(got[1]).room == 2
                fresh.clear()
            finally:
                second.close(0)
                statuses.close(0)

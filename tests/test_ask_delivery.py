"""Asks reach only a live encode rank: what could not be delivered waits in the session
manager, in order, and a room cleared meanwhile is never asked for.

Real Mooncake (tcp on loopback), real ZMQ and the real bootstrap server; raw PULL sockets
stand in for encode ranks so the test sees exactly which frames reach them."""

from __future__ import annotations

import time

import pytest

from live_helpers import wait_until
from test_review_receiver import HOST, _encode_stand_in, _messages, engines  # noqa: F401 - fixture
from transfer.bootstrap import BootstrapClient, BootstrapServer

pytestmark = pytest.mark.live


def _free_port() -> int:
    sock, port = _encode_stand_in()
    sock.close(0)
    return port


def test_a_room_cleared_while_its_encode_rank_is_down_never_reaches_the_rank_that_comes_back(engines):  # noqa: F811
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


def test_a_room_whose_ask_never_left_says_so_when_it_expires(engines):  # noqa: F811
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

"""The prefill side's sockets to encode ranks: one with nothing under way is closed once idle, an
encode rank that restarted at another port is looked up again, not waited for at the old one
(whether its drop was seen before a room or the room's ask waited for a socket at the old port),
and one that keeps moving leaves no socket behind at the ports it left.

Real Mooncake engines (tcp on 127.0.0.1), real ZMQ, a real bootstrap server and sender pools."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq
from live_helpers import HOST, LIVE, wait_until

from transfer.bootstrap import BootstrapClient, BootstrapServer
from transfer.drive import prefill as drive_prefill
from transfer.frames import is_registration
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

ROWS, HIDDEN, BF16 = 4, 64, "torch.bfloat16"


def _room(manager: SessionManager, sender: SenderPool, server: BootstrapServer, room: int,
          buf: torch.Tensor) -> tuple[TransferPoll, str | None]:
    """Sends and receives one room; (its outcome, its failure), its bytes checked."""
    item = torch.randn(ROWS, HIDDEN).to(torch.bfloat16)
    sent = sender.send(room, item)
    handle = manager.receive(room, server.address, buf[room % 2])
    outcome = handle.wait(30)
    failure = handle.failure
    if outcome == TransferPoll.Success:
        assert torch.equal(buf[room % 2].view(torch.uint8), item.view(torch.uint8))
    handle.clear()
    sent.wait(5)
    sent.clear()
    return outcome, failure


def _served_then_gone(engine, manager: SessionManager, server: BootstrapServer, buf: torch.Tensor) -> int:
    """Room 1 from an encode rank that then stops; its port, once the prefill rank saw it go."""
    with SenderPool(engine, 0, 1, 1, server.address) as first:
        assert _room(manager, first, server, 1, buf)[0] == TransferPoll.Success
        port = first.port
    time.sleep(2.5)  # the prefill rank's I/O thread reads its monitors once a second
    return port


def test_a_socket_to_an_encode_rank_with_nothing_under_way_is_closed_once_idle(engines, monkeypatch):
    monkeypatch.setattr(drive_prefill, "ASK_IDLE_S", 0.5)
    encode, prefill = engines
    buf = torch.zeros(2, ROWS, HIDDEN, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server, SenderPool(encode, 0, 1, 1, server.address) as sender, \
            SessionManager(prefill, 0, 1, 1, buffer=buf, host=HOST, deadline_s=30) as manager:
        assert _room(manager, sender, server, 1, buf)[0] == TransferPoll.Success
        assert len(manager._driver._sockets) == 1
        assert wait_until(lambda: not manager._driver._sockets and not manager._driver._monitors, 5), \
            "the idle socket to the encode rank is still open"
        # The next room connects afresh and announces its regions again.
        outcome, failure = _room(manager, sender, server, 2, buf)
        assert outcome == TransferPoll.Success, failure


def test_an_encode_rank_restarted_at_another_port_is_looked_up_again(engines):
    """Its old socket dropped while no room was under way: the next room asks the bootstrap server
    where it is now instead of waiting out its deadline at the old port."""
    encode, prefill = engines
    buf = torch.zeros(2, ROWS, HIDDEN, dtype=torch.bfloat16)
    # A deadline (60 s) far past the room's wait (30 s): a room waiting it out at the old port is not Success.
    with BootstrapServer(HOST, 0) as server, \
            SessionManager(prefill, 0, 1, 1, buffer=buf, host=HOST, deadline_s=60) as manager:
        old_port = _served_then_gone(encode, manager, server, buf)
        with SenderPool(encode, 0, 1, 1, server.address) as second:
            assert second.port != old_port
            outcome, failure = _room(manager, second, server, 2, buf)
        assert outcome == TransferPoll.Success, failure


def test_a_room_asked_while_its_encode_rank_is_down_reaches_it_back_at_another_port(engines):
    """A rank that went away without withdrawing its route (killed: its pool never closed) is still
    named at the old port by the bootstrap server until the restarted rank registers: the room's ask
    waits for a socket there, then is looked up again and goes to the new port, well within its
    deadline."""
    encode, prefill = engines
    buf = torch.zeros(2, ROWS, HIDDEN, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server, \
            SessionManager(prefill, 0, 1, 1, buffer=buf, host=HOST, deadline_s=30) as manager:
        old_port = _served_then_gone(encode, manager, server, buf)
        # The route as a killed rank leaves it.
        BootstrapClient(server.address).register_rank(1, 1, HOST, old_port, 0, retry_for=5)
        item = torch.randn(ROWS, HIDDEN).to(torch.bfloat16)
        handle = manager.receive(2, server.address, buf[0])
        assert wait_until(lambda: manager._driver.core.stage(2) == "queued", 5), manager._driver.core.stage(2)
        with SenderPool(encode, 0, 1, 1, server.address) as second:
            assert second.port != old_port
            sent = second.send(2, item)
            outcome = handle.wait(30)  # its deadline is 30 s too: one that waited it out at the old port failed
            sent.wait(5)
            sent.clear()
        assert outcome == TransferPoll.Success, handle.failure
        assert torch.equal(buf[0].view(torch.uint8), item.view(torch.uint8))
        handle.clear()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _asked_at_a_new_port(ctx: zmq.Context, client: BootstrapClient, ask: Callable[[], Any],
                         dropped: Callable[[], bool]) -> None:
    """One turn of an encode rank that keeps moving: it listens at a new port, registers it, reads
    the ask `ask()` makes, closes that socket, and waits until the prefill rank saw it go (`dropped`):
    an ask sent before ZMQ noticed the close would be lost with it."""
    pull = ctx.socket(zmq.PULL)
    try:
        port = pull.bind_to_random_port(f"tcp://{HOST}")
        client.register_rank(1, 1, HOST, port, 0, retry_for=10)
        ask()
        while True:
            assert pull.poll(15_000), f"no ask reached the encode rank at port {port}"
            if not is_registration(pull.recv_multipart()):
                break
    finally:
        pull.close(0)
    assert wait_until(dropped, 10, interval=0.002), f"the prefill rank never saw port {port} go"


def test_an_encode_rank_that_keeps_moving_leaves_no_sockets_behind_and_others_are_served(engines, monkeypatch):
    """An encode rank reads one ask at each port, then closes it and registers at a new one, 40 times:
    the prefill rank keeps a socket (and its descriptors) for where it is, not for every port it
    left, and the rooms of a healthy deployment beside it, one first met at the end included,
    succeed throughout."""
    monkeypatch.setattr(drive_prefill, "MONITOR_PERIOD_S", 0.01)  # drops are seen sooner: a shorter test
    encode, prefill = engines
    moves = 40
    buf = torch.zeros(moves + 2, ROWS, HIDDEN, dtype=torch.bfloat16)
    ctx = zmq.Context()
    handles: list = []
    try:
        with BootstrapServer(HOST, 0) as moving, BootstrapServer(HOST, 0) as healthy, \
                SenderPool(encode, 0, 1, 1, healthy.address) as sender, \
                SessionManager(prefill, 0, 1, 1, buffer=buf, host=HOST, deadline_s=120) as manager:
            client, key = BootstrapClient(moving.address), (moving.address, 0, 0)
            outcome, failure = _room(manager, sender, healthy, 10_000, buf)
            assert outcome == TransferPoll.Success, failure
            fds_before = _fds()
            for room in range(1, moves + 1):
                _asked_at_a_new_port(
                    ctx, client, lambda room=room: handles.append(manager.receive(room, moving.address,
                                                                                  buf[2 + room % moves])),
                    # A caller polling, as a scheduler does, and the route the drop forgets.
                    lambda: handles[-1].poll() is not None and manager._driver.core.route(key) is None)
                if room % 10 == 0:
                    outcome, failure = _room(manager, sender, healthy, 10_000 + room, buf)
                    assert outcome == TransferPoll.Success, failure
            encode_sockets = len(manager._driver.sockets()) - 1  # less the status socket
            assert encode_sockets <= 4, f"{encode_sockets} sockets to encode ranks after {moves} moves"
            assert _fds() <= fds_before + 40, f"{_fds() - fds_before} more descriptors after {moves} moves"
            with BootstrapServer(HOST, 0) as other, SenderPool(encode, 0, 1, 1, other.address) as newcomer:
                outcome, failure = _room(manager, newcomer, other, 20_000, buf)
                assert outcome == TransferPoll.Success, failure
            for handle in handles:
                handle.clear()
    finally:
        ctx.destroy(0)

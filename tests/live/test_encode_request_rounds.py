"""The encode driver's request rounds (EncodeDriver._drain_requests): each files at most
MAX_REQUESTS_PER_ROUND messages off its request socket, plain asks and every other request alike,
in the order they came, and says when more may be queued. Real ZMQ sockets, a real core."""

from __future__ import annotations

import pytest
import zmq

from transfer import _io
from transfer.core.encode import EncodeCore
from transfer.drive.encode import MAX_REQUESTS_PER_ROUND, EncodeDriver, RoomBook, SourceRegistry
from transfer.frames import TransferInfo
from transfer.metrics import Metrics

HOST = "127.0.0.1"
ASKS = 300


def ask_frames(room: int) -> list[bytes]:
    return TransferInfo(room, HOST, 17001, f"{HOST}:15432", 0x7F00_1234_0000, 0, 4, 2048, "torch.bfloat16", False,
                        1, 0, 4).to_frames()


@pytest.fixture
def unstarted():
    """A driver whose thread never starts, reading an inproc request socket, and a PUSH socket into it: a
    message sent there is queued when its send returns, so each round below finds every message sent before it."""
    driver = EncodeDriver(EncodeCore(), None, 0, HOST, 0, RoomBook(Metrics("t")), SourceRegistry(None), Metrics("t"))
    driver.pull.close(0)
    driver.pull = _io.context().socket(zmq.PULL, socket_class=_io.ControlListener)
    address = f"inproc://requests-{id(driver)}"
    driver.pull.bind(address)
    push = _io.context().socket(zmq.PUSH)
    push.connect(address)
    try:
        yield driver, push
    finally:
        push.close(0)
        driver.pull.close(0)
        driver.statuses.close()
        driver.waker.close()


def test_a_round_counts_every_message_it_reads_and_files_them_in_order(zmq_path, unstarted):
    """Asks each followed by a malformed request: a round reads MAX_REQUESTS_PER_ROUND messages of them,
    half of them asks, and the next rounds file the rest in order, none lost."""
    driver, push = unstarted
    for room in range(ASKS):
        push.send_multipart(ask_frames(room))
        push.send_multipart([b"garbage", b"\xff"])
    assert driver._drain_requests() is True
    assert driver.core.parked.rooms() == list(range(MAX_REQUESTS_PER_ROUND // 2))
    rounds, more = 1, True
    while more:
        more = driver._drain_requests()
        rounds += 1
        assert rounds <= 2 * ASKS, "the rounds never found the socket empty"
    assert driver.core.parked.rooms() == list(range(ASKS))
    assert rounds == 2 * ASKS // MAX_REQUESTS_PER_ROUND + 1  # the last one read what was left, then nothing

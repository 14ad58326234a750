"""A session replaced at its status endpoint: the work that costs does not grow with other sessions' remembered
cancels (the entries a peer can pile up with asks it cancels)."""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any, Callable

import pytest

import transfer.core
from transfer.core.encode import EncodeCore, Offer
from transfer.frames import Cancel, Registration, TransferInfo

HIDDEN = 256
ROW = HIDDEN * 2
BASE = 0x10000
CORE_DIR = os.path.dirname(transfer.core.__file__)
PEER = "10.6.0.1:17000"  # the session piling up cancels


def _registration(session: str, host: str, port: int) -> Registration:
    return Registration(host, port, session, BASE, 0, 1 << 30, 0)


def _ask(room: int, session: str, fanout: int = 1) -> TransferInfo:
    return TransferInfo(room, "10.6.0.1", 6000, session, BASE, 0, 4, HIDDEN, "torch.bfloat16", False, fanout, 0, 4)


def _offer(room: int) -> Offer:
    return Offer(room, object(), 0x7000_0000, 4, HIDDEN, "torch.bfloat16", ROW)


def _cancels_of_rooms_never_sent(core: EncodeCore, count: int) -> None:
    for room in range(count):
        core.ask(_ask(room, PEER), 1.0)
        core.cancel(Cancel(room, "10.6.0.1", 6000, PEER), 1.0)


def _items_sent_right_after_a_cancel(core: EncodeCore, count: int) -> None:
    _cancels_of_rooms_never_sent(core, count)
    for room in range(count):  # each waits for a new ask of the peer; the caller clears it meanwhile
        offer = _offer(room)
        core.offer(offer, 1.0)
        core.clear(room, offer.token, 1.0)


def _cancelled_rooms_cleared(core: EncodeCore, count: int) -> None:
    for room in range(count):
        offer = _offer(room)
        core.offer(offer, 1.0)
        core.ask(_ask(room, PEER, fanout=2), 1.0)  # the rest of its fanout never asks
        core.cancel(Cancel(room, "10.6.0.1", 6000, PEER), 1.0)
        core.clear(room, offer.token, 1.0)


def _lines_run(call: Callable[[], Any]) -> int:
    """How many lines of the room rules `call` runs (a loop's body counts once a turn): work, not time."""
    lines = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(CORE_DIR) else None

    before = sys.gettrace()
    sys.settrace(calls)
    try:
        call()
    finally:
        sys.settrace(before)
    return lines


def _replacement_cost(pile: Callable[[EncodeCore, int], None], count: int) -> int:
    """Lines run by a registration that replaces a session at its status endpoint, after `pile` made `count`
    entries of another session."""
    core = EncodeCore()
    core.registration(_registration(PEER, "10.6.0.1", 6000), 0.0)
    pile(core, count)
    core.registration(_registration("10.0.0.7:17000", "10.0.0.7", 6000), 1.0)
    return _lines_run(lambda: core.registration(_registration("10.0.0.7:17555", "10.0.0.7", 6000), 1.0))


@pytest.mark.parametrize("pile", [_cancels_of_rooms_never_sent, _items_sent_right_after_a_cancel,
                                  _cancelled_rooms_cleared])
def test_replacing_a_session_does_not_visit_other_sessions_remembered_cancels(pile):
    assert _replacement_cost(pile, 1) == _replacement_cost(pile, 400)


def test_replacing_a_session_forgets_its_own_remembered_cancels():
    core = EncodeCore()
    core.registration(_registration(PEER, "10.6.0.1", 6000), 0.0)
    _cancels_of_rooms_never_sent(core, 3)
    assert all(core.expects(room) for room in range(3))  # the items would fail when they come
    core.registration(_registration("10.6.0.1:17555", "10.6.0.1", 6000), 1.0)
    assert not any(core.expects(room) for room in range(3))  # its successor's retries are not failed by them

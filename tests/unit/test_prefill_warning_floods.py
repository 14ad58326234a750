"""The prefill core's complaints under a peer that varies what its statuses say: few lines, bounded memory."""

from __future__ import annotations

import logging

import pytest
from prefill_rooms import core, routed, spec

from transfer import _io
from transfer.core.prefill import Warn
from transfer.status import TransferPoll

FLOOD = 10_000


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(_io.time, "monotonic", lambda: now[0])
    return now


def _room_asked(c) -> None:
    routed(c)
    c.receive(0.0, spec(1, slot=1))


def _room_not_asked(c) -> None:
    c.receive(0.0, spec(1, slot=1))  # still looking up its route


@pytest.mark.parametrize("setup", [_room_asked, _room_not_asked], ids=["wrong encode rank", "room not asked for"])
def test_a_peer_cycling_through_ranks_gets_one_throttled_kind(clock, caplog, setup):
    # The driver logs the core's complaints through a ThrottledLog keyed by Warn.key: a key holding the
    # rank a peer chose would make each of its statuses a new kind, taking the whole line budget (the
    # complaints of everything else left out) and churning the limiter's memory.
    c = core()
    setup(c)
    complaints = _io.ThrottledLog(logging.getLogger("test.prefill.flood"))
    with caplog.at_level(logging.WARNING, logger="test.prefill.flood"):
        for rank in range(1, FLOOD + 1):
            clock[0] += 1.0 / FLOOD  # the flood arrives over one second
            (warn,) = c.status(0.1, 1, TransferPoll.Success, rank)
            assert isinstance(warn, Warn)
            complaints.warning(warn.key, "%s", warn.message)
        complaints.warning("another", "another complaint")  # still logged, the flood notwithstanding
    assert len(caplog.messages) <= 3, caplog.messages
    assert caplog.messages[-1] == "another complaint"
    assert len(complaints._kinds) <= 2

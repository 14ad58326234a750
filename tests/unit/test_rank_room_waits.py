"""An encode rank of `epd-transfer rank` waiting for a room to conclude (its prefill ranks to ask, up to the
fanout timeout, then its writes) says every 10 s what it waits for: harness._GiveUp with the rank's line
(harness._waiting_line), on a fake clock, with a handle whose status stays where a real one would."""

from __future__ import annotations

import pytest
from fakes import FakeTime

from transfer import harness
from transfer.harness import Scenario
from transfer.status import TransferPoll


class Handle:
    """A send handle whose room concludes `status_then` once the clock reaches `concludes_at`."""

    def __init__(self, clock: FakeTime, room: int, status: TransferPoll, concludes_at: float,
                 status_then: TransferPoll = TransferPoll.Success) -> None:
        self.clock, self.room, self.status = clock, room, status
        self.concludes_at, self.status_then = concludes_at, status_then
        self.waits: list[float] = []

    def poll(self) -> TransferPoll:
        return self.status_then if self.clock.now >= self.concludes_at else self.status

    def wait(self, timeout: float) -> TransferPoll:
        self.waits.append(timeout)
        self.clock.now = min(self.clock.now + timeout, max(self.clock.now, self.concludes_at))
        return self.poll()


@pytest.fixture
def clock(monkeypatch) -> FakeTime:
    clock = FakeTime(50.0)
    monkeypatch.setattr(harness, "time", clock)
    return clock


def test_a_room_waiting_for_its_asks_is_said_every_ten_seconds_until_it_concludes(clock):
    sc = Scenario(encode_ranks=2, prefill_ranks=4, fanout_timeout_s=120.0, deadline_s=60.0)
    lines: list[str] = []
    handle = Handle(clock, 7, TransferPoll.WaitingForInput, concludes_at=50.0 + 35.0)
    status = harness._GiveUp(None, harness._waiting_line(sc, 1, lines.append)).wait(handle, 185.0)
    assert status == TransferPoll.Success
    said = ("encode rank 1: room 7 not concluded after {}s (WaitingForInput): waits for prefill ranks 2-3 to ask "
            "for it (each room at most the fanout timeout, 120s, --bootstrap-timeout)")
    assert lines == [said.format(10), said.format(20), said.format(30)]


def test_a_room_wait_the_ranks_timeout_ends_first_names_that_option(clock):
    sc = Scenario(encode_ranks=1, prefill_ranks=1, fanout_timeout_s=300.0, deadline_s=60.0)
    lines: list[str] = []
    ends = 50.0 + 22.0  # the rank's --timeout alarm, long before the 300 s fanout timeout
    handle = Handle(clock, 0, TransferPoll.WaitingForInput, concludes_at=ends)
    harness._GiveUp(None, harness._waiting_line(sc, 0, lines.append, lambda: ends - clock.now)).wait(handle, 365.0)
    said = ("encode rank 0: room 0 not concluded after {}s (WaitingForInput): waits for prefill rank 0 to ask for "
            "it (at most {}s more: --timeout ends the rank before the fanout timeout, 300s, --bootstrap-timeout)")
    assert lines == [said.format(10, 12), said.format(20, 2)]


def test_a_room_wait_the_fanout_timeout_ends_first_names_bootstrap_timeout(clock):
    sc = Scenario(encode_ranks=1, prefill_ranks=1, fanout_timeout_s=30.0, deadline_s=60.0)
    lines: list[str] = []
    handle = Handle(clock, 0, TransferPoll.WaitingForInput, concludes_at=50.0 + 12.0)
    harness._GiveUp(None, harness._waiting_line(sc, 0, lines.append, lambda: 500.0)).wait(handle, 95.0)
    assert lines == ["encode rank 0: room 0 not concluded after 10s (WaitingForInput): waits for prefill rank 0 to "
                     "ask for it (each room at most the fanout timeout, 30s, --bootstrap-timeout)"]


def test_a_room_whose_writes_go_on_says_so(clock):
    sc = Scenario(encode_ranks=1, prefill_ranks=1, fanout_timeout_s=120.0, deadline_s=60.0)
    lines: list[str] = []
    handle = Handle(clock, 3, TransferPoll.Transferring, concludes_at=50.0 + 12.0)
    harness._GiveUp(None, harness._waiting_line(sc, 0, lines.append)).wait(handle, 185.0)
    assert lines == ["encode rank 0: room 3 not concluded after 10s (Transferring): its writes to prefill rank 0 go "
                     "on (each at most --deadline 60s)"]


def test_a_wait_without_a_line_to_say_waits_in_one_piece(clock):
    handle = Handle(clock, 3, TransferPoll.WaitingForInput, concludes_at=50.0 + 40.0)
    assert harness._GiveUp(None).wait(handle, 185.0) == TransferPoll.Success
    assert handle.waits == [185.0]

"""The prefill driver's note that the last read of its status socket found it empty (`PrefillDriver._drained`):
a waiting caller's first turn does not read a socket so noted, and sleeps on its descriptor, which signals
whatever came since a read found the socket empty (and only then). So the note holds exactly when the last read
ended on an empty socket: not after one that stopped at its limit, nor after one that raised. The reads are
scripted (what `_io.take_statuses` hands over, one answer a call); the driver is made without its I/O thread and
sockets, which these reads never touch beyond the scripted call."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prefill_rooms import reading_driver

from transfer import _io
from transfer.drive import prefill as drive
from transfer.drive.prefill import PrefillDriver


def driver() -> PrefillDriver:
    """A driver with what its reads of the status socket use, and no thread or socket."""
    return reading_driver()


class Failed(Exception):
    """The scripted read that raises."""


def scripted(monkeypatch, answers: list) -> None:
    """_io.take_statuses answers `answers` in turn: (socket left empty?, n) for n lane Successes read (then,
    when not empty, the call's limit reached or one message discarded for its size), or Failed to raise."""
    script = deque(answers)

    def take(sock, lanes, most):
        answer = script.popleft()
        if answer is Failed:
            raise Failed()
        empty, settled = answer
        return list(range(settled)), None, empty

    monkeypatch.setattr(_io, "take_statuses", take)


# A read's answers: the socket left empty or not, with up to 3 messages read; or a raise.
READS = st.lists(st.one_of(st.tuples(st.booleans(), st.integers(1, 3)), st.just(Failed)), min_size=1, max_size=6)


def ends_empty(answers: list, limit: int) -> bool:
    """Whether a read of up to `limit` messages through `answers` ends on an empty socket (not at its limit, and
    not on a raise): _take_statuses()'s loop, told in full."""
    for answer in answers:
        if answer is Failed:
            return False
        empty, settled = answer
        limit -= settled + 1  # a call that ends short of empty ends on a message: one more read
        if empty:
            return True
        if limit <= 0:
            return False
    raise AssertionError("the script ran out")


@given(st.lists(READS, min_size=1, max_size=5), st.booleans())
def test_the_socket_is_noted_drained_exactly_when_the_last_read_found_it_empty(reads, drained_before):
    with pytest.MonkeyPatch.context() as monkeypatch:
        d = driver()
        d._drained = drained_before
        for answers in reads:
            # The limit the script's answers reach, so a read never runs past them.
            limit = sum(1 if answer is Failed else answer[1] for answer in answers)
            scripted(monkeypatch, answers)
            try:
                d._take_statuses(limit)
            except Failed:
                pass
            assert d._drained is ends_empty(answers, limit), answers


def test_a_read_that_stops_at_its_limit_leaves_the_socket_not_drained(monkeypatch):
    d = driver()
    d._drained = True
    scripted(monkeypatch, [(False, 1), (False, 1)])
    assert d._take_statuses(2) == ([], True)
    assert d._drained is False and d._statuses_left is True


def test_a_read_that_raises_leaves_the_socket_not_drained(monkeypatch):
    d = driver()
    d._drained = True
    scripted(monkeypatch, [(False, 1), Failed])
    with pytest.raises(Failed):
        d._take_statuses(drive.STATUSES_PER_HOLD)
    assert d._drained is False


def test_a_read_that_empties_the_socket_notes_it_drained(monkeypatch):
    d = driver()
    scripted(monkeypatch, [(False, 1), (True, 0)])
    assert d._take_statuses(drive.STATUSES_PER_HOLD) == ([], False)
    assert d._drained is True and d._statuses_left is False

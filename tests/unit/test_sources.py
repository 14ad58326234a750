"""Source registration counts: shared temporary registrations, and those the engine keeps."""

from __future__ import annotations

from transfer.core.sources import SourceCounts


def test_the_callers_own_registration_comes_before_ours():
    counts = SourceCounts()
    registered = {0x1000: 0x1000, 0x1800: 0x100}
    assert counts.base_for(0x1800, 0x1900, registered) == 0x1000  # both hold it; neither is ours
    counts.hold(0x1000)
    assert counts.base_for(0x1800, 0x1900, registered) == 0x1800  # the caller's, not ours
    assert counts.base_for(0x3000, 0x3100, registered) is None


def test_a_registration_is_released_when_its_last_holder_is_done():
    counts = SourceCounts()
    counts.hold(0x1000)
    counts.hold(0x1000)
    assert counts.release(0x1000) is False
    assert counts.release(0x1000) is True
    counts.dropped(0x1000)
    assert not counts.is_ours(0x1000) and len(counts) == 0


def test_one_the_engine_keeps_is_retried_until_dropped_or_held_again():
    counts = SourceCounts()
    counts.hold(0x1000)
    counts.hold(0x2000)
    assert counts.release(0x1000) and counts.release(0x2000)
    assert counts.kept(0x1000) is True and counts.kept(0x1000) is False  # logged once
    counts.kept(0x2000)
    assert sorted(counts.retry()) == [0x1000, 0x2000]
    counts.hold(0x2000)  # a new room reads it: its own release retries it
    assert counts.retry() == [0x1000] and counts.unreleased == {0x1000}
    counts.dropped(0x1000)
    assert counts.retry() == [] and counts.counts() == {0x2000: 1}

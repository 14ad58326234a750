"""Failure kinds and the room table's one conclude()."""

from __future__ import annotations

import pytest

from transfer.core.failure import MAX_DETAIL, Failure, FailureKind
from transfer.status import RoomTable, TransferPoll


def test_failure_takes_its_kind_by_name_and_prints_its_detail():
    failure = Failure("deadline", "no status from encode rank 0 within 60s")
    assert failure.kind is FailureKind.DEADLINE
    assert str(failure) == "no status from encode rank 0 within 60s"


def test_a_detail_quoting_hostile_text_is_one_printable_line_of_bounded_length():
    session = "evil\n2026-12-04 INFO room 7 Success\x1b[2J" + "A" * 30000
    failure = Failure(FailureKind.WRITE, f"write to {session} (room 7) failed: peer gone")
    assert failure.detail.startswith("write to evil?2026-12-04 INFO room 7 Success?[2JAAA")
    assert len(failure.detail) == MAX_DETAIL and failure.detail.endswith("AAA...")
    assert failure.detail.isprintable()
    plain = "no status from encode rank 0 within 60s"
    assert Failure(FailureKind.DEADLINE, plain).detail is plain


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError):
        Failure("exploded", "?")


def test_conclude_counts_once_and_keeps_the_first_failure():
    table = RoomTable()
    table.start(7)
    first = Failure(FailureKind.GEOMETRY, "hidden 512 != item hidden 1024")
    assert table.conclude(7, TransferPoll.Failed, first) is True
    assert table.conclude(7, TransferPoll.Failed, Failure(FailureKind.CLEARED, "cleared")) is False
    assert table.conclude(7, TransferPoll.Success) is False
    assert table.failure(7) == first
    assert table.reason(7) == "hidden 512 != item hidden 1024"
    assert table.take_concluded() == [7]


def test_conclude_ignores_an_unknown_room_and_a_success_keeps_no_failure():
    table = RoomTable()
    assert table.conclude(3, TransferPoll.Success) is False
    table.start(3)
    assert table.conclude(3, TransferPoll.Success) is True
    assert table.get(3) is TransferPoll.Success and table.failure(3) is None


def test_a_plain_text_reason_is_kept_as_other():
    table = RoomTable()
    table.start(1)
    table.fail(1, "boom")
    assert table.failure(1) == Failure(FailureKind.OTHER, "boom")


def test_a_failure_kind_prints_as_its_metric_label():
    """Callers read `failure_kind()` and print or log it next to the `rooms_failed_total{reason}` label: it must
    read `deadline` there, not Python's `FailureKind.DEADLINE` (what a str-valued Enum prints by default)."""
    assert str(FailureKind.DEADLINE) == "deadline"
    assert f"{FailureKind.CHECKSUM}" == "checksum"
    assert [str(kind) for kind in FailureKind] == [kind.value for kind in FailureKind]

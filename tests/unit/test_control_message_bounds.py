"""The control plane's whole-message bounds as a pure rule."""

from __future__ import annotations

from transfer._io import MAX_CONTROL_MESSAGE, MAX_CONTROL_PARTS, oversized


def test_a_message_is_judged_by_all_its_parts_together():
    assert not oversized([MAX_CONTROL_MESSAGE])
    assert not oversized([MAX_CONTROL_MESSAGE // 2, MAX_CONTROL_MESSAGE - MAX_CONTROL_MESSAGE // 2])
    assert oversized([MAX_CONTROL_MESSAGE - 1] * 2)
    assert oversized([MAX_CONTROL_MESSAGE // 2 + 1, MAX_CONTROL_MESSAGE // 2])


def test_a_message_of_too_many_parts_is_over_whatever_their_sizes():
    assert not oversized([0] * MAX_CONTROL_PARTS)
    assert oversized([0] * (MAX_CONTROL_PARTS + 1))


def test_the_bounds_can_be_given():
    assert oversized([5, 6], max_bytes=10)
    assert oversized([1, 1, 1], max_parts=2)
    assert not oversized([5, 5], max_bytes=10, max_parts=2)

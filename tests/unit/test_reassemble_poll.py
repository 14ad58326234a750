"""transfer.reassemble takes a sharded item's TransferPoll as ok only on success."""

from __future__ import annotations

import torch


def test_a_sharded_item_given_a_transfer_poll_is_ok_only_on_success():
    """A TransferPoll is an int, so bool() would call a room still Bootstrapping ok."""
    from transfer.reassemble import ShardedItem
    from transfer.status import TransferPoll

    full = torch.zeros(2, 4)
    for status in TransferPoll:
        assert ShardedItem(1, full, status).ok is (status == TransferPoll.Success), status
    assert ShardedItem(1, full, True).ok is True


def test_an_outcome_is_a_bool_and_a_poll_is_ok_only_on_success():
    from transfer.reassemble import _is_ok
    from transfer.status import TransferPoll

    assert [_is_ok(status) for status in TransferPoll] == [status == TransferPoll.Success for status in TransferPoll]
    assert [_is_ok(True), _is_ok(0), _is_ok(1)] == [True, False, True]

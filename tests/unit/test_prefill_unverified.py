"""A Success the prefill rank could not verify (the encode rank sent no checksum) is told apart from a verified one."""

from __future__ import annotations

from fakes import Region, Regions
from prefill_rooms import MAIN, core, routed, spec

from transfer.core.prefill import Conclude, Verify
from transfer.status import TransferPoll


def _conclusion(actions) -> Conclude:
    (conclude,) = [a for a in actions if isinstance(a, Conclude)]
    return conclude


def test_a_success_with_no_checksum_part_concludes_unverified():
    c = core()
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    conclude = _conclusion(c.status(0.1, 1, TransferPoll.Success, 0, ()))
    assert conclude.failure is None and conclude.unverified


def test_a_verified_success_is_not_unverified():
    c = core()
    routed(c)
    token, _ = c.receive(0.0, spec(1, slot=1, regions=Regions(MAIN.embedding, Region(0x900000, 4096)),
                                     deepstack=True))
    (verify,) = c.status(0.1, 1, TransferPoll.Success, 0, (11, 22))
    assert isinstance(verify, Verify)
    conclude = _conclusion(c.checksum_verified(0.2, 1, token))
    assert conclude.failure is None and not conclude.unverified


def test_a_deepstack_success_with_the_embeddings_checksum_only_is_checked_and_counted_unverified():
    c = core()
    routed(c)
    token, _ = c.receive(0.0, spec(1, slot=1, regions=Regions(MAIN.embedding, Region(0x900000, 4096)),
                                     deepstack=True))
    (verify,) = c.status(0.1, 1, TransferPoll.Success, 0, (11,))
    assert [check[0] for check in verify.checks] == ["embedding"]
    conclude = _conclusion(c.checksum_verified(0.2, 1, token))
    assert conclude.failure is None and conclude.unverified


def test_a_success_with_integrity_off_here_is_not_counted_unverified():
    # Checking was switched off on purpose on this rank: nothing the peer left out.
    c = core(integrity=False)
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    conclude = _conclusion(c.status(0.1, 1, TransferPoll.Success, 0, ()))
    assert conclude.failure is None and not conclude.unverified


def test_a_failure_is_never_unverified():
    c = core()
    routed(c)
    c.receive(0.0, spec(1, slot=1))
    conclude = _conclusion(c.status(0.1, 1, TransferPoll.Failed, 0))
    assert conclude.failure is not None and not conclude.unverified

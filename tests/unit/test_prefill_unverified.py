"""A Success the prefill rank could not verify (the encode rank sent no checksum) is told apart from a verified one."""

from __future__ import annotations

from dataclasses import dataclass

from transfer.core.prefill import Announce, Conclude, LookUpParallel, LookUpRoute, PrefillCore, RoomSpec, SendAsk, Verify
from transfer.status import TransferPoll

BOOT = "10.0.0.1:8998"


@dataclass(frozen=True)
class Region:
    addr: int
    nbytes: int


@dataclass(frozen=True)
class Regions:
    embedding: Region
    deepstack: Region | None = None


MAIN = Regions(Region(0x10000, 1 << 20))


def spec(room: int, *, regions: Regions = MAIN, slot: int = 0, deepstack: bool = False) -> RoomSpec:
    ptr = regions.embedding.addr + slot * 64
    ds_ptr = regions.deepstack.addr + slot * 32 if deepstack else 0
    return RoomSpec(room, BOOT, ptr, rows=4, hidden=8, dtype="torch.float16", row_bytes=16, row_start=0, span=4,
                    regions=regions, deepstack_ptr=ds_ptr, deepstack_nbytes=32 if deepstack else 0,
                    has_deepstack=deepstack)


def core(**kw) -> PrefillCore:
    return PrefillCore(0, 1, 1, host="10.0.0.3", status_port=5555, session_id="10.0.0.3:1234", deadline_s=60.0, **kw)


def routed(c: PrefillCore) -> None:
    """Resolves the sizes and encode rank 0's route, as a first room would."""
    _, actions = c.receive(0.0, spec(999))
    assert actions == [LookUpParallel(BOOT)]
    assert c.parallel_resolved(0.0, BOOT, 1, 1) == [LookUpRoute((BOOT, 0, 0))]
    assert [type(a) for a in c.route_resolved(0.0, (BOOT, 0, 0), ("10.0.0.2", 7000))] == [Announce, SendAsk]
    c.clear(0.0, 999)


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

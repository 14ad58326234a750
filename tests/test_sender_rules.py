"""The encode side's memory of announced receive regions (SPEC.md section 8)."""

from __future__ import annotations

import pytest

from live_helpers import LIVE
from transfer.bootstrap import BootstrapServer
from transfer.engine import Engine
from transfer.frames import Registration, TransferInfo
from transfer.sender import MAX_REGIONS_PER_SESSION, SenderPool

pytestmark = LIVE

SESSION = "10.0.0.7:17000"


@pytest.fixture(scope="module")
def pool():
    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server, \
            SenderPool(engine, 0, 1, 1, server.address) as sender:
        yield sender


def _reg(port: int, base: int, length: int = 4096) -> Registration:
    return Registration("10.0.0.7", port, SESSION, base, 0, length, 0)


def _ask(ptr: int, rows: int = 4) -> TransferInfo:
    return TransferInfo(1, "10.0.0.7", 5000, SESSION, ptr, 0, rows, 256, "torch.bfloat16", False, 1, 0, rows)


class _Item:
    row_bytes = 512
    deepstack_row_bytes = 0


def test_regions_accumulate_per_manager_and_reset_for_a_new_one(pool):
    pool._sessions.pop(SESSION, None)
    pool._file_registration(_reg(5000, 0x10000))
    pool._file_registration(_reg(5000, 0x80000))  # a per-item buffer of the same manager
    assert pool._check_regions(_Item, [_ask(0x10000)]) is None
    assert pool._check_regions(_Item, [_ask(0x80000)]) is None
    reason = pool._check_regions(_Item, [_ask(0x40000)])
    assert reason is not None and "outside registered region" in reason
    # A destination that runs past its region's end is refused too.
    assert pool._check_regions(_Item, [_ask(0x10000 + 4096 - 512, rows=2)]) is not None

    # A new session manager on the same engine (a new status endpoint): old regions are gone.
    pool._file_registration(_reg(5001, 0x200000))
    assert pool._check_regions(_Item, [_ask(0x10000)]) is not None
    assert pool._check_regions(_Item, [_ask(0x200000)]) is None
    assert len(pool._sessions[SESSION]) == 1


def test_region_memory_is_bounded(pool):
    pool._sessions.pop(SESSION, None)
    for index in range(MAX_REGIONS_PER_SESSION + 10):
        pool._file_registration(_reg(5000, 0x100000 * (index + 1)))
    assert len(pool._sessions[SESSION]) == MAX_REGIONS_PER_SESSION
    # The oldest were forgotten, the newest kept.
    assert pool._check_regions(_Item, [_ask(0x100000)]) is not None
    assert pool._check_regions(_Item, [_ask(0x100000 * (MAX_REGIONS_PER_SESSION + 10))]) is None


def test_a_peer_registration_without_lengths_accepts_any_destination(pool):
    pool._sessions.pop(SESSION, None)
    pool._file_registration(Registration("10.0.0.7", 5000, SESSION, 0x10000, 0))
    assert pool._check_regions(_Item, [_ask(0xDEAD0000)]) is None

"""transfer.wire_engine's constants."""

from __future__ import annotations

from transfer.wire_engine import CHUNK_BYTES


def test_chunk_size_default_is_four_mib():
    assert CHUNK_BYTES == 4 << 20

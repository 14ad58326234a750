"""Fixtures several live test modules share (a module that defines its own keeps it)."""

from __future__ import annotations

import pytest
from live_helpers import HOST, MOONCAKE_MISSING


@pytest.fixture(scope="module")
def engines():
    """(encode engine, prefill engine): two real Mooncake engines (tcp on loopback)."""
    if MOONCAKE_MISSING:
        pytest.skip(MOONCAKE_MISSING)
    from transfer.engine import Engine

    with Engine(HOST, "tcp") as encode, Engine(HOST, "tcp") as prefill:
        yield encode, prefill


@pytest.fixture
def server():
    """A real bootstrap server on an ephemeral loopback port."""
    from transfer.bootstrap import BootstrapServer

    with BootstrapServer(HOST, 0) as bootstrap:
        yield bootstrap

"""The bootstrap client refuses a malformed address before any I/O."""

from __future__ import annotations

import pytest

from transfer.bootstrap import BootstrapClient


def test_bad_address_is_rejected():
    with pytest.raises(ValueError, match="host:port"):
        BootstrapClient("localhost")

"""transfer.wire_engine's constants and the settings it refuses before opening anything."""

from __future__ import annotations

import pytest

from transfer.errors import ConfigError
from transfer.wire_engine import CHUNK_BYTES, WireEngine


def test_chunk_size_default_is_four_mib():
    assert CHUNK_BYTES == 4 << 20


@pytest.mark.parametrize("kwargs, named", [
    ({"chunk_bytes": 0}, "chunk_bytes"),
    ({"chunk_bytes": (64 << 20) + 1}, "chunk_bytes"),
    ({"max_connections": 0}, "max_connections"),
    ({"max_connections": 4097}, "max_connections"),
    ({"recv_timeout_s": 0.0}, "recv_timeout_s"),
    ({"idle_timeout_s": float("nan")}, "idle_timeout_s"),
    ({"reply_timeout_s": float("inf")}, "reply_timeout_s"),
    ({"connect_timeout_s": -1.0}, "connect_timeout_s"),
    ({"min_rate_bps": -1.0}, "min_rate_bps"),
    ({"min_rate_bps": float("nan")}, "min_rate_bps"),
])
def test_settings_out_of_range_are_config_errors_before_any_socket(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        WireEngine("127.0.0.1", **kwargs)

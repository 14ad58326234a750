"""The bootstrap client refuses a malformed address or a timeout that bounds nothing before any I/O."""

from __future__ import annotations

import pytest

from transfer.bootstrap import BootstrapClient
from transfer.errors import ConfigError, ConfigTypeError


def test_bad_address_is_rejected():
    with pytest.raises(ValueError, match="host:port"):
        BootstrapClient("localhost")


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, 0])
def test_a_client_timeout_that_bounds_nothing_is_refused(timeout):
    with pytest.raises(ConfigError, match=r"^timeout=.* is not a positive number of seconds up to 1000000"):
        BootstrapClient("127.0.0.1:8998", timeout=timeout)


@pytest.mark.parametrize("timeout, error", [(float("nan"), ConfigError), (float("inf"), ConfigError),
                                            ("3", ConfigTypeError)])
def test_wait_ready_refuses_a_timeout_that_bounds_nothing_before_asking(timeout, error):
    with pytest.raises(error, match=r"^timeout=.* is not a non-negative number of seconds"):
        BootstrapClient("127.0.0.1:8998").wait_ready(timeout)

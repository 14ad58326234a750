"""The defaults SPEC.md names: the bootstrap server's port 8998 (section 5) and the 120 s after which
a parked item fails (section 6), wherever our code sets them."""

from __future__ import annotations

import inspect

import pytest

from transfer import cli, config
from transfer.bootstrap import BootstrapServer
from transfer.core.encode import EncodeCore

SPEC_PORT = 8998
SPEC_PARKED_S = 120.0


def test_the_bootstrap_server_binds_8998_by_default():
    assert inspect.signature(BootstrapServer).parameters["port"].default == SPEC_PORT


def test_the_bootstrap_command_binds_8998_by_default():
    assert cli.parse_args(["bootstrap"]).port == SPEC_PORT


def test_a_parked_item_fails_after_120_s_by_default(monkeypatch):
    monkeypatch.delenv("EPD_FANOUT_TIMEOUT_S", raising=False)
    assert config.resolve("EPD_FANOUT_TIMEOUT_S") == SPEC_PARKED_S
    assert EncodeCore(now=0.0).fanout_timeout_s == SPEC_PARKED_S


@pytest.mark.parametrize("role", ["encode", "prefill"])
def test_the_rank_command_waits_120_s_for_the_bootstrap_and_the_fanout_by_default(monkeypatch, role):
    monkeypatch.delenv("EPD_FANOUT_TIMEOUT_S", raising=False)
    args = cli.parse_args(["rank", "--role", role, "--rank", "0", "--bootstrap", "127.0.0.1:8998"])
    assert args.bootstrap_timeout == SPEC_PARKED_S

"""Engine construction refuses what cannot work, at once and saying why: a hostname that is empty,
does not resolve or is not this host's, and rdma where no RDMA device is usable; `protocol` is what runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from transfer import engine as engine_mod
from transfer.errors import ConfigError, EngineError

pytestmark = pytest.mark.live

try:
    import mooncake.engine  # noqa: F401

    _MOONCAKE_MISSING = ""
except ImportError as _error:  # pragma: no cover - depends on the host
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"


@pytest.mark.parametrize("hostname, why", [
    ("", "hostname is empty"),
    ("127.0.0.l", "hostname '127.0.0.l' does not resolve"),
    ("192.0.2.1", r"hostname '192.0.2.1' \(192.0.2.1\) is not an address of this host"),
])
def test_a_hostname_that_cannot_work_is_refused_at_construction(hostname, why):
    with pytest.raises(ConfigError, match=why):
        engine_mod.Engine(hostname, "tcp")


def test_rdma_without_a_usable_device_fails_at_start(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_mod, "INFINIBAND_SYSFS", str(tmp_path))
    with pytest.raises(EngineError, match=f"no RDMA device under {tmp_path}: use protocol 'tcp'"):
        engine_mod.Engine("127.0.0.1", "rdma")


@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_auto_reports_tcp_when_the_only_device_is_down(tmp_path, monkeypatch):
    state = tmp_path / "mlx5_0" / "ports" / "1" / "state"
    state.parent.mkdir(parents=True)
    state.write_text("1: DOWN\n")
    monkeypatch.setattr(engine_mod, "INFINIBAND_SYSFS", str(tmp_path))
    with engine_mod.Engine("127.0.0.1", "auto") as engine:
        assert engine.protocol == "tcp"
        assert engine.protocol_reason == "RDMA device(s) mlx5_0 has no ACTIVE port"


@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_a_host_name_and_the_host_port_form_are_accepted(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_mod, "INFINIBAND_SYSFS", str(tmp_path))
    with engine_mod.Engine("localhost", "auto") as engine:
        assert engine.protocol == "tcp" and engine.session_id.startswith("localhost:")
    engine_mod.check_hostname("127.0.0.1:17000")  # Mooncake's host:port form passes the check


def _held_range(count: int, held: int) -> tuple[int, list[socket.socket]]:
    """The first port of `count` consecutive ports free on every interface (below the kernel's ephemeral ports,
    where Mooncake takes a range), with the first `held` of them bound and listening."""
    for first in range(20000, 30000, count):
        socks: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
        except OSError:
            for s in socks:
                s.close()
            continue
        for s in socks[held:]:
            s.close()
        for s in socks[:held]:
            s.listen()
        return first, socks[:held]
    pytest.skip("no free run of ports in 20000-30000")


#: Starts one engine in a process of its own: Mooncake reads MC_MIN_RPC_PORT/MC_MAX_RPC_PORT once a process.
_START_ONE = """
from transfer import engine
try:
    engine.Engine("127.0.0.1", "tcp").close()
except engine.EngineError as error:
    print(error)
"""


@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
@pytest.mark.parametrize("count, held, said", [
    (3, 2, "2 of its 3 ports are in use"),
    (1, 0, "the range has only 1 port"),
])
def test_a_mooncake_port_range_without_two_free_ports_is_named_when_the_engine_cannot_start(count, held, said):
    """Mooncake answers only rc=-1 (its log: `unable to find available tcp port`): the error names the range, what
    is short and what to do."""
    first, socks = _held_range(count, held)
    last = first + count - 1
    env = {**os.environ, "MC_MIN_RPC_PORT": str(first), "MC_MAX_RPC_PORT": str(last)}
    env.pop("MC_MIN_PRC_PORT", None)
    env.pop("MC_MAX_PRC_PORT", None)
    try:
        done = subprocess.run([sys.executable, "-c", _START_ONE], env=env, capture_output=True, text=True,
                              timeout=120, check=False)
    finally:
        for s in socks:
            s.close()
    text = done.stdout
    assert text.startswith("Mooncake engine failed to start on 127.0.0.1 with protocol tcp"), done.stderr[-2000:]
    assert (f"its RPC and TCP-transport listeners need two free ports of {first}-{last} (MC_MIN_RPC_PORT {first} "
            f"to MC_MAX_RPC_PORT {last}), and {said}: set MC_MIN_RPC_PORT/MC_MAX_RPC_PORT") in text

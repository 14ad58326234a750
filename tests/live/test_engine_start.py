"""Engine construction refuses what cannot work, at once and saying why: a hostname that is empty,
does not resolve or is not this host's, and rdma where no RDMA device is usable; `protocol` is what runs."""

from __future__ import annotations

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

"""The RDMA device names an Engine, `epd-transfer rank --device` and EPD_DEVICE take: comma-separated, each
stripped and empty ones dropped before Mooncake's initialize() gets them (Mooncake splits at ',' and matches
each piece exactly), and a name no RDMA device has refused with what is allowed."""

from __future__ import annotations

import pytest
from fakes import MooncakeStandIn, stand_in_mooncake

from transfer import cli
from transfer import engine as engine_module
from transfer.engine import Engine, device_names, effective_protocol
from transfer.errors import ConfigError, ConfigTypeError


@pytest.mark.parametrize("given, passed", [
    ("", ""),
    ("mlx5_0", "mlx5_0"),
    (" mlx5_0, mlx5_1 ", "mlx5_0,mlx5_1"),
    ("mlx5_0,,mlx5_1,", "mlx5_0,mlx5_1"),
    (" , ", ""),
    ("rocep65s0f0,siw_eth0.100,bnxt_re-0", "rocep65s0f0,siw_eth0.100,bnxt_re-0"),
])
def test_device_names_are_stripped_and_empty_ones_dropped(given, passed):
    assert device_names(given) == passed


@pytest.mark.parametrize("given, name", [
    ("mlx5_0,ml x5", "ml x5"),
    ("mlx5_0\t1", "mlx5_0\t1"),
    ("mlx5\x00", "mlx5\x00"),
    ("mlx5_0,\x1b[31m", "\x1b[31m"),
    ("../mlx5_0", "../mlx5_0"),
    ('mlx5_0"', 'mlx5_0"'),
    ("x" * 64, "x" * 64),
])
def test_a_name_no_rdma_device_has_is_refused_saying_what_is_allowed(given, name):
    with pytest.raises(ConfigError) as raised:
        device_names(given)
    assert str(raised.value).startswith(f"device_name: {given!r} names {name!r}, which no RDMA device is called: "
                                        f"give the names under /sys/class/infiniband separated by commas")
    assert "each 1 to 63 printable characters without spaces" in str(raised.value)


def test_a_device_list_that_is_not_text_is_a_type_error():
    with pytest.raises(ConfigTypeError, match="device_name must be a str, not list"):
        device_names(["mlx5_0"])  # type: ignore[arg-type]


class _Recording(MooncakeStandIn):
    def __init__(self) -> None:
        self.initialized: tuple = ()

    def initialize(self, *args) -> int:
        self.initialized = args
        return 0


def test_the_engine_gives_mooncake_the_names_stripped(monkeypatch):
    fake = _Recording()

    stand_in_mooncake(monkeypatch, fake)
    engine = Engine("127.0.0.1", protocol="tcp", device_name=" mlx5_0, mlx5_1 ,")
    try:
        assert fake.initialized == ("127.0.0.1", "P2PHANDSHAKE", "tcp", "mlx5_0,mlx5_1")
    finally:
        engine.close()


def test_the_engine_refuses_a_bad_name_before_mooncake_is_imported(monkeypatch):
    monkeypatch.setattr(engine_module, "_import_engine", lambda: pytest.fail("Mooncake was imported"))
    with pytest.raises(ConfigError, match="^device_name: 'mlx5_0 mlx5_1' names 'mlx5_0 mlx5_1'"):
        Engine("127.0.0.1", protocol="tcp", device_name="mlx5_0 mlx5_1")


def test_rdma_is_chosen_on_the_named_devices_as_mooncake_gets_them(tmp_path):
    for name in ("mlx5_0", "mlx5_1"):
        port = tmp_path / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
    assert effective_protocol("rdma", " mlx5_1 ,", str(tmp_path)) == ("rdma", "requested; usable: mlx5_1")


def test_rank_reads_epd_device_and_device_as_mooncake_gets_them(monkeypatch):
    monkeypatch.setenv("EPD_DEVICE", " mlx5_0, mlx5_1 ,")
    argv = ["rank", "--role", "encode", "--rank", "0", "--bootstrap", "h:1"]
    assert cli.parse_args(argv).device == "mlx5_0,mlx5_1"
    assert cli.parse_args([*argv, "--device", "mlx5_2, "]).device == "mlx5_2"


def test_rank_refuses_an_epd_device_no_device_has_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("EPD_DEVICE", "mlx5_0,ml x5")
    assert cli.main(["rank", "--role", "encode", "--rank", "0", "--bootstrap", "h:1"]) == 2
    err = capsys.readouterr().err
    assert "EPD_DEVICE='mlx5_0,ml x5': 'mlx5_0,ml x5' names 'ml x5', which no RDMA device is called" in err, err


def test_rank_refuses_a_device_option_no_device_has_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.parse_args(["rank", "--role", "encode", "--rank", "0", "--bootstrap", "h:1", "--device", "mlx5_0\x07"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device: 'mlx5_0\\x07' names 'mlx5_0\\x07', which no RDMA device is called" in err, err

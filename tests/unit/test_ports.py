"""Port settings (transfer.ports): a port, any free one, or the first free one of a range."""

from __future__ import annotations

import argparse
import errno

import pytest

from transfer import cli, ports
from transfer.errors import ConfigError, ConfigTypeError, ListenError, PortsInUse
from transfer.ports import bind_port, describe_ports, listen_error, parse_ports


@pytest.mark.parametrize("spec, expected", [
    (0, (0, 0)), (8998, (8998, 8998)), (65535, (65535, 65535)),
    ((30000, 30100), (30000, 30100)), ([30000, 30000], (30000, 30000)),
    ("30000-30100", (30000, 30100)), (" 30000 - 30100 ", (30000, 30100)), ("8998", (8998, 8998)), ("0", (0, 0)),
])
def test_a_setting_is_a_port_or_an_inclusive_range(spec, expected):
    assert parse_ports(spec) == expected


@pytest.mark.parametrize("spec, match", [
    (-1, "outside 0-65535"), (65536, "outside 0-65535"), ((1, 70000), "outside 0-65535"),
    ("30100-30000", "must run from"), ((0, 10), "must run from"), ("0-10", "must run from"),
    ("", "neither a port"), ("30000:30100", "neither a port"), ("30000-", "neither a port"),
    ("-5", "neither a port"), ("1_000", "neither a port"), ("٣٠٠٠", "neither a port"), ("123456", "neither a port"),
])
def test_a_bad_setting_is_refused_naming_it(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_ports(spec)


@pytest.mark.parametrize("spec", [True, 8998.0, None, (1, 2, 3), ("1", "2"), (True, 5)])
def test_a_setting_of_another_type_is_a_type_error(spec):
    with pytest.raises(ConfigTypeError):
        parse_ports(spec)


def test_describe_says_it_as_operators_write_it():
    assert [describe_ports(s) for s in (0, 8998, (30000, 30100))] == ["any free port", "8998", "30000-30100"]


def _binder(busy: set[int], error: int = errno.EADDRINUSE):
    """A bind that fails with `error` on the ports in `busy`, recording every port it was asked for."""
    tried: list[int] = []

    def bind(port: int) -> str:
        tried.append(port)
        if port in busy:
            raise OSError(error, f"port {port} taken")
        return f"bound {port}"

    return bind, tried


def test_a_range_takes_its_first_free_port_in_order():
    bind, tried = _binder({30000, 30001})
    assert bind_port("30000-30005", bind, "x") == "bound 30002"
    assert tried == [30000, 30001, 30002]


def test_a_range_with_no_free_port_names_the_listener_and_the_range():
    bind, tried = _binder({30000, 30001, 30002})
    with pytest.raises(PortsInUse, match=r"^\[Errno 98\] bootstrap server on 10\.0\.0\.1: no free port in "
                                         r"30000-30002: every one is in use$") as caught:
        bind_port((30000, 30002), bind, "bootstrap server on 10.0.0.1")
    assert tried == [30000, 30001, 30002]
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.EADDRINUSE


def test_any_other_bind_error_stops_at_once():
    bind, tried = _binder({30000}, errno.EADDRNOTAVAIL)
    with pytest.raises(OSError, match="port 30000 taken") as caught:
        bind_port((30000, 30005), bind, "x")
    assert tried == [30000] and not isinstance(caught.value, PortsInUse)


def test_an_error_carrying_the_errno_without_being_an_oserror_counts_as_in_use():
    class ZMQLike(Exception):
        errno = errno.EADDRINUSE

    tried: list[int] = []

    def bind(port: int) -> int:
        tried.append(port)
        if port == 30000:
            raise ZMQLike()
        return port

    assert bind_port("30000-30001", bind, "x") == 30001 and tried == [30000, 30001]


@pytest.mark.parametrize("spec", [0, 8998])
def test_one_port_is_bound_as_given_and_its_error_is_unchanged(spec):
    bind, tried = _binder({8998})
    if spec == 8998:
        with pytest.raises(OSError, match="port 8998 taken") as caught:
            bind_port(spec, bind, "x")
        assert not isinstance(caught.value, PortsInUse)
    else:
        assert bind_port(spec, bind, "x") == "bound 0"
    assert tried == [spec]


def test_a_bind_refused_a_port_it_may_not_take_says_which_ports_it_may():
    refused = listen_error("wire listener", "10.0.0.1", 80, OSError(errno.EACCES, "Permission denied"))
    assert type(refused) is ListenError and refused.errno == errno.EACCES
    assert refused.strerror == (
        "wire listener cannot listen on 10.0.0.1:80: Permission denied: this process may not listen on port 80 (a "
        "port below 1024 needs root or the CAP_NET_BIND_SERVICE capability); give a port of 1024 or more, 0 (any "
        "free one) or a range FIRST-LAST")


def test_a_bind_short_of_file_descriptors_says_to_raise_the_limit():
    refused = listen_error("bootstrap server", "::1", 8998, OSError(errno.EMFILE, "Too many open files"))
    assert type(refused) is ListenError and refused.errno == errno.EMFILE
    assert refused.strerror == ("bootstrap server cannot listen on [::1]:8998: Too many open files: no file descriptor "
                                "left; raise the limit on open files (ulimit -n) or close what this process holds open")


@pytest.mark.parametrize("number", [errno.EINVAL, errno.EAFNOSUPPORT, errno.ENODEV])
def test_any_other_bind_error_is_a_listen_error_with_its_errno_saying_what_to_do(number):
    refused = listen_error("bootstrap server", "fe80::1", 8998, OSError(number, "refused"), reached="the server")
    assert type(refused) is ListenError and refused.errno == number
    assert refused.strerror == ("bootstrap server cannot listen on [fe80::1]:8998: refused: give an IP address of "
                                "this host that it can listen on (the one peers reach the server on) and a port of "
                                "1024 or more, 0 (any free one) or a range FIRST-LAST")


def test_a_port_in_use_is_a_listen_error_too():
    in_use = listen_error("wire listener", "10.0.0.1", 8998, OSError(errno.EADDRINUSE, "Address already in use"))
    assert isinstance(in_use, PortsInUse) and isinstance(in_use, ListenError) and in_use.errno == errno.EADDRINUSE


def test_the_cli_takes_a_port_or_a_range_and_refuses_anything_else():
    parser = cli.build_parser()
    assert parser.parse_args(["bootstrap", "--port", "30000-30100"]).port == "30000-30100"
    assert parser.parse_args(["bootstrap", "--port", "9000"]).port == 9000
    assert parser.parse_args(["bootstrap"]).port == 8998
    with pytest.raises(argparse.ArgumentTypeError, match="must run from"):
        cli._ports("30100-30000")


def test_a_rank_passes_its_port_range_to_its_scenario(monkeypatch, capsys):
    seen = {}

    def encode_rank(sc, rank, *args, **kwargs):
        seen["ports"] = sc.ports
        return {"role": "encode", "rank": rank, "rooms": [], "failed": []}

    from transfer import harness

    monkeypatch.setattr(harness, "encode_rank", encode_rank)
    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))  # a Mooncake path: rank checks it first
    monkeypatch.setattr(cli, "_wait_for_bootstrap", lambda who, address, timeout_s, ends=None: timeout_s)  # it answers
    argv = ["rank", "--role", "encode", "--rank", "0", "--bootstrap", "127.0.0.1:1", "--ports", "30000-30009"]
    assert cli.main(argv) == 0
    assert seen["ports"] == "30000-30009"


def test_a_wire_rank_refuses_one_port_for_its_two_listeners(capsys):
    argv = ["rank", "--role", "encode", "--rank", "0", "--bootstrap", "127.0.0.1:1", "--protocol", "wire",
            "--ports", "30000"]
    assert cli.main(argv) == 2
    assert "give a range FIRST-LAST" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "0", "00", "0.0", "0.0.0", "0x0", "000.000.000.000",
                                  "::ffff:0.0.0.0", "[::ffff:0:0]", "0:17000", "0x0:17000", "0.0.0.0:17000"])
def test_every_spelling_the_system_reads_as_the_unspecified_address_is_a_wildcard(host):
    # getaddrinfo() (under connect() and bind()) reads inet_aton's forms of 0.0.0.0, which ipaddress does not.
    assert ports.is_wildcard(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.0", "::1", "[::ffff:10.0.0.1]", "node0", "0.example", "cafe",
                                  "0xdeadbeef", "1", "", "10.0.0.1:17000"])
def test_an_address_or_name_of_a_host_is_no_wildcard(host):
    assert not ports.is_wildcard(host)

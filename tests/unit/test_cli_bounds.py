"""What the command line refuses before anything starts: seconds past the bound of the EPD_* seconds,
bench options its ranks would die on, and an output folder that cannot be written."""

from __future__ import annotations

import pytest

from transfer import cli, config, doctor, harness

RANK = ["rank", "--role", "encode", "--rank", "0", "--bootstrap", "127.0.0.1:8998"]

TOO_LONG = [
    (["demo", "--deadline", "2e6"], "--deadline"),
    (["demo", "--timeout", "1e300"], "--timeout"),
    ([*RANK, "--deadline", "2e6"], "--deadline"),
    ([*RANK, "--timeout", "1e300"], "--timeout"),
    ([*RANK, "--bootstrap-timeout", "1e7"], "--bootstrap-timeout"),
    ([*RANK, "--linger", "1e7"], "--linger"),
    (["bench", "--deadline", "2e6"], "--deadline"),
]

BENCH_REFUSES = [
    (["bench", "--items", "-5"], "--items"),
    (["bench", "--items", "0"], "--items"),
    (["bench", "--repeat", "-3"], "--repeat"),
    (["bench", "--timeout", "-1"], "--timeout"),
    (["bench", "--timeout", "0"], "--timeout"),
    (["bench", "--raw-writers", "0"], "--raw-writers"),
    (["bench", "--deadline", "nan"], "--deadline"),
    (["bench", "--deadline", "-1"], "--deadline"),
    (["bench", "--depth", "-1"], "--depth"),
    (["bench", "--cell-mib", "0"], "--cell-mib"),
    (["bench", "--min-items", "0"], "--min-items"),
    (["bench", "--dtype", "garbage"], "--dtype"),
]


def _refused_in_one_line(argv: list[str], capsys) -> str:
    """The one error line parsing argv prints (exit 2)."""
    with pytest.raises(SystemExit) as done:
        cli.build_parser().parse_args(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, option", TOO_LONG, ids=[" ".join(a) for a, _ in TOO_LONG])
def test_seconds_options_stop_at_the_bound_of_the_epd_seconds(argv, option, capsys):
    err = _refused_in_one_line(argv, capsys)
    assert f"argument {option}:" in err and f"up to {config.MAX_SECONDS:.0f}" in err


@pytest.mark.parametrize("argv, option", [
    (["demo", "--deadline", "\uff15"], "--deadline"), ([*RANK, "--linger", "\u0663"], "--linger"),
    (["demo", "--items", "\uff11\uff16"], "--items"), ([*RANK, "--first-room", "\u0667"], "--first-room"),
    (["bench", "--repeat", "\u0663"], "--repeat"), (["bench", "--fanouts", "\uff11,\uff12"], "--fanouts"),
    (["bench", "--sizes", "\uff11x\uff14"], "--sizes"), (["bench", "--sizes", "\u00b2x4"], "--sizes"),
])
def test_numbers_in_other_scripts_digits_are_refused_as_the_epd_variables_refuse_them(argv, option, capsys):
    err = _refused_in_one_line(argv, capsys)
    assert f"argument {option}: {'item size ' if option == '--sizes' else ''}{argv[-1]!r} is not " in err, err


def test_the_bound_itself_is_taken():
    bound = f"{config.MAX_SECONDS:g}"
    args = cli.build_parser().parse_args(["demo", "--deadline", bound, "--timeout", bound])
    assert args.deadline == args.timeout == config.MAX_SECONDS


@pytest.mark.parametrize("argv, option", BENCH_REFUSES, ids=[" ".join(a) for a, _ in BENCH_REFUSES])
def test_bench_refuses_what_its_ranks_would_fail_on(argv, option, capsys):
    assert f"argument {option}:" in _refused_in_one_line(argv, capsys)


def test_bench_takes_what_it_took():
    args = cli.build_parser().parse_args(["bench", "--items", "4", "--repeat", "3", "--depth", "8",
                                          "--deadline", "2.5", "--timeout", "30", "--dtype", "bfloat16"])
    assert (args.items, args.repeat, args.depth, args.deadline, args.timeout) == (4, 3, 8, 2.5, 30.0)
    assert args.dtype == "torch.bfloat16"


@pytest.mark.parametrize("command", ["demo", "doctor"])
def test_an_unwritable_json_folder_is_refused_before_the_run(command, monkeypatch, tmp_path, capsys):
    def ran(*_args, **_kwargs):
        raise AssertionError(f"{command} ran before refusing its --json folder")

    monkeypatch.setattr(harness, "run", ran)
    monkeypatch.setattr(doctor, "collect_report", ran)
    monkeypatch.setattr(doctor, "run", ran)
    dest = tmp_path / "missing" / "x.json"
    assert cli.main([command, "--json", str(dest)]) == 2
    err = capsys.readouterr().err
    assert err == (f"epd-transfer {command}: --json {dest}: folder {dest.parent} does not exist or is not "
                   f"writable\n")


@pytest.mark.parametrize("command", ["demo", "bench"])
@pytest.mark.parametrize("environ, said", [
    ({"EPD_POLL_MAX_S": "2"}, "poll_max_s (EPD_POLL_MAX_S) is 2 s; at most 1 s"),
    ({"EPD_POLL_MIN_S": "0.005", "EPD_POLL_MAX_S": "0.002"}, "poll_min_s (EPD_POLL_MIN_S) 0.005 s is above"),
    ({"EPD_TOKEN": "a\x01b"}, "EPD_TOKEN: "),
    ({"EPD_DEVICE": "mlx5_0,a/b"}, "EPD_DEVICE='mlx5_0,a/b': "),
])
def test_a_variable_the_ranks_would_refuse_stops_the_run_before_any_rank_starts(command, environ, said, monkeypatch,
                                                                                 capsys):
    from transfer import bench

    def ran(*_args, **_kwargs):
        raise AssertionError(f"{command} started its ranks")

    monkeypatch.setattr(harness, "run", ran)
    monkeypatch.setattr(bench, "main", ran)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"epd-transfer {command}: ") and said in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["demo", "bench", "rank"])
def test_a_misspelt_variable_is_named_with_the_one_meant_and_refuses_nothing(command, monkeypatch, capsys):
    import os

    for name in [name for name in os.environ if name.startswith("EPD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("EPD_DEADLINE", "5")
    monkeypatch.setenv("EPD_ENCODE_TP", "2")  # the launch scripts read it
    monkeypatch.setenv("EPD_SEND_DEPTH", "8")
    assert cli._environment_refused(command) is False
    assert capsys.readouterr().err == (f"epd-transfer {command}: warning: EPD_DEADLINE is read by nothing here (did "
                                       f"you mean EPD_DEADLINE_S?): unset or rename it (`epd-transfer doctor` lists "
                                       f"what is read)\n")
    monkeypatch.delenv("EPD_DEADLINE")
    assert cli._environment_refused(command) is False
    assert capsys.readouterr().err == ""


def test_a_fanout_timeout_longer_than_the_quarantine_allows_is_a_warning_that_refuses_nothing(monkeypatch, capsys):
    import os

    for name in [name for name in os.environ if name.startswith(("EPD_", "MC_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("EPD_FANOUT_TIMEOUT_S", "600")
    assert cli._environment_refused("rank") is False
    err = capsys.readouterr().err
    assert err.startswith("epd-transfer rank: warning: the receive pools' default quarantine, 280 s, is shorter "
                          "than two fanout timeouts (EPD_FANOUT_TIMEOUT_S 600 s)") and err.count("\n") == 1, err


@pytest.mark.parametrize("address", ["[::1:18990", "::1:8998", "[]:1", "a]:1", "host:0", ":80", "host:\uff18\uff19\uff19\uff18",
                                     "host:\u0663", "host:\u00b2", "host:" + "9" * 5000, "host:00000065536"],
                         ids=lambda address: address if len(address) < 20 else f"{address[:12]}...")
def test_a_bootstrap_address_that_is_not_host_port_is_refused(address, capsys):
    err = _refused_in_one_line(["rank", "--role", "encode", "--rank", "0", "--bootstrap", address], capsys)
    assert f"'{address}' is not HOST:PORT" in err


@pytest.mark.parametrize("address", ["127.0.0.1:8998", "[::1]:8998", "encode-node.example:1"])
def test_a_bootstrap_address_in_host_port_form_is_taken(address):
    args = cli.build_parser().parse_args(["rank", "--role", "encode", "--rank", "0", "--bootstrap", address])
    assert args.bootstrap == address


@pytest.mark.parametrize("address, said", [
    ("bad host:8998", "with no space or control character in its host"),
    ("a..b:8998", "with a host name the resolver takes"),
])
def test_a_bootstrap_address_the_bootstrap_client_would_refuse_is_refused_before_anything_starts(address, said, capsys):
    err = _refused_in_one_line(["rank", "--role", "encode", "--rank", "0", "--bootstrap", address], capsys)
    assert f"argument --bootstrap: bootstrap address must be host:port {said}" in err and repr(address) in err

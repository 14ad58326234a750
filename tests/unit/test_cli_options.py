"""epd-transfer's command line: --version, -v anywhere, every option's help and default, --json [FILE]
on every command, the demo's verdict, and what `rank` does with --device, --node and its summary."""

from __future__ import annotations

import argparse
import json

import pytest

from transfer import cli, harness


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_version_comes_from_the_package_metadata(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"epd-transfer {metadata.version('epd-transfer')}"


@pytest.mark.parametrize("argv", [["-v", "doctor"], ["doctor", "-v"], ["doctor", "--verbose"]])
def test_verbose_works_before_and_after_the_subcommand(argv):
    assert cli.build_parser().parse_args(argv).verbose is True


def test_verbose_is_off_unless_given():
    assert cli.build_parser().parse_args(["doctor"]).verbose is False


def test_every_option_has_help_and_shows_its_default():
    for name, parser in _subcommands(cli.build_parser()).items():
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[-1]
            assert action.help, f"{name} {flag} has no help text"
            if action.required or action.default is False or action.default is argparse.SUPPRESS:
                continue
            shown = parser._get_formatter()._get_help_string(action)
            assert "default" in shown, f"{name} {flag}: its help does not say its default ({shown!r})"
        assert "==SUPPRESS==" not in text


def test_the_demo_usage_spells_its_options_as_the_readme_does():
    usage = _subcommands(cli.build_parser())["demo"].format_usage()
    for shown in ("[--deepstack K]", "[--json [FILE]]", "[--identity]", "[--per-block]"):
        assert shown in usage, (shown, usage)


@pytest.mark.parametrize("command", ["demo", "doctor", "bench"])
def test_json_alone_prints_and_json_file_writes(command):
    parser = cli.build_parser()
    assert parser.parse_args([command, "--json"]).json == "-"
    assert parser.parse_args([command, "--json", "out.json"]).json == "out.json"
    assert parser.parse_args([command]).json is None


def test_emit_json_writes_the_file_and_names_it(tmp_path, capsys):
    dest = tmp_path / "r.json"
    cli._emit_json("demo", {"items": 3}, str(dest))
    assert json.loads(dest.read_text()) == {"items": 3}
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"wrote JSON to {dest}" in captured.err


def test_bench_refuses_an_unwritable_json_folder_before_measuring(tmp_path, capsys):
    assert cli.main(["bench", "--json", str(tmp_path / "missing" / "rows.json")]) == 2
    assert "does not exist or is not writable" in capsys.readouterr().err


def _summary(**overrides) -> dict:
    summary = {"items": 4, "bytes": 0, "failed": 4, "retried": 0, "verified": False, "gbps": 0.0, "rooms_per_s": 0.0,
               "p50_ms": 0.0, "p99_ms": 0.0, "protocol": "tcp", "failures": ["prefill 0 room 0: deadline"],
               "mismatches": [], "encode_bytes": [0]}
    summary.update(overrides)
    return summary


def test_summarize_does_not_verify_a_run_where_nothing_landed():
    sc = harness.Scenario(items=2, prefill_ranks=1)
    failed = {"role": "prefill", "rank": 0, "rooms": [0, 1], "failed": [(0, "deadline"), (1, "deadline")],
              "latencies": [], "bytes": 0, "verified_bytes": 0, "bad": [], "retried": 0, "t_start": 1.0, "t_end": 2.0}
    summary = harness.summarize(sc, [failed])
    assert summary["verified"] is False and summary["failed"] == 2


def test_summarize_verifies_a_prefill_rank_whose_every_shard_is_empty():
    # A span smaller than the prefill group leaves a rank no rows: its rooms succeed with nothing written, and
    # its check is that the whole slot kept its sentinel bytes (as `epd-transfer rank` reports one rank).
    sc = harness.Scenario(items=2, prefill_ranks=2, span=1)
    empty = {"role": "prefill", "rank": 1, "rooms": [0, 1], "failed": [], "latencies": [0.001, 0.001],
             "bytes": 0, "verified_bytes": 0, "bad": [], "retried": 0, "t_start": 1.0, "t_end": 2.0}
    summary = harness.summarize(sc, [empty])
    assert summary["verified"] is True and summary["failed"] == 0 and summary["bytes"] == 0
    touched = {**empty, "bad": ["room 1: bytes outside the shard were written"]}
    assert harness.summarize(sc, [touched])["verified"] is False
    said = cli._verified_text(_summary(failed=0, failures=[], mismatches=["prefill 1 room 1: bytes outside the "
                                                                          "shard were written"]))
    assert said == "NO (landed bytes differ from what was sent)"


def test_a_demo_where_every_room_failed_says_verified_no(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))
    monkeypatch.setattr(harness, "run", lambda sc: _summary())
    assert cli.main(["demo", "--items", "4"]) == 1
    out = capsys.readouterr().out
    assert "verified  NO (no item landed)" in out
    assert "every byte checked" not in out and "verified  yes" not in out


def test_a_demo_that_verified_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))
    monkeypatch.setattr(harness, "run", lambda sc: _summary(bytes=2 << 20, failed=0, verified=True, failures=[]))
    assert cli.main(["demo", "--items", "4"]) == 0
    out = capsys.readouterr().out
    assert "verified  yes" in out and "(2.0 MiB landed, every byte checked)" in out


def test_a_demo_that_asked_for_rooms_again_says_how_many(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))
    monkeypatch.setattr(harness, "run", lambda sc: _summary(bytes=2 << 20, failed=0, verified=True, failures=[],
                                                            retried=2))
    assert cli.main(["demo", "--items", "4"]) == 0
    assert "  retried   2 (asked for again after their bootstrap server's pause)" in capsys.readouterr().out


def test_summarize_counts_the_rooms_asked_for_again_of_every_prefill_rank():
    sc = harness.Scenario(items=2, prefill_ranks=2)
    reports = [{"role": "prefill", "rank": rank, "rooms": [0, 1], "failed": [], "latencies": [0.001, 0.001],
                "bytes": 64, "verified_bytes": 64, "bad": [], "retried": retried, "t_start": 1.0, "t_end": 2.0}
               for rank, retried in ((0, 3), (1, 1))]
    assert harness.summarize(sc, reports)["retried"] == 4


def test_rank_device_reaches_the_mooncake_engine(monkeypatch):
    import transfer.engine

    seen = {}

    class FakeEngine:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(transfer.engine, "Engine", FakeEngine)
    harness.make_engine(harness.Scenario(protocol="rdma", device="mlx5_1"))
    assert seen == {"hostname": "127.0.0.1", "protocol": "rdma", "device_name": "mlx5_1"}


def test_rank_device_defaults_to_epd_device(monkeypatch):
    monkeypatch.setenv("EPD_DEVICE", "mlx5_3")
    args = cli.parse_args(["rank", "--role", "encode", "--rank", "0", "--bootstrap", "h:1"])
    assert args.device == "mlx5_3"


def test_rank_refuses_a_device_with_the_wire_protocol(capsys):
    argv = ["rank", "--role", "encode", "--rank", "0", "--bootstrap", "127.0.0.1:1", "--protocol", "wire",
            "--device", "mlx5_0"]
    assert cli.main(argv) == 2
    assert "--device mlx5_0 names a Mooncake RDMA device" in capsys.readouterr().err


def test_a_prefill_ranks_summary_names_its_node_and_rank(monkeypatch, capsys):
    report = {"role": "prefill", "rank": 1, "rooms": [5], "failed": [], "latencies": [0.001], "bytes": 64,
              "verified_bytes": 64, "bad": [], "retried": 0, "t_start": 1.0, "t_end": 2.0}
    monkeypatch.setattr(cli, "_wait_for_route", lambda *a: None)
    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))
    monkeypatch.setattr(harness, "prefill_rank", lambda sc, rank, *a, **kw: dict(report, rank=rank))
    argv = ["rank", "--role", "prefill", "--rank", "1", "-P", "2", "--node", "3", "--items", "1",
            "--first-room", "5", "--bootstrap", "127.0.0.1:1"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["role"], summary["node"], summary["rank"]) == ("prefill", 3, 1)

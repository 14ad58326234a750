"""What the command line refuses, or reports in one line, before a run starts (or instead of a traceback):
an rdma protocol with no device, a Mooncake path where mooncake.engine does not import, a --json/--plot
that cannot be written, options that exclude each other, library EPD_* values on `rank`, a listener that
cannot bind, a bootstrap range in use, and rooms past the wire's last room."""

from __future__ import annotations

import errno
import json
import os
import signal

import pytest

from transfer import bench, cli, harness

RANK = ["rank", "--role", "encode", "--rank", "0", "--bootstrap", "127.0.0.1:1"]


def _never(*args, **kwargs):
    raise AssertionError("the run started")


@pytest.fixture
def no_rdma(monkeypatch, tmp_path):
    """This host as one without an RDMA device, whatever it has."""
    import transfer.engine

    monkeypatch.setattr(transfer.engine, "INFINIBAND_SYSFS", str(tmp_path / "infiniband"))


@pytest.mark.parametrize("argv", [["demo", "--protocol", "rdma"],
                                  ["bench", "--protocol", "rdma", "--paths", "epd"]])
def test_rdma_without_a_device_is_refused_before_any_rank_starts(argv, no_rdma, monkeypatch, capsys):
    # Refused in one line up front, not by each rank failing to start its engine with a traceback.
    monkeypatch.setattr(harness, "run", _never)
    monkeypatch.setattr(bench, "main", _never)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"epd-transfer {argv[0]}: protocol 'rdma' needs a usable RDMA device" in err


PREFILL_RANK = ["rank", "--role", "prefill", "--rank", "0", "--bootstrap", "127.0.0.1:1"]


@pytest.fixture(autouse=True)
def bootstrap_answers(monkeypatch):
    """An encode rank here finds its bootstrap server answering at once: it waits for nothing (no socket)."""
    monkeypatch.setattr(cli, "_wait_for_bootstrap", lambda who, address, timeout_s, ends=None: timeout_s)


def _no_rank_starts(monkeypatch):
    monkeypatch.setattr(harness, "encode_rank", _never)
    monkeypatch.setattr(harness, "prefill_rank", _never)
    monkeypatch.setattr(cli, "_wait_for_route", _never)  # a prefill rank would wait out --bootstrap-timeout


@pytest.mark.parametrize("argv", [RANK, PREFILL_RANK], ids=["encode", "prefill"])
def test_a_rank_whose_rdma_cannot_run_is_refused_before_it_waits_for_anyone(argv, no_rdma, monkeypatch, capsys):
    # As demo and bench: not a prefill rank that waits for its encode rank first and then says only that
    # it never registered, while the reason (no device) waits behind it.
    _no_rank_starts(monkeypatch)
    assert cli.main([*argv, "--protocol", "rdma"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epd-transfer rank: protocol 'rdma' needs a usable RDMA device") and err.count("\n") == 1


def test_a_rank_naming_a_device_this_host_lacks_is_refused_before_it_starts(no_rdma, monkeypatch, capsys):
    _no_rank_starts(monkeypatch)
    assert cli.main([*PREFILL_RANK, "--protocol", "rdma", "--device", "mlx5_9"]) == 2
    assert capsys.readouterr().err.startswith("epd-transfer rank: RDMA device mlx5_9 not under")


def test_a_bench_of_paths_without_mooncake_does_not_need_its_protocol(no_rdma, monkeypatch):
    monkeypatch.setattr(bench, "main", lambda args: 0)
    assert cli.main(["bench", "--protocol", "rdma", "--paths", "wire,memcpy"]) == 0



@pytest.fixture
def no_mooncake(monkeypatch):
    """This host as one whose mooncake.engine does not import, whatever it has."""
    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (False, "import fails: ModuleNotFoundError: No module "
                                                               "named 'mooncake'"))


@pytest.mark.parametrize("argv", [["demo"], ["demo", "--protocol", "tcp"],
                                  ["bench", "--paths", "epd"], ["bench", "--protocol", "auto"]])
def test_a_mooncake_protocol_without_mooncake_is_refused_before_any_rank_starts(argv, no_rdma, no_mooncake,
                                                                               monkeypatch, capsys):
    monkeypatch.setattr(harness, "run", _never)
    monkeypatch.setattr(bench, "main", _never)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"epd-transfer {argv[0]}: cannot import mooncake.engine (")
    assert "No module named 'mooncake'" in err and "pip install mooncake-transfer-engine" in err
    assert ("--paths wire,memcpy" if argv[0] == "bench" else "--protocol wire") in err and "Traceback" not in err


def test_a_rank_on_a_mooncake_path_where_mooncake_does_not_import_is_refused_before_it_starts(no_rdma, no_mooncake,
                                                                                            monkeypatch, capsys):
    _no_rank_starts(monkeypatch)
    assert cli.main([*PREFILL_RANK, "--protocol", "tcp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epd-transfer rank: cannot import mooncake.engine (") and "--protocol wire" in err


def test_a_wire_rank_does_not_need_mooncake(no_rdma, no_mooncake, monkeypatch):
    monkeypatch.setattr(harness, "encode_rank", lambda *args, **kwargs: {"failed": []})
    assert cli.main([*RANK, "--protocol", "wire", "--linger", "0"]) == 0


@pytest.mark.parametrize("argv", [["demo", "--protocol", "wire"], ["bench", "--paths", "wire,memcpy"]])
def test_the_wire_path_runs_without_mooncake(argv, no_rdma, no_mooncake, monkeypatch):
    monkeypatch.setattr(harness, "run", lambda sc: {"failed": 0, "verified": True})
    monkeypatch.setattr(bench, "main", lambda args: 0)
    monkeypatch.setattr(cli, "_emit_json", lambda *args: None)
    assert cli.main([*argv, "--json"]) == 0


@pytest.mark.parametrize("argv", [["demo", "--json", "{dir}"], ["doctor", "--json", "{dir}"],
                                  ["bench", "--json", "{dir}"], ["bench", "--plot", "{dir}"]])
def test_an_output_file_that_is_a_folder_is_refused_before_the_run(argv, tmp_path, monkeypatch, capsys):
    from transfer import doctor

    monkeypatch.setattr(harness, "run", _never)
    monkeypatch.setattr(bench, "main", _never)
    monkeypatch.setattr(doctor, "collect_report", _never)
    assert cli.main([a.format(dir=tmp_path) for a in argv]) == 2
    assert f"{argv[1]} {tmp_path} is a folder" in capsys.readouterr().err


UNWRITABLE = [["demo", "--json", "{file}"], ["doctor", "--json", "{file}"], ["bench", "--json", "{file}"],
              ["bench", "--plot", "{file}.png"]]


@pytest.mark.parametrize("argv", UNWRITABLE, ids=[" ".join(a[:2]) for a in UNWRITABLE])
def test_an_output_file_no_file_can_be_made_at_is_refused_before_the_run(argv, monkeypatch, capsys):
    # /proc takes no new file, though os.access() says root may write there.
    from transfer import doctor

    monkeypatch.setattr(harness, "run", _never)
    monkeypatch.setattr(bench, "main", _never)
    monkeypatch.setattr(doctor, "collect_report", _never)
    monkeypatch.setattr(doctor, "run", _never)
    path = argv[2].format(file="/proc/epd-out")
    assert cli.main([*argv[:2], path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"epd-transfer {argv[0]}: {argv[1]} {path}") and err.count("\n") == 1, err
    assert not os.path.exists(path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only file")
@pytest.mark.parametrize("argv", UNWRITABLE, ids=[" ".join(a[:2]) for a in UNWRITABLE])
def test_a_read_only_output_file_is_refused_before_the_run(argv, tmp_path, monkeypatch, capsys):
    from transfer import doctor

    monkeypatch.setattr(harness, "run", _never)
    monkeypatch.setattr(bench, "main", _never)
    monkeypatch.setattr(doctor, "collect_report", _never)
    monkeypatch.setattr(doctor, "run", _never)
    path = argv[2].format(file=str(tmp_path / "out"))
    with open(path, "w") as fh:
        fh.write("kept")
    os.chmod(path, 0o444)
    assert cli.main([*argv[:2], path]) == 2
    assert f"{argv[1]} {path} cannot be written (Permission denied)" in capsys.readouterr().err
    with open(path) as fh:
        assert fh.read() == "kept"


def test_a_writable_output_file_is_left_as_it_was(tmp_path, monkeypatch):
    from transfer import doctor

    monkeypatch.setattr(doctor, "run", lambda **kw: 0)
    kept, new = tmp_path / "kept.json", tmp_path / "new.json"
    kept.write_text("kept")
    args = cli.parse_args(["doctor", "--json", str(kept)])
    assert cli._output_folders_writable("doctor", args, ("json",))
    args = cli.parse_args(["doctor", "--json", str(new)])
    assert cli._output_folders_writable("doctor", args, ("json",))
    assert kept.read_text() == "kept" and not new.exists()


@pytest.mark.parametrize("where, why", [("a-file", "it is not a folder"), ("/proc/epd-logs", "No such file or directory")])
def test_a_log_dir_that_cannot_hold_the_logs_is_refused_before_the_bench(where, why, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "main", _never)
    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))
    (tmp_path / "a-file").write_text("")
    folder = where if where.startswith("/") else str(tmp_path / where)
    assert cli.main(["bench", "--log-dir", folder]) == 2
    err = capsys.readouterr().err
    assert err == (f"epd-transfer bench: --log-dir {folder} cannot hold the ranks' logs ({why}): name a folder "
                   f"you may write (it is made if missing)\n")


def test_a_log_dir_is_made_before_the_bench(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "main", lambda args: 0)
    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))
    folder = tmp_path / "logs" / "today"
    assert cli.main(["bench", "--log-dir", str(folder)]) == 0
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_a_plot_format_matplotlib_cannot_write_is_refused_before_the_bench(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "main", _never)
    assert cli.main(["bench", "--plot", str(tmp_path / "out.txt")]) == 2
    assert "out.txt: name a file ending in .png" in capsys.readouterr().err
    monkeypatch.setattr(bench, "main", lambda args: 0)
    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))
    assert cli.main(["bench", "--plot", str(tmp_path / "out.PDF")]) == 0


@pytest.mark.parametrize("argv, conflict", [
    ([*RANK, "--bootstrap-bind", "10.9.9.9"], "--bootstrap-bind"),
    (["demo", "--identity", "--per-block"], "--per-block"),
    ([*RANK, "--identity", "--per-block"], "--per-block"),
    ([*RANK, "--timeout", "3", "--linger", "3"], "--linger 3 is not shorter than --timeout 3"),
    ([*RANK, "--timeout", "1"], "--linger 2 is not shorter than --timeout 1"),
])
def test_an_option_that_would_be_ignored_is_a_parser_error(argv, conflict, capsys):
    with pytest.raises(SystemExit) as done:
        cli.parse_args(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"epd-transfer {argv[0]}: error: " in err and conflict in err


def test_a_prefill_rank_takes_a_timeout_shorter_than_the_linger_it_does_not_use():
    args = cli.parse_args(["rank", "--role", "prefill", "--rank", "0", "--bootstrap", "127.0.0.1:1",
                           "--timeout", "1"])
    assert (args.timeout, args.linger) == (1.0, 2.0)


def test_bootstrap_bind_with_serve_bootstrap_is_taken():
    args = cli.parse_args([*RANK, "--serve-bootstrap", "--bootstrap-bind", "0.0.0.0"])
    assert args.bootstrap_bind == "0.0.0.0"


def test_rank_refuses_a_bad_library_variable_before_it_starts(monkeypatch, capsys):
    # As demo and bench do: refused up front (exit 2), not in the sender pool once its engine started.
    monkeypatch.setenv("EPD_SEND_DEPTH", "0")
    monkeypatch.setattr(harness, "encode_rank", _never)
    assert cli.main(RANK) == 2
    assert capsys.readouterr().err.startswith("epd-transfer rank: EPD_SEND_DEPTH='0'")


def test_rank_bootstrap_timeout_bounds_the_encode_ranks_registration(monkeypatch):
    seen = {}

    def encode_rank(sc, *args, **kwargs):
        seen["sc"] = sc
        return {"failed": []}

    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))  # a Mooncake path: rank checks it first
    monkeypatch.setattr(harness, "encode_rank", encode_rank)
    assert cli.main([*RANK, "--bootstrap-timeout", "3", "--linger", "0"]) == 0
    assert (seen["sc"].register_timeout_s, seen["sc"].fanout_timeout_s) == (3.0, 3.0)


def test_the_harness_hands_the_register_timeout_to_the_sender_pool(monkeypatch):
    import transfer.sender

    class Engine:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def register(self, tensor):
            pass

    seen = {}

    def pool(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(harness, "make_engine", lambda sc: Engine())
    monkeypatch.setattr(transfer.sender, "SenderPool", pool)
    with pytest.raises(RuntimeError, match="stop here"):
        harness.encode_rank(harness.Scenario(items=1, span=2, hidden=4, register_timeout_s=3.0), 0, "h:1",
                            None, None, None)
    assert seen["register_timeout_s"] == 3.0


def test_a_listener_that_cannot_bind_is_one_line_without_a_traceback_hint(monkeypatch, capsys):
    import zmq

    def encode_rank(*args, **kwargs):
        raise zmq.ZMQError(errno.EADDRINUSE, "encode rank 0's request socket cannot listen on "
                                             "tcp://127.0.0.1:27987: Address already in use")

    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))  # a Mooncake path: rank checks it first
    monkeypatch.setattr(harness, "encode_rank", encode_rank)
    assert cli.main(RANK) == 1
    err = capsys.readouterr().err
    assert err == ("epd-transfer rank: encode rank 0's request socket cannot listen on tcp://127.0.0.1:27987: "
                   "Address already in use\n")


def test_a_listener_port_in_use_is_one_line_without_its_errno(monkeypatch, capsys):
    from transfer.ports import port_in_use

    def encode_rank(*args, **kwargs):  # as a rank's request socket or wire listener says it
        raise port_in_use("encode rank 0's request socket cannot listen on 127.0.0.1:27987: Address already in use",
                          27987)

    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))
    monkeypatch.setattr(harness, "encode_rank", encode_rank)
    assert cli.main(RANK) == 1
    assert capsys.readouterr().err == (
        "epd-transfer rank: encode rank 0's request socket cannot listen on 127.0.0.1:27987: Address already in "
        "use: another process holds it; give another port, 0 (any free one) or a range FIRST-LAST, or find what "
        "holds it (ss -ltnp 'sport = :27987')\n")


def test_a_bootstrap_range_in_use_is_said_once(monkeypatch, capsys):
    import transfer.bootstrap
    from transfer.errors import PortsInUse

    def server(host, port, token=None):
        raise PortsInUse(errno.EADDRINUSE, f"bootstrap server on {host}: no free port in {port}: every one is in use")

    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    monkeypatch.setattr(transfer.bootstrap, "BootstrapServer", server)
    assert cli.main(["bootstrap", "--port", "18998-18999"]) == 1
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before  # the test process's signals as they were
    assert capsys.readouterr().err == ("epd-transfer bootstrap: bootstrap server on 127.0.0.1: no free port in "
                                       "18998-18999: every one is in use\n")


def test_a_bootstrap_port_it_may_not_take_is_said_without_its_errno(monkeypatch, capsys):
    import transfer.bootstrap
    from transfer.ports import listen_error

    def server(host, port, token=None):
        raise listen_error("bootstrap server", host, port, OSError(errno.EACCES, "Permission denied"))

    monkeypatch.setattr(transfer.bootstrap, "BootstrapServer", server)
    assert cli.main(["bootstrap", "--port", "80"]) == 1
    assert capsys.readouterr().err == (
        "epd-transfer bootstrap: bootstrap server cannot listen on 127.0.0.1:80: Permission denied: this process "
        "may not listen on port 80 (a port below 1024 needs root or the CAP_NET_BIND_SERVICE capability); give a "
        "port of 1024 or more, 0 (any free one) or a range FIRST-LAST\n")


def test_a_rank_failure_reason_names_its_room_once(monkeypatch, capsys):
    from transfer.status import TransferPoll

    class Handle:
        room = 7
        failure = "room 7: receiver 127.0.0.1:15018 hidden 32 != item hidden 64"

        def wait(self, timeout):
            return TransferPoll.Failed

        def clear(self):
            pass

    report: dict = {"rooms": [], "failed": []}
    harness._settle_send(Handle(), harness.Scenario(), report)
    assert report["failed"] == [(7, "receiver 127.0.0.1:15018 hidden 32 != item hidden 64")]
    monkeypatch.setattr(cli, "_probe_mooncake", lambda: (True, "imports"))  # a Mooncake path: rank checks it first
    monkeypatch.setattr(harness, "encode_rank", lambda *args, **kwargs: report)
    assert cli.main([*RANK, "--linger", "0"]) == 1
    failures = json.loads(capsys.readouterr().out)["failures"]
    assert failures == ["room 7: receiver 127.0.0.1:15018 hidden 32 != item hidden 64"]


@pytest.mark.parametrize("argv", [["bootstrap", "--port", "0"], RANK])
def test_exit_with_a_process_that_is_not_running_is_a_parser_error(argv, monkeypatch, capsys):
    # It would stop the command at once: a bootstrap server that announced itself and exited 0.
    def kill(pid, sig):
        assert (pid, sig) == (999999, 0)
        raise ProcessLookupError(pid)

    monkeypatch.setattr(cli.os, "kill", kill)
    monkeypatch.setattr(cli, "_bootstrap", _never)
    monkeypatch.setattr(cli, "_rank", _never)
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--exit-with", "999999"])
    assert exited.value.code == 2
    assert "--exit-with: no process 999999 is running" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bootstrap", "--port", "0"], RANK])
@pytest.mark.parametrize("pid", ["2147483648", "99999999999999999999"])
def test_exit_with_a_number_past_any_process_is_a_parser_error(argv, pid, monkeypatch, capsys):
    # os.kill() takes a C int: a larger number raised OverflowError, a traceback instead of the parser's line.
    monkeypatch.setattr(cli, "_bootstrap", _never)
    monkeypatch.setattr(cli, "_rank", _never)
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--exit-with", pid])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --exit-with: no process {pid} is running" in err and len(err.splitlines()) == 1, err


def test_bench_calls_on_a_python_whose_cprofile_is_one_per_process_is_refused_before_the_bench(monkeypatch,
                                                                                                capsys):
    # From Python 3.12 cProfile takes the process's one sys.monitoring profiler slot: the profiler of
    # every rank thread after the first would raise at that thread's first call, ending the thread.
    import sys

    monkeypatch.setattr(bench, "main", _never)
    monkeypatch.setattr(cli, "_probe_mooncake", _never)
    monkeypatch.setattr(sys, "version_info", (3, 12, 1, "final", 0))
    assert cli.main(["bench", "--calls", "--paths", "wire"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("epd-transfer bench: --calls needs Python 3.10 or 3.11 (this is 3.12)"), err


@pytest.mark.parametrize("argv", [["bootstrap", "--host", "{host}"],
                                  [*RANK, "--serve-bootstrap", "--bootstrap-bind", "{host}"]],
                         ids=["bootstrap --host", "rank --bootstrap-bind"])
@pytest.mark.parametrize("host, said", [
    ("10.0.0.1:8998", "'10.0.0.1:8998' is HOST:PORT: give the address alone (10.0.0.1), and the port with --port"),
    ("[::1]:8998", "'[::1]:8998' is HOST:PORT: give the address alone (::1), and the port with --port"),
    ("[::1]", "'[::1]' has brackets: give the address without them (::1)"),
])
def test_a_bind_address_with_a_port_or_brackets_is_a_parser_error(argv, host, said, capsys):
    # It would be looked up as a host name, and fail with 'Name or service not known'.
    with pytest.raises(SystemExit) as done:
        cli.parse_args([a.format(host=host) for a in argv])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "0.0.0.0", "encode-node.example", "fe80::1%eth0"])
def test_a_bind_address_alone_is_taken(host):
    assert cli.parse_args(["bootstrap", "--host", host]).host == host
    assert cli.parse_args([*RANK, "--serve-bootstrap", "--bootstrap-bind", host]).bootstrap_bind == host


@pytest.mark.parametrize("argv", [["demo", "-E", "3", "-P", "4"], [*RANK, "-E", "2", "-P", "3"],
                                  ["demo", "--encode-ranks", "2"]])
def test_prefill_ranks_that_are_not_a_multiple_of_the_encode_ranks_are_a_parser_error(argv, monkeypatch, capsys):
    # Before anything is probed or started; demo's -P is 4 by default, so -E 2 alone is fine and -E 3 is not.
    monkeypatch.setattr(harness, "run", _never)
    monkeypatch.setattr(cli, "_probe_mooncake", _never)
    if argv == ["demo", "--encode-ranks", "2"]:
        assert cli.parse_args(argv).encode_ranks == 2
        return
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    p, e = argv[argv.index("-P") + 1], argv[argv.index("-E") + 1]
    assert (f"error: --prefill-ranks {p} is not a multiple of --encode-ranks {e}: each encode rank serves "
            f"an equal block of prefill ranks" in err), err
    assert err.startswith(f"epd-transfer {argv[0]}: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("host", ["0.0.0.0", "0"])
@pytest.mark.parametrize("command", [["demo"], RANK], ids=["demo", "rank"])
def test_a_wildcard_rank_host_is_a_parser_error(command, host, capsys):
    # The rank's engine and sockets advertise it to peers, which would connect to their own host; `0` binds as
    # 0.0.0.0 does.
    with pytest.raises(SystemExit) as done:
        cli.parse_args([*command, "--host", host])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"{host!r} is a wildcard address" in err and "give this node's IPv4 address" in err, err


@pytest.mark.parametrize("first, items, said", [
    ("9223372036854775808", "1", "argument --first-room: '9223372036854775808' is not a room number (0 to "
                                 "9223372036854775807, the wire's last room)"),
    ("99999999999999999999", "64", "argument --first-room: '99999999999999999999' is not a room number (0 to "
                                   "9223372036854775807, the wire's last room)"),
    ("9223372036854775807", "2", "--first-room 9223372036854775807 with --items 2 runs to room 9223372036854775808, "
                                 "past the wire's last room 9223372036854775807 (2**63 - 1): give a --first-room of "
                                 "at most 9223372036854775806"),
])
def test_rooms_past_the_wires_last_room_are_a_parser_error(first, items, said, monkeypatch, capsys):
    # Refused before the rank starts, not by the first room past it failing once the rank is up (exit 1).
    _no_rank_starts(monkeypatch)
    monkeypatch.setattr(cli, "_probe_mooncake", _never)
    with pytest.raises(SystemExit) as done:
        cli.main([*RANK, "--first-room", first, "--items", items])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err == f"epd-transfer rank: error: {said} (see epd-transfer rank --help)\n", err


def test_a_demo_of_more_items_than_the_wire_has_rooms_is_a_parser_error(monkeypatch, capsys):
    _no_rank_starts(monkeypatch)
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--items", str(2**63 + 1)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"epd-transfer demo: error: --items {2**63 + 1} runs to room {2**63}, past the wire's last room "
                   f"{2**63 - 1} (2**63 - 1): give at most {2**63} (see epd-transfer demo --help)\n"), err


def test_a_runs_rooms_are_made_as_they_are_reached_whatever_the_count_of_items():
    # Every rank walks sc.rooms: a list of them made up front for --items 10**20 got the ranks OOM-killed.
    import tracemalloc

    sc = harness.Scenario(items=10**6, first_room=7)
    tracemalloc.start()
    try:
        rooms = sc.rooms
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert (rooms[0], rooms[-1], len(rooms)) == (7, 10**6 + 6, 10**6)
    assert list(harness.Scenario(items=3, first_room=2**63 - 3).rooms) == [2**63 - 3, 2**63 - 2, 2**63 - 1]


def test_the_last_room_of_the_wire_is_a_first_room():
    args = cli.parse_args([*RANK, "--first-room", "9223372036854775807", "--items", "1"])
    assert args.first_room == 2**63 - 1


HUGE = ["--span", "100000000", "--hidden", "100000"]  # 20 TB an item: more memory than any host has


@pytest.mark.parametrize("argv, whose", [
    (["demo", "--protocol", "wire", "-E", "1", "-P", "2", *HUGE], "1 encode rank and 2 prefill ranks"),
    ([*RANK, "--protocol", "wire", *HUGE], "1 encode rank"),
    ([*PREFILL_RANK, "--protocol", "wire", *HUGE], "1 prefill rank"),
], ids=["demo", "encode rank", "prefill rank"])
def test_items_no_host_can_hold_are_refused_before_any_rank_starts(argv, whose, monkeypatch, capsys):
    # Not a rank's traceback from torch's allocator once the ranks are up.
    monkeypatch.setattr(harness, "run", _never)
    _no_rank_starts(monkeypatch)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"epd-transfer {argv[0]}: {whose} of items 100000000 x 100000 torch.bfloat16 need "), err
    assert "of memory, more than this host's RAM and swap, " in err, err
    assert err.endswith(": give a smaller --span, --hidden, --inflight or --deepstack, or run fewer ranks on this "
                        "host\n"), err


@pytest.mark.parametrize("paths", ["wire", "memcpy"])
def test_bench_sizes_no_host_can_hold_are_refused_before_any_rank_starts(paths, monkeypatch, capsys):
    monkeypatch.setattr(bench, "measure", _never)
    monkeypatch.setattr(bench, "RankSet", _never)
    assert cli.main(["bench", "--paths", paths, "--sizes", "100000000x100000,64x4096"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("epd-transfer bench: items up to 100000000x100000 torch.bfloat16 need "), err
    assert err.endswith(": give smaller --sizes, or a lower --inflight, --fanouts or --encode-ranks\n"), err

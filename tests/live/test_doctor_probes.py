"""doctor's probes on this host (child interpreters, the real Mooncake wheel, a CUDA query that hangs), demo, bench
and rank refusing a Mooncake path its probe fails, and scripts/soft-roce.sh."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from transfer import doctor


ROOT = Path(__file__).resolve().parents[2]
SOFT_ROCE = ROOT / "scripts" / "soft-roce.sh"


def test_library_checks():
    libc = doctor.check_library("libc.so.6", "libc", "libc6")
    assert libc.level == "ok" and libc.detail == "libc.so.6 loads"
    missing = doctor.check_library("libdoesnotexist.so.9", "libdoesnotexist", "nothing9")
    assert missing.level == "fail"
    assert missing.detail == "libdoesnotexist.so.9 not found"
    assert missing.fix == "apt-get install nothing9"


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="mooncake not installed")
def test_real_mooncake_probe_and_wheel():
    ok, detail = doctor.probe_mooncake_import()
    assert ok, detail
    import mooncake.engine

    has_probe = hasattr(mooncake.engine.TransferEngine, "send_probe")
    assert detail == ("imports" if has_probe else doctor.IMPORTS_NO_PROBE)
    names = [d["name"] for d in doctor.mooncake_distributions()]
    assert any(n.startswith("mooncake-transfer-engine") for n in names)


def test_probe_timeout_is_reported():
    ok, detail = doctor.probe_mooncake_import(timeout_s=0.001)
    assert not ok and "hung for more than" in detail


def test_what_the_mooncake_import_prints_is_not_taken_for_the_probe_verdict(tmp_path, monkeypatch):
    shadow = tmp_path / "mooncake"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("print('mooncake: a line a build prints as it loads')\n")
    (shadow / "engine.py").write_text("class TransferEngine:\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))
    assert doctor.probe_mooncake_import(timeout_s=60) == (True, doctor.IMPORTS_NO_PROBE)
    (shadow / "engine.py").write_text("class TransferEngine:\n    def send_probe(self):\n        pass\n")
    assert doctor.probe_mooncake_import(timeout_s=60) == (True, "imports")


@pytest.mark.parametrize("argv", [["demo", "--items", "1"], ["bench", "--quick"],
                                  ["rank", "--role", "prefill", "--rank", "0", "--bootstrap", "127.0.0.1:1",
                                   "--bootstrap-timeout", "30"]], ids=["demo", "bench", "rank"])
def test_a_mooncake_path_on_a_host_whose_mooncake_does_not_import_is_refused_in_one_line(argv, tmp_path):
    import sys

    shadow = tmp_path / "mooncake"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('libibverbs.so.1: cannot open shared object file')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "transfer.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"epd-transfer {argv[0]}: cannot import mooncake.engine (a system library that "
                                  f"mooncake needs is missing: "), done.stderr
    assert "apt-get install libibverbs1 libnuma1" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


# torch whose CUDA query never returns, as on a host whose driver hangs in cuInit (a GPU fallen off the bus).
_HUNG_CUDA_TORCH = """import os, sys, time
_shadow = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != _shadow]
del sys.modules['torch']
import torch as _torch
def _hang():
    time.sleep(3600)
_torch.cuda.is_available = _hang
sys.modules['torch'] = _torch
"""


def test_a_cuda_query_that_hangs_leaves_the_doctor_a_warning_line(tmp_path):
    import sys

    shadow = tmp_path / "torch"
    shadow.mkdir()
    (shadow / "__init__.py").write_text(_HUNG_CUDA_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    code = "import sys; from transfer import doctor; doctor.CUDA_TIMEOUT_S = 3; sys.exit(doctor.run())"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                              check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("doctor hung with the CUDA query")
    assert done.returncode == 0, done.stderr
    cuda = [line for line in done.stdout.splitlines() if line[6:].startswith("cuda ")]
    assert len(cuda) == 1 and cuda[0].startswith("WARN") and "hung for more than 3s" in cuda[0], done.stdout
    assert "data-path" in done.stdout


def test_real_host_report_is_consistent():
    report = doctor.collect()
    assert report["data_path_ok"] == (report["mooncake"]["imports"]
                                      or any(c["name"] == "wire" and c["level"] == "ok"
                                             for c in report["checks"]))
    names = [c["name"] for c in report["checks"]]
    for name in ("mooncake", "libibverbs", "libnuma", "cuda", "gpudirect", "protocol", "wire",
                 "mc-env", "data-path"):
        assert name in names


def script(*args: str) -> subprocess.CompletedProcess:
    """Run soft-roce.sh with a bounded wait."""
    return subprocess.run(["bash", str(SOFT_ROCE), *args], capture_output=True, text=True,
                          timeout=60, check=False)


def kernel_has_rdma_netlink() -> bool:
    """True when `rdma link show` works (then `up` would really change this host)."""
    if shutil.which("rdma") is None:
        return False
    done = subprocess.run(["rdma", "link", "show"], capture_output=True, text=True, timeout=30,
                          check=False)
    return done.returncode == 0


def test_soft_roce_usage():
    done = script()
    assert done.returncode == 2 and "usage:" in done.stderr
    assert script("sideways").returncode == 2


def test_soft_roce_status():
    done = script("status")
    assert done.returncode == 0, done.stderr
    assert "== RDMA devices" in done.stdout and "== rdma link show" in done.stdout
    if not kernel_has_rdma_netlink() and shutil.which("rdma"):
        assert "has no RDMA netlink" in done.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="up needs root")
def test_soft_roce_up_explains_why_it_cannot():
    if kernel_has_rdma_netlink():
        pytest.skip("this kernel has RDMA netlink: up would really add a device")
    done = script("up")
    assert done.returncode == 1
    if shutil.which("rdma") is None:
        assert "apt-get install iproute2 rdma-core ibverbs-utils" in done.stderr
    else:
        assert "kernel" in done.stderr and ("RDMA netlink" in done.stderr
                                            or "rdma_rxe" in done.stderr)


@pytest.mark.skipif(os.geteuid() != 0, reason="up needs root")
@pytest.mark.skipif(shutil.which("rdma") is None, reason="the rdma tool is not installed")
def test_soft_roce_up_rejects_an_unknown_netdev(tmp_path):
    done = subprocess.run(["bash", str(SOFT_ROCE), "up", "nosuchnet0"], capture_output=True,
                          text=True, timeout=60, check=False,
                          env={**os.environ, "IB_SYSFS": str(tmp_path)})
    assert done.returncode == 1
    assert "no such network interface: nosuchnet0" in done.stderr

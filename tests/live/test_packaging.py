"""An sdist builds, a wheel builds from that sdist, and the wheel installs into a fresh venv and imports."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.live


def _run(argv: list[str], cwd: str | None = None, timeout: float = 600) -> str:
    """Run a command; its output, or a failure that shows it."""
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The folder holding the sdist and the wheel built from it."""
    pytest.importorskip("build", reason="pip install 'epd-transfer[test]' brings the build frontend")
    out = str(tmp_path_factory.mktemp("dist"))
    # A clean copy, as a fresh clone has it: an editable install's egg-info would hand the
    # sdist every file it once compiled, hiding what MANIFEST.in leaves out.
    src = os.path.join(str(tmp_path_factory.mktemp("src")), "epd-transfer")
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", "*.so", ".pytest_cache", ".hypothesis",
        "epd-logs", "out"))
    # No isolation: the build runs on this venv's setuptools, so it needs no index. With no
    # --sdist/--wheel, `build` makes the sdist, then the wheel from the unpacked sdist.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src], timeout=900)
    return out


def test_the_sdist_carries_what_a_build_needs(dist):
    (sdist,) = glob.glob(os.path.join(dist, "*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for header in glob.glob(os.path.join(REPO, "native", "*.h")):
        assert f"native/{os.path.basename(header)}" in names
    for needed in ("native/frame.c", "setup.py", "pyproject.toml", "README.md", "CHANGELOG.md", "docs/protocol.md",
                   "LICENSE", "transfer/py.typed", "transfer/_native.pyi", "transfer/core/failure.py", "transfer/errors.py"):
        assert needed in names, f"the sdist lacks {needed}"
    # Every script, and what one builds from (zmq-floor.sh compiles zmq_floor.c).
    for script in os.listdir(os.path.join(REPO, "scripts")):
        if os.path.isfile(os.path.join(REPO, "scripts", script)) and not script.endswith(".pyc"):
            assert f"scripts/{script}" in names, f"the sdist lacks scripts/{script}"


def test_the_wheel_installs_into_a_fresh_venv_and_imports(dist, tmp_path):
    (wheel,) = glob.glob(os.path.join(dist, "*.whl"))
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    assert "transfer/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)  # the Apache-2.0 text
    assert "transfer/_native.pyi" in names  # the C core's types, for the package's type-checking users
    assert any(n.startswith("transfer/_native") and n.endswith(".so") for n in names), sorted(names)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    # This venv's pip installs the wheel into the fresh one (--python: its scripts run its
    # interpreter). No index: the dependencies (torch, pyzmq) are not needed to import the
    # package, its C core and its pure modules, or to ask the console script its version.
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet", wheel])
    probe = ("import transfer, transfer._native, transfer.frames, transfer.status, transfer.wire; "
             "print(transfer.__file__); print(transfer.frames.dtype_size('bfloat16')); "
             "print(issubclass(transfer.wire.FrameError, transfer.TransferError))")
    lines = _run([python, "-c", probe], cwd=str(tmp_path)).split()
    assert lines[0].startswith(str(venv)), f"imported {lines[0]}, not the installed wheel"
    assert lines[1] == "2" and lines[2] == "True"
    version = _run([str(venv / "bin" / "epd-transfer"), "--version"], cwd=str(tmp_path))
    assert version.strip() == "epd-transfer 0.1.0"

"""`make setup` (which `make demo` and `make test` run first) installs the Mooncake wheel for the host."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.live, pytest.mark.skipif(shutil.which("make") is None, reason="needs make")]


def _outside_make() -> dict[str, str]:
    """This environment without what a `make` above this test (`make test`) hands its children."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}


def _setup_commands(*args: str) -> list[str]:
    """The pip commands `make setup` would run (make -n: printed, not run)."""
    out = subprocess.run(["make", "-n", "-B", "setup", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return [line for line in out.splitlines() if " pip " in line]


@pytest.mark.parametrize("marker, wanted, other", [
    (True, "cuda", "mooncake-transfer-engine-non-cuda"),
    (False, "cpu", "mooncake-transfer-engine"),
])
def test_the_wheel_follows_the_nvidia_driver_and_the_other_goes_first(tmp_path, marker, wanted, other):
    version = tmp_path / "version"  # stands for /proc/driver/nvidia/version
    if marker:
        version.write_text("NVRM version: test\n")
    commands = _setup_commands(f"NVIDIA_MARKERS={version}")
    assert commands[-2:] == [f'.venv/bin/python -m pip uninstall -q -y {other} 2>/dev/null || true',
                             f'.venv/bin/python -m pip install -q -e ".[{wanted},test]"'], commands


def test_the_wheel_can_be_named():
    commands = _setup_commands("NVIDIA_MARKERS=/nonexistent", "MOONCAKE=cuda")
    assert commands[-1] == '.venv/bin/python -m pip install -q -e ".[cuda,test]"', commands


def test_asan_puts_the_normal_build_back_whatever_the_tests_said():
    """`make asan` replaces the extension in place with a sanitized build: the default build must not keep it."""
    out = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/.installed", "asan",
                          "ASAN_TESTS=tests/x.py"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
                         env=_outside_make()).stdout
    sanitized, tested = out.replace("\\\n", " ").strip().splitlines()
    assert "-fsanitize=address,undefined" in sanitized and "build_ext --inplace --force" in sanitized, out
    run, restore = tested.split("rc=$?;")
    assert "libasan.so" in run and "-m pytest" in run and run.rstrip().endswith("tests/x.py;"), out
    assert restore.strip().startswith(".venv/bin/python setup.py -q build_ext --inplace --force"), out
    assert "sanitize" not in restore and restore.endswith("exit $rc"), out

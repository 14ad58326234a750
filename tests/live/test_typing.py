"""The package type-checks clean under pyproject.toml's [tool.mypy], and its engines fit the public Protocol."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def mypy(tmp_path_factory):
    """Runs `python -m mypy ARGS` in the repository under its configuration, a cache shared by this module's tests."""
    pytest.importorskip("mypy", reason="pip install 'epd-transfer[test]' brings mypy")
    cache = str(tmp_path_factory.mktemp("mypy-cache"))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mypy", "--config-file", os.path.join(REPO, "pyproject.toml"),
                               "--cache-dir", cache, *args], cwd=REPO, capture_output=True, text=True, timeout=600)

    return run


def test_the_package_type_checks_clean(mypy):
    result = mypy("transfer")
    assert result.returncode == 0, f"mypy transfer found errors:\n{result.stdout}\n{result.stderr}"
    assert "no issues found" in result.stdout


def test_an_engine_without_a_write_does_not_fit_the_engine_protocol(mypy, tmp_path):
    # Proves the check above can fail: the same configuration refuses a half engine.
    probe = tmp_path / "half_engine.py"
    probe.write_text(textwrap.dedent("""
        from transfer.interfaces import TransferEngineLike

        class HalfEngine:
            hostname = "127.0.0.1"
            session_id = "127.0.0.1:1"

            def register(self, buf: object, length: int | None = None) -> tuple[int, int]:
                return 0, 0

            def unregister(self, addr: int) -> None: ...

            def registered(self) -> dict[int, int]:
                return {}

            def wait(self, ticket: int, timeout_s: float | None = None) -> None: ...

        engine: TransferEngineLike = HalfEngine()
    """))
    result = mypy(str(probe))
    assert result.returncode == 1, result.stdout
    assert '"HalfEngine" is missing following "TransferEngineLike" protocol member' in result.stdout, result.stdout
    assert result.stdout.splitlines()[-2].split("note:")[1].strip() == "write", result.stdout

"""Every module-wide lock of the library is made free again in a forked child (transfer._forks.free_in_child):
a thread of the parent holding it at the fork is not there to let go. Read from the sources, so a new one
cannot be left out."""

from __future__ import annotations

import re
from pathlib import Path

import transfer

MODULE_LOCK = re.compile(r"^(_?\w+)(?:: [^=]+)? = (.*threading\.R?Lock\(\).*)$", re.MULTILINE)


def module_locks() -> dict[str, str]:
    found = {}
    for path in sorted(Path(transfer.__file__).parent.rglob("*.py")):
        for match in MODULE_LOCK.finditer(path.read_text()):
            found[f"{path.name}:{match.group(1)}"] = match.group(2)
    return found


def test_the_library_has_module_locks_to_check():
    assert "receiver.py:_managed_lock" in module_locks()


def test_every_module_lock_is_free_in_a_forked_child():
    bare = {name: made for name, made in module_locks().items() if "free_in_child(" not in made}
    assert not bare, f"module-wide locks a fork would leave held in the child: {bare}"


def test_the_live_fork_test_holds_every_module_lock_across_a_fork():
    live = (Path(__file__).parents[1] / "live" / "test_module_locks_fork.py").read_text()
    listed = set(re.findall(r'\("transfer\.(?:\w+\.)*(\w+)", "(\w+)"\)', live))
    assert {f"{module}.py:{name}" for module, name in listed} == set(module_locks())

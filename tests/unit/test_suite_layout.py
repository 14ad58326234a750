"""The test suite's own layout: `pytest tests` collects both folders, whose modules share one namespace."""

from __future__ import annotations

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _test_modules(folder: str) -> set[str]:
    return {name for name in os.listdir(os.path.join(TESTS, folder)) if name.startswith("test_")
            and name.endswith(".py")}


def test_no_test_module_name_is_in_both_folders():
    # Two modules of one name stop the whole run at collection ("import file mismatch").
    unit, live = _test_modules("unit"), _test_modules("live")
    assert unit and live
    assert not unit & live, sorted(unit & live)

"""The native module's init (native/module.c, PyInit__native): a failed init releases what it made and
leaves a copy of the module that is already loaded as it was."""

from __future__ import annotations

import gc
import importlib.util
import sys
import types
import weakref

import pytest

from transfer import _native, wire


def test_an_init_that_fails_part_way_releases_its_types_and_leaves_the_loaded_module_raising_its_own(monkeypatch):
    """The library's second exception type cannot be made: the first one must not outlive the failed
    init, and the module loaded before (the same shared library, the same C globals) still raises
    transfer.wire's MsgError and FrameError."""
    made: list[weakref.ref] = []

    class TransferError(Exception):
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            made.append(weakref.ref(cls))
            if len(made) == 2:
                raise RuntimeError("no second exception type")

    errors = types.ModuleType("transfer.errors")
    errors.TransferError = TransferError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transfer.errors", errors)
    # Another name: the import system's cache of loaded extensions is keyed by path and name, so the
    # library's init runs again.
    spec = importlib.util.spec_from_file_location("native_init_probe._native", _native.__file__)
    assert spec is not None
    with pytest.raises(RuntimeError, match="^no second exception type$"):
        importlib.util.module_from_spec(spec)
    monkeypatch.undo()
    gc.collect()
    assert made[0]() is None, "the FrameError the failed init made is still referenced"
    with pytest.raises(wire.MsgError, match="a header line without '='"):
        _native.msg_decode(b"no equals sign")
    with pytest.raises(wire.FrameError, match="^read: "):
        _native.read_frame(-1, 1.0)

"""Importing the contract and the wire pulls in no torch, ZMQ or I/O (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys


def test_import_pulls_no_torch_zmq_or_io():
    code = (
        "import sys, transfer.frames, transfer.status\n"
        "heavy = ('torch', 'zmq', 'mooncake', 'numpy', 'transfer._native')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_wire_imports_without_torch():
    code = "import sys, transfer.wire; assert 'torch' not in sys.modules, 'wire imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

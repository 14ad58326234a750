"""How scripts/bench_cpu_libraries.py groups the shared objects perf names."""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from bench_cpu_libraries import library  # noqa: E402


def test_shared_objects_fall_in_their_library_group():
    assert library("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0") == "interpreter"
    # Under site-packages/python3.11: named by the file, not by the folder.
    assert library("/x/lib/python3.11/site-packages/pyzmq.libs/libzmq-2f02442c.so.5.2.5") == "ZMQ"
    assert library("/x/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so") == "torch"
    assert library("[kernel.kallsyms]") == "kernel"
    assert library("/x/site-packages/transfer/_native.cpython-311-x86_64-linux-gnu.so") == "native"
    assert library("/usr/lib/x86_64-linux-gnu/libc.so.6") == "C library"

"""A Mooncake engine in a process forked from the one that started it: its threads, listener and
connections stayed in the parent, so the child's writes and registrations are refused at once, its
close() returns at once, and its exit does not wait for threads it does not have; the parent's engine
writes on as before."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from live_helpers import HOST, LIVE, in_forked_child, outcomes

from transfer.engine import Engine

pytestmark = LIVE


def test_a_forked_childs_calls_on_the_parents_engine_are_refused_and_its_close_returns():
    src = torch.ones(1024, dtype=torch.uint8)
    dst = torch.zeros(1024, dtype=torch.uint8)
    with Engine(HOST, "tcp") as encode, Engine(HOST, "tcp") as prefill:
        encode.register(src)
        prefill.register(dst)
        encode.write(prefill.session_id, [src.data_ptr()], [dst.data_ptr()], [1024])  # a session to the peer

        def child() -> dict:
            report = outcomes({
                "write": lambda: encode.write(prefill.session_id, [src.data_ptr()], [dst.data_ptr()], [1024]),
                "write_async": lambda: encode.write_async(prefill.session_id, [src.data_ptr()], [dst.data_ptr()],
                                                          [1024]),
                "register": lambda: encode.register(torch.zeros(64, dtype=torch.uint8))}, messages=True)
            encode.close()  # it returns: in_forked_child waits for it 20 s at most
            return {**report, "pid": os.getpid()}

        report = in_forked_child(child, wait_s=20.0)
        assert report is not None, "the child's calls on the inherited engine did not return"
        for name in ("write", "write_async", "register"):
            assert report[name] == (f"UsageError: engine {encode.session_id} was made before this process (pid {report['pid']}) "
                                    f"was forked from its parent: Mooncake's threads and connections are the "
                                    f"parent's, so nothing here would carry its writes; make an Engine in this "
                                    f"process"), report

        dst.zero_()  # the parent's engine is untouched
        encode.write(prefill.session_id, [src.data_ptr()], [dst.data_ptr()], [1024])
        assert int(dst.sum()) == 1024


def test_a_forked_child_that_exits_normally_does_not_wait_for_the_parents_engine():
    # sys.exit() runs the interpreter's finalization, which let go of the inherited Mooncake engine,
    # whose destructor joined threads that exist only in the parent: the child never ended.
    code = (
        "import os, sys, time, torch\n"
        "from transfer.engine import Engine\n"
        f"a, b = Engine({HOST!r}, 'tcp'), Engine({HOST!r}, 'tcp')\n"
        "src, dst = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)\n"
        "a.register(src); b.register(dst)\n"
        "a.write(b.session_id, [src.data_ptr()], [dst.data_ptr()], [64])\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)\n"
        "deadline = time.monotonic() + 20\n"
        "while time.monotonic() < deadline:\n"
        "    done, status = os.waitpid(pid, os.WNOHANG)\n"
        "    if done:\n"
        "        print('child exited', os.waitstatus_to_exitcode(status), flush=True)\n"
        "        break\n"
        "    time.sleep(0.05)\n"
        "else:\n"
        "    os.kill(pid, 9); os.waitpid(pid, 0)\n"
        "    print('child still running after 20 s', flush=True)\n"
        "a.close(); b.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "child exited 0", done.stdout + done.stderr[-2000:]

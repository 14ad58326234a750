"""The wire listener in a process that cannot start another thread: a new connection is turned away with
an answer saying why, and counted as refused, not as admitted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# In a process of its own: the cap on its address space leaves no room for a connection thread's stack.
_SCRIPT = textwrap.dedent("""
    import json, resource, socket, time
    from transfer import _native, wire

    listener = _native.wire_listen("127.0.0.1", 0, 5.0, 30.0, 4096, 4)
    port = _native.wire_listener_port(listener)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 10), resource.RLIM_INFINITY))
    sock.connect(("127.0.0.1", port))
    try:
        kind, payload, _ = wire.read_frame(sock, 65536)
        answer = [kind, payload.decode()]
    except OSError as exc:
        answer = [None, str(exc)]
    sock.close()
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    stats = _native.wire_listener_stats(listener)
    _native.wire_listener_close(listener)
    print(json.dumps({"answer": answer, "stats": stats}))
""")


def test_a_connection_whose_thread_cannot_start_is_refused_with_a_reason_and_not_counted_admitted():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    kind, text = report["answer"]
    assert kind == 21, report  # ERROR, whose body says why
    assert text.startswith("\nlistener cannot serve this connection: starting its thread failed ("), report
    assert text.endswith("); the receiving process is out of threads or memory"), report
    stats = report["stats"]
    assert (stats["accepted"], stats["refused"], stats["active"]) == (0, 1, 0), stats

"""A writer whose own process is held up (SIGSTOP) with a write in flight, past the transfer timeout.

The hold-up stops Mooncake's threads with the writer's: the write makes no progress meanwhile,
and that is not the peer's doing. Once the process runs again the write completes, instead of
failing on the first poll as "a peer that stopped reading" (which a sender pool takes for a
dead peer: its room fails, its session's writes fail at once for a while, its memory is
quarantined). A peer that does stop reading still fails the write, within twice the bound.
The same holds for a write to a new peer held back for its probe: the open bound is the peer's time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from live_helpers import MOONCAKE_MISSING, peer_with_64_mib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

needs_mooncake = pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING or "n/a")

#: The writer's transfer timeout, and how long its process is held up (well past it).
TIMEOUT_S = 1.0
HELD_S = 3.0

# Both writers' end: the process stops itself at once, its write in flight (or held back); once the test
# continues it, it polls the write as a sender pool does and prints how it ended.
_STOP_AND_REPORT = r"""
os.kill(os.getpid(), signal.SIGSTOP)
resumed = time.monotonic()
try:
    while not engine.poll(ticket):
        time.sleep(0.0005)
    print("ok", round(time.monotonic() - resumed, 3), flush=True)
except EngineError as exc:
    print("failed", round(time.monotonic() - resumed, 3), exc, flush=True)
engine.close()
"""

# The writer, in its own process: the handshake first, then a 64 MiB write, and the process
# stops itself at once, the write in flight; the test continues it. It polls the write as a
# sender pool does and prints how it ended.
_WRITER = r"""
import os, signal, sys, time, torch
sys.path.insert(0, sys.argv[1])
from transfer.engine import Engine
from transfer.errors import EngineError
session, landing, timeout = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
engine = Engine("127.0.0.1", "tcp", transfer_timeout_s=timeout)
src = torch.full((64 << 20,), 7, dtype=torch.uint8)
engine.register(src)
engine.write(session, [src.data_ptr()], [landing], [64])
print("ready", flush=True)
sys.stdin.readline()  # the peer is as the test wants it
ticket = engine.write_async(session, [src.data_ptr()], [landing], [64 << 20])
""" + _STOP_AND_REPORT


def _held_up_writer(session: str, landing: int, stop_peer=None) -> tuple[str, float]:
    """Runs the writer against the peer, holds its process up HELD_S with the write in flight; (outcome, seconds
    from its resume to the outcome, as the writer measured them)."""
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, REPO, session, str(landing), str(TIMEOUT_S)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        if stop_peer is not None:
            stop_peer()
        writer.stdin.write("go\n")
        writer.stdin.flush()
        _wait_stopped(writer)
        time.sleep(HELD_S)
        os.kill(writer.pid, signal.SIGCONT)
        out, _ = writer.communicate(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(10)
    outcome, took, *_ = out.split(" ", 2) + ["", ""]
    return out.strip(), float(took) if outcome in ("ok", "failed") else float("nan")


def _wait_stopped(writer: subprocess.Popen) -> None:
    """Waits (30 s at most) until the writer stopped itself."""
    deadline = time.monotonic() + 30
    while _state(writer.pid) != "T":
        assert time.monotonic() < deadline, "the writer never stopped itself"
        time.sleep(0.01)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.live
@needs_mooncake
def test_a_write_in_flight_while_its_own_process_is_held_up_completes_after_the_resume():
    peer, session, landing = peer_with_64_mib()
    try:
        outcome, _ = _held_up_writer(session, landing)
    finally:
        peer.kill()
        peer.wait(10)
    assert outcome.startswith("ok "), (
        f"a write held up {HELD_S}s with its own process (transfer timeout {TIMEOUT_S}s) did not complete once it "
        f"ran again: {outcome}")


@pytest.mark.live
@needs_mooncake
def test_a_write_to_a_stopped_peer_still_fails_after_its_own_process_was_held_up():
    peer, session, landing = peer_with_64_mib()
    try:
        outcome, took = _held_up_writer(session, landing, stop_peer=lambda: os.kill(peer.pid, signal.SIGSTOP))
    finally:
        peer.kill()
        peer.wait(10)
    assert outcome.startswith("failed ") and "a peer that stopped reading?" in outcome, outcome
    # Given its bound again from the resume (not failed at once for the time it was held up), then failed.
    assert took >= TIMEOUT_S, outcome


# The writer of a new peer's first write, held back for its probe (the peer is stopped when it is made,
# so the probe is not answered at once), the writer's process stopping itself at once; it prints how it ended.
_PROBING_WRITER = r"""
import os, signal, sys, time, torch
sys.path.insert(0, sys.argv[1])
from transfer.engine import Engine
from transfer.errors import EngineError
session, landing = sys.argv[2], int(sys.argv[3])
engine = Engine("127.0.0.1", "tcp")
src = torch.full((64,), 7, dtype=torch.uint8)
engine.register(src)
print("ready", engine.open_timeout_s, flush=True)
sys.stdin.readline()  # the peer is stopped
ticket = engine.write_async(session, [src.data_ptr()], [landing], [64])
""" + _STOP_AND_REPORT


@pytest.mark.live
@needs_mooncake
def test_a_write_held_back_for_a_new_peers_probe_while_its_own_process_is_held_up_goes_after_the_resume():
    """The peer answers the probe a moment after it went out (it was stopped, and is continued at once);
    the writer's own process is held up past the open bound meanwhile, so it reads that answer only then."""
    peer, session, landing = peer_with_64_mib()
    writer = subprocess.Popen([sys.executable, "-c", _PROBING_WRITER, REPO, session, str(landing)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready, open_timeout_s = writer.stdout.readline().split()
        assert ready == "ready"
        os.kill(peer.pid, signal.SIGSTOP)
        writer.stdin.write("go\n")
        writer.stdin.flush()
        _wait_stopped(writer)
        os.kill(peer.pid, signal.SIGCONT)
        time.sleep(float(open_timeout_s) + 2.0)
        os.kill(writer.pid, signal.SIGCONT)
        out, _ = writer.communicate(timeout=60)
    finally:
        for proc in (writer, peer):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert out.startswith("ok "), (
        f"a write held back for a new peer's probe, its own process held up {float(open_timeout_s) + 2.0}s "
        f"(past the open bound), did not go once it ran again: {out.strip()}")

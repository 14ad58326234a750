"""A writer whose own process is held up (SIGSTOP) with a write in flight, past the transfer timeout.

The hold-up stops Mooncake's threads with the writer's: the write makes no progress meanwhile,
and that is not the peer's doing. Once the process runs again the write completes, instead of
failing on the first poll as "a peer that stopped reading" (which a sender pool takes for a
dead peer: its room fails, its session's writes fail at once for a while, its memory is
quarantined). A peer that does stop reading still fails the write, within twice the bound.
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
        deadline = time.monotonic() + 30
        while _state(writer.pid) != "T":
            assert time.monotonic() < deadline, "the writer never stopped itself"
            time.sleep(0.01)
        time.sleep(HELD_S)
        os.kill(writer.pid, signal.SIGCONT)
        out, _ = writer.communicate(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(10)
    outcome, took, *_ = out.split(" ", 2) + ["", ""]
    return out.strip(), float(took) if outcome in ("ok", "failed") else float("nan")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.live
@needs_mooncake
def test_a_write_in_flight_while_its_own_process_is_held_up_completes_after_the_resume():
    peer, session, landing = peer_with_64_mib()
    try:
        outcome, took = _held_up_writer(session, landing)
    finally:
        peer.kill()
        peer.wait(10)
    assert outcome.startswith("ok "), (
        f"a write held up {HELD_S}s with its own process (transfer timeout {TIMEOUT_S}s) did not complete once it "
        f"ran again: {outcome}")
    assert took < TIMEOUT_S


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
    # Given at most its bound again (1 s plus 1 ns per byte) from the resume, then failed.
    assert TIMEOUT_S <= took < 2 * TIMEOUT_S + 1.0, outcome

"""A prefill rank of `epd-transfer rank` and `demo` (harness.prefill_rank) whose bootstrap server does not answer
its first look-up gets every room once it does.

The look-up that times out pauses that server on the prefill side for UNREACHABLE_RETRY_S (core/prefill_breaker.py):
its rooms fail, and so does every room the rank asks for meanwhile, at once. The rank asks for those again, in
the same slots, once the pause is over (handle.retry_at), instead of failing its whole room list.

A real bootstrap server (`epd-transfer bootstrap`, stopped with SIGSTOP while the look-up waits: busy, its port
still taking connections), a real encode rank (`epd-transfer rank`), real Mooncake `tcp` on 127.0.0.1.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

from live_helpers import HOST, LIVE, reaped, wait_until

from transfer import harness
from transfer.bootstrap import BootstrapClient
from transfer.errors import BootstrapError

pytestmark = LIVE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOUND_S = 120.0
ITEMS, SPAN, HIDDEN, INFLIGHT = 8, 8, 64, 4


def _registered(address: str) -> bool:
    try:
        BootstrapClient(address).route(0, 0, 2.0)
    except BootstrapError:
        return False
    return True


def test_a_prefill_rank_whose_first_look_up_times_out_gets_every_room_once_the_server_answers():
    sc = harness.Scenario(encode_ranks=1, prefill_ranks=1, items=ITEMS, span=SPAN, hidden=HIDDEN, inflight=INFLIGHT,
                          protocol="tcp", host=HOST, timeout_s=BOUND_S)
    with reaped(subprocess.Popen([sys.executable, "-m", "transfer.cli", "bootstrap", "--port", "0"], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) as server:
        address = server.stdout.readline().strip().removeprefix("bootstrap server on http://")
        with reaped(subprocess.Popen(
                [sys.executable, "-m", "transfer.cli", "rank", "--role", "encode", "--rank", "0", "--bootstrap",
                 address, "--protocol", "tcp", "--items", str(ITEMS), "--span", str(SPAN), "--hidden", str(HIDDEN),
                 "--inflight", str(INFLIGHT), "--bootstrap-timeout", str(BOUND_S), "--timeout", str(BOUND_S)],
                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) as encode:
            assert wait_until(lambda: _registered(address) or encode.poll() is not None, BOUND_S)
            assert encode.poll() is None, encode.communicate()[1]
            lines: list[str] = []
            resumed = threading.Event()

            def say(line: str) -> None:
                # The rank's first line comes once a room failed: the look-up that stalled is over.
                lines.append(line)
                if not resumed.is_set():
                    resumed.set()
                    os.kill(server.pid, signal.SIGCONT)

            result: dict = {}

            def run() -> None:
                try:
                    result["report"] = harness.prefill_rank(sc, 0, address, lambda: None, lambda: None, lambda: None,
                                                            say=say)
                except BaseException as exc:  # noqa: BLE001 - the test reads it
                    result["error"] = exc

            os.kill(server.pid, signal.SIGSTOP)
            rank = threading.Thread(target=run, daemon=True)
            try:
                rank.start()
                rank.join(BOUND_S)
            finally:
                os.kill(server.pid, signal.SIGCONT)
            assert not rank.is_alive(), f"the prefill rank did not finish within {BOUND_S:g}s; it said: {lines}"
            assert "error" not in result, result.get("error")
            report = result["report"]
            assert report["failed"] == [], (report["failed"], lines)
            assert sorted(report["rooms"]) == list(range(ITEMS)), "each room counts once, retried or not"
            assert report["verified_bytes"] == report["bytes"] > 0 and report["bad"] == []
            retry = [line for line in lines if "asking for the room again" in line]
            assert report["retried"] >= 1 and len(retry) == report["retried"], lines
            assert retry[0].startswith(f"prefill rank 0: room 0 failed: bootstrap {address}: "), retry[0]
            assert re.search(r"; its bootstrap server is paused after a slow failure: asking for the room again in "
                             r"\d+\.\ds, once that pause is over \(retry 1 of 3\)$", retry[0]), retry[0]
            summary = harness.summarize(sc, [report])
            assert (summary["failed"], summary["retried"], summary["verified"]) == (0, report["retried"], True)
            _, err = encode.communicate(timeout=BOUND_S)
            assert encode.returncode == 0, err

"""A control connection whose link went dead is dropped and made afresh (EPD_ZMQ_TCP_TIMEOUT_S),
so what is sent once the link is back goes out at once, not after TCP's retransmission back-off.

The two ends run in two network namespaces joined by a TUN relay the test cuts (tun_link.py):
root and /dev/net/tun are needed, the test skips without them. Nothing leaves those namespaces."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PUSH_ADDR, PULL_ADDR, PORT = "10.237.0.1", "10.237.0.2", 17001

#: The timeout the pushing end runs under: short, so the test is.
TCP_TIMEOUT_S = "2"

#: The longest any answer of a peer may take (each of its own waits is bounded by 30 s).
ANSWER_S = 45.0


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (it makes network namespaces)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun (the relay between the namespaces)"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    return None


class Peer:
    """A link_cut_peers.py end in a namespace, driven a line at a time."""

    def __init__(self, ns: str, role: str, host: str, env: dict[str, str]) -> None:
        self.role = role
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(HERE / "link_cut_peers.py"),
                                      role, host, str(PORT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def line(self, timeout: float = ANSWER_S) -> str:
        """Its next line; AssertionError when none comes within `timeout`."""
        return _read_line(self.proc, timeout, f"{self.role} end")

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return self.line()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Link:
    """The relay between the two namespaces: `set("down")` cuts the link, `set("up")` restores it."""

    def __init__(self, relay: subprocess.Popen, ctrl: Path) -> None:
        self.relay, self.ctrl = relay, ctrl

    def set(self, state: str) -> None:
        """Returns once the relay holds the link in `state`."""
        self.ctrl.write_text(state)
        assert _read_line(self.relay, ANSWER_S, "relay") == state


def _read_line(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """`proc`'s next line of output (unbuffered reads, so select() sees what is left)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    end = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        readable, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        chunk = os.read(fd, 1) if readable else b""
        if not chunk:
            raise AssertionError(f"the {what} said nothing more within {timeout:g}s (so far: {line!r}; exit status "
                                 f"{proc.poll()})")
        line += chunk
    return line.decode().strip()


@pytest.fixture
def link(tmp_path) -> Iterator[tuple[str, str, Link]]:
    """(push namespace, pull namespace, the link between them)."""
    why = _unavailable()
    if why:
        pytest.skip(why)
    tag = f"dl{os.getpid() % 100000}"
    namespaces = (f"{tag}push", f"{tag}pull")
    ctrl = tmp_path / "link"
    ctrl.write_text("up")
    relay = None
    try:
        for ns in namespaces:
            subprocess.run(["ip", "netns", "add", ns], check=True)
        relay = subprocess.Popen([sys.executable, str(HERE / "tun_link.py"), namespaces[0], PUSH_ADDR, namespaces[1],
                                  PULL_ADDR, tag, str(ctrl)], stdout=subprocess.PIPE)
        assert _read_line(relay, ANSWER_S, "relay") == "ready"
        yield namespaces[0], namespaces[1], Link(relay, ctrl)
    finally:
        for ns in namespaces:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-KILL", pid], check=False)
        if relay is not None:
            relay.kill()
            relay.wait()
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def test_dead_link_dropped_and_remade(link):
    push_ns, pull_ns, cut = link
    env = {**os.environ, "EPD_ZMQ_TCP_TIMEOUT_S": TCP_TIMEOUT_S}
    peers = [Peer(pull_ns, "pull", PULL_ADDR, env)]
    try:
        listener = peers[0]
        assert listener.line() == "ready"
        peers.append(Peer(push_ns, "push", PULL_ADDR, env))
        pusher = peers[1]
        assert pusher.line() == "ready"
        assert pusher.ask("send before") == "sent"
        assert listener.line() == "got before"
        cut.set("down")
        # ZMQ still counts the connection up and takes it; its bytes go unacknowledged from here.
        assert pusher.ask("send lost") == "sent"
        # Without a bound TCP retransmits for about 15 minutes before it gives up on the connection.
        assert pusher.ask("drop 30") == "dropped"
        cut.set("up")
        # Sent on a fresh connection: the one the dead link left behind was let go, with what it held.
        assert pusher.ask("send after") == "sent"
        assert listener.line() == "got after"
    finally:
        for peer in peers:
            peer.stop()

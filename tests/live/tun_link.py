"""A link between two network namespaces that a test can cut: each gets a TUN device, and a
relay in the root namespace copies packets between them while the link is up and drops them
while it is down (no sch_netem needed). Needs root and /dev/net/tun.

Run as `python tun_link.py NS_A ADDR_A NS_B ADDR_B TAG CTRL`: it prints "ready" once both
devices are up, then reads CTRL every 0.1 s ("up" or "down"), printing the state whenever it changes (it holds from
then on), until it is killed."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def main(ns_a: str, addr_a: str, ns_b: str, addr_b: str, tag: str, ctrl: str) -> None:
    devices = {}
    for name, ns, mine, peer in ((f"{tag}a", ns_a, addr_a, addr_b), (f"{tag}b", ns_b, addr_b, addr_a)):
        devices[name] = tun(name)
        for command in (("link", "set", name, "netns", ns), ("-n", ns, "addr", "add", mine, "peer", peer, "dev", name),
                        ("-n", ns, "link", "set", name, "up"), ("-n", ns, "link", "set", "lo", "up")):
            subprocess.run(("ip", *command), check=True)
    fa, fb = devices.values()
    other = {fa: fb, fb: fa}
    print("ready", flush=True)
    down, read_at = False, 0.0
    while True:
        if time.monotonic() - read_at > 0.1:
            read_at = time.monotonic()
            try:
                with open(ctrl) as f:
                    now_down = f.read().strip() == "down"
            except OSError:
                now_down = down
            if now_down != down:
                down = now_down
                print("down" if down else "up", flush=True)
        readable, _, _ = select.select([fa, fb], [], [], 0.05)
        for fd in readable:
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not down:
                    try:
                        os.write(other[fd], packet)
                    except OSError:
                        pass


if __name__ == "__main__":
    main(*sys.argv[1:7])

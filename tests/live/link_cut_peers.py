"""The two ends of test_dead_link_reconnect, each run in its own network namespace: a status
listener (`pull HOST PORT`) and a pushing socket watched for drops (`push HOST PORT`), as the
prefill side's asks and the encode side's statuses use them. Each reads commands on stdin and
answers one line on stdout."""

from __future__ import annotations

import sys
import time

import zmq

from transfer import _io


def pull(host: str, port: int) -> None:
    """Prints `got TEXT` for each message."""
    sock, _ = _io.pull_socket(host, port)
    print("ready", flush=True)
    while True:
        frames = sock.recv_multipart()
        print("got", frames[0].decode(), flush=True)


def push(host: str, port: int) -> None:
    """`send TEXT` queues a message, retried while the socket takes none (as the core retries an ask),
    up to 30 s: `sent` or `refused`. `drop S` waits up to S seconds for the connection to be
    reported lost: `dropped` or `not dropped`."""
    sock = _io.push_socket(host, port, immediate=True, reconnect_max_ms=_io.STATUS_RECONNECT_MAX_MS)
    monitor = _io.watch_drops(sock)
    print("ready", flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "send":
            end = time.monotonic() + 30
            while True:
                try:
                    _io.send_frames(sock, [arg.encode()])
                    print("sent", flush=True)
                    break
                except zmq.Again:
                    if time.monotonic() > end:
                        print("refused", flush=True)
                        break
                    time.sleep(0.05)
        elif command == "drop":
            end = time.monotonic() + float(arg)
            lost = _io.dropped(monitor)
            while not lost and time.monotonic() < end:
                time.sleep(0.05)
                lost = _io.dropped(monitor)
            print("dropped" if lost else "not dropped", flush=True)


if __name__ == "__main__":
    {"pull": pull, "push": push}[sys.argv[1]](sys.argv[2], int(sys.argv[3]))

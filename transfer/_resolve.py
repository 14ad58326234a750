"""Host names looked up, and connected to, within a deadline.

getaddrinfo() takes no timeout: a resolver that does not answer holds its caller through its own
retries, many seconds, past any bound a caller set on its connect. Here a name is looked up on a
thread of its own, which callers wait for at most their own bound.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Any

from transfer._forks import free_in_child

__all__ = ["connect_within", "resolve"]


class _NameLookUp:
    """One host name's getaddrinfo() on a thread of its own, for every request that waits on it."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.done = threading.Event()
        self.infos: list[Any] = []
        self.error: OSError | None = None
        threading.Thread(target=self._run, args=(key,), name="epd-name-lookup", daemon=True).start()

    def _run(self, key: tuple[str, int]) -> None:
        try:
            self.infos = socket.getaddrinfo(*key, type=socket.SOCK_STREAM)
        except OSError as error:
            self.error = error
        except Exception as error:  # noqa: BLE001 - e.g. a UnicodeError: the requests waiting get it as an OSError
            self.error = OSError(f"{type(error).__name__}: {error}")
        finally:
            with _name_lookups_lock:
                if _name_lookups.get(key) is self:
                    del _name_lookups[key]
            self.done.set()


# Host name look-ups under way, one per (host, port): a resolver that does not answer holds one
# thread per name, however many requests wait for it.
_name_lookups: dict[tuple[str, int], _NameLookUp] = {}
_name_lookups_lock = free_in_child(threading.Lock())


def resolve(host: str, port: int, timeout: float) -> list[Any]:
    """getaddrinfo(host, port) for TCP within `timeout` seconds, TimeoutError past it: a name is looked up
    on a thread of its own (one per name, however many callers wait for it), an IP address at once."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    key = (host, port)
    with _name_lookups_lock:
        lookup = _name_lookups.get(key)
        if lookup is None:
            lookup = _name_lookups[key] = _NameLookUp(key)
    if not lookup.done.wait(max(0.0, timeout)):
        raise TimeoutError(f"looking up the host name {host!r} did not answer within {timeout:.3g}s")
    if lookup.error is not None:
        raise type(lookup.error)(*lookup.error.args)  # each waiter its own: a raised error keeps its traceback
    return lookup.infos


def connect_within(host: str, port: int, deadline: float) -> socket.socket:
    """A TCP connection (no Nagle delay) to `host`'s addresses in turn, as socket.create_connection makes,
    looked up and connected by `deadline` (time.monotonic()); the OSError of the last address tried,
    or TimeoutError when the look-up did not answer in time. The socket's timeout is left to the caller."""
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in resolve(host, port, deadline - time.monotonic()):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(max(0.0, deadline - time.monotonic()) or 1e-6)
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error or OSError(f"host name {host!r} has no address")

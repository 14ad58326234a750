"""Listening ports: a fixed port, any free one, or the first free one of a range.

Every listener of the library takes its port through here: the bootstrap server, a
sender pool's request socket, a session manager's status socket, a `WireEngine`'s
listener and the metrics endpoint. A setting is an int (`0`: any free port), a
`(first, last)` pair or a `"FIRST-LAST"` string (both ends included); `bind_port`
tries the range in order and takes the first port that is not in use.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from collections.abc import Callable
from typing import TypeVar, Union

from transfer.errors import ConfigError, ConfigTypeError, ListenError, PortsInUse

__all__ = ["PortSpec", "bind_port", "cannot_listen", "describe_ports", "is_wildcard", "not_this_host", "parse_ports",
           "port_in_use"]

#: A listener's port setting: `8998`, `0` (any free port), `(30000, 30100)` or `"30000-30100"`.
PortSpec = Union[int, str, tuple[int, int]]

T = TypeVar("T")

_RANGE = re.compile(r"\s*([0-9]{1,5})\s*(?:-\s*([0-9]{1,5})\s*)?")


def parse_ports(spec: object) -> tuple[int, int]:
    """(first, last) of a port setting; (0, 0) means any free port. ConfigError when it is not one."""
    if isinstance(spec, bool):
        raise ConfigTypeError(f"port must be an int, a (first, last) pair or 'FIRST-LAST', got {spec!r}")
    if isinstance(spec, int):
        first = last = spec
    elif isinstance(spec, str):
        match = _RANGE.fullmatch(spec)
        if match is None:
            raise ConfigError(f"port {spec!r} is neither a port (0-65535) nor a range FIRST-LAST (e.g. 30000-30100)")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
    elif isinstance(spec, (tuple, list)) and len(spec) == 2 and all(
            isinstance(p, int) and not isinstance(p, bool) for p in spec):
        first, last = spec
    else:
        raise ConfigTypeError(f"port must be an int, a (first, last) pair or 'FIRST-LAST', got {spec!r}")
    if not (0 <= first <= 0xFFFF and 0 <= last <= 0xFFFF):
        raise ConfigError(f"port {_shown(spec)} is outside 0-65535")
    if first != last and (first == 0 or first > last):
        raise ConfigError(f"port range {_shown(spec)} must run from a first port of 1 or more up to a last one "
                          f"no smaller")
    return first, last


def describe_ports(spec: object) -> str:
    """A setting as operators write it: `8998`, `any free port` or `30000-30100`."""
    first, last = parse_ports(spec)
    if first == last:
        return "any free port" if first == 0 else str(first)
    return f"{first}-{last}"


def bind_port(spec: object, bind: Callable[[int], T], what: str) -> T:
    """Calls `bind(port)` for the setting's ports in order and returns the first success.

    A port of a range that is in use (EADDRINUSE) is passed over; any other error is
    raised at once. A single port (or 0) is bound as given, its error unchanged; a
    range with no free port raises PortsInUse naming `what` and the range.
    """
    first, last = parse_ports(spec)
    if first == last:
        return bind(first)
    for port in range(first, last + 1):
        try:
            return bind(port)
        except Exception as exc:  # an OSError, or a zmq.ZMQError (not one), both with the errno
            if getattr(exc, "errno", None) != errno.EADDRINUSE:
                raise
    raise PortsInUse(errno.EADDRINUSE, f"{what}: no free port in {first}-{last}: every one is in use")


def cannot_listen(what: str, host: str, port: int, error: OSError) -> str:
    """What a failed bind of `what` (a server, an endpoint) on host:port said, naming both."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"{what} cannot listen on {address}: {error.strerror or error}"


def listen_error(what: str, host: str, port: int, error: OSError, hint: str = "",
                 reached: str = "it") -> Exception:
    """What a failed bind of `what` on host:port raises, naming both and saying what to do: PortsInUse (errno
    EADDRINUSE kept, so a range passes the port over; `hint` names a likely holder) for a port in use,
    ConfigError for an address not of this host (the one peers reach `reached` on), ListenError (the bind's
    errno kept) for any other error."""
    said = cannot_listen(what, host, port, error)
    if error.errno == errno.EADDRINUSE:
        return port_in_use(said, port, hint)
    if not_this_host(error):
        return ConfigError(f"{said}: give an address of this host (the one peers reach {reached} on)")
    if error.errno == errno.EACCES:
        return ListenError(errno.EACCES, f"{said}: this process may not listen on port {port} (a port below 1024 "
                                         f"needs root or the CAP_NET_BIND_SERVICE capability); give a port of 1024 "
                                         f"or more, 0 (any free one) or a range FIRST-LAST")
    if error.errno in (errno.EMFILE, errno.ENFILE):
        return ListenError(error.errno, f"{said}: no file descriptor left; raise the limit on open files (ulimit -n) "
                                        f"or close what this process holds open")
    return ListenError(error.errno or 0, f"{said}: give an IP address of this host that it can listen on (the one "
                                         f"peers reach {reached} on) and a port of 1024 or more, 0 (any free one) "
                                         f"or a range FIRST-LAST")


def port_in_use(said: str, port: int, hint: str = "") -> PortsInUse:
    """PortsInUse (errno EADDRINUSE kept, so a range passes the port over) saying what to do; `hint` names
    a likely holder."""
    return PortsInUse(errno.EADDRINUSE, f"{said}: another process holds it{hint}; give another port, 0 (any free "
                                        f"one) or a range FIRST-LAST, or find what holds it "
                                        f"(ss -ltnp 'sport = :{port}')")


def not_this_host(error: OSError) -> bool:
    """Whether a bind failed for an address that is not this host's (or a name that does not resolve)."""
    return error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror)


def _shown(spec: object) -> str:
    return repr(spec) if isinstance(spec, str) else str(spec)


def bare_host(host: str) -> str:
    """`host` without a `:port` suffix (as Mooncake takes one) and without IPv6 brackets."""
    if host.count(":") == 1 and host.rpartition(":")[2].isdigit():
        host = host.rpartition(":")[0]
    return host.strip("[]")


#: The characters of an IPv4 address as inet_aton() reads one (decimal, octal or hexadecimal parts).
_INET_ATON_CHARACTERS = "0123456789abcdefABCDEFxX."


def is_wildcard(host: str) -> bool:
    """Whether `host` (optionally with a `:port` suffix, an IPv6 one bracketed or not) is an unspecified
    address, which binds every interface but names no host a peer can reach: 0.0.0.0 or :: in any spelling
    connect() and bind() take for one, an IPv4-mapped 0.0.0.0 and inet_aton's forms of 0.0.0.0 (`0`, `0x0`,
    `0.0`, `000.000.000.000`, which the system's getaddrinfo() reads as an address) among them. Never looked up."""
    bare = bare_host(host)
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        if not bare or bare.strip(_INET_ATON_CHARACTERS):
            return False  # a name or not an address at all
        try:
            return socket.inet_aton(bare) == bytes(4)
        except OSError:
            return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_unspecified or (mapped is not None and mapped.is_unspecified)

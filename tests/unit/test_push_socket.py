"""transfer._io.push_socket refuses a host it must not connect to with the ZMQError its callers
handle, before any socket is made; peer_address puts an IP on the wire."""

from __future__ import annotations

import errno
import re

import pytest
import zmq

from transfer import _io
from transfer.errors import ConfigError


@pytest.mark.parametrize("host", ["\ud800", "h\u00f6st", "victim.slow", "localhost", "10.0.0.1:5", "",
                                  # ZMQ strips one enclosing pair of brackets and looks up the rest as a name
                                  "10.0.0.1]", "[10.0.0.1", "]10.0.0.1[", "[[::1]]", "::1]", "[::1", "[]", "[", "]"])
def test_a_host_that_is_not_an_ip_address_is_a_zmq_error_and_no_socket(host, monkeypatch):
    """A name would be looked up on ZMQ's one I/O thread, holding every socket of the process."""
    monkeypatch.setattr(_io, "context", lambda: pytest.fail("a socket was made for a host that cannot be used"))
    with pytest.raises(zmq.ZMQError, match=r"is not an IP address \(peers are reached by IP") as caught:
        _io.push_socket(host, 7000, immediate=True)
    assert caught.value.errno == errno.EINVAL


@pytest.mark.parametrize("host", ["10.0.0.1", "::1", "[::1]", "fe80::1%2", "[fe80::1%2]", "[10.0.0.1]"])
def test_ip_addresses_are_ip_addresses(host):
    assert _io.is_ip(host)


@pytest.mark.parametrize("host, address", [("10.0.0.5", "10.0.0.5"), ("10.0.0.5:17000", "10.0.0.5"),
                                           ("[::1]", "::1"), ("::1", "::1")])
def test_an_ip_address_is_its_own_peer_address(host, address, monkeypatch):
    monkeypatch.setattr(_io.socket, "getaddrinfo", lambda *a, **k: pytest.fail("an IP address was looked up"))
    assert _io.peer_address(host, "host") == address


def test_a_name_is_looked_up_once_and_one_that_does_not_resolve_is_a_config_error(monkeypatch):
    looked_up = []

    def getaddrinfo(name, *args, **kwargs):
        looked_up.append(name)
        if name == "node5":
            return [(2, 1, 6, "", ("10.1.2.3", 0))]
        raise _io.socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(_io.socket, "getaddrinfo", getaddrinfo)
    assert _io.peer_address("node5", "host") == "10.1.2.3"
    with pytest.raises(ConfigError, match=r"^host 'nowhere' does not resolve \(\[Errno -2\] Name or service not known\)"):
        _io.peer_address("nowhere", "host")
    assert looked_up == ["node5", "nowhere"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "0.0.0.0:17000", "anywhere"])
def test_a_wildcard_address_is_no_peer_address(host, monkeypatch):
    # A sender pool registers it with the bootstrap server, a session manager sends it in every ask:
    # a peer on another host that connects there reaches its own host.
    monkeypatch.setattr(_io.socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("0.0.0.0", 0))])
    with pytest.raises(ConfigError, match=rf"^host '{re.escape(host)}' is a wildcard address: .*give this node's IP"):
        _io.peer_address(host, "host")

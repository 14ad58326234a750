"""transfer._io.push_socket to an IPv6 address (a route a bootstrap server may name, SPEC.md section 5): its
messages reach the listener there. Real ZMQ on the IPv6 loopback."""

from __future__ import annotations

import pytest
import zmq

from transfer import _io


@pytest.fixture
def ipv6_listener():
    """A PULL socket on [::1] (skipped where this host has no IPv6 loopback); yields it and its port."""
    pull = _io.context().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.IPV6, 1)
    try:
        port = pull.bind_to_random_port("tcp://[::1]")
    except zmq.ZMQError as error:
        pull.close(0)
        pytest.skip(f"no IPv6 loopback here: {error}")
    yield pull, port
    pull.close(0)


@pytest.mark.parametrize("host", ["::1", "[::1]"])
@pytest.mark.parametrize("immediate", [False, True], ids=["queued", "immediate"])
def test_a_push_socket_to_an_ipv6_address_connects_and_delivers(ipv6_listener, host, immediate):
    """ZMQ takes an IPv6 address only on a socket with its IPv6 option set: without it, the socket never
    connects, and a prefill rank's asks to an encode rank registered at one wait out their deadline."""
    pull, port = ipv6_listener
    push = _io.push_socket(host, port, immediate=immediate)
    try:
        poller = zmq.Poller()
        poller.register(push, zmq.POLLOUT)
        assert poller.poll(3000), "the socket never connected"
        push.send(b"ask")
        assert pull.poll(3000) and pull.recv() == b"ask"
    finally:
        push.close(0)


def test_a_push_socket_to_an_ipv4_address_keeps_zmqs_default_of_ipv4_only():
    push = _io.push_socket("127.0.0.1", 9, immediate=True)
    try:
        assert push.getsockopt(zmq.IPV6) == 0
    finally:
        push.close(0)

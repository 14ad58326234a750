"""transfer._io.push_socket refuses a host ZMQ cannot encode with the ZMQError its callers handle."""

from __future__ import annotations

import errno

import pytest
import zmq

from transfer import _io


@pytest.mark.parametrize("host", ["\ud800", "h\u00f6st"])
def test_a_host_zmq_cannot_encode_is_a_zmq_error_and_no_socket(host, monkeypatch):
    monkeypatch.setattr(_io, "context", lambda: pytest.fail("a socket was made for a host that cannot be used"))
    with pytest.raises(zmq.ZMQError, match="is not an address ZMQ can connect to") as caught:
        _io.push_socket(host, 7000, immediate=True)
    assert caught.value.errno == errno.EINVAL

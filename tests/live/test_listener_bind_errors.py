"""Every bind failure of the bootstrap server, a wire listener, a prefill rank's status socket, an encode
rank's request socket and a metrics endpoint raises a TransferError naming the listener and its address and
saying what to do."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import zmq
from live_helpers import HOST, LIVE, request_socket, status_socket

from transfer.bootstrap import BootstrapServer
from transfer.errors import ConfigError, ListenError, TransferError
from transfer.wire_engine import WireEngine

pytestmark = LIVE

HERE = os.path.dirname(os.path.abspath(__file__))
#: A link-local IPv6 address: binding one without its scope (fe80::1%eth0) is refused (EINVAL), or, on a
#: host without IPv6, no IPv6 socket opens at all.
LINK_LOCAL = "fe80::1"
WHAT_TO_DO = "give an IP address of this host that it can listen on"


@pytest.mark.parametrize("listen, what", [(BootstrapServer, "bootstrap server"), (WireEngine, "wire listener")],
                         ids=["bootstrap server", "wire listener"])
def test_a_listener_on_an_address_it_cannot_bind_says_what_to_do(listen, what):
    with pytest.raises(ListenError) as caught:
        listen(LINK_LOCAL, 0)
    assert isinstance(caught.value, OSError) and caught.value.errno not in (0, None, errno.EADDRINUSE)
    assert caught.value.strerror.startswith(f"{what} cannot listen on [{LINK_LOCAL}]:0: ")
    assert WHAT_TO_DO in caught.value.strerror


@pytest.mark.parametrize("listen, what", [
    (status_socket, "prefill rank 0's status socket"), (request_socket, "encode rank 0's request socket"),
], ids=["status socket", "request socket"])
def test_a_zmq_socket_on_an_ipv6_address_says_it_takes_ipv4(listen, what):
    with pytest.raises(ConfigError, match=rf"^{what} cannot listen on \[::1\]:0: No such device: give an IPv4 "
                                          r"address of this host"):
        listen("::1", 0)


def test_a_port_this_process_may_not_listen_on_says_what_to_do():
    # Run as the nobody user when this is root: ports below 1024 are privileged there.
    port = 1
    child = subprocess.run([sys.executable, os.path.join(HERE, "unprivileged_listeners.py"), str(port)],
                           capture_output=True, text=True, timeout=120, cwd=HERE)
    assert child.returncode == 0, child.stderr[-4000:]
    raised = json.loads(child.stdout.splitlines()[-1])
    if all(outcome is None for outcome in raised.values()):
        pytest.skip(f"this host lets unprivileged processes listen on port {port}")
    what = {"bootstrap server": "bootstrap server", "wire listener": "wire listener",
            "status socket": "prefill rank 0's status socket", "request socket": "encode rank 0's request socket",
            "metrics endpoint": "metrics endpoint"}
    for name, outcome in raised.items():
        assert outcome is not None, f"{name} bound port {port}"
        kind, bases, number, text = outcome
        assert kind.endswith("ListenError") and TransferError.__name__ in bases and number == errno.EACCES, outcome
        if name.endswith("socket"):
            assert zmq.ZMQError.__name__ in bases, outcome  # what such a bind raised before, still caught
        assert text == (f"[Errno {errno.EACCES}] {what[name]} cannot listen on {HOST}:{port}: Permission denied: "
                         f"this process may not listen on port {port} (a port below 1024 needs root or the "
                         f"CAP_NET_BIND_SERVICE capability); give a port of 1024 or more, 0 (any free one) or a "
                         f"range FIRST-LAST")

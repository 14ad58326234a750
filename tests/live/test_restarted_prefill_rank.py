"""A prefill rank killed while its asks are parked, restarted with a new Mooncake session, retries its rooms."""

from __future__ import annotations

import itertools
import random

import pytest
from live_helpers import LIVE, bootstrap_server, encode_process, free_port, prefill_process, wait_until

pytestmark = LIVE

SPAN, HIDDEN = 8, 64
# A random start: ranks of other deployments on this host must not share our rooms.
_rooms = itertools.count(random.randrange(1 << 20, 1 << 40))


@pytest.mark.parametrize("status_port", ["same", "new"])
def test_a_restarted_rank_retrying_its_rooms_gets_them_at_once(status_port):
    """The successor (the same status endpoint, or the same rank of the block at a new one)
    supersedes the killed rank's parked asks: every retried room succeeds with its bytes
    checked, instead of failing on two receivers for a fanout of one."""
    retried = [next(_rooms) for _ in range(6)]
    port = free_port() if status_port == "same" else 0
    with bootstrap_server() as server, encode_process(server.address, fanout_timeout_s=60.0) as encode:
        first = prefill_process(server.address, span=SPAN, hidden=HIDDEN, slots=len(retried), status_port=port)
        try:
            first.call("ask", retried)
            # Killed once the encode rank parked every ask, before any item is sent.
            assert wait_until(lambda: encode.call("state")["asks"] == len(retried), 5.0)
        finally:
            first.kill()
        with prefill_process(server.address, span=SPAN, hidden=HIDDEN, slots=len(retried),
                             status_port=port) as second:
            assert second.info["session"] != first.info["session"]
            assert (second.info["status_port"] == first.info["status_port"]) is (status_port == "same")
            second.call("ask", retried)
            encode.call("send", retried, SPAN, HIDDEN)
            got = second.call("wait", retried, 10.0)
            assert got == {room: ("Success", None, True) for room in retried}  # True: every byte checked
            sent = encode.call("wait", retried, 5.0)
            assert {room: sent[room][:2] for room in retried} == {room: ("Success", None) for room in retried}
            assert any("supersedes session" in m for m in encode.call("logs"))
            assert encode.call("state")["asks"] == 0

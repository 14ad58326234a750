"""A WireEngine in a process forked from the one that started it: its listener's threads, its writer
threads and its pooled connections stayed in (or are shared with) the parent, so the child's calls are
refused at once, its close() returns at once and closes only its own copies of the descriptors, and the
parent's engine writes on, on the same connection, as before."""

from __future__ import annotations

import os

import torch
from live_helpers import HOST, LIVE, in_forked_child, outcomes

from transfer.wire_engine import WireEngine

pytestmark = LIVE


def test_a_forked_childs_calls_on_the_parents_wire_engine_are_refused_and_its_close_returns():
    src = torch.ones(1024, dtype=torch.uint8)
    dst = torch.zeros(1024, dtype=torch.uint8)
    with WireEngine(HOST) as encode, WireEngine(HOST) as prefill:
        encode.register(src)
        prefill.register(dst)
        # A pooled connection to the peer, and writer threads parked for the next batch.
        batch = encode.write_async(prefill.session_id, [src.data_ptr()], [dst.data_ptr()], [1024])
        encode.wait(batch)

        def child() -> dict:
            report = outcomes({
                "write": lambda: encode.write(prefill.session_id, [src.data_ptr()], [dst.data_ptr()], [1024]),
                "write_async": lambda: encode.write_async(prefill.session_id, [src.data_ptr()], [dst.data_ptr()],
                                                          [1024]),
                "wait": lambda: encode.wait(batch),
                "register": lambda: encode.register(torch.zeros(64, dtype=torch.uint8)),
                "unregister": lambda: encode.unregister(src.data_ptr())}, messages=True)
            encode.close()  # it returns: in_forked_child waits for it 20 s at most
            encode.close()
            return {**report, "pid": os.getpid()}

        report = in_forked_child(child, wait_s=20.0)
        assert report is not None, "the child's calls on the inherited wire engine, or its close(), did not return"
        for name in ("write", "write_async", "wait", "register", "unregister"):
            assert report[name] == (f"UsageError: wire engine {encode.session_id} was made before this process "
                                    f"(pid {report['pid']}) was forked from its parent: its listener, writer threads "
                                    f"and connections are the parent's, so nothing here would carry its writes or "
                                    f"land its peers' bytes; make a WireEngine in this process"), report

        # The parent's engine is untouched: its pooled connection carries the next write, which lands.
        dst.zero_()
        encode.write(prefill.session_id, [src.data_ptr()], [dst.data_ptr()], [1024])
        assert int(dst.sum()) == 1024
        sent, received = encode.stats(), prefill.stats()
        assert sent["connections_opened"] == 1 and sent["writes"] == 2, sent
        assert received["accepted"] == 1 and received["transfers_received"] == 2, received
        # Its own listener still lands a peer's bytes after the child closed its copy.
        back = torch.zeros(1024, dtype=torch.uint8)
        encode.register(back)
        prefill_src = torch.full((1024,), 3, dtype=torch.uint8)
        prefill.register(prefill_src)
        prefill.write(encode.session_id, [prefill_src.data_ptr()], [back.data_ptr()], [1024])
        assert int(back.sum()) == 3 * 1024

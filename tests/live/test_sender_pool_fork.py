"""A sender pool in a process forked from the one that made it: its thread, sockets and bootstrap route
stayed in the parent, so the child's send() is refused at once, and neither its close() nor the
collection of its copy withdraws the parent's route; the parent's rooms go on as before."""

from __future__ import annotations

import gc

import torch
from live_helpers import HOST, LIVE, in_forked_child, outcomes

from transfer.bootstrap import BootstrapServer
from transfer.engine import Engine
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

pytestmark = LIVE

def test_a_forked_child_is_refused_the_parents_pool_and_leaves_its_route_listed():
    item = torch.arange(4 * 64, dtype=torch.float32).view(4, 64).to(torch.bfloat16)
    buf = torch.zeros(4, 64, dtype=torch.bfloat16)
    with Engine(HOST, "tcp") as encode_engine, Engine(HOST, "tcp") as prefill_engine, \
            BootstrapServer(HOST, 0) as server:
        pool = SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST)
        try:
            assert server.registered_ranks == 1

            def child() -> dict:
                report = outcomes({"send": lambda: pool.send(1, item)}, messages=True)
                pool.close()
                return report

            report = in_forked_child(child)
            assert report is not None, "the child's calls on the inherited pool did not return"
            assert report["send"].startswith("UsageError: encode rank 0's sender pool was made before this "
                                             "process"), report
            assert "make a SenderPool in this process" in report["send"], report
            assert server.registered_ranks == 1, "the child's close() withdrew the parent's route"


            def let_go() -> dict:  # the child lets its copy go unclosed, to the collector
                nonlocal pool
                del pool
                gc.collect()
                return {"collected": "yes"}

            assert in_forked_child(let_go) == {"collected": "yes"}
            assert server.registered_ranks == 1, "the collection of the child's copy withdrew the parent's route"

            # The parent's pool is untouched: it serves a room end to end.
            with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=30) as manager:
                handle = manager.receive(1, server.address, buf)
                sent = pool.send(1, item)
                assert handle.wait(20.0) == TransferPoll.Success, handle.failure
                assert torch.equal(buf, item)
                handle.clear()
                sent.wait(10.0)
                sent.clear()
        finally:
            pool.close()


def test_a_forked_childs_calls_return_at_once_though_the_parent_held_the_pools_locks():
    """The pool's thread concludes rooms under the room book's lock and the room table's: held at the fork,
    they stay held in the child for ever, so the child's send(), clear(), concluded() and close() must take
    neither (send() and concluded() are refused, clear() and close() leave the parent's rooms alone)."""
    item = torch.zeros(4, 64, dtype=torch.bfloat16)
    with Engine(HOST, "tcp") as engine, BootstrapServer(HOST, 0) as server, \
            SenderPool(engine, 0, 1, 1, server.address, host=HOST) as pool:
        handle = pool.send(1, item)

        def child() -> dict:
            outcome = outcomes({"send": lambda: pool.send(2, item), "concluded": pool.concluded})
            handle.clear()
            pool.close()
            return {**outcome, "cleared and closed": "yes"}

        report = in_forked_child(child, (pool._book.lock, pool._book.table._lock))
        assert report == {"send": "UsageError", "concluded": "UsageError", "cleared and closed": "yes"}, \
            f"the child waited on a parent's lock: {report}"
        assert handle.poll() == TransferPoll.WaitingForInput  # the parent's room is untouched
        handle.clear()

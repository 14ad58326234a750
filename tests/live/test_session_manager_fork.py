"""A session manager in a process forked from the one that made it: its sockets and I/O thread stayed
in the parent, so the child's calls that would use them are refused at once, its close() closes
nothing of the parent's, and the parent's rooms go on as before."""

from __future__ import annotations

import logging

import torch
import zmq
from live_helpers import HOST, LIVE, LogCapture, in_forked_child, outcomes, wait_until

from transfer.bootstrap import BootstrapClient, BootstrapServer
from transfer.buffers import ReceivePool
from transfer.engine import Engine
from transfer.frames import status_frames
from transfer.receiver import SessionManager
from transfer.status import TransferPoll

pytestmark = LIVE

def _in_child(manager, handle, bootstrap: str, buf: torch.Tensor) -> dict[str, object]:
    """What each call on the inherited manager did in the forked child: 'ok', or its error; then what
    close() logged there and whether it left the parent's registration alone in the child's engine."""
    report: dict[str, object] = dict(outcomes({"poll": handle.poll, "concluded": manager.concluded,
                                               "receive": lambda: manager.receive(2, bootstrap, buf[1:2])},
                                              messages=True))
    capture = LogCapture()
    logging.getLogger("transfer").addHandler(capture)
    manager.close()
    report["close logged"] = capture.take()
    report["close unregistered"] = buf.data_ptr() not in manager.engine.registered()
    return report


def test_a_forked_child_is_refused_the_parents_manager_and_the_parents_rooms_go_on():
    peer = zmq.Context.instance().socket(zmq.PULL)  # an encode rank that queues every ask
    peer.setsockopt(zmq.LINGER, 0)
    port = peer.bind_to_random_port(f"tcp://{HOST}")
    buf = torch.zeros(2, 64, dtype=torch.uint8)
    try:
        with Engine(HOST, "tcp") as engine, BootstrapServer(HOST, 0) as server, \
                SessionManager(engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=30) as manager:
            BootstrapClient(server.address, timeout=2.0).register_rank(1, 1, HOST, port, 0)
            handle = manager.receive(1, server.address, buf[:1])
            assert wait_until(lambda: handle.poll() == TransferPoll.WaitingForInput, 10.0), handle.poll()
            report = in_forked_child(lambda: _in_child(manager, handle, server.address, buf))
            assert report is not None, "the child's calls on the inherited manager did not return"
            assert report.pop("close logged") == [] and report.pop("close unregistered") is False, report
            for name, outcome in report.items():
                assert outcome.startswith("UsageError: prefill rank 0's session manager was made before this "
                                          "process"), (name, outcome)
                assert "make a SessionManager in this process" in outcome, (name, outcome)
            # The parent's manager is untouched: its room concludes on its status.
            pusher = zmq.Context.instance().socket(zmq.PUSH)
            pusher.setsockopt(zmq.LINGER, 0)
            pusher.connect(f"tcp://{HOST}:{manager.status_port}")
            try:
                pusher.send_multipart(status_frames(1, TransferPoll.Success, 0))
                assert wait_until(lambda: handle.poll() == TransferPoll.Success, 10.0), handle.failure
            finally:
                pusher.close(0)
            handle.clear()
    finally:
        peer.close(0)


def test_a_forked_childs_calls_return_at_once_though_the_parent_held_the_managers_and_pools_locks():
    """Threads of the parent (its I/O thread, the scheduler) may hold the manager's or the pool's lock at
    the fork: those stay held in the child for ever, so the child's receive(), clear() and close() must
    take neither."""
    with Engine(HOST, "tcp") as engine, BootstrapServer(HOST, 0) as server, \
            ReceivePool(engine, 4 * 1024, 1024) as slots, \
            SessionManager(engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=30) as manager:
        handle = manager.receive(1, server.address, rows=4, hidden=128, dtype="bfloat16")

        def child() -> dict:
            outcome = outcomes({"receive": lambda: manager.receive(2, server.address, rows=4, hidden=128,
                                                                   dtype="bfloat16")})
            handle.clear()
            manager.close()
            return {**outcome, "cleared and closed": "yes"}

        report = in_forked_child(child, (manager._driver._lock, slots._lock))
        assert report == {"receive": "UsageError", "cleared and closed": "yes"}, "the child waited on a parent's lock"
        handle.clear()

"""Live resource hygiene: both sides close cleanly (threads joined, ports released,
memory unregistered), concluded and cleared rooms leave no state, and every socket
of a process comes from its one ZMQ context.

The encode rank runs in its own process and reports on itself (tests/live/live_helpers.py);
the prefill ranks run here, where their internals can be inspected.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
from live_helpers import (
    HOST,
    LIVE,
    TOKEN,
    Receiver,
    bootstrap_server,
    encode_process,
    epd_threads,
    port_rebindable,
    wait_until,
)

from transfer.receiver import ENCODE_FAILED
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 8, 64
_rooms = itertools.count(random.randrange(1 << 20, 1 << 40))


def rooms(n: int) -> list[int]:
    return [next(_rooms) for _ in range(n)]


@pytest.fixture(scope="module")
def engines():
    from transfer.engine import Engine

    with Engine(HOST, protocol="tcp") as a, Engine(HOST, protocol="tcp") as b:
        yield a, b


def test_concluded_and_cleared_rooms_leave_no_state(engines):
    good, bad, unsent, unasked = rooms(24), rooms(3), rooms(2), rooms(2)
    before = [dict(e.registered()) for e in engines]
    with bootstrap_server() as server, encode_process(server.address, fanout_timeout_s=1.5) as encode:
        with Receiver(engines[0], 0, 2, fanout=2, slots=32) as r0, Receiver(engines[1], 1, 2, fanout=2, slots=32) as r1:
            for room in good + bad + unsent:
                r0.ask(room, server.address, SPAN)
                r1.ask(room, server.address, SPAN, **({"hidden": HIDDEN // 2} if room in bad else {}))
            encode.call("send", good + bad + unasked, SPAN, HIDDEN)
            sent = encode.call("wait", good + bad + unasked, 10.0)
            for r in (r0, r1):
                # `unsent` rooms: the encode rank drops asks whose item never came after its
                # fanout timeout and tells their receivers Failed.
                got = r.wait(good + bad + unsent, 10.0)
                assert {room: got[room] for room in good} == {room: ("Success", None) for room in good}
                assert all(got[room][0] == "Failed" and got[room][1].startswith(ENCODE_FAILED) for room in bad + unsent)
                for room in good:
                    assert r.landed(room) is None
                r.clear()
            assert all(sent[room][0] == "Success" for room in good)
            assert all(sent[room][0] == "Failed" for room in bad + unasked)
            assert all(sent[room][1] == "receiver never registered within 1.5s (no prefill rank asked)" for room in unasked)

            for r in (r0, r1):
                m = r.manager
                assert m._driver.rooms == {} and len(m._driver.table) == 0 and len(m._driver.core) == 0
                assert len(m._driver.core.asks) == 0
            state = encode.call("state")
            assert {k: state[k] for k in ("items", "asks", "table", "temp_sources", "pending_handles")} == {
                "items": 0, "asks": 0, "table": 0, "temp_sources": 0, "pending_handles": 0,
            }
            assert state["extra_registrations"] == []
    assert [dict(e.registered()) for e in engines] == before


def test_both_sides_close_cleanly(engines):
    from transfer.receiver import SessionManager

    done, stuck = rooms(2), rooms(1)
    before = dict(engines[0].registered())
    threads = epd_threads()
    with bootstrap_server() as server:
        encode = encode_process(server.address)
        try:
            r = Receiver(engines[0], 0, 1, fanout=1)
            port = r.manager.status_port
            assert "epd-prefill-0" in epd_threads()
            for room in done + stuck:
                r.ask(room, server.address, SPAN)
            encode.call("send", done, SPAN, HIDDEN)
            assert r.wait(done, 10.0) == {room: ("Success", None) for room in done}
            encode.call("send", rooms(1), SPAN, HIDDEN)  # offered, never asked: in flight at close
            r.close()
            # Failed by the close, not by its deadline (30 s) that a close waiting for it would have met.
            stuck_handle = r.handle(stuck[0])
            assert stuck_handle.poll() == TransferPoll.Failed
            assert stuck_handle.failure == "session manager closed"
            assert epd_threads() == threads
            assert port_rebindable(HOST, port)
            assert dict(engines[0].registered()) == before
            r.close()  # idempotent

            facts = encode.close()
        finally:
            encode.kill()
    assert facts["threads"] == [], facts
    assert facts["port_free"] and facts["registered_back"], facts
    # Failed by the close, not by its fanout timeout that a close waiting for it would have met.
    in_flight = [v for v in facts["in_flight"].values() if v[0] != "Success"]
    assert in_flight == [("Failed", "sender pool closed")], facts["in_flight"]

    # A manager given a tensor that is already registered does not unregister it on close.
    import torch

    buf = torch.zeros((4, SPAN, HIDDEN), dtype=torch.bfloat16)
    engines[0].register(buf)
    try:
        with SessionManager(engines[0], 0, 1, buffer=buf[1], host=HOST):
            pass
        assert buf.data_ptr() in engines[0].registered()
    finally:
        engines[0].unregister(buf.data_ptr())


def test_a_manager_or_pool_dropped_without_close_warns_and_closes_itself(engines):
    """Neither a session manager's nor a sender pool's thread refers to it: dropped without close(),
    each is collected, says so, and lets go of its thread, port, memory and engine claim."""
    import gc

    import torch

    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool

    prefill, encode = engines
    threads = epd_threads()
    buf = torch.zeros(4096, dtype=torch.uint8)
    manager = SessionManager(prefill, 0, 1, buffer=buf, host=HOST)
    port = manager.status_port
    with pytest.warns(ResourceWarning, match=rf"session manager of prefill rank 0 \(status port {port}\) was "
                                             r"dropped without close\(\): closing it"):
        del manager
        gc.collect()
    assert wait_until(lambda: epd_threads() == threads, 10.0), epd_threads()
    assert port_rebindable(HOST, port)
    assert buf.data_ptr() not in prefill.registered()
    with SessionManager(prefill, 0, 1, buffer=buf, host=HOST):  # the engine's claim was released
        pass

    with bootstrap_server() as server:
        pool = SenderPool(encode, 0, 1, 1, server.address, token=TOKEN, host=HOST)
        port = pool.port
        with pytest.warns(ResourceWarning, match=rf"sender pool of encode rank 0 \(port {port}\) was dropped "
                                                 r"without close\(\): closing it"):
            del pool
            gc.collect()
        assert wait_until(lambda: epd_threads() == threads, 10.0), epd_threads()
        assert port_rebindable(HOST, port)


def test_a_manager_made_at_once_on_the_engine_of_a_dropped_one_keeps_its_buffer(engines):
    """The dropped manager's close runs on a thread of its own; a manager made meanwhile on the same
    engine and buffer waits for it, and the buffer stays registered for the new one."""
    import gc
    import warnings

    import torch

    from transfer.receiver import SessionManager

    prefill, _ = engines
    buf = torch.zeros(4096, dtype=torch.uint8)
    for _ in range(5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            manager = SessionManager(prefill, 0, 1, buffer=buf, host=HOST)
            del manager
            gc.collect()
        with SessionManager(prefill, 0, 1, buffer=buf, host=HOST):
            assert buf.data_ptr() in prefill.registered(), "the dropped manager's close unregistered it"
        assert buf.data_ptr() not in prefill.registered()


def test_a_closed_manager_or_pool_warns_of_nothing_when_dropped(engines, recwarn):
    import gc

    import torch

    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool

    prefill, encode = engines
    with bootstrap_server() as server:
        with SessionManager(prefill, 0, 1, buffer=torch.zeros(1024, dtype=torch.uint8), host=HOST) as manager, \
                SenderPool(encode, 0, 1, 1, server.address, token=TOKEN, host=HOST) as pool:
            pass
        del manager, pool
        gc.collect()
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]


def test_a_send_handle_dropped_uncleared_warns_and_close_lets_go_of_its_source(engines):
    """The pool keeps an uncleared room's item, and with it its source tensor, until it closes:
    dropping the room's handle says so, and once close() returned no source is held."""
    import gc
    import warnings
    import weakref

    import torch

    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool

    prefill, encode = engines
    dst = torch.zeros((3, SPAN, HIDDEN), dtype=torch.bfloat16)
    sources: list[weakref.ref] = []
    with bootstrap_server() as server, SessionManager(prefill, 0, 1, buffer=dst, host=HOST) as manager:
        pool = SenderPool(encode, 0, 1, 1, server.address, token=TOKEN, host=HOST)
        try:
            for slot, room in enumerate(rooms(3)):
                received = manager.receive(room, server.address, dst[slot])
                source = torch.randn(SPAN, HIDDEN).to(torch.bfloat16)
                sources.append(weakref.ref(source))
                sent = pool.send(room, source)
                del source
                assert received.wait(10.0) == TransferPoll.Success and sent.wait(10.0) == TransferPoll.Success
                received.clear()
                if slot < 2:
                    with pytest.warns(ResourceWarning, match=rf"room {room}'s handle was dropped without clear\(\): "
                                                             r"the sender pool keeps the room and its source until "
                                                             r"it closes"):
                        del sent
                        gc.collect()
            gc.collect()
            assert all(ref() is not None for ref in sources), "a served room's source was let go uncleared"
        finally:
            pool.close()
        gc.collect()
        assert [ref() is None for ref in sources] == [True, True, True], "close() kept a source alive"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del sent  # its pool closed: nothing is kept for it
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught


def test_one_zmq_context_per_process(engines):
    """Every socket of ours shares the library's one context, which is not the engine's own
    zmq.Context.instance(); its I/O thread runs SCHED_BATCH, the engine's does not."""
    import zmq

    from transfer import _io

    room = rooms(1)[0]
    ours = _io.context()
    assert ours is _io.context() and ours is not zmq.Context.instance()
    assert ours.get(zmq.THREAD_SCHED_POLICY) == os.SCHED_BATCH
    with bootstrap_server() as server, encode_process(server.address) as encode:
        with Receiver(engines[0], 0, 1, fanout=1) as r:
            r.ask(room, server.address, SPAN)
            encode.call("send", [room], SPAN, HIDDEN)
            assert r.wait([room], 10.0) == {room: ("Success", None)}
            m = r.manager
            sockets = m._driver.sockets()
            assert len(sockets) == 2
            assert all(s.context is ours for s in sockets)
            # The encode process checks its PULL and its status pushers the same way.
            state = encode.call("state")
            assert state["pushers"] == 1 and state["contexts_shared"]
            assert encode.call("wait", [room], 5.0)[room][0] == "Success"

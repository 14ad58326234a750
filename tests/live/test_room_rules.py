"""Rules both ends keep about rooms and sessions: announced regions, dead sessions, deadline state."""

from __future__ import annotations

import pytest
from live_helpers import LIVE, peer_with_64_mib, wait_until

from transfer.bootstrap import BootstrapServer
from transfer.core.failure import FailureKind
from transfer.engine import Engine
from transfer.frames import TransferInfo
from transfer.metrics import total
from transfer.sender import SenderPool

pytestmark = LIVE

SESSION = "10.0.0.7:17000"


@pytest.fixture(scope="module")
def pool():
    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server, \
            SenderPool(engine, 0, 1, 1, server.address) as sender:
        yield sender


def test_pool_gauges_count_parked_rooms_while_items_change_under_them(pool):
    """parked_rooms counts items nobody asked for yet, read safely while other threads send and clear."""
    import threading

    import torch

    rows = torch.zeros(4, 256, dtype=torch.bfloat16)
    pool.engine.register(rows)
    try:
        handles = [pool.send(room, rows) for room in (101, 102)]
        assert total(pool.stats(), "epd_encode_parked_rooms") == 2
        stop = threading.Event()
        readings: list[float] = []

        def scrape() -> None:
            while not stop.is_set():
                readings.append(total(pool.stats(), "epd_encode_parked_rooms"))

        import sys

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads often, so a read can land mid-change
        scraper = threading.Thread(target=scrape)
        scraper.start()
        try:
            for room in range(1000, 1300):  # items come and go while the scraper reads
                pool.send(room, rows).clear()
        finally:
            stop.set()
            scraper.join()
            sys.setswitchinterval(interval)
        assert readings and all(2 <= value <= 3 for value in readings)  # never NaN from a racing read
        for handle in handles:
            handle.clear()
        assert total(pool.stats(), "epd_encode_parked_rooms") == 0
    finally:
        pool.engine.unregister(rows.data_ptr())


def _send_and_hear(sender, asks, statuses, status_port: int, session: str, room: int, ptr: int, item):
    """Asks for `room` as `session`, sends its item, and returns (handle, the status pushed back)."""
    from transfer.frames import parse_status

    info = TransferInfo(room, "127.0.0.1", status_port, session, ptr, 0, 4, 256, "torch.bfloat16", False, 1, 0, 4)
    asks.send_multipart(info.to_frames())
    handle = sender.send(room, item)
    assert statuses.poll(10_000), f"no status for room {room}"
    got_room, status, _, _ = parse_status(statuses.recv_multipart())
    assert got_room == room
    return handle, status


def test_a_quickly_refused_write_does_not_mark_the_session_dead():
    """A peer that refuses one write (bad destination) keeps getting the next rooms at once."""
    import time

    import torch

    from transfer import _io
    from transfer.frames import registration_frames
    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as encode_engine, Engine("127.0.0.1", "tcp") as prefill_engine, \
            BootstrapServer("127.0.0.1", 0) as server, \
            SenderPool(encode_engine, 0, 1, 1, server.address) as sender:
        landing = torch.zeros(4, 256, dtype=torch.bfloat16)
        prefill_engine.register(landing)
        statuses, status_port = _io.pull_socket("127.0.0.1", 0)
        asks = _io.push_socket(sender.host, sender.port)
        try:
            session = prefill_engine.session_id
            # A peer-style registration: no lengths, so only Mooncake itself checks the range.
            asks.send_multipart(registration_frames("127.0.0.1", status_port, session, landing.data_ptr(), 0))
            item = torch.randn(4, 256).to(torch.bfloat16)

            def ask(room: int, ptr: int):
                return _send_and_hear(sender, asks, statuses, status_port, session, room, ptr, item)

            refused, status = ask(1, landing.data_ptr() + (1 << 30))  # far outside registered memory
            assert status == TransferPoll.Failed and refused.wait(5) == TransferPoll.Failed
            # Refused, not slow (DEAD_AFTER_S or longer): the breaker holds nothing against the session.
            assert sender._core.breaker.entry(session) is None, refused.failure
            served, status = ask(2, landing.data_ptr())
            assert status == TransferPoll.Success, served.failure
            assert torch.equal(landing.view(torch.uint8), item.view(torch.uint8))
        finally:
            asks.close(0)
            statuses.close(0)


def test_concluded_rooms_leave_the_receivers_deadline_heap(caplog):
    """Thousands of concluded rooms must not sit in the deadline heap for their whole deadline,
    nor write a log line each."""
    import logging
    import time

    import torch

    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server:
        buf = torch.zeros(1, 8, 64, dtype=torch.bfloat16)
        # No encode rank registered: each ask fails fast at the bootstrap, then is cleared.
        with SessionManager(engine, 0, 1, 1, buffer=buf, deadline_s=600) as manager, \
                caplog.at_level(logging.WARNING, logger="transfer.receiver"):
            rooms = 3000
            for room in range(rooms):
                handle = manager.receive(room, server.address, buf[0])
                assert handle.wait(5) == TransferPoll.Failed
                handle.clear()
            assert manager._driver.core.deadline_entries() <= 1024 + 2
            assert not manager._driver.rooms and len(manager._driver.table) == 0
        lines = [m for m in caplog.messages if " failed: bootstrap" in m]
        # One a second, not one a room: each room fails in milliseconds, so one line a room
        # would be thousands; a tenth of that would take the loop 300 s (past pytest's timeout).
        assert 1 <= len(lines) <= rooms // 10, len(lines)
        told = [int(m.split("(and ")[1].split()[0]) for m in lines if "more like it" in m]
        assert len(lines) + sum(told) <= rooms  # each failure is logged or counted once
        assert any("more like it" in m for m in lines) or len(lines) == 1


def test_cached_route_asks_from_receive_and_keeps_deadlines():
    """Once its route is cached a room is asked for inside receive(), after its registration,
    and its deadline still wakes the I/O thread even when that thread was idle."""
    import threading
    import time

    import torch

    from transfer import _io
    from transfer.bootstrap import BootstrapClient
    from transfer.frames import is_registration, parse_registration, status_frames
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server:
        asks, port = _io.pull_socket("127.0.0.1", 0)  # a stand-in encode rank 0
        try:
            BootstrapClient(server.address).register_rank(1, 1, "127.0.0.1", port, 0)
            buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
            with SessionManager(engine, 0, 1, 1, buffer=buf, deadline_s=0.25) as manager:

                def next_message() -> list[bytes]:
                    assert asks.poll(5000), "the manager sent nothing"
                    return asks.recv_multipart()

                first = manager.receive(1, server.address, buf[0])
                reg = next_message()
                assert is_registration(reg) and parse_registration(reg).embedding_base == buf.data_ptr()
                assert TransferInfo.from_frames(next_message()).room == 1
                statuses = _io.push_socket("127.0.0.1", manager.status_port)
                statuses.send_multipart(status_frames(1, TransferPoll.Success, 0))
                assert first.wait(5) == TransferPoll.Success
                first.clear()
                statuses.close(0)
                driver = manager._driver
                # Room 1's deadline entry is gone: the I/O thread's next sleep is a full idle one (1 s).
                planned = driver._wake_at
                assert wait_until(lambda: driver._wake_at > planned and driver._wake_at - time.monotonic() > 0.9, 10.0)
                woken: list[str] = []
                real_wake = driver._waker.wake

                def wake() -> None:
                    woken.append(threading.current_thread().name)
                    real_wake()

                driver._waker.wake = wake
                second = manager.receive(2, server.address, buf[1])
                # Room 2's deadline (0.25 s) comes before that idle sleep ends: receive() woke the thread.
                assert woken == [threading.current_thread().name], woken
                driver._waker.wake = real_wake
                # Asked before receive() returned: no hand-off, and no second registration.
                assert second.poll() == TransferPoll.WaitingForInput
                assert asks.poll(5000)
                info = TransferInfo.from_frames(asks.recv_multipart())
                assert info.room == 2 and info.embedding_ptr == buf[1].data_ptr()
                # Nobody answers: the room fails at its deadline, not at the I/O thread's next idle wake-up.
                assert second.wait(10) == TransferPoll.Failed
                assert "no status from encode rank 0 at 127.0.0.1" in second.failure
                assert second.failure_kind is FailureKind.DEADLINE
        finally:
            asks.close(0)


def _ask_for_64_mib(asks, status_port: int, session: str, landing: int) -> None:
    """The peer's registration and its TransferInfo for room 1: 8192 x 4096 bf16 into its buffer."""
    from transfer.frames import registration_frames

    asks.send_multipart(registration_frames("127.0.0.1", status_port, session, landing, 0, 64 << 20, 0))
    asks.send_multipart(TransferInfo(1, "127.0.0.1", status_port, session, landing, 0, 8192, 4096,
                                     "torch.bfloat16", False, 1, 0, 8192).to_frames())


def _stuck_write(pool, peer, asks, status_port: int, session: str, landing: int, item):
    """Stops the peer, then has the pool start room 1's 64 MiB write to it; returns the room's handle."""
    import os
    import signal
    import time

    from live_helpers import wait_until

    from transfer.status import TransferPoll

    os.kill(peer.pid, signal.SIGSTOP)
    _ask_for_64_mib(asks, status_port, session, landing)
    handle = pool.send(1, item)  # not in registered memory: the pool registers it for the write
    assert wait_until(lambda: handle.poll() == TransferPoll.Transferring, 10.0)
    time.sleep(0.2)  # the 64 MiB cannot fit in the stopped peer's socket buffers
    return handle


def test_close_with_a_write_stuck_on_a_stopped_peer_returns_within_close_timeout_s_and_frees_nothing(caplog):
    """A peer that stops reading (SIGSTOP, after its handshake) leaves a write in flight inside Mooncake:
    close() gives up on it once close_timeout_s runs out, well before Mooncake's transfer timeout (30 s): it
    returns with its thread stopped while the write is still in flight, fails the room saying so, names the
    write in the log, and keeps the source registered since Mooncake may still read it."""
    import logging
    import os
    import signal
    import threading
    import time

    import torch
    from live_helpers import stopped_peer

    from transfer import _io
    from transfer.errors import EngineError
    from transfer.status import TransferPoll

    item = torch.ones(64 << 20, dtype=torch.uint8).view(torch.bfloat16).view(8192, 4096)
    with Engine("127.0.0.1", "tcp") as encode_engine, BootstrapServer("127.0.0.1", 0) as server:
        peer, session, landing = stopped_peer(encode_engine)
        pool = SenderPool(encode_engine, 0, 1, 1, server.address, close_timeout_s=3.0)
        statuses, status_port = _io.pull_socket("127.0.0.1", 0)
        asks = _io.push_socket(pool.host, pool.port)
        try:
            _ask_for_64_mib(asks, status_port, session, landing)
            handle = pool.send(1, item)  # not in registered memory: the pool registers it for the write
            assert wait_until(lambda: handle.poll() == TransferPoll.Transferring, 10.0)
            time.sleep(0.2)  # the 64 MiB cannot fit in the stopped peer's socket buffers
            with caplog.at_level(logging.ERROR, logger="transfer.sender"):
                closing = threading.Thread(target=pool.close, daemon=True)
                closing.start()
                closing.join(25.0)  # generous; the transfer timeout (30 s) is what it must not wait for
                assert not closing.is_alive(), "close() waited for the stuck write"
            assert not pool._thread.is_alive()  # it gave up on the write rather than stopping inside a call
            with pytest.raises(EngineError, match="still being read by a write to"):
                encode_engine.unregister(item.data_ptr())  # the write is still in flight: kept registered
            assert handle.poll() == TransferPoll.Failed and handle.failure_kind is FailureKind.CLOSED
            assert "write still in flight" in handle.failure and "abandoned" in handle.failure
            assert "EPD_CLOSE_TIMEOUT_S" in handle.failure
            [line] = [m for m in caplog.messages if "abandoned" in m]
            assert f"abandoned 1 writes ({64 << 20} bytes)" in line and session in line and "rooms 1;" in line
        finally:
            asks.close(0)
            statuses.close(0)
            os.kill(peer.pid, signal.SIGCONT)
            peer.kill()
            peer.wait(10)
            pool._thread.join(60)
            assert not pool._thread.is_alive()


def test_a_write_the_engine_gave_up_on_keeps_its_source_registered_until_mooncake_lets_go():
    """A peer that stops reading fails the write at the engine's transfer timeout, while Mooncake
    still reads the source: the pool must not unregister it then (the engine refuses), nor leak
    it for good: once the peer reads again, the sweep drops the temporary registration."""
    import os
    import signal

    import torch
    from live_helpers import wait_until

    from transfer import _io
    from transfer.status import TransferPoll

    peer, session, landing = peer_with_64_mib()
    try:
        item = torch.ones(64 << 20, dtype=torch.uint8).view(torch.bfloat16).view(8192, 4096)
        with Engine("127.0.0.1", "tcp", transfer_timeout_s=1.0) as encode_engine, \
                BootstrapServer("127.0.0.1", 0) as server, SenderPool(encode_engine, 0, 1, 1, server.address) as pool:
            statuses, status_port = _io.pull_socket("127.0.0.1", 0)
            asks = _io.push_socket(pool.host, pool.port)
            warm = torch.zeros(64, dtype=torch.uint8)
            encode_engine.register(warm)
            encode_engine.write(session, [warm.data_ptr()], [landing], [64])  # the handshake, before it stops
            encode_engine.unregister(warm.data_ptr())
            try:
                handle = _stuck_write(pool, peer, asks, status_port, session, landing, item)
                assert handle.wait(10) == TransferPoll.Failed
                assert "transfer timeout" in handle.failure, handle.failure
                handle.clear()
                assert item.data_ptr() in encode_engine.registered()  # Mooncake still reads it
                assert pool._sources.counts.counts() == {item.data_ptr(): 0}
                os.kill(peer.pid, signal.SIGCONT)
                assert wait_until(lambda: item.data_ptr() not in encode_engine.registered(), 30.0)
                assert pool._sources.counts.counts() == {} and not pool._sources.counts.unreleased
            finally:
                asks.close(0)
                statuses.close(0)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait(10)


@pytest.mark.driver_dies
def test_a_send_to_a_pool_whose_thread_failed_says_why_and_what_to_do():
    import torch

    from transfer.errors import UsageError
    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server, \
            SenderPool(engine, 0, 1, 1, server.address) as pool:

        def broken(offer, now):
            raise RuntimeError("injected")

        pool._core.offer = broken
        assert pool.send(1, torch.zeros(4, 256, dtype=torch.bfloat16)).wait(5) == TransferPoll.Failed
        with pytest.raises(UsageError, match=r"^sender pool's thread stopped after an error \(sender pool stopped: "
                                             r"RuntimeError: injected; its traceback is logged\): close\(\) the pool "
                                             r"and start a new one$"):
            pool.send(2, torch.zeros(4, 256, dtype=torch.bfloat16))


@pytest.mark.driver_dies
def test_a_failure_inside_the_pools_thread_fails_its_rooms_and_close_still_cleans_up(caplog):
    import logging

    import torch
    from live_helpers import port_rebindable

    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server:
        pool = SenderPool(engine, 0, 1, 1, server.address)

        def broken(offer, now):
            raise RuntimeError("injected")

        pool._core.offer = broken  # the thread calls it when an item is sent
        with caplog.at_level(logging.ERROR, logger="transfer.sender"):
            handle = pool.send(1, torch.zeros(4, 256, dtype=torch.bfloat16))
            assert handle.wait(5) == TransferPoll.Failed
        assert handle.failure == "sender pool stopped: RuntimeError: injected"
        assert any("thread failed" in m for m in caplog.messages)
        with pytest.raises(RuntimeError, match="thread stopped after an error"):
            pool.send(2, torch.zeros(4, 256, dtype=torch.bfloat16))
        pool.close()
        assert not pool._thread.is_alive() and port_rebindable(pool.host, pool.port)


def _stand_in_encode_rank(server):
    """A PULL socket registered as encode rank 0 of `server`: it takes the manager's asks."""
    from transfer import _io
    from transfer.bootstrap import BootstrapClient

    asks, port = _io.pull_socket("127.0.0.1", 0)
    BootstrapClient(server.address).register_rank(1, 1, "127.0.0.1", port, 0)
    return asks


def test_a_status_whose_handling_fails_fails_its_room_only():
    import torch
    from live_helpers import wait_until

    from transfer import _io
    from transfer.frames import status_frames
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server:
        asks = _stand_in_encode_rank(server)
        statuses = None
        try:
            buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
            with SessionManager(engine, 0, 1, 1, buffer=buf) as manager:
                checksum = manager._driver._checksum

                def checksum_or_break(region, addr, nbytes):
                    if addr == buf[0].data_ptr():
                        raise RuntimeError("injected")  # as a device error while checking would
                    return checksum(region, addr, nbytes)

                manager._driver._checksum = checksum_or_break
                first, second = manager.receive(1, server.address, buf[0]), manager.receive(2, server.address, buf[1])
                # A status answers an ask: both go out before the stand-in answers them.
                assert wait_until(lambda: all(manager._driver.core.stage(r) == "asked" for r in (1, 2)), 5)
                statuses = _io.push_socket("127.0.0.1", manager.status_port)
                landed = checksum(_io.as_region(buf), buf[1].data_ptr(), buf[1].numel() * buf.element_size())
                for room in (1, 2):
                    statuses.send_multipart(status_frames(room, TransferPoll.Success, 0, (landed,)))
                assert first.wait(5) == TransferPoll.Failed
                # It says what failed (checksumming which landed bytes), the error, and what to check.
                nbytes = buf[0].numel() * buf.element_size()
                head, tail = first.failure.split(" at 127.0.0.1:")
                assert head == (f"room 1: checksumming its landed embedding ({nbytes} bytes at {buf[0].data_ptr():#x}) "
                                f"to verify the Success from encode rank 0")
                assert tail.split(" ", 1)[1] == (
                    "failed: RuntimeError: injected; the room is failed rather than taken unverified: is its "
                    "receive memory still allocated, and its device usable?")
                assert second.wait(5) == TransferPoll.Success  # the I/O thread lives on
                assert manager._driver._thread.is_alive()
        finally:
            asks.close(0)
            if statuses is not None:
                statuses.close(0)


@pytest.mark.driver_dies
def test_a_failure_inside_the_managers_io_thread_fails_its_rooms_and_close_still_cleans_up(caplog):
    import logging

    import torch
    from live_helpers import port_rebindable

    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server:
        asks = _stand_in_encode_rank(server)
        try:
            buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
            manager = SessionManager(engine, 0, 1, 1, buffer=buf, deadline_s=30)
            handle = manager.receive(1, server.address, buf[0])
            assert asks.poll(5000), "the manager never asked"

            def broken(now, limit=None, unread=False):
                raise RuntimeError("injected")

            manager._driver.core.tick = broken  # the thread calls it on every turn
            with caplog.at_level(logging.ERROR, logger="transfer.receiver"):
                manager._driver._waker.wake()
                assert handle.wait(5) == TransferPoll.Failed  # long before its 30 s deadline
            assert handle.failure == "session manager stopped: RuntimeError: injected"
            assert any("I/O thread failed" in m for m in caplog.messages)
            with pytest.raises(RuntimeError, match="I/O thread stopped after an error"):
                manager.receive(2, server.address, buf[1])
            manager.close()
            assert not manager._driver._thread.is_alive() and port_rebindable(manager.host, manager.status_port)
        finally:
            asks.close(0)


def test_a_receiver_endpoint_that_cannot_be_connected_loses_its_status_only():
    """A TransferInfo naming a malformed status host: its status is dropped, the pool serves on."""
    import torch

    from transfer import _io
    from transfer.frames import parse_status
    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as encode_engine, Engine("127.0.0.1", "tcp") as prefill_engine, \
            BootstrapServer("127.0.0.1", 0) as server, \
            SenderPool(encode_engine, 0, 1, 1, server.address) as sender:
        landing = torch.zeros(2, 4, 256, dtype=torch.bfloat16)
        prefill_engine.register(landing)
        statuses, status_port = _io.pull_socket("127.0.0.1", 0)
        asks = _io.push_socket(sender.host, sender.port)
        try:
            session = prefill_engine.session_id
            item = torch.randn(4, 256).to(torch.bfloat16)
            for room, host in ((1, "bad host"), (2, "127.0.0.1")):
                info = TransferInfo(room, host, status_port, session, landing[room - 1].data_ptr(), 0, 4, 256,
                                    "torch.bfloat16", False, 1, 0, 4)
                asks.send_multipart(info.to_frames())
                handle = sender.send(room, item)
                assert handle.wait(10) == TransferPoll.Success, handle.failure  # the bytes were written
            assert statuses.poll(10_000), "no status for room 2"
            assert parse_status(statuses.recv_multipart())[:2] == (2, TransferPoll.Success)
            assert not statuses.poll(200), "a status reached a receiver it should not have"
            assert sender._thread.is_alive()
            dropped = [row for row in sender.stats() if row["name"] == "epd_encode_statuses_dropped_total"]
            assert [(row["type"], row["value"]) for row in dropped] == [("counter", 1)]
            for slot in (0, 1):
                assert torch.equal(landing[slot].view(torch.uint8), item.view(torch.uint8))
        finally:
            asks.close(0)
            statuses.close(0)


def test_a_route_that_cannot_be_connected_fails_its_room_only():
    import torch

    from transfer.bootstrap import BootstrapClient
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server:
        BootstrapClient(server.address).register_rank(1, 1, "-bad", 5000, 0)  # ZMQ refuses it at connect()
        buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
        with SessionManager(engine, 0, 1, 1, buffer=buf) as manager:
            first = manager.receive(1, server.address, buf[0])
            assert first.wait(5) == TransferPoll.Failed
            assert "encode rank 0 at -bad:5000" in first.failure and "cannot connect" in first.failure
            second = manager.receive(2, server.address, buf[1])  # looked up afresh, fails the same way
            assert second.wait(5) == TransferPoll.Failed and "cannot connect" in second.failure
            assert first.failure_kind is FailureKind.NO_CONNECTION
            assert manager._driver._thread.is_alive()


def test_parked_asks_are_bounded_oldest_told_failed(monkeypatch):
    """A peer asking for rooms nobody sends cannot grow the pool without bound."""
    from live_helpers import wait_until

    from transfer import _io
    from transfer.core import parked
    from transfer.frames import parse_status
    from transfer.status import TransferPoll

    monkeypatch.setattr(parked, "MAX_PARKED_ASKS", 4)
    monkeypatch.setattr(parked, "MAX_RECEIVERS_PER_ROOM", 2)
    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server, \
            SenderPool(engine, 0, 1, 1, server.address) as sender:
        statuses, status_port = _io.pull_socket("127.0.0.1", 0)
        asks = _io.push_socket(sender.host, sender.port)
        try:
            def ask(room: int, session: str = SESSION, fanout: int = 1) -> None:
                info = TransferInfo(room, "127.0.0.1", status_port, session, 0x10000, 0, 4, 256, "torch.bfloat16",
                                    False, fanout, 0, 4)
                asks.send_multipart(info.to_frames())

            for room in range(1, 7):  # each of another receiver: one holds at most a quarter of the bound
                ask(room, SESSION if room == 6 else f"10.0.0.9:{room}")
            failed = []
            while len(failed) < 2 and statuses.poll(5000):
                room, status, _, _ = parse_status(statuses.recv_multipart())
                failed.append((room, status))
            assert failed == [(1, TransferPoll.Failed), (2, TransferPoll.Failed)]
            assert wait_until(lambda: sorted(sender._core.parked) == [3, 4, 5, 6], 2.0), sorted(sender._core.parked)

            for index in range(3):  # room 6 holds two receivers: the second and third of these are too many
                ask(6, f"10.0.0.8:{index}", fanout=2)
            assert wait_until(lambda: len(sender._core.parked[6].infos) == 2, 2.0)
            assert sorted(sender._core.parked[6].infos) == sorted([SESSION, "10.0.0.8:0"])
            # The two too many are told Failed (a peer has no deadline of its own); nobody else hears a thing.
            for _ in range(2):
                assert statuses.poll(2000)
                assert parse_status(statuses.recv_multipart())[:2] == (6, TransferPoll.Failed)
            assert not statuses.poll(200)
        finally:
            asks.close(0)
            statuses.close(0)


def test_rooms_that_do_not_fit_the_wire_and_non_ascii_hosts_are_refused_up_front(pool):
    import torch

    from transfer.receiver import SessionManager

    rows = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit the wire's signed 64 bits"):
        pool.send(1 << 63, rows)
    with pytest.raises(ValueError, match="negative room -1"):
        pool.send(-1, rows)
    with Engine("127.0.0.1", "tcp") as engine:
        buf = torch.zeros(4, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="must be ASCII"):
            SessionManager(engine, 0, 1, 1, buffer=buf, host="h\u00f6st")
        with SessionManager(engine, 0, 1, 1, buffer=buf) as manager:
            with pytest.raises(ValueError, match="does not fit the wire's signed 64 bits"):
                manager.receive(1 << 63, "127.0.0.1:1", buf)
            assert not manager._driver.rooms and manager._driver._thread.is_alive()


def test_an_ask_that_fails_unexpectedly_fails_its_room_only_whichever_thread_sent_it(monkeypatch):
    import torch

    from transfer import _io
    from transfer.receiver import SessionManager
    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server:
        asks = _stand_in_encode_rank(server)
        try:
            buf = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
            with SessionManager(engine, 0, 1, 1, buffer=buf) as manager:
                send = _io.send_ask  # each ask the driver sends, from whichever thread

                def send_or_break(sock, info):
                    if info.room in (1, 3):
                        raise RuntimeError("injected")
                    return send(sock, info)

                monkeypatch.setattr(_io, "send_ask", send_or_break)
                first = manager.receive(1, server.address, buf[0])  # asked by the I/O thread
                assert first.wait(5) == TransferPoll.Failed
                assert first.failure == "room 1: asking for it failed: RuntimeError: injected"
                second = manager.receive(2, server.address, buf[1])  # the route is cached now
                # Room 1's registration may be what the stand-in reads first: the status says the ask left.
                assert wait_until(lambda: second.poll() == TransferPoll.WaitingForInput, 5), second.poll()
                assert manager._driver._thread.is_alive()
                third = manager.receive(3, server.address, buf[2])  # asked from receive() itself
                assert third.poll() == TransferPoll.Failed
                assert third.failure == "room 3: asking for it failed: RuntimeError: injected"
                third.clear()
                monkeypatch.setattr(_io, "send_ask", send)
                assert manager.receive(3, server.address, buf[2]).poll() == TransferPoll.WaitingForInput
        finally:
            asks.close(0)


def test_a_temporary_registration_gone_behind_the_pools_back_does_not_stop_it(caplog):
    import logging

    import torch

    from transfer.status import TransferPoll

    with Engine("127.0.0.1", "tcp") as engine, BootstrapServer("127.0.0.1", 0) as server, \
            SenderPool(engine, 0, 1, 1, server.address, fanout_timeout_s=0.5) as sender:
        rows = torch.zeros(4, 256, dtype=torch.bfloat16)  # not registered: the pool registers it for the room
        handle = sender.send(1, rows)
        assert rows.data_ptr() in engine.registered()
        engine.unregister(rows.data_ptr())  # the caller's mistake
        with caplog.at_level(logging.WARNING, logger="transfer.sender"):
            assert handle.wait(5) == TransferPoll.Failed  # nobody asked within 0.5 s
            assert handle.failure == "receiver never registered within 0.5s (no prefill rank asked)"
            # The driver drops the registration after it concluded the room: give it its turn.
            assert wait_until(lambda: any("dropping the temporary registration" in m for m in caplog.messages),
                              5.0), caplog.messages
        assert sender._thread.is_alive()
        handle.clear()


def test_a_peer_flooding_a_stalled_listener_meets_back_pressure():
    """Our listeners queue a bounded number of messages per peer, so a flood cannot grow memory."""
    import threading

    import torch
    import zmq

    from transfer import _io
    from transfer.receiver import SessionManager

    with Engine("127.0.0.1", "tcp") as engine:
        buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
        with SessionManager(engine, 0, 1, 1, buffer=buf) as manager:
            release = threading.Event()
            drain = manager._driver._drain_statuses

            def stalled() -> None:
                release.wait(30)  # the I/O thread is busy elsewhere for a while
                drain()

            manager._driver._drain_statuses = stalled
            flood = _io.context().socket(zmq.PUSH)
            flood.setsockopt(zmq.LINGER, 0)
            flood.setsockopt(zmq.SNDHWM, 16)
            flood.connect(f"tcp://127.0.0.1:{manager.status_port}")
            part = b"7" * (16 << 10)
            sent = 0
            limit = 3 * _io.LISTENER_HWM  # unbounded queueing would take all of these (and more)
            try:
                while sent < limit:
                    try:
                        flood.send_multipart([part, b"5", b"0"], zmq.NOBLOCK)
                        sent += 1
                    except zmq.Again:
                        # Not drained yet: wait a moment for queues to move, then decide.
                        if flood.poll(500, zmq.POLLOUT) == 0:
                            break
            finally:
                release.set()
                flood.close(0)
            assert sent < limit, f"{sent} messages queued for a listener that was not reading"
            assert sent >= _io.LISTENER_HWM // 2  # a burst of legitimate size still fits
            assert manager._driver._thread.is_alive()


def test_clearing_a_room_mid_write_keeps_its_source_registered_until_the_write_is_over():
    """clear() fails the room at once, but the temporary registration of its source stays
    until the engine is done reading it; then it goes."""
    import os
    import signal

    import torch
    from live_helpers import wait_until

    from transfer import _io

    peer, session, landing = peer_with_64_mib()
    try:
        item = torch.ones(64 << 20, dtype=torch.uint8).view(torch.bfloat16).view(8192, 4096)
        with Engine("127.0.0.1", "tcp") as encode_engine, BootstrapServer("127.0.0.1", 0) as server, \
                SenderPool(encode_engine, 0, 1, 1, server.address) as pool:
            statuses, status_port = _io.pull_socket("127.0.0.1", 0)
            asks = _io.push_socket(pool.host, pool.port)
            try:
                handle = _stuck_write(pool, peer, asks, status_port, session, landing, item)
                handle.clear()
                assert item.data_ptr() in encode_engine.registered()  # Mooncake is still reading it
                os.kill(peer.pid, signal.SIGCONT)
                assert wait_until(lambda: item.data_ptr() not in encode_engine.registered(), 30.0)
                assert not pool._sources.counts.counts() and pool._thread.is_alive()
            finally:
                asks.close(0)
                statuses.close(0)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait(10)


class _StallingEngine:
    """A real engine whose submissions to one session block, then fail: what Mooncake does
    (for 60 s, holding its lock) when that session's port accepts and never answers."""

    def __init__(self, engine, session: str, stall_s: float) -> None:
        self._engine, self._session, self._stall_s = engine, session, stall_s
        self.stalls = 0

    def write_async(self, session_id, srcs, dsts, lengths):
        if session_id == self._session:
            import time

            from transfer.engine import TransferError

            self.stalls += 1
            time.sleep(self._stall_s)
            raise TransferError(f"write to {session_id} failed (Mooncake refused the batch)")
        return self._engine.write_async(session_id, srcs, dsts, lengths)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_submission_that_stalls_the_pool_pauses_its_session_for_longer(caplog):
    """A submission that held the pool's thread for 2 s pauses its session for 8 s (not
    DEAD_SESSION_S), says why once, and the next room for it fails at once, unsubmitted."""
    import logging
    import time

    import torch

    from transfer import _io
    from transfer.sender import DEAD_SESSION_S, DEAD_STALL_FACTOR
    from transfer.status import TransferPoll

    caplog.set_level(logging.WARNING, logger="transfer.sender")
    stall_s = 2.0
    assert stall_s * DEAD_STALL_FACTOR > DEAD_SESSION_S + 2
    bogus = "127.0.0.1:9"  # never contacted: the wrapper stands in for Mooncake's handshake
    with Engine("127.0.0.1", "tcp") as real, BootstrapServer("127.0.0.1", 0) as server:
        engine = _StallingEngine(real, bogus, stall_s)
        with SenderPool(engine, 0, 1, 1, server.address) as sender:
            statuses, status_port = _io.pull_socket("127.0.0.1", 0)
            asks = _io.push_socket(sender.host, sender.port)
            try:
                item = torch.randn(4, 256).to(torch.bfloat16)

                def room_status(room: int):  # each room its own destination: a failed write's is held
                    return _send_and_hear(sender, asks, statuses, status_port, bogus, room, 0x10000 * room, item)

                first, status = room_status(1)
                assert status == TransferPoll.Failed and first.wait(5) == TransferPoll.Failed
                failed_at, until = sender._core.breaker.entry(bogus)
                assert until - failed_at == pytest.approx(DEAD_STALL_FACTOR * stall_s, abs=0.5)
                said = [m for m in caplog.messages if "held the sender pool's thread" in m]
                assert len(said) == 1 and bogus in said[0], caplog.messages
                second, status = room_status(2)
                assert status == TransferPoll.Failed
                # Failed by the pause itself, not by a write that stalled again or timed out.
                assert "skipped: a write to it failed" in second.failure, second.failure
                assert sender._core.breaker.entry(bogus) == (failed_at, until)
                assert engine.stalls == 1  # the second room was never submitted
            finally:
                asks.close(0)
                statuses.close(0)

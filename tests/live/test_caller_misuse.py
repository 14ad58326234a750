"""A caller's mistakes on either side are refused at the call, with a ConfigError naming the value,
and start no room (real Mooncake tcp, real ZMQ, the real bootstrap server)."""

from __future__ import annotations

import pytest
import torch
from live_helpers import HOST

from transfer.bootstrap import BootstrapServer
from transfer.buffers import ReceivePool
from transfer.errors import ConfigError, ConfigTypeError, TransferError
from transfer.metrics import total
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.status import TransferPoll

BF16 = "torch.bfloat16"


@pytest.fixture
def manager(engines):
    _, prefill_engine = engines
    buf = torch.zeros(4, 64, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server, \
            SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=30) as manager:
        yield manager, server.address, buf


@pytest.mark.parametrize("geometry, message", [
    (dict(rows=-1, hidden=64), "rows must be a non-negative integer, got -1"),
    (dict(rows=True, hidden=64), "rows must be a non-negative integer, got True"),
    (dict(rows=2.0, hidden=64), "rows must be a non-negative integer, got 2.0"),
    (dict(rows=2, hidden=0), "hidden must be a positive integer, got 0"),
    (dict(rows=2, hidden=64, span=4.0), "span must be a non-negative integer, got 4.0"),
    (dict(rows=2, hidden=64, row_start=-1, span=4), "row_start must be a non-negative integer, got -1"),
])
def test_a_raw_destination_with_bad_sizes_is_refused_at_the_call(manager, geometry, message):
    manager, bootstrap, buf = manager
    with pytest.raises(ConfigError, match=rf"^room 1: {message}$"):
        manager.receive(1, bootstrap, buf.data_ptr(), dtype=BF16, **geometry)
    assert total(manager.metrics.snapshot(), manager.metrics.full_name("rooms_started_total")) == 0


@pytest.mark.parametrize("address", [8998, "not an address", "http://127.0.0.1:8998"])
def test_a_malformed_bootstrap_address_is_refused_at_the_call(manager, address):
    manager, _, buf = manager
    with pytest.raises(ConfigError, match="bootstrap address must be"):
        manager.receive(1, address, buf)
    assert total(manager.metrics.snapshot(), manager.metrics.full_name("rooms_started_total")) == 0


def test_a_flat_destination_must_hold_whole_rows(manager):
    manager, bootstrap, buf = manager
    flat = buf.view(-1)
    with pytest.raises(ConfigError, match=r"^a destination of 100 elements is no whole number of rows of hidden 64$"):
        manager.receive(1, bootstrap, flat[:100], hidden=64)
    with pytest.raises(ConfigError, match=r"no whole number of rows of hidden 64$"):
        manager.receive(1, bootstrap, flat[:50], hidden=64)
    handle = manager.receive(1, bootstrap, flat[:128], hidden=64)  # two whole rows
    assert handle.poll() is not TransferPoll.Failed
    handle.clear()


def test_a_deepstack_destination_must_hold_exactly_its_rows(engines):
    _, prefill_engine = engines
    buf = torch.zeros(4, 64, dtype=torch.bfloat16)
    deep = torch.zeros(4, 128, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server, SessionManager(prefill_engine, 0, 1, 1, buffer=buf,
                                                            deepstack_buffer=deep, host=HOST, deadline_s=30) as m:
        bootstrap = server.address
        with pytest.raises(ConfigError, match=r"^room 1: deepstack destination of 768 bytes does not hold 2 rows of "
                                              r"deepstack_hidden 128 x torch.bfloat16 \(512 bytes\)$"):
            m.receive(1, bootstrap, buf[:2], deepstack_dst=deep.view(-1)[:384], deepstack_hidden=128)
        with pytest.raises(ConfigError, match=r"^room 1: deepstack destination of 2 bytes is not 2 rows of whole "
                                              r"torch.bfloat16 elements"):
            m.receive(1, bootstrap, buf[:2], deepstack_dst=deep.view(-1)[:1])
        with pytest.raises(ConfigError, match=r"^room 1: deepstack_hidden must be a positive integer, got -1$"):
            m.receive(1, bootstrap, buf[:2], deepstack_dst=deep[:2], deepstack_hidden=-1)
        assert total(m.metrics.snapshot(), m.metrics.full_name("rooms_started_total")) == 0
        handle = m.receive(1, bootstrap, buf[:2], deepstack_dst=deep[:2], deepstack_hidden=128)
        assert handle.poll() is not TransferPoll.Failed
        handle.clear()


def test_a_deepstack_destination_for_a_manager_without_a_deepstack_buffer_says_so(manager):
    manager, bootstrap, buf = manager
    with pytest.raises(ConfigError, match=r"^room 1: a deepstack destination was given, but this session manager "
                                          r"has no deepstack receive buffer: pass deepstack_buffer="):
        manager.receive(1, bootstrap, buf[:2], deepstack_dst=buf[2:4])


def test_clear_with_something_that_is_no_event_is_refused_and_keeps_the_room(manager):
    manager, bootstrap, buf = manager
    handle = manager.receive(1, bootstrap, buf)
    with pytest.raises(ConfigTypeError, match=r"^room 1: event must have query\(\)"):
        handle.clear("done")
    assert handle.poll() is not TransferPoll.Failed  # still under way
    handle.clear()


def test_a_room_cleared_before_it_concluded_counts_as_failed_cleared_and_its_bound_runs(manager):
    manager, bootstrap, buf = manager
    handle = manager.receive(1, bootstrap, buf)
    handle.clear()
    counts = {row["labels"].get("reason"): row["value"] for row in manager.metrics.snapshot()
              if row["name"] == manager.metrics.full_name("rooms_failed_total")}
    assert counts.get("cleared") == 1, counts
    assert handle.latency_s is not None  # the quarantine bound of safe_to_reuse runs from the clear


@pytest.mark.parametrize("timeout", [None, float("nan"), -1])
def test_wait_takes_a_number_of_seconds_on_both_sides(manager, engines, timeout):
    manager, bootstrap, buf = manager
    encode_engine, _ = engines
    received = manager.receive(1, bootstrap, buf)
    item = torch.zeros(4, 64, dtype=torch.bfloat16)
    encode_engine.register(item)
    try:
        with SenderPool(encode_engine, 0, 1, 1, bootstrap, host=HOST) as pool:
            sent = pool.send(7, item)
            for handle in (received, sent):
                with pytest.raises((ConfigError, ConfigTypeError), match=r"^timeout="):
                    handle.wait(timeout)
            sent.clear()
    finally:
        encode_engine.unregister(item.data_ptr())
    received.clear()


def test_send_refuses_bad_raw_sizes_and_a_room_already_sent_as_config_errors(engines):
    encode_engine, _ = engines
    item = torch.zeros(4, 64, dtype=torch.bfloat16)
    encode_engine.register(item)
    try:
        with BootstrapServer(HOST, 0) as server, SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as pool:
            for sizes, message in ((dict(span=-1, hidden=64), "span must be a non-negative integer, got -1"),
                                   (dict(span=True, hidden=64), "span must be a non-negative integer, got True"),
                                   (dict(span=2.0, hidden=64), "span must be a non-negative integer, got 2.0"),
                                   (dict(span=4, hidden=-64), "hidden must be a positive integer, got -64")):
                with pytest.raises(ConfigError, match=rf"^a raw source's {message}$"):
                    pool.send(1, item.data_ptr(), dtype=BF16, **sizes)
            first = pool.send(1, item)
            with pytest.raises(ConfigError, match=r"^room 1 is already being sent; clear\(\) it first$") as caught:
                pool.send(1, item)
            assert isinstance(caught.value, TransferError)
            first.clear()
    finally:
        encode_engine.unregister(item.data_ptr())


def test_a_raw_source_computed_with_numpy_is_sent_like_one_given_as_ints(manager, engines):
    """A pointer and span computed with numpy (base + offsets[i]) are numpy integer scalars, as a
    room may be: the room is served from exactly those rows."""
    import numpy as np

    manager, bootstrap, buf = manager
    encode_engine, _ = engines
    items = torch.arange(8 * 64, dtype=torch.int16).view(torch.bfloat16).view(8, 64)
    encode_engine.register(items)
    try:
        with SenderPool(encode_engine, 0, 1, 1, bootstrap, host=HOST) as pool:
            offsets = np.arange(2) * (4 * 64 * 2)
            sent = pool.send(np.int64(5), items.data_ptr() + offsets[1], span=np.int64(4), hidden=np.int32(64),
                             dtype=BF16)
            received = manager.receive(5, bootstrap, buf)
            assert received.wait(10) == TransferPoll.Success, received.failure
            assert sent.wait(10) == TransferPoll.Success and torch.equal(buf, items[4:])
            sent.clear()
            received.clear()
    finally:
        encode_engine.unregister(items.data_ptr())


def test_a_room_given_as_a_tensor_scalar_is_the_room_of_that_number_on_both_sides(manager, engines):
    manager, bootstrap, buf = manager
    encode_engine, _ = engines
    item = torch.randn(4, 64).to(torch.bfloat16)
    encode_engine.register(item)
    try:
        with SenderPool(encode_engine, 0, 1, 1, bootstrap, host=HOST) as pool:
            received = manager.receive(torch.tensor(6), bootstrap, buf)
            with pytest.raises(ConfigError, match=r"^room 6 is already being received"):
                manager.receive(torch.tensor(6), bootstrap, buf)
            sent = pool.send(torch.tensor(6), item)
            assert received.wait(10) is TransferPoll.Success, received.failure
            assert sent.wait(5) is TransferPoll.Success, sent.failure
            assert torch.equal(buf.view(torch.uint8), item.view(torch.uint8))
            assert [type(room) for room in manager.concluded()] == [int]
            received.clear()
            sent.clear()
    finally:
        encode_engine.unregister(item.data_ptr())


@pytest.mark.parametrize("integrity", [True, False])
def test_a_raw_source_this_process_cannot_read_is_refused_and_the_room_is_not_held(engines, integrity):
    """Mooncake's copy or the checksum would read 0x10 and kill the process once a rank asked."""
    if torch.cuda.is_available() and not integrity:
        pytest.skip("with a CUDA device and integrity off an unreadable pointer may be GPU memory")
    encode_engine, _ = engines
    item = torch.arange(4 * 16, dtype=torch.float32).view(4, 16)
    with BootstrapServer(HOST, 0) as server, \
            SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, integrity=integrity) as pool:
        with pytest.raises(ConfigError, match=r"^room 1: raw source pointer 0x10 \(256 bytes\) is not (host )?memory"):
            pool.send(1, 0x10, span=4, hidden=16, dtype="float32")
        assert encode_engine.registered().keys().isdisjoint({0x10})
        handle = pool.send(1, item)  # the room was never held: sending it is not "already being sent"
        handle.clear()


def test_a_receive_buffer_given_by_an_address_this_process_cannot_read_is_refused(engines):
    """Its checksums, or Mooncake's copies over tcp, would read it and kill the process."""
    if torch.cuda.is_available():
        pytest.skip("with a CUDA device an unreadable address may be GPU memory")
    _, prefill_engine = engines
    with pytest.raises(ConfigError, match=r"^receive buffer \[0x10, \+4096\) is not memory this process can read "
                                          r"\(this host has no CUDA device\): pass the tensor"):
        SessionManager(prefill_engine, 0, 1, 1, buffer=(0x10, 4096), host=HOST, integrity=False)
    assert prefill_engine.registered().keys().isdisjoint({0x10})
    with SessionManager(prefill_engine, 0, 1, 1, buffer=torch.zeros(4, 64), host=HOST) as manager:
        with pytest.raises(ConfigError, match=r"^receive buffer \[0x10, \+4096\) is not memory"):
            manager.add_region((0x10, 4096))
        memory = torch.zeros(1024, dtype=torch.uint8)
        added = manager.add_region((memory.data_ptr(), 1024))  # host memory it can read: taken
        assert (added.embedding.addr, added.embedding.nbytes) == (memory.data_ptr(), 1024)
        manager.remove_region(added)


def test_a_receive_region_that_may_be_gpu_memory_needs_its_tensor_for_its_checksums(manager, monkeypatch):
    from transfer import _io

    manager, _, _ = manager
    monkeypatch.setattr(_io, "cuda_present", lambda: True)
    with pytest.raises(ConfigError, match=r"^receive buffer \[0x10, \+4096\) is not host memory this process can "
                                          r"read, so its checksums cannot be read: pass the tensor \(its device says "
                                          r"where to read it\), or use integrity=False$"):
        manager.add_region((0x10, 4096))


def test_a_pool_on_another_engine_is_refused(engines):
    encode_engine, prefill_engine = engines
    with ReceivePool(encode_engine, 4096, 4096) as slots:
        with pytest.raises(ConfigError, match="registered with another engine than the manager's"):
            SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST)


def test_a_pool_on_a_closed_engine_is_refused_before_it_registers_a_route():
    """None of its writes could start: its route would only send prefill ranks' asks to be failed."""
    import threading

    from transfer.engine import Engine
    from transfer.errors import EngineError

    engine = Engine(HOST, "tcp")
    engine.close()
    threads = threading.active_count()
    with BootstrapServer(HOST, 0) as server:
        with pytest.raises(EngineError, match=rf"^engine {engine.session_id} is closed: give the sender pool an "
                                              rf"open engine$"):
            SenderPool(engine, 0, 1, 1, server.address, host=HOST)
        assert server.registered_ranks == 0
    assert threading.active_count() == threads


def test_a_session_manager_refuses_a_closed_engine_and_a_closed_pool_before_it_listens():
    """Rooms asked of either would fail only at their deadlines: no write could land."""
    import threading

    from transfer.engine import Engine
    from transfer.errors import EngineError

    threads = threading.active_count()
    with Engine(HOST, "tcp") as engine:
        pool = ReceivePool(engine, 4096, 4096)
        pool.close()
        assert pool.closed
        with pytest.raises(ConfigError, match=r"^the receive pool at 0x[0-9a-f]+ is closed: its slots are gone; give "
                                              r"the session manager an open ReceivePool"):
            SessionManager(engine, 0, 1, 1, pool=pool, host=HOST)
        with ReceivePool(engine, 4096, 4096) as open_pool:
            engine.close()
            with pytest.raises(EngineError, match=rf"^engine {engine.session_id} is closed: give the session manager "
                                                  rf"an open engine$"):
                SessionManager(engine, 0, 1, 1, pool=open_pool, host=HOST)
    assert threading.active_count() == threads


def test_sizes_given_with_a_tensor_must_agree_with_it(manager, engines):
    manager, bootstrap, buf = manager
    encode_engine, _ = engines
    item = torch.zeros(4, 64, dtype=torch.bfloat16)
    encode_engine.register(item)
    try:
        with SenderPool(encode_engine, 0, 1, 1, bootstrap, host=HOST) as pool:
            for sizes, message in ((dict(span=8), "span 8 disagrees with the source tensor's 4"),
                                   (dict(hidden=32), "hidden 32 disagrees with the source tensor's 64"),
                                   (dict(dtype="float16"), "dtype torch.float16 disagrees with the source tensor's "
                                                           "torch.bfloat16")):
                with pytest.raises(ConfigError, match=rf"^{message}$"):
                    pool.send(1, item, **sizes)
            with pytest.raises(ConfigError, match="has no columns"):
                pool.send(1, torch.zeros(4, 0, dtype=torch.bfloat16))
    finally:
        encode_engine.unregister(item.data_ptr())
    with pytest.raises(ConfigError, match=r"^room 2: deepstack_hidden given with dst but no deepstack_dst"):
        manager.receive(2, bootstrap, buf, deepstack_hidden=128)


def test_a_deepstack_that_disagrees_with_its_item_is_refused_naming_deepstack_and_what_to_give(engines):
    encode_engine, _ = engines
    item = torch.zeros(4, 64, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server, SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as pool:
        for deepstack, sizes, message in (
                (torch.zeros(5, 128, dtype=torch.bfloat16), {},
                 r"room 1: deepstack rows 5 x torch.bfloat16 != item rows 4 x torch.bfloat16: give deepstack one row "
                 r"per item row, in the item's dtype"),
                (torch.zeros(4, 128, dtype=torch.float32), {},
                 r"room 1: deepstack rows 4 x torch.float32 != item rows 4 x torch.bfloat16: .*"),
                (torch.zeros(4, 128, dtype=torch.bfloat16), dict(deepstack_hidden=64),
                 r"deepstack_hidden 64 disagrees with the deepstack tensor's 128"),
                (torch.zeros(128, 4, dtype=torch.bfloat16).t(), {},
                 r"deepstack of shape \(4, 128\) and strides \(1, 4\) is not contiguous: .*; pass "
                 r"deepstack\.contiguous\(\)"),
                (item.data_ptr(), {}, r"a raw deepstack pointer needs deepstack_hidden")):
            with pytest.raises(ConfigError, match=rf"^{message}$"):
                pool.send(1, item, deepstack, **sizes)
        with pytest.raises(ConfigError, match=r"^source of shape \(64, 4\) .* not contiguous: .*; pass "
                                              r"src\.contiguous"):
            pool.send(1, item.t())
        assert pool._book.held == {} and len(encode_engine.registered()) == 0


def test_a_pooled_receive_refuses_what_only_a_receive_into_dst_takes_and_leases_nothing(engines):
    """A pooled receive (no dst) leases its deepstack rows with the item's: a deepstack_dst given
    there is refused, not dropped (the ask would have gone out without deepstack)."""
    _, prefill_engine = engines
    deepstack = torch.zeros(4, 32, dtype=torch.bfloat16)
    with BootstrapServer(HOST, 0) as server, ReceivePool(prefill_engine, 8 * 4096, 4096) as slots, \
            SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=30) as manager:
        with pytest.raises(ConfigError, match=r"^room 3: deepstack_dst given with no dst: a pooled receive leases "
                                              r"its deepstack rows with the item's \(give deepstack_hidden\)"):
            manager.receive(3, server.address, rows=4, hidden=64, dtype="bfloat16", deepstack_dst=deepstack)
        with pytest.raises(ConfigError, match=r"^room 4: a pooled receive needs rows, hidden and dtype$"):
            manager.receive(4, server.address, rows=4, hidden=64)
        assert slots.stats()["free"] == 8 and slots.stats()["leased"] == 0


def test_a_destination_in_the_pools_memory_is_refused_and_the_pooled_rooms_keep_their_slots(engines):
    """The pool leases its slots and fallback buffers to one room at a time: a dst given there (a
    pooled handle's rows, say, or a slot's raw address) would have a second room's write land in a
    slot another room holds, or one the pool quarantined or leases next."""
    _, prefill_engine = engines
    with BootstrapServer(HOST, 0) as server, ReceivePool(prefill_engine, 4 * 1024, 1024) as slots, \
            SessionManager(prefill_engine, 0, 1, 1, pool=slots, host=HOST, deadline_s=30) as manager:
        held = manager.receive(1, server.address, rows=4, hidden=128, dtype="bfloat16")
        big = manager.receive(2, server.address, rows=8, hidden=128, dtype="bfloat16")  # a fallback buffer
        free_slot = slots.region.addr + 3 * 1024
        for room, dst, geometry in ((3, held.rows, {}), (4, held.rows[1:3], {}), (5, big.rows, {}),
                                    (6, free_slot, dict(rows=4, hidden=128, dtype="bfloat16"))):
            with pytest.raises(ConfigError, match=rf"^room {room}: destination \[0x[0-9a-f]+, \+\d+\) lies in the "
                                                  r"receive pool's memory .* give rows, hidden and dtype without dst"):
                manager.receive(room, server.address, dst, **geometry)
        assert total(manager.metrics.snapshot(), manager.metrics.full_name("rooms_started_total")) == 2
        assert slots.stats()["leased"] == 1 and slots.stats()["fallbacks_live"] == 1
        held.clear()
        big.clear()


def test_a_raw_destination_computed_with_numpy_is_received_like_one_given_as_ints(manager, engines):
    """A receive buffer's address and sizes computed with numpy are numpy integer scalars, as the sender's
    may be: the room lands in exactly those rows."""
    import numpy as np

    manager, bootstrap, buf = manager
    encode_engine, _ = engines
    item = torch.arange(2 * 64, dtype=torch.int16).view(torch.bfloat16).view(2, 64)
    encode_engine.register(item)
    try:
        with SenderPool(encode_engine, 0, 1, 1, bootstrap, host=HOST) as pool:
            buf.zero_()
            row = buf.element_size() * buf.shape[1]
            offsets = np.arange(2) * (2 * row)
            received = manager.receive(np.int64(7), bootstrap, buf.data_ptr() + offsets[1], rows=np.int64(2),
                                       hidden=np.int32(64), dtype=BF16, span=np.int64(2))
            sent = pool.send(7, item)
            assert received.wait(10) == TransferPoll.Success, received.failure
            assert torch.equal(buf[2:4], item) and not buf[:2].any()
            assert sent.wait(10) == TransferPoll.Success
            sent.clear()
            received.clear()
    finally:
        encode_engine.unregister(item.data_ptr())


@pytest.mark.driver_dies
def test_a_receive_after_the_managers_io_thread_stopped_says_to_start_a_new_manager_which_then_receives(engines):
    """The manager's I/O thread stopped after an error: receive() says so, where the traceback went,
    and what to do; doing that (close it, make a new one on the same engine) receives again."""
    encode_engine, prefill_engine = engines
    buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    item = torch.randn(4, 64).to(torch.bfloat16)
    encode_engine.register(item)
    try:
        with BootstrapServer(HOST, 0) as server, SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST) as pool:
            manager = SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=30)
            first = manager.receive(1, server.address, buf[0])

            def broken(now, limit=None, unread=False):
                raise RuntimeError("injected")

            manager._driver.core.tick = broken  # the I/O thread calls it on every turn
            manager._driver._waker.wake()
            assert first.wait(5) == TransferPoll.Failed
            with pytest.raises(TransferError, match=r"^session manager's I/O thread stopped after an error "
                                                    r"\(RuntimeError: injected; its traceback is logged\): "
                                                    r"close\(\) the manager and start a new one$"):
                manager.receive(2, server.address, buf[1])
            first.clear()
            manager.close()
            with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=30) as again:
                handle = again.receive(2, server.address, buf[1])
                sent = pool.send(2, item)
                assert handle.wait(10) == TransferPoll.Success, handle.failure
                assert torch.equal(buf[1], item)
                handle.clear()
                assert sent.wait(10) == TransferPoll.Success
                sent.clear()
    finally:
        encode_engine.unregister(item.data_ptr())

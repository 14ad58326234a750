"""transfer.buffers: slot leasing, event-gated release, quarantine and fallback graces.

The pool's logic runs against a recording engine, a fake clock and fake events."""

from __future__ import annotations

import re

import numpy
import pytest
import torch
from fakes import FakeClock, FakeEvent, RecordingEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transfer.buffers import SLOT_ALIGN, FallbackLimitError, ReceivePool, Slot, SlotError
from transfer.errors import ConfigError


SLOT = 256
QUARANTINE = 30.0
GRACE = 10.0


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def engine():
    return RecordingEngine()


def make_pool(engine, clock, slots=4, **kwargs) -> ReceivePool:
    """A pool of `slots` slots of SLOT bytes with the test's timings."""
    kwargs.setdefault("quarantine_s", QUARANTINE)
    kwargs.setdefault("grace_s", GRACE)
    return ReceivePool(engine, slots * SLOT + 17, SLOT, clock=clock, **kwargs)


def counts(pool) -> tuple[int, int, int, int]:
    """(free, leased, pending_events, quarantined)."""
    s = pool.stats()
    return s["free"], s["leased"], s["pending_events"], s["quarantined"]


def test_pool_registers_one_region_and_cuts_slots(engine, clock):
    with make_pool(engine, clock, slots=4) as pool:
        assert pool.slots == 4 and pool.slot_bytes == SLOT
        assert engine.log == [("register", pool.region.addr, 4 * SLOT + 17)]
        assert pool.region.nbytes == 4 * SLOT + 17 and pool.region.device == "cpu"
        assert pool.region.tensor.data_ptr() == pool.region.addr
        leased = [pool.lease(SLOT) for _ in range(4)]
        assert sorted(s.addr for s in leased) == [pool.region.addr + i * SLOT for i in range(4)]
        assert all(s.region is pool.region and not s.is_fallback and s.nbytes == SLOT for s in leased)
        assert pool.lease(1) is None  # exhausted
        assert counts(pool) == (0, 4, 0, 0)
        assert len(engine.log) == 1  # leasing never registers
    assert engine.log[-1] == ("unregister", pool.region.addr, 4 * SLOT + 17)
    assert engine.regions == {}


def test_the_pool_and_its_fallbacks_name_the_device_its_memory_is_on(engine, clock):
    """A device named without its index ("cuda") is taken as the one the pool's memory went to, so its
    fallbacks go there too, whichever device the thread that leases them has current."""
    with make_pool(engine, clock, device="cpu:0") as pool:
        assert pool.device == str(pool.region.tensor.device) == pool.region.device == "cpu"
        big = pool.lease_or_fallback(SLOT * 3)
        assert big.is_fallback and big.region.device == "cpu"
        assert big.region.tensor.device == pool.region.tensor.device


def test_lease_refuses_too_big_and_negative(engine, clock):
    with make_pool(engine, clock) as pool:
        assert pool.lease(SLOT + 1) is None
        assert pool.lease(0) is not None
        with pytest.raises(ValueError, match="negative size"):
            pool.lease(-1)
        assert pool.stats()["free"] == 3


def test_bad_geometry_is_refused(engine, clock):
    with pytest.raises(ValueError, match=f"multiple of {SLOT_ALIGN}"):
        ReceivePool(engine, 1024, 100, clock=clock)
    with pytest.raises(ValueError, match="cannot hold one slot"):
        ReceivePool(engine, 100, 128, clock=clock)
    assert engine.regions == {}


def test_view_writes_the_slot_bytes(engine, clock):
    with make_pool(engine, clock) as pool:
        first, second = pool.lease(SLOT), pool.lease(SLOT)
        rows = torch.arange(24, dtype=torch.float32).view(4, 6)
        view = second.view((4, 6), torch.float32)
        view.copy_(rows)
        assert view.data_ptr() == second.addr
        offset = second.addr - pool.region.addr
        assert torch.equal(pool.region.tensor[offset : offset + rows.nbytes], rows.view(-1).view(torch.uint8))
        half = second.view(torch.Size([8, 16]), torch.bfloat16)
        assert half.shape == (8, 16) and half.data_ptr() == second.addr
        with pytest.raises(ValueError, match=r"slot \d+ at 0x[0-9a-f]+: shape \(9, 8\) of torch.float32 needs 288 bytes"):
            first.view((9, 8), torch.float32)
        with pytest.raises(TypeError, match=r"slot \d+ at 0x[0-9a-f]+: dtype must be a torch.dtype, got str 'float32'"):
            first.view((4,), "float32")
        second.release()
        with pytest.raises(SlotError, match="view\\(\\) after it was released"):
            second.view((1,), torch.uint8)


def test_release_frees_at_once_and_reuses_oldest_first(engine, clock):
    with make_pool(engine, clock, slots=2) as pool:
        a, b = pool.lease(8), pool.lease(8)
        a.release()
        assert counts(pool) == (1, 1, 0, 0)
        again = pool.lease(8)
        assert again.addr == a.addr and again is not a
        b.release()
        again.release()
        assert counts(pool) == (2, 0, 0, 0)


def test_release_with_event_waits_for_the_event_without_blocking(engine, clock):
    with make_pool(engine, clock, slots=1) as pool:
        slot = pool.lease(8)
        event = FakeEvent()
        slot.release(event)
        assert counts(pool) == (0, 0, 1, 0)
        for _ in range(3):
            assert pool.lease(8) is None  # each call queries, never waits
        assert event.queries >= 3
        event.done = True
        again = pool.lease(8)
        assert again is not None and again.addr == slot.addr
        assert counts(pool) == (0, 1, 0, 0)


def test_release_with_completed_event_frees_at_once(engine, clock):
    with make_pool(engine, clock, slots=1) as pool:
        event = FakeEvent()
        event.done = True
        pool.lease(8).release(event)
        assert counts(pool) == (1, 0, 0, 0)


def test_event_whose_query_raises_quarantines_its_slot(engine, clock):
    class BrokenEvent:
        def query(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with make_pool(engine, clock, slots=1) as pool:
        pool.lease(8).release(BrokenEvent())
        assert counts(pool) == (0, 0, 0, 1)
        clock.advance(QUARANTINE)
        assert pool.lease(8) is not None


def test_failed_slot_stays_quarantined_until_the_timeout(engine, clock):
    with make_pool(engine, clock, slots=2) as pool:
        doomed, other = pool.lease(8), pool.lease(8)
        doomed.fail()
        other.release()
        assert counts(pool) == (1, 0, 0, 1)
        failed_at = clock.now
        # Before the quarantine ends only the other slot is ever handed out.
        for now in (0.0, 1.0, QUARANTINE / 2, QUARANTINE - 1.0, QUARANTINE - 0.001):
            clock.now = failed_at + now
            slot = pool.lease(8)
            assert slot is not None and slot.addr == other.addr
            assert pool.lease(8) is None
            slot.release()
        clock.now = failed_at + QUARANTINE
        got = {pool.lease(8).addr, pool.lease(8).addr}
        assert got == {doomed.addr, other.addr}


def test_zero_quarantine_frees_on_next_poll(engine, clock):
    with make_pool(engine, clock, slots=1, quarantine_s=0.0) as pool:
        pool.lease(8).fail()
        assert pool.lease(8) is not None


@pytest.mark.parametrize("first,second,word", [
    ("release", "release", "released"), ("release", "fail", "released"),
    ("fail", "release", "failed"), ("fail", "fail", "failed"),
])
def test_second_release_or_fail_is_a_clear_error(engine, clock, first, second, word):
    with make_pool(engine, clock, slots=1) as pool:
        slot = pool.lease(8)
        getattr(slot, first)()
        with pytest.raises(SlotError, match=rf"slot 0 at 0x[0-9a-f]+: {second}\(\) after it was already {word}"):
            getattr(slot, second)()
        clock.advance(QUARANTINE)
        assert counts(pool) == (1, 0, 0, 0)  # the error changed nothing


def test_stale_handle_cannot_release_the_next_lease(engine, clock):
    with make_pool(engine, clock, slots=1) as pool:
        old = pool.lease(8)
        old.release()
        new = pool.lease(8)
        assert new.addr == old.addr
        with pytest.raises(SlotError):
            old.release()
        assert new.leased and counts(pool) == (0, 1, 0, 0)


@pytest.mark.parametrize("due", ["copy-out", "quarantine", "grace"])
def test_a_lease_does_the_polls_work_before_it_takes_a_slot(engine, clock, due):
    """lease() frees what poll() would first, each alone due: a slot whose copy-out completed or quarantine
    ended is leased again, a fallback past its grace is unregistered, with no poll() called in between."""
    with make_pool(engine, clock, slots=1) as pool:
        slot = pool.lease(SLOT)
        if due == "copy-out":
            event = FakeEvent()
            slot.release(event)
            event.done = True
        elif due == "quarantine":
            slot.fail()
            clock.advance(QUARANTINE)
        else:
            slot.release()
            big = pool.lease_or_fallback(SLOT * 3)
            big.release()
            clock.advance(GRACE)
        again = pool.lease(SLOT)
        assert again is not None and again.index == 0
        if due == "grace":
            assert big.addr not in engine.regions and pool.stats(poll=False)["fallbacks_live"] == 0


def test_too_big_item_gets_a_registered_fallback_dropped_after_grace(engine, clock):
    with make_pool(engine, clock, slots=2) as pool:
        big = pool.lease_or_fallback(SLOT * 3 + 5)
        assert big.is_fallback and big.nbytes == SLOT * 3 + 5
        assert big.region is not pool.region and big.addr == big.region.addr
        assert engine.regions[big.addr] == SLOT * 3 + 5
        assert pool.stats()["free"] == 2  # no slot taken
        rows = big.view((SLOT * 3 + 5,), torch.uint8)
        rows.fill_(7)
        big.release()
        clock.advance(GRACE - 0.01)
        pool.poll()
        assert big.addr in engine.regions and pool.stats()["fallbacks_live"] == 1
        clock.advance(0.01)
        pool.poll()
        assert big.addr not in engine.regions
        assert pool.stats()["fallbacks_live"] == 0 and pool.stats()["fallbacks_total"] == 1
        assert list(engine.regions) == [pool.region.addr]


def test_exhausted_pool_falls_back_and_failed_fallback_waits_for_the_longer_delay(engine, clock):
    with make_pool(engine, clock, slots=1) as pool:
        slot = pool.lease_or_fallback(8)
        assert not slot.is_fallback
        spare = pool.lease_or_fallback(8)
        assert spare.is_fallback and engine.regions[spare.addr] == 8
        spare.fail()
        clock.advance(max(GRACE, QUARANTINE) - 0.01)
        pool.poll()
        assert spare.addr in engine.regions
        clock.advance(0.01)
        pool.poll()
        assert spare.addr not in engine.regions
        with pytest.raises(SlotError, match="fallback buffer at 0x[0-9a-f]+ \\(8 bytes\\): release"):
            spare.release()


def test_fallback_with_event_starts_its_grace_when_the_event_completes(engine, clock):
    with make_pool(engine, clock, slots=1) as pool:
        big = pool.lease_or_fallback(SLOT * 2)
        event = FakeEvent()
        big.release(event)
        clock.advance(GRACE * 5)
        pool.poll()
        assert big.addr in engine.regions  # copy-out still running
        event.done = True
        pool.poll()
        clock.advance(GRACE - 0.01)
        pool.poll()
        assert big.addr in engine.regions
        clock.advance(0.01)
        pool.poll()
        assert big.addr not in engine.regions


def test_zero_byte_fallback_registers_a_nonempty_buffer(engine, clock):
    with make_pool(engine, clock, slots=1) as pool:
        pool.lease(0)
        empty = pool.lease_or_fallback(0)
        assert empty.is_fallback and empty.nbytes == 0 and engine.regions[empty.addr] == 1


def test_close_unregisters_pool_and_live_fallbacks_and_refuses_leases(engine, clock):
    pool = make_pool(engine, clock, slots=1)
    pool.lease(8)
    live_fallback = pool.lease_or_fallback(8)
    graced = pool.lease_or_fallback(SLOT * 2)
    graced.release()
    assert len(engine.regions) == 3
    pool.close()
    assert engine.regions == {}
    pool.close()  # idempotent
    with pytest.raises(SlotError, match="is closed"):
        pool.lease(8)
    live_fallback.release()  # a late release after close is harmless
    assert engine.regions == {}


OPS = st.lists(st.tuples(st.sampled_from(["lease", "fallback", "release", "release_event",
                                          "fail", "finish_event", "tick", "poll"]),
                         st.integers(0, 1000)), max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, slots=st.integers(1, 5))
def test_random_sequences_never_leak_or_double_lease(ops, slots):
    engine, clock = RecordingEngine(), FakeClock()
    pool = make_pool(engine, clock, slots=slots)
    held: list[Slot] = []
    events: list[FakeEvent] = []
    fail_times: dict[int, float] = {}  # slot addr -> when its room failed
    for op, arg in ops:
        if op in ("lease", "fallback"):
            size = arg % (SLOT * 2)
            slot = pool.lease(size) if op == "lease" else pool.lease_or_fallback(size)
            if slot is not None:
                if not slot.is_fallback:
                    failed_at = fail_times.pop(slot.addr, None)
                    assert failed_at is None or clock.now >= failed_at + QUARANTINE, "reused in quarantine"
                held.append(slot)
        elif op in ("release", "release_event", "fail") and held:
            slot = held.pop(arg % len(held))
            if op == "fail":
                slot.fail()
                if not slot.is_fallback:
                    fail_times[slot.addr] = clock.now
            elif op == "release":
                slot.release()
            else:
                events.append(FakeEvent())
                slot.release(events[-1])
        elif op == "finish_event" and events:
            events.pop(arg % len(events)).done = True
        elif op == "tick":
            clock.advance(arg / 50.0)
        elif op == "poll":
            pool.poll()
        # Invariants after every step: every slot in exactly one state, no address leased twice.
        free, leased, pending, quarantined = counts(pool)
        assert free + leased + pending + quarantined == slots
        assert leased == sum(1 for s in held if not s.is_fallback)
        addrs = [s.addr for s in held if not s.is_fallback]
        assert len(addrs) == len(set(addrs))
        assert pool.stats()["fallbacks_live"] == len(engine.regions) - 1
    # Drain: give everything back, finish every copy, let every timer pass.
    for slot in held:
        slot.release()
    for event in events:
        event.done = True
    pool.poll()  # completed events start their fallbacks' grace now
    clock.advance(max(QUARANTINE, GRACE))
    pool.poll()
    assert counts(pool) == (slots, 0, 0, 0)
    assert pool.stats()["fallbacks_live"] == 0 and list(engine.regions) == [pool.region.addr]
    pool.close()
    assert engine.regions == {}


class _DoneOnQuery:
    """A copy-out event that completes at its `n`-th query (the GPU finished meanwhile)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def query(self) -> bool:
        self.left -= 1
        return self.left <= 0


def test_a_slot_freed_by_the_poll_after_the_cap_refused_a_fallback_is_leased_not_refused(engine, clock):  # noqa: F811
    """One slot, no fallbacks allowed. The slot's copy-out event is still pending when
    lease_or_fallback() leases (query 2). It completes by the poll that follows the refused
    reservation (query 3). That poll frees the slot, and the item gets it. Neither a
    FallbackLimitError claiming "all 1 slots are taken" nor a fallback buffer."""
    pool = make_pool(engine, clock, slots=1, max_fallback_bytes=0)
    held = pool.lease(SLOT)
    held.release(_DoneOnQuery(3))  # query 1: not yet, so the slot waits for its event
    registered = len(engine.log)
    try:
        slot = pool.lease_or_fallback(SLOT)
    except FallbackLimitError as exc:
        pytest.fail(f"refused although its poll freed the slot: {exc}")
    assert not slot.is_fallback and slot.index == held.index
    assert len(engine.log) == registered  # nothing registered
    stats = pool.stats()
    assert (stats["free"], stats["leased"], stats["fallback_bytes"]) == (0, 1, 0)
    slot.release()
    assert pool.stats()["free"] == 1
    pool.close()


def test_a_metrics_scrape_of_the_pool_does_none_of_polls_work(engine, clock):
    """The gauges read the pool as it stands: a fallback past its grace stays registered, and an event is not
    queried, until the owner polls."""
    from transfer.metrics import Metrics, total
    from transfer.receiver import pool_gauges

    metrics = Metrics("epd_test")
    with make_pool(engine, clock, slots=2) as pool:
        pool_gauges(metrics, pool)
        big = pool.lease_or_fallback(SLOT * 3)
        big.release()
        slot = pool.lease(SLOT)
        event = FakeEvent()
        slot.release(event)
        clock.advance(GRACE)
        event.done = True
        queried = event.queries
        assert total(metrics.snapshot(), "epd_test_fallback_bytes") == SLOT * 3
        assert big.addr in engine.regions and event.queries == queried, "the scrape did the owner's work"
        pool.poll()
        assert big.addr not in engine.regions
        assert total(metrics.snapshot(), "epd_test_fallback_bytes") == 0


def _layout(t: torch.Tensor) -> tuple:
    """Where a tensor's elements are and how they are laid out and typed."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 4), st.lists(st.integers(0, 6), max_size=3), st.sampled_from(
    [torch.uint8, torch.bfloat16, torch.float32, torch.float64, torch.int16]))
def test_a_view_cuts_the_bytes_its_region_holds_at_its_offset(engine, clock, leases, shape, dtype):
    """Slots' views cut the pool's byte view of its region, made once; a fallback's its own buffer's: each as
    the slot's region's tensor, flattened to bytes, cut at the slot's offset, then typed and shaped, reads."""
    with make_pool(engine, clock, slots=4) as pool:
        slots = [pool.lease_or_fallback(SLOT) for _ in range(leases)] + [pool.lease_or_fallback(SLOT * 2)]
        for slot in slots:
            need = dtype.itemsize
            for n in shape:
                need *= n
            if need > slot.nbytes:
                continue
            offset = slot.addr - slot.region.addr
            by_region = slot.region.tensor.reshape(-1).view(torch.uint8)[offset: offset + need].view(dtype)
            for given in (tuple(shape), torch.Size(shape), [numpy.int64(n) for n in shape]):
                view = slot.view(given, dtype)
                assert _layout(view) == _layout(by_region.view(tuple(shape)))


_DTYPES = st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.float64, torch.int16])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9), st.sampled_from([0, 1, 2, 3, 4, 8, 16, 64, 300]),
                          _DTYPES), min_size=1, max_size=12))
def test_a_slots_rows_are_the_bytes_cut_typed_and_shaped_whatever_geometry_came_before(engine, clock, views):
    """A 2-D view of a slot, sliced from the pool's rows of its geometry (kept for the last geometry asked), is
    the slot's bytes cut at its offset, typed and shaped: the same elements of the region, laid out and typed
    alike, one geometry after another."""
    with make_pool(engine, clock, slots=4) as pool:
        slots = [pool.lease(SLOT) for _ in range(4)]
        for index, rows, width, dtype in views:
            slot = slots[index]
            need = rows * width * dtype.itemsize
            if need > slot.nbytes:
                continue
            offset = slot.addr - slot.region.addr
            by_bytes = pool._bytes[offset: offset + need].view(dtype).view((rows, width))
            view = slot.view((rows, width), dtype)
            assert _layout(view) == _layout(by_bytes)
            if need:
                view.view(torch.uint8).view(-1)[-1] = index + 1  # the slot's last byte asked for: the region's
                assert pool.region.tensor[offset + need - 1] == index + 1


@pytest.mark.parametrize("shape", [(2, -1), torch.Size([2, -1]), [numpy.int64(2), numpy.int32(-1)], (2.0, -1.0),
                                   (True, -1)])
def test_a_view_names_a_negative_shape_as_ints_whatever_its_numbers_types(engine, clock, shape):
    with make_pool(engine, clock, slots=1) as pool:
        slot = pool.lease(SLOT)
        with pytest.raises(ConfigError, match=rf"^slot 0 at {slot.addr:#x}: negative dimension in shape "
                                              rf"\({int(shape[0])}, -1\)$"):
            slot.view(shape, torch.uint8)


def _rows_layout(t: torch.Tensor, base: int) -> tuple:
    """_layout() with the addresses taken from `base`: two pools' tensors compared by place in their regions (an empty
    tensor's data_ptr() is torch's, for any empty tensor)."""
    return (t.untyped_storage().data_ptr() - base, t.storage_offset(), t.data_ptr() - base if t.numel() else t.data_ptr(),
            tuple(t.shape), t.stride(), t.dtype)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 9), st.sampled_from([0, 1, 2, 3, 4, 8, 16, 64]), _DTYPES, st.booleans()),
                min_size=1, max_size=12))
def test_lease_rows_leases_what_lease_or_fallback_leases_and_cuts_its_view(engine, clock, leases):
    """lease_rows(nbytes, rows, width, dtype) leases the slot (or fallback) lease_or_fallback(nbytes) leases, and
    the rows it cuts where the pool keeps that geometry's rows are the slot's view((rows, width), dtype): the same
    elements of the region, laid out and typed alike, one geometry after another (None where it cuts none, and a
    receive() views them)."""
    with make_pool(engine, clock, slots=3) as fast, make_pool(RecordingEngine(), FakeClock(), slots=3) as slow:
        for rows, width, dtype, keep in leases:
            nbytes = rows * width * dtype.itemsize
            try:
                leased, cut = fast.lease_rows(nbytes, rows, width, dtype)
            except FallbackLimitError as exc:
                with pytest.raises(FallbackLimitError, match=re.escape(str(exc))):
                    slow.lease_or_fallback(nbytes)
                continue
            slot = slow.lease_or_fallback(nbytes)
            assert ((leased.addr - leased.region.addr, leased.index, leased.is_fallback, leased.nbytes)
                    == (slot.addr - slot.region.addr, slot.index, slot.is_fallback, slot.nbytes))
            assert cut is None or not leased.is_fallback, "a fallback's rows are viewed"
            rows_of = cut if cut is not None else leased.view((rows, width), dtype)
            assert (_rows_layout(rows_of, leased.region.addr)
                    == _rows_layout(slot.view((rows, width), dtype), slot.region.addr))
            if not keep:
                leased.release()
                slot.release()

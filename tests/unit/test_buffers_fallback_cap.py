"""transfer.buffers.ReceivePool's cap on fallback bytes (max_fallback_bytes), on the recording engine and fake clock."""

from __future__ import annotations

import random
import re

import pytest
from fakes import FakeClock, FakeEvent, InterleavingEngine, RecordingEngine

from transfer.buffers import FALLBACK_FLOOR_BYTES, FallbackLimitError, ReceivePool, SlotError


SLOT = 256


def _fallback_bytes(engine: RecordingEngine, pool: ReceivePool) -> int:
    """Bytes the recording engine holds registered besides the pool's own region."""
    return sum(n for addr, n in engine.regions.items() if addr != pool.region.addr)


def test_the_default_cap_is_the_pools_size_but_at_least_the_floor():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, 4 * SLOT, SLOT, clock=clock) as small:
        assert small.max_fallback_bytes == FALLBACK_FLOOR_BYTES
        stats = small.stats()
        assert (stats["fallback_bytes"], stats["max_fallback_bytes"]) == (0, FALLBACK_FLOOR_BYTES)
    big_bytes = FALLBACK_FLOOR_BYTES + 4 * SLOT  # torch.empty does not touch the pages
    with ReceivePool(engine, big_bytes, SLOT, clock=clock) as big:
        assert big.max_fallback_bytes == big_bytes


def test_a_negative_cap_is_refused_and_none_is_unbounded():
    engine, clock = RecordingEngine(), FakeClock()
    with pytest.raises(ValueError, match="max_fallback_bytes must be >= 0 or None, got -1"):
        ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=-1, clock=clock)
    assert list(engine.regions) == []
    with ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=None, clock=clock) as pool:
        held = [pool.lease_or_fallback(4 * SLOT) for _ in range(64)]
        stats = pool.stats()
        assert (stats["fallback_bytes"], stats["max_fallback_bytes"]) == (64 * 4 * SLOT, None)
        assert _fallback_bytes(engine, pool) == 64 * 4 * SLOT
        for slot in held:
            slot.release()


def test_fallbacks_fill_the_cap_exactly_and_the_next_one_is_refused():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=2 * SLOT + 1, clock=clock) as pool:
        empty = pool.lease_or_fallback(0)  # the pool's one slot
        assert not empty.is_fallback
        first, second = pool.lease_or_fallback(SLOT + 1), pool.lease_or_fallback(SLOT - 1)
        zero = pool.lease_or_fallback(0)  # a zero-byte item's buffer still counts its 1 byte
        assert first.is_fallback and second.is_fallback and zero.is_fallback
        assert pool.stats()["fallback_bytes"] == 2 * SLOT + 1 == _fallback_bytes(engine, pool)
        before = dict(engine.regions)
        with pytest.raises(FallbackLimitError):
            pool.lease_or_fallback(0)
        assert engine.regions == before
        for slot in (first, second, empty, zero):
            slot.release()


def test_a_zero_cap_allows_no_fallback_but_slots_still_lease():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, 2 * SLOT, SLOT, max_fallback_bytes=0, clock=clock) as pool:
        with pytest.raises(FallbackLimitError, match="bigger than a slot"):
            pool.lease_or_fallback(SLOT + 16)
        one, two = pool.lease_or_fallback(8), pool.lease_or_fallback(SLOT)
        assert not one.is_fallback and not two.is_fallback
        with pytest.raises(FallbackLimitError, match="all 2 slots are taken"):
            pool.lease_or_fallback(8)
        assert list(engine.regions) == [pool.region.addr]


def _fill_every_state(pool: ReceivePool) -> tuple[FakeEvent, list]:
    """Holds the pool's one slot and four fallbacks: three of SLOT bytes (live, awaiting an event,
    quarantined) and one of 4 bytes in its grace, too small to be taken again for what the tests ask.
    Returns (the pending copy-out's event, the live handles)."""
    slot = pool.lease(8)
    live = pool.lease_or_fallback(SLOT)
    pending = pool.lease_or_fallback(SLOT)
    event = FakeEvent()
    pending.release(event)
    pool.lease_or_fallback(4).release()  # grace: 10 s
    pool.lease_or_fallback(SLOT).fail()  # quarantine: 30 s
    return event, [slot, live]


def test_the_error_names_the_ask_what_fallbacks_hold_the_cap_and_the_remedy():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, quarantine_s=30.0, grace_s=10.0,
                     max_fallback_bytes=3 * SLOT + 4, clock=clock) as pool:
        event, live = _fill_every_state(pool)
        before, total = dict(engine.regions), pool.stats()["fallbacks_total"]
        clock.advance(2.5)
        with pytest.raises(FallbackLimitError) as exhausted:
            pool.lease_or_fallback(8)
        expected = (
            f"receive pool at {pool.region.addr:#x}: a fallback buffer of 8 bytes would take fallbacks "
            f"past max_fallback_bytes=772: they hold 772 bytes in 4 buffers (1 live, 1 awaiting copy-out "
            f"events, 1 in grace, 1 quarantined after failed rooms; the next retires in 7.5s), and all 1 "
            f"slots are taken (1 leased, 0 quarantined, 0 awaiting copy-out events); size the pool larger "
            f"(more than 1 slots of 256 bytes), or raise max_fallback_bytes (None: unbounded)"
        )
        assert str(exhausted.value) == expected
        with pytest.raises(FallbackLimitError) as too_big:
            pool.lease_or_fallback(3 * SLOT)
        assert re.search(r"a fallback buffer of 768 bytes would take fallbacks past max_fallback_bytes=772: "
                         r"they hold 772 bytes .*, and the item is bigger than a slot \(256 bytes\); "
                         r"size the pool's slots to at least 768 bytes, or raise max_fallback_bytes",
                         str(too_big.value)), str(too_big.value)
        assert isinstance(too_big.value, RuntimeError)
        # Nothing allocated, registered or counted on the refused path.
        stats = pool.stats()
        assert engine.regions == before
        assert (stats["fallback_bytes"], stats["fallbacks_live"], stats["fallbacks_total"]) == (3 * SLOT + 4, 4, total)
        event.done = True
        for slot in live:
            slot.release()


def test_retiring_graces_and_quarantines_makes_room_again_without_an_explicit_poll():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, quarantine_s=30.0, grace_s=10.0,
                     max_fallback_bytes=4 * SLOT, clock=clock) as pool:
        event, live = _fill_every_state(pool)
        clock.advance(10.0)  # the grace ended: one SLOT is free to take
        again = pool.lease_or_fallback(SLOT)
        assert again.is_fallback and pool.stats()["fallback_bytes"] == 4 * SLOT
        with pytest.raises(FallbackLimitError, match=r"1 quarantined after failed rooms; the next retires in 20\.0s"):
            pool.lease_or_fallback(2 * SLOT)
        clock.advance(20.0)  # the quarantine ended
        event.done = True  # and the copy-out finished: its grace starts at the next poll
        registered = set(engine.regions)
        assert pool.lease_or_fallback(SLOT).is_fallback  # the copied-out buffer, idle in its grace, again
        assert set(engine.regions) < registered  # nothing new (the quarantined one retired meanwhile)
        assert pool.stats()["fallback_bytes"] == 3 * SLOT == _fallback_bytes(engine, pool)
        for slot in live:
            slot.release()


def test_a_failed_allocation_or_registration_gives_its_reservation_back():
    class RefusingEngine(RecordingEngine):
        refuse = False

        def register(self, buf, length=None):
            if self.refuse:
                raise RuntimeError("register failed: out of memory regions")
            return super().register(buf, length)

    engine, clock = RefusingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=1 << 63, clock=clock) as pool:
        with pytest.raises(RuntimeError) as unallocatable:
            pool.lease_or_fallback(1 << 62)  # within the cap, beyond any machine
        assert not isinstance(unallocatable.value, FallbackLimitError)
        engine.refuse = True
        with pytest.raises(RuntimeError, match="out of memory regions"):
            pool.lease_or_fallback(2 * SLOT)
        stats = pool.stats()
        assert (stats["fallback_bytes"], stats["fallbacks_live"], stats["fallbacks_total"]) == (0, 0, 0)
        assert list(engine.regions) == [pool.region.addr]


def test_close_drops_the_count_and_late_returns_do_not_drive_it_negative():
    engine, clock = RecordingEngine(), FakeClock()
    pool = ReceivePool(engine, SLOT, SLOT, quarantine_s=1.0, grace_s=1.0, max_fallback_bytes=4 * SLOT, clock=clock)
    held = [pool.lease_or_fallback(SLOT) for _ in range(3)]
    pool.close()
    held[0].release()
    held[1].fail()
    clock.advance(5.0)
    pool.poll()
    stats = pool.stats()
    assert (stats["fallback_bytes"], stats["fallbacks_live"]) == (0, 0)
    assert engine.regions == {}


def test_churn_keeps_the_fallback_byte_count_equal_to_what_is_registered():
    engine, clock = RecordingEngine(), FakeClock()
    cap = 6 * SLOT
    with ReceivePool(engine, 2 * SLOT, SLOT, quarantine_s=1.0, grace_s=0.3, max_fallback_bytes=cap,
                     clock=clock) as pool:
        rng = random.Random(11)
        held: list = []
        events: list[FakeEvent] = []
        refusals = 0
        for _ in range(4000):
            if held and rng.random() < 0.5:
                slot = held.pop(rng.randrange(len(held)))
                how = rng.choice(("release", "fail", "event"))
                if how == "event":
                    events.append(FakeEvent())
                    slot.release(events[-1])
                else:
                    getattr(slot, how)()
            else:
                try:
                    held.append(pool.lease_or_fallback(rng.choice((0, 8, SLOT, SLOT + 16, 3 * SLOT))))
                except FallbackLimitError:
                    refusals += 1
            if events and rng.random() < 0.2:
                events.pop(rng.randrange(len(events))).done = True
            clock.advance(rng.choice((0.0, 0.01, 0.1)))
            assert pool._fallback_bytes == _fallback_bytes(engine, pool) <= cap
        assert refusals > 0, "the churn never reached the cap: it tests nothing"
        for slot in held:
            slot.release()
        for event in events:
            event.done = True
        clock.advance(2.0)
        pool.poll()  # copy-outs that completed start their grace here
        clock.advance(2.0)
        stats = pool.stats()
        assert (stats["fallback_bytes"], stats["fallbacks_live"], stats["free"]) == (0, 0, 2)


def test_an_idle_fallback_in_its_grace_is_taken_again_instead_of_a_new_registration():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, quarantine_s=60.0, grace_s=30.0, max_fallback_bytes=3000,
                     clock=clock) as pool:
        first = pool.lease_or_fallback(1000)
        first_addr = first.addr
        first.release()
        for _ in range(5):  # one 1000-byte outlier every 5 s, each released at once
            clock.advance(5.0)
            again = pool.lease_or_fallback(1000)
            assert again.is_fallback and again.addr == first_addr and again.nbytes == 1000
            again.release()
        assert pool.stats()["fallbacks_total"] == 6 and _fallback_bytes(engine, pool) == 1000  # 6 uses, 1 buffer
        # The smallest idle one that holds the item; a quarantined one is never taken.
        hold_the_slot = pool.lease(8)
        big, small, failed = (pool.lease_or_fallback(n) for n in (900, 600, 500))
        assert big.addr == first_addr and len(engine.regions) == 1 + 3
        for slot in (big, small):
            slot.release()
        failed.fail()
        taken = pool.lease_or_fallback(450)
        assert taken.addr == small.addr and taken.nbytes == 450
        assert pool.lease_or_fallback(450).addr == first_addr
        assert pool.lease_or_fallback(450).addr not in (first_addr, small.addr, failed.addr)
        assert len(engine.regions) == 1 + 4 and _fallback_bytes(engine, pool) == 2550
        hold_the_slot.release()


def test_idle_fallbacks_too_small_to_serve_an_item_are_dropped_to_make_room_for_it():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, quarantine_s=60.0, grace_s=30.0, max_fallback_bytes=3000,
                     clock=clock) as pool:
        small, other, failed = (pool.lease_or_fallback(n) for n in (1000, 600, 400))
        small.release()
        other.release()
        failed.fail()  # quarantined: never dropped early
        big = pool.lease_or_fallback(2500)  # 2000 held; the largest idle one, then the next, make room
        assert big.is_fallback and sorted(engine.regions.values()) == sorted([SLOT, 400, 2500])
        assert pool.stats()["fallback_bytes"] == 2900 == _fallback_bytes(engine, pool)
        # Nothing is dropped when dropping every idle one would not make room.
        big.release()
        with pytest.raises(FallbackLimitError, match="1 in grace, 1 quarantined"):
            pool.lease_or_fallback(2700)
        assert sorted(engine.regions.values()) == sorted([SLOT, 400, 2500])


def test_the_room_idle_fallbacks_make_goes_to_the_item_they_were_dropped_for():
    engine, clock = RecordingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=1000, clock=clock) as pool:
        pool.lease(8)  # the only slot
        live = pool.lease_or_fallback(300)
        pool.lease_or_fallback(600).release()  # idle, too small for what comes next
        unregister, others = pool._unregister, []

        def another_receive_meanwhile(region):
            # Another thread's receive() while the dropped buffer is unregistered: the room is taken.
            with pytest.raises(FallbackLimitError):
                pool.lease_or_fallback(500)
            others.append(region.nbytes)
            unregister(region)

        pool._unregister = another_receive_meanwhile
        big = pool.lease_or_fallback(700)
        pool._unregister = unregister
        assert others == [600] and big.is_fallback
        assert sorted(engine.regions.values()) == [SLOT, 300, 700] and pool.stats()["fallback_bytes"] == 1000
        live.release()
        big.release()


def test_a_lease_during_a_fallbacks_registration_counts_its_reservation_against_the_cap():
    engine, clock = InterleavingEngine(), FakeClock()
    with ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=3 * SLOT, clock=clock) as pool:
        engine.pool = pool
        slot = pool.lease(8)
        meanwhile = []

        def lease_meanwhile() -> None:
            with pytest.raises(FallbackLimitError, match="they hold 512 bytes"):
                pool.lease_or_fallback(2 * SLOT)  # 2 SLOT reserved + 2 SLOT > 3 SLOT
            meanwhile.append(pool.lease_or_fallback(SLOT))  # fits beside the reservation

        engine.during_register = lease_meanwhile
        first = pool.lease_or_fallback(2 * SLOT)
        assert engine.lock_free == [True]
        assert first.is_fallback and [held.is_fallback for held in meanwhile] == [True]
        stats = pool.stats()
        assert (stats["fallback_bytes"], stats["fallbacks_live"], stats["fallbacks_total"]) == (3 * SLOT, 2, 2)
        assert _fallback_bytes(engine, pool) == 3 * SLOT
        for held in (slot, first, *meanwhile):
            held.release()


@pytest.mark.parametrize("registers", [True, False])
def test_a_close_during_a_fallbacks_registration_leaves_nothing_registered_or_counted(registers):
    class Engine(InterleavingEngine):
        def register(self, buf, length=None):
            addr_nbytes = super().register(buf, length)
            if not registers and buf.numel() == 2 * SLOT:
                self.regions.pop(buf.data_ptr())
                raise RuntimeError("register failed: engine closed")
            return addr_nbytes

    engine, clock = Engine(), FakeClock()
    pool = ReceivePool(engine, SLOT, SLOT, max_fallback_bytes=4 * SLOT, clock=clock)
    engine.pool = pool
    slot = pool.lease(8)
    engine.during_register = pool.close
    with pytest.raises(SlotError if registers else RuntimeError, match="is closed" if registers else "engine closed"):
        pool.lease_or_fallback(2 * SLOT)
    assert engine.lock_free == [True]
    assert engine.regions == {}
    stats = pool.stats()
    assert (stats["fallback_bytes"], stats["fallbacks_live"], stats["fallbacks_total"]) == (0, 0, 0)
    slot.release()
    with pytest.raises(SlotError, match="is closed"):
        pool.lease_or_fallback(2 * SLOT)
    assert engine.regions == {}

"""transfer.buffers: ReceivePool against a model, over random mixes of leases, returns, confirmations and close.

A Hypothesis state machine drives the pool as receiver.py does (lease or fall back; release, with a copy-out
event or not; fail; end_quarantine() from a cancel's confirmation, stale ones included; close(), and returns
after it) with a fake clock, and checks after every step what a prefill engine relies on:

- no slot (nor fallback buffer) is leased to two rooms at once;
- no memory is leased again while a late write of a failed room may land in it (its quarantine neither
  confirmed nor past its bound) or a copy-out may still read it;
- stats() count what the model holds (leased, awaiting events, quarantined, free; fallbacks live and bytes);
- fallback bytes never exceed max_fallback_bytes, and a refusal registers nothing;
- after close(), memory a failed room may still be written into stays held, and stats() still add up to the
  slots: the leases not given back yet, every other slot free, nothing pending, quarantined or registered;
- once every lease was given back, every copy done and every quarantine confirmed or past, every slot is free
  (or, closed, nothing is held).
"""

from __future__ import annotations

from dataclasses import dataclass

from fakes import FakeClock, RecordingEngine
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from transfer import buffers
from transfer.buffers import FallbackLimitError, ReceivePool, Slot, SlotError

SLOT = 256
QUARANTINE = 30.0
GRACE = 10.0
SIZES = st.sampled_from([0, 1, SLOT - 16, SLOT, SLOT + 16, 2 * SLOT, 3 * SLOT])


class ModelEvent:
    """A copy-out event the model completes or breaks; records when the pool first saw it broken."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.done = False
        self.broken = False
        self.seen_broken_at: float | None = None
        self.pool_closed = False  # a closed pool's memory waits on the event up to a bound of its own

    def query(self) -> bool:
        if self.broken:
            if self.seen_broken_at is None and not self.pool_closed:
                self.seen_broken_at = self.clock.now
            raise RuntimeError("sticky CUDA error")
        return self.done


@dataclass
class Returned:
    """A handle given back: how, and (for a quarantine) since when and whether its room was confirmed safe."""

    slot: Slot
    quarantine_s: float  # the pool's: how long a failed room's late write may still land
    returned_at: float
    event: ModelEvent | None = None
    failed_at: float | None = None
    confirmed: bool = False

    def quarantined_since(self) -> float | None:
        """When its quarantine began (fail, or the pool seeing its event broken), or None."""
        if self.failed_at is not None:
            return self.failed_at
        if self.event is not None and self.event.seen_broken_at is not None:
            return self.event.seen_broken_at
        return None

    def unsafe(self, now: float) -> bool:
        """Whether its memory may still be written (failed room) or read (copy-out) by this handle's room."""
        since = self.quarantined_since()
        if since is not None:
            return not self.confirmed and now < since + self.quarantine_s
        if self.event is not None:
            return not self.event.done or self.event.broken
        return False

    def awaiting_event(self) -> bool:
        return self.event is not None and not self.event.done and self.event.seen_broken_at is None


class PoolMachine(RuleBasedStateMachine):
    """The pool and a model of every lease it gave."""

    @initialize(slots=st.integers(1, 3), cap=st.sampled_from([0, SLOT, 3 * SLOT, 6 * SLOT, None]),
                quarantine_s=st.sampled_from([QUARANTINE, 0.0, GRACE / 2]),
                grace_s=st.sampled_from([GRACE, 0.0, QUARANTINE + GRACE]))
    def make(self, slots: int, cap: int | None, quarantine_s: float, grace_s: float) -> None:
        self.engine, self.clock = RecordingEngine(), FakeClock()
        self.pool = ReceivePool(self.engine, slots * SLOT, SLOT, clock=self.clock, quarantine_s=quarantine_s,
                                grace_s=grace_s, max_fallback_bytes=cap)
        self.quarantine_s = quarantine_s
        self.closed_at: float | None = None
        self.slots, self.cap = slots, cap
        self.live: list[Slot] = []
        self.returned: list[Returned] = []  # given back, and not leased again since
        self.stale: list[Slot] = []  # given back, their memory leased again since
        self.closed = False

    # -- leasing ------------------------------------------------------------------

    def _check_new_lease(self, slot: Slot) -> None:
        for other in self.live:
            assert not (slot.region is other.region and (slot.is_fallback or other.index == slot.index)), (
                f"{slot} leased while {other} still is")
        for past in self.returned:
            same = past.slot.region is slot.region and (slot.is_fallback or past.slot.index == slot.index)
            assert not (same and past.unsafe(self.clock.now)), (
                f"{slot} leased again at {self.clock.now} while its last room may still touch it: {past}")
        reused = [p for p in self.returned if p.slot.region is slot.region and
                  (slot.is_fallback or p.slot.index == slot.index)]
        self.stale.extend(p.slot for p in reused)
        self.returned = [p for p in self.returned if p not in reused]
        self.live.append(slot)

    @precondition(lambda self: not self.closed)
    @rule(size=SIZES)
    def lease(self, size: int) -> None:
        slot = self.pool.lease(size)
        if slot is not None:
            assert size <= SLOT and not slot.is_fallback
            self._check_new_lease(slot)

    @precondition(lambda self: not self.closed)
    @rule(size=SIZES)
    def lease_or_fallback(self, size: int) -> None:
        before = dict(self.engine.regions)
        try:
            slot = self.pool.lease_or_fallback(size)
        except FallbackLimitError:
            assert self.cap is not None
            assert set(self.engine.regions) <= set(before), "a refused fallback left a registration behind"
            return
        assert slot.nbytes >= size
        self._check_new_lease(slot)

    # -- returns -------------------------------------------------------------------

    @precondition(lambda self: self.live)
    @rule(data=st.data(), how=st.sampled_from(["release", "release_event", "fail"]))
    def give_back(self, data: st.DataObject, how: str) -> None:
        slot = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        if how == "fail":
            slot.fail()
            self.returned.append(Returned(slot, self.quarantine_s, self.clock.now, failed_at=self.clock.now))
        elif how == "release":
            slot.release()
            self.returned.append(Returned(slot, self.quarantine_s, self.clock.now))
        else:
            event = ModelEvent(self.clock)
            event.pool_closed = self.closed
            slot.release(event)
            self.returned.append(Returned(slot, self.quarantine_s, self.clock.now, event=event))

    @precondition(lambda self: any(r.event is not None and not r.event.done and not r.event.broken
                                   for r in self.returned))
    @rule(data=st.data(), broken=st.booleans())
    def copy_out_ends(self, data: st.DataObject, broken: bool) -> None:
        waiting = [r for r in self.returned if r.event is not None and not r.event.done and not r.event.broken]
        event = data.draw(st.sampled_from(waiting)).event
        if broken:
            event.broken = True
        else:
            event.done = True

    @precondition(lambda self: self.returned)
    @rule(data=st.data())
    def confirm_safe(self, data: st.DataObject) -> None:
        """A cancel's confirmation: end_quarantine() on a given-back handle (one released, or whose quarantine
        passed its bound, must change nothing)."""
        past = data.draw(st.sampled_from(self.returned))
        past.slot.end_quarantine()
        if past.quarantined_since() is not None:
            past.confirmed = True

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def confirm_safe_late(self, data: st.DataObject) -> None:
        """A confirmation heard after the handle's memory was leased again: it must leave the new lease alone."""
        data.draw(st.sampled_from(self.stale)).end_quarantine()

    @rule(tenths=st.integers(1, int((QUARANTINE + GRACE) * 10)))
    def advance(self, tenths: int) -> None:
        self.clock.advance(tenths / 10)

    @rule()
    def poll(self) -> None:
        self.pool.poll()

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        self.fallbacks_at_close = self.pool.stats(poll=False)["fallbacks_total"]
        self.pool.close()
        self.closed = True
        self.closed_at = self.clock.now
        for past in self.returned:
            if past.event is not None:
                past.event.pool_closed = True
        assert self.engine.regions == {}
        try:
            self.pool.lease(1)
        except SlotError:
            pass
        else:
            raise AssertionError("a closed pool leased")

    # -- invariants ---------------------------------------------------------------

    @invariant()
    def counts_match(self) -> None:
        if self.closed:
            self._closed_memory_is_held()
            self._closed_counts_match()
            return
        stats = self.pool.stats()
        now = self.clock.now
        slot_returns = [r for r in self.returned if not r.slot.is_fallback]
        leased = sum(1 for s in self.live if not s.is_fallback)
        pending = sum(1 for r in slot_returns if r.awaiting_event())
        quarantined = sum(1 for r in slot_returns if r.quarantined_since() is not None and r.unsafe(now))
        assert (stats["leased"], stats["pending_events"], stats["quarantined"]) == (leased, pending, quarantined)
        assert stats["free"] == self.slots - leased - pending - quarantined
        fallback_bytes = sum(n for addr, n in self.engine.regions.items() if addr != self.pool.region.addr)
        assert stats["fallback_bytes"] == fallback_bytes
        assert stats["fallbacks_live"] == len(self.engine.regions) - 1
        assert self.cap is None or fallback_bytes <= self.cap
        for past in self.returned:
            if past.slot.is_fallback and past.unsafe(now):
                assert past.slot.addr in self.engine.regions, (
                    f"{past}: a fallback a late write or copy-out may still touch was let go by the open pool")

    def _closed_counts_match(self) -> None:
        """A closed pool holds nothing back: its slots are the leases not given back yet, and free."""
        stats = self.pool.stats()
        leased = sum(1 for s in self.live if not s.is_fallback)
        assert (stats["free"], stats["leased"], stats["pending_events"], stats["quarantined"]) == (
            self.slots - leased, leased, 0, 0), stats
        assert (stats["fallbacks_live"], stats["fallback_bytes"]) == (0, 0), stats
        assert stats["fallbacks_total"] == self.fallbacks_at_close, stats

    def _closed_memory_is_held(self) -> None:
        """A closed pool's memory that a failed room may still write into, or a copy-out still read, is held."""
        held = [entry[2] for entry in buffers._held]
        now = self.clock.now
        for past in self.returned:
            if past.quarantined_since() is not None:
                must_hold = past.unsafe(now)
            else:  # a copy-out still reading: held until its event completed, or for a quarantine from close
                must_hold = (past.event is not None and not past.event.done and
                             now < max(past.returned_at, self.closed_at) + self.quarantine_s)
            if must_hold:
                assert any(region is past.slot.region for region in held), f"{past} let go while unsafe"

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for slot in self.live:
            slot.release()
        for past in self.returned:
            if past.event is not None and not past.event.broken:
                past.event.done = True
        self.pool.poll()
        self.clock.advance(QUARANTINE + GRACE)
        self.pool.poll()
        if not self.closed:
            stats = self.pool.stats()
            assert (stats["free"], stats["leased"], stats["pending_events"], stats["quarantined"]) == (
                self.slots, 0, 0, 0), f"slots lost: {stats}"
            assert stats["fallbacks_live"] == 0 and list(self.engine.regions) == [self.pool.region.addr]
            self.pool.close()
        else:
            stats = self.pool.stats()
            assert (stats["free"], stats["leased"], stats["pending_events"], stats["quarantined"]) == (
                self.slots, 0, 0, 0), f"a closed pool's slots do not add up once every lease was given back: {stats}"
        assert self.engine.regions == {}
        regions = {id(s.region) for s in (*self.live, *self.stale, *(r.slot for r in self.returned))}
        regions.add(id(self.pool.region))
        assert not [e for e in buffers._held if id(e[2]) in regions], "a closed pool's memory is held forever"


PoolMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_pool_against_its_model = PoolMachine.TestCase

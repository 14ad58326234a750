"""What the two cores keep over a long life: after thousands of rooms, restarted prefill ranks and faults that lose
no answer, every book of both cores is back at its floor once time has passed every bound.

The books are found by walking the cores' attributes (and those of the objects of transfer.core they hold), so a
book added later is held to the same floor without being named here. The floor: nothing per room, at most one
entry per live peer, and the bounded memories at their documented caps, set low here so that the run reaches
them: the sessions gone (retired regions, ask costs), and two that are let go of when next looked at rather than
swept: the asks given up with no cancel (the prefill core's, kept until a later give-up finds them stale), and the
writes that failed (the encode core's, kept until a later cancel finds them stale). Pure: the in-memory pair of
tests/core_pair.py and its fake clock.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping

import core_pair
import pytest
from core_pair import Pair

from transfer.core import encode, parked, prefill, regions

KEPT = 8  # each bounded memory's cap (set below)
# The bounded memories, by the attribute that holds each.
CAPPED = ("regions._retired", "parked._costs_of", "._unfenced_asks", "._failed_writes")
# Faults that lose no answer: a lost cancel answer is set aside for good by design (a ghost, see core/cancels.py).
FAULTS = ("fail write", "fail lookup", "duplicate request", "duplicate status", "land late", "ask outside")


def books(obj: object, path: str, out: dict[str, int], seen: set[int]) -> dict[str, int]:
    """The size of every container `obj` holds, by its path, and of those of the transfer.core objects it holds."""
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    fields = getattr(obj, "__dict__", None)
    if fields is None:
        fields = {name: getattr(obj, name) for name in getattr(type(obj), "__slots__", ()) if hasattr(obj, name)}
    for name, value in fields.items():
        where = f"{path}.{name}"
        if isinstance(value, (dict, list, set, deque, Mapping)):
            out[where] = len(value)
        elif isinstance(value, tuple):  # books of several kinds (the regions' sessions by kind)
            out.update((f"{where}[{i}]", len(one)) for i, one in enumerate(value) if isinstance(one, dict))
        if type(value).__module__.startswith("transfer.core"):
            books(value, where, out, seen)
    return out


def live(pair: Pair, seed: int, generations: int) -> None:
    """Plays `generations` rounds of three rooms each on `pair`: rooms offered, received, served, given up at any
    step, failed; connections dropped, prefill ranks restarted, encode ranks stopped a while; then clears all."""
    rng = random.Random(seed)
    room = 0
    for _ in range(generations):
        for _ in range(3):
            room += 1
            if rng.random() < 0.9:
                pair.offer(0, room)
            for p in range(len(pair.prefills)):
                if rng.random() < 0.95:
                    pair.receive(p, room)
        for _ in range(rng.randrange(40)):
            roll = rng.random()
            if roll < 0.1:
                pair.tick(rng.choice((0.05, 1.0, 3.0, 7.0)))
            elif roll < 0.15:
                rank = rng.choice(pair.prefills)
                if rank.receives:
                    pair.clear_receive(rank.rank, rng.choice(sorted(rank.receives)))
            elif roll < 0.17:
                rank = rng.choice(pair.prefills)
                if rank.conns:
                    pair.drop_connection(rank.rank, rng.choice(sorted(rank.conns)))
            elif roll < 0.18:
                pair.stop_encode(0)
            moves = pair.moves()
            if rng.random() < 0.2:
                moves += [move for move in pair.moves(faults=True) if move[0] in FAULTS]
            if not moves:
                break
            pair.do(rng.choice(moves))
        if rng.random() < 0.1:
            pair.restart_prefill(rng.randrange(len(pair.prefills)))
        pair.settle()
        for rank in pair.prefills:
            for number in sorted(rank.receives):
                pair.clear_receive(rank.rank, number)
        for number in sorted(pair.encodes[0].sends):
            pair.clear_send(0, number)
        pair.settle()
        pair.log.clear()  # the trace of a round that broke no rule is not needed
    for _ in range(3):  # past every time bound: stale cancels, pauses, remembered failures
        pair.tick(1000.0)
        pair.settle()


@pytest.mark.parametrize("seed", [1, 2])
def test_every_book_of_both_cores_is_back_at_its_floor_after_a_long_life(monkeypatch, seed):
    monkeypatch.setattr(core_pair, "SLOTS", 2000)  # every receive gets a fresh slot of its own
    monkeypatch.setattr(regions, "MAX_SESSIONS", KEPT)
    monkeypatch.setattr(parked, "MAX_COSTS_KEPT", KEPT)
    monkeypatch.setattr(prefill, "MAX_ROUTES", KEPT)
    monkeypatch.setattr(encode, "MAX_FAILED_WRITES", KEPT)
    pair = Pair(encode_tp=1, prefill_tp=2, deadline_s=10.0, fanout_timeout_s=5.0, late_requests=True)
    live(pair, seed, 300)

    restarts = sum(rank.generation for rank in pair.prefills)
    assert restarts > 2 * KEPT  # the memories of gone sessions reach their caps
    assert len(pair.all_receives) > 1500 and any(rec.outcome() == "Success" for rec in pair.all_receives)
    found = books(pair.encodes[0].core, "encode", {}, set())
    for rank in pair.prefills:
        books(rank.core, f"prefill{rank.rank}", found, set())
    over = {where: size for where, size in found.items()
            if size > (KEPT if where.endswith(CAPPED) else len(pair.prefills))}
    assert over == {}
    assert found["encode.regions._retired"] == KEPT  # the run reached that cap, and was held to it

"""PrefillCore.abandon_or_let_go(), the driver's clear() in one look-up where abandon() has nothing to carry out,
does what abandon() then let_go() do."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st
from prefill_rooms import core as prefill_core
from test_lane import ASKED, ASKED_AGAIN_WITH_A_CANCEL_OUT, ASKED_AGAIN_WITH_NO_CANCEL, CLEARED, EVENTS, books, step

from transfer.core.prefill import PrefillCore


def clear_in_two(c: PrefillCore, now: float, room: int, token: int) -> tuple[list, bool]:
    actions = c.abandon(now, room, token)
    return actions, c.let_go(now, room, token)


def clear_in_one(c: PrefillCore, now: float, room: int, token: int) -> tuple[list, bool]:
    actions, safe = c.abandon_or_let_go(now, room, token)
    if actions:
        assert safe is None
        safe = c.let_go(now, room, token)
    assert safe is not None
    return actions, safe


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.integers(1, 3), st.sampled_from([1, 2, 256]), st.integers(0, 1))
@example(CLEARED, 1, 256, 0)
@example([*ASKED, ("success", 0, None), ("clear", 0, True)], 1, 256, 0)
@example(ASKED_AGAIN_WITH_A_CANCEL_OUT, 1, 256, 0)
@example(ASKED_AGAIN_WITH_NO_CANCEL, 1, 256, 0)
def test_abandon_or_let_go_does_what_abandon_then_let_go_do(events, ask_batch, max_sockets, stale):
    """Each clear of a held room, by its token or (`stale`) a token before it, gives the same actions and answer
    and leaves the same books; every other event goes to both cores alike."""
    one, two = (prefill_core(tp_size=2, deadline_s=10.0, integrity=False, ask_batch=ask_batch,
                             max_sockets=max_sockets) for _ in range(2))
    now = 0.0
    last: tuple[list, list] = ([], [])
    for event in events:
        now += 0.05 + (event[1] if event[0] == "tick" else 0.0)
        if event[0] == "clear" and event[2]:
            token = one.token(event[1])
            if token is None:
                continue
            cleared = clear_in_one(one, now, event[1], token - stale), clear_in_two(two, now, event[1], token - stale)
            assert cleared[0] == cleared[1], event
            last = (cleared[0][0], cleared[1][0])
        else:
            last = (step(one, event, now, last[0], lanes=False), step(two, event, now, last[1], lanes=False))
            assert last[0] == last[1], event
        assert books(one) == books(two), event
        assert one.lanes == two.lanes, event

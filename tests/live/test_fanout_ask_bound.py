"""The encode side's bound on a room's first ask.

Writes never start later than the fanout timeout after the room's first ask
(`_start_waiting` fails the room otherwise). A fanout whose last receiver asks only
after that bound can therefore never be served. Its receivers that already asked must
hear Failed once the bound passes, not when the item's own parked timeout (counted
from send()) runs out. The reason must also say what happened: the fanout did not
all ask in time (SPEC 6's parked-item reason). It must not claim that a write waited
for a write slot or its ready event.

Real Mooncake engines (tcp on loopback), real ZMQ and the real bootstrap server; the
prefill ranks are hand-rolled RawPrefills, so each status is checked as bytes."""

from __future__ import annotations

import logging
import time

from live_helpers import LIVE, RawPrefill, item_tensor
from test_sender_fanout import FAILED, HIDDEN, ITEM, SPAN, _heads, second_prefill  # noqa: F401 - a fixture

from transfer.sender import SenderPool
from transfer.status import TransferPoll


LIMIT = 2.0  # the pools' fanout timeout here


def _live(test):
    """Marks one test live, as `pytestmark = LIVE` marks a whole module (the pool's tests are not)."""
    for mark in LIVE:
        test = mark(test)
    return test


@_live
def test_the_first_receiver_of_a_fanout_hears_failed_once_the_bound_on_its_ask_passed(engines, server,
                                                                                       second_prefill):  # noqa: F811
    """Half of a fanout of two asks at t0 and the item is sent at t0 + 1.5 s. From t0 + 2 s
    no write of the room may start, so the first receiver is told Failed then (give or take
    a sweep). It is not left waiting until the item's own timeout at t0 + 3.5 s. The other
    half asking at t0 + 3 s hears Failed at once, and the room fails with the parked-item
    reason."""
    encode, prefill = engines
    with SenderPool(encode, 0, 1, 1, server.address, fanout_timeout_s=LIMIT) as pool, \
            RawPrefill(prefill, pool.host, pool.port, ITEM) as first, \
            RawPrefill(second_prefill, pool.host, pool.port, ITEM) as second:
        asked = time.monotonic()
        first.ask(1, first.base, 2, HIDDEN, SPAN, fanout=2)
        time.sleep(1.5)
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        told = _heads(first, 1, asked + 2.9 - time.monotonic())
        assert told == [[b"1", FAILED, b"0"]], "the first receiver was not told by t0 + 2.9 s"
        assert handle.poll() == TransferPoll.Failed
        assert handle.failure == f"receiver never registered within {LIMIT:g}s (1 of 2 prefill ranks asked)", \
            handle.failure
        time.sleep(max(0.0, asked + 3.0 - time.monotonic()))
        second.ask(1, second.base, 2, HIDDEN, SPAN, fanout=2, row_start=2)
        assert _heads(second, 1, 2.0) == [[b"1", FAILED, b"0"]]
        assert first.untouched() and second.untouched()


@_live
def test_a_fanout_completed_past_the_bound_on_its_first_ask_fails_with_a_reason_that_says_so(engines, server,
                                                                                             second_prefill,  # noqa: F811
                                                                                             monkeypatch, caplog):
    """With the sweep held off, the second half of the fanout asks 2.5 s after the first,
    past the bound. The room fails at dispatch with SPEC 6's parked-item reason, and the
    log says that the fanout asked too late. It does not say that a write waited for a
    free write slot or its ready event (neither happened). Both receivers are told
    Failed and nothing is written."""
    encode, prefill = engines
    caplog.set_level(logging.WARNING, logger="transfer.sender")
    with SenderPool(encode, 0, 1, 1, server.address, fanout_timeout_s=LIMIT) as pool, \
            RawPrefill(prefill, pool.host, pool.port, ITEM) as first, \
            RawPrefill(second_prefill, pool.host, pool.port, ITEM) as second:
        monkeypatch.setattr(pool._core, "_sweep", lambda now: None)  # the dispatch path alone decides
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN))
        first.ask(1, first.base, 2, HIDDEN, SPAN, fanout=2)
        time.sleep(LIMIT + 0.5)
        second.ask(1, second.base, 2, HIDDEN, SPAN, fanout=2, row_start=2)
        assert handle.wait(5.0) == TransferPoll.Failed
        assert handle.failure.startswith(f"receiver never registered within {LIMIT:g}s (2 of 2 prefill ranks asked, "
                                      "the last "), handle.failure
        said = [m for m in caplog.messages if "its whole fanout of 2 asked only" in m]
        assert len(said) == 1 and said[0].startswith("room 1: ") and "past the fanout timeout 2s" in said[0], said
        assert _heads(first, 1, 2.0) == [[b"1", FAILED, b"0"]]
        assert _heads(second, 1, 2.0) == [[b"1", FAILED, b"0"]]
        assert first.untouched() and second.untouched()


class _NeverReady:
    """A ready event (CUDA-event-like) whose producer never finishes."""

    def query(self) -> bool:
        return False


@_live
def test_a_write_held_by_its_ready_event_fails_once_the_bound_on_the_first_ask_passed(engines, server):
    """The receiver asks at t0 and the item is sent at t0 + 1.5 s with a ready event that
    never completes. From t0 + 2 s no write of the room may start, so the receiver hears
    Failed then. It is not left until the ready event's own bound at t0 + 3.5 s (send() +
    2 s). The reason says the write waited past the bound."""
    encode, prefill = engines
    with SenderPool(encode, 0, 1, 1, server.address, fanout_timeout_s=LIMIT) as pool, \
            RawPrefill(prefill, pool.host, pool.port, ITEM) as raw:
        asked = time.monotonic()
        raw.ask(1, raw.base, SPAN, HIDDEN, SPAN)
        time.sleep(1.5)
        handle = pool.send(1, item_tensor(1, SPAN, HIDDEN), ready_event=_NeverReady())
        told = _heads(raw, 1, asked + 2.9 - time.monotonic())
        assert told == [[b"1", FAILED, b"0"]], "the receiver was not told by t0 + 2.9 s"
        assert handle.poll() == TransferPoll.Failed
        reason = handle.failure
        assert reason.startswith(f"room 1: its write for {prefill.session_id} waited "), reason
        assert reason.endswith(f"past the fanout timeout {LIMIT:g}s; not started"), reason
        assert raw.untouched()
        assert not pool._core.waiting

"""The room counters add up as dashboards and alerts assume (docs/operations.md, Metrics), on a real
SenderPool and SessionManager over Mooncake tcp, through a mix of Successes, deadlines, geometry refusals,
clears before conclusion on either side, closes with rooms in flight, an encode rank killed mid-room and a
receive() that raised after filing its room:

- every scrape of /stats shows no more rooms concluded than started on each side, each Success with its
  latency, and no counter lower than the scrape before;
- whenever no room is between steps, started = succeeded + failed (by reason) + rooms not concluded, and
  each figure is what the handles themselves say (a room cleared before it concluded: `cleared`);
- `room_latency_seconds` is observed once per Success, the byte counters count each Success's bytes once;
- once every room is cleared the gauges are at rest (`rooms_in_flight`, `parked_rooms`, `queue_depth`,
  and `quarantined_slots` once the cancels are confirmed or the quarantine passed), and after close() every
  room is concluded.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections import Counter

from live_helpers import HOST, LIVE, encode_process, wait_until

from transfer.core.failure import FailureKind
from transfer.metrics import REASON_CATEGORIES, Metrics, serve, total
from transfer.status import TransferPoll

pytestmark = LIVE

SPAN, HIDDEN = 4, 64
ITEM_BYTES = SPAN * HIDDEN * 2  # bfloat16
SLOT = 4096
WAIT_S = 15.0


class Scraper:
    """Scrapes /stats over HTTP on a thread of its own until stopped, checking each scrape as it comes."""

    def __init__(self, url: str, prefixes: tuple[str, ...]) -> None:
        self.url = url.removesuffix("/metrics") + "/stats"
        self.prefixes = prefixes
        self.problems: list[str] = []
        self.scrapes = 0
        self._last: dict[tuple, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-scraper", daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with urllib.request.urlopen(self.url, timeout=10) as reply:
                    self.check(json.loads(reply.read()))
                self.scrapes += 1
        except Exception as exc:  # noqa: BLE001 - the test reads it in `problems`
            self.problems.append(f"scrape failed: {exc!r}")

    def check(self, rows: list[dict]) -> None:
        for prefix in self.prefixes:
            started = total(rows, f"{prefix}_rooms_started_total")
            concluded = total(rows, f"{prefix}_rooms_succeeded_total") + total(rows, f"{prefix}_rooms_failed_total")
            if concluded > started:
                self.problems.append(f"{prefix}: {concluded} rooms concluded, {started} started")
            succeeded = total(rows, f"{prefix}_rooms_succeeded_total")
            observed = total(rows, f"{prefix}_room_latency_seconds_count")
            if observed != succeeded:
                self.problems.append(f"{prefix}: {succeeded} Successes, {observed} latencies observed")
        for row in rows:
            if row["type"] != "counter":
                continue
            key = (row["name"], tuple(sorted(row["labels"].items())))
            if row["value"] < self._last.get(key, 0):
                self.problems.append(f"{key} went down from {self._last[key]} to {row['value']}")
            self._last[key] = row["value"]


def _tally(outcomes: list[tuple[TransferPoll | None, FailureKind | None]]) -> Counter:
    """What the handles say, as the counters should: succeeded, a failure reason, or open."""
    tally: Counter = Counter()
    for status, kind in outcomes:
        if status is TransferPoll.Success:
            tally["succeeded"] += 1
        elif status is TransferPoll.Failed:
            tally[kind.value if kind is not None else FailureKind.OTHER.value] += 1
        else:
            tally["open"] += 1
    return tally


def _counts(rows: list[dict], prefix: str) -> Counter:
    counts: Counter = Counter()
    counts["started"] = total(rows, f"{prefix}_rooms_started_total")
    counts["succeeded"] = total(rows, f"{prefix}_rooms_succeeded_total")
    for reason in REASON_CATEGORIES:
        counts[reason] = total(rows, f"{prefix}_rooms_failed_total", reason=reason)
    return +counts  # zeros dropped, as a tally has none


def _assert_adds_up(rows: list[dict], prefix: str, outcomes: list, byte_counter: str) -> None:
    """Counters equal the handles' outcomes; started = succeeded + failed + open; latency and bytes per Success."""
    tally = _tally(outcomes)
    counts = _counts(rows, prefix)
    assert counts["started"] == len(outcomes), (prefix, counts, tally)
    assert counts["started"] == sum(n for key, n in counts.items() if key != "started") + tally["open"]
    assert counts - Counter(started=counts["started"]) == tally - Counter(open=tally["open"]), (prefix, counts, tally)
    assert total(rows, f"{prefix}_room_latency_seconds_count") == tally["succeeded"]
    assert total(rows, f"{prefix}_{byte_counter}") == tally["succeeded"] * ITEM_BYTES


def _gauge(rows: list[dict], name: str) -> float | None:
    values = [row["value"] for row in rows if row["name"] == name]
    return values[0] if values else None


def test_room_counters_add_up_on_both_sides_through_a_mix_of_fates(engines, server):
    import torch

    from transfer.buffers import ReceivePool
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool

    encode_engine, prefill_engine = engines
    items = {room: torch.randn(SPAN, HIDDEN).to(torch.bfloat16) for room in range(1, 41)}
    wide = torch.randn(2 * SPAN, HIDDEN).to(torch.bfloat16)  # more rows than its receiver asks for
    for item in (*items.values(), wide):
        encode_engine.register(item)
    encode_metrics, prefill_metrics = Metrics("epd_encode"), Metrics("epd_prefill")
    sent: dict[int, object] = {}
    received: dict[int, object] = {}
    encode_out: list = []
    prefill_out: list = []

    def settle(handles: dict, out: list, rooms) -> None:
        """Waits for each room, notes its outcome as its handle says it, and clears it."""
        for room in rooms:
            handle = handles.pop(room)
            status = handle.wait(WAIT_S)
            assert status in (TransferPoll.Success, TransferPoll.Failed), (room, status)
            out.append((status, handle.failure_kind))
            handle.clear()

    def clear_open(handles: dict, out: list, rooms) -> None:
        """Clears each room before it concluded (as its handle says): counted as cleared."""
        for room in rooms:
            handle = handles.pop(room)
            status = handle.poll()
            handle.clear()
            out.append((status, handle.failure_kind) if status in (TransferPoll.Success, TransferPoll.Failed)
                       else (TransferPoll.Failed, FailureKind.CLEARED))

    try:
        pool = ReceivePool(prefill_engine, 64 * SLOT, SLOT, quarantine_s=5.0)
        with pool, SenderPool(encode_engine, 0, 1, 1, server.address, host=HOST, metrics=encode_metrics) as sender, \
                SessionManager(prefill_engine, 0, 1, 1, pool=pool, host=HOST, deadline_s=2.0,
                               metrics=prefill_metrics) as manager, \
                serve(encode_metrics, prefill_metrics, host=HOST) as endpoint, \
                Scraper(endpoint.url, ("epd_encode", "epd_prefill")) as scraper:

            def receive(room: int, rows: int = SPAN) -> None:
                received[room] = manager.receive(room, server.address, rows=rows, hidden=HIDDEN, dtype="bfloat16")

            # Successes, both sides.
            for room in range(1, 11):
                receive(room)
                sent[room] = sender.send(room, items[room])
            settle(received, prefill_out, range(1, 11))
            settle(sent, encode_out, range(1, 11))
            assert [s for s, _ in prefill_out + encode_out] == [TransferPoll.Success] * 20
            # Deadlines: asks no item answers.
            for room in range(11, 14):
                receive(room)
            settle(received, prefill_out, range(11, 14))
            # Cleared before they concluded: asks on the prefill side, items nobody asked for on the encode side.
            for room in range(14, 17):
                receive(room)
            assert wait_until(lambda: all(r in sender._core.parked for r in range(14, 17)), WAIT_S)
            clear_open(received, prefill_out, range(14, 17))
            for room in range(17, 20):
                sent[room] = sender.send(room, items[room])
            clear_open(sent, encode_out, range(17, 20))
            # A geometry refusal: the item has more rows than its receiver asked for.
            receive(20)
            sent[20] = sender.send(20, wide)
            settle(received, prefill_out, [20])
            settle(sent, encode_out, [20])
            # More Successes after all that.
            for room in range(21, 26):
                receive(room)
                sent[room] = sender.send(room, items[room])
            settle(received, prefill_out, range(21, 26))
            settle(sent, encode_out, range(21, 26))

            rows = manager.stats() + sender.stats()
            _assert_adds_up(rows, "epd_prefill", prefill_out, "bytes_received_total")
            _assert_adds_up(rows, "epd_encode", encode_out, "bytes_written_total")
            assert _gauge(rows, "epd_prefill_rooms_in_flight") == 0
            assert _gauge(rows, "epd_prefill_cancels_set_aside") == 0
            assert _gauge(rows, "epd_encode_parked_rooms") == 0
            assert _gauge(rows, "epd_encode_queue_depth") == 0
            # The cleared asks' slots wait for their cancels' confirmation (or their quarantine) only.
            assert wait_until(lambda: total(manager.stats(), "epd_prefill_quarantined_slots") == 0, WAIT_S)
            assert pool.stats(poll=False)["leased"] == 0

            # Rooms still open when both sides close: asks nobody answers, and an item nobody asks for.
            for room in range(26, 29):
                receive(room)
                prefill_out.append((None, None))
            sent[29] = sender.send(29, items[29])
            encode_out.append((None, None))
            rows = manager.stats() + sender.stats()
            _assert_adds_up(rows, "epd_prefill", prefill_out, "bytes_received_total")
            _assert_adds_up(rows, "epd_encode", encode_out, "bytes_written_total")
            assert _gauge(rows, "epd_prefill_rooms_in_flight") == 3
            assert wait_until(lambda: total(sender.stats(), "epd_encode_parked_rooms") == 1, WAIT_S)
            manager.close()
            sender.close()
            assert scraper.scrapes > 0
        assert scraper.problems == []
        # Closing concluded every open room, Failed (closed), on both sides.
        for out, handles in ((prefill_out, received), (encode_out, sent)):
            del out[-len(handles):]
            for room, handle in handles.items():
                assert handle.poll() == TransferPoll.Failed and handle.failure_kind is FailureKind.CLOSED, room
                out.append((handle.poll(), handle.failure_kind))
        _assert_adds_up(prefill_metrics.snapshot(), "epd_prefill", prefill_out, "bytes_received_total")
        _assert_adds_up(encode_metrics.snapshot(), "epd_encode", encode_out, "bytes_written_total")
        assert {row["name"] for row in prefill_metrics.snapshot() + encode_metrics.snapshot()
                if row["type"] == "gauge"} == set(), "a closed component's gauges are still read"
    finally:
        for item in (*items.values(), wide):
            encode_engine.unregister(item.data_ptr())


def test_room_counters_add_up_when_the_encode_rank_is_killed_mid_room(engines, server):
    from transfer.buffers import ReceivePool
    from transfer.receiver import SessionManager

    _, prefill_engine = engines
    metrics = Metrics("epd_prefill")
    out: list = []
    pool = ReceivePool(prefill_engine, 16 * SLOT, SLOT, quarantine_s=2.0)
    with encode_process(server.address, token=None) as encode, pool, \
            SessionManager(prefill_engine, 0, 1, 1, pool=pool, host=HOST, deadline_s=3.0, metrics=metrics) as manager:
        handles = {room: manager.receive(room, server.address, rows=SPAN, hidden=HIDDEN, dtype="bfloat16")
                   for room in range(1, 9)}
        encode.call("send", list(range(1, 5)), SPAN, HIDDEN)
        for room in range(1, 5):
            assert handles[room].wait(WAIT_S) == TransferPoll.Success, handles[room].failure
        encode.kill()
        for room in range(1, 9):
            handle = handles[room]
            status = handle.wait(WAIT_S)
            assert status in (TransferPoll.Success, TransferPoll.Failed), (room, status)
            out.append((status, handle.failure_kind))
            handle.clear()
        rows = manager.stats()
        _assert_adds_up(rows, "epd_prefill", out, "bytes_received_total")
        assert total(rows, "epd_prefill_rooms_failed_total") == 4
        assert _gauge(rows, "epd_prefill_rooms_in_flight") == 0
        # No encode rank is left to confirm the cancels: the slots wait out their quarantine.
        assert wait_until(lambda: total(manager.stats(), "epd_prefill_quarantined_slots") == 0, WAIT_S)
        assert pool.stats()["leased"] == 0


def test_a_receive_that_raised_after_filing_its_room_is_counted_concluded_too(engines, server, monkeypatch):
    import torch

    from transfer.receiver import SessionManager

    _, prefill_engine = engines
    buf = torch.zeros((2, SPAN, HIDDEN), dtype=torch.bfloat16)
    metrics = Metrics("epd_prefill")
    with SessionManager(prefill_engine, 0, 1, 1, buffer=buf, host=HOST, deadline_s=1.0, metrics=metrics) as manager:
        # The room's route is not known yet: receive() files it and hands its look-up over, and a signal's
        # exception (Ctrl-C) arrives right then, so receive() raises, leaving no handle.
        lookups = manager._driver._lookups
        submit = lookups.submit

        def interrupted(action):
            raise KeyboardInterrupt

        monkeypatch.setattr(lookups, "submit", interrupted)
        try:
            manager.receive(1, server.address, buf[0])
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("receive() did not raise")
        finally:
            monkeypatch.setattr(lookups, "submit", submit)
        rows = manager.stats()
        _assert_adds_up(rows, "epd_prefill", [(TransferPoll.Failed, FailureKind.OTHER)], "bytes_received_total")
        assert _gauge(rows, "epd_prefill_rooms_in_flight") == 0
        # The room number is free again, and the next room is counted as any other.
        handle = manager.receive(1, server.address, buf[0])
        assert handle.wait(WAIT_S) == TransferPoll.Failed
        outcome = (TransferPoll.Failed, handle.failure_kind)
        handle.clear()
        _assert_adds_up(manager.stats(), "epd_prefill", [(TransferPoll.Failed, FailureKind.OTHER), outcome],
                        "bytes_received_total")

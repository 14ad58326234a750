"""`epd-transfer bench`: no rank opens its timed window before every rank of the cell has warmed up.

Each body runs in this process over fakes that log, in one list, the worker's ready() and go(),
the warm-up's traffic ("warm") and the CPU reading that opens the timed window ("cpu"); the
parent's side runs over queues that say when each command went out.
"""

from __future__ import annotations

import collections
import sys
import types

import pytest

from bench_fakes import floor_zmq

from transfer import bench
from transfer.harness import ItemSource
from transfer.status import TransferPoll

CELL = dict(span=64, hidden=256, dtype="torch.bfloat16", fanout=2, inflight=2, items=6)


class _Worker:
    """The hooks a rank body drives, as rank 1 of its role; go() hands out `given` in turn."""

    def __init__(self, cell: bench.Cell, log: list, given: list) -> None:
        import torch

        self.rank, self.log, self.given, self.setup = 1, log, list(given), {"host": "127.0.0.1"}
        self.src = ItemSource(cell.span, cell.hidden, cell.dtype)
        self.arena = torch.empty(bench.arena_sizes(bench.Options(), [cell])[1], dtype=torch.uint8)
        self.eng = _Engine(log)

    def engine(self, protocol):
        return self.eng

    def source(self, cell, protocol=None):
        return self.src

    def slots(self, cell, rows):
        return bench._Worker.slots(self, cell, rows)  # type: ignore[arg-type]

    def ready(self, info=None) -> None:
        self.log.append("ready")

    def go(self):
        self.log.append("go")
        return self.given.pop(0) if self.given else None

    def finished(self) -> None:
        self.log.append("finished")


class _Engine:
    """A Mooncake engine whose writes are over at once; a blocking write() is the raw warm-up's."""

    session_id = "fake:1"

    def __init__(self, log: list) -> None:
        self.log = log

    def write(self, session, srcs, dsts, lens) -> None:
        self.log.append("warm")

    def write_async(self, session, srcs, dsts, lens) -> int:
        return 1

    def poll(self, ticket) -> bool:
        return True

    def wait(self, ticket, timeout_s=None) -> None:
        pass


class _Handle:
    def __init__(self, room: int) -> None:
        self.room, self.latency_s, self.started_at, self.stages, self.failure = room, 1e-4, 0.0, {}, None
        self.safe_to_reuse = True

    def wait(self, timeout_s=None):
        return TransferPoll.Success

    def clear(self) -> None:
        pass


class _Endpoint:
    """A SenderPool or SessionManager whose rooms succeed at once; the warm-up room is logged."""

    def __init__(self, log: list) -> None:
        self.log = log

    def __call__(self, *args, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _room(self, room: int) -> _Handle:
        if room == bench.WARMUP_ROOM:
            self.log.append("warm")
        return _Handle(room)

    def send(self, room, item, deepstack=None):
        return self._room(room)

    def receive(self, room, bootstrap, dst, row_start, span):
        return self._room(room)


def _zmq(log: list) -> types.ModuleType:
    """A zmq module whose PUSH socket takes each bare ask (the first, the warm-up's, logged) and queues its status."""

    def on_ask(room: int, dst: int) -> None:
        if "warm" not in log:
            log.append("warm")

    return floor_zmq(on_ask)


def _run(monkeypatch, path: str, role: str) -> list:
    """One rank body over the fakes; the log of what it did, in order."""
    cell = bench.Cell(path, **CELL)
    log: list = []
    monkeypatch.setattr(bench, "thread_cpu", lambda: log.append("cpu"))
    monkeypatch.setattr(bench, "_bytes_written", lambda pool: 0)
    monkeypatch.setattr("transfer.sender.SenderPool", _Endpoint(log))
    monkeypatch.setattr("transfer.receiver.SessionManager", _Endpoint(log))
    monkeypatch.setitem(sys.modules, "zmq", _zmq(log))
    receivers = [{"session": f"peer{r}", "addr": 1 << 32, "stride": 0, "row_start": 32 * r, "rows": 32, "rank": r}
                 for r in range(cell.fanout)]
    worker = _Worker(cell, log, [receivers if role == "encode" else {"port": 1}])
    body = bench._BODIES[(role, path if path in ("raw", "floor") else "epd")]
    extra = {"protocol": "tcp", "raw_issue": "async", "raw_writers": 1, "deadline_s": 5.0, "bootstrap": "fake:0"}
    body(worker, cell, extra)  # type: ignore[arg-type]
    return log


@pytest.mark.parametrize("path, role, warms", [
    ("raw", "encode", True), ("raw", "prefill", False), ("floor", "prefill", True),
    ("epd", "encode", True), ("epd", "prefill", True), ("wire", "prefill", True),
])
def test_a_rank_opens_its_timed_window_only_after_the_go_that_follows_every_ranks_warm_up(monkeypatch, path, role,
                                                                                          warms):
    log = _run(monkeypatch, path, role)
    readies = [i for i, what in enumerate(log) if what == "ready"]
    gos = [i for i, what in enumerate(log) if what == "go"]
    # Set up (ready, go), warm up, then the barrier: warmed up (ready), every rank is (go).
    assert len(readies) == 2 and len(gos) == 2, log
    assert readies[0] < gos[0] < readies[1] < gos[1], log
    warm = [i for i, what in enumerate(log) if what == "warm"]
    assert bool(warm) == warms, log
    assert all(gos[0] < i < readies[1] for i in warm), log
    assert log.index("cpu") > gos[1], log


class _Commands:
    """A rank's command queue: records each command with how many reports the parent had read by then."""

    def __init__(self, sent: list, reports: _Reports, key) -> None:
        self.sent, self.reports, self.key = sent, reports, key

    def put(self, msg) -> None:
        self.sent.append((self.key, msg[0], self.reports.read))


class _Reports:
    """The parent's result queue, holding every report the ranks will send, in order."""

    def __init__(self, messages: list) -> None:
        self.messages, self.read = collections.deque(messages), 0

    def get(self, timeout=None):
        self.read += 1
        return self.messages.popleft()


def test_the_parent_says_go_to_the_timed_part_only_once_every_rank_has_warmed_up():
    cell = bench.Cell("raw", **CELL)
    members = [("encode", 0)] + [("prefill", r) for r in range(cell.prefill_ranks)]
    infos = {("prefill", r): {"rank": r, "rows": 32} for r in range(cell.prefill_ranks)}
    messages = [("ready", *key, infos.get(key)) for key in members]  # set up
    messages += [("ready", *key, None) for key in members]  # warmed up
    messages += [("finished", *key, None) for key in members] + [("report", *key, {}) for key in members]
    ranks = object.__new__(bench.RankSet)
    ranks.opts = bench.Options(timeout_s=5.0)
    ranks.res_q = _Reports(messages)
    sent: list = []
    ranks.cmd_qs = {key: _Commands(sent, ranks.res_q, key) for key in members}
    reports = ranks.run_cell(cell)
    assert set(reports) == set(members)
    for key in members:
        assert [what for k, what, _ in sent if k == key] == ["cell", "go", "go", "close"], sent
    first_go = [read for _, what, read in sent if what == "go"][: len(members)]
    second_go = [read for _, what, read in sent if what == "go"][len(members):]
    assert all(read == len(members) for read in first_go)  # every rank set up
    assert all(read == 2 * len(members) for read in second_go)  # every rank warmed up

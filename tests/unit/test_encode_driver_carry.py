"""The encode driver's _carry: the core's actions carried out in order, each answer the core gives to one
carried right after what came before it, and a room cleared meanwhile reaching the core before a write
starts. Run on the test's thread against a scripted core; sockets, waker and pushers are stand-ins."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transfer import _io
from transfer.core.encode import StartWrite, Warn
from transfer.drive.encode import EncodeDriver, RoomBook, SourceRegistry
from transfer.metrics import Metrics


@dataclass
class Node:
    """One action of the script: a warning, or a write whose start the core answers with `answers` (and
    meanwhile the caller clears room `clears`, when set); a clear's answer is its node's `answers` too."""

    write: bool
    answers: list[int]
    clears: int | None = None


class Stub:
    """The request socket, the waker and the status pushers: never used here."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def fileno(self) -> int:
        return 99


class ScriptedCore:
    """Answers the driver as the script says, recording what it was asked in `events`."""

    def __init__(self, nodes: list[Node], events: list[tuple[str, int]]) -> None:
        self.nodes = nodes
        self.events = events
        self.driver: EncodeDriver | None = None

    def action(self, node: int) -> object:
        if self.nodes[node].write:
            return StartWrite(node, node, "peer:1", (0x1000,), (0x2000,), (64,), 64)
        return Warn(str(node), "scripted")

    def wants(self, wid: int) -> bool:
        self.events.append(("start", wid))
        return False

    def write_skipped(self, wid: int, now: float) -> list:
        clears = self.nodes[wid].clears
        if clears is not None:
            assert self.driver is not None
            self.driver.post("clear", clears, None, wake=False)
        return [self.action(answer) for answer in self.nodes[wid].answers]

    def clear(self, room: int, state: object, now: float) -> list:
        self.events.append(("clear", room))
        return [self.action(answer) for answer in self.nodes[room].answers]


class Warnings:
    def __init__(self, events: list[tuple[str, int]]) -> None:
        self.events = events

    def warning(self, key: str, message: str, *args: object) -> None:
        self.events.append(("warn", int(key)))


def expected(nodes: list[Node], first: list[int]) -> list[tuple[str, int]]:
    """What the driver must carry out, in order: one queue of work, each answer put at its front only
    for the clears a write waits for (they and that write come next), at its back otherwise."""
    events: list[tuple[str, int]] = []
    commands: deque[int] = deque()
    work = deque(first)
    while work:
        node = work.popleft()
        if not nodes[node].write:
            events.append(("warn", node))
            continue
        if commands:
            answers = []
            while commands:
                room = commands.popleft()
                events.append(("clear", room))
                answers += nodes[room].answers
            work.appendleft(node)
            work.extendleft(reversed(answers))
            continue
        events.append(("start", node))
        if nodes[node].clears is not None:
            commands.append(nodes[node].clears)
        work.extend(nodes[node].answers)
    return events


@st.composite
def scripts(draw) -> tuple[list[Node], list[int]]:
    """Nodes whose answers and clears name later nodes only (so every script ends), and the first actions."""
    count = draw(st.integers(1, 12))
    nodes = []
    for i in range(count):
        later = st.integers(i + 1, count - 1) if i + 1 < count else st.nothing()
        write = draw(st.booleans())
        answers = draw(st.lists(later, max_size=3)) if i + 1 < count else []
        clears = draw(st.none() | later) if write and i + 1 < count else None
        nodes.append(Node(write, answers, clears))
    first = draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=4))
    return nodes, first


@pytest.fixture
def carried(monkeypatch):
    monkeypatch.setattr(_io, "Waker", Stub)
    monkeypatch.setattr(_io, "Pushers", Stub)
    monkeypatch.setattr(_io, "pull_socket", lambda host, port, what="": (Stub(), 7000))

    def carry(nodes: list[Node], first: list[int]) -> list[tuple[str, int]]:
        """What the driver carried out, in order, for a script whose first actions are `first`."""
        events: list[tuple[str, int]] = []
        core = ScriptedCore(nodes, events)
        driver = EncodeDriver(core, object(), 0, "127.0.0.1", 0, RoomBook(Metrics("epd_test")),
                              SourceRegistry(object()), Metrics("epd_test"), clock=lambda: 0.0)
        core.driver = driver
        driver._warnings = Warnings(events)
        driver._carry([core.action(node) for node in first])
        return events
    return carry


# The fixture only patches what the driver is made of: each example makes a driver of its own.
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=scripts())
def test_actions_and_their_answers_are_carried_out_in_the_order_of_one_queue(carried, script):
    nodes, first = script
    assert carried(nodes, first) == expected(nodes, first)


def test_a_room_cleared_meanwhile_reaches_the_core_before_the_next_write_and_its_answers_before_the_rest(
        carried):
    # 0: a write, whose start the core answers with warning 1 while the caller clears room 2; the clear's
    # answer is warning 3; 4, the next write, waits for that clear and its answer, and warning 5 comes last.
    nodes = [Node(True, [1], clears=2), Node(False, []), Node(False, [3]), Node(False, []),
             Node(True, []), Node(False, [])]
    assert carried(nodes, [0, 4, 5]) == [("start", 0), ("clear", 2), ("warn", 3), ("start", 4), ("warn", 5),
                                         ("warn", 1)]

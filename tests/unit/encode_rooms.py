"""What the EncodeCore cancel tests share: a core on a fake clock, and what it asked for, by kind."""

from __future__ import annotations

from transfer.core.encode import Conclude, EncodeCore, PushStatus
from transfer.core.failure import FailureKind
from transfer.status import TransferPoll


class Run:
    """A core on a fake clock, and everything it asked for."""

    def __init__(self) -> None:
        self.now = 0.0
        self.core = EncodeCore(fanout_timeout_s=10.0, now=self.now)
        self.actions: list = []

    def __call__(self, actions: list) -> list:
        self.actions.extend(actions)
        return actions

    def of(self, kind: type, actions: list | None = None) -> list:
        return [a for a in (self.actions if actions is None else actions) if isinstance(a, kind)]

    def statuses(self, actions: list | None = None) -> list[PushStatus]:
        """Pushes that are not a cancel's answer."""
        return [a for a in self.of(PushStatus, actions) if a.cancel is None]

    def answers(self, actions: list | None = None) -> list[tuple[int, int, bool]]:
        """(room, port, answer) of the cancels' answers."""
        return [(a.room, a.port, a.cancel) for a in self.of(PushStatus, actions) if a.cancel is not None]

    def conclusions(self) -> list[tuple[int, TransferPoll, FailureKind | None]]:
        return [(c.room, c.status, c.failure and c.failure.kind) for c in self.of(Conclude)]

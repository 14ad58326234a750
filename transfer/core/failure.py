"""Why a room failed: a kind from a small closed set, and the human-readable detail."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["CLEARED", "MAX_DETAIL", "Failure", "FailureKind", "cut_printable", "printable", "without_room"]

#: A failure's detail is cut to this many characters: it may quote what a peer or a server sent
#: (a session id, an answer), and it goes to logs, to callers and to peers.
MAX_DETAIL = 2048


def printable(text: str) -> str:
    """Text with every non-printable character (newlines, escapes, controls) shown as `?`."""
    return text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)


def cut_printable(text: str, limit: int) -> str:
    """Printable, and at most `limit` characters (a longer text is cut and marked `...`)."""
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return printable(text)


def without_room(room: int, detail: str) -> str:
    """`detail` without its leading `room N: ` (most details name their room), for a line that names it already."""
    return detail.removeprefix(f"room {room}: ")


class FailureKind(str, Enum):
    """The closed set of reasons a room concludes Failed; metrics label by it, logs throttle by it."""

    DEADLINE = "deadline"  # no terminal status within the room's deadline (prefill side)
    NO_CONNECTION = "no_connection"  # the encode rank's request socket could not be reached
    BOOTSTRAP = "bootstrap"  # bootstrap server unreachable, refused, or has no route yet
    GEOMETRY = "geometry"  # the ask disagrees with the item, or shards do not tile
    REGION = "region"  # a destination lies outside the receiver's announced region
    FANOUT_TIMEOUT = "fanout_timeout"  # not every receiver of the block asked in time
    WRITE = "write"  # the data path refused or failed a write
    CHECKSUM = "checksum"  # landed bytes differ from what the encode rank wrote
    PEER_FAILED = "peer_failed"  # the peer pushed Failed (encode failed to send embedding)
    CLEARED = "cleared"  # the caller cleared the room before it concluded
    CANCELLED = "cancelled"  # a receiver gave up on the room and told the encode rank (our extension)
    CLOSED = "closed"  # the pool or session manager closed with the room open
    OTHER = "other"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Failure:
    """A room's failure: `kind` for programs (metrics, retries), `detail` for people (one printable
    line of at most MAX_DETAIL characters, whatever text it quotes).

    `retry_at`, where set, is when the pause that failed the room ends (on the clock of the `now` that
    concluded it): its bootstrap server failed a look-up slowly, which pauses it (core/prefill_breaker.py),
    and this room's look-up was that one or met the pause. Asking for the room again from then may
    succeed; every other failure leaves it None."""

    kind: FailureKind
    detail: str
    retry_at: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FailureKind):
            object.__setattr__(self, "kind", FailureKind(self.kind))
        object.__setattr__(self, "detail", cut_printable(self.detail, MAX_DETAIL))

    def __str__(self) -> str:
        return self.detail


#: The failure of a room its caller cleared before it concluded (a Failure is immutable: one serves all).
CLEARED = Failure(FailureKind.CLEARED, "cleared before it concluded")

"""The library's exceptions: one base, `TransferError`, and kinds that are also the matching built-in.

`except TransferError` catches everything this library raises on purpose; each kind also
derives from the built-in a caller would have caught before (`ConfigError` is a
`ValueError`, `EngineError` a `RuntimeError`, ...), so existing handlers keep working.
Failures of a room are not exceptions: they conclude the room (`handle.failure`).
The native core's `transfer.wire.FrameError` (an `OSError`), `MsgError` and `LayerError`
(`ValueError`s) derive from `TransferError` too.
"""

from __future__ import annotations

__all__ = [
    "BootstrapError",
    "BootstrapNoRoute",
    "BootstrapUnreachable",
    "CollectiveError",
    "ConfigError",
    "ConfigTypeError",
    "EngineError",
    "EngineUnavailable",
    "FallbackLimitError",
    "ListenError",
    "PortsInUse",
    "SlotError",
    "TransferError",
    "UsageError",
    "WireError",
]


class TransferError(Exception):
    """Base of every exception this library raises on purpose."""


class ConfigError(TransferError, ValueError):
    """An argument or setting the caller gave is wrong; raised before anything starts."""


class ConfigTypeError(TransferError, TypeError):
    """An argument the caller gave has the wrong type."""


class WireError(TransferError, ValueError):
    """A frame that breaks the wire contract; the message is the protocol's wording (docs/protocol.md)."""


class EngineError(TransferError, RuntimeError):
    """A data-path engine could not start, register memory, or complete a write."""


class EngineUnavailable(EngineError):
    """mooncake.engine cannot be imported on this host (the message names the wheel to install)."""


class BootstrapError(TransferError, RuntimeError):
    """The bootstrap server could not be reached or refused the request."""


class BootstrapUnreachable(BootstrapError):
    """No answer from the bootstrap server at all (refused, reset or timed out)."""


class BootstrapNoRoute(BootstrapError):
    """The bootstrap server answered that no encode rank is registered under the route asked for (HTTP 404)."""


class UsageError(TransferError, RuntimeError):
    """A call the object's state does not allow: it is closed, its thread stopped or is stuck (a session
    manager's call that waited transfer._io.LOCK_WAIT_S for a lock one of its threads holds), or the ranks of
    a group are out of step with each other."""


class CollectiveError(UsageError):
    """A collective over a torch.distributed process group did not complete (`transfer.reassemble`):
    a rank of the group exited, or did not make the same call within the group's timeout, or the
    backend failed. Not this rank's misuse (ranks that pass different items raise UsageError or
    ConfigError instead): no row was written, and the group is to be treated as broken.

    `step` names the collective, `rank` and `size` this rank's place in the group, `rooms` the
    rooms of the batch (empty for `agree`)."""

    def __init__(self, message: str, *, step: str = "", rank: int = -1, size: int = 0,
                 rooms: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.step, self.rank, self.size, self.rooms = step, rank, size, rooms


class SlotError(TransferError, RuntimeError):
    """A receive slot used against its lifecycle (released twice, failed after release, ...)."""


class FallbackLimitError(TransferError, RuntimeError):
    """A fallback buffer would take a receive pool's fallbacks past max_fallback_bytes.

    A RuntimeError, like the error a failed allocation of the buffer raises, so callers
    that already handle one handle both; catch this one to tell "over budget" apart.
    """


class ListenError(TransferError, OSError):
    """A listener (the bootstrap server, a wire listener, a rank's request or status socket, a metrics endpoint)
    could not bind its address; the message names the listener, the address and what to do, and `errno` is
    the bind's. An address not of this host is a ConfigError instead."""


class PortsInUse(ListenError):
    """A listener's port is in use: every port of its range, or the one port it was given (errno EADDRINUSE)."""

"""The structural types of the public API: what an engine and an event must offer.

Protocols rather than base classes, so `transfer.engine.Engine` (Mooncake),
`transfer.wire_engine.WireEngine` (the framed wire) and a test's fake all fit
without inheriting from anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["EventLike", "TransferEngineLike"]


class TransferEngineLike(Protocol):
    """An engine a SenderPool, SessionManager or ReceivePool can use: registered memory and one-sided writes.

    An engine may also offer `write_async(...) -> ticket` and `poll(ticket) -> bool`;
    the sender pool uses them when present and `write()` otherwise.
    """

    @property
    def hostname(self) -> str:
        """The address peers reach this engine on."""
        ...

    @property
    def session_id(self) -> str:
        """"host:port" that peers write to."""
        ...

    def register(self, buf: torch.Tensor | int, length: int | None = None, /) -> tuple[int, int]:
        """Registers a tensor or an address range for peers' writes; returns (address, length)."""
        ...

    def unregister(self, addr: int, /) -> None:
        """Unregisters the region that starts at `addr`."""
        ...

    def registered(self) -> dict[int, int]:
        """The registered regions, address -> length."""
        ...

    def write(self, session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
              lengths: Sequence[int], /) -> None:
        """Writes every (src, dst, length) to the peer session and waits for it."""
        ...

    def wait(self, ticket: int, timeout_s: float | None = None, /) -> None:
        """Blocks until the write behind `ticket` (from write_async) is over."""
        ...


class EventLike(Protocol):
    """Something that says whether a copy completed without blocking, e.g. a torch.cuda.Event."""

    def query(self) -> bool:
        """Whether the work before the event completed."""
        ...


if TYPE_CHECKING:
    from transfer.engine import Engine
    from transfer.wire_engine import WireEngine

    def _engines_fit(mooncake: Engine, wire: WireEngine) -> tuple[TransferEngineLike, TransferEngineLike]:
        """Both engines are TransferEngineLike (checked by mypy, never run)."""
        return mooncake, wire

"""The region book: what each prefill session announced it may be written to (SPEC.md 8)."""

from __future__ import annotations

from collections.abc import Iterable

from transfer.frames import (
    MAX_REGIONS_PER_SESSION,
    Registration,
    TransferInfo,
    check_region,
)

__all__ = ["MAX_REGIONS_PER_SESSION", "MAX_SESSIONS", "RegionBook"]

#: Prefill sessions whose regions are remembered (MAX_REGIONS_PER_SESSION each); the one
#: least recently registered or written to is forgotten first.
MAX_SESSIONS = 4096


class RegionBook:
    """Per-session registered regions, newest last, bounded per session and in sessions (LRU)."""

    def __init__(self, *, max_sessions: int | None = None, per_session: int = MAX_REGIONS_PER_SESSION) -> None:
        self.max_sessions = MAX_SESSIONS if max_sessions is None else max_sessions
        self.per_session = per_session
        self._sessions: dict[str, list[Registration]] = {}

    def register(self, reg: Registration) -> None:
        """Remembers a session's announced region; a repeat of the same base replaces it.

        A registration from a new status endpoint is a new session manager on that
        engine: the regions its predecessor announced are forgotten, so memory it
        freed is never again an accepted destination.
        """
        regs = self._sessions.pop(reg.session_id, [])
        self._sessions[reg.session_id] = regs  # now the most recently used
        if len(self._sessions) > self.max_sessions:
            del self._sessions[next(iter(self._sessions))]
        regs[:] = [
            r for r in regs
            if r.embedding_base != reg.embedding_base and (r.endpoint, r.port) == (reg.endpoint, reg.port)
        ]
        regs.append(reg)
        del regs[:-self.per_session]

    def check(self, infos: Iterable[TransferInfo], row_bytes: int, deepstack_row_bytes: int) -> str | None:
        """Why a destination lies outside every region its session announced with lengths, or None.

        A session that never registered is written as the peers do; a session used here
        becomes the last to be forgotten.
        """
        for info in infos:
            regs = self._sessions.pop(info.session_id, None)
            if regs is None:
                continue
            self._sessions[info.session_id] = regs
            reasons = [check_region(info, reg, row_bytes, deepstack_row_bytes) for reg in regs]
            if reasons and all(reasons):
                return reasons[-1]
        return None

    def regions(self, session_id: str) -> list[Registration]:
        """The session's regions, oldest first (a copy)."""
        return list(self._sessions.get(session_id, ()))

    def forget(self, session_id: str) -> None:
        """Drops a session's regions."""
        self._sessions.pop(session_id, None)

    def sessions(self) -> list[str]:
        """Sessions remembered, least recently used first."""
        return list(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

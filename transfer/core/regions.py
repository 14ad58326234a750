"""The region book: what each prefill session announced it may be written to (SPEC.md 8)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from transfer.frames import (
    MAX_REGIONS_PER_SESSION,
    Registration,
    TransferInfo,
    check_region,
    host_text,
    receiver_text,
)

__all__ = ["MAX_REGIONS_PER_SESSION", "MAX_SESSIONS", "RegionBook"]

#: Prefill sessions whose regions are remembered (MAX_REGIONS_PER_SESSION each); the one
#: least recently registered or written to is forgotten first: sessions that never
#: announced lengths, then those that announced them and were never served a write, then
#: those that were (a peer registering sessions of its own by the thousand reaches those
#: last; see RegionBook._evict).
MAX_SESSIONS = 4096

# What a session is to eviction, the first forgotten first.
_NO_LENGTHS, _UNSERVED, _SERVED = range(3)


@dataclass
class _Session:
    """One session's regions, and whether it ever announced lengths (then only those count)."""

    regs: list[Registration] = field(default_factory=list)
    announced: bool = False
    served: bool = False  # a write to it landed
    filed: int = _NO_LENGTHS  # its kind as _order files it

    @property
    def kind(self) -> int:
        if not self.announced:
            return _NO_LENGTHS
        return _SERVED if self.served else _UNSERVED


def _sharing(reg: Registration, kept: Registration) -> Registration:
    """`reg` holding `kept`'s session id, and its endpoint where they are the same.

    Each registration arrives with its own copies of them: shared, a session's regions and its
    keys here hold a peer's long texts once, not once per region (per_session times what it sent).
    """
    endpoint = kept.endpoint if kept.endpoint == reg.endpoint else reg.endpoint
    return replace(reg, session_id=kept.session_id, endpoint=endpoint)


class RegionBook:
    """Per-session registered regions, newest last, bounded per session and in sessions (LRU)."""

    def __init__(self, *, max_sessions: int | None = None, per_session: int = MAX_REGIONS_PER_SESSION) -> None:
        self.max_sessions = MAX_SESSIONS if max_sessions is None else max_sessions
        self.per_session = per_session
        self._sessions: dict[str, _Session] = {}
        # The sessions of each kind, least recently used first (what _evict picks from).
        self._order: tuple[dict[str, None], ...] = ({}, {}, {})
        # Sessions that announced lengths and were then superseded or evicted, oldest first: their
        # asks are refused, never written unchecked as a session that never announced would be.
        self._retired: dict[str, str] = {}  # session -> why its regions are gone
        self.version = 0  # bumped whenever a check's answer may change: one made at the same version still holds

    def register(self, reg: Registration) -> str | None:
        """Remembers a session's announced region; returns why it was refused, or None.

        A repeat of the same pair of bases (embedding, deepstack) replaces it. A registration from a new status
        endpoint is a new session manager on that engine: the regions its predecessor
        announced are forgotten, so memory it freed is never again an accepted
        destination. Once a session announced lengths, one without lengths is refused:
        it would name memory nobody vouched for.
        """
        self.version += 1
        session = self._sessions.pop(reg.session_id, None)
        if session is not None and session.regs:
            reg = _sharing(reg, session.regs[0])
        if session is None:
            self._retired.pop(reg.session_id, None)
            session = _Session()
            self._evict()
        self._sessions[reg.session_id] = session  # now the most recently used
        if session.announced and not reg.has_lengths:
            self._use(reg.session_id, session)
            return (f"a registration without region lengths from {receiver_text(reg.session_id)} (status endpoint "
                    f"{host_text(reg.endpoint)}:{reg.port}, base {reg.embedding_base:#x}) refused: that session "
                    f"announced lengths before")
        if reg.has_lengths:
            session.announced = True
        self._use(reg.session_id, session)
        regs = session.regs
        regs[:] = [
            r for r in regs
            if (r.embedding_base, r.deepstack_base) != (reg.embedding_base, reg.deepstack_base)
            and (r.endpoint, r.port) == (reg.endpoint, reg.port)
            and (r.has_lengths or not session.announced)
        ]
        regs.append(reg)
        del regs[:-self.per_session]
        return None

    def _use(self, session_id: str, session: _Session) -> None:
        """Files the session as the most recently used of its kind."""
        self._order[session.filed].pop(session_id, None)
        session.filed = session.kind
        self._order[session.filed][session_id] = None

    def _evict(self) -> None:
        """Makes room for one more session: the least recently used one without lengths, else of those never
        served a write, else of those served.

        Only a served session is retired (refused until it registers again, see check): the
        others are forgotten, so their asks are written as a peer's are. Registrations are
        not authenticated, and a peer registers sessions of its own by the thousand in a
        moment: retiring the sessions it pushed out would fail every later room of theirs
        (a prefill rank registers once per encode rank), where forgetting them costs only
        the check of their own destinations; and it reaches a served session only once it
        got thousands of its own served.
        """
        if len(self._sessions) < self.max_sessions:
            return
        self.version += 1
        kind, order = next((kind, order) for kind, order in enumerate(self._order) if order)
        victim = next(iter(order))
        del order[victim]
        del self._sessions[victim]
        if kind == _SERVED:
            self._retire(victim, f"its regions were forgotten for newer sessions (more than {self.max_sessions})")

    def served(self, session_id: str) -> None:
        """A write to the session landed: it is forgotten after every session never served one."""
        session = self._sessions.get(session_id)
        if session is not None and not session.served:
            session.served = True
            self._use(session_id, session)

    def check(self, infos: Iterable[TransferInfo], row_bytes: int, deepstack_row_bytes: int) -> str | None:
        """Why a destination lies outside every region its session announced with lengths, or None.

        A session that never registered, or never announced lengths, is written as the
        peers do; one that announced lengths and was then retired is refused; a session
        used here becomes the last to be forgotten.
        """
        sessions = self._sessions
        for info in infos:
            session_id = info.session_id
            if session_id not in sessions:
                why = self._retired.get(session_id)
                if why is not None:
                    return (f"room {info.room}: receiver {receiver_text(session_id)} announced its regions "
                            f"with lengths before, but {why}: no destination of it is accepted until it registers "
                            f"again")
                continue
            # _use(), moved to the end of both dicts by del and set: its kind is the one it is filed under
            # (every change of it files it again).
            session = sessions[session_id]
            del sessions[session_id]
            sessions[session_id] = session
            order = self._order[session.filed]
            del order[session_id]
            order[session_id] = None
            if not session.announced:
                continue
            reason = None
            for reg in session.regs:  # outside when outside every one of them: the last one's reason
                reason = check_region(info, reg, row_bytes, deepstack_row_bytes)
                if not reason:
                    break
            if reason:
                return reason
        return None

    def regions(self, session_id: str) -> list[Registration]:
        """The session's regions, oldest first (a copy)."""
        session = self._sessions.get(session_id)
        return list(session.regs) if session is not None else []

    def forget(self, session_id: str, why: str = "it was superseded") -> None:
        """Drops a session's regions; one that announced lengths is refused from now on (see check)."""
        self.version += 1
        session = self._sessions.pop(session_id, None)
        if session is not None:
            del self._order[session.filed][session_id]
        if session is not None and session.announced:
            self._retire(session_id, why)

    def _retire(self, session_id: str, why: str) -> None:
        self.version += 1
        self._retired.pop(session_id, None)
        self._retired[session_id] = why
        if len(self._retired) > self.max_sessions:
            del self._retired[next(iter(self._retired))]

    def sessions(self) -> list[str]:
        """Sessions remembered, least recently used first."""
        return list(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

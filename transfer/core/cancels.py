"""The cancels a prefill rank sent and awaits answers to (our extension, docs/protocol.md 8).

A cancel is keyed by (room, encode rank): answers name only those two, so the cancels of one key
are answered in the order they were sent, each with TOO_LATE (a write was in flight) and then its
last answer (CONFIRMED or WRITE_FAILED), or its last answer alone. Besides the cancels awaiting
answers, the book keeps what the answers show of each encode address: whether its rank answers
cancels at all, and since when a cancel there went unanswered (its silence clock, counted on the
connection in use: a cancel sent on a connection since lost may never have been read).

Bounded: past MAX_PENDING_CANCELS awaiting, the oldest key is set aside as a ghost; a cancel sent on
a connection since lost is set aside once STALE_CANCEL_S old. A ghost takes whatever answers still
come for its key and is never dropped before its last one (a later cancel of that key would take a
late answer for its own), so past MAX_GHOSTS no cancel is sent at all. What the rooms make of all
this (which ask waits for which answer, when memory is safe) is the prefill core's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from transfer.frames import CancelAnswer

__all__ = ["CANCEL_SILENCE_S", "MAX_ANSWERING", "MAX_GHOSTS", "MAX_PENDING_CANCELS", "STALE_CANCEL_S", "Cancel",
           "CancelBook"]

#: Cancels awaiting their encode rank's confirmation (past this the oldest is set aside as a
#: ghost: its memory then waits out the caller's quarantine bound).
MAX_PENDING_CANCELS = 65536

#: How long a cancel sent on a connection since lost is awaited as one: past it, its (room,
#: encode rank) is set aside as a ghost (an encode rank that went away or restarted never
#: answers; the room's memory waits out the caller's quarantine bound, as with no cancel). A
#: ghost is not looked at when sockets are weighed; it takes whatever answers still come for its
#: room and rank, and no cancel of that room goes to that rank while it is there: answers name
#: only the room and the encode rank, and a late one would be taken for a later cancel's.
STALE_CANCEL_S = 300.0

#: Ghosts (set-aside cancels) kept at most before no cancel is sent at all: a ghost is never
#: dropped (a later cancel of its room would take its late answer), so at this bound cleared
#: rooms wait out the quarantine until ghosts get their last answers.
MAX_GHOSTS = 65536

#: Encode addresses remembered as answering cancels (past this, the one heard from longest ago is forgotten).
MAX_ANSWERING = 65536

#: How long an encode rank may leave a cancel unanswered before it is sent no more, until it
#: answers one or its connection is made afresh: a peer without the extension answers none and
#: logs each as a malformed frame (our ranks answer within milliseconds).
CANCEL_SILENCE_S = 5.0

Address = tuple[str, int]
Key = tuple[int, int]  # (room, encode rank)


@dataclass(slots=True, eq=False)
class Cancel:
    """A cancel sent for one ask (its token), on connection `conn` to `addr`; `answered` once any answer came,
    `gone` once it awaits none (its last answer came, it was not sent after all, or it was set aside)."""

    token: int
    addr: Address
    conn: int
    sent_at: float
    answered: bool = False
    gone: bool = False


class _SentCancels:
    """One address's cancels in the order sent. Those that await no answer on the current connection any
    more are let go of from the front as they come up, and all at once whenever they make up most of the
    queue (an unanswered one at the front would keep the rest), so it holds at most about twice those
    still awaited."""

    __slots__ = ("_cancels", "_compact_at")

    def __init__(self) -> None:
        self._cancels: deque[Cancel] = deque()
        self._compact_at = _MIN_COMPACT

    def add(self, cancel: Cancel) -> None:
        self._cancels.append(cancel)
        if len(self._cancels) > self._compact_at:
            self._cancels = deque(c for c in self._cancels if not (c.answered or c.gone))
            self._compact_at = max(_MIN_COMPACT, 2 * len(self._cancels))

    def oldest(self, conn: int | None) -> Cancel | None:
        """The oldest cancel still unanswered on connection `conn`, if any."""
        cancels = self._cancels
        while cancels and (cancels[0].answered or cancels[0].gone or cancels[0].conn != conn):
            cancels.popleft()  # connections are never reused: one sent on another is no longer awaited here
        return cancels[0] if cancels else None


_MIN_COMPACT = 64


class CancelBook:
    """The cancels awaiting answers per (room, encode rank), the ghosts set aside, and each encode address's
    answering and silence. `current_conn` names the connection in use to an address (None: none)."""

    def __init__(self, current_conn: Callable[[Address], int | None]) -> None:
        self._current_conn = current_conn
        #: The cancels of each key awaiting answers, oldest first; keys in the order first sent (read, never
        #: changed, outside).
        self.awaiting: dict[Key, list[Cancel]] = {}
        self._count = 0
        # (sent at, key, cancel), in the order sent; those awaiting no answer any more are let go of all at once
        # whenever they make up most of it, so it holds at most about twice the cancels still awaited
        self._sent: deque[tuple[float, Key, Cancel]] = deque()
        self._sent_compact_at = _MIN_COMPACT
        #: Each key set aside -> its last answers still to come (read, never changed, outside).
        self.ghosts: dict[Key, int] = {}
        self._answering: dict[Address, None] = {}  # encode ranks seen to answer cancels, least recently heard first
        self._unanswered_since: dict[Address, float] = {}  # when a cancel there last went unanswered
        self._sent_to: dict[Address, _SentCancels] = {}  # each address's cancels, for its silence clock

    # ------------------------------------------------------------ queries

    @property
    def pending(self) -> int:
        """Cancels sent and awaiting their last answer."""
        return self._count

    @property
    def kept(self) -> int:
        """Cancels the book keeps in the order sent, for setting aside those gone stale: those answered are let
        go of, so it holds at most about twice the most awaited at once (at least 64), whatever the count sent."""
        return len(self._sent)

    def full(self) -> str | None:
        """Why no cancel may be sent now (MAX_GHOSTS keys set aside await last answers), or None."""
        if len(self.ghosts) < MAX_GHOSTS:
            return None
        return f"{len(self.ghosts)} cancels set aside still await answers (at most {MAX_GHOSTS})"

    def holds(self, key: Key) -> bool:
        """Whether answers may still come for `key`: cancels await them, or it was set aside."""
        return key in self.awaiting or key in self.ghosts

    def ghost(self, key: Key) -> bool:
        """Whether `key` was set aside and awaits last answers."""
        return key in self.ghosts

    def answers(self, addr: Address) -> bool:
        """Whether the encode rank at `addr` was seen to answer cancels (on its current connection or before)."""
        return addr in self._answering

    def silent(self, addr: Address, now: float) -> bool:
        """Whether `addr` left a cancel unanswered CANCEL_SILENCE_S, not being known to answer them."""
        since = self._unanswered_since.get(addr)
        return since is not None and now - since >= CANCEL_SILENCE_S and addr not in self._answering

    def stranger(self, key: Key, addr: Address, conn: int) -> bool:
        """Whether cancels of `key` await answers from elsewhere than connection `conn` to `addr` (another
        address, or an earlier connection), whose answers would be taken for one sent there."""
        awaiting = self.awaiting.get(key)
        if not awaiting:
            return False
        return awaiting[0].addr != addr or awaiting[-1].conn != conn

    def unanswered(self, key: Key, conn: int | None) -> Cancel | None:
        """The newest cancel of `key` sent on connection `conn` that got no answer at all yet."""
        for cancel in reversed(self.awaiting.get(key, ())):
            if not cancel.answered and cancel.conn == conn:
                return cancel
        return None

    def unanswered_anywhere(self, key: Key) -> bool:
        """Whether a cancel of `key` got no answer at all yet, on whatever connection it was sent."""
        awaiting = self.awaiting.get(key)
        return awaiting is not None and any(not cancel.answered for cancel in awaiting)

    def awaited_at(self, addr: Address, now: float) -> bool:
        """Whether a cancel sent on the current connection to `addr` within CANCEL_SILENCE_S is unanswered."""
        return addr in self.awaited_addresses(now)

    def awaited_addresses(self, now: float) -> set[Address]:
        """The addresses `awaited_at()` holds for."""
        current = self._current_conn
        return {cancel.addr for cancels in self.awaiting.values() for cancel in cancels
                if not cancel.answered and current(cancel.addr) == cancel.conn
                and now - cancel.sent_at < CANCEL_SILENCE_S}

    # ------------------------------------------------------------- events

    def add(self, now: float, key: Key, token: int, addr: Address, conn: int) -> Key | None:
        """Files a cancel sent now; returns the oldest key, to set aside, once more than MAX_PENDING_CANCELS
        await answers."""
        cancel = Cancel(token, addr, conn, now)
        self.awaiting.setdefault(key, []).append(cancel)
        self._sent.append((now, key, cancel))
        if len(self._sent) > self._sent_compact_at:
            kept = [entry for entry in self._sent if not entry[2].gone]
            self._sent.clear()  # in place: set_aside_stale() may be going through it
            self._sent.extend(kept)
            self._sent_compact_at = max(_MIN_COMPACT, 2 * len(self._sent))
        self._sent_to.setdefault(addr, _SentCancels()).add(cancel)
        self._unanswered_since.setdefault(addr, now)
        self._count += 1
        return next(iter(self.awaiting)) if self._count > MAX_PENDING_CANCELS else None

    def answered(self, key: Key, answer: CancelAnswer) -> Cancel | None:
        """An answer for `key`: the cancel it answers, forgotten on its last answer; None for a ghost's
        answer, or a TOO_LATE when every cancel of `key` was answered already."""
        cancels = self.awaiting.get(key)
        if not cancels:
            self._ghost_answered(key, answer)
            return None
        if answer is CancelAnswer.TOO_LATE:  # its last answer follows once the write is over
            cancel = next((cancel for cancel in cancels if not cancel.answered), None)
            if cancel is None:
                return None
        else:
            cancel = cancels[0]
            self._drop(key, cancel)
        self._heard(cancel)
        return cancel

    def unsent(self, key: Key, token: int) -> Cancel | None:
        """The socket did not take the cancel of `key` for `token`: it awaits no answer and says nothing of
        its address's silence. The cancel, or None when none such awaits an answer."""
        for cancel in self.awaiting.get(key, ()):
            if cancel.token == token and not cancel.answered:
                self._drop(key, cancel)
                self.restart_silence(cancel.addr)
                return cancel
        return None

    def set_aside(self, key: Key) -> None:
        """Sets every cancel of `key` aside as a ghost that takes their answers still to come."""
        cancels = self.awaiting.pop(key)
        for cancel in cancels:
            cancel.gone = True
        self._count -= len(cancels)
        self.ghosts[key] = self.ghosts.get(key, 0) + len(cancels)

    def set_aside_stale(self, now: float, limit: int | None, released: Callable[[Key], list]) -> list:
        """Sets aside the keys of cancels sent STALE_CANCEL_S ago on a connection since lost, at most `limit`
        of them, each followed by `released(key)`'s actions; looks again later at one whose connection is
        still in use. Past twice MAX_PENDING_CANCELS sent, the oldest is set aside whatever its age."""
        sent = self._sent
        actions: list = []
        silent: set[Address] = set()
        again = []
        set_aside = 0
        while sent and (limit is None or set_aside < limit):
            sent_at, key, cancel = sent[0]
            crowded = len(sent) > 2 * MAX_PENDING_CANCELS
            if now - sent_at < STALE_CANCEL_S and not crowded:
                break
            sent.popleft()
            if not any(pending is cancel for pending in self.awaiting.get(key, ())):
                continue  # its last answer came
            if self._current_conn(cancel.addr) == cancel.conn and not crowded:
                again.append((now, key, cancel))
                continue
            silent.add(cancel.addr)
            set_aside += 1
            self.set_aside(key)
            actions += released(key)
        sent.extend(again)
        for addr in silent:
            self.restart_silence(addr)
        return actions

    def restart_silence(self, addr: Address) -> None:
        """The silence clock of `addr` from its oldest cancel still unanswered on its current connection,
        if any (one sent on a connection since lost may never have been read)."""
        sent = self._sent_to.get(addr)
        oldest = None if sent is None else sent.oldest(self._current_conn(addr))
        if oldest is not None:
            self._unanswered_since[addr] = oldest.sent_at
        else:
            self._unanswered_since.pop(addr, None)
            self._sent_to.pop(addr, None)

    def forget(self, addr: Address, *, answering: bool = False) -> None:
        """The connection to `addr` is gone: its silence clock stops, with the cancels sent there that kept it
        (each was sent on that connection or an earlier one, and a silence clock counts on a later one only),
        and with `answering` what it showed of answering cancels goes too (a rank restarted there shows it
        afresh). Cancels still awaiting answers stay awaited, by (room, encode rank)."""
        self._unanswered_since.pop(addr, None)
        self._sent_to.pop(addr, None)
        if answering:
            self._answering.pop(addr, None)

    # ---------------------------------------------------------- internals

    def _drop(self, key: Key, cancel: Cancel) -> None:
        """Forgets one cancel awaiting its answer under `key`."""
        cancels = self.awaiting[key]
        cancels.remove(cancel)
        cancel.gone = True
        if not cancels:
            del self.awaiting[key]
        self._count -= 1

    def _ghost_answered(self, key: Key, answer: CancelAnswer) -> None:
        """An answer for a key set aside: a last answer leaves one fewer."""
        left = self.ghosts.get(key)
        if left is None or answer is CancelAnswer.TOO_LATE:
            return
        if left > 1:
            self.ghosts[key] = left - 1
        else:
            del self.ghosts[key]

    def _heard(self, cancel: Cancel) -> None:
        """A cancel got its first answer (or its last): its encode rank answers cancels."""
        cancel.answered = True
        self._unanswered_since.pop(cancel.addr, None)
        answering = self._answering
        if cancel.addr in answering:
            del answering[cancel.addr]  # moved to the end: heard from most recently
        elif len(answering) >= MAX_ANSWERING:
            del answering[next(iter(answering))]  # the one heard from longest ago
        answering[cancel.addr] = None

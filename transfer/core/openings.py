"""Which peer sessions a Mooncake engine may write to now: a new peer's handshake is probed first.

Mooncake opens a new peer's segment (its handshake with the peer) inside the write call,
holding a lock that every write of the engine takes, and waits up to 60 s for an answer.
A peer that accepts connections and never answers (a stopped or wedged process) would
stall every write to every peer. So a session's writes go to Mooncake only once its
segment is open or a probe of its handshake port answered; until then they wait, for at
most the open bound, and then fail. The probe runs on a thread of its own and holds no
lock the writes need.

The bound is the peer's time, not the prober's: when the prober's own process was held up
(stopped, swapped out, starved of CPU) the probe's thread and the peer's answer were held up
with it. The engine says so (`held_up`: how long it saw no poll before this one), and the
part of the probe's wait that hold-up covers is not counted, once per probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Openings", "Probe", "Verdict"]

#: How long a new session's writes wait for the answer to its probe before failing.
OPEN_TIMEOUT_S = 5.0

#: Probes in flight at once (each holds a thread until the peer answers, or up to 60 s).
MAX_PROBING = 64

#: Sessions remembered as open (the oldest is forgotten first: its next write probes again).
MAX_OPEN = 65536


class Verdict(Enum):
    """What a write to a session may do now."""

    GO = "go"  # hand it to Mooncake
    PROBE = "probe"  # start the probe returned with it, then wait for its answer
    WAIT = "wait"  # a probe is out: wait for its answer
    REFUSE = "refuse"  # fail it, with the detail returned


@dataclass(eq=False)
class Probe:
    """One probe of a session's handshake port: when it went out and how it ended."""

    session: str
    started: float
    done: bool = False
    took: float = 0.0
    #: Seconds of its wait the prober's own process was held up, not counted against the bound (set once).
    held_up: float = 0.0


class Openings:
    """Sessions whose segment is open, probes in flight, and the rule for each write."""

    def __init__(self, *, open_timeout_s: float = OPEN_TIMEOUT_S, max_probing: int = MAX_PROBING,
                 max_open: int = MAX_OPEN) -> None:
        self.open_timeout_s = open_timeout_s
        self.max_probing = max_probing
        self.max_open = max_open
        #: Sessions whose segment is open, oldest first: the engine reads it (a write's `in`, no call); only this
        #: class changes it.
        self.open_sessions: dict[str, None] = {}
        self._probing: dict[str, Probe] = {}

    def admit(self, session: str, now: float, held_up: float = 0.0) -> tuple[Verdict, Probe | None, str]:
        """A new write to `session`: (verdict, the probe it waits on, why it is refused); `held_up` as for verdict()."""
        if session in self.open_sessions:
            return Verdict.GO, None, ""
        probe = self._probing.get(session)
        if probe is not None:
            verdict, why = self.verdict(probe, now, held_up)
            return verdict, probe, why
        if len(self._probing) >= self.max_probing:
            return Verdict.REFUSE, None, (
                f"{len(self._probing)} new peers are being probed already, none answering yet "
                f"(at most {self.max_probing} at once): stopped or unreachable processes?")
        probe = Probe(session, now)
        self._probing[session] = probe
        return Verdict.PROBE, probe, ""

    def verdict(self, probe: Probe, now: float, held_up: float = 0.0) -> tuple[Verdict, str]:
        """What a write waiting on `probe` may do now: GO, WAIT, or REFUSE with why.

        `held_up`: the prober's own process may have been held up for the last `held_up` seconds
        (its caller saw no poll meanwhile; 0: it was not). A wait that would be refused does not
        count the part of it that hold-up covers, once per probe: a peer that answers once the
        process runs again is not refused for time that was not its own, and a silent one is
        refused within one bound of the hold-up's end, however long it was.
        """
        verdict, why = self._judge(probe, now)
        if verdict is Verdict.REFUSE and held_up > 0 and probe.held_up == 0:
            end = probe.started + probe.took if probe.done else now
            covered = min(end, now) - max(probe.started, now - held_up)
            probe.held_up = max(0.0, covered)
            verdict, why = self._judge(probe, now)
        return verdict, why

    def _judge(self, probe: Probe, now: float) -> tuple[Verdict, str]:
        """The verdict on `probe` at `now`, its prober's hold-up discounted."""
        waited = (probe.took if probe.done else now - probe.started) - probe.held_up
        if waited <= self.open_timeout_s:
            # Returned within the bound: a reply, or a refusal as quick as Mooncake's own handshake would get.
            return (Verdict.GO if probe.done else Verdict.WAIT), ""
        held = f", {probe.held_up:.1f}s of which this process was held up" if probe.held_up else ""
        return Verdict.REFUSE, (
            f"its Mooncake handshake port did not answer within {self.open_timeout_s:g}s "
            f"(probed {now - probe.started:.1f}s ago{held}): a stopped, wedged or unreachable process? "
            f"Its writes are held back, as Mooncake's own handshake with it would block every write "
            f"of this engine for up to 60 s")

    def answered(self, probe: Probe, replied: bool, now: float) -> None:
        """The probe returned; `replied`: the peer answered it (else it failed, e.g. refused).

        Within the bound either lets the writes waiting on it go to Mooncake: a peer that
        refused the probe (a closed port, an older Mooncake without probes) answers
        Mooncake's handshake quickly too. A reply marks the session open, also after the
        bound (the peer came back); a failure leaves it to the next write to probe again.
        """
        probe.done, probe.took = True, now - probe.started
        if self._probing.get(probe.session) is probe:
            del self._probing[probe.session]
        if replied:
            self.opened(probe.session)

    def opened(self, session: str) -> None:
        """The session's segment is open (a probe answered, or Mooncake accepted a write to it)."""
        if session in self.open_sessions:  # mostly (every write says so): moved to the newest end, no more open
            del self.open_sessions[session]
            self.open_sessions[session] = None
            return
        self.open_sessions[session] = None
        while len(self.open_sessions) > self.max_open:
            del self.open_sessions[next(iter(self.open_sessions))]

    def forget(self, session: str) -> None:
        """The session is gone (its peer left): its next write probes again."""
        self.open_sessions.pop(session, None)

    def is_open(self, session: str) -> bool:
        """Whether writes to `session` go to Mooncake at once."""
        return session in self.open_sessions

    def probing(self) -> int:
        """Probes in flight."""
        return len(self._probing)

"""The `EPD_*` environment variables: one table of what each sets, its default, and its check.

An environment variable only supplies a default: an argument given to the constructor
(or an option given on the command line) always wins. A value that does not parse, or
is out of range, raises `ConfigError` naming the variable and the value when the
component that reads it is constructed (a number takes ASCII digits only). An empty
value counts as unset.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from transfer.core.parked import MAX_PARKED_BYTES
from transfer.errors import ConfigError, ConfigTypeError

__all__ = [
    "MAX_POLL_S", "SETTINGS", "Setting", "check_flag", "check_polls", "check_seconds", "parse_seconds", "renamed", "resolve", "setting",
]


#: The longest wait a setting may ask for: every wait goes down to poll()s and socket timeouts in
#: milliseconds, whose C ints end at about 24 days.
MAX_SECONDS = 1e6

#: The largest count and number of bytes a setting may ask for.
MAX_COUNT = (1 << 31) - 1
MAX_BYTES = (1 << 63) - 1

#: The longest wait between polls of writes in flight: a finished write waits that long to be noticed.
MAX_POLL_S = 1.0


def _number(text: str, kind: Callable[[str], Any]) -> Any:
    """`text` as an int or float of ASCII digits: int() and float() take any script's digits ("٣" is 3)."""
    if not text.isascii():
        raise ValueError
    return kind(text)


def _seconds(text: str) -> float:
    value = _number(text, float)
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise ValueError
    return value


def _non_negative_seconds(text: str) -> float:
    value = _number(text, float)
    if not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
        raise ValueError
    return value + 0.0  # -0 is 0


def _count(text: str) -> int:
    value = _number(text, int)
    if not 1 <= value <= MAX_COUNT:
        raise ValueError
    return value


def _bytes(text: str) -> int:
    value = _number(text, int)
    if not 1 <= value <= MAX_BYTES:
        raise ValueError
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError


def _text(text: str) -> str:
    return text


# What each kind of value must be: (parser of the environment's text, its description).
_KINDS: dict[str, tuple[Callable[[str], Any], str]] = {
    "seconds": (_seconds, f"a positive number of seconds up to {MAX_SECONDS:.0f}"),
    "seconds0": (_non_negative_seconds, f"a non-negative number of seconds up to {MAX_SECONDS:.0f}"),
    "count": (_count, f"a positive integer up to {MAX_COUNT}"),
    "bytes": (_bytes, f"a positive number of bytes up to {MAX_BYTES}"),
    "flag": (_flag, "one of 1, 0, true, false, yes, no, on, off"),
    "text": (_text, "text"),
}


@dataclass(frozen=True)
class Setting:
    """One environment variable: the argument it defaults ('' for none), where, its default, and what it bounds."""

    env: str
    argument: str
    component: str
    default: Any
    kind: str
    bounds: str

    def parse(self, text: str) -> Any:
        """The environment's `text` as this setting's value, or ConfigError naming the variable and value."""
        parser, what = _KINDS[self.kind]
        try:
            return parser(text)
        except (TypeError, ValueError):
            raise ConfigError(f"{self.env}={text!r} is not {what} ({self.where}: {self.bounds})") from None

    @property
    def where(self) -> str:
        """The component and the argument it defaults, in words."""
        return f"{self.component} {self.argument}" if self.argument else self.component

    def default_text(self) -> str:
        """The default as the README's table shows it."""
        value = self.default
        if value is None:
            return "unset"
        if self.kind in ("seconds", "seconds0"):
            if 0 < value < 1e-3:
                return f"{value * 1e6:g} us"
            if 0 < value < 1:
                return f"{value * 1e3:g} ms"
            return f"{value:g} s"
        if self.kind == "bytes" and value % (1 << 20) == 0:
            return f"{value >> 20} MiB"
        if self.kind == "flag":
            return "1" if value else "0"
        return str(value)

    def check(self, value: Any) -> Any:
        """An argument given in code, checked like the environment's text; ConfigError naming the argument
        (ConfigTypeError for one that is not a number of the setting's kind, or not a bool for a flag)."""
        if self.kind == "text":
            return value
        if self.kind == "flag":
            if not isinstance(value, bool):
                raise ConfigTypeError(f"{self.argument}={value!r} must be True or False")
            return value
        parser, what = _KINDS[self.kind]
        integral = self.kind in ("count", "bytes")
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if integral else numbers.Real):
            raise ConfigTypeError(f"{self.argument}={value!r} is not {what}")
        try:
            return parser(str(int(value) if integral and isinstance(value, numbers.Integral) else float(value)))
        except (ValueError, OverflowError):
            raise ConfigError(f"{self.argument}={value!r} is not {what}") from None


#: Every variable the library and its command line read, in the README's order.
SETTINGS: tuple[Setting, ...] = (
    Setting("EPD_DEADLINE_S", "deadline_s", "SessionManager", 60.0, "seconds",
            "each room, from receive() to its conclusion (also `demo`/`rank --deadline`)"),
    Setting("EPD_LOOKUP_TIMEOUT_S", "lookup_timeout_s", "SessionManager", 2.0, "seconds",
            "one bootstrap look-up of an encode rank"),
    Setting("EPD_FANOUT_TIMEOUT_S", "fanout_timeout_s", "SenderPool", 120.0, "seconds",
            "waiting for a room's whole fanout to ask, and for a write to start after the first ask "
            "(also `rank --bootstrap-timeout`)"),
    Setting("EPD_REGISTER_TIMEOUT_S", "register_timeout_s", "SenderPool", 30.0, "seconds",
            "registering with the bootstrap server at construction (an encode `rank` registers for its "
            "--bootstrap-timeout)"),
    Setting("EPD_SEND_DEPTH", "depth", "SenderPool", 32, "count",
            "receiver shard writes in flight at once"),
    Setting("EPD_MAX_PARKED_BYTES", "max_parked_bytes", "SenderPool", MAX_PARKED_BYTES, "bytes",
            "asks held for items not sent yet (past it the oldest room's asks are told Failed)"),
    Setting("EPD_POLL_MIN_S", "poll_min_s", "SenderPool", 100e-6, "seconds",
            "the shortest wait between polls of writes in flight (Mooncake has no completion callback): "
            "writes of at most 1 MiB are polled at it for their first 2 ms, others first after it, then "
            "at doubling waits up to EPD_POLL_MAX_S; on RDMA, about a small write's time"),
    Setting("EPD_POLL_MAX_S", "poll_max_s", "SenderPool", 1e-3, "seconds",
            "the longest wait between polls of writes in flight (at most 1 s)"),
    Setting("EPD_CLOSE_TIMEOUT_S", "close_timeout_s", "SenderPool and SessionManager", 10.0, "seconds",
            "the whole close(): withdrawing the route, waiting for writes in flight, stopping the thread; "
            "writes still in flight then are abandoned, their rooms failed; on the prefill side, look-ups "
            "still under way are left to end alone (keep it under a supervisor's stop grace, 30 s in "
            "Kubernetes)"),
    # Two fanout timeouts and a transfer timeout, 10 s spare (why: transfer.buffers.QUARANTINE_S).
    Setting("EPD_QUARANTINE_S", "quarantine_s", "ReceivePool", 2 * 120.0 + 30.0 + 10.0, "seconds0",
            "how long a failed room's slot is held back unless its cancel is confirmed"),
    Setting("EPD_FALLBACK_GRACE_S", "grace_s", "ReceivePool", 30.0, "seconds0",
            "how long an idle fallback buffer is kept for reuse"),
    Setting("EPD_ZMQ_SCHED_BATCH", "", "the library's ZMQ I/O thread", True, "flag",
            "runs it under SCHED_BATCH, so waking it never preempts the engine's thread (0: the default policy)"),
    Setting("EPD_ZMQ_TCP_TIMEOUT_S", "", "the library's ZMQ connections (asks and statuses)", 10.0, "seconds0",
            "how long one may hold data the peer's host has not acknowledged, or take to connect (at most "
            "2 s an attempt), before it is dropped and made afresh: a link that went dead is left then, not "
            "waited on through TCP's retransmission back-off once it is back; what the dropped one still "
            "held is lost (0: the OS's bounds, about 15 minutes and 2 minutes)"),
    Setting("EPD_MOONCAKE_DIRECT", "", "the Engine's Mooncake calls", True, "flag",
            "submits writes and reads their status from C on the Mooncake wheels checked (0: through its binding)"),
    Setting("EPD_TOKEN", "--token", "epd-transfer bootstrap/rank", None, "text",
            "the bearer token the bootstrap server requires for registrations"),
    Setting("EPD_DEVICE", "--device", "epd-transfer rank", None, "text",
            "Mooncake's RDMA device(s), comma-separated, e.g. mlx5_0,mlx5_1 (unset: every device found)"),
)

_BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS}


def setting(env: str) -> Setting:
    """The Setting of one variable (KeyError for a name not in the table)."""
    return _BY_ENV[env]


def resolve(env: str, given: Any = None, environ: Mapping[str, str] | None = None) -> Any:
    """`given` (checked) when not None, else the variable's value from `environ` (default
    os.environ), else the documented default."""
    entry = _BY_ENV[env]
    if given is not None:
        return entry.check(given)
    text = (os.environ if environ is None else environ).get(env, "")
    if text == "":
        return entry.default
    return entry.parse(text)


def is_set(env: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the variable is set to something (an empty value means its default)."""
    return (os.environ if environ is None else environ).get(env, "") != ""


def parse_seconds(text: str, zero_ok: bool = False) -> float:
    """`text` as seconds in (0, MAX_SECONDS] ([0, MAX_SECONDS] with `zero_ok`), else ConfigError
    whose text says what it must be."""
    parser, what = _KINDS["seconds0" if zero_ok else "seconds"]
    try:
        return parser(text)
    except ValueError:
        raise ConfigError(what) from None


def check_seconds(argument: str, value: Any, zero_ok: bool = False) -> float:
    """`value` as seconds if it is a real number in (0, MAX_SECONDS] ([0, ...] with `zero_ok`):
    ConfigTypeError for another type, ConfigError naming `argument` otherwise."""
    kind = type(value)
    if (kind is float or kind is int) and (0 <= value if zero_ok else 0 < value) and value <= MAX_SECONDS:
        return value + 0.0  # a plain number in range, read as the text below would be (-0 is 0)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigTypeError(f"{argument}={value!r} is not {_KINDS['seconds0' if zero_ok else 'seconds'][1]}")
    try:
        text = str(float(value))
    except OverflowError:
        text = "inf"  # too large for a float: refused as infinity is
    try:
        return parse_seconds(text, zero_ok)
    except ValueError as what:
        raise ConfigError(f"{argument}={value!r} is not {what}") from None


def check_flag(owner: str, argument: str, value: Any) -> bool:
    """`value` if it is True or False, else ConfigTypeError (a string such as "no" would count as True)."""
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{owner}: {argument}={value!r} must be True or False")
    return value


#: What a sender pool or session manager uses of its engine first: an object without them is no engine.
ENGINE_MEMBERS = ("session_id", "register", "registered")


def check_engine(owner: str, engine: Any, members: tuple[str, ...] = ENGINE_MEMBERS) -> None:
    """ConfigTypeError unless `engine` has `members`, as a transfer engine does (transfer.engine.Engine,
    transfer.wire_engine.WireEngine, or one like them: transfer.interfaces.TransferEngineLike)."""
    missing = [name for name in members if not hasattr(engine, name)]
    if missing:
        has = ", ".join(f"{name}()" if name != "session_id" else name for name in members)
        raise ConfigTypeError(f"{owner}: engine must be a transfer engine (transfer.engine.Engine, "
                              f"transfer.wire_engine.WireEngine, or one with {has}), got {type(engine).__name__}"
                              + ("" if engine is None else f" without {', '.join(missing)}"))


def check_polls(owner: str, poll_min_s: float, poll_max_s: float) -> None:
    """ConfigError unless poll_min_s <= poll_max_s <= MAX_POLL_S (both checked as settings already)."""
    if poll_max_s > MAX_POLL_S:
        raise ConfigError(f"{owner}: poll_max_s (EPD_POLL_MAX_S) is {poll_max_s:g} s; at most "
                          f"{MAX_POLL_S:g} s, or a finished write waits that long to be noticed")
    if poll_min_s > poll_max_s:
        raise ConfigError(f"{owner}: poll_min_s (EPD_POLL_MIN_S) {poll_min_s:g} s is above poll_max_s "
                          f"(EPD_POLL_MAX_S) {poll_max_s:g} s")


def renamed(owner: str, old: str, old_value: Any, new: str, new_value: Any, stacklevel: int = 3) -> Any:
    """The value of a renamed keyword: the new one, or the old one with a DeprecationWarning.

    Both given is refused (ConfigError): which one was meant cannot be told.
    """
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ConfigError(f"{owner}: give {new}= only ({old}= is its deprecated name), not both")
    warnings.warn(f"{owner}({old}=) is deprecated: use {new}=", DeprecationWarning, stacklevel=stacklevel)
    return old_value

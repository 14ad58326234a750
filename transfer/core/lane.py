"""Lanes: the statuses a prefill driver may settle without the room rules' general path.

A prefill core grants a room a lane (`PrefillCore.lanes[room] = encode rank`) when its ask
goes out in the plain case: integrity checks off, no earlier ask of the same room number whose
statuses could pass for this one's (no cancel of it unanswered, none set aside, none given up
without a cancel). Then the only thing left to happen to the room in the plain case is its
encode rank's Success, and what the core would do with it is fixed: note that the rank
answered, and conclude the room Success. The core takes the lane back on anything else that
happens to the room (any other status for it, a cancel's answer, a deadline, clear(), a
connection's loss that puts its ask back in a queue).

`settles` says which messages are such a Success. It is the rule the native status intake
(`_native.lane_take`, `lane_match`) applies to each message it reads, in arrival order; it
stops at the first message that is not one and hands it to the general path, so a lane's
Success is never taken ahead of an earlier message about its room. Anything `settles` turns
down goes the general path, which gives the same outcome for it, only at its own cost: the
rule may refuse more than it needs to (a number with more than 19 digits, a checksum part
that is not plain digits), never less.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from transfer.frames import MAX_CHECKSUMS, STATUS_PARTS
from transfer.status import TransferPoll

__all__ = ["MAX_DIGITS", "settles"]

_I64_MAX = (1 << 63) - 1
_U64_MAX = (1 << 64) - 1

#: Most digits of a room, status or rank number a lane reads (19: every such number fits in an
#: int64, which SPEC.md's numbers must); a checksum part may have one more (a u64).
MAX_DIGITS = 19


def _plain(part: object, most: int = MAX_DIGITS, largest: int = _I64_MAX) -> int | None:
    """The number a part holds when it is `bytes` of 1 to `most` ASCII digits, at most `largest`, else None."""
    if type(part) is not bytes or not 0 < len(part) <= most or not part.isdigit():
        return None
    value = int(part)
    return value if value <= largest else None


def settles(parts: Sequence[object], lanes: Mapping[int, int]) -> int | None:
    """The room whose lane this message settles, or None (it goes the general path).

    It settles a room when it is a plain Success (3 parts of plain digits, with up to
    MAX_CHECKSUMS checksum parts of plain digits after them, which a lane does not read: lanes
    exist only with integrity checks off, but a checksum past a u64 is not plain) of a room in
    `lanes`, from the encode rank its lane names. Room and rank numbers are at most int64's."""
    if type(parts) is not list or not STATUS_PARTS <= len(parts) <= STATUS_PARTS + MAX_CHECKSUMS:
        return None
    room, code, rank = (_plain(part) for part in parts[:STATUS_PARTS])
    if room is None or code != TransferPoll.Success or rank is None:
        return None
    if any(_plain(part, MAX_DIGITS + 1, _U64_MAX) is None for part in parts[STATUS_PARTS:]):
        return None
    lane = lanes.get(room)
    return room if lane is not None and lane == rank else None

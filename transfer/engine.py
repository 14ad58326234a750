"""The one place that touches mooncake.engine: start, register memory, batch writes.

GIL notes, from Mooncake's pybind layer (mooncake-integration/transfer_engine/
transfer_engine_py.cpp in kvcache-ai/Mooncake):

- `batch_transfer_sync_write`, `batch_transfer_async_write`,
  `get_batch_transfer_status`, `transfer_sync_*`, `batch_register_memory` and
  `batch_unregister_memory` open a `gil_scoped_release` first, so a write
  (including the handshake with a new peer, `openSegment`) never holds the GIL:
  other Python threads keep running while one thread blocks in a write.
- `initialize`, `register_memory` and `unregister_memory` keep the GIL; they are
  short (no network I/O) and happen once per buffer, so that is acceptable.
- A sync write blocks for at most Mooncake's transfer timeout
  (`MC_TRANSFER_TIMEOUT` seconds, default 30, minimum 5, plus 1 ns per byte).
- `get_batch_transfer_status` takes no timeout of its own and spins a core until
  every batch completes, fails, or passes that same transfer timeout. On two cores
  that spinning thread starves the transport, so `wait()` polls the non-blocking
  `transfer_check_status` with a short, growing sleep instead.
- A write to a session whose segment is not open yet opens it first
  (`openSegment`: a metadata exchange over the peer's handshake port) while holding
  the binding's one mutex, which every write takes; the exchange waits up to 60 s for
  an answer (a fixed SO_RCVTIMEO in the socket handshake plugin; only connect() is
  bounded, by MC_HANDSHAKE_CONNECT_TIMEOUT). A peer that accepts connections and never
  answers (a stopped process: its kernel still accepts) would stall every write of the
  engine, so a new session's writes wait until `send_probe` (which releases the GIL
  and takes no lock the writes need) got an answer from it on a thread of its own,
  for at most the open timeout (core/openings.py). `get_first_buffer_address` would
  open the segment without the mutex but keeps the GIL throughout.
- `transfer_check_status` has no deadline at all: a batch to a peer that stopped
  reading (a stopped or wedged process whose socket stays open) reads "in flight"
  for as long as the peer stays that way, and its TIMEOUT answer (-2, only with
  `MC_SLICE_TIMEOUT` set) is a warning, not an outcome: the batch still completes or
  fails later. So poll() applies the transfer timeout itself, and a batch that
  outlives it keeps its source memory pinned (unregister() refuses it) until
  Mooncake settles it or close() destroys the transport.

Direct calls: on the Mooncake wheel versions native/mooncake.c was checked against
(DIRECT_CALLS_CHECKED; `EPD_MOONCAKE_DIRECT=0` turns them off), a session's writes after
the first are submitted, and every write's status read, from C on the engine the binding
holds (`get_engine_ptr`): the same TransferEngine methods the binding calls
(docs/performance-log.md, "Kept: Mooncake's calls from C"); the submission lets go of the GIL,
as the binding's does, the status reads keep it. The first write to a
session still goes through the binding, whose handshake (`openSegment`) may block; its
segment handle is then looked up from Mooncake's cache. `calls` says which way an engine's calls go, `calls_reason` why.
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import logging
import math
import operator
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from transfer import _forks
from transfer._forks import forks
from transfer.config import check_seconds, resolve
from transfer.core.openings import OPEN_TIMEOUT_S, Openings, Probe, Verdict
from transfer.core.registrations import Registrations
from transfer.errors import ConfigError, ConfigTypeError, EngineError, EngineUnavailable, UsageError
from transfer.ports import bare_host, is_wildcard

try:  # the direct Mooncake calls; without the extension every call goes through the binding
    from transfer import _native
except ImportError:  # pragma: no cover - the package is built with it
    _native = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

# Where the kernel lists RDMA devices; tests point this at a temporary folder.
INFINIBAND_SYSFS = "/sys/class/infiniband"

PROTOCOLS = ("rdma", "tcp")

# Mooncake's async API answers one of these batch ids when submission failed: 0, or
# -1 cast to u64, depending on its version.
_BAD_BATCH_IDS = (0, (1 << 64) - 1)

#: Mooncake's answer to unregistering an address it holds no registration at (ERR_ADDRESS_NOT_REGISTERED).
_ERR_ADDRESS_NOT_REGISTERED = -3

#: wait()'s sleep between polls grows from POLL_MIN_S to POLL_MAX_S.
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3

#: How long write_async() waits for a new peer's probe before leaving the write to poll():
#: a live peer answers within it, so a refusal is still raised at once.
FIRST_ANSWER_S = 0.05

#: A gap this long between two polls that found a write in flight says this process may have been held
#: up meanwhile (stopped, swapped out, starved of CPU), Mooncake's threads with it: a write found past
#: its deadline then is given that long again (at most its whole bound, in all) before it fails.
HELD_UP_S = 0.25

#: Overdue writes (reported failed at their deadline, still in Mooncake's hands) are read again once this many
#: are filed, and again whenever their number doubles since: those Mooncake settled meanwhile leave, their batches
#: freed. At most twice the overdue writes Mooncake still holds, plus this many, are kept, whether or not a
#: region is ever unregistered, at a bounded number of status reads per overdue write on average.
OVERDUE_CHECK_AT = 16

#: Highest address + 1: a region or a destination must end at or below it.
_ADDRESS_SPACE = 1 << 64

#: The Mooncake wheels, by version, whose TransferEngine native/mooncake.c was checked against
#: (its request, status and string layouts, and the methods' mangled names).
DIRECT_CALLS_CHECKED: dict[str, tuple[str, ...]] = {"mooncake-transfer-engine-non-cuda": ("0.3.13.post1",),
                                                   "mooncake-transfer-engine": ("0.3.13.post1",)}

#: The most segments whose handles an engine keeps for its direct calls; past it they are
#: forgotten and looked up again through the binding's next write.
MAX_HANDLES = 65536

#: Where the process stands with the direct calls once asked: (bound, why).
_direct_bound: tuple[bool, str] | None = None
_direct_lock = _forks.free_in_child(threading.Lock())


def direct_calls_verdict(installed: Mapping[str, str], wanted: bool, has_pointer: bool) -> tuple[bool, str]:
    """Whether an engine may call Mooncake from C, and why: `installed` maps each Mooncake
    distribution found to its version, `wanted` is EPD_MOONCAKE_DIRECT, `has_pointer` whether
    the binding offers get_engine_ptr."""
    if not wanted:
        return False, "EPD_MOONCAKE_DIRECT=0"
    if not has_pointer:
        return False, "this Mooncake binding has no get_engine_ptr"
    if not installed:
        return False, "none of the Mooncake wheels the direct calls were checked against is installed"
    if len(installed) > 1:
        found = ", ".join(f"{name} {version}" for name, version in sorted(installed.items()))
        return False, f"two Mooncake wheels installed ({found})"
    (name, version), = installed.items()
    if version not in DIRECT_CALLS_CHECKED.get(name, ()):
        checked = ", ".join(f"{n} {v}" for n, vs in DIRECT_CALLS_CHECKED.items() for v in vs)
        return False, f"{name} {version} is not a version the direct calls were checked against ({checked})"
    return True, f"{name} {version}"


#: The Mooncake wheels built without CUDA: their tcp transport reads and writes every address as host memory.
HOST_ONLY_WHEELS = ("mooncake-transfer-engine-non-cuda",)


def device_memory_refusal(installed: Mapping[str, str], protocol: str, device: str) -> str | None:
    """Why memory on `device` (a torch device's name, not the CPU) cannot be registered with an engine of
    `protocol` given the Mooncake wheels `installed` (name -> version), or None where it can.

    Over tcp, a build without CUDA copies the bytes itself, from and into the address as host
    memory: device memory there kills the process at the first write."""
    if protocol != "tcp" or not installed or any(name not in HOST_ONLY_WHEELS for name in installed):
        return None
    name, version = sorted(installed.items())[0]
    return (f"cannot register memory on {device} over tcp with {name} {version}, a Mooncake build without "
            f"CUDA: its copies would read and write the device address as host memory and kill the process; "
            f"install the CUDA build (pip uninstall {name} && pip install mooncake-transfer-engine), "
            f"or register host memory")


@functools.lru_cache(maxsize=1)
def _installed_mooncake() -> dict[str, str]:
    """The Mooncake transfer-engine distributions installed, by version (read once a process)."""
    from transfer.doctor import mooncake_distributions
    return {dist["name"]: dist["version"] for dist in mooncake_distributions()}


def _bind_direct(te: Any, mooncake_engine: Any) -> tuple[int, str]:
    """The engine's pointer for the direct calls (0 when they are off) and why."""
    global _direct_bound
    wanted = bool(resolve("EPD_MOONCAKE_DIRECT"))
    ok, why = direct_calls_verdict(_installed_mooncake(), wanted, callable(getattr(te, "get_engine_ptr", None)))
    if not ok:
        return 0, why
    with _direct_lock:
        if _direct_bound is None:
            try:
                if _native is None:
                    raise ImportError("transfer._native does not import")
                _native.mooncake_bind(mooncake_engine.__file__)
                _direct_bound = True, why
            except (ImportError, AttributeError, OSError) as exc:
                _direct_bound = False, f"Mooncake's methods not found: {exc}"
                log.warning("Mooncake's calls go through its Python binding: %s", _direct_bound[1])
        bound, why = _direct_bound
    return (int(te.get_engine_ptr()), why) if bound else (0, why)


def mooncake_transfer_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """Mooncake's transfer timeout, read as Mooncake reads it: 30 s where MC_TRANSFER_TIMEOUT is unset,
    else its leading whole number of seconds (C's atoi: "2.5" is 2, "abc" and "" are 0), at least 5."""
    text = (os.environ if environ is None else environ).get("MC_TRANSFER_TIMEOUT")
    if text is None:
        return 30.0
    leading = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)  # C's isspace and digits, not Unicode's
    return float(max(5, int(leading.group(1)) if leading else 0))


#: The range Mooncake takes its RPC and TCP-transport ports from where MC_MIN_RPC_PORT/MC_MAX_RPC_PORT give none
#: it takes.
MOONCAKE_PORTS = (15000, 17000)

#: The kernel's ephemeral port range where /proc does not say (Linux's default).
EPHEMERAL_PORTS = (32768, 60999)

#: The largest Mooncake port range whose ports a failed start counts, one bind each.
COUNTED_PORTS_MAX = 4096


def _c_int(text: str | None) -> int | None:
    """C's atoi() of an environment value ("2.5" is 2, "abc" is 0); None where it is unset."""
    if text is None:
        return None
    leading = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)  # C's isspace and digits, not Unicode's
    return int(leading.group(1)) if leading else 0


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range (EPHEMERAL_PORTS where it cannot be read)."""
    try:
        first, last = (int(word) for word in _read_text(path).split())
    except ValueError:
        return EPHEMERAL_PORTS
    return first, last


def mooncake_port_range(environ: Mapping[str, str] | None = None,
                        ephemeral: tuple[int, int] = EPHEMERAL_PORTS) -> tuple[int, int, str]:
    """The range Mooncake's engine takes its listeners' ports from, read as Mooncake 0.3.13 reads it, and how
    it came to be that range, in words: each end from MC_MIN_RPC_PORT / MC_MAX_RPC_PORT (else the older
    MC_MIN_PRC_PORT / MC_MAX_PRC_PORT, else MOONCAKE_PORTS), as C's atoi(); a range not within 1024-65535,
    ending below its start, or overlapping the kernel's `ephemeral` ports, is MOONCAKE_PORTS instead."""
    env = os.environ if environ is None else environ
    ends = []
    for end, default in (("MIN", MOONCAKE_PORTS[0]), ("MAX", MOONCAKE_PORTS[1])):
        named = next((name for name in (f"MC_{end}_RPC_PORT", f"MC_{end}_PRC_PORT") if name in env), None)
        value = _c_int(env.get(named)) if named is not None else None
        ends.append((default if value is None else value, named))
    (first, first_name), (last, last_name) = ends
    if first_name is None and last_name is None:
        return first, last, "Mooncake's default, MC_MIN_RPC_PORT/MC_MAX_RPC_PORT being unset"
    given = f"{first_name or 'the default'} {first} to {last_name or 'the default'} {last}"
    if not 1024 <= first <= last <= 65535 or (first <= ephemeral[1] and ephemeral[0] <= last):
        return (*MOONCAKE_PORTS, f"Mooncake's default, as {given} is no range it takes (it must lie within "
                                 f"1024-65535, outside the kernel's ephemeral ports {ephemeral[0]}-{ephemeral[1]})")
    return first, last, given


def ports_in_use(first: int, last: int) -> int:
    """How many ports of first..last something listens on or holds, on any interface (as Mooncake binds
    them): one bind each, with SO_REUSEADDR as a listener's."""
    taken = 0
    for port in range(first, last + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                taken += 1
    return taken


def start_failure_hint(protocol: str, first: int, last: int, how: str, in_use: int | None) -> str:
    """What to check after Mooncake refused to start an engine of `protocol` whose ports come from first..last
    (`how`: where that range comes from) with `in_use` of them taken (None: not counted)."""
    need = 2 if protocol == "tcp" else 1  # its RPC listener, and on tcp its TCP-transport listener
    ports = last - first + 1
    free = None if in_use is None else ports - in_use
    if free is not None and free < need:
        listeners = "its RPC and TCP-transport listeners need two free ports" if need == 2 else \
            "its RPC listener needs a free port"
        what = f"the range has only {ports} port" if ports < need else f"{in_use} of its {ports} ports are in use"
        return (f"{listeners} of {first}-{last} ({how}), and {what}: set MC_MIN_RPC_PORT/MC_MAX_RPC_PORT to a "
                f"range with {need} or more free ports (no single fixed port), or free its ports (ss -ltn 'sport "
                f">= :{first} and sport <= :{last}'); Mooncake's log lines above say more")
    return f"Mooncake's log lines above say why (its ports come from {first}-{last}, {how})"


#: The range Mooncake took its ports from in this process (mooncake_port_range()): it reads the environment once,
#: when the process's first engine starts.
_mooncake_ports: tuple[int, int, str] | None = None


def _started_port_range() -> tuple[int, int, str]:
    """mooncake_port_range() as it was when this process's first engine started (called before each start)."""
    global _mooncake_ports
    if _mooncake_ports is None:
        _mooncake_ports = mooncake_port_range(ephemeral=ephemeral_ports())
    return _mooncake_ports


def _start_failure_hint(protocol: str) -> str:
    """start_failure_hint() for the range this process's engines take their ports from, counting its ports where
    it is not too long."""
    first, last, how = _started_port_range()
    in_use = ports_in_use(first, last) if last - first + 1 <= COUNTED_PORTS_MAX else None
    return start_failure_hint(protocol, first, last, how, in_use)


_PLAIN = (list, tuple)  # sequences check_batch reads without checking they are sequences


def check_batch(session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
                lengths: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """A write's buffers as ints, zero-length ones dropped; ConfigError for a batch no peer could take.

    Checked before any buffer goes out, not halfway through the batch (pybind's bare
    TypeError, or a wire peer refusing the transfer after a round trip).
    """
    plain = type(src_addrs) in _PLAIN and type(dst_addrs) in _PLAIN and type(lengths) in _PLAIN  # the drivers' are
    if plain:
        # The drivers' batches: as many exact ints each, none empty, each destination in range. _checked_batch
        # would build the same lists, buffer by buffer; any other batch goes on below (an exact int reads the
        # same twice). zip's strict=True compares the counts, which the three len() calls below do otherwise.
        try:
            for src, dst, length in zip(src_addrs, dst_addrs, lengths, strict=True):
                if not (type(src) is int and type(dst) is int and type(length) is int and length > 0
                        and 0 <= dst and dst + length <= _ADDRESS_SPACE):
                    break
            else:
                return list(src_addrs), list(dst_addrs), list(lengths)
        except ValueError:
            pass  # not as many of each: refused below
    else:
        for name, given in (("src_addrs", src_addrs), ("dst_addrs", dst_addrs), ("lengths", lengths)):
            if isinstance(given, (str, bytes)) or not hasattr(given, "__len__"):
                raise ConfigTypeError(f"write to {session_id}: {name} must be a sequence of ints, one per buffer, "
                                      f"got {type(given).__name__} {given!r:.40}: for one buffer pass [src], [dst], "
                                      f"[length]")
    if not (len(src_addrs) == len(dst_addrs) == len(lengths)):
        raise ConfigError(f"write to {session_id}: {len(src_addrs)} sources, "
                          f"{len(dst_addrs)} destinations, {len(lengths)} lengths")
    return _checked_batch(session_id, src_addrs, dst_addrs, lengths)


def _checked_batch(session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
                   lengths: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """check_batch's work, buffer by buffer, for sequences of as many buffers each."""
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for index, given in enumerate(zip(src_addrs, dst_addrs, lengths)):
        src, dst, length = given
        if not (type(src) is int and type(dst) is int and type(length) is int):  # the drivers' are
            try:
                src, dst, length = (operator.index(value) for value in given)
            except TypeError:
                raise ConfigTypeError(f"write to {session_id}: buffer {index} is (source, destination, length) "
                                      f"{tuple(given)!r:.120}; each must be an int (an address or a byte count)"
                                      ) from None
        if length < 0:
            raise ConfigError(f"write to {session_id}: negative length {length}")
        if length == 0:
            continue
        if dst < 0 or dst + length > _ADDRESS_SPACE:
            raise ConfigError(f"write to {session_id}: destination {dst:#x} length {length} "
                              f"is not a range of the 64-bit address space")
        srcs.append(src)
        dsts.append(dst)
        lens.append(length)
    return srcs, dsts, lens


@dataclass
class _Pending:
    """An async write: its batches not yet settled, and what to say if it failed."""

    session_id: str
    srcs: list[int]
    dsts: list[int]
    lens: list[int]
    deadline: float = math.inf  # monotonic, set once handed to Mooncake: past it, poll() reports the write failed
    given_back: float = 0.0  # seconds added to the deadline for this process being held up (see HELD_UP_S)
    batches: list[int] = field(default_factory=list)
    error: str | None = None
    submitting: bool = True  # batches are still being handed to Mooncake (set and cleared under the engine lock)
    waiting: bool = False  # held back until its session's probe lets it go (set and cleared under the engine lock)
    probe: Probe | None = None  # the probe it waits on
    # A stop signal's exception cut its submission short: a batch Mooncake took may read its sources under an id
    # the call's answer would have given, until the transport goes.
    cut_short: bool = False
    # One poller at a time reads its batches' statuses (Mooncake frees a batch when it answers it is over):
    # the engine's writes share the engine's lock for that, none holding it while it waits.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reads(self, addr: int, nbytes: int) -> bool:
        """Whether one of its sources overlaps [addr, addr + nbytes)."""
        return any(src < addr + nbytes and addr < src + n for src, n in zip(self.srcs, self.lens))


#: EngineError under the name code may import from this module.
TransferError = EngineError


def _cuda_host() -> bool:
    """True when an NVIDIA driver is present (decides which wheel to suggest)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


def _unavailable_message(error: BaseException) -> str:
    """One message naming the wheel for this host and the Debian packages."""
    text = str(error)
    if _cuda_host():
        wheel = "pip install mooncake-transfer-engine  (or: pip install 'epd-transfer[cuda]')"
        host = "this host has an NVIDIA driver"
    else:
        wheel = ("pip install mooncake-transfer-engine-non-cuda  "
                 "(or: pip install 'epd-transfer[cpu]')")
        host = "this host has no NVIDIA driver"
    missing_lib = "libibverbs" in text or "libnuma" in text
    what = ("a system library that mooncake needs is missing" if missing_lib
            else "the mooncake module is not installed")
    return (f"cannot import mooncake.engine ({what}: {text}). "
            f"Install the wheel for this host ({host}): {wheel}; never install both the "
            f"CUDA and the non-CUDA wheel. Mooncake also needs the Debian packages: "
            f"apt-get install libibverbs1 libnuma1")


def _import_engine() -> Any:
    """Import mooncake.engine, turning any import failure into EngineUnavailable."""
    # Mooncake logs every completed batch at INFO: a stderr write per transfer on the
    # hot path. Keep warnings and errors unless the operator asked for more.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake import engine as mooncake_engine
    except ImportError as error:
        raise EngineUnavailable(_unavailable_message(error)) from error
    return mooncake_engine


def rdma_device_names(root: str | None = None) -> list[str]:
    """Sorted RDMA device names under the infiniband sysfs folder; [] when absent."""
    root = INFINIBAND_SYSFS if root is None else root
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


#: The longest name the kernel gives an RDMA device (IB_DEVICE_NAME_MAX, 64, less its NUL).
MAX_DEVICE_NAME_CHARS = 63

#: A character no RDMA device's name holds: whitespace, '/' (each name is a sysfs folder), and the '"' and '\\'
#: that Mooncake builds before 0.3 put inside a JSON string unescaped.
_NOT_IN_DEVICE_NAME = re.compile(r'[\s/"\\]')


def device_names(value: str, what: str = "device_name") -> str:
    """`value`, RDMA device names separated by commas, as Mooncake's initialize() is to get it: each name
    stripped of the whitespace around it, empty ones dropped, joined by ',' ("" for none: Mooncake then uses
    every device it finds). Mooncake splits the string at each ',' and uses a device only where its name
    equals a piece exactly, so " mlx5_1" as given would match no device.

    ConfigError, naming `what` where given, for a name no RDMA device has: one with whitespace inside, a
    control character, '/', '"' or '\\', or more than MAX_DEVICE_NAME_CHARS characters. ConfigTypeError
    for a value that is not a str."""
    if not isinstance(value, str):
        raise ConfigTypeError(f"{what or 'a device list'} must be a str, not {type(value).__name__}")
    names = [name.strip() for name in value.split(",")]
    for name in names:
        if name and (len(name) > MAX_DEVICE_NAME_CHARS or not name.isprintable() or _NOT_IN_DEVICE_NAME.search(name)):
            said = f"{what}: " if what else ""
            raise ConfigError(f"{said}{value!r} names {name!r}, which no RDMA device is called: give the names "
                              f"under {INFINIBAND_SYSFS} separated by commas (e.g. mlx5_0,mlx5_1), each 1 to "
                              f"{MAX_DEVICE_NAME_CHARS} printable characters without spaces, '/', '\"' or '\\'")
    return ",".join(name for name in names if name)


def choose_protocol(protocol: str = "auto", root: str | None = None) -> tuple[str, str]:
    """Resolve "auto" to rdma when an RDMA device exists, else tcp; returns (protocol, why)."""
    if protocol in PROTOCOLS:
        return protocol, "requested"
    if protocol != "auto":
        raise ConfigError(f"unknown protocol {protocol!r}: expected auto, rdma or tcp")
    devices = rdma_device_names(root)
    if devices:
        return "rdma", f"RDMA device(s) {', '.join(devices)} found"
    where = INFINIBAND_SYSFS if root is None else root
    return "tcp", f"no RDMA device under {where}"


def usable_rdma_devices(root: str | None = None) -> list[str]:
    """The RDMA devices with at least one ACTIVE port (what Mooncake can run rdma on)."""
    root = INFINIBAND_SYSFS if root is None else root
    usable = []
    for name in rdma_device_names(root):
        ports = os.path.join(root, name, "ports")
        try:
            states = [_read_text(os.path.join(ports, port, "state")) for port in os.listdir(ports)]
        except OSError:
            continue
        if any(state.rpartition(":")[2].strip() == "ACTIVE" for state in states):
            usable.append(name)
    return usable


def _read_text(path: str) -> str:
    """A small sysfs file's text, "" when it cannot be read."""
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def effective_protocol(protocol: str = "auto", device_name: str = "", root: str | None = None) -> tuple[str, str]:
    """The protocol an engine will really run, and why: rdma only where a named (or any) device is usable.

    `auto` falls back to tcp when the devices it found have no ACTIVE port. An explicit
    `rdma` with no usable device raises EngineError: Mooncake would otherwise start,
    find no HCA and carry the writes over TCP while the engine said rdma. `device_name` is
    read as device_names() reads it (ConfigError for a name no device has).
    """
    wanted = [d for d in device_names(device_name).split(",") if d]
    chosen, why = choose_protocol(protocol, root)
    if chosen != "rdma":
        return chosen, why
    where = INFINIBAND_SYSFS if root is None else root
    present = rdma_device_names(root)
    usable = usable_rdma_devices(root)
    if wanted:
        missing = [d for d in wanted if d not in present]
        if missing:
            raise ConfigError(f"RDMA device {', '.join(missing)} not under {where} "
                              f"(found: {', '.join(present) or 'none'})")
        usable = [d for d in usable if d in wanted]
    if usable:
        return "rdma", f"{why}; usable: {', '.join(usable)}"
    listed = ", ".join(wanted or present)
    state = f"{listed} has no ACTIVE port" if listed else f"no RDMA device under {where}"
    if protocol == "auto":
        return "tcp", f"RDMA device(s) {state}"
    raise EngineError(f"protocol 'rdma' needs a usable RDMA device, and {state}: use protocol 'tcp' (or 'auto', "
                      f"which picks tcp here), bring a port up, or create a soft-RoCE device "
                      f"(scripts/soft-roce.sh up); `epd-transfer doctor` shows what this host can run")


def check_hostname(hostname: str) -> None:
    """ConfigError unless `hostname` (optionally with :port) resolves to an address of this host."""
    if not isinstance(hostname, str):
        raise ConfigTypeError(f"hostname must be a str, not {type(hostname).__name__}")
    host = bare_host(hostname)
    if not host:
        raise ConfigError("hostname is empty: give this node's IP address (the one peers reach it on)")
    if is_wildcard(host):
        raise ConfigError(f"hostname {hostname!r} is a wildcard address: peers write to the session id "
                          f"(hostname:port), and there it would name their own host; give this node's IP "
                          f"address (the one peers reach it on)")
    try:
        if ipaddress.ip_address(host).is_loopback:
            return  # always an address of this host
    except ValueError:
        pass  # a name: resolve it
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise ConfigError(f"hostname {hostname!r} does not resolve ({error}): give this node's IP address "
                          f"(the one peers reach it on)") from None
    family, _, _, _, address = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address[0], 0))
    except OSError as error:
        raise ConfigError(f"hostname {hostname!r} ({address[0]}) is not an address of this host ({error}): "
                          f"the engine listens there, so give one of this node's own IP addresses") from None


def _buffer_span(buf: Any, length: int | None) -> tuple[int, int]:
    """(address, length) of a contiguous torch tensor, or of an int address with a length."""
    if isinstance(buf, int) and not isinstance(buf, bool):
        if length is None:
            raise ConfigError(f"registering address 0x{buf:x} needs a length")
        return buf, int(length)
    if not (hasattr(buf, "data_ptr") and hasattr(buf, "nbytes")):
        raise ConfigTypeError(f"cannot register a {type(buf).__name__}: expected a tensor or an int address")
    if not buf.is_contiguous():
        raise ConfigError("cannot register a non-contiguous tensor: call .contiguous() first")
    nbytes = int(buf.nbytes)
    if length is not None and length != nbytes:
        raise ConfigError(f"length {length} differs from the tensor's {nbytes} bytes")
    return int(buf.data_ptr()), nbytes


class RegisteredMemory:
    """register(), unregister() and registered() for an engine, over its own add/remove hooks.

    The engine provides `_lock` (a lock or a condition), `_regions` (address -> length),
    `_adding` (address -> length, registrations under way), `_registrations` (a condition on
    `_lock`, notified when one settles), `_owners` (the tensors kept alive), `_closed`,
    `_check_open()`, `session_id`, and the hooks below.
    """

    #: Why an empty region is refused, for the error message.
    _EMPTY_REASON = "empty region"

    # Set by the engine's __init__.
    session_id: str
    _lock: AbstractContextManager[Any]
    _regions: Registrations
    _adding: dict[int, int]
    _registrations: threading.Condition
    _owners: dict[int, Any]
    _closed: bool
    _released: bool  # once a _release() ran to its end (read and set under _releasing)
    _releasing: threading.Lock  # held by the close() running _release()
    _releaser: int | None = None  # the thread that runs it

    @property
    def closed(self) -> bool:
        """Whether close() was called (it may still be waiting for writes in flight)."""
        return self._closed

    def _close_once(self) -> None:
        """Runs the engine's _release() until one ran to its end. A call while another is under way
        returns when that one did, so no close() returns while a peer may still write into the engine's
        memory; one whose _release() raised (a stop signal's exception while it waited for writes) leaves
        it to the next close(), which runs it again. A call from inside it on the same thread (a signal's
        handler) returns at once: the close it interrupted goes on."""
        me = threading.get_ident()
        with self._lock:
            self._closed = True
            if self._releaser == me:
                return
        with self._releasing:
            if self._released:
                return
            self._releaser = me
            try:
                self._release()
            finally:
                self._releaser = None
            self._released = True

    def _release(self) -> None:
        """close()'s work: settle the writes, drop the memory, stop the transport."""
        raise NotImplementedError

    def _check_open(self) -> None:
        """Raises EngineError once the engine is closed (lock held)."""
        raise NotImplementedError

    def _check_process(self) -> None:
        """Raises UsageError where this process cannot use the engine (before any lock is taken)."""

    def _region_span(self, buf: Any, length: int | None) -> tuple[int, int]:
        """(address, length) of what register() was given."""
        return _buffer_span(buf, length)

    def _add_region(self, addr: int, nbytes: int) -> None:
        """Makes the region writable by peers (lock not held); raises EngineError when refused."""
        raise NotImplementedError

    def _remove_region(self, addr: int) -> str | None:
        """Stops peers writing into the region (lock held); a problem to report, or None."""
        raise NotImplementedError

    def _reader_of(self, addr: int, nbytes: int) -> str | None:
        """A write still reading from [addr, addr + nbytes) (lock held), described; None when there is none."""
        return None

    def register(self, buf: Any, length: int | None = None) -> tuple[int, int]:
        """Register a tensor or an address range for peers' writes; returns (address, length).

        Raises ConfigError (empty, non-contiguous or out-of-range memory), ConfigTypeError (not
        a tensor or an address) or EngineError (already registered, refused, engine closed)."""
        addr, nbytes = self._region_span(buf, length)
        if nbytes <= 0:
            raise ConfigError(f"cannot register address 0x{addr:x} with length {nbytes}: {self._EMPTY_REASON}")
        if addr <= 0 or addr + nbytes >= _ADDRESS_SPACE:
            # Mooncake takes a range that wraps past 2**64 and pybind a negative one with a bare TypeError;
            # the wire engine's C book keeps a region's end in 64 bits, which 2**64 itself does not fit.
            raise ConfigError(f"cannot register address {addr:#x} with length {nbytes}: "
                             f"not a range of the 64-bit address space")
        self._check_process()
        with self._lock:
            self._check_open()
            if addr in self._regions or addr in self._adding:
                raise EngineError(f"address 0x{addr:x} is already registered "
                                  f"({self._regions.get(addr, self._adding.get(addr))} bytes) on {self.session_id}")
            self._adding[addr] = nbytes
        added = False
        try:
            # Outside the lock: pinning a large region (RDMA) takes a while, and writes go on meanwhile.
            self._add_region(addr, nbytes)
            added = True
        finally:
            with self._lock:
                del self._adding[addr]
                if added:
                    self._regions[addr] = nbytes
                    if not isinstance(buf, int):
                        self._owners[addr] = buf
                self._registrations.notify_all()  # close() waits for registrations under way
                closed = self._closed
        if closed:  # close() came meanwhile and took the region with it
            raise EngineError(f"cannot register address 0x{addr:x}: {self.session_id} closed meanwhile (its close() "
                              f"ran during the registration); register with an open engine")
        return addr, nbytes

    def _wait_for_registrations(self) -> None:
        """Waits until no registration is under way (lock held; close() calls it once closed)."""
        while self._adding:
            self._registrations.wait()

    def unregister(self, addr: int) -> None:
        """Unregister the region that starts at addr; EngineError if it is not registered, a write reads it,
        or the engine would not let it go (it then stays registered, its tensor kept alive)."""
        self._check_process()
        with self._lock:
            self._check_open()
            if addr not in self._regions:
                raise EngineError(f"address 0x{addr:x} is not registered on {self.session_id}")
            reader = self._reader_of(addr, self._regions[addr])
            if reader is not None:
                # Unregistering drops the tensor we keep alive while a write still reads it.
                raise EngineError(f"address 0x{addr:x} length {self._regions[addr]} on {self.session_id} "
                                    f"is still being read by {reader}: unregister it once that write settled")
            problem = self._remove_region(addr)
            nbytes = self._regions[addr]
            if problem is None:
                del self._regions[addr]
                self._owners.pop(addr, None)
        if problem:
            # Peers may still write into it: it stays ours (and its tensor alive) until it is let go.
            raise EngineError(f"unregistering address 0x{addr:x} length {nbytes} on "
                              f"{self.session_id} failed ({problem}); it stays registered")

    def unregister_many(self, addrs: Iterable[int]) -> dict[int, str]:
        """Unregisters the regions that start at `addrs`, through one engine call where the engine has a batch
        call; returns {address: why} for each it did not let go (not registered, read by a write, or refused by
        the engine: a refused one stays registered, its tensor kept alive). EngineError once the engine is
        closed (nothing is let go then), UsageError in a forked child."""
        self._check_process()
        problems: dict[int, str] = {}
        with self._lock:
            self._check_open()
            removing: list[int] = []
            for addr in dict.fromkeys(addrs):
                nbytes = self._regions.get(addr)
                if nbytes is None:
                    problems[addr] = f"address 0x{addr:x} is not registered on {self.session_id}"
                    continue
                reader = self._reader_of(addr, nbytes)
                if reader is not None:
                    problems[addr] = (f"address 0x{addr:x} length {nbytes} on {self.session_id} is still being "
                                      f"read by {reader}")
                    continue
                removing.append(addr)
            refused = self._remove_regions(removing) if removing else {}
            for addr in removing:
                if addr in refused:
                    problems[addr] = (f"unregistering address 0x{addr:x} length {self._regions[addr]} on "
                                      f"{self.session_id} failed ({refused[addr]}); it stays registered")
                else:
                    del self._regions[addr]
                    self._owners.pop(addr, None)
        return problems

    def _remove_regions(self, addrs: list[int]) -> dict[int, str]:
        """Stops peers writing into each region (lock held); {address: problem} for those not let go."""
        problems = {}
        for addr in addrs:
            problem = self._remove_region(addr)
            if problem is not None:
                problems[addr] = problem
        return problems

    def registered(self) -> dict[int, int]:
        """A snapshot of the registered regions, address -> length."""
        with self._lock:
            return dict(self._regions)

    def registration_holding(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """(address, length) of the registered region that holds [addr, addr + nbytes) whole, or None; one
        look-up however many regions are registered."""
        with self._lock:
            return self._regions.holding(addr, nbytes)

    def registration_overlapping(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """(address, length) of a registered region sharing a byte with [addr, addr + nbytes), or None; one
        look-up however many regions are registered."""
        with self._lock:
            return self._regions.overlapping(addr, nbytes)

    def owner_of(self, addr: int, nbytes: int) -> Any:
        """The tensor registered around [addr, addr + nbytes), or None (registered as an address, or not at all)."""
        with self._lock:
            held = self._regions.holding(addr, nbytes)
            return None if held is None else self._owners.get(held[0])


#: Engines started and not closed: a process forked from theirs keeps their Mooncake engines (see below).
_live: weakref.WeakSet[Engine] = weakref.WeakSet()

def _keep_in_child() -> None:
    """After a fork, in the child: keeps each inherited Mooncake engine alive for good (one reference
    leaked). The child has an engine's memory but none of its threads, and the engine's destructor joins
    them: the child's exit, or a close() there, would wait forever."""
    for engine in list(_live):
        te = engine.__dict__.get("_te")
        if te is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(te))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_in_child)


class Engine(RegisteredMemory):
    """A started Mooncake TransferEngine with its registered memory."""

    _EMPTY_REASON = "Mooncake refuses empty regions"

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "auto",
                 device_name: str = "", metadata: str = "P2PHANDSHAKE",
                 transfer_timeout_s: float | None = None, open_timeout_s: float | None = None) -> None:
        """Start the engine on hostname; protocol auto picks rdma when a usable device exists, else tcp.

        transfer_timeout_s (default: Mooncake's MC_TRANSFER_TIMEOUT) bounds every write,
        plus 1 ns per byte as Mooncake's own sync writes do. `protocol` then says what runs.
        open_timeout_s (default 5; 0 turns probing off) bounds how long a new peer's
        writes wait for it to answer a probe of its handshake port before they fail.

        Raises ConfigError for a hostname that is empty, a wildcard, does not resolve or is not this
        host's, an unknown protocol, a device_name no RDMA device has (device_names(): comma-separated
        names, each stripped; Mooncake gets them so), a device not present when the protocol is rdma, or a
        timeout outside its bound (0 < transfer_timeout_s, 0 <= open_timeout_s, both at most 1e6 s;
        ConfigTypeError for one that is not a number), all before Mooncake is imported; EngineError when
        rdma was asked for and no RDMA device is usable, or Mooncake refused to start; EngineUnavailable
        when mooncake.engine cannot be imported."""
        check_hostname(hostname)
        device_name = device_names(device_name)
        self.protocol, self.protocol_reason = effective_protocol(protocol, device_name)
        self.transfer_timeout_s = (mooncake_transfer_timeout_s() if transfer_timeout_s is None
                                   else check_seconds("transfer_timeout_s", transfer_timeout_s))
        self.open_timeout_s = (OPEN_TIMEOUT_S if open_timeout_s is None  # 0 turns probing off
                               else check_seconds("open_timeout_s", open_timeout_s, zero_ok=True))
        mooncake_engine = _import_engine()
        self.hostname = hostname
        # The lock itself, not the condition, is what the hot paths enter: a Condition's
        # __enter__/__exit__ are Python calls around the same acquisition.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # a submission or registration settled, a probe answered
        self._registrations = self._changed
        self._regions = Registrations()
        self._adding: dict[int, int] = {}
        self._owners: dict[int, Any] = {}  # keeps registered tensors alive
        # The region the last write read from, (start, end): a sender's writes mostly come
        # from one buffer. Reset whenever a region goes.
        self._source_region = (0, 0)
        self._pending: dict[int, _Pending] = {}  # write_async tickets not yet settled
        self._settling = threading.Lock()  # every write's `lock`: taken within _lock, never the other way round
        self._overdue: list[_Pending] = []  # writes reported failed at their deadline, still in Mooncake's hands
        self._overdue_check_at = OVERDUE_CHECK_AT  # how many overdue writes are filed before they are read again
        self._in_flight_at = time.monotonic()  # when poll() last found a write in flight
        self._held: dict[str, list[int]] = {}  # session -> tickets held back until its probe answers, oldest first
        self._next_ticket = 0
        self._closed = False
        self._close_by = math.inf  # when close() stops waiting for writes in flight (its timeout_s)
        self._released = False  # close() released the memory and the transport
        self._releasing = threading.Lock()
        self._openings = Openings(open_timeout_s=self.open_timeout_s)
        self._te = mooncake_engine.TransferEngine()
        _started_port_range()
        rc = self._te.initialize(hostname, metadata, self.protocol, device_name)
        if rc != 0:
            self._te = None
            self._closed = True
            self._released = True
            raise EngineError(
                f"Mooncake engine failed to start on {hostname} with protocol {self.protocol} "
                f"(device {device_name or 'auto'}, metadata {metadata}): rc={rc}; {_start_failure_hint(self.protocol)}")
        self.rpc_port = int(self._te.get_rpc_port())
        # Writes and status checks from C (native/mooncake.c) on the wheels checked; the
        # binding still opens every session with its first write.
        self._direct, self.calls_reason = _bind_direct(self._te, mooncake_engine)
        self.calls = "direct" if self._direct else "binding"
        self._handles: dict[str, int] = {}  # session -> Mooncake's segment handle, for the direct calls
        # Probing needs the binding's send_probe (wheels from mid-2026 on) and the P2P
        # handshake, whose openSegment is what blocks.
        self._probing = (self.open_timeout_s > 0 and metadata == "P2PHANDSHAKE"
                         and callable(getattr(self._te, "send_probe", None)))
        self.session_id = f"{hostname}:{self.rpc_port}"
        self._forks = forks()
        _live.add(self)
        log.debug("engine %s started (%s: %s; Mooncake's calls: %s, %s)", self.session_id, self.protocol,
                  self.protocol_reason, self.calls, self.calls_reason)

    # -- memory -----------------------------------------------------------

    def _region_span(self, buf: Any, length: int | None) -> tuple[int, int]:
        """(address, length) of what register() was given; EngineError for device memory this
        engine's Mooncake build cannot move (`device_memory_refusal`)."""
        device = getattr(buf, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            problem = device_memory_refusal(_installed_mooncake(), self.protocol, str(device))
            if problem is not None:
                raise EngineError(problem)
        return _buffer_span(buf, length)

    def _add_region(self, addr: int, nbytes: int) -> None:
        """Registers a tensor's memory (host or CUDA) or an address range with Mooncake.

        Through its batch call where there is one: Mooncake's register_memory keeps the GIL
        while it pins the memory, its batch call lets the other threads run meanwhile.
        """
        batch = getattr(self._te, "batch_register_memory", None)
        rc = self._te.register_memory(addr, nbytes) if batch is None else batch([addr], [nbytes])
        if rc != 0:
            raise EngineError(f"registering address 0x{addr:x} length {nbytes} on "
                                f"{self.session_id} failed (rc={rc}; -7 means it overlaps "
                                f"a registered region)")

    def _remove_region(self, addr: int) -> str | None:
        self._source_region = (0, 0)
        rc = self._te.unregister_memory(addr)
        return f"rc={rc}" if rc != 0 else None

    def _remove_regions(self, addrs: list[int]) -> dict[int, str]:
        """Unregisters the regions with Mooncake's batch call where it has one: one update of the engine's
        segment description for all of them, where unregister_memory makes one per region (each longer the
        more regions are registered). The batch goes on past a region it could not drop and then answers
        non-zero without naming it, so each is asked again alone: ERR_ADDRESS_NOT_REGISTERED then says the
        batch dropped it."""
        batch = getattr(self._te, "batch_unregister_memory", None)
        if batch is None or len(addrs) < 2:
            return super()._remove_regions(addrs)
        self._source_region = (0, 0)
        if batch(list(addrs)) == 0:
            return {}
        problems = {}
        for addr in addrs:
            rc = self._te.unregister_memory(addr)
            if rc not in (0, _ERR_ADDRESS_NOT_REGISTERED):
                problems[addr] = f"rc={rc}"
        return problems

    # -- writes -----------------------------------------------------------

    def native_target(self, session_id: str) -> tuple[int, int] | None:
        """(Mooncake engine pointer, segment handle) through which C code writes to an open session
        with `_native`'s Mooncake calls (the bench's `cfloor` path), or None: writes go through the
        binding (`calls`), or no write to the session opened it yet. The engine must stay open while
        the C code runs."""
        with self._lock:
            handle = self._handles.get(session_id, -1)
            if self._closed or not self._direct or handle < 0:
                return None
            return self._direct, handle

    def write(self, session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        """Write every (src, dst, length) to the peer session and wait for it, without spinning a core.

        Raises ConfigError for mismatched or negative lengths and EngineError when the write failed."""
        self.wait(self.write_async(session_id, src_addrs, dst_addrs, lengths))

    def write_async(self, session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
                    lengths: Sequence[int]) -> int:
        """Submit the buffers without waiting; returns a ticket for poll()/wait() (0: nothing to write).

        Each buffer becomes a batch of its own, because Mooncake's non-blocking status
        call looks at a batch's first task only. The ticket is filed before the first
        batch goes out, so close() and unregister() see the write while it is submitted.
        UsageError in a process forked from the one that started the engine.
        """
        if self._forks != _forks.count:  # _check_process(), without its calls
            self._check_process()
        srcs, dsts, lens = check_batch(session_id, src_addrs, dst_addrs, lengths)
        if not lens:
            return 0
        pending = _Pending(session_id, srcs, dsts, lens, lock=self._settling)
        with self._lock:
            if self._closed:  # _check_open(), without its call while open
                self._check_open()
            self._check_sources(pending)
            ticket = self._next_ticket = self._next_ticket + 1
            # The openings' is_open(), without its call.
            if session_id not in self._held and (not self._probing or session_id in self._openings.open_sessions):
                # What _admit() would say with nothing held for the session: GO, no probe.
                self._pending[ticket] = pending
                held = False
            else:
                held = self._file_behind_probe(ticket, pending)
        try:
            if held:
                self._release_waiting(session_id)
            else:
                self._hand_over(pending)
        finally:
            with self._lock:
                if not held:
                    self._submitted(pending)
                refused = not (pending.waiting or pending.submitting or pending.batches or pending.cut_short
                               or pending.error is None)
                if refused:
                    self._pending.pop(ticket, None)  # refused with nothing in flight: fail at once
        if refused:
            raise EngineError(pending.error)
        return ticket

    def _file_behind_probe(self, ticket: int, pending: _Pending) -> bool:
        """Files a write the openings must judge (lock held); True when it is held back, False for GO."""
        session_id = pending.session_id
        # Writes already held back for its probe are polled: a gap since the last poll may be a hold-up.
        verdict, probe, why = self._admit(session_id,
                                          self._held_up(time.monotonic()) if session_id in self._held else 0.0)
        if verdict is Verdict.REFUSE:
            raise EngineError(self._describe_failure("write", session_id, pending.dsts, pending.lens, why))
        self._pending[ticket] = pending
        held = verdict is not Verdict.GO or session_id in self._held
        if held:  # behind its probe, or behind the session's writes still held back
            pending.waiting, pending.probe, pending.submitting = True, probe, False
            self._held.setdefault(session_id, []).append(ticket)
        starts = probe if verdict is Verdict.PROBE else None  # the probe this write starts, if any
        if starts is not None:
            self._start_probe(starts)
            self._changed.wait_for(lambda: starts.done, FIRST_ANSWER_S)
        return held

    def _admit(self, session_id: str, held_up: float = 0.0) -> tuple[Verdict, Probe | None, str]:
        """The openings' verdict on a new write to the session (lock held); GO when probing is off."""
        if not self._probing:
            return Verdict.GO, None, ""
        return self._openings.admit(session_id, time.monotonic(), held_up)

    def _held_up(self, now: float) -> float:
        """How long this process may have been held up before `now`: the time since the last poll that
        found a write in flight, when that is HELD_UP_S or more (else 0)."""
        held = now - self._in_flight_at
        return held if held >= HELD_UP_S else 0.0

    def _start_probe(self, probe: Probe) -> None:
        """Probes the peer's handshake port on a thread of its own (lock held)."""
        threading.Thread(target=self._probe, args=(self._te, probe), daemon=True,
                         name=f"epd-probe-{probe.session[:32]}").start()

    def _probe(self, te: Any, probe: Probe) -> None:
        """Asks the peer for an answer (the thread keeps `te` alive, so close() cannot free it under us)."""
        try:
            replied = int(te.send_probe(probe.session)) == 0
        except Exception:  # noqa: BLE001 - a probe that fails lets Mooncake give its own answer
            replied = False
        with self._lock:
            self._openings.answered(probe, replied, time.monotonic())
            self._changed.notify_all()

    def _release_waiting(self, session_id: str, held_up: float = 0.0) -> None:
        """Submits the session's held-back writes that may go now, oldest first (`held_up`: see Openings.verdict)."""
        with self._lock:
            if self._closed:
                return
            now = time.monotonic()
            ready, kept = [], []
            tickets = self._held.pop(session_id, [])
            for i, ticket in enumerate(tickets):
                pending = self._pending.get(ticket)
                if pending is None or not pending.waiting:
                    continue  # failed and collected meanwhile
                verdict = (Verdict.GO if pending.probe is None
                           else self._openings.verdict(pending.probe, now, held_up)[0])
                if verdict is Verdict.WAIT:
                    kept.extend(tickets[i:])  # later writes keep their order behind it
                    break
                if verdict is Verdict.GO:
                    pending.waiting, pending.probe, pending.submitting = False, None, True
                    ready.append((ticket, pending))
                else:
                    kept.append(ticket)  # refused: it fails when its owner polls it
            if kept:
                self._held[session_id] = kept
        for i, (_, pending) in enumerate(ready):
            try:
                self._submit(pending)
            except BaseException:
                self._hold_again(session_id, ready[i + 1:])
                raise

    def _hold_again(self, session_id: str, writes: list[tuple[int, _Pending]]) -> None:
        """Puts writes let go and not handed over (a stop signal's exception cut an older one's submission short)
        back at the head of the session's held-back writes, for the next poll to submit; failed once closed."""
        with self._lock:
            for _, pending in writes:
                pending.submitting = False
                if self._closed:
                    pending.error = self._describe_failure("write", pending.session_id, pending.dsts, pending.lens,
                                                           "the engine closed before it was submitted")
                else:
                    pending.waiting = True
            if writes and not self._closed:
                self._held[session_id] = [ticket for ticket, _ in writes] + self._held.get(session_id, [])
            self._changed.notify_all()  # close() waits for submissions to settle

    def _unhold(self, session_id: str, ticket: int) -> None:
        """Takes a failed ticket off its session's held-back writes, and the session off the book once none is
        left (lock held): a peer whose writes all failed leaves nothing behind."""
        tickets = self._held.get(session_id)
        if tickets is not None and ticket in tickets:
            tickets.remove(ticket)
            if not tickets:
                del self._held[session_id]

    def _submit(self, pending: _Pending) -> None:
        """Hands a write's buffers to Mooncake and records that it is submitted."""
        try:
            self._hand_over(pending)
        finally:
            with self._lock:
                self._submitted(pending)

    def _hand_over(self, pending: _Pending) -> None:
        """Hands a write's buffers to Mooncake, one batch each; a failure is kept on the write."""
        session_id = pending.session_id
        te, engine = self._te, self._direct  # `te` keeps the engine `engine` points to alive
        handle = self._handles.get(session_id, -1) if engine and te is not None else -1
        try:
            for src, dst, length in zip(pending.srcs, pending.dsts, pending.lens):
                if handle >= 0:
                    batch_id = _native.mooncake_write(engine, handle, src, dst, length)
                else:
                    batch_id = int(te.batch_transfer_async_write(session_id, [src], [dst], [length]))
                if batch_id in _BAD_BATCH_IDS:
                    pending.error = self._describe_failure(
                        "write", session_id, pending.dsts, pending.lens,
                        "Mooncake refused the batch: an unknown or unreachable session, or a peer that does "
                        "not run Mooncake (a `wire` prefill rank? both sides must use the same protocol)")
                    break
                # Filed before the handle look-up, which may raise: the batch reads the source until it settled.
                pending.batches.append(batch_id)
                if engine and handle < 0:
                    handle = self._open_handle(engine, session_id)
        except Exception as exc:  # noqa: BLE001 - the batches already submitted stay tracked
            pending.error = self._describe_failure("write", session_id, pending.dsts, pending.lens,
                                                   f"submitting failed: {exc}")
        except BaseException:
            # Raised as a call returned (where Python runs a signal's handler), it loses the batch id answered.
            pending.cut_short = True
            pending.error = self._describe_failure("write", session_id, pending.dsts, pending.lens,
                                                   "its submission was cut short by a stop signal")
            raise
        finally:
            # The clock starts once submitted: a handshake with a new peer may take a while.
            pending.deadline = time.monotonic() + self.transfer_timeout_s + sum(pending.lens) * 1e-9

    def _open_handle(self, engine: int, session_id: str) -> int:
        """The session's segment handle for the direct calls, once the binding's write opened it
        (so Mooncake answers from its cache); -1 when it has none."""
        handle = _native.mooncake_open(engine, session_id)
        if handle >= 0:
            if len(self._handles) >= MAX_HANDLES:
                self._handles.clear()
            self._handles[session_id] = handle
        return handle

    def _submitted(self, pending: _Pending) -> None:
        """The write is in Mooncake's hands, or refused (lock held): what its session's openings learn."""
        pending.submitting = False
        if pending.batches:
            self._openings.opened(pending.session_id)  # Mooncake holds its segment: no handshake ahead
        elif pending.error is not None:
            self._openings.forget(pending.session_id)  # probe again before Mooncake's next handshake
        if self._closed:
            self._changed.notify_all()  # close() waits for submissions to settle; nothing else does

    def poll(self, ticket: int) -> bool:
        """Whether the write behind `ticket` is over, without blocking; EngineError if it failed.

        A failed ticket raises once every buffer it submitted has settled, so the caller
        never reuses memory that Mooncake may still be reading; or once the transfer
        timeout passed, and then its source regions stay registered (and their tensors
        alive) until Mooncake is done with them or the engine closes. A failed write may
        still have landed in part, and over tcp bytes it carried may land after it failed:
        its destination is not safe to reuse on the strength of the failure.
        """
        if ticket == 0:
            return True
        # A lookup is one atomic dict operation: the lock guards what changes the filing
        # (a ticket is filed before write_async returns it and leaves under the lock).
        pending = self._pending.get(ticket)
        if pending is None:
            raise EngineError(f"unknown write ticket {ticket} on {self.session_id}")
        if pending.waiting:
            # A write held back for its probe is in flight too: a gap since the last such poll may be a
            # hold-up of this process, which the probe's bound does not count against the peer.
            now = time.monotonic()
            held_up, self._in_flight_at = self._held_up(now), now
            self._release_waiting(pending.session_id, held_up)
            with self._lock:
                if pending.waiting:
                    if pending.probe is None:
                        return False  # behind the session's older writes, whose probe is still out
                    verdict, why = self._openings.verdict(pending.probe, time.monotonic(), held_up)
                    if verdict is not Verdict.REFUSE:
                        return False
                    self._pending.pop(ticket, None)
                    self._unhold(pending.session_id, ticket)
                    raise EngineError(self._describe_failure("write", pending.session_id, pending.dsts,
                                                             pending.lens, why))
        if not self._advance(pending):
            now = time.monotonic()
            held_up, self._in_flight_at = self._held_up(now), now
            if now <= pending.deadline or (held_up > 0 and self._give_back(pending, held_up, now)):
                return False
            with self._lock:
                if self._pending.pop(ticket, None) is not None:
                    if len(self._overdue) >= self._overdue_check_at:
                        self._collect_overdue()
                    self._overdue.append(pending)
            raise EngineError(self._describe_failure(
                "write", pending.session_id, pending.dsts, pending.lens,
                f"still in flight after the transfer timeout of {self.transfer_timeout_s:g}s "
                f"(MC_TRANSFER_TIMEOUT) plus 1 ns per byte: a peer that stopped reading?"))
        with self._lock:
            self._pending.pop(ticket, None)
        if pending.error is not None:
            raise EngineError(pending.error)
        return True

    def _give_back(self, pending: _Pending, held: float, now: float) -> bool:
        """Gives a write found past its deadline `held` seconds more from now, `held` being the time since
        the previous poll found a write in flight: this process (Mooncake's threads with it) may have been
        held up all that while, which is not the peer's doing, and its threads need a moment to run again.
        At most the write's own bound is given in all, so a caller that polls rarely delays a dead peer's
        failure by no more than that. Whether any time was given."""
        bound = self.transfer_timeout_s + sum(pending.lens) * 1e-9
        back = min(held, bound - pending.given_back)
        if back <= 0:
            return False
        pending.given_back += back
        pending.deadline = now + back
        return True

    def _advance(self, pending: _Pending) -> bool:
        """Collects the write's settled batches; True when none is in flight any more."""
        with pending.lock:
            while pending.batches:
                te = self._te
                if te is None:  # close() destroyed the transport: nothing reads the sources now
                    pending.batches.clear()
                    if pending.error is None:
                        pending.error = self._describe_failure("write", pending.session_id, pending.dsts,
                                                               pending.lens, "the engine closed first")
                    break
                engine = self._direct
                if engine:
                    # Takes the batches over off the list, in one call: 1 when none is left, else as below.
                    rc = _native.mooncake_settle(engine, pending.batches)
                else:
                    rc = int(te.transfer_check_status(pending.batches[0]))
                    if rc not in (0, -2):
                        pending.batches.pop(0)  # Mooncake freed that batch (or cannot read it)
                # -2 (TIMEOUT, with MC_SLICE_TIMEOUT set) says a slice is old, not that it stopped:
                # the batch completes or fails later and Mooncake frees it only then.
                if rc in (0, -2):
                    return False
                if rc < 0 and pending.error is None:
                    why = f"rc={rc}" if rc > -1000 else f"Mooncake could not read its status (code {-1000 - rc})"
                    pending.error = self._describe_failure("write", pending.session_id, pending.dsts, pending.lens,
                                                           why, remedy=_failed_write_remedy(pending.session_id))
            if pending.cut_short and self._te is not None:
                return False  # a batch it cannot read may still read its sources
            return not (pending.submitting or pending.waiting)  # a held-back write reads its sources later

    def _collect_overdue(self) -> None:
        """Lets go of the overdue writes Mooncake settled, reading their batches' statuses (which frees them);
        the next collection comes once twice as many as are left are filed (lock held)."""
        self._overdue = [p for p in self._overdue if not self._advance(p)]
        self._overdue_check_at = max(OVERDUE_CHECK_AT, 2 * len(self._overdue))

    def _reader_of(self, addr: int, nbytes: int) -> str | None:
        """A write in flight (or overdue) whose sources overlap the region, described (lock held)."""
        self._collect_overdue()
        for pending in (*self._pending.values(), *self._overdue):
            if pending.reads(addr, nbytes) and not self._advance(pending):
                return f"a write to {pending.session_id} in flight"
        return None

    def wait(self, ticket: int, timeout_s: float | None = None) -> None:
        """Blocks until the write behind `ticket` is over, sleeping between polls (no spinning).

        Bounded by `timeout_s` when given, and always by the transfer timeout, after
        which poll() reports the write failed. UsageError in a process forked from the one that
        started the engine.
        """
        self._check_process()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = POLL_MIN_S
        while not self.poll(ticket):
            if deadline is not None and time.monotonic() > deadline:
                raise EngineError(f"write ticket {ticket} on {self.session_id} still in flight after {timeout_s}s")
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def _check_sources(self, pending: _Pending) -> None:
        """Refuse a source range outside our registered memory (RDMA would fail obscurely); lock held."""
        low, high = self._source_region
        for src, length in zip(pending.srcs, pending.lens):
            if not (low <= src and src + length <= high):
                low, high = self._region_around(src, length, pending.session_id)
        self._source_region = (low, high)

    def _region_around(self, src: int, length: int, session_id: str) -> tuple[int, int]:
        """(start, end) of the registered region holding [src, src + length); EngineError when none does."""
        held = self._regions.holding(src, length)
        if held is not None:
            return held[0], held[0] + held[1]
        raise EngineError(f"write to {session_id}: source 0x{src:x} length {length} is not "
                            f"inside memory registered on {self.session_id}")

    def _describe_failure(self, what: str, session_id: str, dsts: list[int],
                          lens: list[int], why: str, remedy: str = "") -> str:
        """Name the session (a peer's, so shortened when long), the destination range(s), the sizes, why, and
        what to check (`remedy`, when given)."""
        first = f"first destination 0x{dsts[0]:x}+{lens[0]}"
        text = (f"{what} to {_session_name(session_id)} failed ({why}): {len(lens)} buffer(s), {sum(lens)} bytes, "
                f"{first}")
        return f"{text}; {remedy}" if remedy else text

    # -- lifecycle --------------------------------------------------------

    def _check_open(self) -> None:
        """Raise when the engine was closed (caller holds the lock)."""
        if self._closed:
            name = getattr(self, "session_id", self.hostname)
            raise EngineError(f"engine {name} is closed: its close() ran; start a new engine (and new pools and "
                              f"managers on it) to register or write more")

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for writes in flight, unregister all memory and release the engine; idempotent.

        Each write is waited for at most until its transfer timeout, and all of them at most
        `timeout_s` when given (a caller with a stop of its own to keep, e.g. a supervisor's
        grace); the transport is destroyed before the tensors kept alive are let go, so a
        write still in flight then (overdue, or past `timeout_s`) never reads freed memory.
        Writes still held back for a probe fail; a probe still out keeps Mooncake's engine
        (its threads and listener) alive until it returns, at most Mooncake's 60 s, as does a
        write being handed to Mooncake (a handshake with a new peer), which close() waits for.
        A close() while another is under way returns when that one did; one cut short (a stop signal's
        exception) is finished by the next. ConfigError for a
        `timeout_s` below 0 or above 1e6 (ConfigTypeError for one that is not a number).
        """
        if self._forks != forks():
            return  # a forked child's copy: Mooncake's engine, its memory and its threads are the parent's
        if timeout_s is not None:
            close_by = time.monotonic() + check_seconds("timeout_s", timeout_s, zero_ok=True)
            with self._lock:
                if not self._closed:
                    self._close_by = close_by
        self._close_once()

    def _check_process(self) -> None:
        """UsageError in a process forked from the one that started the engine: nothing here would carry
        its writes (a write would wait out its transfer timeout)."""
        if self._forks != forks():
            raise UsageError(f"engine {self.session_id} was made before this process (pid {os.getpid()}) was "
                             f"forked from its parent: Mooncake's threads and connections are the parent's, so "
                             f"nothing here would carry its writes; make an Engine in this process")

    def _release(self) -> None:
        """close()'s work: settle the writes, unregister the memory, destroy the transport; again after a
        close cut short, what is left of it."""
        if self._te is None:  # a close cut short right after it destroyed the transport
            with self._lock:
                self._owners.clear()
                self._overdue.clear()
            return
        with self._lock:
            self._held.clear()
            for pending in self._pending.values():
                if pending.waiting:
                    pending.waiting, pending.probe = False, None
                    pending.error = self._describe_failure("write", pending.session_id, pending.dsts,
                                                           pending.lens, "the engine closed before the peer "
                                                           "answered its probe")
            # A submission in progress files batches close() must see (each is bounded by
            # Mooncake's handshake with a new peer); a registration under way, a region to drop.
            while any(p.submitting for p in self._pending.values()):
                self._changed.wait()
            self._wait_for_registrations()
            self._collect_overdue()  # frees the batches of those Mooncake settled; the transport goes below
            writes = list(self._pending.values())
        # Let writes in flight finish before the memory goes, each until its deadline (or close()'s
        # timeout_s). Their tickets stay filed: an owner polling one later still learns how its write ended.
        for pending in writes:
            delay = POLL_MIN_S
            # One cut short is never seen to settle: the transport's end below is what stops it.
            while (not self._advance(pending) and not pending.cut_short
                   and time.monotonic() <= min(pending.deadline, self._close_by)):
                time.sleep(delay)
                delay = min(delay * 2, POLL_MAX_S)
            if pending.batches or pending.cut_short:
                log.warning("closing %s: %s", self.session_id, self._describe_failure(
                    "write", pending.session_id, pending.dsts, pending.lens, "still in flight at close"))
        with self._lock:
            for addr, problem in self._remove_regions(list(self._regions)).items():
                log.warning("unregistering 0x%x on %s failed (%s)", addr, self.session_id, problem)
            self._regions.clear()
            self._source_region = (0, 0)
            te, self._te = self._te, None
        del te  # the TransferEngine's destructor stops its threads and listener
        with self._lock:
            self._owners.clear()  # only now: an overdue write may have read them until the line above
            self._overdue.clear()

    def __enter__(self) -> Engine:
        """Context-manager entry."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on exit."""
        self.close()

    def __repr__(self) -> str:
        """Session and protocol, for logs."""
        state = "closed" if self._closed else "open"
        return f"Engine({getattr(self, 'session_id', self.hostname)}, {self.protocol}, {state})"


def _session_name(session_id: str) -> str:
    """A peer's session id as failure texts quote it (shortened when long)."""
    return session_id if len(session_id) <= 120 else f"{session_id[:100]}... ({len(session_id)} characters)"


def _failed_write_remedy(session_id: str) -> str:
    """What to check when Mooncake reports a write failed (a negative status: a peer gone, or a bad destination)."""
    return (f"is the peer engine {_session_name(session_id)} still running, and its host and port reachable from "
            f"this node, and does the destination lie in memory it registered? (a peer restarted at the same "
            f"host:port keeps failing here until this process restarts: docs/operations.md, troubleshooting)")

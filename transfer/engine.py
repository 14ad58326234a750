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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

log = logging.getLogger(__name__)

# Where the kernel lists RDMA devices; tests point this at a temporary folder.
INFINIBAND_SYSFS = "/sys/class/infiniband"

PROTOCOLS = ("rdma", "tcp")

# Mooncake's async API answers these batch ids when submission failed (0 in the
# current wheels, -1 cast to u64 in older sources).
_BAD_BATCH_IDS = (0, (1 << 64) - 1)

#: wait()'s sleep between polls grows from POLL_MIN_S to POLL_MAX_S.
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3


@dataclass
class _Pending:
    """An async write: its batches not yet settled, and what to say if it failed."""

    session_id: str
    dsts: list[int]
    lens: list[int]
    batches: list[int] = field(default_factory=list)
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one poller at a time per batch


class EngineUnavailable(RuntimeError):
    """mooncake.engine cannot be imported on this host."""


class TransferError(RuntimeError):
    """A Mooncake registration or write failed."""


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


def choose_protocol(protocol: str = "auto", root: str | None = None) -> tuple[str, str]:
    """Resolve "auto" to rdma when an RDMA device exists, else tcp; returns (protocol, why)."""
    if protocol in PROTOCOLS:
        return protocol, "requested"
    if protocol != "auto":
        raise ValueError(f"unknown protocol {protocol!r}: expected auto, rdma or tcp")
    devices = rdma_device_names(root)
    if devices:
        return "rdma", f"RDMA device(s) {', '.join(devices)} found"
    where = INFINIBAND_SYSFS if root is None else root
    return "tcp", f"no RDMA device under {where}"


def _buffer_span(buf: Any, length: int | None) -> tuple[int, int]:
    """(address, length) of a contiguous torch tensor, or of an int address with a length."""
    if isinstance(buf, int) and not isinstance(buf, bool):
        if length is None:
            raise ValueError(f"registering address 0x{buf:x} needs a length")
        return buf, int(length)
    if not (hasattr(buf, "data_ptr") and hasattr(buf, "nbytes")):
        raise TypeError(f"cannot register a {type(buf).__name__}: expected a tensor or an int address")
    if not buf.is_contiguous():
        raise ValueError("cannot register a non-contiguous tensor: call .contiguous() first")
    nbytes = int(buf.nbytes)
    if length is not None and length != nbytes:
        raise ValueError(f"length {length} differs from the tensor's {nbytes} bytes")
    return int(buf.data_ptr()), nbytes


class RegisteredMemory:
    """register(), unregister() and registered() for an engine, over its own add/remove hooks.

    The engine provides `_lock`, `_regions` (address -> length), `_owners` (the tensors
    kept alive), `_check_open()`, `session_id`, and the hooks below.
    """

    #: Why an empty region is refused, for the error message.
    _EMPTY_REASON = "empty region"

    def _region_span(self, buf: Any, length: int | None) -> tuple[int, int]:
        """(address, length) of what register() was given."""
        return _buffer_span(buf, length)

    def _add_region(self, addr: int, nbytes: int) -> None:
        """Makes the region writable by peers (lock held); raises TransferError when refused."""
        raise NotImplementedError

    def _remove_region(self, addr: int) -> str | None:
        """Stops peers writing into the region (lock held); a problem to report, or None."""
        raise NotImplementedError

    def register(self, buf: Any, length: int | None = None) -> tuple[int, int]:
        """Register a tensor or an address range for peers' writes; returns (address, length)."""
        addr, nbytes = self._region_span(buf, length)
        if nbytes <= 0:
            raise ValueError(f"cannot register address 0x{addr:x} with length {nbytes}: {self._EMPTY_REASON}")
        with self._lock:
            self._check_open()
            if addr in self._regions:
                raise TransferError(f"address 0x{addr:x} is already registered "
                                    f"({self._regions[addr]} bytes) on {self.session_id}")
            self._add_region(addr, nbytes)
            self._regions[addr] = nbytes
            if not isinstance(buf, int):
                self._owners[addr] = buf
        return addr, nbytes

    def unregister(self, addr: int) -> None:
        """Unregister the region that starts at addr."""
        with self._lock:
            self._check_open()
            if addr not in self._regions:
                raise TransferError(f"address 0x{addr:x} is not registered on {self.session_id}")
            problem = self._remove_region(addr)
            nbytes = self._regions.pop(addr)
            self._owners.pop(addr, None)
        if problem:
            raise TransferError(f"unregistering address 0x{addr:x} length {nbytes} on "
                                f"{self.session_id} failed ({problem})")

    def registered(self) -> dict[int, int]:
        """A snapshot of the registered regions, address -> length."""
        with self._lock:
            return dict(self._regions)


class Engine(RegisteredMemory):
    """A started Mooncake TransferEngine with its registered memory."""

    _EMPTY_REASON = "Mooncake refuses empty regions"

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "auto",
                 device_name: str = "", metadata: str = "P2PHANDSHAKE") -> None:
        """Start the engine on hostname; protocol auto picks rdma when a device exists."""
        self.protocol, self.protocol_reason = choose_protocol(protocol)
        mooncake_engine = _import_engine()
        self.hostname = hostname
        self._lock = threading.Condition()
        self._regions: dict[int, int] = {}
        self._owners: dict[int, Any] = {}  # keeps registered tensors alive
        self._pending: dict[int, _Pending] = {}  # write_async tickets not yet settled
        self._next_ticket = 0
        self._closed = False
        self._te = mooncake_engine.TransferEngine()
        rc = self._te.initialize(hostname, metadata, self.protocol, device_name)
        if rc != 0:
            self._te = None
            self._closed = True
            raise TransferError(
                f"Mooncake engine failed to start on {hostname} with protocol {self.protocol} "
                f"(device {device_name or 'auto'}, metadata {metadata}): rc={rc}")
        self.rpc_port = int(self._te.get_rpc_port())
        self.session_id = f"{hostname}:{self.rpc_port}"
        log.debug("engine %s started (%s: %s)", self.session_id, self.protocol, self.protocol_reason)

    # -- memory -----------------------------------------------------------

    def _add_region(self, addr: int, nbytes: int) -> None:
        """Registers a tensor's memory (host or CUDA) or an address range with Mooncake."""
        rc = self._te.register_memory(addr, nbytes)
        if rc != 0:
            raise TransferError(f"registering address 0x{addr:x} length {nbytes} on "
                                f"{self.session_id} failed (rc={rc}; -7 means it overlaps "
                                f"a registered region)")

    def _remove_region(self, addr: int) -> str | None:
        rc = self._te.unregister_memory(addr)
        return f"rc={rc}" if rc != 0 else None

    # -- writes -----------------------------------------------------------

    def write(self, session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        """Write every (src, dst, length) to the peer session and wait for it, without spinning a core."""
        self.wait(self.write_async(session_id, src_addrs, dst_addrs, lengths))

    def write_async(self, session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
                    lengths: Sequence[int]) -> int:
        """Submit the buffers without waiting; returns a ticket for poll()/wait() (0: nothing to write).

        Each buffer becomes a batch of its own, because Mooncake's non-blocking status
        call looks at a batch's first task only.
        """
        batch = self._batch(session_id, src_addrs, dst_addrs, lengths)
        if batch is None:
            return 0
        srcs, dsts, lens = batch
        pending = _Pending(session_id, dsts, lens)
        for src, dst, length in zip(srcs, dsts, lens):
            batch_id = int(self._te.batch_transfer_async_write(session_id, [src], [dst], [length]))
            if batch_id in _BAD_BATCH_IDS:
                pending.error = self._describe_failure(
                    "write", session_id, dsts, lens, "Mooncake refused the batch: an unknown or unreachable session?")
                break
            pending.batches.append(batch_id)
        if pending.error is not None and not pending.batches:
            raise TransferError(pending.error)  # nothing in flight: fail at once
        with self._lock:
            ticket = self._next_ticket = self._next_ticket + 1
            self._pending[ticket] = pending
        return ticket

    def poll(self, ticket: int) -> bool:
        """Whether the write behind `ticket` is over, without blocking; TransferError if it failed.

        A failed ticket raises only once every buffer it submitted has settled, so the
        caller never reuses memory that Mooncake may still be reading.
        """
        if ticket == 0:
            return True
        with self._lock:
            pending = self._pending.get(ticket)
        if pending is None:
            raise TransferError(f"unknown write ticket {ticket} on {self.session_id}")
        with pending.lock:
            while pending.batches:
                rc = int(self._te.transfer_check_status(pending.batches[0]))
                if rc == 0:
                    return False
                pending.batches.pop(0)  # Mooncake freed (or timed out) that batch
                if rc < 0 and pending.error is None:
                    pending.error = self._describe_failure("write", pending.session_id, pending.dsts, pending.lens,
                                                           f"rc={rc}")
                    if rc == -2:
                        pending.error += "; Mooncake's transfer timeout (MC_TRANSFER_TIMEOUT) passed"
        with self._lock:
            self._pending.pop(ticket, None)
            self._lock.notify_all()
        if pending.error is not None:
            raise TransferError(pending.error)
        return True

    def wait(self, ticket: int, timeout_s: float | None = None) -> None:
        """Blocks until the write behind `ticket` is over, sleeping between polls (no spinning).

        Bounded by `timeout_s` when given, and always by Mooncake's transfer timeout
        (MC_TRANSFER_TIMEOUT), after which the batch reports failure.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = POLL_MIN_S
        while not self.poll(ticket):
            if deadline is not None and time.monotonic() > deadline:
                raise TransferError(f"write ticket {ticket} on {self.session_id} still in flight after {timeout_s}s")
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def _batch(self, session_id: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
               lengths: Sequence[int]) -> tuple[list[int], list[int], list[int]] | None:
        """Validate a batch and drop zero-length entries; None when nothing is left."""
        if not (len(src_addrs) == len(dst_addrs) == len(lengths)):
            raise ValueError(f"write to {session_id}: {len(src_addrs)} sources, "
                             f"{len(dst_addrs)} destinations, {len(lengths)} lengths")
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for src, dst, length in zip(src_addrs, dst_addrs, lengths):
            if length < 0:
                raise ValueError(f"write to {session_id}: negative length {length}")
            if length == 0:
                continue
            srcs.append(int(src))
            dsts.append(int(dst))
            lens.append(int(length))
        if not lens:
            return None
        with self._lock:
            self._check_open()
            for src, length in zip(srcs, lens):
                self._check_source(src, length, session_id)
        return srcs, dsts, lens

    def _check_source(self, src: int, length: int, session_id: str) -> None:
        """Refuse a source range outside our registered memory (RDMA would fail obscurely)."""
        for base, size in self._regions.items():
            if base <= src and src + length <= base + size:
                return
        raise TransferError(f"write to {session_id}: source 0x{src:x} length {length} is not "
                            f"inside memory registered on {self.session_id}")

    def _describe_failure(self, what: str, session_id: str, dsts: list[int],
                          lens: list[int], why: str) -> str:
        """Name the session (a peer's, so shortened when long), the destination range(s), the sizes and why."""
        name = session_id if len(session_id) <= 120 else f"{session_id[:100]}... ({len(session_id)} characters)"
        first = f"first destination 0x{dsts[0]:x}+{lens[0]}"
        return f"{what} to {name} failed ({why}): {len(lens)} buffer(s), {sum(lens)} bytes, {first}"

    # -- lifecycle --------------------------------------------------------

    def _check_open(self) -> None:
        """Raise when the engine was closed (caller holds the lock)."""
        if self._closed:
            raise TransferError(f"engine {getattr(self, 'session_id', self.hostname)} is closed")

    def close(self) -> None:
        """Wait for writes in flight, unregister all memory and release the engine; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            tickets = list(self._pending)
        # Nobody may be polling abandoned tickets: settle them here before the memory goes
        # (each is bounded by Mooncake's transfer timeout).
        for ticket in tickets:
            try:
                self.wait(ticket)
            except TransferError as exc:
                log.warning("closing %s: %s", self.session_id, exc)
        with self._lock:
            for addr in list(self._regions):
                rc = self._te.unregister_memory(addr)
                if rc != 0:
                    log.warning("unregistering 0x%x on %s failed (rc=%s)", addr, self.session_id, rc)
            self._regions.clear()
            self._owners.clear()
            te, self._te = self._te, None
        del te  # the TransferEngine's destructor stops its threads and listener

    def __enter__(self) -> "Engine":
        """Context-manager entry."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on exit."""
        self.close()

    def __repr__(self) -> str:
        """Session and protocol, for logs."""
        state = "closed" if self._closed else "open"
        return f"Engine({getattr(self, 'session_id', self.hostname)}, {self.protocol}, {state})"

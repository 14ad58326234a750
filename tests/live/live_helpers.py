"""Shared pieces of the live tests: deterministic items, rank processes driven by
command queues, a prefill rank in the test process, and a raw-ZMQ stand-in peer.

The rank processes are spawned (never forked: Mooncake and ZMQ own threads) and
stay free of torch, so one starts in well under a second; the test process keeps
torch for `transfer.harness.check_landed`. Every wait here is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import random
import secrets
import signal
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

# The byte receive slots hold before an ask (the harness's, so check_landed applies).
from transfer.harness import SENTINEL

HOST = "127.0.0.1"
#: The bootstrap token of the tests' servers: on a shared host, an encode rank of another
#: deployment still retrying its PUT against a port our server reused must not take over
#: our routes.
TOKEN = secrets.token_hex(8)
DTYPE = "torch.bfloat16"
#: How long a command to a rank process may take before the test fails.
COMMAND_TIMEOUT_S = 30.0

try:
    import mooncake.engine  # noqa: F401

    MOONCAKE_MISSING = ""
except ImportError as _error:  # pragma: no cover - depends on the host
    MOONCAKE_MISSING = f"mooncake.engine cannot be imported: {_error}"

#: Marks for every live test module: `pytestmark = LIVE`.
LIVE = [pytest.mark.live, pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING or "n/a")]

_ELEMENT = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4, "torch.uint8": 1, "torch.int8": 1}


def element_size(dtype: str) -> int:
    """Bytes per element of the dtypes the live tests use."""
    return _ELEMENT[dtype]


def item_bytes(room: int, nbytes: int, seed: int = 0) -> np.ndarray:
    """Room's deterministic item bytes (both ends derive them; distinct rooms differ)."""
    rng = np.random.default_rng([seed, room])
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


#: The item the sender pool tests send: SPAN rows of HIDDEN bf16 values, ROW bytes a row, ITEM in all.
SPAN = 4
HIDDEN = 256
ROW = HIDDEN * 2
ITEM = SPAN * ROW


def item_tensor(room: int, span: int, hidden: int, dtype: str = DTYPE, seed: int = 0):
    """Room's item as a torch tensor `[span, hidden]` (test process only)."""
    import torch

    raw = torch.from_numpy(item_bytes(room, span * hidden * element_size(dtype), seed))
    return raw.view(getattr(torch, dtype.removeprefix("torch."))).view(span, hidden)


def on_one_cpu(pid: int) -> list[int]:
    """Pins every thread of process `pid` to one CPU; returns its ZMQ I/O threads' ids (asserted found), which
    `stopped()` holds back across a resume."""
    cpu = min(os.sched_getaffinity(0))
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})
    io_threads = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as comm:
            if comm.read().startswith("ZMQbg/IO"):
                io_threads.append(int(tid))
    assert io_threads, f"no ZMQ I/O thread found in process {pid}"
    return io_threads


#: How long after a resume `stopped()` keeps ZMQ's I/O threads at SCHED_IDLE: the process's own threads
#: tick long before.
IDLE_AFTER_RESUME_S = 0.01


@contextlib.contextmanager
def stopped(pid: int, io_threads: list[int]) -> Iterator[None]:
    """Process `pid` stopped (SIGSTOP) for the block, its ZMQ I/O threads (`on_one_cpu()`) at SCHED_IDLE until
    IDLE_AFTER_RESUME_S after it resumes: what came meanwhile is handed over last, the worst order for the
    process's own threads."""
    os.kill(pid, signal.SIGSTOP)
    try:
        for tid in io_threads:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(IDLE_AFTER_RESUME_S)
    for tid in io_threads:
        with contextlib.suppress(PermissionError):  # an unprivileged thread may not leave SCHED_IDLE
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.01) -> bool:
    """Polls `predicate` until it is true or `timeout` seconds passed; returns its last truth."""
    end = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(interval)


def free_port() -> int:
    """A loopback port nobody listens on (bound and released a moment ago)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def port_rebindable(host: str, port: int, timeout: float = 2.0) -> bool:
    """True when a ZMQ socket can bind host:port again within `timeout` (ZMQ closes asynchronously)."""
    import zmq

    end = time.monotonic() + timeout
    while True:
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(f"tcp://{host}:{port}")
            return True
        except zmq.ZMQError:
            if time.monotonic() >= end:
                return False
            time.sleep(0.05)
        finally:
            sock.close(0)


def child_report(read_fd: int, pid: int, wait_s: float = 10.0) -> dict | None:
    """A forked child's JSON report read from `read_fd`, or None when it sent none within `wait_s` (the child
    is killed then); the child is reaped and the descriptor closed either way."""
    import json
    import select

    raw = b""
    try:
        ready, _, _ = select.select([read_fd], [], [], wait_s)
        raw = os.read(read_fd, 1 << 16) if ready else b""
    finally:
        if not raw:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(read_fd)
    return json.loads(raw) if raw else None


def in_forked_child(child: Callable[[], dict], locks: tuple = (), wait_s: float = 10.0) -> dict | None:
    """Forks, runs `child()` in the child and returns the JSON report it made (None when none came within
    `wait_s`: it hung); the child leaves without running anything of the parent's. `locks` are held across
    the fork, as a lock another thread holds at a fork is, for ever, in the child."""
    import json

    read_fd, write_fd = os.pipe()
    for lock in locks:
        lock.acquire()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            os.write(write_fd, json.dumps(child()).encode())
        finally:
            os._exit(0)
    for lock in locks:  # the parent's; the child's copies stay held
        lock.release()
    os.close(write_fd)
    return child_report(read_fd, pid, wait_s)


def outcomes(calls: dict[str, Callable[[], Any]], messages: bool = False) -> dict[str, str]:
    """Each call's outcome by name: "ok", or the name of the exception it raised (with its message)."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            out[name] = f"{type(exc).__name__}: {exc}" if messages else type(exc).__name__
    return out


def thread_stacks() -> str:
    """Every thread's current stack, for diagnosing a stall."""
    import sys

    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


def epd_threads() -> list[str]:
    """Names of the live threads our sender pools and session managers start."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("epd-"))


class LogCapture(logging.Handler):
    """Keeps the messages of `transfer.*` warnings and errors (installed in rank processes)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._lock_messages = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock_messages:
            self.messages.append(record.getMessage())

    def take(self) -> list[str]:
        """The messages so far."""
        with self._lock_messages:
            return list(self.messages)


# ------------------------------------------------------------- rank processes


def _serve(setup: Callable[[dict], Any], cfg: dict, ctrl, out) -> None:
    """Runs a rank process: `setup` builds its state; then it answers commands until `close`."""
    capture = LogCapture()
    logging.getLogger("transfer").addHandler(capture)
    logging.getLogger("transfer").setLevel(logging.WARNING)
    try:
        rank = setup(cfg)
        rank.capture = capture
        out.put(("ready", rank.hello()))
        parent = os.getppid()
        while True:
            try:
                command, args = ctrl.get(timeout=1.0)
            except queue_mod.Empty:
                if os.getppid() != parent:  # the test process died: do not linger
                    return
                continue
            try:
                reply = getattr(rank, "do_" + command)(*args)
            except Exception:  # noqa: BLE001 - the test must see it
                out.put(("error", traceback.format_exc()))
                continue
            out.put(("ok", reply))
            if command == "close":
                return
    except BaseException:  # noqa: BLE001 - the parent must hear about it
        out.put(("error", traceback.format_exc()))


class _EncodeRank:
    """State of an encode rank process: a Mooncake engine, a SenderPool, the items it sent."""

    def __init__(self, cfg: dict) -> None:
        from transfer.engine import Engine
        from transfer.sender import SenderPool

        self.engine = Engine(HOST, protocol=cfg.get("protocol", "tcp"))
        self.registered_before = dict(self.engine.registered())
        self.pool = SenderPool(
            self.engine, cfg.get("rank", 0), cfg.get("tp", 1), cfg.get("dp", 1), cfg["bootstrap"],
            host=HOST, token=cfg.get("token"), fanout_timeout_s=cfg.get("fanout_timeout_s", 60.0),
            register_timeout_s=cfg.get("register_timeout_s", 10.0), port=cfg.get("port", 0),
        )
        self.handles: dict[int, Any] = {}
        self.arenas: list[tuple[np.ndarray, int]] = []

    def hello(self) -> dict:
        return {"host": self.pool.host, "port": self.pool.port, "session": self.engine.session_id, "pid": os.getpid()}

    def _arena(self, nbytes: int) -> np.ndarray:
        """A registered source buffer of `nbytes` (kept until close)."""
        arena = np.empty(max(nbytes, 8), dtype=np.uint8)
        addr = arena.ctypes.data
        self.engine.register(addr, arena.nbytes)
        self.arenas.append((arena, addr))
        return arena

    def do_send(self, rooms: list[int], span: int, hidden: int, dtype: str = DTYPE, deepstack: int = 0) -> None:
        """Sends each room's item (and deepstack rows `hidden * deepstack` wide) from registered memory."""
        row = hidden * element_size(dtype)
        nbytes = span * row
        arena = self._arena(len(rooms) * nbytes)
        ds_arena = self._arena(len(rooms) * nbytes * deepstack) if deepstack else None
        for i, room in enumerate(rooms):
            arena[i * nbytes : (i + 1) * nbytes] = item_bytes(room, nbytes)
            ds = None
            if ds_arena is not None:
                ds_n = nbytes * deepstack
                ds_arena[i * ds_n : (i + 1) * ds_n] = item_bytes(room, ds_n, seed=1)
                ds = ds_arena.ctypes.data + i * ds_n
            self.handles[room] = self.pool.send(
                room, arena.ctypes.data + i * nbytes, ds, span=span, hidden=hidden, dtype=dtype,
                deepstack_hidden=hidden * deepstack if deepstack else None,
            )

    def do_wait(self, rooms: list[int], timeout: float) -> dict[int, tuple[str, str | None, float]]:
        """Waits (bounded overall) for each room; returns room -> (status, reason, seconds) and clears it."""
        end = time.monotonic() + timeout
        results = {}
        for room in rooms:
            handle = self.handles.pop(room)
            status = handle.wait(max(0.0, end - time.monotonic()))
            results[room] = (status.name, handle.failure, handle.latency_s)
            handle.clear()
        return results

    def do_logs(self) -> list[str]:
        return self.capture.take()

    def do_stacks(self) -> str:
        """Every thread's stack (to explain a stall)."""
        return thread_stacks()

    def do_state(self) -> dict:
        """What the pool still holds, for the no-state-left checks."""
        pool = self.pool
        arenas = {addr for _, addr in self.arenas}
        return {
            "items": len(pool._book.held), "asks": len(pool._core.parked), "table": len(pool._table),
            "waiting_for_asks": pool._core.parked_rooms,
            "temp_sources": len(pool._sources.counts), "pending_handles": len(self.handles),
            "extra_registrations": sorted(set(self.engine.registered()) - set(self.registered_before) - arenas),
            "dropped_statuses": pool._driver.statuses.dropped,
            "contexts_shared": _one_context(pool),
            "pushers": len(pool._driver.statuses),
        }

    def do_close(self) -> dict:
        """Closes the pool and reports what is left: threads, the port, registrations."""
        started = time.monotonic()
        in_flight = {room: h for room, h in self.handles.items()}
        self.pool.close()
        close_s = time.monotonic() - started
        failures = {room: (h.poll().name, h.failure) for room, h in in_flight.items()}
        for _, addr in self.arenas:
            self.engine.unregister(addr)
        facts = {
            "close_s": close_s,
            "threads": epd_threads(),
            "port_free": port_rebindable(self.pool.host, self.pool.port),
            "registered_back": self.engine.registered() == self.registered_before,
            "in_flight": failures,
        }
        self.engine.close()
        return facts


def _one_context(pool) -> bool:
    """True when every socket the pool opened belongs to the library's one ZMQ context."""
    from transfer import _io

    shared = _io.context()
    socks = [pool._driver.pull, *pool._driver.statuses._sockets.values()]
    return all(s.context is shared for s in socks)


def _encode_main(cfg: dict, ctrl, out) -> None:
    """Process body of an encode rank."""
    _serve(_EncodeRank, cfg, ctrl, out)


class _PrefillRank:
    """State of a prefill rank process: an engine, a SessionManager over a numpy slot arena."""

    def __init__(self, cfg: dict) -> None:
        from transfer.engine import Engine
        from transfer.receiver import SessionManager

        self.cfg = cfg
        self.row = cfg["hidden"] * element_size(cfg.get("dtype", DTYPE))
        self.slot_bytes = cfg["span"] * self.row
        self.arena = np.full(cfg["slots"] * self.slot_bytes, SENTINEL, dtype=np.uint8)
        self.engine = Engine(HOST, protocol=cfg.get("protocol", "tcp"))
        self.manager = SessionManager(
            self.engine, cfg.get("rank", 0), cfg.get("tp", 1), cfg.get("dp", 1),
            buffer=(self.arena.ctypes.data, self.arena.nbytes), host=HOST, deadline_s=cfg.get("deadline_s", 30.0),
            status_port=cfg.get("status_port", 0),
        )
        self.handles: dict[int, tuple[Any, int]] = {}
        self.next_slot = 0

    def hello(self) -> dict:
        return {"status_port": self.manager.status_port, "session": self.engine.session_id, "pid": os.getpid(),
                "arena": self.arena.ctypes.data, "slot_bytes": self.slot_bytes}

    def do_ask(self, rooms: list[int]) -> None:
        """Asks for each room's full span (identity) into its own slot."""
        for room in rooms:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
            ptr = self.arena.ctypes.data + slot * self.slot_bytes
            handle = self.manager.receive(
                room, self.cfg["bootstrap"], ptr, self.cfg["span"], self.cfg["hidden"], self.cfg.get("dtype", DTYPE),
            )
            self.handles[room] = (handle, slot)
        # Return once every TransferInfo went out (the room left Bootstrapping), bounded.
        from transfer.status import TransferPoll

        handles = [h for h, _ in self.handles.values()]
        if not wait_until(lambda: all(h.poll() != TransferPoll.Bootstrapping for h in handles), 10.0):
            raise TimeoutError("TransferInfos not sent within 10s")

    def do_wait(self, rooms: list[int], timeout: float) -> dict[int, tuple[str, str | None, bool]]:
        """room -> (status, reason, bytes equal the item's) after a bounded wait."""
        end = time.monotonic() + timeout
        results = {}
        for room in rooms:
            handle, slot = self.handles.pop(room)
            status = handle.wait(max(0.0, end - time.monotonic()))
            landed = self.arena[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]
            results[room] = (status.name, handle.failure, bool(np.array_equal(landed, item_bytes(room, self.slot_bytes))))
            handle.clear()
        return results

    def do_close(self) -> dict:
        self.manager.close()
        self.engine.close()
        return {"threads": epd_threads()}


def _prefill_main(cfg: dict, ctrl, out) -> None:
    """Process body of a prefill rank."""
    _serve(_PrefillRank, cfg, ctrl, out)


class RankProcess:
    """A rank in its own spawned process, driven by commands with bounded replies."""

    def __init__(self, body: Callable, cfg: dict, timeout: float = COMMAND_TIMEOUT_S) -> None:
        ctx = mp.get_context("spawn")
        self._ctrl, self._out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=body, args=(cfg, self._ctrl, self._out), daemon=True)
        self.proc.start()
        self.info: dict = self._reply("start", timeout)

    def _reply(self, what: str, timeout: float) -> Any:
        end = time.monotonic() + timeout
        while True:
            try:
                kind, value = self._out.get(timeout=0.1)
            except queue_mod.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"rank process died (exit {self.proc.exitcode}) during {what}") from None
                if time.monotonic() >= end:
                    raise TimeoutError(f"rank process did not answer {what} within {timeout:g}s") from None
                continue
            if kind == "error":
                raise RuntimeError(f"rank process failed during {what}:\n{value}")
            return value

    def call(self, command: str, *args: Any, timeout: float = COMMAND_TIMEOUT_S) -> Any:
        """Runs `command` in the rank process and returns its reply."""
        self._ctrl.put((command, args))
        return self._reply(command, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing gets to close."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self, timeout: float = COMMAND_TIMEOUT_S) -> dict | None:
        """Asks the rank to close and reports its facts; kills it when it does not exit."""
        facts = None
        if self.proc.is_alive():
            try:
                facts = self.call("close", timeout=timeout)
            finally:
                self.proc.join(10)
                if self.proc.is_alive():
                    self.kill()
        return facts

    def __enter__(self) -> RankProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bootstrap_server(token: str | None = TOKEN):
    """A BootstrapServer on an ephemeral loopback port, guarded by the tests' token."""
    from transfer.bootstrap import BootstrapServer

    return BootstrapServer(HOST, 0, token=token)


def encode_process(bootstrap: str, **cfg: Any) -> RankProcess:
    """An encode rank process registered with `bootstrap` (cfg: rank, tp, dp, token, fanout_timeout_s, port, ...)."""
    return RankProcess(_encode_main, {"bootstrap": bootstrap, "token": TOKEN, **cfg})


def prefill_process(bootstrap: str, **cfg: Any) -> RankProcess:
    """A prefill rank process (cfg: span, hidden, slots, rank, tp, dp, deadline_s, status_port)."""
    return RankProcess(_prefill_main, {"bootstrap": bootstrap, **cfg})


# ------------------------------------------------ a prefill rank in the test process


class Receiver:
    """A prefill rank in the test process: a SessionManager over sentinel-filled slots."""

    def __init__(
        self, engine, rank: int, tp: int, *, fanout: int, slots: int = 8, max_span: int = 16, hidden: int = 64,
        dtype: str = DTYPE, deepstack: int = 0, deadline_s: float = 30.0, dp: int = 1,
        lookup_timeout_s: float = 2.0, integrity: bool = True,
    ) -> None:
        import torch

        from transfer.receiver import SessionManager

        self.rank, self.fanout, self.hidden, self.dtype, self.deepstack = rank, fanout, hidden, dtype, deepstack
        torch_dtype = getattr(torch, dtype.removeprefix("torch."))
        self.slots = torch.empty((slots, max_span, hidden), dtype=torch_dtype)
        self.slots.view(torch.uint8).fill_(SENTINEL)
        self.ds_slots = None
        if deepstack:
            self.ds_slots = torch.empty((slots, max_span, hidden * deepstack), dtype=torch_dtype)
            self.ds_slots.view(torch.uint8).fill_(SENTINEL)
        self.manager = SessionManager(
            engine, rank, tp, dp, buffer=self.slots, deepstack_buffer=self.ds_slots, host=HOST, deadline_s=deadline_s,
            lookup_timeout_s=lookup_timeout_s, integrity=integrity,
        )
        self._next_slot = 0
        self.asked: dict[int, tuple[Any, int, int, int, int]] = {}

    def shard(self, span: int) -> tuple[int, int]:
        """This rank's (row_start, rows) of a span."""
        from transfer.frames import shard_rows

        return shard_rows(span, self.rank % self.fanout, self.fanout)

    def ask(self, room: int, bootstrap: str, span: int, *, hidden: int | None = None, dtype: str | None = None,
            claimed_span: int | None = None):
        """Asks for this rank's shard of `room`; `hidden`, `dtype` or `claimed_span` lie about the geometry."""
        slot = self._next_slot
        self._next_slot += 1
        claimed = span if claimed_span is None else claimed_span
        row_start, rows = self.shard(claimed)
        hidden = self.hidden if hidden is None else hidden
        ptr = self.slots[slot].data_ptr() + row_start * self.hidden * element_size(self.dtype)
        ds_dst = None
        if self.ds_slots is not None:
            ds_dst = self.ds_slots[slot, row_start : row_start + rows]
        handle = self.manager.receive(
            room, bootstrap, ptr, rows, hidden, dtype or self.dtype, row_start=row_start, span=claimed,
            deepstack_dst=ds_dst,
        )
        self.asked[room] = (handle, slot, span, row_start, rows)
        return handle

    def handle(self, room: int):
        return self.asked[room][0]

    def landed(self, room: int) -> str | None:
        """None when room's shard landed exactly and nothing outside it was touched (harness.check_landed)."""
        from transfer.harness import check_landed

        _, slot, span, row_start, rows = self.asked[room]
        bad = check_landed(self.slots[slot], item_tensor(room, span, self.hidden, self.dtype), row_start, rows)
        if bad is None and self.ds_slots is not None:
            want = item_tensor(room, span, self.hidden * self.deepstack, self.dtype, seed=1)
            bad = check_landed(self.ds_slots[slot], want, row_start, rows)
            bad = None if bad is None else f"deepstack: {bad}"
        return None if bad is None else f"room {room}: {bad}"

    def untouched(self, room: int) -> bool:
        """True when room's slot still holds only the sentinel."""
        import torch

        _, slot, *_ = self.asked[room]
        slots = [self.slots[slot]] + ([self.ds_slots[slot]] if self.ds_slots is not None else [])
        return all(bool((s.view(torch.uint8) == SENTINEL).all()) for s in slots)

    def wait(self, rooms, timeout: float) -> dict[int, tuple[str, str | None]]:
        """room -> (status, reason) after a bounded wait for all of them."""
        end = time.monotonic() + timeout
        return {r: (self.asked[r][0].wait(max(0.0, end - time.monotonic())).name, self.asked[r][0].failure) for r in rooms}

    def clear(self) -> None:
        """Clears every room asked for."""
        for handle, *_ in self.asked.values():
            handle.clear()
        self.asked.clear()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------ a raw-ZMQ stand-in peer


def pointer(value: int) -> bytes:
    """SPEC.md 4.1/4.2's pointer part: struct.pack("Q", p), native order."""
    return struct.pack("Q", value)


class RawPrefill:
    """A prefill rank built from raw ZMQ sockets and a real engine: crafts its own frames.

    It owns a real status PULL (to observe what the encode rank pushes) and a
    registered buffer, so an encode rank can really write into it.
    """

    def __init__(self, engine, encode_host: str, encode_port: int, nbytes: int) -> None:
        import torch
        import zmq

        self.engine = engine
        self.buffer = torch.full((nbytes,), SENTINEL, dtype=torch.uint8)
        engine.register(self.buffer)
        ctx = zmq.Context.instance()
        self.status = ctx.socket(zmq.PULL)
        self.status.setsockopt(zmq.LINGER, 0)
        self.status_port = self.status.bind_to_random_port(f"tcp://{HOST}")
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(f"tcp://{encode_host}:{encode_port}")

    @property
    def base(self) -> int:
        return self.buffer.data_ptr()

    def register(self, lengths: tuple[int, int] | None, deepstack_base: int = 0) -> list[bytes]:
        """Sends a registration (SPEC.md 4.1, plus section 8's lengths when given); returns its parts."""
        parts = [b"None", HOST.encode(), str(self.status_port).encode(), self.engine.session_id.encode(),
                 pointer(self.base), pointer(deepstack_base)]
        if lengths is not None:
            parts += [str(lengths[0]).encode(), str(lengths[1]).encode()]
        self.push.send_multipart(parts)
        return parts

    def ask(self, room: int, ptr: int, rows: int, hidden: int, span: int, *, dtype: str = DTYPE, fanout: int = 1,
            row_start: int = 0, deepstack_ptr: int = 0) -> list[bytes]:
        """Sends a TransferInfo (SPEC.md 4.2) built by hand; returns its parts."""
        parts = [str(room).encode(), HOST.encode(), str(self.status_port).encode(), self.engine.session_id.encode(),
                 pointer(ptr), pointer(deepstack_ptr), str(rows).encode(), str(hidden).encode(), dtype.encode(),
                 b"1" if deepstack_ptr else b"0", str(fanout).encode(), str(row_start).encode(), str(span).encode()]
        self.push.send_multipart(parts)
        return parts

    def statuses(self, count: int, timeout: float) -> list[list[bytes]]:
        """The next `count` status messages, or fewer when `timeout` passes first."""
        got: list[list[bytes]] = []
        end = time.monotonic() + timeout
        while len(got) < count:
            left = int((end - time.monotonic()) * 1000)
            if left <= 0 or not self.status.poll(left):
                break
            got.append(self.status.recv_multipart())
        return got

    def untouched(self) -> bool:
        return bool((self.buffer == SENTINEL).all())

    def close(self) -> None:
        self.push.close(0)
        self.status.close(0)
        self.engine.unregister(self.base)

    def __enter__(self) -> RawPrefill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def junk_pusher(host: str, port: int):
    """A raw PUSH connected to host:port (the caller closes it)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{host}:{port}")
    return sock


#: Every session a peer_with_64_mib() process had in this test process: an engine that wrote to one keeps
#: its connection to that host:port, and Mooncake fails every write to a new engine listening there.
_PEER_SESSIONS: set[str] = set()


def peer_with_64_mib():
    """A prefill engine in a process of its own with 64 MiB registered: (process, session, address).

    A 64 MiB write to it takes long enough to still be in flight when a test stops (SIGSTOP) it. Its
    session is one no earlier such peer of this test process had (a peer whose engine took an earlier
    one's port is replaced), so no engine here holds a connection to a process that is gone at its address.
    """
    import subprocess
    import sys

    for _ in range(10):
        peer = subprocess.Popen(
            [sys.executable, "-c", (
                "import time, torch\n"
                "from transfer.engine import Engine\n"
                "e = Engine('127.0.0.1', 'tcp'); buf = torch.zeros(64 << 20, dtype=torch.uint8); e.register(buf)\n"
                "print(e.session_id, buf.data_ptr(), flush=True)\n"
                "time.sleep(120)\n")],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        session, landing = peer.stdout.readline().split()
        if session not in _PEER_SESSIONS:
            _PEER_SESSIONS.add(session)
            return peer, session, int(landing)
        peer.kill()
        peer.wait(10)
    raise RuntimeError(f"ten peer engines in a row took ports earlier peers had: {sorted(_PEER_SESSIONS)}")


def stopped_peer(encode):
    """peer_with_64_mib(), stopped (SIGSTOP) once `encode` has written to it, so the handshake is done first.

    Returns (process, session, address); a write to it stays in flight until the process is
    continued (SIGCONT). The caller kills it. A peer the first write fails to is replaced, twice at most.
    """
    import torch

    from transfer.errors import EngineError

    tries = 3
    while True:
        peer, session, landing = peer_with_64_mib()
        try:
            warm = torch.zeros(64, dtype=torch.uint8)
            encode.register(warm)
            try:
                encode.write(session, [warm.data_ptr()], [landing], [64])
            finally:
                encode.unregister(warm.data_ptr())
            os.kill(peer.pid, signal.SIGSTOP)
            return peer, session, landing
        except BaseException as exc:
            peer.kill()
            peer.wait(10)
            tries -= 1
            # Mooncake keeps its connections to peers `encode` wrote to: a new peer listening where a gone one
            # did can meet that dead connection (its first write fails: end of file). Another peer, another port.
            if not isinstance(exc, EngineError) or not tries:
                raise


def cuda_mooncake_missing() -> str:
    """Why the CUDA tests cannot run here ("" where they can): they need a CUDA device and the CUDA
    build of Mooncake, whose tcp copies move device memory (the build without CUDA refuses it)."""
    import torch

    from transfer.doctor import mooncake_distributions

    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if not any(dist["flavour"].startswith("CUDA") for dist in mooncake_distributions()):
        return "needs the CUDA build of Mooncake (pip install mooncake-transfer-engine)"
    return ""


def status_socket(host: str, port: int) -> None:
    """A session manager whose status socket binds host:port (over the wire engine: no Mooncake needed)."""
    import torch

    from transfer.receiver import SessionManager
    from transfer.wire_engine import WireEngine

    with WireEngine(HOST) as engine:
        SessionManager(engine, 0, 1, buffer=torch.zeros(1024, dtype=torch.uint8), host=host, status_port=port).close()


def request_socket(host: str, port: int) -> None:
    """A sender pool whose request socket binds host:port (it binds before it registers anywhere)."""
    from transfer.sender import SenderPool
    from transfer.wire_engine import WireEngine

    with WireEngine(HOST) as engine:
        SenderPool(engine, 0, 1, 1, f"{HOST}:1", host=host, port=port, register_timeout_s=1).close()


@contextlib.contextmanager
def reaped(proc: Any) -> Iterator[Any]:
    """A child process (subprocess.Popen) killed and waited for on the way out, if it is still running then."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ------------------------------------------------ a hostile peer's mutations of valid input


#: Parts a hostile peer tries in place of a number or a text.
ODD_PARTS = [b"", b"NaN", b"inf", b"-inf", b"-1", b"+5", b" 1", b"1_0", b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80",
             b"9223372036854775808", b"18446744073709551616", b"-9223372036854775809", b"0" * 4000 + b"7",
             b"9" * 4400]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """`data` with up to four edits: a bit flipped, bytes inserted, deleted or duplicated, a cut, or an odd part."""
    b = bytearray(data)
    for _ in range(rng.randint(0, 4)):
        op = rng.choice(["flip", "insert", "delete", "cut", "duplicate", "odd"])
        if op == "flip" and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == "insert":
            at = rng.randint(0, len(b))
            b[at:at] = rng.choice([rng.randbytes(rng.randint(1, 4)), b"\n", b"\r\n", b"=", b"\xff", b"{", b'"'])
        elif op == "delete" and b:
            at = rng.randrange(len(b))
            del b[at:at + rng.randint(1, 4)]
        elif op == "cut":
            del b[rng.randint(0, len(b)):]
        elif op == "duplicate" and b:
            start = rng.randrange(len(b))
            end = rng.randint(start, len(b))
            b[end:end] = b[start:end]
        elif op == "odd":
            b = bytearray(rng.choice(ODD_PARTS))
    return bytes(b)


def mutate_parts(parts: list[bytes], rng: random.Random) -> list[bytes]:
    """`parts` with at least one edit: a part mutated, dropped, duplicated or added, the list cut or grown."""
    parts = list(parts)
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(["part", "part", "drop", "duplicate", "add", "cut", "many"])
        if op == "part" and parts:
            at = rng.randrange(len(parts))
            parts[at] = mutate_bytes(parts[at], rng)
        elif op == "drop" and parts:
            del parts[rng.randrange(len(parts))]
        elif op == "duplicate" and parts:
            at = rng.randrange(len(parts))
            parts.insert(at, parts[at])
        elif op == "add":
            parts.insert(rng.randint(0, len(parts)), rng.choice(ODD_PARTS))
        elif op == "cut":
            parts = parts[:rng.randint(0, len(parts))]
        elif op == "many":
            parts += [b"1"] * rng.randint(1, 100)
    return parts or [b""]  # ZMQ sends no message of no parts


def take_all(take: Callable[[int], tuple[list, Any, bool]], count: int, kind: str, most: int = 64,
             timeout: float = 10.0) -> list:
    """What a take call (`take(most)`: `_io.take_statuses` or `_io.take_asks` on a socket) hands over for
    `count` messages, in order: (kind, item) for each it took, ("message", frames) for each it left to the
    general path. A message over the bounds, discarded, counts for neither."""
    got: list = []
    deadline = time.monotonic() + timeout
    taken = 0
    while taken < count:
        items, frames, empty = take(min(most, count - taken))
        got += [(kind, item) for item in items]
        taken += len(items)
        if frames is not None:
            got.append(("message", frames))
            taken += 1
        if empty and taken < count:
            assert time.monotonic() < deadline, f"{taken} of {count} messages arrived: {got}"
            time.sleep(0.001)
    return got

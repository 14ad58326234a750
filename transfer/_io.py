"""Plumbing shared by the sender pool and the session manager: one ZMQ context per
process, a cross-thread wake-up for zmq.Poller loops, bounded status pushers, and
helpers that turn tensors or raw pointers into memory regions."""

from __future__ import annotations

import errno
import ipaddress
import logging
import math
import os
import select
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import zmq

from transfer import config
from transfer._forks import forks, free_in_child
from transfer.core.failure import FailureKind, without_room
from transfer.errors import ConfigError, ConfigTypeError, ListenError, PortsInUse
from transfer.frames import TransferInfo, host_text
from transfer.ports import PortSpec, bare_host, bind_port, cannot_listen, is_wildcard, listen_error
from transfer.status import TransferPoll

if TYPE_CHECKING:
    from transfer.core.failure import Failure
    from transfer.metrics import Metrics
    from transfer.status import RoomTable, TransferPoll

log = logging.getLogger("transfer")

#: Largest control-plane message our listeners take, all its parts together. A
#: TransferInfo is about 200 bytes; 64 KiB is generous. ZMQ_MAXMSGSIZE holds each part
#: to it (ZMQ drops the connection of a peer sending a bigger part); recv_frames()
#: discards a whole message over it unparsed.
MAX_CONTROL_MESSAGE = 64 << 10

#: Most parts a control-plane message may have: SPEC.md's largest has 13, and the few
#: extension parts peers add are ignored, so more is a peer building lists of junk.
MAX_CONTROL_PARTS = 64

#: Statuses queued for one receiver before further pushes are dropped: a dead
#: prefill rank must never make the sender block.
STATUS_HWM = 4096

#: Sockets our ZMQ context may hold, set explicitly rather than left at libzmq's 1023:
#: status connections, asks' sockets and their monitors all count.
CONTEXT_MAX_SOCKETS = 4096

#: Status connections one process keeps at most, well below CONTEXT_MAX_SOCKETS (and a
#: quarter of the descriptors the process may open: each costs a socket and a signaler).
#: Past it the least recently used is closed: a new receiver is always served.
MAX_STATUS_CONNECTIONS = 512

#: A status connection unused this long is closed: its receiver's rooms are over, and a
#: dead one's reconnection attempts stop.
STATUS_IDLE_S = 60.0

#: How long a new status connection may take to come up; its statuses wait that long,
#: then the endpoint counts as unreachable: they are dropped and the socket closed.
STATUS_CONNECT_S = 5.0

#: Longest pause between reconnection attempts of a status connection that went down
#: (ZMQ starts at 100 ms and doubles): a restarted receiver is reached within it.
STATUS_RECONNECT_MAX_MS = 1000

#: The longest a connection attempt of ours waits for its peer's answer before ZMQ makes a
#: new one (when EPD_ZMQ_TCP_TIMEOUT_S is on): an attempt whose SYN was lost while a link was
#: down is replaced this soon after the link is back, not at the end of the kernel's SYN
#: back-off (about 2 minutes).
CONNECT_TIMEOUT_MS = 2000

#: Bounds a connection that went dead (see EPD_ZMQ_TCP_TIMEOUT_S in transfer.config).
TCP_TIMEOUT_ENV = "EPD_ZMQ_TCP_TIMEOUT_S"

#: Messages our listeners queue per connected peer before ZMQ stops reading from it:
#: a peer that sends faster than we drain meets back-pressure (its own sends fill up)
#: instead of growing our memory without bound; other peers' connections are unaffected.
LISTENER_HWM = 4096


#: Set to 0 (or false, no, off) to leave the library's ZMQ I/O thread under the default
#: scheduling policy (transfer.config).
SCHED_BATCH_ENV = "EPD_ZMQ_SCHED_BATCH"

_context: zmq.Context | None = None
_context_pid = 0
_tcp_timeout_ms = 0  # EPD_ZMQ_TCP_TIMEOUT_S, read with the context
_context_lock = free_in_child(threading.Lock())




def context() -> zmq.Context:
    """The library's ZMQ context: one per process, shared by every socket we open.

    Its I/O thread (which moves every ask and status) runs under SCHED_BATCH where the
    OS has it, unless EPD_ZMQ_SCHED_BATCH=0: it still gets its full share of a CPU, but
    waking it (every send does) does not preempt the thread that sent, which is the
    engine's scheduler thread for an ask: on a busy host that thread keeps running
    instead of being switched out at each send. The context is ours, not
    zmq.Context.instance(), so the engine's own sockets keep the policy they had. A
    process forked after first use makes its own (ZMQ contexts do not survive fork).
    EPD_ZMQ_TCP_TIMEOUT_S is read with it, once a process, for every connection push_socket() makes.
    """
    global _context, _context_pid, _tcp_timeout_ms
    with _context_lock:
        if _context is None or _context_pid != os.getpid():
            batch = getattr(os, "SCHED_BATCH", None) if config.resolve(SCHED_BATCH_ENV) else None
            _tcp_timeout_ms = math.ceil(config.resolve(TCP_TIMEOUT_ENV) * 1000)
            ctx = zmq.Context()
            ctx.set(zmq.MAX_SOCKETS, CONTEXT_MAX_SOCKETS)
            if batch is not None:
                ctx.set(zmq.THREAD_SCHED_POLICY, batch)
            _context, _context_pid = ctx, os.getpid()
        return _context


def is_ip(host: str) -> bool:
    """Whether `host` is an IP address, not a name: an address as it is, or inside one pair of brackets.

    ZMQ removes one enclosing pair and looks up whatever else it is given as a name, so a
    stray or doubled bracket (`10.0.0.1]`, `[[::1]]`) is not an address."""
    if host[:1] == "[" and host[-1:] == "]":
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def peer_address(host: str, what: str) -> str:
    """`host` as the IP address peers reach this process on: an IP as it is, a name looked up once
    here (a `:port` suffix, as Mooncake takes, is dropped). Names never go on the wire: a peer's
    ZMQ would look them up on its I/O thread, stalling every socket of its process."""
    bare = bare_host(host)
    if is_ip(bare):
        address = bare
    else:
        try:
            infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as error:
            raise ConfigError(f"{what} {host!r} does not resolve ({error}): give this node's IP address") from None
        address = str(infos[0][4][0])
    if is_wildcard(address):
        raise ConfigError(f"{what} {host!r} is a wildcard address: peers are given it to connect to, and "
                          f"there it would name their own host; give this node's IP address (the one peers "
                          f"reach it on)")
    return address


def zmq_host(host: str) -> str:
    """`host` as ZMQ wants it in a tcp:// address (IPv6 literals bracketed)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Waker:
    """A self-pipe that any thread can set to wake a zmq.Poller loop.

    `_armed` is a plain attribute: the GIL makes its reads and writes atomic, and a
    wake() that loses a race with drain() only ever leaves an extra byte in the pipe
    (the next poll returns at once) or a wake-up whose work the drainer is about to
    look at anyway.
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._armed = False
        # A wake() racing close() must not write into whatever file reuses the descriptor.
        self._closing = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        """The read end, to register with a zmq.Poller."""
        return self._r

    def wake(self) -> None:
        """Makes the read end readable (at most one byte pending at a time)."""
        if not self._armed:
            self._armed = True
            with self._closing:
                if self._closed:
                    return
                try:
                    os.write(self._w, b"!")
                except BlockingIOError:
                    pass

    def pending(self) -> bool:
        """Whether a wake-up is waiting to be drained (no system call)."""
        return self._armed

    def drain(self, readable: bool = True) -> bool:
        """Consumes the pending wake-up (True if there was one); call before looking at the work queue.

        With `readable=False` (the caller has not seen the pipe readable) it reads the
        pipe only when a wake-up is pending: a byte left by a wake() that raced the last
        drain makes the pipe readable, and the caller's poll then says so. The pipe is
        emptied before the flag is cleared: the other order lets a wake() in between lose
        its byte while leaving the flag set, silencing every later wake().
        """
        if not readable and not self._armed:
            return False
        woken = False
        try:
            while os.read(self._r, 512):
                woken = True
        except BlockingIOError:
            pass
        self._armed = False
        return woken

    def close(self) -> None:
        """Closes both ends; later wake()s do nothing."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            for fd in (self._r, self._w):
                try:
                    os.close(fd)
                except OSError:
                    pass


class ControlListener(zmq.Socket):
    """A PULL socket for control-plane messages from peers: recv_frames() holds each whole
    message to MAX_CONTROL_MESSAGE bytes and MAX_CONTROL_PARTS parts."""


class _SocketPortInUse(PortsInUse, zmq.ZMQError):  # type: ignore[misc]  # strerror: OSError sets it to the text
    """PortsInUse from a ZMQ socket's one port: also the zmq.ZMQError such a bind raised before, so a caller
    that catches that still does (catch PortsInUse, as for the other listeners)."""


class _SocketListenError(ListenError, zmq.ZMQError):  # type: ignore[misc]  # strerror: OSError sets it to the text
    """ListenError from a ZMQ socket: also the zmq.ZMQError such a bind raised before, so a caller that
    catches that still does (catch ListenError, as for the other listeners)."""


def pull_socket(host: str, port: PortSpec, what: str = "control socket") -> tuple[zmq.Socket, int]:
    """A ControlListener bound to exactly `host` on `port` (0: any free one; a range: its first free
    one, see transfer.ports); returns it and its port. A bind's error names `what`, its address and
    what to do, as the other listeners' do: PortsInUse (errno kept, so a range passes the port over)
    for a port in use, ConfigError for an address these sockets cannot listen on (not of this host, or
    IPv6: they listen on IPv4 only), else ListenError with ZMQ's errno (both PortsInUse and ListenError
    also zmq.ZMQError)."""
    sock = context().socket(zmq.PULL, socket_class=ControlListener)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
    sock.setsockopt(zmq.RCVHWM, LISTENER_HWM)
    base = f"tcp://{zmq_host(host)}"

    def bind(number: int) -> int:
        address = f"{base}:{number or '*'}"
        try:
            if number == 0:
                return sock.bind_to_random_port(base)
            sock.bind(address)
        except zmq.ZMQError as error:  # ZMQ's own text names neither the listener nor, for a port, its address
            why = zmq.strerror(error.errno) if error.errno else error.strerror  # without pyzmq's "(addr=...)"
            bound = OSError(error.errno, why)
            if error.errno == errno.ENODEV:  # ZMQ took the host for an interface name: not an IPv4 address
                raise ConfigError(f"{cannot_listen(what, host, number, bound)}: give an IPv4 address of this host "
                                  f"(the one peers reach it on; these sockets do not listen on IPv6)") from None
            problem = listen_error(what, host, number, bound)
            if isinstance(problem, PortsInUse):
                raise _SocketPortInUse(problem.errno, problem.strerror) from None
            if isinstance(problem, ListenError):
                raise _SocketListenError(problem.errno, problem.strerror) from None
            raise problem from None
        return number

    try:
        return sock, bind_port(port, bind, f"{what} on {host}")
    except BaseException:
        sock.close()
        raise


def push_socket(host: str, port: int, hwm: int = STATUS_HWM, immediate: bool = False,
                reconnect_max_ms: int = 0) -> zmq.Socket:
    """A PUSH socket connected to host:port that never blocks the sender for long.

    With `immediate`, messages are queued only while a connection is up (sending
    meanwhile raises zmq.Again), and what was queued dies with the connection: ZMQ
    otherwise keeps it and hands it to whoever listens at that address next.
    `reconnect_max_ms` > 0 lets the pause between reconnection attempts double up to it.
    Under EPD_ZMQ_TCP_TIMEOUT_S (on by default) a connection whose sent data goes unacknowledged
    that long (TCP_USER_TIMEOUT, through ZMQ_TCP_MAXRT), or whose attempt goes unanswered for
    CONNECT_TIMEOUT_MS, is dropped and made again: once a dead link is back, ZMQ reconnects
    within about a second instead of waiting out TCP's retransmission back-off. Neither puts
    anything on the wire: the peer needs nothing of its own.
    zmq.ZMQError when the address cannot be connected to (a malformed host, or a name
    rather than an IP address); no socket is left behind then.
    """
    if not is_ip(host):
        # ZMQ would look the name up on its one I/O thread, holding every socket of the process.
        raise zmq.ZMQError(errno.EINVAL, f"host {host_text(host)!r} is not an IP address (peers are reached by IP, "
                                         f"SPEC.md 4.1)")
    address = f"tcp://{zmq_host(host)}:{port}"
    sock = context().socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.SNDTIMEO, 0)
        if ":" in host:  # ZMQ connects a socket to an IPv6 address only with this set; IPv4 ones keep its default
            sock.setsockopt(zmq.IPV6, 1)
        if immediate:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if reconnect_max_ms > 0:
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_max_ms)
        if _tcp_timeout_ms > 0:
            sock.setsockopt(zmq.TCP_MAXRT, _tcp_timeout_ms)
            sock.setsockopt(zmq.CONNECT_TIMEOUT, min(_tcp_timeout_ms, CONNECT_TIMEOUT_MS))
        sock.connect(address)
    except zmq.ZMQError:
        sock.close(0)
        raise
    return sock


def watch_drops(sock: zmq.Socket) -> zmq.Socket:
    """A socket that reports each connection `sock` loses (read it with dropped()).

    Nothing polls it: it is read under the same lock as the sends on `sock`, so a send
    after a reconnection always sees the drop first (ZMQ reconnects 100 ms or more later).
    """
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def dropped(monitor: zmq.Socket) -> bool:
    """Whether the watched socket lost a connection since the last call (drains the reports)."""
    lost = False
    if _NATIVE is not None:
        # recv_frames()'s first read, without its call: a monitor with no report (nearly every ask) ends here.
        try:
            if _NATIVE.zmq_recv_parts(monitor.underlying) is None:
                return False
        except OSError as exc:
            raise _zmq_error(exc) from None
        lost = True
    while recv_frames(monitor) is not None:
        lost = True
    return lost


def close_watched(sock: zmq.Socket, monitor: zmq.Socket | None, linger_ms: int = 0) -> None:
    """Closes `sock` and the socket watching it, discarding what either still queues (after
    `linger_ms` for `sock`'s)."""
    if monitor is not None:
        sock.disable_monitor()
        monitor.close(0)
    sock.close(linger_ms)


# pyzmq's Python-level Socket.send/get wrappers cost more than libzmq itself for our
# small parts; the Cython methods underneath take the same arguments.
_send = getattr(zmq.backend.Socket, "send", zmq.Socket.send)
_recv = getattr(zmq.backend.Socket, "recv", zmq.Socket.recv)
# Only int options (EVENTS, RCVMORE) are read through _get.
_get = cast("Callable[[zmq.Socket, int], int]", getattr(zmq.backend.Socket, "get", zmq.Socket.get))
_MORE = zmq.SNDMORE | zmq.NOBLOCK


def _native_parts() -> Any:
    """transfer._native bound to the libzmq that pyzmq loaded, for whole messages in one
    call (a 13-part TransferInfo is received in about 1 us, against 23 us through pyzmq's
    per-part calls); None where it cannot be bound, and pyzmq's calls serve instead."""
    try:
        import ctypes
        import importlib

        from . import _native

        try:  # pyzmq 26 on has the whole backend in one module
            backend = importlib.import_module("zmq.backend.cython._zmq")
        except ImportError:  # pyzmq 25: its socket module links libzmq as well
            backend = importlib.import_module("zmq.backend.cython.socket")

        if zmq.zmq_version_info()[0] != 4:  # the message layout zmqmsg.c assumes
            return None
        # The extension's own scope finds the libzmq it was linked with, whatever its file is called.
        lib = ctypes.CDLL(backend.__file__)
        names = ("zmq_msg_init", "zmq_msg_recv", "zmq_msg_close", "zmq_msg_data", "zmq_msg_size",
                 "zmq_msg_more", "zmq_send", "zmq_errno")
        _native.zmq_bind(*(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0 for name in names))
        return _native
    except (ImportError, OSError, AttributeError, ValueError):
        return None


_NATIVE = _native_parts()


def _zmq_error(exc: OSError) -> zmq.ZMQError:
    return zmq.Again() if exc.errno == zmq.EAGAIN else zmq.ZMQError(exc.errno)


def send_frames(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Queues one multipart message without blocking (zmq.Again when the queue is full).

    A part that is not bytes (TypeError) or a message of no part (ValueError) is refused before
    anything is queued. When it raises, nothing of the message was delivered: a full queue refuses
    the first part, and a later part is refused only when the peer's pipe went away mid-message, which
    makes libzmq drop the message's remaining parts; they are handed over for that drop to end
    with this message rather than swallow the next one.
    """
    if _NATIVE is not None and type(frames) is list:
        try:
            _NATIVE.zmq_send_parts(sock.underlying, frames)
        except OSError as exc:
            raise _zmq_error(exc) from None
        return
    # Checked before the first part goes, as the native call does: a part queued with more to come
    # would otherwise be the head of the next message sent on this socket.
    if not frames:
        raise ConfigError("a message has at least one part")
    for i, frame in enumerate(frames):
        if not isinstance(frame, bytes):
            raise ConfigTypeError(f"part {i} is {type(frame).__name__}, not bytes")
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        try:
            _send(sock, frame, _MORE if i < last else zmq.NOBLOCK)
        except zmq.ZMQError:
            for j in range(i + 1 if i > 0 else len(frames), len(frames)):
                try:
                    _send(sock, frames[j], _MORE if j < last else zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the drop under way: nothing to report beyond the first failure
            raise


def send_ask(sock: zmq.Socket, info: TransferInfo) -> None:
    """send_frames(sock, info.to_frames()): a plain ask's parts encoded and queued natively, in one call
    (native/ask.c holds to_frames()'s plain case), any other through to_frames() and send_frames()."""
    if _NATIVE is not None:
        try:
            if _NATIVE.ask_send(sock.underlying, info, TransferInfo) is not None:
                return
        except OSError as exc:
            raise _zmq_error(exc) from None
    send_frames(sock, info.to_frames())


def readable(sock: zmq.Socket) -> bool:
    """Whether a message is queued on sock (never blocks)."""
    return bool(_get(sock, zmq.EVENTS) & zmq.POLLIN)


def oversized(sizes: list[int], max_bytes: int = MAX_CONTROL_MESSAGE, max_parts: int = MAX_CONTROL_PARTS) -> bool:
    """Whether a message with parts of these sizes is over the control plane's bounds."""
    return len(sizes) > max_parts or sum(sizes) > max_bytes


def recv_frames(sock: zmq.Socket) -> list[bytes] | None:
    """One multipart message without blocking, or None when none is queued.

    On a ControlListener, messages over MAX_CONTROL_MESSAGE bytes or MAX_CONTROL_PARTS
    parts are discarded unparsed (counted in `oversized_dropped`, warned about
    once a second) and the next one is returned: None must mean the socket is empty,
    or a poll loop waiting on ZMQ's edge-triggered FD would sleep on queued messages.
    The pyzmq path asks ZMQ_EVENTS first, so draining a socket ends without raising
    (and building) a zmq.Again, which cost more than a message.
    """
    while True:
        frames = _recv_or_discard(sock)
        if frames is not _DISCARDED:
            return frames  # type: ignore[return-value]


#: What _recv_or_discard() answers for a message it discarded for its size.
_DISCARDED = object()


def _recv_or_discard(sock: zmq.Socket) -> list[bytes] | None | object:
    """recv_frames()'s one read: a message, None when none is queued, or _DISCARDED for one it discarded
    (counted and warned about) for its size."""
    if _NATIVE is not None:
        try:
            frames = (_NATIVE.zmq_recv_parts(sock.underlying, MAX_CONTROL_MESSAGE, MAX_CONTROL_PARTS)
                      if type(sock) is ControlListener else _NATIVE.zmq_recv_parts(sock.underlying))
        except OSError as exc:
            raise _zmq_error(exc) from None
        if type(frames) is not tuple:
            return frames
        total, parts = frames
    else:
        if not readable(sock):
            return None
        try:
            frames = [_recv(sock, zmq.NOBLOCK)]
            while _get(sock, zmq.RCVMORE):
                frames.append(_recv(sock, zmq.NOBLOCK))
        except zmq.Again:
            return None
        if type(sock) is not ControlListener:
            return frames
        sizes = [len(frame) for frame in frames]
        if not oversized(sizes):
            return frames
        total, parts = sum(sizes), len(sizes)
    _dropped_oversized(total, parts)
    return _DISCARDED


def _dropped_oversized(total: int, parts: int) -> None:
    """Counts and warns of a control message discarded for its size."""
    global oversized_dropped
    with _oversized_lock:
        oversized_dropped += 1
    _complaints.warning("oversized", "dropped a control message of %d bytes in %d parts: the "
                        "bounds are %d bytes and %d parts in all", total, parts,
                        MAX_CONTROL_MESSAGE, MAX_CONTROL_PARTS)


_SUCCESS = int(TransferPoll.Success)


def take_statuses(sock: zmq.Socket, lanes: dict[int, int],
                  most: int) -> tuple[list[int], list[bytes] | None, bool]:
    """Reads a status socket (a ControlListener) without blocking, settling lanes (transfer.core.lane).

    Takes the rooms the statuses read settle out of `lanes`, in order, up to `most` messages or
    the first message that settles none: returns those rooms, that message (None if none), and
    whether the socket is empty. Natively every lane's Success is read, matched and settled in
    one call; without the native core each call reads one message as recv_frames() does and
    leaves lanes alone, which the general path then takes."""
    if _NATIVE is None:
        return _one_message(sock)
    return _taken(_NATIVE.lane_take, sock, lanes, _SUCCESS, most)


def take_asks(sock: zmq.Socket, most: int) -> tuple[list[TransferInfo], list[bytes] | None, bool]:
    """Reads a request socket (a ControlListener) without blocking, parsing its plain asks.

    Returns the TransferInfos of the plain asks read in order (TransferInfo's plain case: 13 or
    14 bytes parts, well formed), up to `most` messages or the first message that is not one;
    that message (None if none: a registration, a cancel, or an ask the strict parser takes);
    and whether the socket is empty. Natively the asks are read and parsed in one call; without
    the native core each call reads one message as recv_frames() does, for the general path."""
    if _NATIVE is None:
        return _one_message(sock)
    return _taken(_NATIVE.ask_take, sock, TransferInfo, most)


def _one_message(sock: zmq.Socket) -> tuple[list, list[bytes] | None, bool]:
    """What a take call reads without the native core: one message, for the general path, or one discarded
    for its size (then none, with the socket not empty, as natively): a caller counts it among those read."""
    frames = _recv_or_discard(sock)
    if frames is _DISCARDED:
        return [], None, False
    return [], frames, frames is None  # type: ignore[return-value]


def _taken(take: Callable[..., tuple], sock: zmq.Socket, *args: object) -> tuple[list, list[bytes] | None, bool]:
    """What a native take call (epd_zmq_take's: lane_take, ask_take) read off a ControlListener."""
    try:
        taken, frames, empty = take(sock.underlying, *args, MAX_CONTROL_MESSAGE, MAX_CONTROL_PARTS)
    except OSError as exc:
        raise _zmq_error(exc) from None
    if type(frames) is tuple:  # over the bounds: discarded unread
        _dropped_oversized(*frames)
        return taken, None, False
    return taken, frames, empty


class ThrottledLog:
    """Warnings about what peers send, throttled per kind and in all, in bounded memory.

    A misconfigured or hostile peer can send thousands of bad messages a second, under
    one kind of complaint (a key the caller picks, such as the error text) or under
    many (a key holding a number the peer varies). A kind is logged the first time,
    then at most once per `interval_s` with a count of the repeats left out; and at most
    `max_lines` lines are logged per interval in all: what the budget leaves out is
    counted, and the first warning of a later interval says how many. Only the
    `max_kinds` kinds seen most recently are remembered, by hash, so neither many keys
    nor long ones grow memory; a forgotten kind's repeats go into that count too. So do
    the repeats of a kind that has not come back since its interval passed: a later
    interval's first warning, of any kind, or flush() (at close) tells them.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0, max_kinds: int = 256,
                 max_lines: int = 10) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._max_kinds = max_kinds
        self._max_lines = max_lines
        self._kinds: OrderedDict[int, list] = OrderedDict()  # hash -> [next time it may log, repeats left out]
        self._window_ends = -math.inf  # the interval the line budget counts in
        self._lines = 0  # logged in this interval
        self._untold = 0  # left out by the budget or with forgotten kinds, not yet told
        self._lock = threading.Lock()

    def warning(self, key: object, msg: str, *args: object) -> None:
        """Logs `msg % args` unless its kind or the line budget says to count it instead."""
        now = time.monotonic()
        told = None
        repeats = 0
        since = 0.0
        with self._lock:
            kind = hash(key)
            if now >= self._window_ends:
                told, self._untold = self._untold, 0
                self._window_ends, self._lines = now + self._interval_s, 0
                repeats = self._take_repeats(now, kind)  # this kind's own line tells its own
            entry = self._kinds.get(kind)
            if entry is not None:
                self._kinds.move_to_end(kind)
            if entry is not None and now < entry[0]:
                entry[1] += 1
                left_out = None
            elif self._lines >= self._max_lines:
                if entry is not None:
                    entry[1] += 1  # told with the kind's next line
                else:
                    self._untold += 1
                left_out = None
            else:
                self._lines += 1
                if entry is None:
                    left_out = 0
                    if len(self._kinds) >= self._max_kinds:
                        self._untold += self._kinds.popitem(last=False)[1][1]
                    entry = self._kinds[kind] = [0.0, 0]
                else:  # its repeats came since its last line, however long ago that was
                    left_out, since = entry[1], now - (entry[0] - self._interval_s)
                entry[0], entry[1] = now + self._interval_s, 0
        self._tell(told, repeats)
        if left_out is None:
            return
        if left_out:
            msg += " (and %d more like it in the last %.1fs, not logged)"
            args += (left_out, since)
        self._logger.warning(msg, *args)

    def flush(self) -> None:
        """Logs the count of every warning left out and not told yet (at most two lines): for a close,
        after which no later warning would tell them."""
        with self._lock:
            told, self._untold = self._untold, 0
            repeats = self._take_repeats(math.inf)
        self._tell(told, repeats)

    def _take_repeats(self, now: float, but: int | None = None) -> int:
        """The repeats left out of the kinds whose interval passed by `now` (but kind `but`), now told
        here rather than by their kind's next line (lock held)."""
        taken = 0
        for kind, entry in self._kinds.items():
            if entry[1] and now >= entry[0] and kind != but:
                taken += entry[1]
                entry[1] = 0
        return taken

    def _tell(self, told: int | None, repeats: int) -> None:
        """Logs the counts of warnings left out: by the line budget (or forgotten), and repeats."""
        if told:
            self._logger.warning("%d more warnings were not logged: at most %d lines are logged per %gs",
                                 told, self._max_lines, self._interval_s)
        if repeats:
            self._logger.warning("%d more warnings were not logged: repeats of kinds logged at most once per %gs "
                                 "that did not come back since", repeats, self._interval_s)


def count_concluded(metrics: Metrics, failures: ThrottledLog, room: int, succeeded: bool, failure: Failure | None,
                    latency_s: float, success_counts: dict[str, float] | None = None) -> None:
    """Counts a room that concluded: a Success with its latency and `success_counts` (its bytes, ...) in one
    update of `metrics`, which no read sees in part; or a Failed by its kind, logged (throttled per kind) as
    `room N failed: ...`, its detail's own leading `room N: ` left out."""
    if succeeded:
        counts: dict[str, float] = {"rooms_succeeded_total": 1, **(success_counts or {})}  # no update() call
        metrics.inc_all(counts, {"room_latency_seconds": latency_s})
    else:
        kind = failure.kind if failure is not None else FailureKind.OTHER
        metrics.inc("rooms_failed_total", reason=kind.value)
        failures.warning(kind, "room %d failed: %s", room, without_room(room, str(failure)))


#: Control messages recv_frames() discarded for their size, in this process.
oversized_dropped = 0
_oversized_lock = free_in_child(threading.Lock())
_complaints = ThrottledLog(log)


def seconds_left(deadline: float, most: float) -> float:
    """Seconds from now (time.monotonic()) to `deadline`, at most `most`, at least 0: one wait's share of
    a bound that several waits take turns at (a close()'s)."""
    return max(0.0, min(most, deadline - time.monotonic()))


#: How long a caller's call waits for a lock its side's own threads take only for short steps (the
#: prefill driver's, the encode side's source registrations): past it, the holder is stuck (an engine call,
#: a device, a log handler that does not return) and the call raises instead of joining it.
LOCK_WAIT_S = 5.0


def threads_inside(holds: Callable[[Any], bool]) -> str:
    """The other threads with a call on an object `holds` accepts (a frame whose `self` it is) on their stack,
    each named with where it is now; for the error of a call that found a lock held too long (not a hot path)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    found = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        inner: Any = frame
        while inner is not None:
            try:
                inside = holds(inner.f_locals.get("self"))
            except Exception:  # noqa: BLE001 - an object whose attributes raise is no holder
                inside = False
            if inside:
                code = frame.f_code
                found.append(f"thread {names.get(ident, ident)} at {os.path.basename(code.co_filename)}:"
                             f"{frame.f_lineno} in {code.co_name}()")
                break
            inner = inner.f_back
    return "; ".join(found) or "no thread inside its calls now (a thread that took the lock directly?)"


def status_connection_limit(wanted: int = MAX_STATUS_CONNECTIONS) -> int:
    """`wanted`, cut to a quarter of the descriptors this process may open and of the context's sockets."""
    sockets = CONTEXT_MAX_SOCKETS
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:
            sockets = min(sockets, soft)
    except (ImportError, OSError, ValueError):
        pass
    return max(1, min(wanted, sockets // 4))


class StatusEndpoints:
    """Which status endpoints keep a connection: the rule behind Pushers, with no sockets.

    An endpoint is `connecting` from its first use until connected(); it is closed when
    it has not connected within `connect_s` (unreachable), when unused for `idle_s`, or,
    least recently used first, to make room for a new one beyond `limit`: one still
    connecting before any that connected, so a peer naming endpoints nobody listens at
    (in asks told Failed at once, in cancels) closes those, not other receivers' live
    connections and the statuses queued on them.
    """

    def __init__(self, limit: int, idle_s: float = STATUS_IDLE_S, connect_s: float = STATUS_CONNECT_S) -> None:
        if limit < 1:
            raise ConfigError(f"at least one status connection is needed, got a limit of {limit}")
        self.limit = limit
        self.idle_s = idle_s
        self.connect_s = connect_s
        self._used: OrderedDict[Any, float] = OrderedDict()  # least recently used first
        self._connecting: dict[Any, float] = {}  # endpoint -> when it was opened

    def __len__(self) -> int:
        return len(self._used)

    def __contains__(self, key: object) -> bool:
        return key in self._used

    def is_connecting(self, key: object) -> bool:
        """Whether `key` was opened and has not connected yet."""
        return key in self._connecting

    def connecting(self) -> list:
        """The endpoints not connected yet."""
        return list(self._connecting)

    def use(self, key: Any, now: float) -> list:
        """Marks `key` used now; opens it if new, returning the endpoints to close to make room."""
        if key in self._used:
            del self._used[key]  # filed again as the most recently used: move_to_end, without its call
            self._used[key] = now
            return []
        evicted = []
        while len(self._used) >= self.limit:
            # The least recently used still connecting, else the least recently used (limit entries at most).
            old = next((used for used in self._used if used in self._connecting), None)
            if old is None:
                old = next(iter(self._used))
            self.forget(old)
            evicted.append(old)
        self._used[key] = now
        self._connecting[key] = now
        return evicted

    def connected(self, key: Any) -> None:
        """`key`'s connection is up."""
        self._connecting.pop(key, None)

    def forget(self, key: Any) -> None:
        """`key` was closed."""
        self._used.pop(key, None)
        self._connecting.pop(key, None)

    def expired(self, now: float) -> list[tuple[Any, str]]:
        """Forgets and returns (endpoint, why) for those unreachable or idle by `now`."""
        out = [(key, "unreachable") for key, opened in self._connecting.items() if now - opened >= self.connect_s]
        for key, _ in out:
            self.forget(key)
        for key, used in self._used.items():  # least recently used first: stop at the first still in use
            if now - used < self.idle_s:
                break
            out.append((key, "idle"))
        for key, why in out:
            if why == "idle":
                self.forget(key)
        return out

    def next_expiry(self) -> float | None:
        """When expired() next has something to say (None: nothing open)."""
        times = [opened + self.connect_s for opened in self._connecting.values()]
        if self._used:
            times.append(next(iter(self._used.values())) + self.idle_s)
        return min(times) if times else None


class Pushers:
    """Status PUSH sockets keyed by endpoint, shared by threads under one lock.

    Sends never block, and a status goes only over a connection that is up when it is
    sent (ZMQ_IMMEDIATE): one pushed while its receiver is down is dropped, never kept
    for whichever process listens at that address next. A new endpoint's statuses wait
    (in order, up to the queue's bound) for its first connection, which a thread of the
    pool's own ("epd-status") watches; one that does not come up within connect_s is
    unreachable and its statuses are dropped. Connections are bounded (least recently
    used closed first to serve a new endpoint) and closed after idle_s unused, so dead
    endpoints cost no sockets, descriptors or reconnection attempts once their rooms
    are over. Drops are counted in `dropped` and warned about, throttled.
    """

    def __init__(self, hwm: int = STATUS_HWM, limit: int | None = None, idle_s: float = STATUS_IDLE_S,
                 connect_s: float = STATUS_CONNECT_S, on_dropped: Callable[[int], None] | None = None) -> None:
        """`on_dropped(count)` hears of each drop as it is counted (under the pushers' lock); an error it raises
        is logged (throttled), and stops nothing."""
        self._hwm = hwm
        self._endpoints = StatusEndpoints(status_connection_limit() if limit is None else limit, idle_s, connect_s)
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}
        self._waiting: dict[tuple[str, int], list[list[bytes]]] = {}  # statuses for connections not up yet
        self._lock = threading.Lock()
        self._waker = Waker()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._warn = ThrottledLog(log)
        self.dropped = 0
        self._on_dropped = on_dropped

    @property
    def limit(self) -> int:
        """Status connections kept at most."""
        return self._endpoints.limit

    def send(self, endpoint: str, port: int, frames: list[bytes]) -> bool:
        """Queues `frames` for endpoint:port; False when they had to be dropped.

        Never raises for the endpoint's sake: one that cannot even be connected to (a
        peer announced a malformed host) loses its messages, logged once, like a dead one.
        """
        key = (endpoint, port)
        with self._lock:
            if self._closed:
                return self._drop(key, 1, "the status pushers are closed")
            sock = self._sockets.get(key)
            if sock is None:
                opened = self._open(key)
                if isinstance(opened, str):
                    return self._drop(key, 1, f"cannot connect to it ({opened})")
                sock = opened
            else:
                self._endpoints.use(key, time.monotonic())
            waiting = self._waiting.get(key) if self._waiting else None  # mostly none: every connection is up
            if waiting is not None and not self._came_up(key, sock):
                if len(waiting) >= self._hwm:
                    return self._drop(key, 1, "its connection is not up yet and its queue is full")
                waiting.append(frames)
                return True
            try:
                send_frames(sock, frames)
                return True
            except zmq.Again:
                return self._drop(key, 1, "it is down or not draining its queue")

    def expect(self, endpoint: str, port: int) -> None:
        """A receiver at endpoint:port just announced itself (its registration arrived).

        Its connection is opened now if there is none, and made afresh if the one there
        is down (its receiver restarted there): its next statuses then wait for the new
        connection instead of being dropped while ZMQ's reconnection backs off (a live
        connection so backed up that it takes nothing is made afresh too, its queue
        dropped). What was pushed before this call never reaches it.
        """
        key = (endpoint, port)
        with self._lock:
            if self._closed:
                return
            sock = self._sockets.get(key)
            if sock is not None and (key in self._waiting or _get(sock, zmq.EVENTS) & zmq.POLLOUT):
                self._endpoints.use(key, time.monotonic())
                return
            if sock is not None:
                self._close(key, "its receiver announced itself again")
                self._endpoints.forget(key)
            opened = self._open(key)
            if isinstance(opened, str):
                self._warn.warning("expect", "cannot connect to receiver %s:%d: %s", host_text(endpoint), port,
                                   opened)

    def _open(self, key: tuple[str, int]) -> zmq.Socket | str:
        """Opens a socket to a new endpoint (closing the least recently used past the limit) and has the
        thread watch for its connection (lock held); the socket, or why it could not be made."""
        if not is_ip(key[0]):  # refused by push_socket below: it must close no other endpoint's first
            return f"host {host_text(key[0])!r} is not an IP address (peers are reached by IP, SPEC.md 4.1)"
        for old in self._endpoints.use(key, time.monotonic()):
            self._close(old, "closed to make room for a new receiver")
        try:
            sock = push_socket(key[0], key[1], self._hwm, immediate=True, reconnect_max_ms=STATUS_RECONNECT_MAX_MS)
        except zmq.ZMQError as exc:
            self._endpoints.forget(key)
            return str(exc)
        self._sockets[key] = sock
        self._waiting[key] = []
        self._start()
        return sock

    def _came_up(self, key: tuple[str, int], sock: zmq.Socket) -> bool:
        """Whether a waiting endpoint's connection is up; if so, sends what waited (lock held)."""
        if not _get(sock, zmq.EVENTS) & zmq.POLLOUT:
            return False
        self._endpoints.connected(key)
        waiting = self._waiting.pop(key)
        for i, frames in enumerate(waiting):
            try:
                send_frames(sock, frames)
            except zmq.Again:
                self._drop(key, len(waiting) - i, "it is not draining its queue")
                break
        return True

    def _drop(self, key: tuple[str, int], count: int, why: str) -> bool:
        """Counts dropped statuses and warns, throttled (lock held)."""
        self.dropped += count
        if self._on_dropped is not None:
            try:
                self._on_dropped(count)
            except Exception as exc:  # noqa: BLE001 - a count (the caller's metrics) stops no close, send or watch
                self._warn.warning("on_dropped", "counting %d dropped statuses failed: %r", count, exc)
        self._warn.warning(why, "dropping statuses to %s:%d: %s", host_text(key[0]), key[1], why)
        return False

    def _close(self, key: tuple[str, int], why: str) -> None:
        """Closes one endpoint's socket, dropping the statuses still waiting for it (lock held)."""
        waiting = self._waiting.pop(key, None)
        if waiting:
            self._drop(key, len(waiting), why)
        self._sockets.pop(key).close(0)

    def _start(self) -> None:
        """Starts the watching thread, or wakes it for a new endpoint (lock held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="epd-status", daemon=True)
            self._thread.start()
        self._waker.wake()

    def _watch(self) -> None:
        """Sends what waited once a connection is up; closes unreachable and idle endpoints."""
        name_this_thread("epd-status")
        poll = 0.001
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                for key in self._endpoints.connecting():
                    self._came_up(key, self._sockets[key])
                for key, why in self._endpoints.expired(now):
                    self._close(key, f"{why}: no connection within {self._endpoints.connect_s:g}s"
                                if why == "unreachable" else why)
                expiry = self._endpoints.next_expiry()
                waiting = bool(self._endpoints.connecting())
            # Connections coming up are checked often at first (a receiver is usually there
            # at once), then less; with none coming up the thread sleeps until an expiry.
            timeout = None if expiry is None else max(0.0, expiry - time.monotonic())
            if waiting:
                timeout = poll if timeout is None else min(poll, timeout)
            # poll(2), not select(): a waker past descriptor 1024 must not end this thread.
            waker = select.poll()
            waker.register(self._waker.fileno(), select.POLLIN)
            waker.poll(None if timeout is None else math.ceil(timeout * 1000))
            poll = 0.001 if self._waker.drain() or not waiting else min(poll * 2, 0.05)

    def __len__(self) -> int:
        return len(self._sockets)

    def close(self, linger_ms: int = 0) -> None:
        """Closes every socket; what is still queued gets `linger_ms` to go out (0: discarded).

        Statuses still waiting for a connection get those `linger_ms` to see it come up;
        queued ones then linger in the context's I/O thread, so close() waits for no more.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._waker.wake()
        if self._thread is not None:
            self._thread.join()
        deadline = time.monotonic() + linger_ms / 1000
        while time.monotonic() < deadline:
            with self._lock:
                for key in list(self._waiting):
                    self._came_up(key, self._sockets[key])
                if not self._waiting:
                    break
            time.sleep(0.001)
        with self._lock:
            for key in list(self._sockets):
                waiting = self._waiting.pop(key, None)
                if waiting:
                    self._drop(key, len(waiting), "its connection did not come up before close()")
                self._sockets.pop(key).close(linger_ms)
                self._endpoints.forget(key)
        self._waker.close()
        self._warn.flush()  # the counts of warnings left out that no later one will tell


class RoomRecord(Protocol):
    """What a room handle reads of its room's record."""

    @property
    def room(self) -> int: ...

    @property
    def started_at(self) -> float: ...

    @property
    def concluded_at(self) -> float | None: ...

    def stage_times(self) -> tuple[tuple[str, float | None], ...]: ...


_Record = TypeVar("_Record", bound=RoomRecord)
_Value = TypeVar("_Value")


class Conclusions:
    """Wakes the threads in RoomHandle.wait() when a room concludes.

    One condition per manager or pool rather than an Event per room: a room costs
    nothing here unless someone waits on it, and scheduler loops only poll.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiters = 0

    def notify(self) -> None:
        """Call after setting a room's concluded_at."""
        # Unlocked read: a waiter counts itself before it looks at concluded_at, and
        # concluded_at was set before this read, so no waiter can be missed.
        if self._waiters:
            with self._cond:
                self._cond.notify_all()

    def wait(self, state: RoomRecord, timeout: float) -> None:
        """Blocks until state.concluded_at is set, at most `timeout` seconds."""
        with self._cond:
            self._waiters += 1
            try:
                self._cond.wait_for(lambda: state.concluded_at is not None, timeout)
            finally:
                self._waiters -= 1


class RoomHandle(Generic[_Record]):
    """One room's progress as its caller sees it; `state` carries room, started_at, concluded_at."""

    def __init__(self, table: RoomTable, state: _Record, conclusions: Conclusions,
                 held: Callable[[int], object]) -> None:
        """`held(room)` is the state its owner holds for the room now (None once forgotten)."""
        self._table = table
        self._state = state
        self._conclusions = conclusions
        self._held = held
        self.room = state.room

    def _current(self) -> bool:
        """Whether this handle's room is still held: not cleared, and its number not reused since."""
        return self._held(self.room) is self._state

    def _read(self, read: Callable[[int], _Value | None]) -> _Value | None:
        """What `read` finds in the room table under this handle's room number, or None once the room
        is cleared: looked at before and after, as a room reusing the number may come in between."""
        held, room, state = self._held, self.room, self._state  # _current(), twice, without its calls
        if held(room) is not state:
            return None
        value = read(room)
        return value if held(room) is state else None

    def poll(self) -> TransferPoll:
        """The room's status right now (never blocks; Failed once cleared, whoever reuses its number)."""
        from transfer.status import TransferPoll

        status = self._read(self._table.get)
        return TransferPoll.Failed if status is None else status

    @property
    def failure(self) -> str | None:
        """Why the room failed, or None (also once cleared)."""
        return self._read(self._table.reason)

    @property
    def failure_kind(self) -> FailureKind | None:
        """Why the room failed as a FailureKind from a closed set (for metrics and retries), or None."""
        failure = self._read(self._table.failure)
        return None if failure is None else failure.kind

    @property
    def latency_s(self) -> float | None:
        """Seconds from the room's start to its conclusion, once concluded."""
        end = self._state.concluded_at
        return None if end is None else end - self._state.started_at

    @property
    def started_at(self) -> float:
        """When the room started (receive() or send()), on time.monotonic's clock."""
        return self._state.started_at

    @property
    def stages(self) -> dict[str, float]:
        """Seconds from the room's start to each stage it reached so far, in order (README,
        "Where a room's time goes"); a stage before the start is negative."""
        start = self._state.started_at
        return {name: at - start for name, at in self._state.stage_times() if at is not None}

    def wait(self, timeout: float) -> TransferPoll:
        """Blocks up to `timeout` seconds for a terminal status (for tools and tests, not scheduler loops)."""
        timeout = config.check_seconds("timeout", timeout, zero_ok=True)
        # A room concluded already has nothing to wait for (Conclusions.wait would return at once); a
        # cleared room will not conclude for this handle.
        if self._state.concluded_at is None and self._current():
            self._conclusions.wait(self._state, timeout)
        return self.poll()


@dataclass(frozen=True)
class Region:
    """A span of memory: its address, length in bytes, and device ('cpu', 'cuda:N', or another torch device's name)."""

    addr: int
    nbytes: int
    device: str = "cpu"
    tensor: Any = None  # the tensor it came from, kept alive and used for checksums

    @property
    def end(self) -> int:
        """The address just past the region."""
        return self.addr + self.nbytes

    def overlaps(self, addr: int, nbytes: int) -> bool:
        """Whether [addr, addr + nbytes) shares a byte with the region."""
        return nbytes > 0 and addr < self.end and self.addr < addr + nbytes

    def contains(self, addr: int, nbytes: int) -> bool:
        """Whether [addr, addr + nbytes) lies wholly inside this region."""
        return nbytes == 0 or (self.addr <= addr and addr + nbytes <= self.addr + self.nbytes)  # end, without its call


def as_region(buf: Any, nbytes: int | None = None) -> Region:
    """A Region from a contiguous torch tensor, an (addr, nbytes) pair, or an address and `nbytes`."""
    if isinstance(buf, Region):
        return buf
    if isinstance(buf, tuple):
        addr, nbytes = buf
        return Region(int(addr), int(nbytes))
    if isinstance(buf, int):
        if nbytes is None:
            raise ConfigError("a raw address needs its length in bytes")
        return Region(buf, int(nbytes))
    if hasattr(buf, "data_ptr"):
        if not buf.is_contiguous():
            raise ConfigError(f"tensor of shape {tuple(buf.shape)} is not contiguous")
        refuse_lazy_view(buf)
        return Region(buf.data_ptr(), buf.numel() * buf.element_size(), str(buf.device), buf)
    raise ConfigTypeError(f"expected a torch tensor or an (address, length) pair, got {type(buf).__name__}")


def refuse_lazy_view(tensor: Any) -> None:
    """ConfigError for a tensor whose memory holds other values than it reads (torch's lazy negation or
    conjugation): its bytes would be moved as they are, and read back with the other sign."""
    if getattr(tensor, "is_neg", lambda: False)() or getattr(tensor, "is_conj", lambda: False)():
        raise ConfigError(f"tensor of shape {tuple(tensor.shape)} is a lazily negated or conjugated view: its memory "
                          f"holds other values than it reads; pass tensor.resolve_neg() or tensor.resolve_conj()")


def cuda_present() -> bool:
    """Whether this process may hold CUDA memory (torch loaded, with a CUDA device)."""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA set-up: assume it may, and ask for the tensor
        return True


def raw_memory_problem(readable: Callable[[], bool], *, cuda: bool, integrity: bool) -> str | None:
    """Why memory given by address alone (no tensor to say its device) cannot be used, or None.

    It must be host memory this process can read (`readable()`): checksums read it there and,
    over tcp, so do Mooncake's copies; reading anything else kills the process. Only where a
    CUDA device exists and integrity is off may it be GPU memory, which Mooncake alone touches.
    """
    if (cuda and not integrity) or readable():
        return None
    if cuda:
        return "is not host memory this process can read, so its checksums cannot be read"
    return "is not memory this process can read (this host has no CUDA device)"


def host_readable(addr: int, nbytes: int) -> bool:
    """Whether [addr, addr + nbytes) lies in readable mappings of this process (/proc/self/maps).

    GPU memory in CUDA's unified address space is mapped, but not readable.
    """
    end, at = addr + nbytes, addr
    try:
        with open("/proc/self/maps", "rb") as maps:
            for line in maps:
                span, perms = line.split(b" ", 2)[:2]
                low, high = (int(x, 16) for x in span.split(b"-"))
                if low <= at < high:
                    if not perms.startswith(b"r"):
                        return False
                    at = high
                    if at >= end:
                        return True
    except OSError:
        return False
    return at >= end


def checksum(region: Region, addr: int, nbytes: int) -> int:
    """The layer checksum of [addr, addr + nbytes) inside `region`: host memory read by address, memory on
    any other device (CUDA, or another accelerator's) through the region's tensor, by torch on that device."""
    import transfer.wire as wire  # found in sys.modules after the first, with no fromlist to handle

    # An address on a device is no host address: reading it as one kills the process.
    if region.device.partition(":")[0] != "cpu":
        import torch

        flat = region.tensor.reshape(-1).view(torch.uint8)
        offset = addr - region.addr
        return wire.tensor_layer_sum(flat[offset : offset + nbytes])
    return wire.layer_sum(addr, nbytes)


def name_this_thread(name: str) -> None:
    """Gives the calling thread `name` at the OS level too, so `top -H` and py-spy show our threads."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME; the kernel keeps 15 bytes
    except (OSError, AttributeError):
        pass

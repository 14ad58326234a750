"""The HTTP bootstrap rendezvous on the encode node, and its client (SPEC.md sections 5 and 8).

Encode ranks `PUT /route` their ZMQ endpoint; prefill ranks `GET /route` the
encode side's parallel sizes and then one encode rank's endpoint. Ours adds
`DELETE /route` (docs/protocol.md section 8): an encode rank whose sender pool
closes withdraws its endpoint, so prefill ranks stop being sent to it.

Decisions the spec leaves open, documented here:
- The first accepted PUT fixes world_size and dp_size until the server restarts; a later
  PUT with other sizes is refused with 409 (a rank of a different deployment must not
  join), whose text says to give the rank the server's sizes or to restart the server.
  world_size is at most MAX_WORLD_SIZE (400 beyond), and the client refuses a
  server's sizes beyond it: a size no deployment has must neither be fixed by a
  stray first PUT nor be computed with by a prefill rank. Without a token, any
  first PUT with plausible sizes still fixes them: the token is what keeps
  strangers from squatting.
- A PUT for a (dp_group, tp_rank) already present replaces it, so a restarted
  encode rank can re-register; configure a token to keep strangers out. Every
  registration is logged at INFO, and one that replaces another endpoint at WARNING.
- A DELETE takes the PUT's body, checks and token, and removes the entry only
  while it still maps to the body's endpoint: a rank restarted at another one
  keeps its route whenever its predecessor's pool closes. The sizes stay fixed.
- Our encode ranks send an instance nonce (INSTANCE_HEADER) on their PUT and
  DELETE: the entry remembers the one its PUT carried, and a DELETE that names
  one removes the entry only when it is that one, so a rank restarted at the very
  same endpoint keeps its route however late its predecessor's DELETE arrives. A
  DELETE without it (an older peer of ours) removes by endpoint as above. A GET of
  a route so registered answers with the same header, naming the registration: a
  prefill rank of ours tells a rank restarted at the same endpoint from the one it
  asked. Peers send no such header, and their bodies and answers are unchanged.
- The server remembers the instances that withdrew their route (DELETE with the header),
  the latest MAX_WITHDRAWN of them, and refuses a PUT from one with 410 (Gone), listing
  nothing: a registration of a closed pool that arrives after its DELETE (held up in flight,
  or an attempt its client had already given up on) would list a rank that is gone. An
  instance is one pool's, which withdraws it only when it closes (it may register again
  before, where a restarted server lost its route): a restarted rank comes with a new one.
  A PUT without the header is listed whatever DELETE came before it: nothing tells a late
  one from a rank (a peer's, an older one of ours) started since at the same endpoint.
- The route lookup is `table[target_dp_group][engine_rank]`, i.e. engine_rank
  is read as the tp rank inside the group, as the peers' servers do.
- Success bodies are JSON (application/json); errors and /health are short
  text/plain bodies that name the problem, since peers log the body as is.
- Bodies are parsed as JSON only: never unpickled or evaluated.
"""

from __future__ import annotations

import errno
import functools
import hmac
import http.client
import io
import json
import logging
import re
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeGuard, cast
from urllib.parse import SplitResult, parse_qs, urlsplit

from transfer._forks import forks
from transfer._http import BoundedHTTPServer, DeadlineReader, OneDeadlineHandler
from transfer._resolve import connect_within
from transfer.config import check_seconds
from transfer.errors import BootstrapError, BootstrapNoRoute, BootstrapUnreachable, ConfigError
from transfer.frames import shown
from transfer.ports import PortSpec, bind_port, listen_error

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
#: Encode ranks one deployment may have; far above any real one, low enough that no
#: rank arithmetic or message about it grows with what a stranger sends.
MAX_WORLD_SIZE = 1 << 16
#: A DNS name's longest spelling; an address is shorter.
MAX_HOST_CHARS = 253
ROLE = "Prefill"
#: Instances whose withdrawal (DELETE /route) the server remembers, to refuse their late registrations.
MAX_WITHDRAWN = 4096
#: The header that names which process (one sender pool) a PUT or DELETE /route comes from.
INSTANCE_HEADER = "X-EPD-Instance"
#: What an instance may be: 1 to 64 letters, digits, '-' or '_' (ours are 32 hex digits).
_INSTANCE = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_INTEGER = re.compile(r"[+-]?[0-9]+\Z")
_DIGITS = re.compile(r"[0-9]+\Z")


#: What a 409 for other sizes says to do (the server's text, and the client's error where a server's text does not).
_SIZES_STAY = ("the bootstrap server keeps the sizes of its first registration until it restarts: give this "
               "encode rank the sizes it has, or restart the bootstrap server (`epd-transfer bootstrap`, or a new "
               "BootstrapServer) to serve a deployment of other sizes")


class _RequestError(Exception):
    """An HTTP error answer: status code and text."""

    def __init__(self, status: int, text: str) -> None:
        """Remember the status and the text sent back."""
        super().__init__(text)
        self.status = status
        self.text = text


class _RouteTable:
    """Thread-safe registry of encode ranks keyed by (dp_group, tp_rank)."""

    def __init__(self) -> None:
        """An empty table; sizes unknown until the first registration."""
        self._lock = threading.Lock()
        self.world_size: int | None = None
        self.dp_size: int | None = None
        self._routes: dict[tuple[int, int], tuple[str, int]] = {}
        self._instances: dict[tuple[int, int], str | None] = {}  # which registration made each route
        # Instances that withdrew their route, oldest first: a PUT from one is refused (410).
        self._withdrawn: dict[str, None] = {}
        self.max_withdrawn = MAX_WITHDRAWN

    def put(self, world_size: int, dp_size: int, rank_ip: str, rank_port: int, engine_rank: int,
            instance: str | None = None) -> tuple[int, int]:
        """Store one rank's endpoint; returns its (dp_group, tp_rank)."""
        return self.claim(world_size, dp_size, rank_ip, rank_port, engine_rank, instance)[0]

    def claim(self, world_size: int, dp_size: int, rank_ip: str, rank_port: int,
              engine_rank: int, instance: str | None = None,
              only_if_absent: bool = False) -> tuple[tuple[int, int], tuple[str, int] | None]:
        """put(), also returning the endpoint this one replaced, if any (for the log); `instance` is the
        registering process's nonce (None: a peer's, or an older one of ours). 410, listing nothing and fixing
        no sizes, for an instance that withdrew its route already: this PUT came late, its pool is closed.
        `only_if_absent` (a PUT with `If-None-Match: *`): 412, changing nothing, where the key holds another
        registration than this one."""
        group_size = world_size // dp_size
        key = (engine_rank // group_size, engine_rank % group_size)
        with self._lock:
            if instance is not None and instance in self._withdrawn:
                raise _RequestError(
                    410, f"encode rank {engine_rank}'s registration comes from instance {instance}, which withdrew "
                         f"its route (DELETE /route) already: a registration it sent before, arriving late, is not "
                         f"listed again; a restarted encode rank registers as a new instance (a new sender pool)")
            if self.world_size is None:
                self.world_size, self.dp_size = world_size, dp_size
            self._check_sizes("PUT", world_size, dp_size)
            previous = self._routes.get(key)
            if only_if_absent and previous is not None and (previous, self._instances.get(key)) != (
                    (rank_ip, rank_port), instance):
                raise _RequestError(
                    412, f"encode rank {engine_rank} (dp group {key[0]}, tp rank {key[1]}) is registered at "
                         f"{previous[0]}:{previous[1]} by another registration; this one (If-None-Match: *) "
                         f"replaces none")
            self._routes[key] = (rank_ip, rank_port)
            self._instances[key] = instance
        return key, previous

    def remove(self, world_size: int, dp_size: int, rank_ip: str, rank_port: int,
               engine_rank: int, instance: str | None = None) -> tuple[tuple[int, int], tuple[str, int] | None, bool]:
        """Forgets one rank's endpoint, only while its entry still maps to (rank_ip, rank_port) and, when
        `instance` is given, was registered by that instance (a successor at the same endpoint is another).

        Returns its (dp_group, tp_rank), the endpoint the entry holds afterwards (None for
        none) and whether it was removed. The sizes stay as the first PUT fixed them: other
        sizes are a 409, as for a PUT; before any PUT there is nothing to remove. Whatever it
        removed, an `instance` is remembered as withdrawn (the latest max_withdrawn): its own
        PUT arriving after this DELETE is refused.
        """
        group_size = world_size // dp_size
        key = (engine_rank // group_size, engine_rank % group_size)
        with self._lock:
            if self.world_size is not None:
                self._check_sizes("DELETE", world_size, dp_size)
            if instance is not None:
                self._withdrawn.pop(instance, None)
                self._withdrawn[instance] = None
                while len(self._withdrawn) > self.max_withdrawn:
                    del self._withdrawn[next(iter(self._withdrawn))]
            current = self._routes.get(key)
            if current != (rank_ip, rank_port) or (instance is not None and self._instances.get(key) != instance):
                return key, current, False
            del self._routes[key]
            self._instances.pop(key, None)
        return key, None, True

    def _check_sizes(self, method: str, world_size: int, dp_size: int) -> None:
        """409 when a request's sizes are not the ones the first PUT fixed (lock held, sizes set)."""
        if (self.world_size, self.dp_size) != (world_size, dp_size):
            raise _RequestError(
                409, f"world_size/dp_size mismatch: this server has world_size="
                     f"{self.world_size} dp_size={self.dp_size}, the {method} says "
                     f"world_size={world_size} dp_size={dp_size}: {_SIZES_STAY}")

    def sizes(self) -> tuple[int | None, int | None]:
        """(world_size, dp_size), None before any registration."""
        with self._lock:
            return self.world_size, self.dp_size

    def get(self, engine_rank: int, dp_group: int) -> tuple[str, int] | None:
        """The endpoint for tp rank engine_rank of dp_group, or None."""
        with self._lock:
            return self._routes.get((dp_group, engine_rank))

    def registration(self, engine_rank: int, dp_group: int) -> tuple[tuple[str, int], str | None] | None:
        """The endpoint for tp rank engine_rank of dp_group and the instance that registered it (None: a
        peer's registration, or an older one of ours), or None."""
        key = (dp_group, engine_rank)
        with self._lock:
            route = self._routes.get(key)
            return None if route is None else (route, self._instances.get(key))

    def __len__(self) -> int:
        """How many ranks are registered."""
        with self._lock:
            return len(self._routes)


def _field_int(body: dict, name: str, low: int, high: int | None = None) -> int:
    """A required integer field within [low, high]; 400 naming the field otherwise."""
    value = body.get(name)
    if name not in body:
        raise _RequestError(400, f"missing field {name}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise _RequestError(400, f"{name} is not an integer")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise _RequestError(400, f"{name} out of range: {_shown_int(value)} not in {bound}")
    return value


def _parse_registration(raw: bytes) -> tuple[int, int, str, int, int]:
    """Validate a PUT (or DELETE) /route body; returns (world_size, dp_size, ip, port, engine_rank)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # deep nesting exhausts the parser's stack
        raise _RequestError(400, "body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _RequestError(400, "body must be a JSON object")
    role = body.get("role")
    if role != ROLE:
        raise _RequestError(400, f"role must be \"{ROLE}\" (the encode side), got {shown(repr(role), 64)}")
    world_size = _field_int(body, "world_size", 1, MAX_WORLD_SIZE)
    dp_size = _field_int(body, "dp_size", 1, world_size)
    if world_size % dp_size != 0:
        raise _RequestError(400, f"world_size {world_size} is not a multiple of dp_size {dp_size}")
    rank_ip = body.get("rank_ip")
    if not isinstance(rank_ip, str) or not 0 < len(rank_ip) <= MAX_HOST_CHARS or not _HOST.fullmatch(rank_ip):
        raise _RequestError(400, f"rank_ip must be an IP address or host name of at most {MAX_HOST_CHARS} "
                                 f"characters (letters, digits, '.', '-', '_', ':', '%')")
    rank_port = _field_int(body, "rank_port", 1, 65535)
    engine_rank = _field_int(body, "engine_rank", 0, world_size - 1)
    return world_size, dp_size, rank_ip, rank_port, engine_rank


def _query_int(query: dict[str, list[str]], name: str) -> int:
    """A required integer query parameter; 400 when missing or not an integer."""
    values = query.get(name)
    if not values:
        raise _RequestError(400, f"missing query parameter {name}")
    if not _INTEGER.match(values[0]):
        raise _RequestError(400, f"{name} is not an integer")
    try:
        return int(values[0])
    except ValueError:  # more digits than int() converts
        raise _RequestError(400, f"{name} is not an integer") from None


class _Handler(OneDeadlineHandler):
    """One HTTP request against the server's route table (a silent or slow client is dropped
    `timeout` seconds after it connected)."""

    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # stdlib name
        """Route access logs to logging at debug instead of stderr, the client's text (its request line)
        made printable."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("bootstrap %s: %s", self.address_string(), shown(format % args))

    def _json(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
        """Send a JSON response."""
        self._send(status, json.dumps(value).encode(), "application/json", headers)

    def do_GET(self) -> None:
        """GET /route (sync sizes or one route) and GET /health."""
        try:
            url = self._target()
            if url.path == "/health":
                self._text(200, "OK")
            elif url.path == "/route":
                self._get_route(parse_qs(url.query, keep_blank_values=True))
            else:
                raise _RequestError(404, f"no such path {url.path}")
        except _RequestError as error:
            self._text(error.status, error.text)

    def do_HEAD(self) -> None:
        """HEAD /route and /health: answered as GET, headers only (a load balancer's or a probe's check;
        SPEC.md section 5 names only GET, and a HEAD changes nothing)."""
        self.do_GET()

    def _target(self) -> SplitResult:
        """The request target split into its parts, or a 400 when it does not parse (a bad IPv6 host)."""
        try:
            return urlsplit(self.path)
        except ValueError:
            self.close_connection = True  # a body stays unread
            raise _RequestError(400, "bad request target") from None

    def _get_route(self, query: dict[str, list[str]]) -> None:
        """Answer the sync call (-1, -1) or one encode rank's endpoint."""
        engine_rank = _query_int(query, "engine_rank")
        dp_group = _query_int(query, "target_dp_group")
        table = self.server.table
        if engine_rank == -1 and dp_group == -1:
            world_size, dp_size = table.sizes()
            self._json(200, {"prefill_tp_size": world_size, "prefill_dp_size": dp_size})
            return
        found = table.registration(engine_rank, dp_group)
        if found is None:
            raise _RequestError(404, f"no route for encode rank {_shown_int(engine_rank)} in dp group "
                                     f"{_shown_int(dp_group)}")
        (ip, port), instance = found
        self._json(200, {"rank_ip": ip, "rank_port": port}, None if instance is None else {INSTANCE_HEADER: instance})

    def do_PUT(self) -> None:
        """PUT /route: one encode rank registers its endpoint."""
        try:
            world_size, dp_size, rank_ip, rank_port, engine_rank = self._route_body()
            key, previous = self.server.table.claim(world_size, dp_size, rank_ip, rank_port, engine_rank,
                                                    self._instance(), self.headers.get("If-None-Match") == "*")
            # Logged before the answer: the route changed whether or not the client reads it.
            self._log_registration(engine_rank, key, (rank_ip, rank_port), previous)
            self._json(200, {"status": "OK", "dp_group": key[0], "tp_rank": key[1]})
        except _RequestError as error:
            if error.status == 410:  # a closed pool's late registration: its rank stays unlisted
                log.info("bootstrap %s: %s", self.server.address_text, error.text)
            self._text(error.status, error.text)

    def do_DELETE(self) -> None:
        """DELETE /route (ours): one encode rank withdraws its endpoint, if its route still leads there."""
        try:
            world_size, dp_size, rank_ip, rank_port, engine_rank = self._route_body()
            key, current, removed = self.server.table.remove(world_size, dp_size, rank_ip, rank_port, engine_rank,
                                                             self._instance())
            self._log_unregistration(engine_rank, key, (rank_ip, rank_port), current, removed)
            self._json(200, {"status": "OK", "removed": removed})
        except _RequestError as error:
            self._text(error.status, error.text)

    def _route_body(self) -> tuple[int, int, str, int, int]:
        """A PUT's or DELETE's path, token and body checked; (world_size, dp_size, ip, port, engine_rank)."""
        path = self._target().path
        if path != "/route":
            self.close_connection = True  # the body stays unread
            raise _RequestError(404, f"no such path {path}")
        self._authorize()
        registration = _parse_registration(self._read_body())
        self._instance()  # a malformed one is a 400 before anything changes
        return registration

    def _instance(self) -> str | None:
        """The request's INSTANCE_HEADER (ours: which sender pool sent it), None without one; 400 when it
        is there but no instance."""
        value = self.headers.get(INSTANCE_HEADER)
        if value is None:
            return None
        if not _INSTANCE.match(value):
            raise _RequestError(400, f"{INSTANCE_HEADER} must be 1 to 64 letters, digits, '-' or '_', "
                                     f"got {shown(value, 80)!r}")
        return value

    def _log_unregistration(self, engine_rank: int, key: tuple[int, int], endpoint: tuple[str, int],
                            current: tuple[str, int] | None, removed: bool) -> None:
        """INFO for a route removed; DEBUG for one kept because it leads elsewhere (or nowhere) now."""
        where = f"{endpoint[0]}:{endpoint[1]}"
        rank = f"encode rank {engine_rank} (dp group {key[0]}, tp rank {key[1]})"
        if removed:
            log.info("bootstrap %s: %s unregistered from %s (%d rank(s) known)", self.server.address_text, rank,
                     where, len(self.server.table))
            return
        if current == endpoint:
            log.debug("bootstrap %s: %s asked to unregister %s by another instance than the one registered there (a "
                      "successor at the same endpoint): kept", self.server.address_text, rank, where)
            return
        now = "none" if current is None else f"{current[0]}:{current[1]}"
        log.debug("bootstrap %s: %s asked to unregister %s, which is not its route (%s): kept",
                  self.server.address_text, rank, where, now)

    def _log_registration(self, engine_rank: int, key: tuple[int, int], endpoint: tuple[str, int],
                          previous: tuple[str, int] | None) -> None:
        """INFO for each registration; WARNING when another endpoint takes over a rank already claimed."""
        where = f"{endpoint[0]}:{endpoint[1]}"
        rank = f"encode rank {engine_rank} (dp group {key[0]}, tp rank {key[1]})"
        if previous is None or previous == endpoint:
            log.info("bootstrap %s: %s registered at %s%s (%d rank(s) known)", self.server.address_text, rank,
                     where, "" if previous is None else " again", len(self.server.table))
            return
        log.warning("bootstrap %s: %s, registered at %s:%s, is now claimed by %s (from %s): a restarted rank, "
                    "or two processes given the same rank? Peers asking from now on get %s",
                    self.server.address_text, rank, previous[0], previous[1], where, self.client_address[0],
                    where)

    def _authorize(self) -> None:
        """With a token configured, require `Authorization: Bearer <token>` (401 otherwise)."""
        token = self.server.token
        if token is None:
            return
        given = self.headers.get("Authorization", "")
        expected = f"Bearer {token}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            self.close_connection = True  # the body stays unread
            raise _RequestError(401, f"{self.command} /route needs Authorization: Bearer <token>")

    def _read_body(self) -> bytes:
        """Read a Content-Length body of at most MAX_BODY bytes (413 beyond, before reading; 400 when
        the client ends its body short).

        A body framed more than one way is read no way: 411 with a Transfer-Encoding (which overrides a
        Content-Length, and is not read here), 400 for Content-Length headers that disagree. An
        intermediary that went by the other framing would have passed on another request than the one
        this would register."""
        if "Transfer-Encoding" in self.headers:
            self.close_connection = True
            raise _RequestError(411, f"{self.command} /route needs a Content-Length body, not a Transfer-Encoding "
                                     f"one")
        lengths = {value.strip() for value in self.headers.get_all("Content-Length", [])}
        if len(lengths) > 1:
            self.close_connection = True
            raise _RequestError(400, f"{self.command} /route has conflicting Content-Length headers")
        length_text = self.headers.get("Content-Length")
        text = (length_text or "").strip()
        # ASCII digits only: str.isdigit() also takes '\xb2', which int() refuses.
        if length_text is None or not _DIGITS.match(text):
            self.close_connection = True
            raise _RequestError(411 if length_text is None else 400,
                                f"{self.command} /route needs a Content-Length body")
        # Its length first: int() refuses thousands of digits.
        if len(text) > 18 or int(text) > MAX_BODY:
            self.close_connection = True
            raise _RequestError(413, f"body of {text[:18]}{'...' if len(text) > 18 else ''} bytes exceeds {MAX_BODY}")
        body = self.rfile.read(int(text))
        if len(body) < int(text):
            self.close_connection = True
            raise _RequestError(400, f"body shorter than Content-Length: {len(body)} of {int(text)} bytes")
        return body


class _HTTPServer(BoundedHTTPServer):
    """The bounded HTTP server holding the route table and the token."""

    #: Connections served at once; more are answered 503 at once instead of each getting
    #: a thread, so silent or slow clients cost at most this many threads.
    max_handlers = 256
    busy_text = b"bootstrap server busy: too many connections at once"
    client_busy_text = b"bootstrap server busy: too many connections from this address at once"
    log = logging.getLogger(__name__)  # request errors go to this module's log
    table: _RouteTable
    token: str | None
    address_text: str  # host:port, for log lines


def _refuse_bind(host: str, port: int, error: OSError) -> Exception:
    """What a failed bind raises, naming the server, its address and what to do: PortsInUse (errno EADDRINUSE
    kept, so a range passes it over) for a port in use, ConfigError for a host that is not this one's,
    ListenError (errno kept) for any other error."""
    return listen_error("bootstrap server", host, port, error, " (a bootstrap server running already?)",
                        reached="the server")


class BootstrapServer:
    """The bootstrap HTTP server, serving on its own thread from construction until close()."""

    def __init__(self, host: str = "127.0.0.1", port: PortSpec = 8998, token: str | None = None) -> None:
        """Bind host:port and start serving; ready on return.

        `port`: a port, 0 (any free one), or a range, `(30000, 30100)` or `"30000-30100"`
        (its first free port; `.port` says which). `PortsInUse` (an OSError) when its port, or
        every port of the range, is in use; ConfigError for a host that is not this one's;
        `ListenError` (an OSError, the bind's errno kept) for any other failure to bind.
        """
        token = check_token(token)
        server_class = _HTTPServer.for_host(host)

        def bind(number: int) -> _HTTPServer:
            try:
                return server_class((host, number), _Handler)
            except OSError as error:  # its own text names neither the server nor the address
                raise _refuse_bind(host, number, error) from None

        self._server = bind_port(port, bind, f"bootstrap server on {host}")
        self._server.table = _RouteTable()
        self._server.token = token
        self.host = host
        self.port = int(self._server.server_address[1])
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._server.address_text = self.address
        self._closed = False
        # Held by a close() until the socket is closed; reentrant, for a close() that a signal's handler calls
        # inside another on the same thread (stopping again is harmless).
        self._lock = threading.RLock()
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"bootstrap-{self.address}", daemon=True)
        self._thread.start()
        self._forks = forks()
        # Dropped without close(), the server stops anyway (its thread holds the HTTP server, not this).
        self._dropped = weakref.finalize(self, _stop_dropped, self._server, self._thread, self.address, self._forks)
        self._dropped.atexit = False  # at exit the daemon thread goes with the process
        log.info("bootstrap server on %s (token %s)", self.address, "on" if token else "off")

    @property
    def registered_ranks(self) -> int:
        """How many encode ranks registered."""
        return len(self._server.table)

    def close(self) -> None:
        """Stop serving, join the thread and close the socket; idempotent: a second close() returns once the
        first is done. A close that raised before its end (a stop signal's exception, KeyboardInterrupt,
        while it waited for the thread) is finished by the next, or by the server's collection. In a process
        forked from the one that made the server it closes only that process's copies of its sockets, at
        once: the serving thread is the parent's, which serves on."""
        if self._forks != forks():
            self._dropped.detach()
            self._server.close_copies()
            return
        with self._lock:
            if self._closed:
                return
            _stop(self._server, self._thread)
            self._closed = True
        self._dropped.detach()

    def __enter__(self) -> BootstrapServer:
        """Context-manager entry."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on exit."""
        self.close()


def _stop(server: _HTTPServer, thread: threading.Thread) -> None:
    """Stops serving, joins the serving thread and closes the listening socket; again, after a stop that
    raised on the way, it finishes it."""
    server.shutdown()
    thread.join()
    server.server_close()


def _stop_dropped(server: _HTTPServer, thread: threading.Thread, address: str, made_at: int = 0) -> None:
    """A BootstrapServer was dropped without close(): says so, and stops it on a thread of its own
    (the collection may run on any thread, the serving one too, which shutdown() would wait on). A forked
    child's copy is the parent's server: only the child's copies of its sockets are closed."""
    if made_at != forks():
        server.close_copies()
        return
    warnings.warn(f"bootstrap server on {address} was dropped without close(): stopping it", ResourceWarning)
    threading.Thread(target=_stop, args=(server, thread), name=f"bootstrap-stop-{address}", daemon=True).start()


def _registered(raw: bytes) -> bool:
    """Whether a 200's body is a bootstrap server's answer to PUT /route: our JSON, or a peer's `OK` (or
    nothing: SPEC.md does not say what a PUT is answered with)."""
    if raw.strip() in (b"OK", b""):
        return True
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return False
    return isinstance(value, dict) and value.get("status") == "OK"


def _unregistered(raw: bytes) -> bool | None:
    """`removed` of our server's answer to DELETE /route, or None when the body is not that answer."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return None
    if not isinstance(value, dict) or value.get("status") != "OK" or not isinstance(value.get("removed"), bool):
        return None
    return value["removed"]


def _shown_int(value: int) -> str:
    """An integer a peer sent (a server its answer, a client its body), for an error: JSON carries up to 4300
    digits, far more than a reason or an answer's text holds."""
    return shown(str(value), 24)


def _positive_int(value: object) -> TypeGuard[int]:
    """Whether a JSON value is an int (not a bool) above 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


#: What a rank's address may hold: a host name, an IPv4 or IPv6 address (with a zone). It goes into
#: ZMQ endpoints and log lines, so nothing else (spaces, newlines, ';', '/') gets in.
_HOST = re.compile(r"[A-Za-z0-9._:%-]+")


def check_token(token: str | None) -> str | None:
    """A bearer token as the server and clients take it: None or "" (none), else 1 to 4096 printable
    ASCII characters, as an HTTP header carries them; ConfigError otherwise."""
    if token is None or token == "":
        return None
    if not isinstance(token, str) or len(token) > 4096 or not all(" " <= c <= "~" for c in token):
        raise ConfigError("the token must be 1 to 4096 printable ASCII characters (it travels in an HTTP header)")
    return token


#: What no host holds and HTTP refuses to send one with (http.client's InvalidURL): spaces and control characters.
_SPACE_OR_CONTROL = re.compile(r"[\x00-\x20\x7f]")


def split_address(address: str) -> tuple[str, int]:
    """Split "host:port" (or "[v6]:port") into host and port; ConfigError for a port outside 1-65535, a host
    with a space or control character, or one the resolver cannot encode (an empty label, or one over 63
    characters)."""
    if not isinstance(address, str):
        raise ConfigError(f"bootstrap address must be a 'host:port' str, got {type(address).__name__} {address!r}")
    if "://" in address:
        raise ConfigError(f"bootstrap address must be host:port without a scheme, got {address!r}")
    host, sep, port = address.rpartition(":")
    number = port.lstrip("0")  # int() raises its own ValueError for a string of over 4300 digits, zeros too
    if not sep or not host or not (port.isascii() and port.isdigit() and len(number) <= 5
                                   and 0 < int(number or "0") <= 65535):
        raise ConfigError(f"bootstrap address must be host:port (a port of 1-65535), got {address!r}")
    host = host.strip("[]")
    if _SPACE_OR_CONTROL.search(host):  # else every request fails unsent: HTTP refuses such a host
        raise ConfigError(f"bootstrap address must be host:port with no space or control character in its host "
                          f"(a stray space or newline?), got {address!r}")
    if not _resolver_takes(host):  # else every request fails with a UnicodeError
        raise ConfigError(f"bootstrap address must be host:port with a host name the resolver takes (dot-separated "
                          f"labels of 1 to 63 characters), got {address!r}")
    return host, int(number)


@functools.lru_cache(maxsize=256)
def checked_address(address: str) -> tuple[str, int]:
    """split_address, remembered for the addresses seen most recently (receive() checks its bootstrap
    address on every call, and a rank asks few servers); what it refuses raises each time."""
    return split_address(address)


@functools.lru_cache(maxsize=256)
def _resolver_takes(host: str) -> bool:
    """Whether `host` encodes as the resolver encodes it (IDNA). Cached: receive() splits its bootstrap
    address on every call, and the codec runs in Python."""
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


class _BoundedResponse(http.client.HTTPResponse):
    """An HTTP response read through one deadline: a server dripping its answer meets it too."""

    def __init__(self, sock: socket.socket, *args: Any, deadline: float, **kwargs: Any) -> None:
        """The stdlib response, reading `sock` until `deadline` (time.monotonic())."""
        super().__init__(sock, *args, **kwargs)
        # The stdlib's file stays open until the response closes: the connection lets go of
        # the socket once the response begins, and that file is what keeps it open.
        self.fp = io.BufferedReader(DeadlineReader(sock, deadline, keep=self.fp))


class _BoundedConnection(http.client.HTTPConnection):
    """An HTTP connection whose host name is looked up, and connected to, within its request's deadline
    (its Host header is the name, as given)."""

    def __init__(self, host: str, port: int, *, timeout: float, deadline: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._deadline = deadline

    def connect(self) -> None:
        """Connects to the host's addresses in turn, as socket.create_connection does."""
        self.sock = connect_within(self.host, self.port, self._deadline)
        self.sock.settimeout(self.timeout)


#: How often a wait for the bootstrap server says it still waits (a quarter of the wait, where that is shorter).
WAIT_SAY_S = 10.0


def _tries_text(tries: int) -> str:
    """`1 try`, `2 tries`: a count of tries as a wait's lines and errors say it."""
    return f"{tries} try" if tries == 1 else f"{tries} tries"


def reason(error: BaseException) -> str:
    """What a try to reach the bootstrap server met, in words: a refused connection, a host name that does
    not resolve, no answer in time, or the server's answer (its HTTP status, no route yet). `error` is the
    OSError itself, or the BootstrapError a client raised (its cause the OSError, if any)."""
    cause = error if isinstance(error, OSError) else error.__cause__
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (nothing listens there)"
    if isinstance(cause, socket.gaierror):
        return f"the host name does not resolve ({cause.strerror})"
    if isinstance(cause, TimeoutError):
        return f"no answer ({str(cause) or 'timed out'})"
    if isinstance(error, OSError):
        return f"{type(error).__name__}: {shown(str(error))}"
    return str(error)


class WaitLines:
    """What a wait for the bootstrap server says through `say(level, line)`: nothing where its first try
    succeeds; else, at INFO, what it waits for, how long (`bound`, the setting that bounds it) and until
    when, and why not yet; then, at WARNING, at most every WAIT_SAY_S (a quarter of the wait where that is
    shorter) how long it has waited, the tries and the last reason; once it is over, at INFO, that it is.
    `who`, where given, begins each line."""

    def __init__(self, what: str, timeout_s: float, bound: str, say: Callable[[int, str], None], start: float,
                 who: str = "") -> None:
        self.what, self.timeout_s, self.bound, self._say, self.start = what, timeout_s, bound, say, start
        self._who = f"{who}: " if who else ""
        self._every = min(WAIT_SAY_S, timeout_s / 4)
        self._said_at: float | None = None

    def failed(self, now: float, tries: int, why: str) -> None:
        """A try failed and another follows: says so where it is due."""
        if self._said_at is None:
            until = (datetime.now() + timedelta(seconds=max(0.0, self.start + self.timeout_s - now))).strftime(
                "%H:%M:%S")
            self._say(logging.INFO, f"{self._who}waiting up to {self.timeout_s:g}s ({self.bound}, until {until}) "
                                    f"for {self.what}; not yet: {why}")
        elif now - self._said_at >= self._every:
            self._say(logging.WARNING, f"{self._who}still waiting for {self.what}: {now - self.start:.0f}s of "
                                       f"{self.timeout_s:g}s, {_tries_text(tries)}; last: {why}")
        else:
            return
        self._said_at = now

    def done(self, now: float, tries: int) -> None:
        """The wait is over: says so where it said it waits."""
        if self._said_at is not None:
            self._say(logging.INFO, f"{self._who}done waiting for {self.what}, after {now - self.start:.0f}s "
                                    f"({_tries_text(tries)})")


def waited(what: str, timeout_s: float, attempt: Callable[[float], None], never: str, fix: str,
           say: Callable[[int, str], None], *, who: str = "", bound: str = "timeout", ends_s: float | None = None,
           try_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> float:
    """Tries `attempt(bound_s)` until it returns, for at most `timeout_s` seconds; returns the seconds left.

    `attempt` raises BootstrapError while `what` has not happened, each try given what is left (at least
    0.05 s, at most `try_s`); tries come 0.05 s apart, doubling to 0.5 s. What it says: WaitLines, naming
    `bound` as what ends the wait, after `ends_s` (timeout_s by default; less where the caller ends it
    sooner by other means). Past timeout_s: BootstrapError `NEVER within Ts (N tries), the last: WHY: FIX`.
    """
    start = clock()
    deadline = start + timeout_s
    lines = WaitLines(what, timeout_s if ends_s is None else min(ends_s, timeout_s), bound, say, start, who)
    tries = 0
    delay = 0.05
    while True:
        tries += 1
        try:
            attempt(max(0.05, min(try_s, deadline - clock())))
        except BootstrapError as error:
            why = reason(error)
        else:
            lines.done(clock(), tries)
            return deadline - clock()
        now = clock()
        if now >= deadline:
            raise BootstrapError(f"{never} within {timeout_s:g}s ({_tries_text(tries)}), the last: {why}: {fix}")
        lines.failed(now, tries, why)
        sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.5)


def _logged(level: int, line: str) -> None:
    """A wait's line (WaitLines) in this module's log."""
    log.log(level, "%s", line)


class BootstrapClient:
    """Talks to one bootstrap server with bounded timeouts (http.client: no proxies, no pickles)."""

    def __init__(self, address: str, timeout: float = 2.0, token: str | None = None) -> None:
        """address is "host:port" (ConfigError otherwise); timeout, in (0, 1e6] seconds, bounds each attempt."""
        self.address = address
        self.host, self.port = split_address(address)
        self.timeout = check_seconds("timeout", timeout)
        self.token = check_token(token)
        #: Whether the last register_rank() may have left its route listed: it returned, or one of its
        #: attempts was sent and went unanswered (the server may have taken it), or was cut short by an
        #: exception such as KeyboardInterrupt. False when every attempt was refused a connection or
        #: answered with a refusal: there is no route to withdraw.
        self.may_have_registered = False

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None,
                 timeout: float | None = None, answered: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One HTTP exchange within `timeout`; returns (status, body), and puts the answer's INSTANCE_HEADER, if
        any, in `answered`; OSError/HTTPException on transport failure. A body is read up to one byte past
        MAX_BODY: one that long is longer than any bootstrap server's answer, and is not read further."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        conn = _BoundedConnection(self.host, self.port, timeout=timeout, deadline=deadline)
        # http.client only ever calls response_class(sock, ...), which the partial accepts.
        conn.response_class = cast("type[http.client.HTTPResponse]",
                                   functools.partial(_BoundedResponse, deadline=deadline))
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            instance = response.getheader(INSTANCE_HEADER)
            if answered is not None and instance is not None:
                answered[INSTANCE_HEADER] = instance
            raw = response.read(MAX_BODY + 1)
            if response.length and len(raw) <= MAX_BODY:  # the server closed before its Content-Length
                raise http.client.IncompleteRead(raw, response.length)
            return response.status, raw
        finally:
            conn.close()

    def _get_json(self, path: str, what: str, timeout: float | None = None,
                  answered: dict[str, str] | None = None) -> tuple[int, Any]:
        """One GET within `timeout` (the client's by default); BootstrapError when unreachable or the body is
        not JSON on 200. `answered`: see _request()."""
        try:
            status, raw = self._request("GET", path, timeout=timeout, answered=answered)
        except (OSError, http.client.HTTPException) as error:
            raise BootstrapUnreachable(f"bootstrap server {self.address} unreachable for {what}: "
                                       f"{shown(str(error)) or type(error).__name__}") from error
        if status != 200:
            return status, shown(raw.decode("utf-8", "replace"))
        if len(raw) > MAX_BODY:
            raise BootstrapError(f"bootstrap server {self.address} sent an answer over {MAX_BODY} bytes for "
                                 f"{what}, longer than any bootstrap server's: is it the bootstrap server's "
                                 f"address?")
        try:
            return status, json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            raise BootstrapError(f"bootstrap server {self.address} sent a body that is not "
                                 f"JSON for {what}") from None

    def register_rank(self, world_size: int, dp_size: int, rank_ip: str, rank_port: int,
                      engine_rank: int, retry_for: float = 30.0, instance: str | None = None,
                      only_if_absent: bool = False) -> bool:
        """PUT this encode rank's endpoint, retrying refusals and 5xx until retry_for elapses; BootstrapError after.

        `instance` (ours, docs/protocol.md section 8): the registering process's nonce, sent in the
        INSTANCE_HEADER header; its unregister_rank() names it, so that withdrawal leaves a successor
        registered at the same endpoint alone. The body is the SPEC's either way.

        BootstrapUnreachable when no attempt got an answer at all (refused, reset or timed out).
        Only a bootstrap server's answer registers: 200 with our server's JSON (`"status": "OK"`),
        a peer's plain `OK`, or an empty body. Any other 200, a redirect, a 4xx or a 501 (a server that takes no
        PUT: not a bootstrap server) is a BootstrapError at once.
        ConfigError for a `retry_for` outside [0, 1e6] seconds (NaN included), before any request. Each
        attempt takes at most the client's timeout, cut to what is left of `retry_for`; `retry_for=0`
        makes one attempt, within the client's timeout.
        `may_have_registered` says afterwards whether the server may list the route (see there).

        `only_if_absent` sends `If-None-Match: *` (ours, docs/protocol.md section 8): our server then
        replaces no other registration of the rank (412), and this returns False; True when it
        registered. A peer's server ignores the header and registers.
        """
        retry_for = check_seconds("retry_for", retry_for, zero_ok=True)
        body, headers = self._route_request(world_size, dp_size, rank_ip, rank_port, engine_rank, instance)
        if only_if_absent:
            headers["If-None-Match"] = "*"
        start = time.monotonic()
        deadline = start + retry_for
        lines = WaitLines(f"encode rank {engine_rank} to be registered at bootstrap {self.address}", retry_for,
                          "retry_for", _logged, start, who="BootstrapClient.register_rank")
        tries = 0
        delay = 0.05
        self.may_have_registered = False
        answered = False  # whether any attempt got an HTTP answer
        while True:
            tries += 1
            remaining = deadline - time.monotonic()
            # One attempt (retry_for 0) takes the client's whole timeout; retries share what is left of retry_for.
            attempt_s = self.timeout if not retry_for else max(0.05, min(self.timeout, remaining))
            # From the request on, the server may list the route until this attempt is known to have registered
            # nothing: a stop signal's exception (KeyboardInterrupt) anywhere in between leaves it True.
            before, self.may_have_registered = self.may_have_registered, True
            try:
                status, raw = self._request("PUT", "/route", body, headers, timeout=attempt_s)
            except (OSError, http.client.HTTPException) as error:
                last = f"{type(error).__name__}: {shown(str(error))}"
                why = reason(error) if isinstance(error, OSError) else last
                # Only a refused connection (or a name that does not resolve) surely sent nothing.
                if isinstance(error, (ConnectionRefusedError, socket.gaierror)):
                    self.may_have_registered = before
            else:
                answered = True
                if status == 200 and _registered(raw):
                    lines.done(time.monotonic(), tries)
                    return True
                self.may_have_registered = before  # an answer that registered nothing (raised below, or retried)
                text = shown(raw.decode("utf-8", "replace"))
                if status == 412 and only_if_absent:  # another registration holds the rank: left alone
                    return False
                refused = self._refused(engine_rank, status, text)
                if refused is not None:
                    raise refused
                last = why = f"HTTP {status}: {text}"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                said = (f"could not register encode rank {engine_rank} with bootstrap server {self.address} "
                        f"within {retry_for:g}s ({_tries_text(tries)}), the last: {last}")
                if answered:
                    raise BootstrapError(said)
                raise BootstrapUnreachable(f"{said}; nothing answered there: start the bootstrap server "
                                           f"(`epd-transfer bootstrap`, or a BootstrapServer) first, or check "
                                           f"the address and the firewall")
            lines.failed(time.monotonic(), tries, why)
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.5)

    def _refused(self, engine_rank: int, status: int, text: str) -> BootstrapError | None:
        """The error for an answer to encode rank `engine_rank`'s registration that registered nothing and
        that no retry changes (any 2xx, 3xx, 4xx, and 501: not a bootstrap server's, or a refusal); None
        for the other 5xx, which register_rank() retries. `text` is the answer's body, shown."""
        if status == 200:
            return BootstrapError(f"{self.address} answered encode rank {engine_rank}'s registration with "
                                  f"HTTP 200 and {text!r}, which no bootstrap server answers: is it the "
                                  f"bootstrap server's address?")
        if 300 <= status < 400:
            return BootstrapError(f"{self.address} redirected encode rank {engine_rank}'s registration "
                                  f"(HTTP {status}), which no bootstrap server does: give the bootstrap "
                                  f"server's own address")
        if status == 401:
            sent = "the token sent is not the server's" if self.token else "no token was sent"
            return BootstrapError(f"bootstrap server {self.address} refused encode rank {engine_rank}: "
                                  f"HTTP 401: {text} ({sent}): give the sender pool the server's token "
                                  f"(token=; `epd-transfer rank`: --token or EPD_TOKEN)")
        if status == 409 and "restart" not in text:  # a server that does not say what to do
            return BootstrapError(f"bootstrap server {self.address} refused encode rank {engine_rank}: "
                                  f"HTTP 409: {text}: sizes other than its first registration's? "
                                  f"{_SIZES_STAY}")
        if status == 501:  # Not Implemented: a server that takes no PUT, which retrying does not change
            return BootstrapError(f"{self.address} answered encode rank {engine_rank}'s registration with "
                                  f"HTTP 501 (PUT not implemented), which no bootstrap server answers: is "
                                  f"it the bootstrap server's address (not a metrics endpoint's, say)? It "
                                  f"said: {text}")
        if status < 500:
            return BootstrapError(f"bootstrap server {self.address} refused encode rank "
                                  f"{engine_rank}: HTTP {status}: {text}")
        return None

    def unregister_rank(self, world_size: int, dp_size: int, rank_ip: str, rank_port: int,
                        engine_rank: int, timeout: float = 1.0, instance: str | None = None) -> bool:
        """DELETE this encode rank's route (ours, docs/protocol.md section 8): one attempt within `timeout`
        seconds (at most 1e6). With `instance` (the one its register_rank() sent), only the route that
        registration made is removed.

        True when the server removed it; False when it kept it because the route leads to
        another endpoint now (a rank restarted there), was registered by another instance
        (a rank restarted at the same endpoint), or leads to none. BootstrapUnreachable
        without an answer; BootstrapError for any other answer (a peer's server, which has
        no DELETE, answers 404, 405 or 501).
        """
        timeout = check_seconds("timeout", timeout)
        body, headers = self._route_request(world_size, dp_size, rank_ip, rank_port, engine_rank, instance)
        try:
            status, raw = self._request("DELETE", "/route", body, headers, timeout=timeout)
        except (OSError, http.client.HTTPException) as error:
            raise BootstrapUnreachable(f"bootstrap server {self.address} unreachable to unregister encode rank "
                                       f"{engine_rank}: {shown(str(error)) or type(error).__name__}") from error
        text = shown(raw.decode("utf-8", "replace"))
        if status != 200:
            raise BootstrapError(f"bootstrap server {self.address} did not unregister encode rank {engine_rank}: "
                                 f"HTTP {status}: {text}")
        removed = _unregistered(raw)
        if removed is None:
            raise BootstrapError(f"{self.address} answered encode rank {engine_rank}'s unregistration with HTTP 200 "
                                 f"and {text!r}, which no bootstrap server of ours answers")
        return removed

    def _route_request(self, world_size: int, dp_size: int, rank_ip: str, rank_port: int,
                       engine_rank: int, instance: str | None = None) -> tuple[bytes, dict[str, str]]:
        """The body and headers of a PUT or DELETE /route for one encode rank (the token's header with a token,
        the instance's with an instance); ConfigError for an instance the server would refuse."""
        body = json.dumps({"role": ROLE, "world_size": world_size, "dp_size": dp_size,
                           "rank_ip": rank_ip, "rank_port": rank_port,
                           "engine_rank": engine_rank}).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if instance is not None:
            if not isinstance(instance, str) or not _INSTANCE.match(instance):
                raise ConfigError(f"an instance must be 1 to 64 letters, digits, '-' or '_', got {instance!r}")
            headers[INSTANCE_HEADER] = instance
        return body, headers

    def parallel_info(self, timeout: float | None = None) -> tuple[int, int]:
        """(world_size, dp_size) of the encode side; one attempt within `timeout` (the client's by default),
        BootstrapError if none."""
        status, value = self._get_json("/route?engine_rank=-1&target_dp_group=-1", "parallel info", timeout)
        if status != 200:
            raise BootstrapError(f"bootstrap server {self.address} answered HTTP {status} "
                                 f"for parallel info: {value}")
        world_size, dp_size = None, None
        if isinstance(value, dict):
            world_size, dp_size = value.get("prefill_tp_size"), value.get("prefill_dp_size")
        if not (_positive_int(world_size) and _positive_int(dp_size)):
            raise BootstrapError(f"bootstrap server {self.address} has incomplete parallel info "
                                 f"(no encode rank registered yet?): {shown(repr(value))}")
        if world_size > MAX_WORLD_SIZE or world_size % dp_size:
            raise BootstrapError(f"bootstrap server {self.address} sent parallel sizes no deployment "
                                 f"has: encode tp size {_shown_int(world_size)} (at most {MAX_WORLD_SIZE}), "
                                 f"dp size {_shown_int(dp_size)} (must divide it)")
        return world_size, dp_size

    def route(self, engine_rank: int, dp_group: int, timeout: float | None = None) -> tuple[str, int]:
        """(ip, port) of encode rank engine_rank in dp_group; one attempt within `timeout` (the client's by
        default): BootstrapError if none, BootstrapNoRoute when the server answered that it has none."""
        return self.registration(engine_rank, dp_group, timeout)[:2]

    def registration(self, engine_rank: int, dp_group: int,
                     timeout: float | None = None) -> tuple[str, int, str | None]:
        """route(), with the instance that registered it where the server names it (ours, docs/protocol.md
        section 8; None from a peer's server, or for a registration that named none)."""
        path = f"/route?engine_rank={int(engine_rank)}&target_dp_group={int(dp_group)}"
        answered: dict[str, str] = {}
        status, value = self._get_json(path, f"encode rank {engine_rank}", timeout, answered)
        if status == 404:
            raise BootstrapNoRoute(f"no route for encode rank {engine_rank} in dp group "
                                   f"{dp_group} at {self.address}")
        if status != 200:
            raise BootstrapError(f"bootstrap server {self.address} answered HTTP {status} "
                                 f"for encode rank {engine_rank}: {value}")
        ip = value.get("rank_ip") if isinstance(value, dict) else None
        port = value.get("rank_port") if isinstance(value, dict) else None
        if not isinstance(ip, str) or not isinstance(port, int) or isinstance(port, bool):
            raise BootstrapError(f"bootstrap server {self.address} sent an incomplete route "
                                 f"for encode rank {engine_rank}: {shown(repr(value))}")
        if not 0 < len(ip) <= MAX_HOST_CHARS or not _HOST.fullmatch(ip) or not 1 <= port <= 65535:
            raise BootstrapError(f"bootstrap server {self.address} sent a route no encode rank has "
                                 f"for encode rank {engine_rank}: host {ip[:MAX_HOST_CHARS]!r} (1 to "
                                 f"{MAX_HOST_CHARS} letters, digits, '.', '-', '_', ':', '%'), port {_shown_int(port)} "
                                 f"(1 to 65535)")
        instance = answered.get(INSTANCE_HEADER)
        return ip, port, instance if instance is not None and _INSTANCE.match(instance) else None

    def wait_ready(self, timeout: float, encode_rank: int | None = None, dp_group: int = 0) -> tuple[int, int]:
        """Blocks until the encode side registered, at most `timeout` seconds; returns (world_size, dp_size).

        For a prefill rank started before its encode ranks: call it before the first
        receive(), whose rooms would otherwise fail at once (no encode rank registered
        yet). With `encode_rank`, also waits for that rank's route in `dp_group`. Raises
        BootstrapError naming the address, the tries and the last answer once the timeout
        passed; ConfigError for a timeout outside [0, 1e6] seconds (ConfigTypeError for one
        that is not a number). Logged (this module's logger): where the first try fails, at
        INFO, what it waits for, the address and until when; at WARNING, at most every 10 s,
        how long it has waited and the last reason; at INFO, that it is over.
        """
        timeout = check_seconds("timeout", timeout, zero_ok=True)
        deadline = time.monotonic() + timeout

        def left() -> float:  # each look-up within what is left of the wait (and the client's own bound)
            return max(0.05, min(self.timeout, deadline - time.monotonic()))

        sizes: list[tuple[int, int]] = []

        def ready(_bound_s: float) -> None:
            found = self.parallel_info(left())
            if encode_rank is not None:
                self.route(encode_rank, dp_group, left())
            sizes.append(found)

        if encode_rank is None:
            what, never = f"an encode rank to register at bootstrap {self.address}", "no encode rank registered"
        else:
            what = f"encode rank {encode_rank} (dp group {dp_group}) to register at bootstrap {self.address}"
            never = f"encode rank {encode_rank} (dp group {dp_group}) never registered"
        waited(what, timeout, ready, f"{never} at bootstrap {self.address}",
               "start the encode ranks (and the bootstrap server), or give the address they register at",
               _logged, who="BootstrapClient.wait_ready", bound="timeout", try_s=self.timeout,
               clock=time.monotonic, sleep=time.sleep)
        return sizes[-1]

    def health(self) -> bool:
        """True when the server answers /health with 200 OK."""
        try:
            status, raw = self._request("GET", "/health")
        except (OSError, http.client.HTTPException):
            return False
        return status == 200 and raw.strip() == b"OK"

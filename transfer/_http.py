"""The bounded HTTP plumbing shared by the bootstrap server (and its client) and the /metrics endpoint.

Both listen where anyone on the network may connect, so both bound what a client can
hold: one request per connection, a short deadline for its request line and headers
(a real client sends them in one write) and a byte budget for them (431 beyond), one
deadline for the whole request however slowly it drips in, and a cap on connections
served at once, in all and from one address (503 beyond, answered without blocking the
accepting thread), so one client cannot keep every other one out. Clients from several
addresses that each stay under their own cap can still fill every place with requests they
never finish: a new connection then takes the place of the oldest one still being read,
which is read no further (what it already sent is still served), so requests that are sent
whole are answered however many unfinished ones are held open.
"""

from __future__ import annotations

import email.errors
import io
import logging
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self  # 3.11+; the package runs on 3.10 too


class DeadlineReader(io.RawIOBase):
    """A socket's reads, each bounded by what is left of one deadline for a whole exchange.

    The socket's own timeout bounds each read alone: a peer sending a byte now and
    then would hold the reading thread for ever. `budget`, while not None, is how many
    more bytes may be read: past it reads see the end of the stream, and `exhausted` says so.
    """

    def __init__(self, sock: socket.socket, deadline: float, keep: Any = None, budget: int | None = None) -> None:
        """Reads from `sock` until `deadline` (time.monotonic()); `keep` is closed along with it."""
        super().__init__()
        self._sock = sock
        self.deadline = deadline
        self._keep = keep
        self.budget = budget
        self.exhausted = False
        self.eof = False  # a read found the stream ended (the peer, or a shutdown of our side, ended it)

    def close(self) -> None:
        """Closes the reader and what it keeps."""
        if self._keep is not None:
            self._keep.close()
            self._keep = None
        super().close()

    def readable(self) -> bool:
        """A reader."""
        return True

    def readinto(self, buffer: Any) -> int:
        """One recv, waiting at most until the deadline (TimeoutError past it)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out: the exchange's deadline passed")
        if self.budget is not None:
            if self.budget <= 0:
                self.exhausted = True
                return 0
            buffer = memoryview(buffer).cast("B")[: self.budget]
        self._sock.settimeout(left)
        count = self._sock.recv_into(buffer)
        if count == 0 and len(buffer):
            self.eof = True
        if self.budget is not None:
            self.budget -= count
        return count


#: What the stdlib's header parser notes for a header line it could not read as one (a space before the colon, no
#: colon, no name, a first line that continues none): it drops that line, and every one after it.
_NO_HEADER = (email.errors.MissingHeaderBodySeparatorDefect, email.errors.FirstHeaderLineIsContinuationDefect,
              email.errors.InvalidHeaderDefect)


class _LineReader(io.BufferedReader):
    """A buffered reader noting whether a line read from it (the request line and headers are read by lines,
    a body is not) holds a CR other than its ending's, or a NUL.

    The stdlib's header parser takes a lone CR for a line's end: behind one, a header line carries
    another header, which a reader going by the HTTP spec (that refuses such a line, or reads the CR
    as a space) never saw: a Content-Length, an Authorization, a header of ours."""

    malformed = False

    def readline(self, size: int | None = -1, /) -> bytes:
        """One line, noted as malformed where it holds a CR before its end or a NUL."""
        line = super().readline(size)
        text = line[:-2] if line.endswith(b"\r\n") else line[:-1] if line.endswith(b"\n") else line
        if b"\r" in text or b"\x00" in text:
            self.malformed = True
        return line


class OneDeadlineHandler(BaseHTTPRequestHandler):
    """A request handler that reads its request line and headers within `header_timeout`
    seconds and `header_bytes` bytes, and its one request (HTTP/1.0) within `timeout`
    seconds in all.

    The handler's thread is one of the server's few slots: a client that connects and
    says nothing must give it back in about a second, not after the whole request's
    deadline. BaseHTTPRequestHandler answers a timeout by closing the connection; with
    one request per connection no handler thread lingers on a keep-alive socket. The
    byte budget bounds what each connection's headers hold in memory (the stdlib alone
    allows 100 lines of 64 KiB); bytes of the body read along with the headers count too.
    A request line or header holding a CR before its line's end, or a NUL, is a 400 (see _LineReader), and so
    is a header line that is no header: the stdlib would drop it and the headers after it, where a reader going
    by the HTTP spec refuses the request.
    """

    protocol_version = "HTTP/1.0"
    timeout = 10.0
    header_timeout = 1.0
    header_bytes = 16 * 1024

    def setup(self) -> None:
        """Reads the request through deadlines that start now."""
        super().setup()
        self._connected_at = time.monotonic()
        self.rfile.close()
        self._reader = DeadlineReader(self.connection, self._connected_at + min(self.header_timeout, self.timeout),
                                      budget=self.header_bytes)
        self.rfile = self._lines = _LineReader(self._reader)

    def parse_request(self) -> bool:
        """Parses the request line and headers; the body, if any, gets the rest of `timeout`."""
        too_long = f"request line and headers over {self.header_bytes} bytes"
        if self._reader.exhausted and not getattr(self, "raw_requestline", b"").endswith(b"\n"):
            self.requestline, self.request_version, self.command = "", "", ""
            self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG, too_long)
            return False
        parsed = super().parse_request()
        if parsed and self._reader.exhausted:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, too_long)
            return False
        if parsed and self._lines.malformed:
            self.send_error(HTTPStatus.BAD_REQUEST, "a CR inside a line, or a NUL, in the request line or headers")
            return False
        if parsed and any(isinstance(defect, _NO_HEADER) for defect in self.headers.defects):
            self.send_error(HTTPStatus.BAD_REQUEST,
                            "a header line that is no header (a name, a colon right after it, a value)")
            return False
        self._reader.budget = None
        self._reader.deadline = self._connected_at + self.timeout
        return parsed

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Answers an error (the stdlib's own ones too: 400, 501, ...) as a short text/plain body naming
        the problem, not the stdlib's HTML page, and closes the connection."""
        self.log_error("code %d, message %s", code, message)
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            # A request line the stdlib could not read leaves it at HTTP/0.9, which answers with a bare
            # body: the client would see neither the status nor that it is an error.
            self.request_version = self.protocol_version
        self._text(code, message or self.responses.get(code, ("error",))[0])

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        """Send one complete response (a HEAD request's without its body), with `headers` besides its own.

        A request whose reading was ended to make room for a newer connection, and found its end there, is
        answered 503 instead: whatever it got to was about a request cut short, not the one its client sent."""
        server = self.server
        if isinstance(server, BoundedHTTPServer) and server.answering(self.connection) and self._reader.eof:
            status, content_type, headers = 503, "text/plain; charset=utf-8", None
            body = (f"{server.busy_text.decode()}: this request was still incomplete when a newer connection "
                    f"needed its place").encode()
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _text(self, status: int, text: str) -> None:
        """Send a text/plain response."""
        self._send(status, text.encode(), "text/plain; charset=utf-8")


def _client_of(client_address: Any) -> str:
    """The address a connection came from (its host, whatever its port)."""
    return str(client_address[0]) if isinstance(client_address, tuple) and client_address else str(client_address)


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer serving at most `max_handlers` connections at once, and at most
    `max_per_client` of them from one address (a quarter of max_handlers when None); the rest get 503.
    With every place taken, a connection from an address under its cap takes the place of the oldest
    connection whose request is still being read: that one's reading side is shut down, so its thread
    serves what was already received and ends (at most max_handlers such threads at once, or the new
    connection gets 503 too). server_close() ends the connections still being served and waits for their
    threads."""

    daemon_threads = True
    # Connections wait here while the accepting thread is held up (a busy process's GIL): the stdlib's
    # backlog of 5 drops the handshakes of a burst beyond it, which clients retry only after 1 s, 3 s, ...
    request_queue_size = 128
    max_handlers = 64
    max_per_client: int | None = None
    busy_text = b"server busy: too many connections at once"
    client_busy_text = b"server busy: too many connections from this address at once"
    log = logging.getLogger("transfer.http")
    #: How long server_close() waits, in all, for the handler threads once their connections are shut down.
    close_wait_s = 5.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The stdlib server, counting its handler threads, in all and per client address."""
        self._handlers = 0
        self._per_client: dict[str, int] = {}
        self._serving: dict[socket.socket, threading.Thread] = {}  # each connection served, and its thread
        self._reading: dict[socket.socket, None] = {}  # those whose request is still being read, oldest first
        self._evicted: set[socket.socket] = set()  # those whose place a newer connection took, still served
        self._handlers_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    @classmethod
    def for_host(cls, host: str) -> type[Self]:
        """This class, or its IPv6 variant for an IPv6 literal."""
        if ":" not in host:
            return cls
        return type(f"{cls.__name__}6", (cls,), {"address_family": socket.AF_INET6})

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hands the connection to a thread of its own, or turns it away when max_handlers are busy, or
        max_per_client with its address."""
        client = _client_of(client_address)
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  daemon=self.daemon_threads)
        with self._handlers_lock:
            per_client = self.max_per_client or max(1, self.max_handlers // 4)
            under_cap = self._per_client.get(client, 0) < per_client
            busy = None
            if self._handlers - len(self._evicted) >= self.max_handlers:
                if not (under_cap and self._evict_oldest_reader()):
                    busy = self.busy_text
            elif not under_cap:
                busy = self.client_busy_text
            if busy is None:
                self._handlers += 1
                self._per_client[client] = self._per_client.get(client, 0) + 1
                self._serving[request] = thread
                self._reading[request] = None
        if busy is not None:
            self._turn_away(request, busy)
            self.shutdown_request(request)
            return
        try:
            thread.start()
        except BaseException:
            self._handler_done(client, request)
            raise

    def _evict_oldest_reader(self) -> bool:
        """Shuts down the reading side of the oldest connection whose request is still being read, if any and
        while fewer than max_handlers such connections are still served; whether it did (lock held: a listed
        connection is not closed under the shutdown)."""
        if not self._reading or len(self._evicted) >= self.max_handlers:
            return False
        victim = next(iter(self._reading))
        del self._reading[victim]
        self._evicted.add(victim)
        try:
            victim.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        return True

    def answering(self, request: socket.socket) -> bool:
        """Notes that `request`'s handler read what it will and answers now (no newer connection takes its place
        from here on); whether a newer one took it before."""
        with self._handlers_lock:
            self._reading.pop(request, None)
            return request in self._evicted

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serves one connection on its thread, counts it out, then closes it: a client that saw its
        connection close finds the place free."""
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._handler_done(_client_of(client_address), request)
            self.shutdown_request(request)

    def _handler_done(self, client: str, request: socket.socket) -> None:
        """One handler thread fewer, one of `client`'s (its connection is closed next, not by server_close())."""
        with self._handlers_lock:
            self._handlers -= 1
            self._serving.pop(request, None)
            self._reading.pop(request, None)
            self._evicted.discard(request)
            left = self._per_client.pop(client, 1) - 1
            if left > 0:
                self._per_client[client] = left

    def server_close(self) -> None:
        """Closes the listening socket, then shuts down the connections still being served and waits for
        their threads, `close_wait_s` for all of them: a closed server answers no request it had not answered
        yet."""
        super().server_close()
        deadline = time.monotonic() + self.close_wait_s
        with self._handlers_lock:  # held: a connection listed here is not closed under the shutdown
            serving = list(self._serving.items())
            for request, _ in serving:
                try:
                    request.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for _, thread in serving:
            if thread.ident is not None and thread is not threading.current_thread():  # started, not ours
                thread.join(max(0.0, deadline - time.monotonic()))

    def close_copies(self) -> None:
        """In a process forked from the server's: closes this process's copies of the listening socket and
        of the connections being served, never shutting one down (that would end the parent's), taking no
        lock (a thread of the parent's may have held it at the fork)."""
        for sock in [self.socket, *list(self._serving)]:
            try:
                sock.close()
            except OSError:
                pass

    def _turn_away(self, request: socket.socket, text: bytes) -> None:
        """Answers 503 without blocking the accepting thread (the client may not read it)."""
        answer = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(text), text))
        try:
            request.setblocking(False)
            try:
                request.recv(64 * 1024)  # unread bytes at close() would reset the answer away
            except OSError:
                pass
            request.send(answer)
        except OSError:
            pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Logs a failed request instead of printing to stderr; a client that went away is routine."""
        level = logging.DEBUG if isinstance(sys.exc_info()[1], OSError) else logging.ERROR
        self.log.log(level, "request from %s failed", client_address, exc_info=True)

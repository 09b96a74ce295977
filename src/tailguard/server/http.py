"""HTTP/1.1 on uvloop + httptools, straight into the app: no ASGI layer in between.

Why our own protocol instead of uvicorn: measured on this machine with wrk (64 keep-alive
connections, a trivial JSON POST), a minimal httptools protocol answered ~93k requests/s where
the same echo as a raw ASGI app on uvicorn answered ~23k: uvicorn's per-request Python (scope
dict, ASGI message dicts, the request-response cycle object, flow control, two writes per
response) costs about three quarters of a trivial request. tailguard's front end is the part
that must stay cheap under a 10,000-connection burst, so it parses with httptools and calls
`App.handle(call)` directly.

What a connection does (`HttpProtocol`):
- parses with httptools; a malformed request gets a 400 and the connection closes;
- bounds the body (`max_body_bytes`): a too-large `Content-Length` is answered 413 at once,
  without reading the body; `Expect: 100-continue` is honoured;
- runs one request at a time in a task; pipelined requests wait their turn in order (reading
  pauses when too many are queued);
- writes every non-streaming response in one `write` (status line, headers, body); streams
  (SSE) use chunked transfer encoding and wait for the socket to drain under back-pressure;
- keeps the connection alive (HTTP/1.1, or 1.0 with keep-alive) with no request cap, and closes
  it after `keepalive_timeout_s` idle (one sweep a second for all connections, not a timer per
  request); a request whose headers or body trickle in slower than that is closed too;
- a client that disconnects cancels its request's task, which aborts the engine request.
Accepting connections and starting / stopping the server: tailguard.server.serving.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from collections import deque
from http import HTTPStatus
from typing import TYPE_CHECKING
from urllib.parse import unquote

import httptools

from tailguard.errors import InvalidRequestError, PayloadTooLargeError, TailguardError
from tailguard.server.app import Call
from tailguard.server.errors import error_answer

if TYPE_CHECKING:
    from tailguard.server.app import App

__all__ = ["HttpProtocol", "HttpServer"]

log = logging.getLogger("tailguard.server")
access_log = logging.getLogger("tailguard.access")

_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CLOSE = b"connection: close\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_LENGTH_CLOSE = b"content-length: %d\r\nconnection: close\r\n\r\n"
_MAX_PIPELINED = 16  # queued requests on one connection before reading pauses


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


def _date_header() -> bytes:
    return b"date: " + email.utils.formatdate(usegmt=True).encode() + b"\r\n"


class HttpServer:
    """What every connection shares: the app, limits, the live connections, the date header."""

    def __init__(self, app: App) -> None:
        cfg = app.config
        self.app = app
        self.loop = asyncio.get_running_loop()
        self.max_body = cfg.max_body_bytes
        self.idle_timeout_s = float(cfg.keepalive_timeout_s)
        self.access_log = cfg.access_log
        self.metrics = app.metrics
        self.connections: set[HttpProtocol] = set()
        self.date = _date_header()
        self.draining = False
        self.per_iteration = cfg.handlers_per_iteration
        self._taken = 0  # data chunks taken up in this loop iteration
        # chunks left for later iterations, with the time they were read
        self._inbox: deque[tuple[HttpProtocol, bytes, float]] = deque()
        self._intake_wait = app.metrics.intake
        self._reset_pending = False

    # ---- intake: a bounded slice of newly read data per loop iteration -------------------------
    def take(self, conn: HttpProtocol, data: bytes) -> None:
        """Process `data` (parse, start handlers) now if this iteration has room, else later.

        Why: the kernel hands over everything that became readable at once. At the start of a
        10,000-connection burst that was ~9,000 requests in one loop iteration (236 ms of
        parsing and handler starts), while answers for admitted requests waited behind it.
        Here each iteration parses at most `handlers_per_iteration` chunks; the rest wait in
        arrival order, a connection's later data behind its earlier data. Server time (request
        read -> response written) starts when a request is parsed, as for a request that waits
        in the kernel's socket buffer; the wait here is measured on its own
        (`tailguard_intake_wait_seconds`).
        """
        if conn.deferred == 0 and self._taken < self.per_iteration and not self._inbox:
            self._taken += 1
            if not self._reset_pending:
                self._reset_pending = True
                self.loop.call_soon(self._next_iteration)
            conn.feed(data, time.monotonic())
            return
        conn.deferred += 1
        self._inbox.append((conn, data, time.monotonic()))
        if not self._reset_pending:
            self._reset_pending = True
            self.loop.call_soon(self._next_iteration)

    def _next_iteration(self) -> None:
        """Once per loop iteration while there is intake: a new budget, oldest data first."""
        self._reset_pending = False
        self._taken = 0
        inbox = self._inbox
        now = time.monotonic()
        while inbox and self._taken < self.per_iteration:
            conn, data, t_read = inbox.popleft()
            conn.deferred -= 1
            if not conn.closed:
                self._taken += 1
                self._intake_wait.observe(now - t_read)
                conn.feed(data, t_read)
        if inbox or self._taken:
            self._reset_pending = True
            self.loop.call_soon(self._next_iteration)

    def protocol(self) -> HttpProtocol:
        return HttpProtocol(self)

    def sweep(self, now: float) -> None:
        """Once a second: refresh the date header; close idle and stalled connections."""
        self.date = _date_header()
        cutoff = now - self.idle_timeout_s
        for conn in [c for c in self.connections if c.since < cutoff and c.call is None]:
            conn.close()

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.sweep(time.monotonic())

    def drain(self) -> None:
        """Graceful shutdown: idle connections close now, busy ones after their answer."""
        self.draining = True
        for conn in list(self.connections):
            if conn.call is None and not conn.pending:
                conn.close()

    @property
    def busy(self) -> int:
        return sum(1 for c in self.connections if c.call is not None)


class HttpProtocol(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    __slots__ = (
        "_body",
        "_body_size",
        "_discard",
        "_drained",
        "_headers",
        "_parser",
        "_t_arrival",
        "_t_chunk",
        "_url",
        "call",
        "client",
        "closed",
        "deferred",
        "pending",
        "requests",
        "server",
        "since",
        "transport",
        "write_paused",
    )

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._discard = False  # stop parsing: after a 413 or a malformed request
        self._t_chunk = 0.0  # when the data being parsed was read from the socket
        self._t_arrival = 0.0  # when the first bytes of the request being parsed were read
        self.call: Call | None = None  # the request being answered
        self.pending: deque[Call] = deque()  # pipelined requests waiting their turn
        self.client = ""
        self.closed = False
        self.deferred = 0  # data chunks waiting in the server's intake
        self.requests = 0
        self.since = time.monotonic()  # idle since / reading since (for the sweep)
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None

    # ---- connection events --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if peer else ""
        self.server.connections.add(self)
        self.server.metrics.connection_opened()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.server.metrics.connection_closed(self.requests)
        self.pending.clear()
        if self.call is not None:
            self.call.disconnect()  # nobody to answer: cancel it (aborts the engine request)
        self._wake_writer()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def data_received(self, data: bytes) -> None:
        self.server.take(self, data)

    def feed(self, data: bytes, t_read: float) -> None:
        """Parse `data`, read from the socket at `t_read` (called by the server's intake, at
        most a slice per loop iteration)."""
        if self._discard:
            return
        self._t_chunk = t_read
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject_connection(
                InvalidRequestError("protocol upgrade is not supported; send plain HTTP/1.1")
            )
        except httptools.HttpParserError as e:
            self._reject_connection(
                InvalidRequestError(f"malformed HTTP request: {e}; send valid HTTP/1.1")
            )

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    # ---- httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._t_arrival = self._t_chunk  # a request arrives with its first bytes
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_size = 0
        self.requests += 1
        if self.call is None:
            self.since = time.monotonic()  # now reading: the sweep closes it if this stalls

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        old = self._headers.get(name)
        self._headers[name] = value if old is None else old + b", " + value

    def on_headers_complete(self) -> None:
        length = self._headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body:
            self._too_large(f"request body is {length.decode()} bytes")
        elif self._headers.get(b"expect", b"").lower() == b"100-continue":
            self._write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self._discard:
            return
        self._body_size += len(body)
        if self._body_size > self.server.max_body:
            self._too_large("request body (chunked) is longer than allowed")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._discard:
            return
        call = self._new_call()
        if self.call is None:
            self._start(call)
        else:
            self.pending.append(call)
            if len(self.pending) >= _MAX_PIPELINED and self.transport is not None:
                self.transport.pause_reading()

    # ---- requests -----------------------------------------------------------------------------
    def _new_call(self) -> Call:
        url = self._url
        q = url.find(b"?")
        path = (url if q < 0 else url[:q]).decode("latin-1")
        if "%" in path:
            path = unquote(path)
        body = self._body
        return Call(
            self._parser.get_method().decode("latin-1"),
            path,
            self._headers,
            body[0] if len(body) == 1 else b"".join(body),
            self.client,
            self,
            keep_alive=self._parser.should_keep_alive(),
            t_arrival=self._t_arrival,
        )

    def _too_large(self, what: str) -> None:
        """Answer 413 without reading the rest of the body; the connection closes after it."""
        call = self._new_call()
        call.body = b""
        call.keep_alive = False
        call.error = PayloadTooLargeError(
            f"{what}; the limit is {self.server.max_body} bytes (max_body_bytes): "
            "send less per request"
        )
        self._discard = True  # read nothing more from this connection
        if self.call is None:
            self._start(call)
        else:
            self.pending.append(call)

    def _start(self, call: Call) -> None:
        self.call = call
        task = self.server.loop.create_task(self.server.app.handle(call))
        call.task = task
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        call, self.call = self.call, None
        if self.closed:
            return
        if call is not None and not call.done:
            # the handler ended without an answer (it should not): never leave a client hanging
            log.error("no answer for %s %s; closing the connection", call.method, call.path)
            self.close()
        elif call is not None and not call.keep_alive:
            self.close()
        elif self.pending:
            nxt = self.pending.popleft()
            if len(self.pending) < _MAX_PIPELINED // 2 and self.transport is not None:
                self.transport.resume_reading()
            self._start(nxt)
        elif self.server.draining or self._discard:
            self.close()
        else:
            self.since = time.monotonic()  # idle from now

    def _reject_connection(self, exc: TailguardError) -> None:
        """A request that cannot be parsed: answer 400 and close (after any answer under way)."""
        self._discard = True
        self.pending.clear()
        if self.call is not None:
            self.call.keep_alive = False
            return
        ans = error_answer(exc)
        self._write(
            self._head(ans.status, [(b"content-type", b"application/json"), *ans.headers])
            + b"content-length: %d\r\n%s\r\n" % (len(ans.body), _CLOSE)
            + ans.body
        )
        self.close()

    # ---- responses (the Conn interface of tailguard.server.app.Call) --------------------------
    def _write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        parts = [_status_line(status), self.server.date]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        return b"".join(parts)

    def send_response(
        self, call: Call, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        if self.server.draining or (b"connection", b"close") in headers:
            call.keep_alive = False
        tail = b"content-length: %d\r\n\r\n" if call.keep_alive else _LENGTH_CLOSE
        self._write(self._head(status, headers) + tail % len(body) + body)
        if self.server.access_log:
            access_log.info('%s "%s %s" %d', call.client, call.method, call.path, status)

    def send_head(self, call: Call, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.server.draining:
            call.keep_alive = False
        end = b"\r\n" if call.keep_alive else _CLOSE + b"\r\n"
        self._write(self._head(status, headers) + _CHUNKED + end)
        if self.server.access_log:
            access_log.info('%s "%s %s" %d (stream)', call.client, call.method, call.path, status)

    async def send_chunk(self, call: Call, data: bytes, more: bool) -> None:
        if data:
            self._write(b"%x\r\n%s\r\n" % (len(data), data))
        if not more:
            self._write(b"0\r\n\r\n")
        if self.write_paused and not self.closed:
            if self._drained is None:
                self._drained = self.server.loop.create_future()
            await self._drained

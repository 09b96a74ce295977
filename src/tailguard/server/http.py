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
- bounds what one request may hold (docs/server.md, "Limits and timeouts"): the request target
  (414), the head's bytes and fields counted from the request's first byte (431), the body
  (413: a too-large `Content-Length` is answered at once, without reading the body); answers
  505 to versions other than HTTP/1.0 and 1.1, 501 to transfer codings other than `chunked`,
  400 to a missing or repeated Host; chunked trailers are read and ignored;
- `Expect: 100-continue` is answered `100 Continue` only after the route, method and API key
  passed (else the refusal goes out at once and the body is never read);
- runs one request at a time in a task; pipelined requests wait their turn in order; reading
  pauses when too many are queued or while the client is not reading its answers;
- writes every non-streaming response in one `write` (status line, headers, body); streams
  (SSE) use chunked transfer encoding and wait for the socket to drain under back-pressure;
- keeps the connection alive (HTTP/1.1, or 1.0 with keep-alive) with no request cap;
- one sweep a second (not a timer per request) enforces the timeouts: idle keep-alive
  (`keepalive_timeout_s`), request head and body (`header_timeout_s`, `body_timeout_s`: 408),
  unsent answer bytes (`send_timeout_s`: the connection is aborted, its request cancelled) and
  lingering close (`linger_timeout_s`);
- a connection the server ends mid-request (413, 431, ...) is closed the way nginx's lingering
  close does: the answer, then FIN, then what the client still sends is read and dropped for a
  bounded time, so the client reads the answer instead of a reset;
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

from tailguard.errors import (
    HeadersTooLargeError,
    HttpVersionError,
    InvalidRequestError,
    PayloadTooLargeError,
    RequestTimeoutError,
    TailguardError,
    UnsupportedFramingError,
    UriTooLongError,
)
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
_CLOSE_HEADER = (b"connection", b"close")
_CHUNKED = b"transfer-encoding: chunked\r\n"
_LENGTH_CLOSE = b"content-length: %d\r\nconnection: close\r\n\r\n"
_MAX_PIPELINED = 16  # queued requests on one connection before reading pauses
# What a lingering close reads and drops at most (the time bound is linger_timeout_s): a client
# that sent a 64 MiB body without `Expect` still reads its 413, a faster one is cut off.
_LINGER_MAX_BYTES = 128 * 1024 * 1024
# Request phases (HttpProtocol.reading)
_IDLE, _HEAD, _BODY = 0, 1, 2


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


def _date_header() -> bytes:
    return b"date: " + email.utils.formatdate(usegmt=True).encode() + b"\r\n"


def _shown(value: bytes, limit: int = 64) -> str:
    """A client-sent value quoted in an error message, never more than `limit` characters."""
    text = value[:limit].decode("latin-1")
    return repr(text) + ("..." if len(value) > limit else "")


def _origin_form(url: bytes) -> bytes:
    """`http://host/p?q` -> `/p?q` (RFC 9112 3.2.2: servers accept the absolute form)."""
    scheme = url.find(b"://")
    if scheme < 0 or url[:scheme].lower() not in (b"http", b"https"):
        return url
    slash = url.find(b"/", scheme + 3)
    if slash < 0:
        query = url.find(b"?", scheme + 3)
        return b"/" if query < 0 else b"/" + url[query:]
    return url[slash:]


class _Refuse(Exception):
    """Raised inside a parser callback: stop parsing this connection, answer `error`, close."""

    def __init__(self, error: TailguardError) -> None:
        super().__init__(error.message)
        self.error = error


class HttpServer:
    """What every connection shares: the app, limits, the live connections, the date header."""

    def __init__(self, app: App) -> None:
        cfg = app.config
        self.app = app
        self.loop = asyncio.get_running_loop()
        self.max_body = cfg.max_body_bytes
        self.max_url = cfg.max_url_bytes
        self.max_head = cfg.max_header_bytes
        self.max_fields = cfg.max_header_count
        # what a chunked body may take on the wire (chunk framing, trailers) before 413
        self.max_body_wire = 2 * cfg.max_body_bytes + cfg.max_header_bytes
        self.idle_timeout_s = float(cfg.keepalive_timeout_s)
        self.header_timeout_s = cfg.header_timeout_s
        self.body_timeout_s = cfg.body_timeout_s
        self.send_timeout_s = cfg.send_timeout_s
        self.linger_timeout_s = cfg.linger_timeout_s
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
        """Once a second: refresh the date header; enforce every connection's timeouts.

        A connection with answer bytes unsent for `send_timeout_s` is aborted, whatever it is
        doing (a stalled stream, unread pipelined answers, a close waiting for its flush).
        Otherwise, while no request is being answered, its `deadline` is that of its current
        wait: idle keep-alive, reading a request head or body, or a lingering close.
        """
        self.date = _date_header()
        stalled_before = now - self.send_timeout_s
        for conn in list(self.connections):
            if conn.stalled_since and conn.stalled_since < stalled_before:
                conn.abort("send_timeout")
            elif conn.call is None and conn.deadline < now:
                conn.expire()

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
        "_fields",
        "_head_bytes",
        "_headers",
        "_hosts",
        "_linger_bytes",
        "_parser",
        "_reading_paused",
        "_request",
        "_t_arrival",
        "_t_chunk",
        "_url",
        "_wire",
        "call",
        "client",
        "closed",
        "deadline",
        "deferred",
        "lingering",
        "pending",
        "reading",
        "requests",
        "server",
        "stalled_since",
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
        self._head_bytes = 0  # request line + header bytes seen through the parser callbacks
        self._wire = 0  # bytes of whole chunks read in the current phase (head or body)
        self._fields = 0  # header fields of the request being read
        self._hosts = 0  # Host fields of the request being read
        self._request: Call | None = None  # the request being read (built when its head ends)
        self._discard = False  # stop parsing: after a refusal (413, 431, ...) or a bad request
        self._t_chunk = 0.0  # when the data being parsed was read from the socket
        self._t_arrival = 0.0  # when the first bytes of the request being parsed were read
        self._reading_paused = False
        self._linger_bytes = 0
        self.call: Call | None = None  # the request being answered
        self.pending: deque[Call] = deque()  # pipelined requests waiting their turn
        self.client = ""
        self.closed = False
        self.lingering = False
        self.reading = _IDLE  # phase of the request being read: _IDLE, _HEAD or _BODY
        self.deferred = 0  # data chunks waiting in the server's intake
        self.requests = 0
        # while no request is being answered: when the current wait ends (idle, head, body,
        # linger); a new connection gets header_timeout_s for its first request
        self.deadline = time.monotonic() + server.header_timeout_s
        self.stalled_since = 0.0  # answer bytes unsent since (0: none stuck)
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
        self.lingering = False
        self.server.connections.discard(self)
        self.server.metrics.connection_closed(self.requests)
        self.pending.clear()
        if self.call is not None:
            self.call.disconnect()  # nobody to answer: cancel it (aborts the engine request)
        self._wake_writer()

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the client is not reading."""
        self.write_paused = True
        if not self.stalled_since:
            self.stalled_since = time.monotonic()
        self._update_reading()  # read no more requests while their answers cannot go out

    def resume_writing(self) -> None:
        self.write_paused = False
        if not self.closed:  # a closing connection keeps its clock until the flush is done
            self.stalled_since = 0.0
        self._wake_writer()
        if not self.closed:
            if self.call is None and self.pending:
                self._start(self.pending.popleft())
            self._update_reading()

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def _update_reading(self) -> None:
        """Read while answers go out and few requests are queued: pause at _MAX_PIPELINED
        queued or while writing is paused, resume below half of it."""
        t = self.transport
        if t is None or self.closed:
            return
        if self._reading_paused:
            if not self.write_paused and len(self.pending) < _MAX_PIPELINED // 2:
                self._reading_paused = False
                t.resume_reading()
        elif self.write_paused or len(self.pending) >= _MAX_PIPELINED:
            self._reading_paused = True
            t.pause_reading()

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # answered and closing: read and drop what the client still sends
            self._linger_bytes += len(data)
            if self._linger_bytes > _LINGER_MAX_BYTES:
                self.abort("linger_timeout")
            return
        self.server.take(self, data)

    def feed(self, data: bytes, t_read: float) -> None:
        """Parse `data`, read from the socket at `t_read` (called by the server's intake, at
        most a slice per loop iteration)."""
        if self._discard:
            return
        self._t_chunk = t_read
        phase, n = self.reading, self.requests
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            refusal = e.__context__
            if isinstance(refusal, _Refuse):
                self._refuse(refusal.error)
            else:  # a bug in a callback below: answer 500 rather than leave the client hanging
                log.error("HTTP parser callback failed", exc_info=refusal)
                self._refuse(TailguardError("internal error while reading the request"))
            return
        except httptools.HttpParserUpgrade:
            self._refuse(
                InvalidRequestError("protocol upgrade is not supported; send plain HTTP/1.1")
            )
            return
        except httptools.HttpParserError as e:
            self._refuse(InvalidRequestError(f"malformed HTTP request: {e}; send valid HTTP/1.1"))
            return
        if phase and phase == self.reading and n == self.requests:
            # The whole chunk belongs to the head or body still being read. The callbacks see a
            # header only once it is complete, and httptools buffers the one in progress: this
            # is what bounds it.
            self._wire += len(data)
            if phase == _HEAD and self._wire > self.server.max_head:
                self._refuse(self._head_too_large())
            elif phase == _BODY and self._wire > self.server.max_body_wire:
                self._refuse(
                    PayloadTooLargeError(
                        f"request body (chunked) takes more than {self.server.max_body_wire} "
                        "bytes on the wire; send fewer, larger chunks and no trailers"
                    )
                )

    def close(self) -> None:
        """Close after what was written is sent (a connection that stopped reading mid-request
        lingers first, see `_linger`)."""
        t = self.transport
        if t is None or self.closed:
            return
        self.closed = True
        if t.get_write_buffer_size() and not self.stalled_since:
            self.stalled_since = time.monotonic()  # send_timeout_s to flush, then abort
        if self._discard and self.reading and t.can_write_eof():
            self._linger(t)
        else:
            t.close()

    def _linger(self, t: asyncio.Transport) -> None:
        """nginx's lingering close: the client may still be sending the request body we refused;
        closing now would answer its data with a reset, which can destroy our answer before it
        reads it. Send the answer and a FIN, read and drop for at most linger_timeout_s."""
        self.lingering = True
        self.deadline = time.monotonic() + self.server.linger_timeout_s
        t.write_eof()
        if self._reading_paused:
            self._reading_paused = False
            t.resume_reading()

    def eof_received(self) -> bool | None:
        return None  # the client closed its side: close ours (and cancel what it asked for)

    def abort(self, reason: str) -> None:
        """End the connection now, dropping unsent bytes; its request is cancelled."""
        if self.transport is None:
            return
        self.closed = True
        self.lingering = False
        self.server.metrics.connection_cut(reason)
        self.transport.abort()

    def expire(self) -> None:
        """The sweep found this connection's wait over (no request is being answered)."""
        if self.lingering:
            self.abort("linger_timeout")
        elif self.closed or self.pending:
            return  # flushing, or answers waiting for the client to read: send_timeout_s
        elif self.reading:
            srv = self.server
            phase = "header" if self.reading == _HEAD else "body"
            limit = srv.header_timeout_s if self.reading == _HEAD else srv.body_timeout_s
            srv.metrics.connection_cut(f"{phase}_timeout")
            self._refuse(
                RequestTimeoutError(
                    f"request {phase} not received within {limit:g} s ({phase}_timeout_s); "
                    "send the whole request at once"
                )
            )
        else:
            self.server.metrics.connection_cut("idle")
            self.close()

    # ---- httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        t = self._t_arrival = self._t_chunk  # a request arrives with its first bytes
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_size = 0
        self._head_bytes = self._wire = self._fields = self._hosts = 0
        self.reading = _HEAD
        self.deadline = t + self.server.header_timeout_s
        self.requests += 1

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.server.max_url:
            raise _Refuse(
                UriTooLongError(
                    f"request target longer than {self.server.max_url} bytes (max_url_bytes); "
                    "send large inputs in the body"
                )
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.reading != _HEAD:
            return  # a chunked trailer: read, never part of the request (auth, deadline, ...)
        self._fields += 1
        self._head_bytes += len(name) + len(value) + 4
        if self._fields > self.server.max_fields or self._head_bytes > self.server.max_head:
            raise _Refuse(self._head_too_large())
        name = name.lower()
        if name == b"host":
            self._hosts += 1
        old = self._headers.get(name)
        self._headers[name] = value if old is None else old + b", " + value

    def _head_too_large(self) -> HeadersTooLargeError:
        srv = self.server
        return HeadersTooLargeError(
            f"request head over {srv.max_head} bytes or {srv.max_fields} fields "
            "(max_header_bytes, max_header_count); send large inputs in the body"
        )

    def on_headers_complete(self) -> None:
        self.reading = _BODY
        self._wire = 0
        self.deadline = self._t_chunk + self.server.body_timeout_s
        p = self._parser
        version = p.get_http_version()
        if version != "1.1" and version != "1.0":
            raise _Refuse(HttpVersionError(f"HTTP/{version} is not supported; use HTTP/1.1"))
        headers = self._headers
        if self._hosts != 1 and (version == "1.1" or self._hosts):
            raise _Refuse(
                InvalidRequestError(
                    "missing Host header" if not self._hosts else "more than one Host header"
                )
            )
        keep_alive = p.should_keep_alive()
        te = headers.get(b"transfer-encoding")
        if te is not None:
            if te.strip().lower() != b"chunked":
                raise _Refuse(
                    UnsupportedFramingError(
                        f"Transfer-Encoding {_shown(te)} is not supported; send the body "
                        "chunked or with Content-Length"
                    )
                )
            if version == "1.0":
                keep_alive = False  # RFC 9112 6.1: framing of a 1.0 message with TE is suspect
        call = self._request = self._new_call(keep_alive)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body:
            self._refuse_call(
                call,
                PayloadTooLargeError(
                    f"request body is {int(length)} bytes; the limit is {self.server.max_body} "
                    "bytes (max_body_bytes): send less per request"
                ),
            )
        elif headers.get(b"expect", b"").lower() == b"100-continue":
            refusal = self.server.app.precheck(call)
            if refusal is not None:
                self._refuse_call(call, refusal)  # never asked for the body: do not read it
            else:
                self._write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self._discard:
            return
        self._body_size += len(body)
        if self._body_size > self.server.max_body:
            assert self._request is not None
            self._refuse_call(
                self._request,
                PayloadTooLargeError(
                    f"request body (chunked) is longer than {self.server.max_body} bytes "
                    "(max_body_bytes): send less per request"
                ),
            )
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.reading = _IDLE
        call, self._request = self._request, None
        if self._discard or call is None:
            return
        body = self._body
        call.body = body[0] if len(body) == 1 else b"".join(body)
        if self.call is None and not self.write_paused:
            self._start(call)
        else:
            self.pending.append(call)
            if len(self.pending) >= _MAX_PIPELINED:
                self._update_reading()

    # ---- requests -----------------------------------------------------------------------------
    def _new_call(self, keep_alive: bool) -> Call:
        url = self._url
        if url[:1] != b"/":
            url = _origin_form(url)
        q = url.find(b"?")
        path = (url if q < 0 else url[:q]).decode("latin-1")
        if "%" in path:
            path = unquote(path)
        return Call(
            self._parser.get_method().decode("latin-1"),
            path,
            self._headers,
            b"",
            self.client,
            self,
            keep_alive=keep_alive,
            t_arrival=self._t_arrival,
        )

    def _refuse_call(self, call: Call, error: TailguardError) -> None:
        """Answer `call` with `error` without reading its body; the connection closes after."""
        call.keep_alive = False
        call.error = error
        self._discard = True  # parse nothing more from this connection
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
            if not self.write_paused:  # else resume_writing starts it
                self._start(self.pending.popleft())
                self._update_reading()
        elif self.server.draining or self._discard:
            self.close()
        elif not self.reading:
            self.deadline = time.monotonic() + self.server.idle_timeout_s  # idle from now

    def _refuse(self, exc: TailguardError) -> None:
        """A request that cannot be read on: answer the error and close (after any answer
        under way, which then carries `Connection: close`)."""
        self._discard = True
        self.pending.clear()
        if self.call is not None:
            self.call.keep_alive = False
            return
        if self.closed:
            return
        ans = error_answer(exc)
        self._write(
            self._head(ans.status, [(b"content-type", b"application/json"), *ans.headers])
            + b"content-length: %d\r\n%s\r\n" % (len(ans.body), _CLOSE)
            + ans.body
        )
        if ans.label == "invalid":  # counted with the app's refusals (never reached a handler)
            self.server.metrics.rejected(ans.label, 0.0)
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
        if _CLOSE_HEADER in headers:  # the framing below says it once
            call.keep_alive = False
            headers = [h for h in headers if h != _CLOSE_HEADER]
        elif self.server.draining:
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
            # Wait for the client to read. If it does not, the sweep aborts the connection after
            # send_timeout_s; connection_lost then wakes us and cancels this request.
            if self._drained is None:
                self._drained = self.server.loop.create_future()
            await self._drained

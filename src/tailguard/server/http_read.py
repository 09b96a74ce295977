"""Reading requests off one connection: the httptools callbacks, the limits, the Call they build.

A `RequestReader` is the httptools parser's protocol object for one connection
(tailguard.server.http_conn). It feeds the parser what the socket read, bounds what one request
may hold (docs/server.md, "Limits and timeouts") and hands each request to its connection, in
the order they arrived, once it is read or refused:
- a request target over `max_url_bytes`: 414; a head over `max_header_bytes` or
  `max_header_count` fields: 431, its bytes counted from the request's first byte whatever the
  read boundaries (`feed`); no client input is echoed in the answer;
- a body over `max_body_bytes`: 413 (a too large `Content-Length` at once, without reading the
  body); a chunked body whose framing takes more than `max_body_wire` bytes on the wire: 413;
- versions other than HTTP/1.0 and 1.1: 505; transfer codings other than `chunked`: 501; a
  missing or repeated Host: 400; malformed HTTP: 400; chunked trailers are read and ignored;
- `Expect: 100-continue` is answered only after the app's precheck (route, method, API key).
A refused request is answered like any other (its Call carries the error) and parsing stops:
the connection closes after answering it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote

import httptools

from tailguard.errors import (
    HeadersTooLargeError,
    HttpVersionError,
    InvalidRequestError,
    PayloadTooLargeError,
    TailguardError,
    UnsupportedFramingError,
    UriTooLongError,
)
from tailguard.server.call import Call, Conn

if TYPE_CHECKING:
    import asyncio

    from tailguard.errors import TailguardError
    from tailguard.server.config import ServerConfig
    from tailguard.server.metrics import ServerMetrics

__all__ = ["BODY", "HEAD", "IDLE", "Handler", "RequestReader", "RequestSink", "SharedState"]

log = logging.getLogger("tailguard.server")

# Request phases (RequestReader.phase)
IDLE, HEAD, BODY = 0, 1, 2


class Handler(Protocol):
    """What the HTTP layer needs of the app: `App` (tailguard.server.app), or the echo that
    bench/bench_frontend.py measures the layer with. A protocol, not `App`: the compiled
    (mypyc) layer checks the argument types it is given."""

    config: ServerConfig
    metrics: ServerMetrics

    def precheck(self, call: Call) -> TailguardError | None: ...

    async def handle(self, call: Call) -> None: ...


class SharedState(Protocol):
    """What a connection reads from the state all connections share (tailguard.server.http
    `HttpServer`), named here so the connection modules need not import the server module that
    imports them."""

    app: Handler
    loop: asyncio.AbstractEventLoop
    metrics: ServerMetrics
    connections: set[Any]  # the live connections (http_conn.HttpProtocol, which imports this)
    date: bytes  # the current `date` header line
    draining: bool
    access_log: bool
    max_body: int
    max_body_wire: int  # what a chunked body may take on the wire before 413
    max_url: int
    max_head: int
    max_fields: int
    idle_timeout_s: float
    header_timeout_s: float
    body_timeout_s: float
    send_timeout_s: float
    linger_timeout_s: float

    def take(self, conn: Any, data: bytes) -> None:
        """Process `data` read on `conn` now or in a later loop iteration."""


class RequestSink(Conn, Protocol):
    """What the reader needs from its connection (tailguard.server.http_conn.HttpProtocol),
    which also answers the requests (`Conn`)."""

    client: str  # peer address
    deadline: float  # monotonic; when the current wait (head, body) times out

    def enqueue(self, call: Call) -> None:
        """A request read (or refused: `call.error`); answer it after those before it."""

    def send_continue(self) -> None:
        """Answer `Expect: 100-continue` for the request being read."""


def _shown(value: bytes, limit: int = 64) -> str:
    """A client-sent value quoted in an error message, never more than `limit` characters."""
    text = value[:limit].decode("latin-1")
    return repr(text) + ("..." if len(value) > limit else "")


def origin_form(url: bytes) -> bytes:
    """`http://host/p?q` -> `/p?q` (RFC 9112 3.2.2: servers accept the absolute form)."""
    scheme = url.find(b"://")
    if scheme < 0 or url[:scheme].lower() not in (b"http", b"https"):
        return url
    slash = url.find(b"/", scheme + 3)
    if slash < 0:
        query = url.find(b"?", scheme + 3)
        return b"/" if query < 0 else b"/" + url[query:]
    return url[slash:]


def blank_line_end(data: bytes) -> int:
    """The offset just past the last empty line (`\\n\\r\\n` or `\\n\\n`) in `data`, 0 if none."""
    crlf, lf = data.rfind(b"\n\r\n"), data.rfind(b"\n\n")
    return max(crlf + 3 if crlf >= 0 else 0, lf + 2 if lf >= 0 else 0)


class _Refuse(Exception):
    """Raised inside a parser callback: stop parsing this connection and answer `error` (for
    `call`, when the request's head was read) after the requests before it."""

    def __init__(self, error: TailguardError, call: Call | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.call = call


class RequestReader:
    """The requests of one connection, parsed and bounded (see the module docstring)."""

    __slots__ = (
        "_body",
        "_body_size",
        "_chunked",
        "_feed_body",
        "_fields",
        "_head_bytes",
        "_headers",
        "_hosts",
        "_parser",
        "_prev_body",
        "_t_chunk",
        "_url",
        "_wire",
        "discard",
        "phase",
        "request",
        "requests",
        "server",
        "sink",
        "t_arrival",
    )

    def __init__(self, server: SharedState, sink: RequestSink) -> None:
        self.server = server
        self.sink = sink
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._head_bytes = 0  # header bytes seen through the on_header callbacks
        self._wire = 0  # bytes of the current phase (head or body) on the wire, see `feed`
        self._fields = 0  # header fields of the request being read
        self._hosts = 0  # Host fields of the request being read
        self._chunked = False  # the request being read has a chunked body
        self._feed_body = 0  # body bytes of the request being read, in the data being fed
        self._prev_body = 0  # the same for the request before it (Content-Length framing)
        self.request: Call | None = None  # the request being read (built when its head ends)
        self._t_chunk = 0.0  # when the data being parsed was read from the socket
        self.t_arrival = 0.0  # when the first bytes of the request being parsed were read
        self.discard = False  # parse nothing more: after a refusal (413, 431, ...)
        self.phase = IDLE  # of the request being read: IDLE, HEAD or BODY
        self.requests = 0  # requests begun on this connection

    # ---- feeding the parser -------------------------------------------------------------------
    def feed(self, data: bytes, t_read: float) -> None:
        """Parse `data`, read from the socket at `t_read` (called by the server's intake, at
        most a slice per loop iteration)."""
        if self.discard:
            return
        self._t_chunk = t_read
        phase, n = self.phase, self.requests
        self._feed_body = self._prev_body = 0
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            refusal = e.__context__
            if isinstance(refusal, _Refuse):
                self.refuse(refusal.error, refusal.call)
            else:  # a bug in a callback below: answer 500 rather than leave the client hanging
                log.error("HTTP parser callback failed", exc_info=refusal)
                self.refuse(TailguardError("internal error while reading the request"))
            return
        except httptools.HttpParserUpgrade:
            self.refuse(
                InvalidRequestError("protocol upgrade is not supported; send plain HTTP/1.1")
            )
            return
        except httptools.HttpParserError as e:
            self.refuse(InvalidRequestError(f"malformed HTTP request: {e}; send valid HTTP/1.1"))
            return
        if self.phase:
            self._count_wire(data, phase == self.phase and n == self.requests)

    def _count_wire(self, data: bytes, continued: bool) -> None:
        """Count the bytes of the head or body still being read at the end of `data`.

        httptools sees a header field only once it is complete and holds the one in progress
        itself: counting bytes on the wire is what bounds it. When the head began in `data`,
        its bytes are those after the end of the message before it: the last empty line in
        `data` (the head being read has none yet) and, for a Content-Length body after it, that
        body's bytes in `data`. A body holding empty lines can only make the count smaller than
        the head's true size, never larger, so no head within the limit is refused.
        """
        srv = self.server
        if self.phase == HEAD:
            if continued:
                self._wire += len(data)
            else:  # the head began in `data`
                self._wire = len(data) - blank_line_end(data) - self._prev_body
            if self._wire > srv.max_head:
                self.refuse(self._head_too_large())
        elif continued:  # the body's framing (chunk sizes, trailers); its bytes: on_body
            self._wire += len(data)
            if self._wire > srv.max_body_wire:
                self.refuse(
                    PayloadTooLargeError(
                        f"request body (chunked) takes more than {srv.max_body_wire} "
                        "bytes on the wire; send fewer, larger chunks and no trailers"
                    ),
                    self.request,
                )

    def refuse(self, error: TailguardError, call: Call | None = None) -> None:
        """Stop reading; answer `error` for the request being read (after those before it)."""
        self.discard = True
        if call is None:
            call = Call("", "", {}, b"", self.sink.client, self.sink, keep_alive=False, error=error)
            call.t_arrival = self.t_arrival
        else:
            call.keep_alive = False
            call.error = error
        self.request = None
        self.sink.enqueue(call)

    def _head_too_large(self) -> HeadersTooLargeError:
        srv = self.server
        return HeadersTooLargeError(
            f"request head over {srv.max_head} bytes or {srv.max_fields} fields "
            "(max_header_bytes, max_header_count); send large inputs in the body"
        )

    # ---- httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        t = self.t_arrival = self._t_chunk  # a request arrives with its first bytes
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_size = 0
        self._head_bytes = self._wire = self._fields = self._hosts = 0
        self._prev_body = 0 if self._chunked else self._feed_body
        self._feed_body = 0
        self._chunked = False
        self.phase = HEAD
        self.sink.deadline = t + self.server.header_timeout_s
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
        if self.phase != HEAD:
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

    def on_headers_complete(self) -> None:
        self.phase = BODY
        self._wire = 0
        srv = self.server
        self.sink.deadline = self._t_chunk + srv.body_timeout_s
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
            self._chunked = True
            if version == "1.0":
                keep_alive = False  # RFC 9112 6.1: framing of a 1.0 message with TE is suspect
        call = self.request = self._new_call(keep_alive)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > srv.max_body:
            raise _Refuse(
                PayloadTooLargeError(
                    f"request body is {int(length)} bytes; the limit is {srv.max_body} "
                    "bytes (max_body_bytes): send less per request"
                ),
                call,
            )
        if headers.get(b"expect", b"").lower() == b"100-continue":
            refusal = srv.app.precheck(call)
            if refusal is not None:
                raise _Refuse(refusal, call)  # never asked for the body: do not read it
            self.sink.send_continue()

    def on_body(self, body: bytes) -> None:
        n = len(body)
        self._feed_body += n
        self._body_size += n
        if self._body_size > self.server.max_body:
            raise _Refuse(
                PayloadTooLargeError(
                    f"request body (chunked) is longer than {self.server.max_body} bytes "
                    "(max_body_bytes): send less per request"
                ),
                self.request,
            )
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.phase = IDLE
        call, self.request = self.request, None
        if call is None:
            return
        body = self._body
        call.body = body[0] if len(body) == 1 else b"".join(body)
        self.sink.enqueue(call)

    def _new_call(self, keep_alive: bool) -> Call:
        url = self._url
        if url[:1] != b"/":
            url = origin_form(url)
        q = url.find(b"?")
        path = (url if q < 0 else url[:q]).decode("latin-1")
        if "%" in path:
            path = unquote(path)
        return Call(
            self._parser.get_method().decode("latin-1"),
            path,
            self._headers,
            b"",
            self.sink.client,
            self.sink,
            keep_alive=keep_alive,
            t_arrival=self.t_arrival,
        )

"""One client connection: the order of its answers, flow control, timeouts, closing.

`HttpProtocol` is the asyncio protocol of a connection. Its `RequestReader`
(tailguard.server.http_read) parses the requests; the connection answers them:
- one request at a time, in a task (`App.handle`); pipelined requests, refusals included, wait
  their turn in order, so every request gets its own answer in the order it was sent; reading
  pauses when too many are queued or while the client is not reading its answers;
- writes every non-streaming response in one `write` (status line, headers, body); streams
  (SSE) use chunked transfer encoding and wait for the socket to drain under back-pressure;
- keeps the connection alive (HTTP/1.1, or 1.0 with keep-alive) with no request cap;
- `expire` (called by the server's sweep once a second) ends a wait that ran out: idle
  keep-alive, a request head or body (408), a lingering close; `abort` ends a connection whose
  answer bytes stay unsent for `send_timeout_s`;
- a connection the server ends mid-request (413, 431, ...) is closed the way nginx's lingering
  close does: the answer, then FIN, then what the client still sends is read and dropped for a
  bounded time, so the client reads the answer instead of a reset;
- a client that disconnects cancels its request's task, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from collections import deque
from http import HTTPStatus
from typing import TYPE_CHECKING

from tailguard.errors import RequestTimeoutError
from tailguard.server.http_read import HEAD, RequestReader, SharedState

if TYPE_CHECKING:
    from tailguard.server.call import Call

__all__ = ["HttpProtocol", "date_header"]

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


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


def date_header() -> bytes:
    return b"date: " + email.utils.formatdate(usegmt=True).encode() + b"\r\n"


class HttpProtocol(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    __slots__ = (
        "_continue_due",
        "_drained",
        "_linger_bytes",
        "_reading_paused",
        "call",
        "client",
        "closed",
        "deadline",
        "deferred",
        "lingering",
        "pending",
        "reader",
        "server",
        "stalled_since",
        "transport",
        "write_paused",
    )

    def __init__(self, server: SharedState) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.reader = RequestReader(server, self)
        self._reading_paused = False
        self._linger_bytes = 0
        self._continue_due = False  # `100 Continue` owed once the answers before it are out
        self.call: Call | None = None  # the request being answered
        self.pending: deque[Call] = deque()  # requests read, waiting their turn
        self.client = ""
        self.closed = False
        self.lingering = False
        self.deferred = 0  # data chunks waiting in the server's intake
        # while no request is being answered: when the current wait ends (idle, head, body,
        # linger); a new connection gets header_timeout_s for its first request
        self.deadline = time.monotonic() + server.header_timeout_s
        self.stalled_since = 0.0  # answer bytes unsent since (0: none stuck)
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None

    @property
    def requests(self) -> int:
        """Requests begun on this connection."""
        return self.reader.requests

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
        self.server.metrics.connection_closed(self.reader.requests)
        self.pending.clear()
        if self.call is not None:
            self.call.disconnect()  # nobody to answer: cancel it (aborts the engine request)
        self._wake_writer()

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # answered and closing: read and drop what the client still sends
            self._linger_bytes += len(data)
            if self._linger_bytes > _LINGER_MAX_BYTES:
                self.abort("linger_timeout")
            return
        self.server.take(self, data)

    def feed(self, data: bytes, t_read: float) -> None:
        """Parse `data`, read at `t_read` (the server's intake calls this, a slice per loop
        iteration)."""
        self.reader.feed(data, t_read)

    def eof_received(self) -> bool | None:
        return None  # the client closed its side: close ours (and cancel what it asked for)

    # ---- flow control -------------------------------------------------------------------------
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

    # ---- the requests, in order ---------------------------------------------------------------
    def enqueue(self, call: Call) -> None:
        """A request read, or refused while reading (`call.error`): answer it now if nothing
        is ahead of it, else after the requests before it (RFC 9112 9.3.2)."""
        if self.closed:
            return
        self._continue_due = False  # its body came (or never will): no 100 Continue now
        if self.call is None and not self.pending and not self.write_paused:
            self._start(call)
        else:
            self.pending.append(call)
            if len(self.pending) >= _MAX_PIPELINED:
                self._update_reading()

    def send_continue(self) -> None:
        """`100 Continue` for the request being read; if earlier answers are still going out,
        it waits for them (an interim answer must not land inside another's bytes)."""
        if self.call is None and not self.pending:
            self._write(_CONTINUE)
        else:
            self._continue_due = True

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
        elif self.server.draining or self.reader.discard:
            self.close()
        elif self._continue_due:
            self._continue_due = False
            self._write(_CONTINUE)
            self.deadline = time.monotonic() + self.server.body_timeout_s  # its body from now
        elif not self.reader.phase:
            self.deadline = time.monotonic() + self.server.idle_timeout_s  # idle from now

    # ---- ending the connection ----------------------------------------------------------------
    def close(self) -> None:
        """Close after what was written is sent (a connection that stopped reading mid-request
        lingers first, see `_linger`)."""
        t = self.transport
        if t is None or self.closed:
            return
        self.closed = True
        if t.get_write_buffer_size() and not self.stalled_since:
            self.stalled_since = time.monotonic()  # send_timeout_s to flush, then abort
        if self.reader.discard and self.reader.phase and t.can_write_eof():
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
        phase = self.reader.phase
        if self.lingering:
            self.abort("linger_timeout")
        elif self.closed or self.pending:
            return  # flushing, or answers waiting for the client to read: send_timeout_s
        elif phase and not self.reader.discard:
            srv = self.server
            what = "header" if phase == HEAD else "body"
            limit = srv.header_timeout_s if phase == HEAD else srv.body_timeout_s
            srv.metrics.connection_cut(f"{what}_timeout")
            self.reader.refuse(
                RequestTimeoutError(
                    f"request {what} not received within {limit:g} s ({what}_timeout_s); "
                    "send the whole request at once"
                ),
                self.reader.request,
            )
        else:
            self.server.metrics.connection_cut("idle")
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

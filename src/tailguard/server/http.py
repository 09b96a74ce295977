"""HTTP/1.1 on uvloop + httptools, straight into the app: no ASGI layer in between.

Why our own protocol instead of uvicorn: measured on this machine with wrk (64 keep-alive
connections, a trivial JSON POST), a minimal httptools protocol answered ~93k requests/s where
the same echo as a raw ASGI app on uvicorn answered ~23k: uvicorn's per-request Python (scope
dict, ASGI message dicts, the request-response cycle object, flow control, two writes per
response) costs about three quarters of a trivial request. tailguard's front end is the part
that must stay cheap under a 10,000-connection burst, so it parses with httptools and calls
`App.handle(call)` directly.

The layer, one concern per module:
- here, `HttpServer`: what every connection shares (the app, the limits, the live connections,
  the date header), the intake (a bounded slice of read data parsed per loop iteration) and the
  sweep that enforces every timeout once a second;
- tailguard.server.http_read, `RequestReader`: parsing one connection's requests and bounding
  them (414, 431, 413, 505, 501, 400; trailers ignored; `Expect: 100-continue`);
- tailguard.server.http_conn, `HttpProtocol`: one connection; its answers in request order,
  flow control (pause reading while the client does not read), timeouts, lingering close, and
  the byte framing of answers (the `Conn` interface of tailguard.server.app.Call);
- tailguard.server.serving: accepting connections, starting and stopping the server.
The limits and timeouts, with their defaults and flags: docs/server.md, "Limits and timeouts".
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Protocol

from tailguard.server.http_conn import HttpProtocol, date_header
from tailguard.server.http_read import Handler

__all__ = ["Fed", "HttpProtocol", "HttpServer"]


class Fed(Protocol):
    """What the intake needs of a connection: HttpProtocol, or a recorder in a test."""

    deferred: int  # chunks of it waiting in the intake
    closed: bool

    def feed(self, data: bytes, t_read: float) -> None: ...


class HttpServer:
    """What every connection shares: the app, limits, the live connections, the date header."""

    def __init__(self, app: Handler) -> None:
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
        self.date = date_header()
        self.draining = False
        self.per_iteration = cfg.handlers_per_iteration
        self._taken = 0  # data chunks taken up in this loop iteration
        # chunks left for later iterations, with the time they were read
        self._inbox: deque[tuple[Fed, bytes, float]] = deque()
        self._intake_wait = app.metrics.intake
        self._reset_pending = False

    # ---- intake: a bounded slice of newly read data per loop iteration -------------------------
    def take(self, conn: Fed, data: bytes) -> None:
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
        self.date = date_header()
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

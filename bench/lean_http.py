"""A lean HTTP/1.1 keep-alive client for benchmarks that share the machine with the server.

With aiohttp, bench_goodput's open loop took ~190 us of client CPU a request (0.48 of a core
at 2,549 requests/s), and at 4x the engine's capacity on a 2-core machine it took the CPU the
HTTP server needed and lagged its own sends by 35-80 ms at p99; with this client, ~90 us (0.26
of a core at 2,888/s, bodies and tasks included) and 3.5 ms. This client is an asyncio
protocol on httptools' response parser: one request at a time per connection, idle connections
reused, a new one opened when none is idle (aiohttp's `limit=0`). It times two events of an
answer: its first body bytes (a stream's first token) and its end.

It speaks only what the benchmarks send: POST with a body, Content-Length or chunked answers.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import httptools


class _Answer:
    __slots__ = ("done", "first", "keep", "status")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.first = 0.0  # monotonic time of the first body bytes (0: none yet)
        self.status = 0
        self.done: asyncio.Future[float] = loop.create_future()  # monotonic end time
        self.keep = False


class _Conn(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: _Answer | None = None
        self.open = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport, self.open = transport, True  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:  # an OSError for the caller, like a reset
            self._fail(ConnectionError(f"malformed HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._fail(exc or ConnectionResetError("connection closed before the answer ended"))

    # -- httptools callbacks
    def on_headers_complete(self) -> None:
        if self.answer is not None:
            self.answer.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        a = self.answer
        if a is not None and not a.first:
            a.first = time.monotonic()

    def on_message_complete(self) -> None:
        a, self.answer = self.answer, None
        if a is not None and not a.done.done():
            a.keep = self.parser.should_keep_alive()
            a.done.set_result(time.monotonic())

    def _fail(self, exc: BaseException) -> None:
        a, self.answer = self.answer, None
        self.open = False
        if self.transport is not None:
            self.transport.abort()
        if a is not None and not a.done.done():
            a.done.set_exception(exc)


class LeanSession:
    """POST to one host over pooled keep-alive connections. Use as an async context manager."""

    def __init__(self, base: str, timeout_s: float = 60.0) -> None:
        u = urlsplit(base)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.timeout_s = timeout_s
        self.idle: list[_Conn] = []
        self.all: set[_Conn] = set()
        self._host_line = f"Host: {self.host}:{self.port}\r\n".encode()

    async def __aenter__(self) -> LeanSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in self.all:
            if c.transport is not None:
                c.transport.close()
        self.all.clear()
        self.idle.clear()

    async def _conn(self) -> _Conn:
        while self.idle:
            c = self.idle.pop()
            if c.open:
                return c
        loop = asyncio.get_running_loop()
        _, c = await loop.create_connection(lambda: _Conn(loop), self.host, self.port)
        self.all.add(c)
        return c

    async def post(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, float, float]:
        """(status, first body bytes, end), monotonic times; raises OSError or TimeoutError."""
        c = await self._conn()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
        head = (
            b"POST " + path.encode() + b" HTTP/1.1\r\n" + self._host_line
            + b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n"
        )  # fmt: skip
        a = c.answer = _Answer(c.loop)
        assert c.transport is not None
        c.transport.write(head + body)
        try:
            end = await asyncio.wait_for(a.done, self.timeout_s)
        except BaseException:
            self.all.discard(c)
            c._fail(TimeoutError("no answer in time"))
            raise
        if a.keep and c.open:
            self.idle.append(c)
        else:
            self.all.discard(c)
            if c.transport is not None:
                c.transport.close()
        return a.status, a.first or end, end

"""One HTTP request on its way through the server (`Call`) and where its answer goes (`Conn`).

Apart from the app: the connection (tailguard.server.http) builds a `Call`, the app and the
request pipeline answer through it, and in-process tests record what it is sent.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from tailguard.errors import TailguardError

__all__ = ["JSON", "SSE", "Call", "Conn"]

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Conn(Protocol):
    """Where a Call's answer goes: the HTTP connection (tailguard.server.http.HttpProtocol), or
    a recorder in in-process tests. It frames the bytes; Call decides what to say."""

    def send_response(
        self, call: Call, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None: ...

    def send_head(self, call: Call, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def send_chunk(self, call: Call, data: bytes, more: bool) -> None: ...


@dataclass(eq=False, slots=True)
class Call:
    """One HTTP request on its way through the server: built by the connection once the whole
    request is read, handed to `App.handle`, answered through `conn`."""

    method: str
    path: str
    headers: dict[bytes, bytes]  # lower-case names; repeated headers joined with ", "
    body: bytes
    client: str  # peer address (for per-client quotas)
    conn: Conn
    keep_alive: bool = True  # the connection stays open after the answer
    endpoint: str = ""  # metric label: completions, chat, embeddings, infer ("" for ops endpoints)
    task: asyncio.Task[None] | None = None  # the task handling this request
    error: TailguardError | None = None  # found while reading (413): answered without a handler
    t_arrival: float = 0.0  # time.monotonic() when its first bytes were read from the socket
    t_read: float = 0.0  # time.monotonic() when the handler started on the read request
    outcome: str = "ok"  # metric label of the answer
    started: bool = False  # response headers sent
    done: bool = False  # the whole answer sent
    extra_headers: tuple[tuple[bytes, bytes], ...] = ()  # added to every response's headers
    disconnected: bool = False  # the client went away

    def disconnect(self) -> None:
        """The client is gone: cancel the handler (closing the engine stream aborts the request)."""
        self.disconnected = True
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def header(self, name: bytes) -> str | None:
        v = self.headers.get(name)
        return v.decode("latin-1") if v is not None else None

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status and headers of a streamed answer (chunked transfer encoding)."""
        self.started = True
        if self.extra_headers:
            headers = [*headers, *self.extra_headers]
        self.conn.send_head(self, status, headers)

    async def body_part(self, data: bytes, more: bool) -> None:
        if not more:
            self.done = True
        await self.conn.send_chunk(self, data, more)

    def respond(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON) -> None:
        """Send a whole answer (one write on a socket)."""
        self.started = self.done = True
        if self.extra_headers:
            headers = [*headers, *self.extra_headers]
        self.conn.send_response(self, status, headers, body)

    def respond_json(self, obj: Any, status: int = 200) -> None:
        self.respond(status, orjson.dumps(obj))

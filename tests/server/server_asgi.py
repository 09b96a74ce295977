"""A minimal in-process ASGI driver: one request in, status + headers + body out.

Used instead of an HTTP client library so in-process tests exercise exactly the ASGI messages
uvicorn sends (body chunks, http.disconnect) and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from tailguard.server.app import App
from tailguard.server.cli import build_app
from tailguard.server.config import ServerConfig, load_config


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    chunks: list[bytes] = field(default_factory=list)

    def json(self) -> Any:
        return orjson.loads(self.body)


async def request(
    app: App,
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    disconnect_after_s: float | None = None,
) -> Response:
    raw = orjson.dumps(body) if isinstance(body, dict) else (body or b"")
    hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": hdrs,
        "client": ("127.0.0.1", 5555),
        "query_string": b"",
    }
    sent_body = False
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if disconnect_after_s is not None:
            await asyncio.sleep(disconnect_after_s)
            gone.set()
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # never: the response completes first
        raise AssertionError

    status = 0
    out_headers: dict[str, str] = {}
    chunks: list[bytes] = []

    async def send(msg: dict[str, Any]) -> None:
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
            out_headers.update({k.decode(): v.decode() for k, v in msg["headers"]})
        elif msg["type"] == "http.response.body":
            chunks.append(msg.get("body", b""))

    await app(scope, receive, send)
    return Response(status, out_headers, b"".join(chunks), chunks)


def make_config(**kw: Any) -> ServerConfig:
    kw.setdefault("engine", "simulated")
    return load_config(None, kw)


@contextlib.asynccontextmanager
async def running_app(**kw: Any) -> Any:
    """An app whose engine is started and warm (lifespan startup done)."""
    app = build_app(make_config(**kw))
    await app.startup()
    for _ in range(200):
        if app.engine.ready:
            break
        await asyncio.sleep(0.01)
    try:
        yield app
    finally:
        await app.shutdown()

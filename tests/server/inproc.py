"""A minimal in-process driver: one request in, status + headers + body out.

It builds the `Call` the HTTP connection would build and records what the app answers through
the `Conn` interface, so in-process tests exercise the app without sockets (the HTTP framing
itself is tested over real sockets in test_server_http.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from tailguard.server.app import App
from tailguard.server.call import Call
from tailguard.server.cli import build_app
from tailguard.server.config import ServerConfig, load_config

READY_TIMEOUT_S = 30.0


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    chunks: list[bytes] = field(default_factory=list)

    def json(self) -> Any:
        return orjson.loads(self.body)


class Recorder:
    """A `Conn` that keeps what the app sends."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        assert self.status == 0, "answered twice"
        self.status = status
        self.headers.update({k.decode(): v.decode() for k, v in headers})

    def send_response(
        self, call: Call, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        self._head(status, headers)
        self.chunks.append(body)

    def send_head(self, call: Call, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._head(status, headers)

    async def send_chunk(self, call: Call, data: bytes, more: bool) -> None:
        self.chunks.append(data)


async def request(
    app: App,
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    disconnect_after_s: float | None = None,
) -> Response:
    raw = orjson.dumps(body) if isinstance(body, dict) else (body or b"")
    hdrs = {k.lower().encode(): v.encode() for k, v in (headers or {}).items()}
    rec = Recorder()
    call = Call(method, path, hdrs, raw, "127.0.0.1", rec)
    task = asyncio.get_running_loop().create_task(app.handle(call))
    call.task = task
    if disconnect_after_s is not None:
        asyncio.get_running_loop().call_later(disconnect_after_s, call.disconnect)
    await task
    return Response(rec.status, rec.headers, b"".join(rec.chunks), rec.chunks)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for `condition` (checked every loop turn, then every ms), failing loudly after
    `timeout_s`: tests wait for a state, not for a guessed time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.001)


def make_config(**kw: Any) -> ServerConfig:
    kw.setdefault("engine", "simulated")
    return load_config(None, kw)


@contextlib.asynccontextmanager
async def running_app(**kw: Any) -> Any:
    """An app whose engine is started and warm (lifespan startup done) and, with the simulated
    engine (which publishes its warm-up steps), whose admission has fitted its step cost."""
    cfg = make_config(**kw)
    app = build_app(cfg)
    await app.startup()
    no_fit = cfg.engine != "simulated" or cfg.admission != "on"  # no warm-up steps to fit
    try:
        await until(
            lambda: app.engine.ready and (no_fit or app.admission.cost.fitted), READY_TIMEOUT_S
        )
    except AssertionError:
        await app.shutdown()
        raise AssertionError(f"the engine never became ready within {READY_TIMEOUT_S} s") from None
    try:
        yield app
    finally:
        await app.shutdown()


class SpyTokenizer:
    """The app's tokenizer, recording what it is asked to encode (`encoded`: the text of each
    `encode` and the last message of each chat template). Installed with `spy_tokenizer`:
    the tokenizer may be a compiled class (tailguard.compiled), whose methods cannot be patched."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.bos_id, self.eos_id, self.vocab_size = inner.bos_id, inner.eos_id, inner.vocab_size
        self.encoded: list[str] = []

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.encoded.append(text)
        return list(self.inner.encode(text, add_bos))

    def decode(self, ids: Any) -> str:
        return str(self.inner.decode(ids))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        self.encoded.append(messages[-1]["content"])
        return list(self.inner.apply_chat_template(messages))


def spy_tokenizer(app: App) -> SpyTokenizer:
    """Put a SpyTokenizer in front of the app's tokenizer (where the request path reads it)."""
    from tailguard.server.tokenizer import ModelInfo

    spy = SpyTokenizer(app.model.tokenizer)
    app.model = app.pipeline.model = ModelInfo(spy, app.model.model_dir)
    return spy

"""RequestRouter: the per-request plumbing every engine client shares.

An engine client sends requests somewhere (a process over IPC, or a scheduler in this event
loop) and gets outputs back for many requests at once. The router keeps, for each request in
flight, where its outputs go (a queue for a stream, a future for a single-pass request),
hands every output to `on_output` first (the admission ledger follows the engine), fails every
request at once when the engine dies, and aborts a request whose reader leaves early.

No torch, no IPC here: tailguard.engine.client (the real engine) and
tailguard.server.simulated (the real scheduler without a model) both use it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from mypy_extensions import mypyc_attr

from tailguard.core.request import EngineOutput, EngineRequest
from tailguard.errors import EngineUnavailableError

__all__ = ["OutputStream", "RequestRouter", "RoutedClient"]


class RequestRouter:
    def __init__(self, send: Callable[[EngineRequest], None], abort: Callable[[str], None]):
        self._send = send  # hand a request to the engine (never blocks)
        self._abort = abort  # tell the engine to drop a request (never blocks)
        self._queues: dict[str, asyncio.Queue[EngineOutput | BaseException]] = {}
        self._waiters: dict[str, asyncio.Future[EngineOutput]] = {}  # single-pass requests
        self.on_output: Callable[[EngineOutput], None] | None = None

    def __len__(self) -> int:
        return len(self._queues) + len(self._waiters)

    def deliver(self, outputs: Iterable[EngineOutput]) -> None:
        """Outputs from the engine: stamped, `on_output` first, then to their readers (an
        output for a request nobody reads any more is dropped)."""
        now = time.monotonic()
        listener = self.on_output
        for out in outputs:
            out.received_s = now
            if listener is not None:  # the admission ledger: before any handler runs
                listener(out)
            w = self._waiters.pop(out.request_id, None) if out.finished else None
            if w is not None:
                if not w.done():
                    w.set_result(out)
                continue
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def fail_all(self, why: str) -> None:
        """The engine is gone: every request in flight ends with EngineUnavailableError."""
        for q in self._queues.values():
            q.put_nowait(EngineUnavailableError(why))
        waiters, self._waiters = self._waiters, {}
        for w in waiters.values():
            if not w.done():
                w.set_exception(EngineUnavailableError(why))

    def stream(self, request: EngineRequest) -> OutputStream:
        """Send `request` (on the first read); its outputs until the finished one. Closing it
        early (`aclose`) aborts it."""
        return OutputStream(self, request)

    async def single(self, request: EngineRequest) -> EngineOutput:
        """Send a single-pass `request`; its one output. Cancelling aborts it."""
        rid = request.request_id
        if rid in self._waiters or rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in flight")
        fut: asyncio.Future[EngineOutput] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        try:
            self._send(request)
            return await fut
        except asyncio.CancelledError:
            if self._waiters.pop(rid, None) is not None:
                self._abort(rid)
            raise
        finally:
            self._waiters.pop(rid, None)


class OutputStream:
    """One streamed request's outputs, until the finished one: an async iterator (a class, not
    an async generator, so that the module compiles with mypyc). Nothing is sent before the
    first read; `aclose()` before the finished output aborts the request in the engine. Read it
    inside `contextlib.aclosing`: unlike an async generator, a stream dropped unclosed is never
    finalised, so its request would run on in the engine for nobody."""

    __slots__ = ("_closed", "_queue", "_request", "_router")

    def __init__(self, router: RequestRouter, request: EngineRequest) -> None:
        self._router = router
        self._request = request
        self._queue: asyncio.Queue[EngineOutput | BaseException] | None = None
        self._closed = False  # finished, failed or closed: nothing more to read or abort

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self._closed:
            raise StopAsyncIteration
        q = self._queue
        if q is None:
            q = self._queue = self._open()
        item = await q.get()
        if isinstance(item, BaseException):
            self._finish()  # the engine that held it is gone: nothing to abort
            raise item
        if item.finished:
            self._finish()
        return item

    async def aclose(self) -> None:
        if self._queue is not None and not self._closed:
            self._finish()
            self._router._abort(self._request.request_id)
        self._closed = True

    def _open(self) -> asyncio.Queue[EngineOutput | BaseException]:
        router, rid = self._router, self._request.request_id
        if rid in router._queues or rid in router._waiters:
            self._closed = True
            raise ValueError(f"request id {rid!r} is already in flight")
        q: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        router._queues[rid] = q
        try:
            router._send(self._request)
        except BaseException:
            self._finish()
            router._abort(rid)
            raise
        return q

    def _finish(self) -> None:
        self._closed = True
        self._router._queues.pop(self._request.request_id, None)


# compiled (tailguard.compiled), and subclassed by interpreted engine clients
@mypyc_attr(allow_interpreted_subclasses=True)
class RoutedClient:
    """The request half of `EngineClientProtocol` on a RequestRouter (`submit`, `run`,
    `on_output`), shared by the engine clients: each sets `_router` and says when it takes
    requests (`_check_ready`)."""

    _router: RequestRouter
    _ready: bool  # takes requests
    _restarts: int  # engine restarts so far

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def on_output(self) -> Callable[[EngineOutput], None] | None:
        return self._router.on_output

    @on_output.setter
    def on_output(self, listener: Callable[[EngineOutput], None] | None) -> None:
        self._router.on_output = listener

    def submit(self, request: EngineRequest) -> OutputStream:
        self._check_ready()
        return self._router.stream(request)

    async def run(self, request: EngineRequest) -> EngineOutput:
        self._check_ready()
        return await self._router.single(request)

    def _check_ready(self) -> None:
        """Raise EngineUnavailableError when the engine cannot take a request now."""
        raise NotImplementedError

"""The ASGI application: routing, body reading, auth, errors, and the operational endpoints.

A raw ASGI app rather than a framework: on this machine FastAPI served about a third of the
requests per second of a raw ASGI app, and the 10,000-connection burst is front-end bound.
Per request: route -> auth -> read body (bounded) -> handler (handlers.py) -> one answer,
timed from "request read" to "response written" for `mistral_inference_latency_seconds`.
The engine runs in another process; nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from tailguard.core.admission import AdmissionController
from tailguard.core.engine_api import EngineClientProtocol
from tailguard.errors import (
    EngineUnavailableError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    QuotaExceededError,
    TailguardError,
    UnauthorizedError,
)
from tailguard.server.cache import ResponseCache
from tailguard.server.config import ServerConfig
from tailguard.server.errors import error_answer
from tailguard.server.metrics import CONTENT_TYPE, ServerMetrics
from tailguard.server.schemas import openapi_document
from tailguard.server.tokenizer import ModelInfo

__all__ = ["App", "Call"]

log = logging.getLogger("tailguard.server")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = [(b"content-type", b"application/json")]
# tailguard_rejections_total{reason}: refusals, as opposed to failures (oom, internal)
REJECTION_REASONS = frozenset(
    {"overloaded", "expired", "invalid", "unauthorized", "quota", "engine_down", "not_found"}
)


class DisconnectWatch:
    """Cancels the handler of a request whose client disconnected, once it has run `after_s`.

    Most answers are done within a few ms, so a request is only noted when it reaches the engine
    (`Call.watch_disconnect`: one dict insert) and a sweep every `after_s / 2` starts a watcher
    task for the requests still running after `after_s`. Cheaper than a timer per request, and
    far cheaper than a task per request. A client gone earlier is noticed within 1.5 x after_s.
    """

    def __init__(self, after_s: float = 0.02) -> None:
        self.after_s = after_s
        self._noted: dict[Call, float] = {}  # call -> time.monotonic() when noted; oldest first

    def note(self, call: Call) -> None:
        self._noted[call] = time.monotonic()

    def forget(self, call: Call) -> None:
        self._noted.pop(call, None)

    def sweep(self, now: float) -> None:
        cutoff = now - self.after_s
        noted = self._noted
        while noted:
            call = next(iter(noted))
            if noted[call] > cutoff:
                return
            del noted[call]
            call.start_watch()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.after_s / 2)
            self.sweep(time.monotonic())


@dataclass(eq=False, slots=True)  # compared and hashed by identity (DisconnectWatch keys on it)
class Call:
    """One HTTP request on its way through the server."""

    scope: Scope
    receive: Receive
    send: Send
    headers: dict[bytes, bytes]
    endpoint: str  # metric label: completions, chat, embeddings, infer ("" for ops endpoints)
    task: asyncio.Task[Any] | None = None  # the task handling this request
    watch: DisconnectWatch | None = None  # where `watch_disconnect` notes this request
    body: bytes = b""
    t_read: float = 0.0  # time.monotonic() when the body was fully read
    outcome: str = "ok"  # metric label of the answer
    started: bool = False  # response headers sent
    extra_headers: tuple[tuple[bytes, bytes], ...] = ()  # added to every response's headers
    disconnected: bool = False  # the client went away (set by the watcher)
    _watcher: asyncio.Task[None] | None = None

    def watch_disconnect(self) -> None:
        """Cancel this request's handler if the client disconnects (see DisconnectWatch).

        Called once a request reaches the engine: from then on the engine holds resources for
        a client that may be gone.
        """
        if self.watch is not None and self.task is not None:
            self.watch.note(self)

    def start_watch(self) -> None:
        if self._watcher is None and self.task is not None and not self.task.done():
            self._watcher = self.task.get_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        if self.task is not None:
            self.task.cancel()

    def stop_watching(self) -> None:
        if self.watch is not None:
            self.watch.forget(self)
        if self._watcher is not None:
            self._watcher.cancel()

    def header(self, name: bytes) -> str | None:
        v = self.headers.get(name)
        return v.decode("latin-1") if v is not None else None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        if self.extra_headers:
            headers = [*headers, *self.extra_headers]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def body_part(self, data: bytes, more: bool) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def respond(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON
    ) -> None:
        self.started = True
        if self.extra_headers:
            headers = [*headers, *self.extra_headers]
        send = self.send
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*headers, (b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def respond_json(self, obj: Any, status: int = 200) -> None:
        await self.respond(status, orjson.dumps(obj))


Handler = Callable[[Call], Awaitable[None]]


@dataclass(frozen=True)
class Route:
    methods: tuple[str, ...]
    handler: Handler
    endpoint: str = ""  # metric label; API routes need auth and are timed
    api: bool = False


class _Quota:
    """Per-client token buckets (429 for a client over its own quota, never for overload)."""

    def __init__(self, rps: float, burst: int) -> None:
        self.rps, self.burst = rps, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, last time)

    def take(self, client: str, now: float) -> float:
        """0 when allowed, else seconds until a token is available."""
        tokens, last = self._buckets.get(client, (float(self.burst), now))
        tokens = min(self.burst, tokens + (now - last) * self.rps)
        if tokens >= 1.0:
            self._buckets[client] = (tokens - 1.0, now)
            return 0.0
        self._buckets[client] = (tokens, now)
        if len(self._buckets) > 100_000:  # bound memory against many distinct clients
            self._buckets.clear()
        return (1.0 - tokens) / self.rps


class IterationGate:
    """Lets at most `per_iteration` request handlers start per event-loop iteration.

    Why: under a burst the loop reads thousands of requests at once, and their handlers would all
    run back to back in one iteration (seconds, measured: one 2.5 s+ stall in a 10,000-connection
    burst), while the engine's answers for requests already admitted wait behind them. With the
    gate each iteration runs a bounded slice of new handlers, so woken, admitted requests are
    answered within a slice or two. Waiting handlers keep their FIFO order.
    """

    def __init__(self, per_iteration: int) -> None:
        self.per_iteration = per_iteration
        self._used = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._reset_pending = False

    def try_enter(self) -> bool:
        """Take a slot in this iteration if one is free, without waiting (the common case)."""
        if self._used < self.per_iteration and not self._waiters:
            self._used += 1
            if not self._reset_pending:
                self._schedule_reset()
            return True
        return False

    async def enter(self) -> None:
        if self.try_enter():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._schedule_reset()
        await fut

    def _schedule_reset(self) -> None:
        if not self._reset_pending:
            self._reset_pending = True
            asyncio.get_running_loop().call_soon(self._reset)

    def _reset(self) -> None:
        """Runs once per iteration: a new budget, handed to the oldest waiters first."""
        self._reset_pending = False
        self._used = 0
        while self._waiters and self._used < self.per_iteration:
            fut = self._waiters.popleft()
            if not fut.done():  # a cancelled waiter (client gone) takes no budget
                fut.set_result(None)
                self._used += 1
        if self._waiters or self._used:
            self._schedule_reset()


class App:
    def __init__(
        self,
        config: ServerConfig,
        engine: EngineClientProtocol,
        model: ModelInfo,
        metrics: ServerMetrics | None = None,
    ) -> None:
        from tailguard.server import handlers  # the endpoint logic

        self.config = config
        self.engine = engine
        self.model = model
        self.model_name = config.served_model_name
        self.metrics = metrics or ServerMetrics(
            config.sla_ms / 1e3, config.engine_config.max_num_seqs
        )
        self.admission = AdmissionController(config.admission())
        self.cache = ResponseCache(config.cache_max_entries, config.cache_max_bytes)
        self.quota = _Quota(config.client_quota_rps, config.client_quota_burst)
        self._api_key = config.api_key.encode() if config.api_key else None
        self._client_checks = self._api_key is not None or config.client_quota_rps > 0
        self._tasks: list[asyncio.Task[None]] = []
        self._engine_started = False
        self._openapi: bytes | None = None
        self._token_text: dict[int, str] = {}
        self.gate = IterationGate(config.handlers_per_iteration)
        self.watch = DisconnectWatch()
        self._loop: asyncio.AbstractEventLoop | None = None  # set by startup / the first request
        self.routes: dict[str, Route] = {
            "/v1/completions": Route(
                ("POST",), partial(handlers.completions, self), "completions", True
            ),
            "/v1/chat/completions": Route(("POST",), partial(handlers.chat, self), "chat", True),
            "/v1/embeddings": Route(
                ("POST",), partial(handlers.embeddings, self), "embeddings", True
            ),
            "/v1/infer": Route(("POST",), partial(handlers.infer, self), "infer", True),
            "/v1/models": Route(("GET",), self._models, "", True),
            "/health": Route(("GET",), self._health),
            "/ready": Route(("GET",), self._ready),
            "/metrics": Route(("GET",), self._metrics),
            "/openapi.json": Route(("GET",), self._openapi_json),
        }

    # ---- lifespan ---------------------------------------------------------------------------
    async def startup(self) -> None:
        """Start background work; the engine warms up while /health already answers."""
        loop = self._loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._start_engine(), name="engine-start"),
            loop.create_task(self.watch.run(), name="disconnect-watch"),
            loop.create_task(self._pump_stats(), name="stats-pump"),
            loop.create_task(self._probe_loop_lag(), name="loop-lag"),
        ]

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._engine_started:
            await self.engine.close()
        self.metrics.close()

    async def _start_engine(self) -> None:
        try:
            await self.engine.start()
            self._engine_started = True
            # Everything alive now (modules, tokenizer, metrics) lives for the whole process:
            # move it out of the collector's sight, so collections during a burst scan only
            # per-request objects (measured: 0.8 s of GC pauses in a 10,000-request burst).
            gc.collect()
            gc.freeze()
            log.info("engine ready")
        except Exception:
            log.exception("engine failed to start; /ready stays 503")
            self._engine_started = True  # close() still releases what start() acquired

    async def _pump_stats(self) -> None:
        """Feed engine step timings to admission and the metrics (every 5 ms).

        The pump's own lateness is the event-loop lag right now; its moving average goes to
        admission as the front-end's share of every answer's latency (an average, not a max:
        one GC pause or slow import must not turn every request away for the next 100 ms,
        while a burst that keeps the loop busy keeps the average up).
        """
        period = 0.005
        lag_avg = 0.0
        last_steps = 0
        logged: set[type] = set()
        while True:
            t = time.perf_counter()
            await asyncio.sleep(period)
            lag = max(time.perf_counter() - t - period, 0.0)
            lag_avg = 0.7 * lag_avg + 0.3 * lag
            self.admission.frontend_delay_s = lag_avg
            try:
                s = self.engine.stats
                new = self.metrics.observe_engine(
                    s, ready=self.engine.ready, restarts=self.engine.restarts
                )
                for step in new:
                    self.admission.cost.observe(step.num_tokens, step.step_s)
                if not new and s.steps_total > last_steps and s.step_s_ewma > 0:
                    # Steps ran but their records were in a snapshot this poll never saw (the
                    # client keeps only the latest one): learn from the engine's averages.
                    self.admission.cost.observe(
                        max(1, round(s.tokens_per_s * s.step_s_ewma)), s.step_s_ewma
                    )
                last_steps = s.steps_total
                self.admission.cost.refit()
                self.metrics.in_flight.set(self.admission.queued_requests)
            except Exception as exc:  # a bad snapshot must not stop the pump; say so once
                if type(exc) not in logged:
                    logged.add(type(exc))
                    log.exception("engine stats could not be read; admission uses older figures")

    async def _probe_loop_lag(self) -> None:
        interval = self.config.loop_lag_interval_ms / 1e3
        while True:
            t = time.perf_counter()
            await asyncio.sleep(interval)
            self.metrics.loop_lag.observe(max(time.perf_counter() - t - interval, 0.0))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:  # pragma: no cover - reported to the server
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- request path -----------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"])
        loop = self._loop
        if loop is None:  # served without lifespan (no startup)
            loop = self._loop = asyncio.get_running_loop()
        # current_task(loop): without the loop argument it looks the loop up, a getpid() syscall
        call = Call(
            scope,
            receive,
            send,
            dict(scope["headers"]),
            route.endpoint if route else "",
            asyncio.current_task(loop),
            self.watch,
        )
        try:
            if route is None:
                call.t_read = time.monotonic()
                raise NotFoundError(f"no route {scope['path']}; see /openapi.json")
            if scope["method"] not in route.methods:
                call.t_read = time.monotonic()
                raise MethodNotAllowedError(
                    f"{scope['method']} is not allowed on {scope['path']}; use "
                    f"{' or '.join(route.methods)}"
                )
            if route.api and not self.gate.try_enter():
                # Before the body is read, so server time (read -> written) starts when a
                # handler slot is free; the wait for a slot is not in it (it is in the client's).
                await self.gate.enter()
            call.body = await self._read_body(call)
            call.t_read = time.monotonic()
            if route.api and self._client_checks:
                self._check_client(call)
            await route.handler(call)
        except asyncio.CancelledError:
            if not call.disconnected:
                raise
            # The watcher cancelled us: the engine request is aborted; nobody to answer.
            call.outcome = "aborted"
        except Exception as exc:
            if not isinstance(exc, TailguardError):
                log.exception("unhandled error on %s", scope["path"])
            if not call.started:
                ans = error_answer(exc, allow=",".join(route.methods) if route else None)
                call.outcome = ans.label
                await call.respond(ans.status, ans.body, [*JSON, *ans.headers])
                if ans.label in REJECTION_REASONS:
                    self.metrics.rejected(ans.label, time.monotonic() - call.t_read)
        finally:
            call.stop_watching()
            if call.endpoint and call.t_read:
                self.metrics.answered(call.endpoint, call.outcome, time.monotonic() - call.t_read)

    async def _read_body(self, call: Call) -> bytes:
        limit = self.config.max_body_bytes
        length = call.headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise PayloadTooLargeError(
                f"request body is {length.decode()} bytes; the limit is {limit} (max_body_bytes)"
            )
        msg = await call.receive()
        if msg["type"] == "http.request" and not msg.get("more_body", False):
            body: bytes = msg.get("body", b"")  # the usual case: the whole body in one message
            if len(body) <= limit:
                return body
        chunks: list[bytes] = []
        size = 0
        while True:
            if msg["type"] == "http.disconnect":
                raise asyncio.CancelledError  # nobody to answer
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(
                    f"request body exceeds {limit} bytes (max_body_bytes); send less per request"
                )
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)
            msg = await call.receive()

    def _check_client(self, call: Call) -> None:
        """Auth first (401 touches nothing), then the client's own quota (429)."""
        auth = call.headers.get(b"authorization", b"")
        if self._api_key is not None:
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self._api_key):
                raise UnauthorizedError(
                    "missing or wrong API key: send `Authorization: Bearer <key>`"
                )
        if self.config.client_quota_rps > 0:
            client = (
                auth
                or call.headers.get(b"x-client-id")
                or str((call.scope.get("client") or ("?",))[0]).encode()
            )
            wait = self.quota.take(client.decode("latin-1"), call.t_read)
            if wait > 0:
                raise QuotaExceededError(
                    f"client over its quota of {self.config.client_quota_rps:g} requests/s; "
                    "slow down",
                    retry_after_s=wait,
                )

    def token_text(self, token_id: int) -> str:
        """One token's text, memoised: top-k answers decode the same few ids over and over."""
        text = self._token_text.get(token_id)
        if text is None:
            if len(self._token_text) > 65_536:
                self._token_text.clear()
            text = self._token_text[token_id] = self.model.tokenizer.decode([token_id])
        return text

    def require_engine(self) -> None:
        if not self.engine.ready:
            raise EngineUnavailableError(
                "engine is not ready (warming up, or restarting after a crash); retry shortly"
            )

    # ---- operational endpoints --------------------------------------------------------------
    async def _health(self, call: Call) -> None:
        await call.respond_json({"status": "ok"})

    async def _ready(self, call: Call) -> None:
        if not self.engine.ready:
            ans = error_answer(
                EngineUnavailableError(
                    "engine not ready: warming up, or its process died and is being restarted "
                    f"(restarts so far: {self.engine.restarts})"
                )
            )
            await call.respond(ans.status, ans.body, [*JSON, *ans.headers])
            return
        await call.respond_json({"status": "ready", "restarts": self.engine.restarts})

    async def _metrics(self, call: Call) -> None:
        await call.respond(200, self.metrics.render(), [(b"content-type", CONTENT_TYPE.encode())])

    async def _models(self, call: Call) -> None:
        await call.respond_json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "tailguard",
                        "max_model_len": self.model.max_model_len,
                    }
                ],
            }
        )

    async def _openapi_json(self, call: Call) -> None:
        if self._openapi is None:
            self._openapi = orjson.dumps(openapi_document(self.model_name))
        await call.respond(200, self._openapi)

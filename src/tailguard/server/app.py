"""The application: routing, auth, errors, background work, and the operational endpoints.

No framework and no ASGI: on this machine FastAPI served about a third of the requests per
second of a raw ASGI app, and a minimal httptools protocol about four times a raw ASGI app on
uvicorn (tailguard.server.http). The connection reads a whole request (body bounded), builds a
`Call` (call.py) and awaits `App.handle(call)`: route -> auth/quota -> handler (handlers.py,
generate.py: thin adapters on the request pipeline, pipeline.py, built here once) -> one
answer, timed from "request read" to "response written" for
`mistral_inference_latency_seconds`. The engine runs in another process; nothing here imports
torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import orjson

from tailguard.core.admission import AdmissionController
from tailguard.core.calibration import EDGES_S
from tailguard.core.engine_api import EngineClientProtocol
from tailguard.core.request import EngineOutput
from tailguard.errors import (
    EngineUnavailableError,
    MethodNotAllowedError,
    NotFoundError,
    QuotaExceededError,
    TailguardError,
    UnauthorizedError,
)
from tailguard.server import generate, handlers
from tailguard.server.cache import ResponseCache
from tailguard.server.call import JSON, Call
from tailguard.server.config import ServerConfig
from tailguard.server.errors import error_answer
from tailguard.server.metrics import CONTENT_TYPE, ServerMetrics
from tailguard.server.pipeline import Pipeline
from tailguard.server.quota import ClientQuota, bearer_token
from tailguard.server.schemas import openapi_document
from tailguard.server.tokenizer import ModelInfo

__all__ = ["App", "Call"]

log = logging.getLogger("tailguard.server")

# tailguard_rejections_total{reason}: refusals, as opposed to failures (oom, internal)
REJECTION_REASONS = frozenset(
    {"overloaded", "expired", "invalid", "unauthorized", "quota", "engine_down", "not_found"}
)


Handler = Callable[[Call], Awaitable[None]]


@dataclass(frozen=True)
class Route:
    methods: tuple[str, ...]
    handler: Handler
    endpoint: str = ""  # metric label; API routes need auth and are timed
    api: bool = False


class App:
    def __init__(
        self,
        config: ServerConfig,
        engine: EngineClientProtocol,
        model: ModelInfo,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.model = model
        self.model_name = config.served_model_name
        self.metrics = metrics or ServerMetrics(
            config.sla_ms / 1e3, config.engine_config.max_num_seqs
        )
        self.admission = AdmissionController(config.admission_config())
        engine.on_output = self._on_engine_output
        self.cache = ResponseCache(config.cache_max_entries, config.cache_max_bytes)
        self.pipeline = p = Pipeline(
            config, engine, model, self.admission, self.cache, self.metrics
        )
        self.quota = ClientQuota(
            config.client_quota_rps,
            config.client_quota_burst,
            config.client_quota_max_clients,
            config.trusted_proxies,
        )
        self._api_key = config.api_key.encode() if config.api_key else None
        self._client_checks = self._api_key is not None or config.client_quota_rps > 0
        self._tasks: list[asyncio.Task[None]] = []
        self._engine_started = False
        self._openapi: bytes | None = None
        self.routes: dict[str, Route] = {
            "/v1/completions": Route(
                ("POST",), partial(generate.completions, p), "completions", True
            ),
            "/v1/chat/completions": Route(("POST",), partial(generate.chat, p), "chat", True),
            "/v1/embeddings": Route(("POST",), partial(handlers.embeddings, p), "embeddings", True),
            "/v1/infer": Route(("POST",), partial(handlers.infer, p), "infer", True),
            "/v1/models": Route(("GET",), self._models, "", True),
            "/health": Route(("GET",), self._health),
            "/ready": Route(("GET",), self._ready),
            "/metrics": Route(("GET",), self._metrics),
            "/openapi.json": Route(("GET",), self._openapi_json),
        }

    # ---- lifespan ---------------------------------------------------------------------------
    async def startup(self) -> None:
        """Start background work; the engine warms up while /health already answers."""
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._start_engine(), name="engine-start"),
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

    def _on_engine_output(self, out: EngineOutput) -> None:
        """Every engine output, the moment the engine client reads it: the admission ledger
        follows the engine, and each deadline event is one prediction-error sample."""
        sample = self.admission.observe_output(out, out.received_s or time.monotonic())
        if sample is not None:
            self.metrics.prediction(sample.single_pass, sample.actual_s, sample.predicted_s)

    async def _pump_stats(self) -> None:
        """Feed engine step timings to admission and the metrics, and refresh admission's
        calibration (every 5 ms).

        Admission's figure for the front end's share of an answer's latency (after the engine
        client read it) is the larger of (1) the moving average of the pump's own lateness (the
        event-loop lag right now; an average, so one GC pause does not turn every request away)
        and (2) the largest time a recent answer took from the engine client to its handler
        (`delivery`, measured on the answers themselves, forgotten within 0.5 s): under a burst
        the loop is busy with the flood, and that is the delay an admitted answer waits.
        """
        period = 0.005
        lag_avg = 0.0
        logged: set[type] = set()
        while True:
            t = time.perf_counter()
            await asyncio.sleep(period)
            lag = max(time.perf_counter() - t - period, 0.0)
            lag_avg = 0.7 * lag_avg + 0.3 * lag
            self.admission.frontend_delay_s = max(
                lag_avg, self.pipeline.delivery.value(time.monotonic())
            )
            try:
                s = self.engine.stats
                new = self.metrics.observe_engine(
                    s, ready=self.engine.ready, restarts=self.engine.restarts
                )
                for step in new:
                    self.admission.observe_step(step)
                self.admission.cost.refit()
                self.admission.refresh(time.monotonic())
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

    # ---- request path -----------------------------------------------------------------------
    async def handle(self, call: Call) -> None:
        """Answer one request: route -> auth/quota -> handler; every error answered
        here in OpenAI shape, timed from "request read" to "response written"."""
        route = self.routes.get(call.path)
        if route is not None:
            call.endpoint = route.endpoint
        try:
            if call.error is not None:  # found while reading the request (413)
                call.t_read = time.monotonic()
                raise call.error
            if route is None:
                call.t_read = time.monotonic()
                raise NotFoundError(f"no route {call.path}; see /openapi.json")
            if call.method not in route.methods:
                call.t_read = time.monotonic()
                raise MethodNotAllowedError(
                    f"{call.method} is not allowed on {call.path}; use {' or '.join(route.methods)}"
                )
            call.t_read = time.monotonic()
            if not call.t_arrival:  # built without a socket (in-process)
                call.t_arrival = call.t_read
            if route.api and self._client_checks:
                self._check_client(call)
            await route.handler(call)
        except asyncio.CancelledError:
            if not call.disconnected:
                raise
            # The client went away: the engine request is aborted; nobody to answer.
            call.outcome = "aborted"
        except Exception as exc:
            if not isinstance(exc, TailguardError):
                log.exception("unhandled error on %s", call.path)
            if not call.started:
                ans = error_answer(exc, allow=",".join(route.methods) if route else None)
                call.outcome = ans.label
                call.respond(ans.status, ans.body, [*JSON, *ans.headers])
                if ans.label in REJECTION_REASONS:
                    self.metrics.rejected(ans.label, time.monotonic() - call.t_read)
        finally:
            if call.endpoint and call.t_read:
                self.metrics.answered(call.endpoint, call.outcome, time.monotonic() - call.t_read)

    def _check_client(self, call: Call) -> None:
        """Auth first (401 touches nothing), then the client's own quota (429)."""
        self._check_auth(call)
        if self.config.client_quota_rps > 0:
            client = self.quota.identity(call.headers, call.client, self._api_key)
            wait = self.quota.take(client, call.t_read)
            if wait > 0:
                raise QuotaExceededError(
                    f"client over its quota of {self.config.client_quota_rps:g} requests/s; "
                    "slow down",
                    retry_after_s=wait,
                )

    def _check_auth(self, call: Call) -> None:
        if self._api_key is not None:
            token = bearer_token(call.headers.get(b"authorization")) or b""
            if not hmac.compare_digest(token, self._api_key):
                raise UnauthorizedError(
                    "missing or wrong API key: send `Authorization: Bearer <key>`"
                )

    def precheck(self, call: Call) -> TailguardError | None:
        """What refuses a request from its head alone (route, method, API key), asked before
        answering `Expect: 100-continue`: a client told 404 or 401 never sends its body."""
        route = self.routes.get(call.path)
        if route is None:
            return NotFoundError(f"no route {call.path}; see /openapi.json")
        if call.method not in route.methods:
            return MethodNotAllowedError(
                f"{call.method} is not allowed on {call.path}; use {' or '.join(route.methods)}"
            )
        if route.api:
            try:
                self._check_auth(call)
            except UnauthorizedError as e:
                return e
        return None

    # ---- operational endpoints --------------------------------------------------------------
    async def _health(self, call: Call) -> None:
        call.respond_json({"status": "ok"})

    async def _ready(self, call: Call) -> None:
        if not self.engine.ready:
            ans = error_answer(
                EngineUnavailableError(
                    "engine not ready: warming up, or its process died and is being restarted "
                    f"(restarts so far: {self.engine.restarts})"
                )
            )
            call.respond(ans.status, ans.body, [*JSON, *ans.headers])
            return
        call.respond_json({"status": "ready", "restarts": self.engine.restarts})

    async def _metrics(self, call: Call) -> None:
        for single_pass, cal in self.admission.calibration.items():
            self.metrics.calibration_now(single_pass, cal, EDGES_S)
        self.metrics.step_cost.labels("a").set(self.admission.cost.a)
        self.metrics.step_cost.labels("b").set(self.admission.cost.b)
        self.metrics.step_cost.labels("c").set(self.admission.cost.c)
        self.metrics.expected_misses.set(self.admission.expected_miss_share)
        self.metrics.overload_headroom.set(self.admission.headroom(time.monotonic()))
        call.respond(200, self.metrics.render(), [(b"content-type", CONTENT_TYPE.encode())])

    async def _models(self, call: Call) -> None:
        call.respond_json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "tailguard",
                        "max_model_len": self.engine.max_model_len or None,  # None: not started
                        # token ids a prompt may use (load tools draw random prompts from it)
                        "vocab_size": self.model.tokenizer.vocab_size,
                    }
                ],
            }
        )

    async def _openapi_json(self, call: Call) -> None:
        if self._openapi is None:
            self._openapi = orjson.dumps(openapi_document(self.model_name))
        call.respond(200, self._openapi)

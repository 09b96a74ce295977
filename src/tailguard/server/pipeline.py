"""The request pipeline every /v1 endpoint goes through, built once with its dependencies.

    handler (OpenAI JSON -> Job)        handlers.py, generate.py: thin adapters
      prepare      deadline, priority, cache key, ids checked against vocabulary and context
      shed         not even one token would be admitted now: cache or 503, before tokenizing
      admit        an owned admission Ticket (async context manager), released on every exit
      run          engine outputs (`outputs`, `single`); leaving early aborts the engine request
      answer       JSON body; on overload or OOM the degradation cache answers instead
    handler (result -> OpenAI JSON)

The degradation cache stores only an answer's deterministic payload (choices, data, usage);
its envelope (id, created, timing) is made fresh for every answer, a cache hit included.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from tailguard.core.admission import AdmissionController
from tailguard.core.calibration import RecentMax
from tailguard.core.engine_api import EngineClientProtocol, EngineStream
from tailguard.core.request import (
    EngineOutput,
    EngineRequest,
    Pooling,
    Priority,
    RequestKind,
    SamplingParams,
)
from tailguard.errors import (
    ContextLengthError,
    EngineUnavailableError,
    InvalidRequestError,
    NotFoundError,
    OutOfMemoryRequestError,
    OverloadedError,
)
from tailguard.server.cache import ResponseCache
from tailguard.server.call import JSON, Call
from tailguard.server.config import ServerConfig
from tailguard.server.errors import engine_error
from tailguard.server.metrics import ServerMetrics
from tailguard.server.tokenizer import ModelInfo

__all__ = ["Job", "Outputs", "Pipeline", "Ticket", "splice"]

# No tokenizer makes more tokens than UTF-8 bytes; a few more for BOS and other special ones.
SPECIAL_TOKENS = 8
_PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}
_KIND_NAMES = {k: k.name.lower() for k in RequestKind}
_GENERATE = RequestKind.GENERATE  # bound once: reading an Enum's member costs ~55 ns
# Fields that do not change an answer: left out of its cache key.
_VOLATILE = frozenset({"timeout", "priority", "user", "stream", "stream_options"})
_encode = msgspec.json.Encoder().encode


@functools.cache
def _key_fields(cls: type[msgspec.Struct]) -> Callable[[Any], tuple[Any, ...]]:
    """What reads, from a request struct, the values of the fields that shape its answer (the
    cache key's), in field order (always a tuple: every request type has two or more)."""
    return operator.attrgetter(*(f for f in cls.__struct_fields__ if f not in _VOLATILE))


_GREEDY = SamplingParams()  # frozen: one shared default
_NOT_READY = "engine is not ready (warming up, or restarting after a crash); retry shortly"


@dataclass(slots=True)
class Job:
    """A prepared request: what the pipeline needs from any endpoint."""

    kind: RequestKind
    obj: str  # the answer's OpenAI `object`: inference, list, text_completion, chat.completion
    deadline_s: float  # monotonic, from the request's arrival
    priority: Priority
    cache_key: bytes | None  # None: nothing is stored or served from the cache
    ids: tuple[int, ...] = ()  # prompt token ids, once tokenized
    output_tokens: int = 0  # GENERATE: max_tokens
    sampling: SamplingParams = _GREEDY  # GENERATE
    top_k: int = 0  # SCORE
    want_embedding: bool = False  # SCORE
    pooling: Pooling = Pooling.MEAN  # EMBED, SCORE with want_embedding

    @property
    def single_pass(self) -> bool:
        return self.kind != _GENERATE


class Ticket:
    """An admitted request's place in the admission ledger, owned by its handler: `async with`
    releases it on every way out (answer, error, cancellation). Releasing is idempotent; the
    engine client's outputs usually moved the request out of the ledger already."""

    __slots__ = ("_admission", "_released", "request")

    def __init__(self, request: EngineRequest, admission: AdmissionController) -> None:
        self.request = request
        self._admission = admission
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission.release(self.request.request_id)

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Outputs:
    """An admitted generation's engine outputs (Pipeline.outputs): an engine failure raises its
    typed error; the ticket is released with the finished output, before the consumer sees it
    (a consumer may stop at the last output); `aclose()` before that aborts the request. A
    class, not an async generator, so that this module compiles with mypyc. It ends when the
    engine stream ends (after the finished output)."""

    __slots__ = ("_stream", "_ticket")

    def __init__(self, stream: EngineStream, ticket: Ticket) -> None:
        self._stream = stream
        self._ticket = ticket

    def __aiter__(self) -> Outputs:
        return self

    async def __anext__(self) -> EngineOutput:
        out = await self._stream.__anext__()
        if out.finished:
            err = engine_error(out)
            if err is not None:
                raise err
            self._ticket.release()
        return out

    async def aclose(self) -> None:
        await self._stream.aclose()


def splice(head: dict[str, Any], payload: bytes) -> bytes:
    """One JSON object from a fresh envelope and a (maybe cached) payload object."""
    start = orjson.dumps(head)
    if payload == b"{}":
        return start
    return start[:-1] + b"," + payload[1:]


class Pipeline:
    def __init__(
        self,
        config: ServerConfig,
        engine: EngineClientProtocol,
        model: ModelInfo,
        admission: AdmissionController,
        cache: ResponseCache,
        metrics: ServerMetrics,
    ) -> None:
        self.config = config
        self.engine = engine
        self.model = model
        self.model_name = config.served_model_name
        self.admission = admission
        self.cache = cache
        self.metrics = metrics
        self.delivery = RecentMax(window_s=0.25)  # engine client read it -> handler resumed (s)
        self._ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()
        self._token_text: dict[int, str] = {}

    # ---- prepare ------------------------------------------------------------------------------
    def new_id(self, kind: str) -> str:
        return f"{kind}-{self._id_prefix}{next(self._ids):x}"

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise NotFoundError(
                f"model {name!r} is not served here; this server serves {self.model_name!r} "
                "(see GET /v1/models)",
                param="model",
            )

    def deadline(self, call: Call, timeout_s: float | None) -> float:
        """Monotonic deadline: X-Request-Timeout-Ms, else the `timeout` field, else the SLA;
        capped; counted from the request's arrival (its first bytes read from the socket)."""
        cfg = self.config
        ms = cfg.sla_ms
        raw_b = call.headers.get(b"x-request-timeout-ms")
        if raw_b is not None:
            raw = raw_b.decode("latin-1")
            try:
                ms = float(raw)
            except ValueError:
                ms = -1.0
            if not ms > 0:
                raise InvalidRequestError(
                    f"X-Request-Timeout-Ms: {raw!r} is not a positive number of milliseconds",
                    param="X-Request-Timeout-Ms",
                )
        elif timeout_s is not None:
            ms = timeout_s * 1e3
        # From when the request's first bytes were read, not from when it was parsed: under a
        # burst a request can wait in the intake, and a request that already waited out its
        # deadline there must not be admitted (it would be late whatever the engine did).
        return call.t_arrival + min(ms, cfg.max_deadline_ms) / 1e3

    def priority(self, call: Call, field: str | None) -> Priority:
        raw = call.headers.get(b"x-priority")
        name = raw.decode("latin-1") if raw else field or self.config.default_priority
        p = _PRIORITIES.get(name)
        if p is None:
            raise InvalidRequestError(
                f"X-Priority: {name!r}; use interactive or batch", param="X-Priority"
            )
        return p

    def cache_key(
        self, call: Call, endpoint: str, req: msgspec.Struct, deterministic: bool
    ) -> bytes | None:
        """The degradation cache's key: the endpoint and every field that shapes the answer.
        None when nothing could be stored or served (cache off, sampled answer, or the client
        said both no-cache and no-store)."""
        if not deterministic or not self.cache.enabled:
            return None
        cc = call.headers.get(b"cache-control")
        if cc is not None:
            cc = cc.lower()
            if b"no-cache" in cc and b"no-store" in cc:
                return None
        # the answer-shaping fields' values in the struct's field order: the same request, the
        # same bytes (measured: 0.6 us, where to_builtins and a key-sorted dump took 1.5 us)
        return endpoint.encode() + b":" + _encode(_key_fields(type(req))(req))

    def job(
        self,
        call: Call,
        kind: RequestKind,
        req: Any,
        *,
        endpoint: str,
        obj: str,
        deterministic: bool = True,
    ) -> Job:
        """A Job from the fields every request has (`timeout`, `priority`); ids come later."""
        return Job(
            kind,
            obj,
            self.deadline(call, req.timeout),
            self.priority(call, req.priority),
            self.cache_key(call, endpoint, req, deterministic),
        )

    @property
    def max_model_len(self) -> int:
        """The engine's context length, as it reported at start-up. Before that nothing can be
        checked against it, nor run: 503."""
        n = self.engine.max_model_len
        if not n:
            raise EngineUnavailableError(_NOT_READY)
        return n

    def check_ids(self, ids: list[int], param: str) -> tuple[int, ...]:
        vocab = self.model.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param
            )
        return tuple(ids)

    def check_context(self, prompt: int, max_tokens: int, param: str) -> None:
        ctx = self.max_model_len
        if prompt + max_tokens > ctx:
            raise ContextLengthError(
                f"prompt has {prompt} tokens and max_tokens is {max_tokens}: "
                f"{prompt + max_tokens} > the model's context of {ctx} tokens; shorten the "
                "prompt or lower max_tokens",
                param=param,
            )

    def top_k_entries(self, pairs: Iterable[tuple[int, float]]) -> list[dict[str, Any]]:
        """An answer's `top_k`: (token id, log-prob) pairs with each token's text."""
        text = self.token_text  # memoised there
        return [{"token_id": t, "logprob": lp, "token": text(t)} for t, lp in pairs]

    def token_text(self, token_id: int) -> str:
        """One token's text, memoised: top-k answers decode the same few ids over and over."""
        text = self._token_text.get(token_id)
        if text is None:
            if len(self._token_text) > 65_536:
                self._token_text.clear()
            text = self._token_text[token_id] = self.model.tokenizer.decode([token_id])
        return text

    # ---- shed and admit -----------------------------------------------------------------------
    def shed_before_tokenizing(self, call: Call, job: Job, prompt_bytes: int) -> bool:
        """The one "shed before tokenizing" rule: when not even a one-token request would be
        admitted now, answer from the degradation cache (True) or raise OverloadedError (503 +
        Retry-After); False when the request may still fit. Under a burst far beyond capacity
        most requests end here, and tokenizing them (chat templates most of all) would only
        slow the answers down.

        Only for a prompt of `prompt_bytes` that cannot run past the context whatever its
        tokens: one that might gets tokenized first and its 400, not a 503, whatever the load.
        """
        if prompt_bytes + SPECIAL_TOKENS + job.output_tokens > self.max_model_len:
            return False
        d = self.admission.saturated(
            now_s=time.monotonic(),
            deadline_s=job.deadline_s,
            priority=job.priority,
            single_pass=job.single_pass,
        )
        if d is None:
            return False
        if self.served_from_cache(call, job, "overload"):
            return True
        self.metrics.admission_refused(d.code, job.single_pass)
        raise OverloadedError(
            f"server overloaded: {d.reason}; retry after {d.retry_after_s:.1f} s",
            retry_after_s=d.retry_after_s,
        )

    def admit(self, call: Call, job: Job) -> Ticket:
        """The admission decision: a Ticket to hold with `async with`, or OverloadedError (503 +
        Retry-After) at once when the request would be late."""
        if not self.engine.ready:
            raise EngineUnavailableError(_NOT_READY)
        rid = self.new_id(_KIND_NAMES[job.kind])
        d = self.admission.decide(
            rid,
            now_s=time.monotonic(),
            deadline_s=job.deadline_s,
            prompt_tokens=len(job.ids),
            output_tokens=job.output_tokens,
            priority=job.priority,
            single_pass=job.single_pass,
        )
        if not d.admitted:
            self.metrics.admission_refused(d.code, job.single_pass)
            raise OverloadedError(
                f"server overloaded: {d.reason}; retry after {d.retry_after_s:.1f} s",
                retry_after_s=d.retry_after_s,
            )
        req = EngineRequest(
            request_id=rid,
            prompt_token_ids=job.ids,
            kind=job.kind,
            sampling=job.sampling,
            priority=job.priority,
            deadline_s=d.engine_deadline_s,
            arrival_s=call.t_read,
            pooling=job.pooling,
            top_k=job.top_k,
            want_embedding=job.want_embedding,
        )
        return Ticket(req, self.admission)

    # ---- run ----------------------------------------------------------------------------------
    def outputs(self, ticket: Ticket) -> Outputs:
        """Engine outputs of one admitted generation; closing early aborts it in the engine.
        Consume it inside `contextlib.aclosing`, so that leaving early aborts at once."""
        return Outputs(self.engine.submit(ticket.request), ticket)

    async def single(self, ticket: Ticket) -> EngineOutput:
        """The one output of a single-pass request (score, embed); cancelling aborts it. The
        ticket is released on every way out, so `await p.single(p.admit(...))` needs no
        `async with` (nothing can happen between the admission and this `try`)."""
        try:
            out = await self.engine.run(ticket.request)
        finally:
            ticket.release()
        err = engine_error(out)
        if err is not None:
            raise err
        self.metrics.queue_for(ticket.request.priority).observe(out.queue_s)
        # How long the answer took from the engine client to this handler: under a burst the
        # event loop is busy with the flood, and admission must count this delay too (the
        # calibrated prediction covers the time until the engine client read the answer).
        now = time.monotonic()
        if out.received_s:
            self.delivery.observe(now - out.received_s, now)
        return out

    # ---- answer -------------------------------------------------------------------------------
    def envelope(
        self, call: Call, job: Job, request_id: str | None, out: EngineOutput | None
    ) -> dict[str, Any]:
        """What is fresh in every answer, a cache hit's included: id, created, timing. `out`:
        the engine output that answered (None for a cache hit: no queue, no compute)."""
        if job.obj == "list":  # embeddings: no id, no time
            return {"object": "list", "model": self.model_name}
        rid = request_id or self.new_id(_KIND_NAMES[job.kind])
        if job.obj == "inference":
            now = time.monotonic()
            return {
                "id": rid,
                "object": job.obj,
                "model": self.model_name,
                "timing": {
                    "intake_ms": ms(call.t_read - call.t_arrival),
                    "queue_ms": ms(out.queue_s) if out else 0.0,
                    "compute_ms": ms(out.compute_s) if out else 0.0,
                    "server_ms": ms(now - call.t_read),
                },
            }
        return {"id": rid, "object": job.obj, "created": int(time.time()), "model": self.model_name}

    def served_from_cache(self, call: Call, job: Job, reason: str) -> bool:
        """Graceful degradation: instead of failing a request (`reason`: overload or oom),
        answer it from the cache if the cache has it and the client did not opt out
        (`no-cache`): the cached payload in a fresh envelope."""
        key = job.cache_key
        if key is None or b"no-cache" in call.headers.get(b"cache-control", b"").lower():
            return False
        payload = self.cache.get(key)
        if payload is None:
            return False
        self.metrics.cache_hits.labels(reason).inc()
        call.outcome = "cache_hit"
        body = splice(self.envelope(call, job, None, None), payload)
        call.respond(200, body, [*JSON, (b"x-tailguard-cache", b"hit")])
        return True

    async def answer(
        self,
        call: Call,
        job: Job,
        compute: Callable[[], Awaitable[tuple[dict[str, Any], bytes]]],
    ) -> None:
        """Compute and send a JSON answer: `compute` returns its envelope (`envelope`) and its
        deterministic payload, which the cache stores. On overload or OOM the cache answers
        instead, when it can."""
        if job.cache_key is None:  # nothing to store, nothing to fall back to
            head, payload = await compute()
            call.respond(200, splice(head, payload))
            return
        try:
            head, payload = await compute()
        except (OverloadedError, OutOfMemoryRequestError) as e:
            reason = "overload" if isinstance(e, OverloadedError) else "oom"
            if self.served_from_cache(call, job, reason):
                return
            raise
        if b"no-store" not in call.headers.get(b"cache-control", b"").lower():
            self.cache.put(job.cache_key, payload)
        call.respond(200, splice(head, payload))


def ms(seconds: float) -> float:
    """Seconds -> milliseconds rounded to 3 decimals (round(x, 3) is ~3x slower: it goes
    through a decimal conversion)."""
    return int(seconds * 1e6 + 0.5) / 1e3

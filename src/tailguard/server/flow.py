"""The request path shared by every /v1 endpoint.

`admit` (deadline + priority -> admission decision; OverloadedError at once when it would be
late), `outputs`/`single` (engine outputs; closing early aborts the engine request), and `answer`
(on overload or OOM fall back to the degradation cache; store deterministic answers). Once a
request reaches the engine, a watcher cancels its handler if the client disconnects, which
closes the engine iterator and so aborts the engine request.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import orjson

from tailguard.core.request import EngineOutput, EngineRequest, Priority, RequestKind
from tailguard.errors import (
    ContextLengthError,
    InvalidRequestError,
    NotFoundError,
    OutOfMemoryRequestError,
    OverloadedError,
)
from tailguard.server.errors import engine_error

if TYPE_CHECKING:
    from tailguard.core.admission import AdmissionController, Decision
    from tailguard.server.app import App, Call

__all__ = [
    "JSON",
    "Admitted",
    "admit",
    "answer",
    "cache_key",
    "check_context",
    "check_ids",
    "check_model",
    "deadline",
    "new_id",
    "outputs",
    "priority",
    "served_from_cache",
    "shed",
    "single",
]

JSON = [(b"content-type", b"application/json")]
_ids = itertools.count()
_PREFIX = os.urandom(4).hex()
_KIND_NAMES = {k: k.name.lower() for k in RequestKind}


def new_id(kind: str) -> str:
    return f"{kind}-{_PREFIX}{next(_ids):x}"


def check_model(app: App, name: str | None) -> None:
    if name is not None and name != app.model_name:
        raise NotFoundError(
            f"model {name!r} is not served here; this server serves {app.model_name!r} "
            "(see GET /v1/models)",
            param="model",
        )


def deadline(app: App, call: Call, timeout_s: float | None) -> float:
    """Monotonic deadline: X-Request-Timeout-Ms, else the `timeout` field, else the SLA; capped;
    counted from the request's arrival (its first bytes read from the socket)."""
    cfg = app.config
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


_PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}


def priority(app: App, call: Call, field: str | None) -> Priority:
    raw = call.headers.get(b"x-priority")
    name = raw.decode("latin-1") if raw else field or app.config.default_priority
    p = _PRIORITIES.get(name)
    if p is None:
        raise InvalidRequestError(
            f"X-Priority: {name!r}; use interactive or batch", param="X-Priority"
        )
    return p


def check_ids(app: App, ids: list[int], param: str) -> tuple[int, ...]:
    vocab = app.model.tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param
        )
    return tuple(ids)


def check_context(app: App, prompt: int, max_tokens: int, param: str) -> None:
    ctx = app.model.max_model_len
    if prompt + max_tokens > ctx:
        raise ContextLengthError(
            f"prompt has {prompt} tokens and max_tokens is {max_tokens}: {prompt + max_tokens} > "
            f"the model's context of {ctx} tokens; shorten the prompt or lower max_tokens",
            param=param,
        )


def cache_key(
    app: App, call: Call, endpoint: str, req: msgspec.Struct, deterministic: bool
) -> bytes | None:
    """The degradation cache's key: the endpoint and every field that shapes the answer.

    None when nothing could be stored or served (cache off, sampled answer, or the client said
    both no-cache and no-store): `answer` then skips the cache altogether.
    """
    if not deterministic or not app.cache.enabled:
        return None
    cc = (call.header(b"cache-control") or "").lower()
    if "no-cache" in cc and "no-store" in cc:
        return None
    d = msgspec.to_builtins(req)
    for volatile in ("timeout", "priority", "user", "stream", "stream_options"):
        d.pop(volatile, None)
    return endpoint.encode() + b":" + orjson.dumps(d, option=orjson.OPT_SORT_KEYS)


class Admitted:
    """An admitted request: what goes to the engine, and its place in the admission ledger."""

    __slots__ = ("_admission", "_released", "request")

    def __init__(self, request: EngineRequest, admission: AdmissionController) -> None:
        self.request = request
        self._admission = admission
        self._released = False

    def release(self) -> None:
        """Leave the ledger (idempotent): the answer is in, or the request failed. The engine
        client's outputs usually moved it out already (the ledger follows the engine)."""
        if not self._released:
            self._released = True
            self._admission.release(self.request.request_id)


def _overloaded(app: App, d: Decision, single_pass: bool) -> OverloadedError:
    app.metrics.admission_refused(d.code, single_pass)
    return OverloadedError(
        f"server overloaded: {d.reason}; retry after {d.retry_after_s:.1f} s",
        retry_after_s=d.retry_after_s,
    )


def shed(
    app: App,
    call: Call,
    deadline_s: float,
    priority: Priority,
    *,
    single_pass: bool,
    key: Callable[[], bytes | None],
) -> bool:
    """For a handler about to tokenize: when not even a one-token request would be admitted
    now, answer from the degradation cache (True) or raise OverloadedError (503 +
    Retry-After); False when the request may still fit. Under a burst far beyond capacity most
    requests end here, and tokenizing them first would only slow the answers down. `key`
    (the cache key) is only computed when needed."""
    d = app.admission.saturated(
        now_s=time.monotonic(), deadline_s=deadline_s, priority=priority, single_pass=single_pass
    )
    if d is None:
        return False
    if served_from_cache(app, call, key(), "overload"):
        return True
    raise _overloaded(app, d, single_pass)


def could_exceed_context(app: App, text: str) -> bool:
    """True if `text` might tokenize past the model's context: no tokenizer makes more tokens
    than UTF-8 bytes, plus a few special ones."""
    return len(text.encode()) + 8 > app.model.max_model_len


def admit(
    app: App,
    call: Call,
    *,
    ids: tuple[int, ...],
    kind: RequestKind,
    deadline_s: float,
    priority: Priority,
    output_tokens: int = 0,
    **fields: Any,
) -> Admitted:
    """Admission decision; raises OverloadedError (503 + Retry-After) if it would be late."""
    if not app.engine.ready:
        app.require_engine()
    rid = new_id(_KIND_NAMES[kind])
    d = app.admission.decide(
        rid,
        now_s=time.monotonic(),
        deadline_s=deadline_s,
        prompt_tokens=len(ids),
        output_tokens=output_tokens,
        priority=priority,
        single_pass=kind != RequestKind.GENERATE,
    )
    if not d.admitted:
        raise _overloaded(app, d, kind != RequestKind.GENERATE)
    req = EngineRequest(
        request_id=rid,
        prompt_token_ids=ids,
        kind=kind,
        priority=priority,
        deadline_s=d.engine_deadline_s,
        arrival_s=call.t_read,
        **fields,
    )
    return Admitted(req, app.admission)


def raise_for(out: EngineOutput) -> None:
    """Turn a failed final output into the error the client gets."""
    err = engine_error(out)
    if err is not None:
        raise err


async def outputs(app: App, call: Call, adm: Admitted) -> AsyncGenerator[EngineOutput, None]:
    """Engine outputs of one admitted request; closing early aborts it in the engine.

    Consume it inside `contextlib.aclosing`: leaving an async generator un-closed defers its
    `finally` (abort, ledger release) to garbage collection.
    """
    agen = app.engine.submit(adm.request)
    try:
        async for out in agen:
            if out.finished:
                raise_for(out)
            if out.finished:
                adm.release()  # before the yield: a consumer may stop at the final output
            yield out
            if out.finished:
                return
    finally:
        adm.release()
        await agen.aclose()  # type: ignore[attr-defined]


async def single(app: App, call: Call, adm: Admitted) -> EngineOutput:
    """The one output of a single-pass request (score, embed); cancelling aborts it."""
    try:
        out = await app.engine.run(adm.request)
    finally:
        adm.release()
    raise_for(out)
    app.metrics.queue_for(adm.request.priority).observe(out.queue_s)
    # How long the answer took from the engine client to this handler: under a burst the event
    # loop is busy with the flood, and admission must count this delay too (the calibrated
    # prediction covers the time until the engine client read the answer).
    now = time.monotonic()
    if out.received_s:
        app.delivery.observe(now - out.received_s, now)
    return out


def served_from_cache(app: App, call: Call, key: bytes | None, reason: str) -> bool:
    """Graceful degradation: instead of failing a request (`reason`: overload or oom), answer
    it from the cache if the cache has it and the client did not opt out (`no-cache`)."""
    if key is None or "no-cache" in (call.header(b"cache-control") or "").lower():
        return False
    cached = app.cache.get(key)
    if cached is None:
        return False
    app.metrics.cache_hits.labels(reason).inc()
    call.outcome = "cache_hit"
    call.respond(200, cached, [*JSON, (b"x-tailguard-cache", b"hit")])
    return True


async def answer(
    app: App, call: Call, key: bytes | None, compute: Callable[[], Awaitable[bytes]]
) -> None:
    """Compute and send a JSON answer; degrade to the cache on overload or OOM."""
    if key is None:  # nothing to store, nothing to fall back to
        call.respond(200, await compute())
        return
    try:
        body: bytes = await compute()
    except (OverloadedError, OutOfMemoryRequestError) as e:
        if served_from_cache(
            app, call, key, "overload" if isinstance(e, OverloadedError) else "oom"
        ):
            return
        raise
    cc = (call.header(b"cache-control") or "").lower()
    if "no-store" not in cc:
        app.cache.put(key, body)
    call.respond(200, body)

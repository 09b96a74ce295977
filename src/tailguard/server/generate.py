"""Completions and chat: one generation, streamed as SSE or answered as one JSON body.

Stop strings are matched on the detokenized text in this process (the engine knows only stop
token ids; see text.py); a match ends the response and aborts the engine request.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import orjson

from tailguard.core.request import FinishReason, Priority, RequestKind, SamplingParams
from tailguard.errors import TailguardError
from tailguard.server import flow
from tailguard.server.errors import error_answer
from tailguard.server.schemas import ChatRequest, CompletionRequest
from tailguard.server.text import GeneratedText

if TYPE_CHECKING:
    from tailguard.server.app import App, Call

__all__ = ["run_generation"]

SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat uses the context left (<= 512)


def _finish_name(reason: FinishReason | None, stopped: bool) -> str:
    return "stop" if stopped or reason == FinishReason.STOP else "length"


def _deterministic(req: CompletionRequest | ChatRequest) -> bool:
    return req.temperature == 0 or req.seed is not None


def _max_tokens(req: CompletionRequest | ChatRequest, *, chat: bool, context_left: int) -> int:
    """What the client asked for, else the default: 16 for completions (OpenAI's), the context
    left (at most 512) for chat."""
    asked = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        asked = req.max_completion_tokens
    if asked is not None:
        return asked
    return DEFAULT_MAX_TOKENS if not chat else max(1, min(512, context_left))


def shed_before_tokenizing(
    app: App, call: Call, req: CompletionRequest | ChatRequest, *, chat: bool, prompt_bytes: int
) -> bool:
    """Turn a generation away before tokenizing it when not even a one-token request would be
    admitted now (chat templates cost more than the rest of the request path together). True
    when it was answered from the degradation cache instead; raises OverloadedError otherwise.

    Only for a prompt that cannot run past the context whatever its tokens (no tokenizer makes
    more tokens than UTF-8 bytes; 16 per message for a chat template's markers): such a request
    gets its 400, not a 503, whatever the load.
    """
    # chat's default output (the context left) always fits: count one token for it
    max_tokens = _max_tokens(req, chat=chat, context_left=1)
    if prompt_bytes + 8 + max_tokens > app.model.max_model_len:
        return False
    endpoint = "chat" if chat else "completions"
    return flow.shed(
        app,
        call,
        flow.deadline(app, call, req.timeout),
        flow.priority(app, call, req.priority),
        single_pass=False,
        key=lambda: (
            None if req.stream else flow.cache_key(app, call, endpoint, req, _deterministic(req))
        ),
    )


async def run_generation(
    app: App, call: Call, req: CompletionRequest | ChatRequest, ids: tuple[int, ...], *, chat: bool
) -> None:
    max_tokens = _max_tokens(req, chat=chat, context_left=app.model.max_model_len - len(ids))
    flow.check_context(app, len(ids), max_tokens, "max_tokens")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    deadline = flow.deadline(app, call, req.timeout)
    priority = flow.priority(app, call, req.priority)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
    )
    endpoint = "chat" if chat else "completions"
    deterministic = _deterministic(req)
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"

    def admit() -> flow.Admitted:
        return flow.admit(
            app,
            call,
            ids=ids,
            kind=RequestKind.GENERATE,
            deadline_s=deadline,
            priority=priority,
            output_tokens=max_tokens,
            sampling=sampling,
        )

    def usage(n_out: int) -> dict[str, int]:
        return {
            "prompt_tokens": len(ids),
            "completion_tokens": n_out,
            "total_tokens": len(ids) + n_out,
        }

    def observe_timing(first_s: float | None, last_s: float, n_out: int) -> None:
        if first_s is None:
            return
        app.metrics.ttft.labels(endpoint).observe(max(first_s - call.t_read, 0.0))
        if n_out > 1:
            app.metrics.tpot.observe((last_s - first_s) / (n_out - 1))

    if not req.stream:

        async def compute() -> bytes:
            adm = admit()
            text = GeneratedText(app.model.tokenizer, stops)
            n_out, reason, first_s = 0, None, None
            async with contextlib.aclosing(flow.outputs(app, call, adm)) as it:
                async for out in it:
                    if first_s is None and out.new_token_ids:
                        first_s = time.monotonic()
                        app.metrics.queue_for(priority).observe(out.queue_s)
                    n_out = out.num_output_tokens or n_out + len(out.new_token_ids)
                    text.add(out.new_token_ids, out.finished)
                    reason = out.finish_reason
                    if text.stopped:
                        break  # leaving the loop aborts the engine request
            observe_timing(first_s, time.monotonic(), n_out)
            finish = _finish_name(reason, text.stopped)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text.text}
            else:
                choice["text"] = text.text
            return orjson.dumps(
                {
                    "id": adm.request.request_id,
                    "object": obj,
                    "created": created,
                    "model": app.model_name,
                    "choices": [choice],
                    "usage": usage(n_out),
                }
            )

        await flow.answer(
            app, call, flow.cache_key(app, call, endpoint, req, deterministic), compute
        )
        return

    await _stream(app, call, req, admit, stops, chat, created, usage, observe_timing, priority)


async def _stream(
    app: App,
    call: Call,
    req: CompletionRequest | ChatRequest,
    admit: Any,
    stops: list[str],
    chat: bool,
    created: int,
    usage: Any,
    observe_timing: Any,
    priority: Priority,
) -> None:
    """SSE: headers go out with the first token, so admission or expiry errors keep a status."""
    adm = admit()
    rid = adm.request.request_id
    obj = "chat.completion.chunk" if chat else "text_completion"
    text = GeneratedText(app.model.tokenizer, stops)

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {"id": rid, "object": obj, "created": created, "model": app.model_name}
        return b"data: " + orjson.dumps({**body, "choices": choices, **extra}) + b"\n\n"

    def chunk(delta: str | None, finish: str | None, first: bool = False) -> bytes:
        if chat:
            d: dict[str, Any] = {}
            if first:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return event([choice])

    n_out, reason, first_s = 0, None, None
    try:
        async with contextlib.aclosing(flow.outputs(app, call, adm)) as it:
            async for out in it:
                if not call.started:
                    call.start(200, SSE)
                    await call.body_part(chunk("" if chat else None, None, first=True), True)
                if first_s is None and out.new_token_ids:
                    first_s = time.monotonic()
                    app.metrics.queue_for(priority).observe(out.queue_s)
                n_out = out.num_output_tokens or n_out + len(out.new_token_ids)
                reason = out.finish_reason
                delta = text.add(out.new_token_ids, out.finished)
                if delta:
                    await call.body_part(chunk(delta, None), True)
                if text.stopped:
                    break
    except TailguardError as exc:
        if not call.started:
            raise
        # Headers are gone: report the error in-band, as OpenAI's API does, and end the stream.
        call.outcome = error_answer(exc).label
        await call.body_part(b"data: " + orjson.dumps(exc.to_dict()) + b"\n\n", True)
        await call.body_part(b"data: [DONE]\n\n", False)
        return
    observe_timing(first_s, time.monotonic(), n_out)
    if not call.started:
        call.start(200, SSE)
    body = chunk(None, _finish_name(reason, text.stopped))
    opts = getattr(req, "stream_options", None)
    if isinstance(opts, dict) and opts.get("include_usage"):
        body += event([], usage=usage(n_out))
    await call.body_part(body + b"data: [DONE]\n\n", False)

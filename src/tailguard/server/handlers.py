"""The /v1 endpoints: validate, tokenize, admit, run in the engine, answer in OpenAI shape.

Each endpoint is `(app, call) -> None`; the shared request path (admission, engine outputs,
disconnect watch, degradation cache) is in flow.py, generation (completions, chat, SSE) in
generate.py.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from array import array
from typing import TYPE_CHECKING, Any

import orjson

from tailguard.core.request import Pooling, RequestKind
from tailguard.errors import InvalidRequestError, OverloadedError
from tailguard.server import flow
from tailguard.server.generate import run_generation, shed_before_tokenizing
from tailguard.server.schemas import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    InferRequest,
    decode,
)

if TYPE_CHECKING:
    from tailguard.server.app import App, Call

__all__ = ["chat", "completions", "embeddings", "infer"]


def _ms(seconds: float) -> float:
    """Seconds -> milliseconds rounded to 3 decimals (round(x, 3) is ~3x slower: it goes
    through a decimal conversion)."""
    return math.floor(seconds * 1e6 + 0.5) / 1e3


# ---- /v1/infer --------------------------------------------------------------------------------


async def infer(app: App, call: Call) -> None:
    req = decode(call.body, InferRequest)
    if req.model is not None:
        flow.check_model(app, req.model)
    if (req.prompt is None) == (req.input_ids is None):
        raise InvalidRequestError(
            "give exactly one of `prompt` (string) or `input_ids`", param="prompt"
        )
    if req.top_k == 0 and not req.embedding:
        raise InvalidRequestError(
            "nothing to return: set top_k >= 1 and/or embedding: true", param="top_k"
        )
    deadline = flow.deadline(app, call, req.timeout)
    priority = flow.priority(app, call, req.priority)
    key = flow.cache_key(app, call, "infer", req, True)
    if req.input_ids is not None:
        ids = flow.check_ids(app, req.input_ids, "input_ids")
        flow.check_context(app, len(ids), 0, "input_ids")
    else:
        prompt = req.prompt or ""
        # A prompt that fits the context whatever its tokens is shed before it is tokenized;
        # one that might not is tokenized first, so that it gets its 400 rather than a 503.
        if not flow.could_exceed_context(app, prompt) and flow.shed(
            app, call, deadline, priority, single_pass=True, key=lambda: key
        ):
            return
        ids = tuple(app.model.tokenizer.encode(prompt, add_bos=True))
        flow.check_context(app, len(ids), 0, "prompt")

    async def compute() -> bytes:
        adm = flow.admit(
            app,
            call,
            ids=ids,
            kind=RequestKind.SCORE,
            deadline_s=deadline,
            priority=priority,
            top_k=req.top_k,
            want_embedding=req.embedding,
            pooling=Pooling.MEAN if req.pooling == "mean" else Pooling.LAST,
        )
        out = await flow.single(app, call, adm)
        text = app.token_text
        body: dict[str, Any] = {
            "id": adm.request.request_id,
            "object": "inference",
            "model": app.model_name,
            "top_k": [
                {"token_id": t, "logprob": lp, "token": text(t)}
                for t, lp in (out.top_logprobs or ())
            ],
            "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids)},
            "timing": {
                "intake_ms": _ms(call.t_read - call.t_arrival),
                "queue_ms": _ms(out.queue_s),
                "compute_ms": _ms(out.compute_s),
                "server_ms": _ms(time.monotonic() - call.t_read),
            },
        }
        if req.embedding:
            body["embedding"] = out.embedding
        return orjson.dumps(body)

    await flow.answer(app, call, key, compute)


# ---- /v1/embeddings ---------------------------------------------------------------------------


async def embeddings(app: App, call: Call) -> None:
    req = decode(call.body, EmbeddingRequest)
    flow.check_model(app, req.model)
    inputs = req.inputs()
    # Nothing can turn out too long: when even one token would not fit, say so before
    # tokenizing (or answer from the degradation cache, when it has this request).
    fits_context = not any(isinstance(x, str) and flow.could_exceed_context(app, x) for x in inputs)
    if fits_context and flow.shed(
        app,
        call,
        flow.deadline(app, call, req.timeout),
        flow.priority(app, call, req.priority),
        single_pass=True,
        key=lambda: flow.cache_key(app, call, "embeddings", req, True),
    ):
        return
    tok = app.model.tokenizer
    prompts = [
        tuple(tok.encode(x)) if isinstance(x, str) else flow.check_ids(app, x, "input")
        for x in inputs
    ]
    for p in prompts:
        flow.check_context(app, len(p), 0, "input")
    deadline = flow.deadline(app, call, req.timeout)
    priority = flow.priority(app, call, req.priority)

    async def compute() -> bytes:
        admitted: list[flow.Admitted] = []
        try:
            for ids in prompts:
                admitted.append(
                    flow.admit(
                        app,
                        call,
                        ids=ids,
                        kind=RequestKind.EMBED,
                        deadline_s=deadline,
                        priority=priority,
                    )
                )
        except OverloadedError:
            for a in admitted:  # all or nothing
                a.release()
            raise
        outs = await asyncio.gather(*(flow.single(app, call, a) for a in admitted))
        data = []
        for i, out in enumerate(outs):
            emb = out.embedding or []
            value: Any = emb
            if req.encoding_format == "base64":
                value = base64.b64encode(array("f", emb).tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        n = sum(len(p) for p in prompts)
        return orjson.dumps(
            {
                "object": "list",
                "data": data,
                "model": app.model_name,
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )

    await flow.answer(app, call, flow.cache_key(app, call, "embeddings", req, True), compute)


# ---- /v1/completions and /v1/chat/completions -------------------------------------------------


async def completions(app: App, call: Call) -> None:
    req = decode(call.body, CompletionRequest)
    flow.check_model(app, req.model)
    if isinstance(req.prompt, str):
        size = len(req.prompt.encode())
        if shed_before_tokenizing(app, call, req, chat=False, prompt_bytes=size):
            return  # answered from the degradation cache
        ids = tuple(app.model.tokenizer.encode(req.prompt, add_bos=True))
    else:
        ids = flow.check_ids(app, req.prompt, "prompt")
    await run_generation(app, call, req, ids, chat=False)


async def chat(app: App, call: Call) -> None:
    req = decode(call.body, ChatRequest)
    flow.check_model(app, req.model)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    size = sum(len(m["content"].encode()) + 16 for m in messages)
    if shed_before_tokenizing(app, call, req, chat=True, prompt_bytes=size):
        return  # answered from the degradation cache
    try:
        ids = tuple(app.model.tokenizer.apply_chat_template(messages))
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidRequestError(f"messages: {e}", param="messages") from None
    await run_generation(app, call, req, ids, chat=True)

"""/v1/infer and /v1/embeddings: OpenAI-shaped adapters on the request pipeline.

Each handler decodes its JSON into a `Job` (pipeline.py), tokenizes (after the shed check),
runs it through admission and the engine, and turns the result into its JSON answer.
Completions and chat are in generate.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from array import array
from typing import Any

import orjson

from tailguard.core.request import EngineOutput, Pooling, RequestKind
from tailguard.errors import InvalidRequestError
from tailguard.server.call import Call
from tailguard.server.pipeline import Job, Pipeline
from tailguard.server.schemas import EmbeddingRequest, InferRequest, decode

__all__ = ["embeddings", "infer"]


async def infer(p: Pipeline, call: Call) -> None:
    req = decode(call.body, InferRequest)
    p.check_model(req.model)
    if (req.prompt is None) == (req.input_ids is None):
        raise InvalidRequestError(
            "give exactly one of `prompt` (string) or `input_ids`", param="prompt"
        )
    if req.top_k == 0 and not req.embedding:
        raise InvalidRequestError(
            "nothing to return: set top_k >= 1 and/or embedding: true", param="top_k"
        )
    job = p.job(call, RequestKind.SCORE, req, endpoint="infer", obj="inference")
    job.top_k, job.want_embedding = req.top_k, req.embedding
    job.pooling = Pooling.MEAN if req.pooling == "mean" else Pooling.LAST
    if req.input_ids is not None:
        job.ids = p.check_ids(req.input_ids, "input_ids")
        p.check_context(len(job.ids), 0, "input_ids")
    else:
        prompt = req.prompt or ""
        if p.shed_before_tokenizing(call, job, len(prompt.encode())):
            return  # answered from the degradation cache
        job.ids = tuple(p.model.tokenizer.encode(prompt, add_bos=True))
        p.check_context(len(job.ids), 0, "prompt")

    async def compute() -> tuple[dict[str, Any], bytes]:
        ticket = p.admit(call, job)
        out = await p.single(ticket)  # releases the ticket on every way out
        payload: dict[str, Any] = {
            "top_k": p.top_k_entries(out.top_logprobs or ()),
            "usage": {"prompt_tokens": len(job.ids), "total_tokens": len(job.ids)},
        }
        if req.embedding:
            payload["embedding"] = out.embedding
        return p.envelope(call, job, ticket.request.request_id, out), orjson.dumps(payload)

    await p.answer(call, job, compute)


async def embeddings(p: Pipeline, call: Call) -> None:
    req = decode(call.body, EmbeddingRequest)
    p.check_model(req.model)
    inputs = req.inputs()
    job = p.job(call, RequestKind.EMBED, req, endpoint="embeddings", obj="list")
    longest = max((len(x.encode()) for x in inputs if isinstance(x, str)), default=0)
    if p.shed_before_tokenizing(call, job, longest):
        return  # answered from the degradation cache
    tok = p.model.tokenizer
    prompts = [
        tuple(tok.encode(x)) if isinstance(x, str) else p.check_ids(x, "input") for x in inputs
    ]
    for ids in prompts:
        p.check_context(len(ids), 0, "input")

    async def compute() -> tuple[dict[str, Any], bytes]:
        outs = await _run_all(p, call, job, prompts)
        data = []
        for i, out in enumerate(outs):
            emb = out.embedding or []
            value: Any = emb
            if req.encoding_format == "base64":
                value = base64.b64encode(array("f", emb).tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        n = sum(len(ids) for ids in prompts)
        payload = {"data": data, "usage": {"prompt_tokens": n, "total_tokens": n}}
        return p.envelope(call, job, None, None), orjson.dumps(payload)

    await p.answer(call, job, compute)


async def _run_all(
    p: Pipeline, call: Call, job: Job, prompts: list[tuple[int, ...]]
) -> list[EngineOutput]:
    """One engine request per input, all admitted or none; when one fails, the others are
    cancelled (and so aborted in the engine) rather than left running for nobody."""
    async with contextlib.AsyncExitStack() as tickets:
        admitted = [
            await tickets.enter_async_context(p.admit(call, _one(job, ids))) for ids in prompts
        ]
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(p.single(t)) for t in admitted]
        except BaseExceptionGroup as group:  # the first failure is the answer
            raise group.exceptions[0] from None
    return [t.result() for t in tasks]


def _one(job: Job, ids: tuple[int, ...]) -> Job:
    return Job(job.kind, job.obj, job.deadline_s, job.priority, job.cache_key, ids)

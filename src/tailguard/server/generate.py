"""/v1/completions and /v1/chat/completions: one generation, streamed as SSE or answered as one
JSON body, on the request pipeline (pipeline.py).

Stop strings are matched on the detokenized text in this process (the engine knows only stop
token ids; see text.py); a match ends the response and aborts the engine request.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import orjson

from tailguard.core.request import EngineOutput, FinishReason, RequestKind, SamplingParams
from tailguard.errors import InvalidRequestError, TailguardError
from tailguard.server.call import SSE, Call
from tailguard.server.errors import error_answer
from tailguard.server.pipeline import Job, Pipeline, Ticket
from tailguard.server.schemas import ChatRequest, CompletionRequest, decode
from tailguard.server.text import GeneratedText

__all__ = ["chat", "completions"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat uses the context left (<= 512)
CHAT_MARKER_BYTES = 16  # per message: what a chat template adds around it, at most


async def completions(p: Pipeline, call: Call) -> None:
    req = decode(call.body, CompletionRequest)
    p.check_model(req.model)
    job = _job(p, call, req, chat=False)
    if isinstance(req.prompt, str):
        if p.shed_before_tokenizing(call, job, len(req.prompt.encode())):
            return  # answered from the degradation cache
        ids = tuple(p.model.tokenizer.encode(req.prompt, add_bos=True))
    else:
        ids = p.check_ids(req.prompt, "prompt")
    await Generation(p, call, req, job, ids, chat=False).run()


async def chat(p: Pipeline, call: Call) -> None:
    req = decode(call.body, ChatRequest)
    p.check_model(req.model)
    job = _job(p, call, req, chat=True)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    size = sum(len(m["content"].encode()) + CHAT_MARKER_BYTES for m in messages)
    if p.shed_before_tokenizing(call, job, size):
        return  # answered from the degradation cache
    try:
        ids = tuple(p.model.tokenizer.apply_chat_template(messages))
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidRequestError(f"messages: {e}", param="messages") from None
    await Generation(p, call, req, job, ids, chat=True).run()


def _job(p: Pipeline, call: Call, req: CompletionRequest | ChatRequest, *, chat: bool) -> Job:
    """The Job before tokenizing: its output tokens count for the shed rule (chat's default,
    the context left, always fits: one token is counted for it)."""
    deterministic = req.temperature == 0 or req.seed is not None
    job = p.job(
        call,
        RequestKind.GENERATE,
        req,
        endpoint="chat" if chat else "completions",
        obj="chat.completion" if chat else "text_completion",
        deterministic=deterministic and not req.stream,  # a stream is never cached
    )
    job.output_tokens = _max_tokens(req, chat=chat, context_left=1)
    return job


def _max_tokens(req: CompletionRequest | ChatRequest, *, chat: bool, context_left: int) -> int:
    """What the client asked for, else the default: 16 for completions (OpenAI's), the context
    left (at most 512) for chat."""
    asked = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        asked = req.max_completion_tokens
    if asked is not None:
        return asked
    return DEFAULT_MAX_TOKENS if not chat else max(1, min(512, context_left))


class Generation:
    """One generation request, tokenized: admitted, run, and answered (JSON or SSE)."""

    def __init__(
        self,
        p: Pipeline,
        call: Call,
        req: CompletionRequest | ChatRequest,
        job: Job,
        ids: tuple[int, ...],
        *,
        chat: bool,
    ) -> None:
        self.p, self.call, self.req, self.job, self.chat = p, call, req, job, chat
        job.ids = ids
        job.output_tokens = _max_tokens(req, chat=chat, context_left=p.max_model_len - len(ids))
        p.check_context(len(ids), job.output_tokens, "max_tokens")
        job.sampling = SamplingParams(
            max_tokens=job.output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self.text = GeneratedText(p.model.tokenizer, stops)
        self.n_out = 0
        self.reason: FinishReason | None = None
        self.first_s: float | None = None  # monotonic: the first token arrived
        self._head: dict[str, Any] = {}  # SSE: every event's envelope

    async def run(self) -> None:
        if self.req.stream:
            await self._stream()
        else:
            await self.p.answer(self.call, self.job, self._compute)

    def _take(self, out: EngineOutput) -> str:
        """One engine output: count it, time it, and return the text now safe to send."""
        if self.first_s is None and out.new_token_ids:
            self.first_s = time.monotonic()
            self.p.metrics.queue_for(self.job.priority).observe(out.queue_s)
        self.n_out = out.num_output_tokens or self.n_out + len(out.new_token_ids)
        self.reason = out.finish_reason
        return self.text.add(out.new_token_ids, out.finished)

    def _finished(self) -> str:
        """The OpenAI finish_reason; observes the generation's TTFT and TPOT."""
        m, first = self.p.metrics, self.first_s
        if first is not None:
            m.ttft.labels("chat" if self.chat else "completions").observe(
                max(first - self.call.t_read, 0.0)
            )
            if self.n_out > 1:
                m.tpot.observe((time.monotonic() - first) / (self.n_out - 1))
        return "stop" if self.text.stopped or self.reason == FinishReason.STOP else "length"

    def _usage(self) -> dict[str, int]:
        n_in = len(self.job.ids)
        return {
            "prompt_tokens": n_in,
            "completion_tokens": self.n_out,
            "total_tokens": n_in + self.n_out,
        }

    async def _compute(self) -> tuple[dict[str, Any], bytes]:
        async with (
            self.p.admit(self.call, self.job) as ticket,
            contextlib.aclosing(self.p.outputs(ticket)) as outputs,
        ):
            async for out in outputs:
                self._take(out)
                if self.text.stopped:
                    break  # leaving the loop aborts the engine request
        choice: dict[str, Any] = {"index": 0, "finish_reason": self._finished(), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": self.text.text}
        else:
            choice["text"] = self.text.text
        payload = orjson.dumps({"choices": [choice], "usage": self._usage()})
        return self.p.envelope(self.call, self.job, ticket.request.request_id, None), payload

    async def _stream(self) -> None:
        """SSE: headers go out with the first output, so admission or expiry errors keep their
        status; an error after that is reported in-band, as OpenAI's API does."""
        call = self.call
        try:
            async with self.p.admit(call, self.job) as ticket:
                await self._stream_outputs(ticket)
        except TailguardError as exc:
            if not call.started:
                raise
            call.outcome = error_answer(exc).label
            await call.body_part(b"data: " + orjson.dumps(exc.to_dict()) + b"\n\n", True)
            await call.body_part(b"data: [DONE]\n\n", False)
            return
        if not call.started:
            call.start(200, SSE)
        body = self._event([self._choice(None, self._finished())])
        opts = self.req.stream_options
        if isinstance(opts, dict) and opts.get("include_usage"):
            body += self._event([], usage=self._usage())
        await call.body_part(body + b"data: [DONE]\n\n", False)

    async def _stream_outputs(self, ticket: Ticket) -> None:
        call = self.call
        self._head = self.p.envelope(call, self.job, ticket.request.request_id, None)
        self._head["object"] = "chat.completion.chunk" if self.chat else "text_completion"
        async with contextlib.aclosing(self.p.outputs(ticket)) as outputs:
            async for out in outputs:
                if not call.started:
                    call.start(200, SSE)
                    first = self._choice("" if self.chat else None, None, first=True)
                    await call.body_part(self._event([first]), True)
                delta = self._take(out)
                if delta:
                    await call.body_part(self._event([self._choice(delta, None)]), True)
                if self.text.stopped:
                    break  # leaving the loop aborts the engine request

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({**self._head, "choices": choices, **extra}) + b"\n\n"

    def _choice(self, delta: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        d: dict[str, Any] = {}
        if first:
            d["role"] = "assistant"
        if delta is not None:
            d["content"] = delta
        return {"index": 0, "delta": d, "finish_reason": finish}

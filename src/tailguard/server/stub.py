"""The instant stub engine, and the deterministic stand-ins for a model's outputs.

`StubEngineClient` (implements `EngineClientProtocol`): every request answers at once. The
front-end benchmark uses it to measure the HTTP + admission path alone ("the model replaced by
an instant stub"). The simulated engine (simulated.py: the real scheduler with a timed fake
model) uses the same stand-ins: `fake_token`, `fake_embedding`, `fake_top_logprobs`.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable

from tailguard.core.request import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestKind,
)
from tailguard.core.stats import EngineStats
from tailguard.errors import EngineUnavailableError

__all__ = ["StubEngineClient", "fake_embedding", "fake_token", "fake_top_logprobs"]

EMBED_DIM = 16  # size of the fake embeddings


def _digest(ids: tuple[int, ...]) -> bytes:
    # hash() of a tuple of ints is deterministic (no hash randomisation for ints) and cheap:
    # the stub must cost next to nothing, it stands in for an instant model.
    return hash(ids).to_bytes(8, "little", signed=True) * 4


def fake_embedding(ids: tuple[int, ...]) -> list[float]:
    """Deterministic unit-norm vector derived from the prompt (so caching is testable)."""
    raw = [(b - 127.5) / 127.5 for b in _digest(ids)[:EMBED_DIM]]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def fake_token(ids: tuple[int, ...], step: int, seed: int | None) -> int:
    """Deterministic token for output position `step`: printable byte ids of SimpleTokenizer."""
    h = _digest((*ids[-4:], step, seed or 0))
    return 3 + 97 + h[0] % 26  # a..z in the simple byte tokenizer


def fake_top_logprobs(ids: tuple[int, ...], k: int) -> list[tuple[int, float]] | None:
    """Deterministic (token id, log-prob) pairs, best first (at most 16); None for k = 0."""
    if k <= 0:
        return None
    h = _digest(ids)
    return [(3 + h[i] % 250, -0.5 - i) for i in range(min(k, 16))]


def _single_pass_output(req: EngineRequest, queue_s: float, compute_s: float) -> EngineOutput:
    out = EngineOutput(
        request_id=req.request_id,
        finished=True,
        finish_reason=FinishReason.DONE,
        num_prompt_tokens=len(req.prompt_token_ids),
        queue_s=queue_s,
        compute_s=compute_s,
    )
    if req.kind == RequestKind.EMBED or req.want_embedding:
        out.embedding = fake_embedding(req.prompt_token_ids)
    if req.kind == RequestKind.SCORE:
        out.top_logprobs = fake_top_logprobs(req.prompt_token_ids, req.top_k)
    return out


def _hand_over(listener: Callable[[EngineOutput], None] | None, out: EngineOutput) -> EngineOutput:
    """Hand one output over as the real engine client does: stamped, `on_output` first, then
    (the caller) to the request's handler."""
    out.received_s = time.monotonic()
    if listener is not None:
        listener(out)
    return out


def _reason(stop: bool) -> FinishReason:
    return FinishReason.STOP if stop else FinishReason.LENGTH


class StubEngineClient:
    """Instant answers, no queue: the front-end benchmark's engine."""

    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024) -> None:
        self._stats = EngineStats(
            warmup_done=True,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self._ready = False
        self.on_output: Callable[[EngineOutput], None] | None = None

    async def start(self) -> None:
        self._ready = True

    async def close(self) -> None:
        self._ready = False

    async def submit(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if not self._ready:
            raise EngineUnavailableError("stub engine is not started")
        if request.kind != RequestKind.GENERATE:
            yield self._emit(_single_pass_output(request, 0.0, 0.0))
            return
        n = request.sampling.max_tokens
        ids = [fake_token(request.prompt_token_ids, i, request.sampling.seed) for i in range(n)]
        out = EngineOutput(
            request_id=request.request_id,
            new_token_ids=ids,
            finished=True,
            finish_reason=FinishReason.LENGTH,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=n,
            first_token_s=time.monotonic(),
        )
        yield self._emit(out)

    async def run(self, request: EngineRequest) -> EngineOutput:
        if not self._ready:
            raise EngineUnavailableError("stub engine is not started")
        return self._emit(_single_pass_output(request, 0.0, 0.0))

    def _emit(self, out: EngineOutput) -> EngineOutput:
        return _hand_over(self.on_output, out)

    async def abort(self, request_id: str) -> None:
        return None

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def restarts(self) -> int:
        return 0

"""The instant stub engine, and the deterministic stand-ins for a model's outputs.

`StubEngineClient` (implements `EngineClientProtocol`): every request answers at once. The
front-end benchmark uses it to measure the HTTP + admission path alone ("the model replaced by
an instant stub"). The simulated engine (simulated.py: the real scheduler with a timed fake
model) uses the same stand-ins: `fake_token`, `fake_embedding`, `fake_top_logprobs`.
"""

from __future__ import annotations

import math
import time

from mypy_extensions import mypyc_attr

from tailguard.core.request import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestKind,
)
from tailguard.core.stats import EngineStats
from tailguard.engine.router import RequestRouter, RoutedClient
from tailguard.errors import EngineUnavailableError

__all__ = ["StubEngineClient", "fake_embedding", "fake_token", "fake_top_logprobs"]

EMBED_DIM = 16  # size of the fake embeddings
# bound once: reading an Enum's member costs ~55 ns (the stub must cost next to nothing)
_DONE, _EMBED, _SCORE = FinishReason.DONE, RequestKind.EMBED, RequestKind.SCORE


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


_LOGPROBS = tuple(-0.5 - i for i in range(16))  # the i-th best's log-prob


def fake_top_logprobs(ids: tuple[int, ...], k: int) -> list[tuple[int, float]] | None:
    """Deterministic (token id, log-prob) pairs, best first (at most 16); None for k = 0."""
    if k <= 0:
        return None
    return [(3 + b % 250, lp) for b, lp in zip(_digest(ids), _LOGPROBS[:k], strict=False)]


def _single_pass_output(req: EngineRequest, queue_s: float, compute_s: float) -> EngineOutput:
    out = EngineOutput(
        request_id=req.request_id,
        finished=True,
        finish_reason=_DONE,
        num_prompt_tokens=len(req.prompt_token_ids),
        queue_s=queue_s,
        compute_s=compute_s,
    )
    if req.kind == _EMBED or req.want_embedding:
        out.embedding = fake_embedding(req.prompt_token_ids)
    if req.kind == _SCORE:
        out.top_logprobs = fake_top_logprobs(req.prompt_token_ids, req.top_k)
    return out


# compiled (tailguard.compiled), and subclassed in Python (bench/bench_stream.py)
@mypyc_attr(allow_interpreted_subclasses=True)
class StubEngineClient(RoutedClient):
    """Instant answers, no queue: the front-end benchmark's engine. Its answers reach their
    handlers through the same RequestRouter as the real engine client's (stamped, `on_output`
    first), so the front-end benchmark pays that hand-over as the real server does; only the
    model and the IPC hop are missing."""

    def __init__(
        self, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, max_model_len: int = 4096
    ) -> None:
        self._stats = EngineStats(
            warmup_done=True,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self._ready = False
        self._restarts = 0
        self._router = RequestRouter(self._answer, self._drop)
        self.max_model_len = max_model_len

    async def start(self) -> None:
        self._ready = True

    async def close(self) -> None:
        self._ready = False
        self._router.fail_all("stub engine closed")

    def _check_ready(self) -> None:
        if not self._ready:
            raise EngineUnavailableError("stub engine is not started")

    def _answer(self, request: EngineRequest) -> None:
        """The router's send: the request's whole answer, at once."""
        self._router.deliver(self.outputs(request))

    def _drop(self, request_id: str) -> None:
        """The router's abort: nothing runs, nothing to drop."""

    def outputs(self, request: EngineRequest) -> list[EngineOutput]:
        """Every output of `request`: one (a generation's tokens all in it)."""
        if request.kind != RequestKind.GENERATE:
            return [_single_pass_output(request, 0.0, 0.0)]
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
        return [out]

    async def abort(self, request_id: str) -> None:
        return None

    @property
    def stats(self) -> EngineStats:
        return self._stats

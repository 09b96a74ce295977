"""Engine clients without a model, both implementing `EngineClientProtocol`.

`StubEngineClient`: every request answers at once. The front-end benchmark uses it to measure
the HTTP + admission path alone ("the model replaced by an instant stub").

`SimulatedEngineClient`: one asyncio loop that behaves like the real engine's scheduler at a
configurable speed: steps of at most `max_num_seqs` sequences and `max_num_batched_tokens`
tokens, each costing `overhead + tokens / tokens_per_s` seconds; interactive work is scheduled
first; a request still waiting at its deadline is dropped unexecuted (EXPIRED); it publishes
`EngineStats` with per-step figures like the real engine. Admission, deadlines, 504 expiry,
priorities and Retry-After are testable with it in milliseconds and without torch. `crash()`
makes it behave like a dead engine process (in-flight requests fail with EngineUnavailableError,
not ready) until it restarts itself after `restart_delay_s`, at most `max_restarts` times.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tailguard.core.request import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    Priority,
    RequestKind,
)
from tailguard.core.stats import EngineStats, StepStats
from tailguard.errors import EngineUnavailableError

__all__ = ["SimulatedEngineClient", "StubEngineClient", "fake_embedding", "fake_token"]

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
    if req.kind == RequestKind.SCORE and req.top_k > 0:
        h = _digest(req.prompt_token_ids)
        out.top_logprobs = [(3 + h[i] % 250, -0.5 - i) for i in range(min(req.top_k, 16))]
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


@dataclass
class _Seq:
    req: EngineRequest
    out: asyncio.Queue[EngineOutput | BaseException]
    prefilled: int = 0  # prompt tokens processed
    generated: int = 0
    started_s: float | None = None
    first_token_s: float | None = None
    emitted: list[int] = field(default_factory=list)


class SimulatedEngineClient:
    """A timed scheduler without a model (see the module docstring)."""

    def __init__(
        self,
        *,
        tokens_per_s: float = 20_000.0,
        step_overhead_s: float = 0.002,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        max_restarts: int = 3,
        restart_delay_s: float = 0.2,
        warmup_s: float = 0.05,
    ) -> None:
        self.tokens_per_s = tokens_per_s
        self.step_overhead_s = step_overhead_s
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_restarts = max_restarts
        self.restart_delay_s = restart_delay_s
        self.warmup_s = warmup_s
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ready = False
        self._restarts = 0
        self._counters = EngineStats(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
        self._recent: list[StepStats] = []
        self.on_output: Callable[[EngineOutput], None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        # Stands in for the real engine's warm-up, which runs every bucket shape once: publish
        # one step per size so the server's cost model is calibrated before the first request.
        await asyncio.sleep(self.warmup_s)
        t = time.monotonic()
        for i, n in enumerate((16, 64, 256, self.max_num_batched_tokens)):
            step_s = self.step_overhead_s + n / self.tokens_per_s
            self._recent.append(
                StepStats(
                    t_s=t + i * 1e-6,
                    step_s=step_s,
                    num_seqs=1,
                    num_tokens=n,
                    padded_seqs=1,
                    padded_tokens=n,
                    num_prefill_tokens=n,
                    num_decode_tokens=0,
                )
            )
        self._ready = True
        self._counters.warmup_done = True
        self._task = asyncio.create_task(self._loop(), name="simulated-engine")

    async def close(self) -> None:
        self._ready = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all("engine stopped")

    def crash(self) -> None:
        """Behave like a dead engine process; restart after restart_delay_s (bounded)."""
        self._ready = False
        self._counters.warmup_done = False
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._fail_all("engine process died; the server is restarting it, retry shortly")
        if self._restarts < self.max_restarts:
            asyncio.get_running_loop().call_later(
                self.restart_delay_s, lambda: asyncio.ensure_future(self._restart())
            )

    async def _restart(self) -> None:
        self._restarts += 1
        await self.start()

    def _fail_all(self, why: str) -> None:
        for seq in self._by_id.values():
            seq.out.put_nowait(EngineUnavailableError(why))
        self._by_id.clear()
        self._waiting.clear()
        self._running.clear()

    # ---- protocol -----------------------------------------------------------------------------
    async def submit(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if not self._ready:
            raise EngineUnavailableError("engine is not ready (starting or restarting)")
        seq = _Seq(request, asyncio.Queue())
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                item = await seq.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if request.request_id in self._by_id:  # closed early: abort, like the real client
                self._remove(request.request_id)
                self._counters.aborted_total += 1

    async def run(self, request: EngineRequest) -> EngineOutput:
        async for out in self.submit(request):
            if out.finished:
                return out
        raise EngineUnavailableError("the simulated engine ended a request without an answer")

    async def abort(self, request_id: str) -> None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._remove(request_id)
            self._counters.aborted_total += 1
            self._emit(
                seq, EngineOutput(request_id, finished=True, finish_reason=FinishReason.ABORTED)
            )

    def _remove(self, request_id: str) -> None:
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return
        for lst in (self._waiting, self._running):
            if seq in lst:
                lst.remove(seq)

    @property
    def stats(self) -> EngineStats:
        s = self._counters
        s.t_s = time.monotonic()
        s.waiting = len(self._waiting)
        s.running = len(self._running)
        s.waiting_tokens = sum(
            len(q.req.prompt_token_ids) - q.prefilled for q in self._by_id.values()
        )
        s.recent_steps, self._recent = self._recent, []
        return s

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def restarts(self) -> int:
        return self._restarts

    # ---- the loop: schedule, execute (sleep), update ------------------------------------------
    async def _loop(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            now = time.monotonic()
            self._expire(now)
            plan = self._schedule()
            if not plan:
                await asyncio.sleep(0.001)
                continue
            tokens = sum(n for _, n in plan)
            await asyncio.sleep(self.step_overhead_s + tokens / self.tokens_per_s)
            # Report the wall time, like a real engine: a busy event loop makes steps longer.
            end = time.monotonic()
            self._update(plan, end, end - now)

    def _expire(self, now: float) -> None:
        for seq in [q for q in self._waiting if q.started_s is None and q.req.deadline_s < now]:
            self._remove(seq.req.request_id)
            self._counters.expired_total += 1
            self._emit(
                seq,
                EngineOutput(seq.req.request_id, finished=True, finish_reason=FinishReason.EXPIRED),
            )

    def _schedule(self) -> list[tuple[_Seq, int]]:
        """Decodes first (one token each), then prefill chunks, interactive before batch."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[_Seq, int]] = []
        for seq in self._running:
            if len(plan) < self.max_num_seqs and budget > 0:
                plan.append((seq, 1))
                budget -= 1
        self._waiting.sort(key=lambda q: (q.req.priority != Priority.INTERACTIVE, q.req.arrival_s))
        for seq in list(self._waiting):
            if len(plan) >= self.max_num_seqs or budget <= 0:
                break
            n = min(len(seq.req.prompt_token_ids) - seq.prefilled, budget)
            plan.append((seq, n))
            budget -= n
        return plan

    def _update(self, plan: list[tuple[_Seq, int]], now: float, step_s: float) -> None:
        prefill = 0
        for seq, n in plan:
            rid = seq.req.request_id
            if rid not in self._by_id:  # aborted during the step
                continue
            if seq.started_s is None:
                seq.started_s = now - step_s
            queue_s = seq.started_s - seq.req.arrival_s
            if seq in self._waiting:
                prefill += n
                seq.prefilled += n
                if seq.prefilled < len(seq.req.prompt_token_ids):
                    continue  # chunked prefill continues next step
                self._waiting.remove(seq)
                if seq.req.kind != RequestKind.GENERATE:
                    self._finish(seq, _single_pass_output(seq.req, queue_s, now - seq.started_s))
                    continue
                self._running.append(seq)
            tok = fake_token(seq.req.prompt_token_ids, seq.generated, seq.req.sampling.seed)
            seq.generated += 1
            if seq.first_token_s is None:
                seq.first_token_s = now
            sp = seq.req.sampling
            stop = tok in sp.stop_token_ids
            done = stop or seq.generated >= sp.max_tokens
            out = EngineOutput(
                request_id=rid,
                new_token_ids=[tok],
                finished=done,
                finish_reason=_reason(stop) if done else None,
                num_prompt_tokens=len(seq.req.prompt_token_ids),
                num_output_tokens=seq.generated,
                queue_s=queue_s,
                compute_s=now - seq.started_s,
                first_token_s=seq.first_token_s,
            )
            if done:
                self._running.remove(seq)
                self._finish(seq, out)
            else:
                self._emit(seq, out)
        tokens = sum(n for _, n in plan)
        c = self._counters
        c.steps_total += 1
        c.step_s_ewma = step_s if c.step_s_ewma == 0 else 0.8 * c.step_s_ewma + 0.2 * step_s
        rate = tokens / step_s
        c.tokens_per_s = rate if c.tokens_per_s == 0 else 0.8 * c.tokens_per_s + 0.2 * rate
        self._recent.append(
            StepStats(
                t_s=now,
                step_s=step_s,
                num_seqs=len(plan),
                num_tokens=tokens,
                padded_seqs=len(plan),
                padded_tokens=tokens,
                num_prefill_tokens=prefill,
                num_decode_tokens=tokens - prefill,
            )
        )
        if len(self._recent) > 1024:  # nobody is reading: keep memory bounded
            del self._recent[:512]

    def _finish(self, seq: _Seq, out: EngineOutput) -> None:
        self._by_id.pop(seq.req.request_id, None)
        self._counters.finished_total += 1
        self._emit(seq, out)

    def _emit(self, seq: _Seq, out: EngineOutput) -> None:
        seq.out.put_nowait(_hand_over(self.on_output, out))

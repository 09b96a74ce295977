"""The simulated engine is the real scheduler and block pool with a timed fake model."""

from __future__ import annotations

import asyncio

from tailguard.core.request import (
    EngineRequest,
    FinishReason,
    Priority,
    RequestKind,
    SamplingParams,
)
from tailguard.server.simulated import SimulatedEngineClient


def _gen(rid: str, prompt: int, max_tokens: int, **kw: object) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=tuple(range(10, 10 + prompt)),
        sampling=SamplingParams(max_tokens=max_tokens),
        **kw,  # type: ignore[arg-type]
    )


async def _collect(engine: SimulatedEngineClient, req: EngineRequest) -> tuple[int, FinishReason]:
    n, reason = 0, None
    async for out in engine.submit(req):
        n += len(out.new_token_ids)
        reason = out.finish_reason
    assert reason is not None
    return n, reason


async def test_a_small_kv_pool_preempts_and_both_finish() -> None:
    # 6 usable blocks of 16 tokens: two sequences of 40 prompt + 24 output tokens (4 blocks
    # each at full length) cannot both stay: the scheduler that ships preempts one
    engine = SimulatedEngineClient(
        tokens_per_s=1e6, step_overhead_s=0.0, num_kv_blocks=7, warmup_s=0.0
    )
    await engine.start()
    try:
        hi = _gen("hi", 40, 24, priority=Priority.INTERACTIVE)
        lo = _gen("lo", 40, 24, priority=Priority.BATCH)
        results = await asyncio.wait_for(
            asyncio.gather(_collect(engine, hi), _collect(engine, lo)), 10
        )
        assert results == [(24, FinishReason.LENGTH), (24, FinishReason.LENGTH)]
        s = engine.stats
        assert s.preemptions_total >= 1 and s.kv_blocks_used == 0 and s.finished_total == 2
    finally:
        await engine.close()


async def test_steps_cost_overhead_plus_tokens() -> None:
    engine = SimulatedEngineClient(tokens_per_s=10_000.0, step_overhead_s=0.005, warmup_s=0.0)
    await engine.start()
    try:
        assert len(engine.stats.recent_steps) == 4  # the warm-up steps, handed over once
        score = EngineRequest("q", tuple(range(3, 503)), kind=RequestKind.SCORE, top_k=2)
        out = await asyncio.wait_for(engine.run(score), 10)
        assert out.finish_reason == FinishReason.DONE and len(out.top_logprobs or []) == 2
        (step,) = engine.stats.recent_steps
        assert step.num_tokens == 500
        assert step.step_s >= 0.005 + 500 / 10_000.0  # a + b * tokens, at least
    finally:
        await engine.close()

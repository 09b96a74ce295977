"""EngineClient drives a real engine process over ZeroMQ: stream, abort, death and restart."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from tests.engine.conftest import tiny_engine_config

from tailguard.core.request import EngineRequest, FinishReason, RequestKind, SamplingParams
from tailguard.engine.client import EngineClient
from tailguard.errors import EngineUnavailableError


def req(rid: str, max_tokens: int = 6) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=(5, 6, 7, 8),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def score(rid: str) -> EngineRequest:
    return EngineRequest(
        request_id=rid, prompt_token_ids=(5, 6, 7, 8), kind=RequestKind.SCORE, top_k=3
    )


async def collect(client: EngineClient, r: EngineRequest) -> list[int]:
    toks: list[int] = []
    async for out in client.submit(r):
        toks.extend(out.new_token_ids)
        if out.finished:
            assert out.finish_reason == FinishReason.LENGTH
    return toks


async def test_client_streams_aborts_and_survives_engine_death(tiny_model_dir: Path) -> None:
    client = EngineClient(tiny_engine_config(tiny_model_dir, max_restarts=1, warmup=False))
    await client.start()
    try:
        assert client.ready and client.pid is not None
        results = await asyncio.gather(*(collect(client, req(f"r{i}")) for i in range(16)))
        assert all(len(t) == 6 for t in results)
        assert len({tuple(t) for t in results}) == 1  # same prompt, greedy: same tokens

        # single-pass requests through run(): one final output each, identical for one prompt
        outs = await asyncio.gather(*(client.run(score(f"s{i}")) for i in range(8)))
        assert all(o.finish_reason == FinishReason.DONE for o in outs)
        assert all(len(o.top_logprobs or []) == 3 for o in outs)
        assert len({tuple(o.top_logprobs or []) for o in outs}) == 1
        gone = asyncio.create_task(client.run(score("gone")))
        await asyncio.sleep(0)
        gone.cancel()  # cancelled before its answer: nothing is left waiting for it
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert len(client._router) == 0

        # abort mid-stream by closing the iterator: blocks go back to the pool
        it = client.submit(req("long", max_tokens=500))
        await it.__anext__()
        await it.aclose()
        for _ in range(50):
            await asyncio.sleep(0.05)
            if client.stats.kv_blocks_used == 0 and client.stats.aborted_total >= 1:
                break
        assert client.stats.aborted_total >= 1 and client.stats.kv_blocks_used == 0

        # kill the engine mid-request (its first token out: it is running, not just sent): the
        # request fails fast, then the engine comes back
        doomed = client.submit(req("doomed", max_tokens=1000))
        first = await asyncio.wait_for(doomed.__anext__(), 10)
        assert first.new_token_ids and not first.finished
        first_pid = client.pid
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)

        async def rest() -> None:
            async for out in doomed:
                assert not out.finished  # 1000 tokens: the kill comes first

        with pytest.raises(EngineUnavailableError, match="died"):
            await asyncio.wait_for(rest(), 10)
        for _ in range(600):
            if client.ready and client.pid != first_pid:
                break
            await asyncio.sleep(0.05)
        assert client.ready and client.restarts == 1
        assert len(await collect(client, req("after"))) == 6
    finally:
        await client.close()
    assert not client.ready


def test_stats_hand_each_step_record_over_once() -> None:
    import dataclasses

    from tailguard.core.stats import EngineStats, StepStats
    from tailguard.engine.client import KEEP_STEPS
    from tailguard.engine.config import EngineConfig

    def step(t: float) -> StepStats:
        return StepStats(
            t_s=t, step_s=0.01, num_seqs=1, num_tokens=8, padded_seqs=1, padded_tokens=16,
            num_prefill_tokens=8, num_decode_tokens=0,
        )  # fmt: skip

    client = EngineClient(dataclasses.replace(EngineConfig(), warmup=False))
    client._take_stats(EngineStats(steps_total=1, recent_steps=[step(1.0)]))
    client._take_stats(EngineStats(steps_total=3, recent_steps=[step(2.0), step(3.0)]))
    s = client.stats  # read less often than snapshots arrive: nothing lost
    assert s.steps_total == 3 and [x.t_s for x in s.recent_steps] == [1.0, 2.0, 3.0]
    assert client.stats.recent_steps == []  # and nothing handed over twice
    for i in range(KEEP_STEPS + 10):  # a reader that stops reading costs bounded memory
        client._take_stats(EngineStats(recent_steps=[step(10.0 + i)]))
    kept = client.stats.recent_steps
    assert len(kept) == KEEP_STEPS and kept[-1].t_s == 10.0 + KEEP_STEPS + 9

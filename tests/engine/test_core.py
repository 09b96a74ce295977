"""EngineCore with a real (tiny) model: continuous batching, fixed memory, OOM isolation."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tests.engine.conftest import tiny_engine_config

from tailguard.core.request import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    Pooling,
    RequestKind,
    SamplingParams,
)
from tailguard.engine.core import EngineCore
from tailguard.model.mistral import can_prepack


def gen(rid: str, prompt: list[int], max_tokens: int = 8, **kw: object) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw),  # type: ignore[arg-type]
    )


def drain(core: EngineCore, max_steps: int = 100_000) -> dict[str, list[EngineOutput]]:
    outs: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return outs
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not drain")


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_no_new_shapes(core: EngineCore, shapes_after_warmup: int) -> None:
    """The check the memory tests rely on: every op shape served was run by warm-up."""
    escaped = core.runner.shapes.after_warmup
    assert escaped == set(), f"op shapes not run by warm-up: {sorted(escaped, key=str)}"
    assert core.stats().distinct_shapes == shapes_after_warmup


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path) -> EngineCore:
    c = EngineCore(tiny_engine_config(tiny_model_dir), tiny_model_dir)
    c.warmup()
    return c


def test_batched_greedy_generation_matches_each_request_alone(core: EngineCore) -> None:
    rng = random.Random(0)
    prompts = {
        f"r{i}": [rng.randrange(3, 512) for _ in range(rng.randint(3, 300))] for i in range(12)
    }
    alone = {}
    for rid, p in prompts.items():
        core.add(gen(rid, p))
        alone[rid] = tokens(drain(core)[rid])
    for rid, p in prompts.items():
        core.add(gen(rid + "-batched", p))
    together = drain(core)
    for rid in prompts:
        assert tokens(together[rid + "-batched"]) == alone[rid]
        assert len(alone[rid]) == 8


def test_single_pass_queries_return_topk_and_embeddings(core: EngineCore) -> None:
    prompt = list(range(5, 305))  # longer than the 256-token budget: pooled across chunks
    core.add(
        EngineRequest(
            request_id="s",
            prompt_token_ids=tuple(prompt),
            kind=RequestKind.SCORE,
            top_k=5,
            want_embedding=True,
        )
    )
    core.add(
        EngineRequest(
            request_id="e",
            prompt_token_ids=tuple(prompt),
            kind=RequestKind.EMBED,
            pooling=Pooling.MEAN,
        )
    )
    outs = drain(core)
    (s,) = outs["s"]
    assert s.finish_reason == FinishReason.DONE and s.top_logprobs is not None
    assert len(s.top_logprobs) == 5
    logps = [lp for _, lp in s.top_logprobs]
    assert logps == sorted(logps, reverse=True) and all(lp <= 0 for lp in logps)
    (e,) = outs["e"]
    assert e.embedding is not None and len(e.embedding) == 64
    assert abs(sum(x * x for x in e.embedding) - 1.0) < 1e-4  # unit length
    assert e.embedding == pytest.approx(s.embedding, abs=1e-5)


def test_seeded_sampling_is_reproducible(core: EngineCore) -> None:
    for rid in ("a", "b"):
        core.add(gen(rid, [5, 6, 7], max_tokens=12, temperature=1.0, top_p=0.9, seed=42))
    outs = drain(core)
    assert tokens(outs["a"]) == tokens(outs["b"])


def test_oom_in_a_batch_of_64_fails_only_the_bad_request(tiny_model_dir: Path) -> None:
    core = EngineCore(
        tiny_engine_config(
            tiny_model_dir,
            max_num_seqs=64,
            seq_buckets=(1, 2, 4, 8, 16, 32, 64),
            max_num_batched_tokens=256,
            oom_test_hook="bad",
            warmup=False,
        ),
        tiny_model_dir,
    )
    core.warmup()
    ids = [f"ok{i}" for i in range(63)] + ["bad"]
    random.Random(1).shuffle(ids)
    for rid in ids:
        core.add(gen(rid, [3, 4, 5], max_tokens=2))
    outs = drain(core)
    finals = {rid: o[-1] for rid, o in outs.items()}
    bad = finals.pop("bad")
    assert bad.finish_reason == FinishReason.ERROR
    assert bad.error is not None and "out of memory even when run alone" in bad.error
    assert "MiB" in bad.error
    assert len(finals) == 63
    assert all(o.finish_reason == FinishReason.LENGTH for o in finals.values())
    stats = core.stats()
    assert stats.oom_retries_total >= 6  # 64 -> 32 -> ... -> 1 along the bad request's path
    assert stats.oom_failures_total == 1


def test_kv_pool_exhaustion_preempts_and_completes_everything(tiny_model_dir: Path) -> None:
    # 40 blocks of 16 tokens: 8 sequences of 100 + 40 tokens need 72 blocks at once
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    core = EngineCore(
        tiny_engine_config(
            tiny_model_dir, kv_cache_bytes=per_block * 40, max_model_len=512, warmup=False
        ),
        tiny_model_dir,
    )
    for i in range(8):
        core.add(gen(f"p{i}", list(range(3, 103)), max_tokens=40))
    outs = drain(core)
    assert core.stats().preemptions_total > 0
    assert all(len(tokens(o)) == 40 for o in outs.values()) and len(outs) == 8


def test_two_thousand_random_requests_allocate_nothing_after_warmup(micro_model_dir: Path) -> None:
    core = EngineCore(
        tiny_engine_config(micro_model_dir, kv_cache_bytes=32 * 1024 * 1024), micro_model_dir
    )
    core.warmup()
    before = core.stats()
    rng = random.Random(7)
    rss_start = before.allocator.rss_bytes
    done = 0
    for i in range(2000):
        n = rng.randint(4, 1000)
        kind = RequestKind.GENERATE if rng.random() < 0.5 else RequestKind.SCORE
        core.add(
            EngineRequest(
                request_id=str(i),
                prompt_token_ids=tuple(rng.randrange(3, 512) for _ in range(n)),
                kind=kind,
                top_k=3,
                sampling=SamplingParams(max_tokens=rng.randint(0, 64), ignore_eos=True),
            )
        )
        if i % 100 == 99:  # arrivals keep coming while it serves
            for _ in range(20):
                done += sum(o.finished for o in core.step())
    done += sum(o[-1].finished for o in drain(core).values())
    after = core.stats()
    assert done == 2000 and after.finished_total - before.finished_total == 2000
    assert after.kv_allocations_total == before.kv_allocations_total
    assert_no_new_shapes(core, before.distinct_shapes)
    assert after.kv_blocks_used == 0
    assert after.allocator.rss_bytes - rss_start < 50 * 2**20


def test_expired_request_is_never_executed(core: EngineCore) -> None:
    import time

    core.add(
        EngineRequest(
            request_id="late", prompt_token_ids=(3, 4, 5), deadline_s=time.monotonic() - 1
        )
    )
    (o,) = drain(core)["late"]
    assert o.finish_reason == FinishReason.EXPIRED and o.num_output_tokens == 0


def test_abort_mid_generation_returns_blocks(core: EngineCore) -> None:
    core.add(gen("long", list(range(3, 200)), max_tokens=100))
    core.step()
    core.step()
    assert core.stats().kv_blocks_used > 0
    out = core.abort("long")
    assert out is not None and out.finish_reason == FinishReason.ABORTED
    assert core.stats().kv_blocks_used == 0 and not core.has_work()


def test_an_escaped_attention_shape_fails_the_no_new_shape_check(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Serve with block tables left unpadded (as if a dimension escaped its bucket): the
    check that the 2,000-request test relies on must fail, naming the shape."""
    import tailguard.engine.plan as plan_mod

    core = EngineCore(tiny_engine_config(tiny_model_dir), tiny_model_dir)
    core.warmup()
    warm = core.stats().distinct_shapes
    padded = plan_mod.group_shape

    def unpadded_blocks(n: int, q: int, blocks: int, *ladders: tuple[int, ...]) -> tuple:
        key = padded(n, q, blocks, *ladders)
        return (*key[:3], blocks)

    monkeypatch.setattr(plan_mod, "group_shape", unpadded_blocks)  # the steps' layout
    core.add(gen("x", list(range(3, 73)), max_tokens=2))  # 70 + 2 tokens: 5 blocks, not 4 or 6
    drain(core)
    assert core.runner.shapes.after_warmup == {("attn", 1, 128, 5), ("attn", 1, 1, 5)}
    with pytest.raises(AssertionError, match=r"\('attn', 1, 128, 5\)"):
        assert_no_new_shapes(core, warm)


def test_prepacked_and_plain_weights_generate_the_same_tokens(tiny_model_dir: Path) -> None:
    """oneDNN-packed weights (the default on CPU) against plain F.linear, greedy, fp32 and bf16:
    token-identical, and the packed path really ran (no plain weight left)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 120))] for _ in range(6)]
    for dtype in ("float32", "bfloat16"):
        got = {}
        for packed in (True, False):
            c = EngineCore(
                tiny_engine_config(
                    tiny_model_dir,
                    dtype=dtype,
                    prepack_weights=packed,
                    small_m_kernel=False,  # oneDNN packing alone (the kernel: model tests)
                    warmup=False,
                ),
                tiny_model_dir,
            )
            # the plain head was dropped where packing applies (bf16 needs oneDNN bf16 support)
            applies = packed and can_prepack(c.runner.dtype, "cpu")
            assert (c.runner.model.lm_head is None) == applies
            for i, p in enumerate(prompts):
                c.add(gen(f"r{i}", p, max_tokens=12))
            got[packed] = {rid: tokens(o) for rid, o in drain(c).items()}
        assert got[True] == got[False], dtype

"""Decode steps run on as many rows as they have sequences (rounded to a power of two), not on
a 16-row floor: with the default token buckets a batch-8 decode pads to 8 tokens, its outputs
equal the 16-row floor's, and no op shape escapes warm-up."""

from __future__ import annotations

from pathlib import Path

from tests.engine.conftest import tiny_engine_config
from tests.engine.test_core import assert_no_new_shapes, drain, gen

from tailguard.engine.buckets import bucket_for
from tailguard.engine.config import EngineConfig
from tailguard.engine.core import EngineCore


def run(model_dir: Path, token_buckets: tuple[int, ...]) -> tuple[dict[str, list[int]], set[int]]:
    core = EngineCore(tiny_engine_config(model_dir, token_buckets=token_buckets), model_dir)
    core.warmup()
    warm = core.stats().distinct_shapes
    for i in range(8):  # 8 prompts of different lengths; the last finishes 3 steps later
        core.add(gen(f"r{i}", [3 + i + j for j in range(5 + 3 * i)], max_tokens=4 + (i == 7) * 3))
    padded: set[int] = set()
    outs: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        n = core.log.take()[-1]
        if n.num_prefill_tokens == 0:  # a pure decode step
            padded.add(n.padded_tokens)
            assert n.padded_tokens == bucket_for(token_buckets, n.num_seqs)
    assert_no_new_shapes(core, warm)
    assert drain(core) == {}
    return outs, padded


def test_default_token_buckets_reach_down_to_one_row() -> None:
    assert EngineConfig().token_buckets[:4] == (1, 2, 4, 8)


def test_decode_pads_to_the_batch_not_to_16_rows_and_tokens_are_unchanged(
    tiny_model_dir: Path,
) -> None:
    small, padded = run(tiny_model_dir, EngineConfig().token_buckets)
    assert 8 in padded and 1 in padded  # batch-8 decodes on 8 rows, the last one alone on 1
    floor16, padded16 = run(tiny_model_dir, (16, 32, 64, 128, 256))
    assert padded16 == {16}
    assert small == floor16
    assert all(len(v) in (4, 7) for v in small.values())


def test_prefill_chunks_attend_in_groups_of_one_query_bucket(tiny_model_dir: Path) -> None:
    """Four 3-token prompts beside a 200-token one: two groups, 4 x 16 and 1 x 256 queries,
    not one group of 8 x 256; the same tokens as each prompt served alone."""

    def serve(prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], set[object]]:
        core = EngineCore(tiny_engine_config(tiny_model_dir), tiny_model_dir)
        for rid, p in prompts.items():
            core.add(gen(rid, p, max_tokens=3))
        before = set(core.runner.shapes.seen)
        outs: dict[str, list[int]] = {}
        first = True
        while core.has_work():
            for o in core.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if first:
                assert core.log.take()[-1].num_prefill_tokens == sum(map(len, prompts.values()))
                first_groups = {k for k in core.runner.shapes.seen - before if k[0] == "attn"}
                first = False
        return outs, first_groups

    prompts = {f"s{i}": [5 + i, 6, 7] for i in range(4)} | {"long": list(range(3, 203))}
    together, groups = serve(prompts)
    assert groups == {("attn", 4, 16, 4), ("attn", 1, 256, 16)}
    for rid, p in prompts.items():
        assert serve({rid: p})[0][rid] == together[rid], rid

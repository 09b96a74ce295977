"""CUDA allocator figures (recorded stats dict, tested on CPU) and shape buckets."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator

import pytest
import torch

from tailguard.engine.allocator import (
    CUDA_ALLOC_CONF,
    allocator_stats,
    configure_cuda_allocator,
    from_memory_stats,
)
from tailguard.engine.buckets import (
    ShapeTracker,
    attention_shapes,
    block_ladder,
    bucket_for,
    group_shape,
    pad_query,
    query_floor,
    spread,
    step_keys,
)
from tailguard.engine.config import EngineConfig
from tailguard.errors import ConfigError

# Recorded from torch.cuda.memory_stats() on a fragmented device (values as PyTorch reports them).
RECORDED_CUDA_STATS = {
    "reserved_bytes.all.current": 12_884_901_888,
    "allocated_bytes.all.current": 9_663_676_416,
    "inactive_split_bytes.all.current": 1_610_612_736,
    "num_alloc_retries": 17,
    "num_ooms": 2,
    "num_device_alloc": 311,
    "active_bytes.all.current": 9_663_676_416,
}


def test_cuda_memory_stats_translate_to_engine_stats() -> None:
    a = from_memory_stats(RECORDED_CUDA_STATS, rss_bytes=123, device="cuda:0")
    assert (a.device, a.reserved_bytes, a.allocated_bytes) == (
        "cuda:0",
        12_884_901_888,
        9_663_676_416,
    )
    assert a.reserved_bytes - a.allocated_bytes == 3_221_225_472  # the fragmentation gap
    assert (a.inactive_split_bytes, a.num_alloc_retries, a.num_ooms) == (1_610_612_736, 17, 2)
    assert a.num_device_alloc == 311 and a.rss_bytes == 123


def test_missing_keys_read_as_zero_and_cpu_reports_rss() -> None:
    assert from_memory_stats({}, rss_bytes=5).num_alloc_retries == 0
    cpu = allocator_stats(torch.device("cpu"), rss_bytes=42)
    assert cpu.device == "cpu" and cpu.rss_bytes == 42 and cpu.reserved_bytes == 0


def test_allocator_config_is_the_variable_pytorch_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CUDA_ALLOC_CONF == "expandable_segments:True"  # not max_split_size_mb: never both
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("TORCH_CUDA_ALLOC_CONF", raising=False)
    configure_cuda_allocator()
    # PyTorch reads PYTORCH_CUDA_ALLOC_CONF; the runbook's TORCH_CUDA_ALLOC_CONF is ignored by it
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_ALLOC_CONF
    assert "TORCH_CUDA_ALLOC_CONF" not in os.environ
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    configure_cuda_allocator()  # an operator's own setting wins
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:native"


def test_bucket_for_picks_the_smallest_bucket_that_fits() -> None:
    assert [bucket_for((16, 32, 64), n) for n in (1, 16, 17, 64)] == [16, 16, 32, 64]
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        bucket_for((16, 32), 33)


def test_block_ladder_pads_contexts_by_at_most_one_and_a_half() -> None:
    assert block_ladder(128) == (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
    assert block_ladder(129)[-1] == 192 and block_ladder(1) == (4,)
    ladder = block_ladder(256)
    assert max(bucket_for(ladder, n) / n for n in range(4, 257)) <= 1.5


def test_group_shape_pads_each_attention_dimension() -> None:
    ladder = block_ladder(128)
    assert group_shape(5, 1, 9, ladder) == ("attn", 8, 1, 12)  # decodes: Q stays 1
    assert group_shape(1, 2, 1, ladder) == ("attn", 1, 16, 4)
    assert group_shape(3, 100, 33, ladder) == ("attn", 4, 128, 48)


def _feasible_groups(
    rng: random.Random, seqs: int, budget: int, bs: int, tries: int = 20_000
) -> Iterator[tuple[int, int, int]]:
    """(sequences, longest chunk, longest block table) of random groups that fit the budgets
    (the scheduler's only constraints on a group), 2,048-token contexts at most: decodes, or
    prefill chunks of one query bucket (the runner groups them so)."""
    qs = [16]
    while qs[-1] < budget:
        qs.append(2 * qs[-1])
    for _ in range(tries):
        if rng.random() < 0.3:
            news = [1] * rng.randint(1, seqs)
        else:
            q = rng.choice(qs)
            least = query_floor(q)
            n = rng.randint(1, min(seqs, budget // least))
            news = [rng.randint(least, q) for _ in range(n)]
            assert {pad_query(x) for x in news} == {q}
        n = len(news)
        if sum(news) > budget:
            continue
        tables = [rng.randint(-(-new // bs), 2048 // bs) for new in news]
        yield n, max(news), max(tables)


def test_attention_shapes_cover_every_group_the_budgets_allow() -> None:
    """Random groups that fit the budgets (the scheduler's only constraints on a group): each
    one's padded shape is in the warm-up set; and the set is not everything (it is pruned)."""
    seqs, budget, bs = 32, 256, 16
    ladder = block_ladder(2048 // bs)
    shapes = set(attention_shapes(seqs, budget, bs, ladder))
    for n, max_new, max_table in _feasible_groups(random.Random(3), seqs, budget, bs):
        assert group_shape(n, max_new, max_table, ladder) in shapes
    assert ("attn", 32, 256, 4) not in shapes  # 17+ sequences of 129+ tokens: over budget
    assert ("attn", 4, 256, 12) not in shapes  # 3+ chunks of 129+ tokens: over budget
    assert ("attn", 32, 16, 4) in shapes  # 17+ chunks of 2-16 tokens


def test_groups_pad_to_the_sequence_buckets_and_every_budgeted_group_is_covered() -> None:
    """With the engine's sequence buckets as the group ladder, a 65-sequence decode attends as
    72, not 128; random groups that fit the budgets are all in the warm-up set."""
    groups = EngineConfig().seq_buckets
    ladder = block_ladder(2048 // 16)
    assert group_shape(65, 1, 4, ladder, groups) == ("attn", 72, 1, 4)
    assert group_shape(65, 1, 4, ladder) == ("attn", 128, 1, 4)
    seqs, budget, bs = 96, 512, 16
    shapes = set(attention_shapes(seqs, budget, bs, ladder, groups))
    assert {k[1] for k in shapes} == {g for g in groups if g <= 96}
    for n, max_new, max_table in _feasible_groups(random.Random(5), seqs, budget, bs):
        assert group_shape(n, max_new, max_table, ladder, groups) in shapes


def test_spread_takes_a_geometric_subset_with_both_ends() -> None:
    buckets = EngineConfig().token_buckets
    picked = spread(buckets)
    assert picked[0] == buckets[0] and picked[-1] == buckets[-1]
    assert set(picked) <= set(buckets)
    assert all(b >= 1.5 * a for a, b in itertools.pairwise(picked[:-1]))
    assert len(picked) < len(buckets) // 2
    assert spread((4,)) == [4] and spread((4, 5)) == [4, 5]


def test_default_buckets_pad_by_at_most_an_eighth_from_32() -> None:
    c = EngineConfig()
    for buckets, top in ((c.seq_buckets, 256), (c.token_buckets, 1024)):
        assert max(bucket_for(buckets, n) / n for n in range(32, top + 1)) <= 1.25
        assert max(bucket_for(buckets, n) / n for n in range(64, top + 1)) <= 1.125


def test_shape_tracker_reports_op_shapes_new_after_warmup() -> None:
    t = ShapeTracker()
    t.record(step_keys(16, 1, [("attn", 1, 16, 4)]))
    t.mark_warm()
    t.record(step_keys(16, 1, [("attn", 1, 16, 4)]))
    assert t.after_warmup == set()
    t.record(step_keys(16, 0, [("attn", 1, 16, 5)]))  # only the attention dims differ
    assert t.after_warmup == {("attn", 1, 16, 5)}
    assert t.seen == {("tokens", 16), ("logits", 1), ("attn", 1, 16, 4), ("attn", 1, 16, 5)}


def test_config_refuses_clashing_values_naming_both() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs=512"):
        EngineConfig(max_num_seqs=512)
    with pytest.raises(ConfigError, match="max_num_batched_tokens=8 < max_num_seqs"):
        EngineConfig(max_num_batched_tokens=8, max_num_seqs=16, seq_buckets=(16,))

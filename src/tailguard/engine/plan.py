"""A scheduled step laid out as one padded forward pass (`StepPlan`): token ids, positions and
KV slots padded to the token bucket, the sequences grouped for attention by query bucket, each
group padded to its (G, Q, B) buckets, and the full shape key every op of the step runs
(engine/buckets.py). The runner builds one per step; tests build them from hand-made
`ScheduledSeq`s."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tailguard.core.request import RequestKind
from tailguard.core.scheduler import ScheduledSeq
from tailguard.engine.buckets import ShapeKey, bucket_for, group_shape, pad_query, step_keys
from tailguard.engine.config import EngineConfig
from tailguard.model.batch import NULL_BLOCK, AttnGroup, ForwardBatch

__all__ = ["StepPlan", "greedy_only"]


@dataclass(frozen=True)
class StepPlan:
    """A scheduled step laid out as one padded forward pass."""

    batch: ForwardBatch
    shape: tuple[int, int]  # (sequence bucket, token bucket)
    keys: list[ShapeKey]  # every op shape this step runs (engine/buckets.py)
    last_index: torch.Tensor  # [S_bucket] flat index of each sequence's last new token
    spans: list[tuple[int, int]]  # flat [begin, end) of each item's tokens
    needs_logits: bool

    @staticmethod
    def build(
        items: list[ScheduledSeq],
        config: EngineConfig,
        ladder: tuple[int, ...],
        device: torch.device,
    ) -> StepPlan:
        bs = config.block_size
        num_tokens = sum(i.num_new for i in items)
        s_bucket = bucket_for(config.seq_buckets, len(items))
        t_bucket = bucket_for(config.token_buckets, num_tokens)
        input_ids = [0] * t_bucket
        positions = [0] * t_bucket
        slots = [NULL_BLOCK * bs] * t_bucket
        spans: list[tuple[int, int]] = []
        flat = 0
        for item in items:
            seq = item.seq
            end = item.start + item.num_new
            input_ids[flat : flat + item.num_new] = seq.token_ids[item.start : end]
            positions[flat : flat + item.num_new] = range(item.start, end)
            table = seq.block_table
            slots[flat : flat + item.num_new] = [
                table[p // bs] * bs + p % bs for p in range(item.start, end)
            ]
            spans.append((flat, flat + item.num_new))
            flat += item.num_new
        built = [
            _group(items, spans, idx, t_bucket, ladder, config.seq_buckets, device)
            for idx in _by_query_bucket(items)
        ]
        groups = tuple(g for g, _ in built)
        last = [e - 1 for _, e in spans] + [t_bucket - 1] * (s_bucket - len(items))
        needs_logits = any(
            it.completes and (it.seq.request.kind != RequestKind.EMBED) for it in items
        )
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            groups=groups,
        )
        return StepPlan(
            batch,
            (s_bucket, t_bucket),
            step_keys(t_bucket, s_bucket if needs_logits else 0, [k for _, k in built]),
            torch.tensor(last, dtype=torch.long, device=device),
            spans,
            needs_logits,
        )


def greedy_only(items: list[ScheduledSeq]) -> bool:
    """Every item takes its next token by argmax this step and wants nothing else from it
    (no sampling, embedding or scores): the step's result is its token ids alone."""
    return all(
        it.completes
        and it.seq.request.kind == RequestKind.GENERATE
        and not it.seq.is_single_pass
        and it.seq.request.sampling.temperature <= 0
        and not it.seq.request.want_embedding
        for it in items
    )


def _by_query_bucket(items: list[ScheduledSeq]) -> list[list[int]]:
    """Item indices grouped for attention: the decodes, then the prefill chunks of each query
    bucket (`pad_query`). One group for every prefill padded all chunks to the longest: one
    513-token chunk beside 255 two-token ones attended as 256 x 1024 queries; by bucket each
    chunk pads by under 2x."""
    by_q: dict[int, list[int]] = {}
    for i, it in enumerate(items):
        by_q.setdefault(pad_query(it.num_new), []).append(i)
    return [by_q[q] for q in sorted(by_q)]


def _group(
    items: list[ScheduledSeq],
    spans: list[tuple[int, int]],
    idx: list[int],
    pad_token: int,
    ladder: tuple[int, ...],
    groups: tuple[int, ...],
    device: torch.device,
) -> tuple[AttnGroup, ShapeKey]:
    """Sequences idx in a padded [G, Q] query layout with [G, B] block tables; G, Q and B are
    buckets (engine/buckets.py), so the group's shape is one warm-up ran."""
    key = group_shape(
        len(idx),
        max(items[i].num_new for i in idx),
        max(len(items[i].seq.block_table) for i in idx),
        ladder,
        groups,
    )
    _, g, q, nblocks = key
    assert isinstance(g, int) and isinstance(q, int) and isinstance(nblocks, int)
    token_index = [[pad_token] * q for _ in range(g)]
    tables = [[NULL_BLOCK] * nblocks for _ in range(g)]
    ctx = [1] * g  # padding rows see key 0 of the null block: finite, never NaN
    qstart = [0] * g
    for row, i in enumerate(idx):
        it = items[i]
        b, e = spans[i]
        token_index[row][: e - b] = range(b, e)
        bt = it.seq.block_table
        tables[row][: len(bt)] = bt
        ctx[row] = it.start + it.num_new
        qstart[row] = it.start
    group = AttnGroup(
        token_index=torch.tensor(token_index, dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.long, device=device),
        query_start=torch.tensor(qstart, dtype=torch.long, device=device),
        from_start=all(items[i].start == 0 for i in idx),
    )
    return group, key

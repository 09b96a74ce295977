"""Shape buckets: every dimension a forward pass depends on is padded to a small fixed set.

A step's shape is decomposed into the shapes of the ops that see it, and each is bucketed:

    ("tokens", T)         every dense op (embedding, projections, MLP, norms): T flat tokens,
                          a token bucket
    ("logits", S)         the output head over S rows: a sequence bucket
    ("attn", G, Q, B)     one attention group: G sequences (a sequence bucket), Q queries each
                          (1 for decodes, else a power of two >= 16: prefill chunks are grouped by
                          this bucket, so padding stays under 2x), B blocks of context each
                          (a `block_ladder` step: 4, 6, 8, 12, 16, 24, ...; at most 1.5x padding)

`attention_shapes` enumerates every attention shape the scheduler's budgets can produce. On
CUDA warm-up runs each once, so the caching allocator has served every size before the first
request (and the decode ones are what a CUDA-graph capture per bucket records); on CPU, where
no caching allocator exists and the 648 shapes of a 1024-token budget cost minutes on a 246M
model, they are declared instead (`ShapeTracker.allow`). `ShapeTracker` records the full key
of every executed op and reports any outside what warm-up ran or declared: such an escape
fails the engine's tests.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

QUERY_MIN = 16  # prefill chunks pad to at least this many queries (decodes: exactly 1)
BLOCKS_MIN = 4  # contexts pad to at least this many blocks

ShapeKey = tuple[str | int, ...]  # ("tokens", T) | ("logits", S) | ("attn", G, Q, B)


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """Smallest bucket >= n."""
    i = bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def pow2_at_least(n: int, floor: int = 1) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def block_ladder(max_blocks: int) -> tuple[int, ...]:
    """4, 6, 8, 12, 16, 24, ... up to the first step >= max_blocks: powers of two and 1.5x
    powers of two. Contexts are the dimension that grows longest, so padding there is kept
    under 1.5x (a power-of-two ladder would gather up to 2x the keys in every layer)."""
    out = [BLOCKS_MIN]
    while out[-1] < max_blocks:
        p = out[-1]
        out.append(p * 3 // 2 if p & (p - 1) == 0 else p * 4 // 3)
    return tuple(out)


def pad_query(n: int) -> int:
    return 1 if n == 1 else pow2_at_least(n, QUERY_MIN)


def group_shape(
    num_seqs: int,
    max_new: int,
    max_blocks: int,
    ladder: Sequence[int],
    groups: Sequence[int] | None = None,
) -> ShapeKey:
    """The padded ("attn", G, Q, B) of a group of `num_seqs` sequences whose longest chunk has
    `max_new` tokens and longest block table `max_blocks` entries; G is the smallest of
    `groups` (the engine's sequence buckets; None: powers of two) that holds them."""
    g = pow2_at_least(num_seqs) if groups is None else bucket_for(groups, num_seqs)
    return ("attn", g, pad_query(max_new), bucket_for(ladder, max_blocks))


def _previous(values: Sequence[int], v: int) -> int:
    i = values.index(v)
    return values[i - 1] if i else 0


def query_floor(q: int) -> int:
    """The fewest new tokens a prefill chunk in query bucket q has: 2 in the first bucket,
    else one more than the bucket below (the engine groups prefill chunks by query bucket)."""
    return 2 if q == QUERY_MIN else q // 2 + 1


def attention_shapes(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    ladder: Sequence[int],
    groups: Sequence[int] | None = None,
) -> list[ShapeKey]:
    """Every attention group shape the scheduler can produce under these budgets, with G from
    `groups` as in `group_shape`.

    Decodes: any G up to the sequence budget, any B. Prefill chunks are grouped by their query
    bucket (`pad_query`), so a group padded to (G, Q) holds more sequences than the G below it,
    each with at least `query_floor(Q)` new tokens; it fits the token budget, and its longest
    table holds a chunk of that many.
    """
    if groups is None:
        gs = [1]
        while gs[-1] < max_num_seqs:
            gs.append(gs[-1] * 2)
    else:
        gs = [g for g in groups if g <= bucket_for(groups, max_num_seqs)]
    qs = [QUERY_MIN]
    while qs[-1] < max_num_batched_tokens:
        qs.append(qs[-1] * 2)
    shapes: list[ShapeKey] = [("attn", g, 1, b) for g in gs for b in ladder]
    for q in qs:
        least = query_floor(q)
        for below, g in zip([0, *gs], gs, strict=False):
            min_seqs = below + 1
            if min_seqs > max_num_seqs or min_seqs * least > max_num_batched_tokens:
                continue
            min_blocks = -(-least // block_size)
            shapes.extend(("attn", g, q, b) for b in ladder if b >= min_blocks or b == ladder[-1])
    return shapes


def spread(buckets: Sequence[int], ratio: float = 1.5) -> list[int]:
    """A geometric subset of `buckets`: the first, each next one at least `ratio` times the
    last taken, and the last. Warm-up on CPU times only these (the step-cost fit needs a few
    points, not every bucket) and declares the rest."""
    out = [buckets[0]]
    for b in buckets[1:-1]:
        if b >= ratio * out[-1]:
            out.append(b)
    if buckets[-1] != out[-1]:
        out.append(buckets[-1])
    return out


def step_keys(tokens: int, logits: int, groups: Iterable[ShapeKey]) -> list[ShapeKey]:
    """The op shapes of one step: its token bucket, its logits rows (0: no head), its groups."""
    keys: list[ShapeKey] = [("tokens", tokens)]
    if logits:
        keys.append(("logits", logits))
    keys.extend(groups)
    return keys


@dataclass
class ShapeTracker:
    """Records every executed op shape; after `mark_warm`, new ones are escapes."""

    def __post_init__(self) -> None:
        self.seen: set[ShapeKey] = set()  # executed
        self.allowed: set[ShapeKey] = set()  # declared by the bucket enumeration, not run
        self.after_warmup: set[ShapeKey] = set()  # escapes: executed after warm-up, undeclared
        self.warm = False

    def allow(self, keys: Iterable[ShapeKey]) -> None:
        self.allowed.update(keys)

    def record(self, keys: Iterable[ShapeKey]) -> None:
        for key in keys:
            if key not in self.seen:
                self.seen.add(key)
                if self.warm and key not in self.allowed:
                    self.after_warmup.add(key)

    @property
    def known(self) -> int:
        """Distinct op shapes warm-up ran or declared, plus escapes: constant while serving
        unless a shape escapes."""
        return len(self.seen | self.allowed)

    def mark_warm(self) -> None:
        self.warm = True

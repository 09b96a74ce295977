"""Shape buckets: every forward pass is padded to one of a few (sequences, tokens) shapes.

After warm-up the allocator (CUDA's caching allocator, or the CPU allocator) has seen every
shape the engine will ever run, so serving never asks it for a block size it has not cached.
The same fixed set is what a CUDA-graph capture would record.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """Smallest bucket >= n."""
    i = bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def pow2_at_least(n: int, floor: int = 1) -> int:
    """Inner attention dimensions (query chunk, blocks per sequence) pad to powers of two."""
    p = floor
    while p < n:
        p *= 2
    return p


def warmup_shapes(
    seq_buckets: Sequence[int], token_buckets: Sequence[int]
) -> list[tuple[int, int]]:
    """Every (sequences, tokens) pair the scheduler can produce: at least one token per sequence,
    and a token count that needs this many sequences' worth of padding at most."""
    return [(s, t) for s in seq_buckets for t in token_buckets if s <= t]


class ShapeTracker:
    """Counts distinct executed forward shapes; after warm-up the count must not grow."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()
        self.after_warmup: set[tuple[int, int]] = set()
        self.warm = False

    def record(self, shape: tuple[int, int]) -> None:
        if shape not in self.seen:
            self.seen.add(shape)
            if self.warm:
                self.after_warmup.add(shape)

    def mark_warm(self) -> None:
        self.warm = True

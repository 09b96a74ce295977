"""The KV-cache block pool: fixed-size blocks, counted once at start-up, never grown.

The pool only hands out block ids; the tensors behind them are allocated once by the model
runner. It answers "does it fit?" before committing: `allocate` returns None when it does not,
and the caller decides (wait, preempt, reject).
"""

from __future__ import annotations

from collections import deque

NULL_BLOCK = 0  # reserved: padding writes land here (see tailguard.model.batch)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is reserved)")
        self.num_blocks = num_blocks  # including the reserved null block
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None if the pool does not have them (nothing is taken then)."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

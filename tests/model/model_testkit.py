"""Model test kit: tiny seeded checkpoints and a hand-driven paged KV cache.

A plain module (not conftest) so tests can import it by a name no other test folder uses.

`PagedCache` plays the runner's part in miniature: it hands out blocks (block 0 reserved),
tracks each sequence's length and builds ForwardBatch/AttnGroup exactly as batch.py describes,
including padding tokens, padded query rows, padded table columns and fully padded group rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import pytest
import torch

from tailguard.model.batch import NULL_BLOCK, AttnGroup, ForwardBatch
from tailguard.model.config import MistralConfig
from tailguard.model.embedded import write_checkpoint
from tailguard.model.mistral import MistralModel, allocate_kv_cache

# Tiny but complete: GQA (4 query heads share 2 KV heads), head_dim != hidden/heads is not
# exercised by HF defaults so set it explicitly, a sliding window well below the 40-token
# sequences the tests run, an odd vocabulary.
TINY = MistralConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    sliding_window=16,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# Larger-than-HF init std: with 0.02 a 2-layer toy model's logits are nearly flat and greedy
# decoding would hinge on 1e-6 ties; 0.2 separates them by orders of magnitude more.
TINY_STD = 0.2


def make_checkpoint(folder: Path, config: MistralConfig = TINY, seed: int = 7) -> Path:
    write_checkpoint(folder, config, seed=seed, init_std=TINY_STD, tokenizer=False)
    return folder


def hf_model(folder: Path) -> torch.nn.Module:
    from transformers import MistralForCausalLM

    # eager attention: the plainest reference implementation of the mask.
    model = MistralForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


class PagedCache:
    """A miniature runner: block allocation, slot mapping and batch building by hand."""

    def __init__(
        self,
        config: MistralConfig,
        num_blocks: int = 64,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.block_size = block_size
        self.kv = allocate_kv_cache(config, num_blocks, block_size, dtype, "cpu")
        self.free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() from the low end
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slots(self, seq: int, n_new: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        start = self.lens.get(seq, 0)
        slots = []
        for pos in range(start, start + n_new):
            if pos // self.block_size >= len(table):
                table.append(self.free.pop())
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        self.lens[seq] = start + n_new
        return slots

    def batch(
        self,
        groups: list[list[tuple[int, list[int]]]],  # per group: (sequence id, new token ids)
        pad_tokens: int = 0,  # flat padding tokens at the tail (bucket padding)
        pad_rows: int = 0,  # fully padded sequence rows added to every group
        pad_queries: int = 0,  # extra padded query columns per group
        pad_blocks: int = 0,  # extra NULL_BLOCK columns in every block table
    ) -> tuple[ForwardBatch, list[list[int]]]:
        """Build one step; returns the batch and, per group, the flat index of each sequence's
        last new token (where the runner would sample)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        placed: list[list[tuple[int, list[int]]]] = []  # per group: (seq, flat indices)
        for group in groups:
            rows = []
            for seq, new in group:
                start = self.lens.get(seq, 0)
                flat = list(range(len(ids), len(ids) + len(new)))
                slots += self._slots(seq, len(new))
                ids += new
                positions += range(start, start + len(new))
                rows.append((seq, flat))
            placed.append(rows)
        n_real = len(ids)
        num_tokens = n_real + pad_tokens
        ids += [0] * pad_tokens
        positions += [0] * pad_tokens
        slots += [NULL_BLOCK * self.block_size + i % self.block_size for i in range(pad_tokens)]

        attn_groups = []
        for rows in placed:
            q = max(len(flat) for _, flat in rows) + pad_queries
            b = max(len(self.tables[seq]) for seq, _ in rows) + pad_blocks
            index = [flat + [num_tokens] * (q - len(flat)) for _, flat in rows]
            tables = [self.tables[s] + [NULL_BLOCK] * (b - len(self.tables[s])) for s, _ in rows]
            ctx = [self.lens[s] for s, _ in rows]
            start = [self.lens[s] - len(flat) for s, flat in rows]
            for _ in range(pad_rows):
                index.append([num_tokens] * q)
                tables.append([NULL_BLOCK] * b)
                ctx.append(1)
                start.append(0)
            attn_groups.append(
                AttnGroup(
                    token_index=torch.tensor(index),
                    block_tables=torch.tensor(tables),
                    context_lens=torch.tensor(ctx),
                    query_start=torch.tensor(start),
                    from_start=all(s == 0 for s in start),  # as the runner sets it
                )
            )
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            groups=tuple(attn_groups),
        )
        last = [[flat[-1] for _, flat in rows] for rows in placed]
        return batch, last

    def run(
        self, model: MistralModel, groups: list[list[tuple[int, list[int]]]], **pad: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """One forward; returns (hidden [T, H], logits [T, V], last-token flat indices)."""
        batch, last = self.batch(groups, **pad)
        with torch.inference_mode():
            hidden = model(batch, self.kv)
            return hidden, model.compute_logits(hidden), last


T = TypeVar("T")


def built_or_skip(kernel: T | None, why: str | None, what: str) -> T:
    """A compiled kernel for a test: a skip only where this machine has no C compiler or the
    CPU lacks the instructions; a kernel that builds but fails its self-check is a failure,
    so a broken kernel never turns its tests into skips."""
    if kernel is not None:
        return kernel
    reason = why or "?"
    if "no C compiler" in reason or "this CPU has no" in reason:
        pytest.skip(f"{what} unavailable here: {reason}")
    pytest.fail(f"{what} unavailable: {reason}")

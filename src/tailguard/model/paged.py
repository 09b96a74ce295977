"""The paged KV cache's tensors and the masks attention reads them with: one (k, v) pair of
[num_blocks, block_size, nkv, hd] per layer, allocated once; a group's additive mask over its
gathered keys, or CAUSAL for first chunks. Shapes as in model/mistral.py."""

from __future__ import annotations

import torch
from torch import Tensor

from tailguard.model.batch import AttnGroup
from tailguard.model.config import MistralConfig

__all__ = [
    "CAUSAL",
    "CHUNKED",
    "CausalMask",
    "ChunkMask",
    "KVCache",
    "Mask",
    "allocate_kv_cache",
    "attention_mask",
]

KVCache = list[tuple[Tensor, Tensor]]


def allocate_kv_cache(
    config: MistralConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> KVCache:
    """One zero-filled (k, v) pair per layer, each [num_blocks, block_size, nkv, hd]."""
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]


class CausalMask:
    """How a group of first chunks attends (`AttnGroup.from_start`): every sequence's query i
    sits at position i, so SDPA's top-left causal flag hides exactly the keys the additive mask
    would (the later positions), and its flash kernel skips the hidden blocks instead of adding
    -inf to them: 1.3-2.3x faster per attention call on the 2-core CPU (session 24, micro).
    Padding queries (beyond a prompt, or whole padding rows) see keys 0..i of stale or null
    blocks: finite garbage in rows nothing reads. CPU only: on CUDA warm-up runs each group
    shape's masked attention, and a causal kernel would be a shape it did not run."""


CAUSAL = CausalMask()


class ChunkMask:
    """How a group of prompt chunks attends where the bf16 prefill kernel (attn_bf16.c) runs
    them: each sequence's query i at position query_start + i sees the keys up to it (the
    sliding window honoured), a first chunk's from its own qkv rows, a later chunk's from the
    paged cache. No mask tensor is built."""


CHUNKED = ChunkMask()
Mask = Tensor | CausalMask | ChunkMask | None  # a group's attention: MistralModel._group_mask


def attention_mask(
    group: AttnGroup,
    num_tokens: int,
    kv_len: int,
    sliding_window: int | None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Additive mask [G, 1, Q, S] (0 = visible, -inf = hidden) of a group's gathered keys.

    Additive in the activation dtype rather than boolean: SDPA converts a boolean mask to this
    form on every call, i.e. in every layer; built here it is converted once per step.
    """
    device = group.token_index.device
    q_len = group.token_index.shape[1]
    q_pos = group.query_start[:, None, None] + torch.arange(q_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)  # [S]; q_pos: [G, Q, 1]
    # causal, and only keys already written (the gathered tail of the last block is stale)
    visible = (k_pos <= q_pos) & (k_pos < group.context_lens[:, None, None])  # [G, Q, S]
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window  # transformers: kv_idx > q_idx - window
    # Padding queries may see nothing at all (past the window, empty table): give them key 0 so
    # softmax has a term and their garbage rows stay finite instead of NaN.
    pad = (group.token_index == num_tokens)[..., None]  # [G, Q, 1]
    visible |= pad & (k_pos == 0)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~visible, float("-inf"))[:, None]  # broadcast over heads

"""The one dataclass that crosses runner -> model: a padded forward pass over the paged KV cache.

Layout: every new token of every scheduled sequence is flattened into one token axis of length
T (a bucket size; padding tokens fill the tail). Attention is computed per *group* in a padded
[G, Q] query layout: the runner puts decode sequences (1 new token each) in one group and
prefill chunks (many new tokens) in another, so a long prefill does not inflate the decode
group's padding.

KV cache: per layer a (k, v) pair of tensors, each [num_blocks, block_size, n_kv_heads, head_dim],
allocated once at start-up by the runner. Block 0 is reserved: padding tokens write their K/V
there and padded block-table entries point at it, so no forward pass ever allocates cache.
Flat slot of (block b, offset o) = b * block_size + o.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NULL_BLOCK = 0  # reserved scratch block: padding writes land here, padded tables point here


@dataclass(frozen=True)
class AttnGroup:
    """G sequences attended together, queries padded to Q per sequence."""

    token_index: (
        torch.Tensor
    )  # [G, Q] int64: flat token index of each query; padding -> T (the pad row)
    block_tables: torch.Tensor  # [G, B] int64: cache blocks of each sequence, padding -> NULL_BLOCK
    context_lens: (
        torch.Tensor
    )  # [G] int64: tokens in cache after this step's writes (>= 1 for padding rows)
    query_start: torch.Tensor  # [G] int64: position of the first new token (= context_len - q_len)
    from_start: bool = False  # every sequence's queries start at position 0 (first chunks)


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, padding = 0
    positions: torch.Tensor  # [T] int64 absolute positions, padding = 0
    slot_mapping: (
        torch.Tensor
    )  # [T] int64 flat cache slot to write each token's K/V; padding -> a slot in NULL_BLOCK
    groups: tuple[AttnGroup, ...]  # every real token appears in exactly one group

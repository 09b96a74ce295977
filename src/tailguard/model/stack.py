"""The fused decode stack (model/kernels/decode.c, decode_bf16.c) bound to one model's weights
and one KV cache: `bind` builds it from a model's layers (MistralModel.use_decode_stack decides
whether it applies), and `BoundStack.run` takes a decode step's embedded tokens through every
layer in one call. The same bits as the op-by-op forward (tests/model)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tailguard.model.batch import ForwardBatch
from tailguard.model.config import MistralConfig
from tailguard.model.kernels import DecodeStack
from tailguard.model.kernels.decode import Bf16DecodeStack, LayerRefs, StackDims
from tailguard.model.linear import KernelLinear
from tailguard.model.paged import KVCache

# one layer's projections, in the stack's order: wqkv, wo, w13, w2
Projections = tuple[nn.Module, nn.Module, nn.Module, nn.Module]


def on_stack_kernel(stack: DecodeStack, linear: nn.Module | None) -> bool:
    """Whether `linear` runs on our linear kernel in the stack's dtype and panel width, so the
    stack can read its panels."""
    return (
        isinstance(linear, KernelLinear)
        and linear.kernel.dtype == stack.dtype
        and linear.kernel.width == stack.width
    )


def panels(linear: nn.Module) -> Tensor:
    """A projection's packed panels (it runs on our linear kernel: KernelLinear)."""
    assert isinstance(linear, KernelLinear)
    return linear.weight.panels


@dataclass(frozen=True)
class BoundStack:
    """The decode stack bound to a model's weights and one KV cache (`bind`)."""

    kernel: DecodeStack
    layers: Any  # the ctypes array of decode.c's struct tg_layer
    refs: list[LayerRefs]  # keeps every pointer in `layers` alive
    dims: StackDims
    greedy_head: Tensor | None = None  # the head's panels where the stack runs greedy_head

    def applies(self, batch: ForwardBatch, kv_caches: KVCache) -> bool:
        """One decode group (one query a sequence), over the cache the stack was bound to."""
        groups = batch.groups
        return (
            len(groups) == 1
            and groups[0].token_index.shape[1] == 1
            and kv_caches[0][0].data_ptr() == self.refs[0].k_cache.data_ptr()
            and batch.input_ids.device.type == "cpu"
        )

    def run(
        self, batch: ForwardBatch, embed: nn.Embedding, rope_cos: Tensor, rope_sin: Tensor
    ) -> Tensor:
        """The decoder stack's output [T, H] (the residual stream, before the final norm)."""
        x = embed(batch.input_ids).contiguous()  # [T, H], updated in place
        # [T, hd] in the model dtype (bf16: cast as the op-by-op forward casts)
        cos = rope_cos.index_select(0, batch.positions).to(x.dtype).contiguous()
        sin = rope_sin.index_select(0, batch.positions).to(x.dtype).contiguous()
        group = batch.groups[0]
        tables = group.block_tables.contiguous()
        self.kernel.run(
            self.layers, self.dims, x, cos, sin, batch.slot_mapping.contiguous(),
            group.token_index[:, 0].contiguous(), tables, group.context_lens.contiguous(),
            tables.shape[1] * self.dims.bs, torch.get_num_threads(),
        )  # fmt: skip
        return x


def bind(
    stack: DecodeStack,
    config: MistralConfig,
    norms: Sequence[tuple[Tensor, Tensor]],
    projections: Sequence[Projections],
    kv_caches: KVCache,
    head: nn.Module | None,
) -> BoundStack:
    """The stack over every layer's norm weights (attention, FFN), projections (each
    `on_stack_kernel`: the caller checks) and KV cache; with the
    output head's panels where the stack runs the greedy tail (decode_bf16.c's, a head on its
    kernel)."""
    refs = [
        LayerRefs(attn, ffn, panels(qkv), panels(o), panels(w13), panels(w2), k, v)
        for (attn, ffn), (qkv, o, w13, w2), (k, v) in zip(
            norms, projections, kv_caches, strict=True
        )
    ]
    c = config
    dims = StackDims(
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
        c.intermediate_size, kv_caches[0][0].shape[1], c.sliding_window or 0,
        c.rms_norm_eps, c.head_dim**-0.5,
    )  # fmt: skip
    greedy = (
        panels(head)
        # the greedy tail is decode_bf16.c's
        if isinstance(stack, Bf16DecodeStack) and head is not None and on_stack_kernel(stack, head)
        else None
    )
    return BoundStack(stack, stack.layers(refs), refs, dims, greedy)

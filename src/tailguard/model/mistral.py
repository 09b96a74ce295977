"""Mistral, compact: RMSNorm, rotary embeddings, grouped-query sliding-window attention over a
paged KV cache, SwiGLU MLP, tied or untied head. One top-down file in the style of gpt-fast.

Shapes: T = flat tokens of the step (a bucket, padding at the tail), H = hidden, nh / nkv =
query / KV heads, hd = head_dim, G x Q = an attention group's padded query grid, B = blocks per
sequence in the group's block table, S = B * block_size keys gathered per sequence.

Weights use fused projections (wqkv, w13) so a layer runs 4 matmuls instead of 7; the loader
maps Hugging Face names onto them with `load_hf_weights`. Numerics follow transformers'
MistralForCausalLM (RMSNorm in fp32 then cast, rotate-half RoPE in the model dtype, the
sliding window `q_pos - k_pos < sliding_window`), so fp32 logits match it to ~1e-5. The KV
cache tensors and the attention masks live in model/paged.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tailguard.model.batch import AttnGroup, ForwardBatch
from tailguard.model.config import MistralConfig
from tailguard.model.kernels import DecodeStack, LinearKernel, RowKernel
from tailguard.model.kernels.attn_bf16 import PrefillAttention
from tailguard.model.kernels.rows import MAX_BF16_HEAD_DIM, MAX_REP
from tailguard.model.linear import KernelLinear, PackedLinear, can_prepack
from tailguard.model.paged import (
    CAUSAL,
    CHUNKED,
    CausalMask,
    ChunkMask,
    KVCache,
    Mask,
    allocate_kv_cache,
    attention_mask,
)
from tailguard.model.stack import BoundStack, bind, on_stack_kernel, panels

__all__ = [
    "CAUSAL",
    "CausalMask",
    "KernelLinear",
    "MistralModel",
    "PackedLinear",
    "allocate_kv_cache",
    "attention_mask",
    "can_prepack",
]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused: RowKernel | None = None  # one compiled pass (CPU fp32 or bf16) where set

    def on_kernel(self, x: Tensor) -> bool:
        """Whether forward(x) runs on the row kernel (whose bf16 rounding a linear's x copy
        can repeat: `fold`)."""
        return self.fused is not None and x.is_contiguous() and x.dtype == self.weight.dtype

    def fold(self, x: Tensor) -> tuple[Tensor, float] | None:
        """(weight, eps) for a bf16 kernel linear to apply this norm to x inside its own copy of
        x (the same bits as forward on the row kernel), else None: call forward."""
        if x.dtype == torch.bfloat16 and self.on_kernel(x):
            return self.weight, self.eps
        return None

    def forward(self, x: Tensor) -> Tensor:
        kernel = self.fused
        if kernel is not None and self.on_kernel(x):
            return kernel.rms_norm(x, self.weight, self.eps, torch.get_num_threads())
        # Normalise in fp32 and cast back before the weight, exactly as transformers does, so
        # bf16 serving rounds at the same places as the reference.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE. x: [T, heads, hd]; cos, sin: [T, 1, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.n_head = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv * self.head_dim
        self.split = (q_dim, kv_dim, kv_dim)
        self.wqkv = nn.Linear(config.hidden_size, q_dim + 2 * kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, config.hidden_size, bias=False)
        self.window = config.sliding_window or 0
        # decode groups on our own kernel (model/kernels/attend.c) where set: CPU fp32 or bf16
        self.fused: RowKernel | None = None
        self.fused_rope: RowKernel | None = None  # RoPE on it (bf16: half of hd whole lanes)
        self.prefill: PrefillAttention | None = None  # bf16 first chunks (attn_bf16.c) if set

    def forward(
        self,
        x: Tensor,  # [T, H]
        cos: Tensor,  # [T, 1, hd]
        sin: Tensor,  # [T, 1, hd]
        batch: ForwardBatch,
        masks: list[Mask],  # per group [G, 1, Q, S], CAUSAL, or None: a decode group on `fused`
        kv_cache: tuple[Tensor, Tensor],  # each [num_blocks, block_size, nkv, hd]
        residual: Tensor | None = None,  # [T, H] added to the output (the layer's input)
        norm: RMSNorm | None = None,  # x is normalised by it first (in wqkv's x copy if it can)
        out: Tensor | None = None,  # [T+1, nh*hd] zero-filled, shared by a step's layers
    ) -> Tensor:
        n_tok = x.shape[0]
        qkv = self.wqkv(x) if norm is None else project_normed(self.wqkv, x, norm)
        kernel = self.fused
        rope = self.fused_rope
        # This step's K/V are written first, so each group then reads its context (own new
        # tokens included) from the cache alone. Padding tokens write into the null block.
        k_cache, v_cache = kv_cache
        fuse_kv = k_cache.dtype == qkv.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
        rotated = False  # q and k rotated in qkv's own rows (the prefill kernel reads them there)
        if rope is not None and qkv.is_contiguous() and fuse_kv:
            # q and k rotated in place and K/V written to the cache, one pass over the rows
            rotated = True
            rope.rope_(
                qkv, self.n_head + self.n_kv, self.head_dim, cos[:, 0], sin[:, 0],
                torch.get_num_threads(), kv=(self.n_kv, batch.slot_mapping, k_cache, v_cache),
            )  # fmt: skip
            q = qkv[:, : self.n_head * self.head_dim].view(n_tok, self.n_head, self.head_dim)
        else:
            q, k, v = qkv.split(self.split, dim=-1)
            q = apply_rope(q.view(n_tok, self.n_head, self.head_dim), cos, sin)  # [T, nh, hd]
            k = apply_rope(k.view(n_tok, self.n_kv, self.head_dim), cos, sin)  # [T, nkv, hd]
            v = v.view(n_tok, self.n_kv, self.head_dim)  # [T, nkv, hd]
            k_cache.view(-1, self.n_kv, self.head_dim).index_copy_(0, batch.slot_mapping, k)
            v_cache.view(-1, self.n_kv, self.head_dim).index_copy_(0, batch.slot_mapping, v)

        # Row T of both buffers is the padding row: padded queries read zeros from it and
        # their outputs land there, so flat padding rows stay zero (finite) and nothing races.
        # Every real token's row is written below in every layer, so one zero-filled buffer
        # serves a step's layers (MistralModel.forward: a 2-MiB fill a layer at 1,024 tokens).
        if out is None:
            out = x.new_zeros(n_tok + 1, self.n_head * self.head_dim)  # [T+1, nh*hd]
        q_ext: Tensor | None = None  # [T+1, nh, hd], made for the torch path only
        for group, mask in zip(batch.groups, masks, strict=True):  # a few groups, not sequences
            if mask is None:
                assert kernel is not None
                kernel.decode_attention(
                    q, group.token_index[:, 0].contiguous(), n_tok, k_cache, v_cache,
                    group.block_tables, group.context_lens,
                    group.block_tables.shape[1] * k_cache.shape[1], self.window, out,
                    torch.get_num_threads(),
                )  # fmt: skip
                continue
            if isinstance(mask, ChunkMask):
                if self.prefill is not None and rotated:
                    self.prefill.attend(
                        qkv, group.token_index[:, 0], group.context_lens - group.query_start,
                        self.n_head, self.n_kv, self.head_dim, self.window, out,
                        torch.get_num_threads(), starts=group.query_start,
                        cache=(k_cache, v_cache, group.block_tables),
                        warm=panels(self.wo) if isinstance(self.wo, KernelLinear) else None,
                    )  # fmt: skip
                    continue
                kv_len = group.block_tables.shape[1] * k_cache.shape[1]
                mask = attention_mask(group, n_tok, kv_len, self.window or None, x.dtype)
            if q_ext is None:
                q_ext = torch.cat((q, q.new_zeros(1, self.n_head, self.head_dim)))
            self.attend(q_ext, group, mask, k_cache, v_cache, out)
        return project(self.wo, out[:n_tok], residual)  # [T, H]

    def attend(
        self,
        q_ext: Tensor,  # [T+1, nh, hd] this step's queries, row T zeros (the padding row)
        group: AttnGroup,
        mask: Tensor | CausalMask,  # [G, 1, Q, S], or CAUSAL for first chunks
        k_cache: Tensor,  # [num_blocks, block_size, nkv, hd]
        v_cache: Tensor,
        out: Tensor,  # [T+1, nh*hd] written at the group's token rows
    ) -> None:
        """One group's attention over its gathered context. Its shape (G, Q, B) is the
        group's bucket: the engine's warm-up runs this alone for every bucket."""
        n_seq, q_len = group.token_index.shape
        flat_q = group.token_index.reshape(-1)  # [G*Q]
        blocks = group.block_tables.reshape(-1)  # [G*B]
        # index_select on dim 0 rather than k_cache[block_tables]: same gather, 3-4x faster
        # on CPU (advanced indexing takes a generic strided path).
        qg = q_ext.index_select(0, flat_q).view(n_seq, q_len, self.n_head, self.head_dim)
        kg = k_cache.index_select(0, blocks).view(n_seq, -1, self.n_kv, self.head_dim)
        vg = v_cache.index_select(0, blocks).view(n_seq, -1, self.n_kv, self.head_dim)
        og = F.scaled_dot_product_attention(
            qg.transpose(1, 2),  # [G, nh, Q, hd]
            kg.transpose(1, 2),  # [G, nkv, S, hd]
            vg.transpose(1, 2),  # [G, nkv, S, hd]
            attn_mask=None if isinstance(mask, CausalMask) else mask,  # [G, 1, Q, S]
            is_causal=isinstance(mask, CausalMask),  # top-left: query i sees keys 0..i
            enable_gqa=True,
        )  # [G, nh, Q, hd]
        out.index_copy_(0, flat_q, og.transpose(1, 2).reshape(n_seq * q_len, -1))


class FeedForward(nn.Module):
    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused: RowKernel | None = None  # silu(gate) * up in one compiled pass where set

    def forward(
        self, x: Tensor, residual: Tensor | None = None, norm: RMSNorm | None = None
    ) -> Tensor:
        """w2(silu(gate) * up), plus residual ([T, H], the layer's stream) where given; x is
        normalised by norm first where given (inside w13's x copy where it can)."""
        w13 = self.w13
        folded = None if norm is None else norm.fold(x)
        if self.fused is not None and isinstance(w13, KernelLinear):
            # silu(gate) * up inside the bf16 kernel's w13 (prefill sizes on AMX), same bits
            act = w13.fused(x, silu=True, norm=folded)
            if act is not None:
                return project(self.w2, act, residual)
        if norm is not None:
            x = norm(x)
        gate_up = w13(x)  # [T, 2I]
        if self.fused is not None and gate_up.is_contiguous():
            act = self.fused.silu_mul(gate_up, torch.get_num_threads())
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            act = F.silu(gate) * up
        return project(self.w2, act, residual)


def project_normed(linear: nn.Module, x: Tensor, norm: RMSNorm) -> Tensor:
    """linear(norm(x)), the norm inside the linear's own copy of x where its kernel can (bf16 on
    AMX above 32 rows, the norm on the row kernel): the normalised x never goes to memory, and
    the bits are those of the two calls either way."""
    folded = norm.fold(x)
    if folded is not None and isinstance(linear, KernelLinear):
        y = linear.fused(x, norm=folded)
        if y is not None:
            return y
    return linear(norm(x))


def project(linear: nn.Module, x: Tensor, residual: Tensor | None) -> Tensor:
    """linear(x), plus residual where given: added in the linear's own store where its kernel
    can (bf16 on AMX above 32 rows: one pass over the output instead of two), with the bits of
    `residual + linear(x)` either way."""
    if residual is None:
        return linear(x)
    if isinstance(linear, KernelLinear):
        y = linear.fused(x, residual=residual)
        if y is not None:
            return y
    return residual + linear(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        batch: ForwardBatch,
        masks: list[Mask],
        kv_cache: tuple[Tensor, Tensor],
        attn_out: Tensor | None = None,  # [T+1, nh*hd] zero-filled, shared by a step's layers
    ) -> Tensor:
        x = self.attn(
            x, cos, sin, batch, masks, kv_cache, residual=x, norm=self.attn_norm, out=attn_out
        )
        return self.mlp(x, residual=x, norm=self.ffn_norm)


class MistralModel(nn.Module):
    rope_cos: Tensor  # [P, hd] fp32 buffer
    rope_sin: Tensor  # [P, hd] fp32 buffer
    _head_t: Tensor | None = None  # [H, vocab] copy of the output head, made on first use

    def __init__(self, config: MistralConfig, max_seq_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        self._head_packed: nn.Module | None = None  # the output head after prepack()
        self.row_kernel: RowKernel | None = None  # set by use_row_kernel() on every layer
        self.prefill_kernel: PrefillAttention | None = None  # set by use_prefill_attention()
        self._stack: BoundStack | None = None  # set by use_decode_stack()
        # Initialised by hand and not on the meta device (the loader builds there and assigns
        # real tensors): normal_() on meta pulls in torch's Python reference kernels, a one-off
        # ~1-2 s import that would dominate loading a small model.
        embed = torch.empty(config.vocab_size, config.hidden_size)
        if embed.device.type != "meta":
            nn.init.normal_(embed, std=0.02)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embed)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Positions index a precomputed table covering every position the config allows (128k
        # x hd=128 costs 128 MiB in fp32, under 1% of a 7B model); built on the CPU explicitly
        # so that constructing under `torch.device("meta")` (the loader does) yields values.
        self.max_seq_len = max_seq_len or config.max_position_embeddings
        cos, sin = _rope_table(self.max_seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, hd] fp32
        self.register_buffer("rope_sin", sin, persistent=False)  # [P, hd] fp32

    def forward(self, batch: ForwardBatch, kv_caches: KVCache) -> Tensor:
        """Final-norm hidden states [T, H] of every flat token (padding rows finite garbage)."""
        stack = self._stack
        if stack is not None and stack.applies(batch, kv_caches):
            return self.norm(stack.run(batch, self.embed_tokens, self.rope_cos, self.rope_sin))
        x = self.embed_tokens(batch.input_ids)  # [T, H]
        # transformers computes cos/sin in fp32 and casts to the activation dtype; same here.
        cos = self.rope_cos.index_select(0, batch.positions).to(x.dtype)[:, None]  # [T, 1, hd]
        sin = self.rope_sin.index_select(0, batch.positions).to(x.dtype)[:, None]  # [T, 1, hd]
        block_size = kv_caches[0][0].shape[1]
        masks = [self._group_mask(g, x, block_size) for g in batch.groups]  # once per step
        c = self.config
        attn_out = x.new_zeros(x.shape[0] + 1, c.num_attention_heads * c.head_dim)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, batch, masks, kv_cache, attn_out)
        return self.norm(x)

    def _group_mask(self, group: AttnGroup, x: Tensor, block_size: int) -> Mask:
        """How a group attends in every layer of this step: None for a decode group on the row
        kernel (fp32 or bf16, any context: it reads the paged cache in place, 0.5-0.6x the time
        of gathering and SDPA at 512-1,024 tokens in bf16), CHUNKED for prompt chunks on the
        bf16 prefill kernel (first or later chunks), CAUSAL for first chunks on CPU otherwise
        (SDPA's causal flag skips the hidden half), else the additive mask."""
        q_len = group.token_index.shape[1]
        kv_len = group.block_tables.shape[1] * block_size
        if self.row_kernel is not None and q_len == 1:
            return None
        if self.prefill_kernel is not None and q_len > 1:
            return CHUNKED
        window = self.config.sliding_window
        if (
            group.from_start
            and q_len > 1
            and x.device.type == "cpu"
            and (window is None or window >= q_len)
        ):
            return CAUSAL
        return attention_mask(group, x.shape[0], kv_len, window, x.dtype)

    def use_row_kernel(self, kernel: RowKernel | None) -> bool:
        """Run decode groups' attention, RoPE, RMSNorm and the MLP's silu(gate) * up on
        `kernel` (model/kernels/rows.c) where it applies: CPU fp32 or bf16, head_dim, hidden
        and intermediate sizes whole numbers of its vector lanes (bf16 RoPE: half of head_dim,
        else torch's). Returns whether it does."""
        c = self.config
        ok = (
            kernel is not None
            and self.dtype in (torch.float32, torch.bfloat16)
            and self.device.type == "cpu"
            and all(n % kernel.lanes == 0 for n in (c.head_dim, c.hidden_size, c.intermediate_size))
            and c.num_attention_heads // c.num_key_value_heads <= MAX_REP
            and (self.dtype != torch.bfloat16 or c.head_dim <= MAX_BF16_HEAD_DIM)
        )
        use = self.row_kernel = kernel if ok else None
        half_fits = use is not None and c.head_dim // 2 % use.lanes == 0
        rope = use if self.dtype == torch.float32 or half_fits else None
        self.norm.fused = use
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.attn.fused = use
            layer.attn.fused_rope = rope
            layer.attn_norm.fused = use
            layer.ffn_norm.fused = use
            layer.mlp.fused = use
        return ok

    def use_prefill_attention(self, kernel: PrefillAttention | None) -> bool:
        """Run prompt chunks' causal attention (CHUNKED groups: first chunks, and later chunks
        of prompts longer than a step's budget, which read their earlier keys from the paged
        cache) on `kernel` (attn_bf16.c) where it applies: a CPU bf16 model whose RoPE runs in
        place on the row kernel (the kernel reads queries, and a first chunk's keys and values,
        from the rotated qkv rows), head_dim a multiple of 32. Returns whether it does."""
        c = self.config
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        ok = (
            kernel is not None
            and self.dtype == torch.bfloat16
            and self.device.type == "cpu"
            and kernel.applies(c.num_attention_heads, c.num_key_value_heads, c.head_dim)
            and all(ly.attn.fused_rope is not None for ly in layers)
        )
        for ly in layers:
            ly.attn.prefill = kernel if ok else None
        self.prefill_kernel = kernel if ok else None
        return ok

    def use_decode_stack(self, stack: DecodeStack | None, kv_caches: KVCache) -> bool:
        """Run a decode step's whole decoder stack (a forward whose one attention group is a
        decode group, over `kv_caches`) in one compiled call (model/kernels/decode.c, or
        decode_bf16.c for a bf16 model) where it applies: after `use_row_kernel` (RoPE on it
        too) and `prepack` onto our linear kernel of the stack's dtype and panel width.
        Returns whether it does."""
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        linears = [(ly.attn.wqkv, ly.attn.wo, ly.mlp.w13, ly.mlp.w2) for ly in layers]
        ok = (
            stack is not None
            and self.row_kernel is not None
            and stack.lanes == self.row_kernel.lanes
            and len(layers) == len(kv_caches) > 0
            and all(ly.attn.fused_rope is not None for ly in layers)  # the stack's RoPE
            and stack.dtype == self.dtype
            and all(on_stack_kernel(stack, lin) for four in linears for lin in four)
        )
        if not ok or stack is None:
            self._stack = None
            return False
        norms = [(ly.attn_norm.weight.detach(), ly.ffn_norm.weight.detach()) for ly in layers]
        self._stack = bind(stack, self.config, norms, linears, kv_caches, self._head_packed)
        return True

    def decode_greedy(self, batch: ForwardBatch, kv_caches: KVCache, rows: Tensor) -> Tensor | None:
        """The greedy next token [len(rows)] (int64) of each row index of a decode step in
        one call after the stack: the final norm, the head and the argmax in C, the same
        bits as `forward`, `head` and an argmax of its logits. None where the stack does not
        run this batch or has no greedy head (fp32; a head not on its kernel)."""
        stack = self._stack
        if stack is None or stack.greedy_head is None or not stack.applies(batch, kv_caches):
            return None
        x = stack.run(batch, self.embed_tokens, self.rope_cos, self.rope_sin)
        c = self.config
        return stack.kernel.greedy_head(
            x, rows, self.norm.weight.detach(), c.rms_norm_eps, stack.greedy_head,
            c.vocab_size, torch.get_num_threads(),
        )  # fmt: skip

    def prepack(self, pack: bool = True, kernel: LinearKernel | None = None) -> None:
        """Replace every projection and the output head by faster linears (CPU inference).

        kernel: one of our kernels' layouts (`KernelLinear`), where its dtype is the model's
        (the runner picks it, saying why when there is none). Else, with `pack`,
        oneDNN-packed weights (`PackedLinear`). The plain weights are dropped (tied: the
        embedding stays), so `load_hf_weights` and `state_dict` no longer apply. Inference
        only, after loading; idempotent; a no-op where neither applies.
        """
        if kernel is not None and kernel.dtype != self.dtype:
            kernel = None  # the runner says so before calling
        pack = pack and can_prepack(self.dtype, self.device)
        if self._head_packed is not None or not (pack or kernel is not None):
            return

        def make(weight: Tensor) -> nn.Module:
            return PackedLinear(weight) if kernel is None else KernelLinear(weight, kernel)

        with torch.no_grad():
            for layer in self.layers:
                for owner, name in (
                    (layer.attn, "wqkv"),
                    (layer.attn, "wo"),
                    (layer.mlp, "w13"),
                    (layer.mlp, "w2"),
                ):
                    lin = getattr(owner, name)
                    setattr(owner, name, make(lin.weight))
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self._head_packed = make(head)
            self.lm_head = None  # the plain head weight is dropped or moved
            self._head_t = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, H] -> [N, vocab] fp32 (sampling and log-probs want fp32 whatever the weights)."""
        return self.head(hidden).float()

    def head(self, hidden: Tensor) -> Tensor:
        """[N, H] -> [N, vocab] logits in the model dtype. Greedy decoding takes the argmax
        of these directly: widening to fp32 is exact, so it cannot change the argmax, and it
        would copy [N, vocab] (32 MB at 256 rows) every step."""
        if self._head_packed is not None:
            return self._head_packed(hidden)
        head_t = self._head_t
        if head_t is None or head_t.device != hidden.device or head_t.dtype != hidden.dtype:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            # The output head is the largest matmul of a step. A [H, vocab] copy lets it run as
            # a plain x @ W: measured on the 2-core CPU, 2.2 -> 0.8 ms for one row and 29 -> 21
            # ms for 64 rows against F.linear's x @ W.T. Weights are frozen while serving.
            head_t = self._head_t = weight.detach().t().contiguous()  # [H, vocab]
        return hidden @ head_t

    def load_hf_weights(self, tensors: Mapping[str, Tensor]) -> None:
        """Take Hugging Face-named tensors (already validated and cast) and fuse projections.

        Assigns the tensors as parameters (no copy when no fusion is needed), so a model
        constructed on the meta device becomes real here.
        """
        sd: dict[str, Tensor] = {
            "embed_tokens.weight": tensors["model.embed_tokens.weight"],
            "norm.weight": tensors["model.norm.weight"],
        }
        if self.lm_head is not None:
            sd["lm_head.weight"] = tensors["lm_head.weight"]
        for i in range(self.config.num_hidden_layers):
            hf = f"model.layers.{i}."
            sd[f"layers.{i}.attn_norm.weight"] = tensors[hf + "input_layernorm.weight"]
            sd[f"layers.{i}.ffn_norm.weight"] = tensors[hf + "post_attention_layernorm.weight"]
            sd[f"layers.{i}.attn.wqkv.weight"] = torch.cat(
                [tensors[hf + f"self_attn.{p}_proj.weight"] for p in "qkv"]
            )
            sd[f"layers.{i}.attn.wo.weight"] = tensors[hf + "self_attn.o_proj.weight"]
            sd[f"layers.{i}.mlp.w13.weight"] = torch.cat(
                [tensors[hf + "mlp.gate_proj.weight"], tensors[hf + "mlp.up_proj.weight"]]
            )
            sd[f"layers.{i}.mlp.w2.weight"] = tensors[hf + "mlp.down_proj.weight"]
        self.load_state_dict(sd, strict=True, assign=True)
        self._head_t = None  # new weights: rebuild the transposed head on first use


def _rope_table(max_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [max_len, hd] in fp32, computed as transformers' MistralRotaryEmbedding does."""
    dims = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu")
    inv_freq = 1.0 / (theta ** (dims / head_dim))  # [hd/2]
    freqs = torch.arange(max_len, device="cpu").float()[:, None] * inv_freq  # [P, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
    return emb.cos(), emb.sin()

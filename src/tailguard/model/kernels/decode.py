"""The decoder stack of a decode step in one compiled call (decode.c), CPU fp32.

    stack = load_decode_stack()        # None, with one logged line saying why, if unavailable
    layers = stack.layers([...])       # once: every layer's norm weights, panels and caches
    stack.run(layers, dims, x, cos, sin, slots, q_rows, tables, ctx_lens, max_ctx, threads)

decode.c includes gemv.c (the small-M linear) and rows.c (norms, RoPE, silu, paged decode
attention), so each phase is the same code as the op-by-op path; built and cached like them
(build.py) and checked against a torch reference of one layer (`self_check`) before use.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from tailguard.model.kernels.build import Loader

__all__ = [
    "DecodeStack",
    "LayerRefs",
    "StackDims",
    "decode_unavailable_reason",
    "load_decode_stack",
    "self_check",
]

SOURCE = Path(__file__).with_name("decode.c")
ABI = 1


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("attn_norm", "ffn_norm", "wqkv", "wo", "w13", "w2", "k_cache", "v_cache")
    ]


class StackDims(ctypes.Structure):
    """The model's sizes as decode.c's `struct tg_dims`."""

    _fields_ = [
        *((name, ctypes.c_long) for name in ("H", "nh", "nkv", "hd", "I", "bs", "window")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


@dataclass(frozen=True)
class LayerRefs:
    """One layer's tensors: fp32 norm weights [H], tg_pack panels, caches [blocks, bs, nkv,
    hd]. Held here so the pointers handed to C stay valid."""

    attn_norm: Tensor
    ffn_norm: Tensor
    wqkv: Tensor
    wo: Tensor
    w13: Tensor
    w2: Tensor
    k_cache: Tensor
    v_cache: Tensor


class DecodeStack:
    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        c_long, c_void_p, c_int = ctypes.c_long, ctypes.c_void_p, ctypes.c_int
        self._run = lib.tg_decode_stack
        self._run.restype = c_int
        # layers, n_layers, dims, x, T, cos, sin, slots, q_rows, nseq, tables, tbl_ld, ctx,
        # max_ctx, scratch, threads
        self._run.argtypes = [
            c_void_p, c_long, c_void_p, c_void_p, c_long, c_void_p, c_void_p, c_void_p,
            c_void_p, c_long, c_void_p, c_long, c_void_p, c_long, c_void_p, c_int,
        ]  # fmt: skip
        self._scratch = lib.tg_decode_scratch
        self._scratch.restype = c_long
        self._scratch.argtypes = [c_void_p, c_long, c_long, c_int]
        self._pack = lib.tg_pack
        self._pack.restype = None
        self._pack.argtypes = [c_void_p, c_void_p, c_long, c_long]
        self.width = int(lib.tg_panel_width())
        self.lanes = int(lib.tg_rows_lanes())
        self._lib = lib

    def pack(self, w: Tensor) -> Tensor:
        """[N, K] fp32 -> tg_pack panels [ceil(N / width), K, width] (as the small-M kernel)."""
        w = w.detach().contiguous()
        n, k = w.shape
        panels = torch.empty(-(-n // self.width), k, self.width, dtype=torch.float32)
        self._pack(w.data_ptr(), panels.data_ptr(), n, k)
        return panels

    @staticmethod
    def layers(refs: Sequence[LayerRefs]) -> ctypes.Array[_Layer]:
        arr = (_Layer * len(refs))()
        for c, r in zip(arr, refs, strict=True):
            for name in _Layer._fields_:
                setattr(c, name[0], getattr(r, name[0]).data_ptr())
        return arr

    def run(
        self,
        layers: ctypes.Array[_Layer],
        dims: StackDims,
        x: Tensor,  # [T, H] fp32 contiguous, updated in place
        cos: Tensor,  # [T, hd] fp32 contiguous
        sin: Tensor,
        slots: Tensor,  # [T] int64
        q_rows: Tensor,  # [G] int64 contiguous; rows >= T are padding
        tables: Tensor,  # [G, B] int64 contiguous
        ctx_lens: Tensor,  # [G] int64
        max_ctx: int,
        threads: int,
    ) -> None:
        t = x.shape[0]
        scratch = torch.empty(self._scratch(ctypes.byref(dims), t, max_ctx, threads))
        rc = self._run(
            layers, len(layers), ctypes.byref(dims), x.data_ptr(), t, cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), q_rows.data_ptr(), q_rows.shape[0],
            tables.data_ptr(), tables.shape[1], ctx_lens.data_ptr(), max_ctx,
            scratch.data_ptr(), threads,
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"decode stack refused its arguments ({rc}): T={t}, {dims.H=}")


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [T, heads, hd]
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]


def self_check(stack: DecodeStack) -> str | None:
    """Two layers over 3 decode rows and a padding row, against torch ops (GQA, a window,
    scattered blocks): None if they agree, else why not."""
    g = torch.Generator().manual_seed(0)
    hd, nh, nkv, bs = stack.lanes, 4, 2, 4
    h_, i_ = nh * hd, 2 * stack.lanes
    dims = StackDims(h_, nh, nkv, hd, i_, bs, 5, 1e-5, hd**-0.5)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    refs, plain = [], []
    for _ in range(2):
        w = [rand(h_) + 1, rand(h_) + 1, rand((nh + 2 * nkv) * hd, h_), rand(h_, nh * hd)]
        w += [rand(2 * i_, h_), rand(h_, i_)]
        plain.append(w)
        caches = rand(9, bs, nkv, hd), rand(9, bs, nkv, hd)
        wqkv, wo, w13, w2 = (stack.pack(m) for m in w[2:])
        refs.append(LayerRefs(w[0], w[1], wqkv, wo, w13, w2, *caches))
    ctx = torch.tensor([7, 3, 12])  # contexts incl. this token; row 3 is padding
    tables = torch.tensor([[2, 5, 0], [7, 0, 0], [1, 3, 8]])
    slots = torch.stack([tables[s, (c - 1) // bs] * bs + (c - 1) % bs for s, c in enumerate(ctx)])
    slots = torch.cat((slots, torch.tensor([0])))  # padding writes the null block
    x = rand(4, h_)
    angle = rand(4, hd)
    cos, sin = angle.cos().contiguous(), angle.sin().contiguous()
    want = x.clone()
    expect_caches = [(r.k_cache.clone(), r.v_cache.clone()) for r in refs]
    for w, (kc, vc) in zip(plain, expect_caches, strict=True):
        qkv = _rms(want, w[0], dims.eps) @ w[2].t()
        q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), -1)
        q = _rope(q.view(4, nh, hd), cos, sin)
        k = _rope(k.view(4, nkv, hd), cos, sin)
        kc.view(-1, nkv, hd)[slots] = k
        vc.view(-1, nkv, hd)[slots] = v.view(4, nkv, hd)
        att = torch.zeros(4, nh * hd)
        for s in range(3):
            n = int(ctx[s])
            pos = torch.arange(max(0, n - dims.window), n)
            flat = tables[s, pos // bs] * bs + pos % bs
            ks = kc.view(-1, nkv, hd)[flat].repeat_interleave(nh // nkv, 1).transpose(0, 1)
            vs = vc.view(-1, nkv, hd)[flat].repeat_interleave(nh // nkv, 1).transpose(0, 1)
            o = F.scaled_dot_product_attention(q[s][:, None], ks, vs)  # [nh, 1, hd]
            att[s] = o.reshape(-1)
        want = want + att @ w[3].t()
        gate, up = (_rms(want, w[1], dims.eps) @ w[4].t()).chunk(2, -1)
        want = want + (F.silu(gate) * up) @ w[5].t()
    got = x.clone()
    stack.run(
        stack.layers(refs), dims, got, cos, sin, slots, torch.tensor([0, 1, 2, 4]),
        torch.cat((tables, torch.zeros(1, 3, dtype=torch.long))), torch.cat((ctx, ctx[:1])),
        12, 2,
    )  # fmt: skip
    err = (got - want).abs().max().item()
    if not err < 1e-4:
        return f"decode stack self-check failed: max error {err:.3g} against torch"
    for r, (kc, _) in zip(refs, expect_caches, strict=True):
        if not torch.allclose(r.k_cache, kc, atol=1e-5):
            return "decode stack self-check failed: the KV cache write differs from torch's"
    return None


_LOADER: Loader[DecodeStack] = Loader(
    SOURCE,
    "tg_decode_abi",
    ABI,
    DecodeStack,
    self_check,
    what="decode stack",
    fallback="the op-by-op forward",
)


def load_decode_stack(
    compiler: str | None = None, cache_dir: Path | None = None
) -> DecodeStack | None:
    """The decode stack, built and checked once per process (and per compiler / cache
    folder); None after one warning line saying why, if it cannot be had."""
    return _LOADER.load(compiler, cache_dir)


def decode_unavailable_reason(
    compiler: str | None = None, cache_dir: Path | None = None
) -> str | None:
    """Why load_decode_stack() gave None (after it ran), else None."""
    return _LOADER.reason(compiler, cache_dir)

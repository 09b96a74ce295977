"""The decoder stack of a decode step in one compiled call: decode.c (CPU fp32) or
decode_bf16.c (CPU bf16 on AVX512-BF16, the bf16 linear kernel's panels).

    stack = load_decode_stack(dtype)   # None, with one logged line saying why, if unavailable
    layers = stack.layers([...])       # once: every layer's norm weights, panels and caches
    stack.run(layers, dims, x, cos, sin, slots, q_rows, tables, ctx_lens, max_ctx, threads)

decode.c includes gemv.c (the small-M linear) and rows.c (norms, RoPE, silu, and through
attend.c the paged decode attention), decode_bf16.c gemv_bf16.c and rows.c, so each phase is
the same code as the op-by-op path; built and cached like them (build.py) and checked against a
torch reference of two layers (`self_check`) before use.
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
from tailguard.model.kernels.small_m_bf16 import AmxPath

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
SOURCE_BF16 = Path(__file__).with_name("decode_bf16.c")
ABI_BF16 = 3


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
    """One layer's tensors in the stack's dtype: norm weights [H], its kernel's panels, caches
    [blocks, bs, nkv, hd]. Held here so the pointers handed to C stay valid."""

    attn_norm: Tensor
    ffn_norm: Tensor
    wqkv: Tensor
    wo: Tensor
    w13: Tensor
    w2: Tensor
    k_cache: Tensor
    v_cache: Tensor


class DecodeStack:
    """decode.c: fp32 activations, tg_pack panels (gemv.c)."""

    dtype = torch.float32
    amx = False  # fp32: no tiles
    _symbols = ("tg_decode_stack", "tg_decode_scratch", "tg_pack", "tg_panel_width")

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        c_long, c_void_p, c_int = ctypes.c_long, ctypes.c_void_p, ctypes.c_int
        run, scratch, pack, width = (getattr(lib, name) for name in self._symbols)
        self._run = run
        self._run.restype = c_int
        # layers, n_layers, dims, x, T, cos, sin, slots, q_rows, nseq, tables, tbl_ld, ctx,
        # max_ctx, scratch, threads
        self._run.argtypes = [
            c_void_p, c_long, c_void_p, c_void_p, c_long, c_void_p, c_void_p, c_void_p,
            c_void_p, c_long, c_void_p, c_long, c_void_p, c_long, c_void_p, c_int,
        ]  # fmt: skip
        self._scratch = scratch
        self._scratch.restype = c_long
        self._scratch.argtypes = [c_void_p, c_long, c_long, c_int]
        self._pack = pack
        self._pack.restype = None
        self._pack.argtypes = [c_void_p, c_void_p, c_long, c_long]
        self.width = int(width())
        self.lanes = int(lib.tg_rows_lanes())
        self._lib = lib

    def use_amx(self, on: bool) -> bool:
        """The linears on AMX tiles (bf16 only; the same as the bf16 kernel's use_amx, so the
        stack gives the op-by-op path's bits). Returns whether AMX is now on."""
        return False

    def greedy_head(
        self, x: Tensor, rows: Tensor, norm_w: Tensor, eps: float, head: Tensor, vocab: int,
        threads: int,
    ) -> Tensor:  # fmt: skip
        raise NotImplementedError("the greedy head runs on the bf16 stack only")

    def pack(self, w: Tensor) -> Tensor:
        """[N, K] fp32 -> tg_pack panels [ceil(N / width), K, width] (as the small-M kernel)."""
        w = w.detach().contiguous()
        n, k = w.shape
        panels = torch.empty(-(-n // self.width), k, self.width, dtype=torch.float32)
        self._pack(w.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def _scratch_tensor(self, dims: StackDims, t: int, max_ctx: int, threads: int) -> Tensor:
        return torch.empty(self._scratch(ctypes.byref(dims), t, max_ctx, threads))  # floats

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
        x: Tensor,  # [T, H] in the stack's dtype, contiguous, updated in place
        cos: Tensor,  # [T, hd] in the stack's dtype, contiguous
        sin: Tensor,
        slots: Tensor,  # [T] int64
        q_rows: Tensor,  # [G] int64 contiguous; rows >= T are padding
        tables: Tensor,  # [G, B] int64 contiguous
        ctx_lens: Tensor,  # [G] int64
        max_ctx: int,
        threads: int,
    ) -> None:
        t = x.shape[0]
        if x.dtype != self.dtype or cos.dtype != self.dtype or not x.is_contiguous():
            raise ValueError(f"decode stack runs contiguous {self.dtype}: got x {x.dtype}")
        scratch = self._scratch_tensor(dims, t, max_ctx, threads)
        rc = self._run(
            layers, len(layers), ctypes.byref(dims), x.data_ptr(), t, cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), q_rows.data_ptr(), q_rows.shape[0],
            tables.data_ptr(), tables.shape[1], ctx_lens.data_ptr(), max_ctx,
            scratch.data_ptr(), threads,
        )  # fmt: skip
        if rc == -3:
            raise ValueError("this CPU has no AVX512-BF16 (vdpbf16ps)")
        if rc != 0:
            raise ValueError(f"decode stack refused its arguments ({rc}): T={t}, {dims.H=}")


class Bf16DecodeStack(AmxPath, DecodeStack):
    """decode_bf16.c: bf16 activations, weights and caches, tg_bf16_pack panels."""

    dtype = torch.bfloat16
    _symbols = (
        "tg_decode_stack_bf16",
        "tg_decode_scratch_bf16",
        "tg_bf16_pack",
        "tg_bf16_panel_width",
    )

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        super().__init__(lib, path)
        self._bind_amx(lib)  # the linears on the bf16 kernel's path give its bits
        c_long, c_void_p = ctypes.c_long, ctypes.c_void_p
        self._greedy = lib.tg_greedy_head_bf16
        self._greedy.restype = ctypes.c_int
        # x, T, rows, nrows, norm_w, eps, H, head, V, ids, scratch, threads
        self._greedy.argtypes = [
            c_void_p, c_long, c_void_p, c_long, c_void_p, ctypes.c_float, c_long, c_void_p,
            c_long, c_void_p, c_void_p, ctypes.c_int,
        ]  # fmt: skip
        self._greedy_scratch = lib.tg_greedy_scratch_bf16
        self._greedy_scratch.restype = c_long
        self._greedy_scratch.argtypes = [c_long, c_long, c_long, ctypes.c_int]

    def greedy_head(
        self, x: Tensor, rows: Tensor, norm_w: Tensor, eps: float, head: Tensor, vocab: int,
        threads: int,
    ) -> Tensor:  # fmt: skip
        """Next-token ids [len(rows)] (int64) of greedy decoding from the stack's output x
        [T, H] (before the final norm): for each row index in `rows`, RMSNorm by `norm_w`,
        the head (`pack`ed panels of [vocab, H]) and the first maximal logit, with the
        op-by-op tail's roundings (the norm kernel, the head on the bf16 kernel, argmax of
        the bf16 logits), in one call."""
        t, h = x.shape
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or norm_w.dtype != x.dtype:
            raise ValueError(f"greedy head takes contiguous bf16 x and norm: got {x.dtype}")
        rows = rows.contiguous()
        n = rows.shape[0]
        ids = torch.empty(n, dtype=torch.long)
        nbytes = self._greedy_scratch(n, h, vocab, threads)
        scratch = torch.empty(nbytes // 4 + 16, dtype=torch.float32)  # 64-byte aligned
        rc = self._greedy(
            x.data_ptr(), t, rows.data_ptr(), n, norm_w.data_ptr(), eps, h, head.data_ptr(),
            vocab, ids.data_ptr(), scratch.data_ptr(), threads,
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"greedy head refused its arguments ({rc}): T={t} H={h} rows={n}")
        return ids

    def pack(self, w: Tensor) -> Tensor:
        """[N, K] bf16 -> tg_bf16_pack panels [ceil(N / width), ceil(K / 2), 2 width] (as the
        bf16 kernel)."""
        w = w.detach().contiguous()
        n, k = w.shape
        panels = torch.empty(-(-n // self.width), -(-k // 2), 2 * self.width, dtype=w.dtype)
        self._pack(w.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def _scratch_tensor(self, dims: StackDims, t: int, max_ctx: int, threads: int) -> Tensor:
        nbytes = self._scratch(ctypes.byref(dims), t, max_ctx, threads)
        return torch.empty(nbytes // 4 + 16, dtype=torch.float32)  # 64-byte aligned by torch


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [T, heads, hd]
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]


def self_check(stack: DecodeStack) -> str | None:
    """Two layers over 3 decode rows and a padding row, against torch ops in fp32 (GQA, a
    window, scattered blocks): None if they agree (bf16: within its roundings of the
    activations), else why not."""
    g = torch.Generator().manual_seed(0)
    dt = stack.dtype
    tol, cache_tol = (1e-4, 1e-5) if dt == torch.float32 else (6e-2, 4e-2)
    # bf16 RoPE takes half of head_dim in whole lanes
    hd, nh, nkv, bs = stack.lanes * (1 if dt == torch.float32 else 2), 4, 2, 4
    h_, i_ = nh * hd, 2 * stack.lanes
    dims = StackDims(h_, nh, nkv, hd, i_, bs, 5, 1e-5, hd**-0.5)

    def rand(*shape: int) -> Tensor:  # values exact in the stack's dtype
        return (torch.randn(*shape, generator=g) * 0.3).to(dt).float()

    refs, plain = [], []
    for _ in range(2):
        w = [rand(h_) + 1, rand(h_) + 1, rand((nh + 2 * nkv) * hd, h_), rand(h_, nh * hd)]
        w += [rand(2 * i_, h_), rand(h_, i_)]
        plain.append(w)
        caches = rand(9, bs, nkv, hd).to(dt), rand(9, bs, nkv, hd).to(dt)
        wqkv, wo, w13, w2 = (stack.pack(m.to(dt)) for m in w[2:])
        refs.append(LayerRefs(w[0].to(dt), w[1].to(dt), wqkv, wo, w13, w2, *caches))
    ctx = torch.tensor([7, 3, 12])  # contexts incl. this token; row 3 is padding
    tables = torch.tensor([[2, 5, 0], [7, 0, 0], [1, 3, 8]])
    slots = torch.stack([tables[s, (c - 1) // bs] * bs + (c - 1) % bs for s, c in enumerate(ctx)])
    slots = torch.cat((slots, torch.tensor([0])))  # padding writes the null block
    x = rand(4, h_)
    angle = rand(4, hd)
    cos, sin = angle.cos().to(dt).float(), angle.sin().to(dt).float()
    want = x.clone()
    expect_caches = [(r.k_cache.float(), r.v_cache.float()) for r in refs]
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
    got = x.to(dt)
    try:
        stack.run(
            stack.layers(refs), dims, got, cos.to(dt), sin.to(dt), slots,
            torch.tensor([0, 1, 2, 4]), torch.cat((tables, torch.zeros(1, 3, dtype=torch.long))),
            torch.cat((ctx, ctx[:1])), 12, 2,
        )  # fmt: skip
    except ValueError as exc:  # bf16: -3 on a CPU without AVX512-BF16
        return f"decode stack self-check failed: {exc}"
    err = (got.float() - want).abs().max().item()
    if not err < tol * max(1.0, want.abs().max().item()):
        return f"decode stack self-check failed: max error {err:.3g} against torch"
    for r, (kc, _) in zip(refs, expect_caches, strict=True):
        bound = cache_tol * max(1.0, kc.abs().max().item())  # bf16: roundings grow per layer
        if not (r.k_cache.float() - kc).abs().max().item() <= bound:
            return "decode stack self-check failed: the KV cache write differs from torch's"
    return None


_LOADERS: dict[torch.dtype, Loader[DecodeStack]] = {
    torch.float32: Loader(
        SOURCE,
        "tg_decode_abi",
        ABI,
        DecodeStack,
        self_check,
        what="decode stack",
        fallback="the op-by-op forward",
    ),
    torch.bfloat16: Loader(
        SOURCE_BF16,
        "tg_decode_bf16_abi",
        ABI_BF16,
        Bf16DecodeStack,
        self_check,
        what="bf16 decode stack",
        fallback="the op-by-op forward",
    ),
}


def load_decode_stack(
    dtype: torch.dtype = torch.float32,
    compiler: str | None = None,
    cache_dir: Path | None = None,
) -> DecodeStack | None:
    """The decode stack for `dtype` (fp32 or bf16), built and checked once per process (and
    per compiler / cache folder); None after one warning line saying why, if it cannot be
    had (bf16: a CPU without AVX512-BF16 fails its self-check)."""
    loader = _LOADERS.get(dtype)
    return None if loader is None else loader.load(compiler, cache_dir)


def decode_unavailable_reason(
    dtype: torch.dtype = torch.float32,
    compiler: str | None = None,
    cache_dir: Path | None = None,
) -> str | None:
    """Why load_decode_stack() gave None (after it ran), else None."""
    loader = _LOADERS.get(dtype)
    return f"no decode stack for {dtype}" if loader is None else loader.reason(compiler, cache_dir)

"""Causal attention of prompts' first chunks in bf16 (attn_bf16.c), on vdpbf16ps (CPUs with
AVX512-BF16: on a 2-core Zen 4 torch's CPU flash attention ran ~70 GFLOP/s against ~425 for
the cores' bf16 products; docs/benchmarks.md, issue 12, session 30) or on AMX tiles where the
CPU has them (`use_amx`, as the bf16 linear kernel; session 31).

    kernel = load_prefill_attention()   # None, with one logged line saying why, if unavailable
    kernel.attend(qkv, firsts, lens, nh, nkv, hd, window, out, threads)

qkv [T, (nh + 2 nkv) hd] bf16 after RoPE: sequence s's queries, keys and values are its rows
firsts[s] .. firsts[s] + lens[s] - 1 (a first chunk: row i is position i). Built and cached like
the other kernels (build.py) and checked against torch's SDPA in fp32 before use.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from tailguard.model.kernels.build import Loader
from tailguard.model.kernels.small_m_bf16 import AmxPath, check_each_path

__all__ = ["PrefillAttention", "load_prefill_attention", "prefill_attention_unavailable_reason"]

SOURCE = Path(__file__).with_name("attn_bf16.c")
ABI = 2
HD_MULTIPLE = 32  # head_dim must be whole panels of 32 (attn_bf16.c)
MAX_REP = 12  # query heads per KV head (one block of 12 query rows holds them)


class PrefillAttention(AmxPath):
    """Blocks of 12 query rows on vdpbf16ps, or of 16 on AMX tiles (`use_amx`)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        c_long, c_void_p = ctypes.c_long, ctypes.c_void_p
        fn = lib.tg_prefill_attention_bf16
        fn.restype = ctypes.c_int
        # qkv, ld, T, firsts, lens, nseq, nh, nkv, hd, scale, window, out, out_ld, threads
        fn.argtypes = [
            c_void_p, c_long, c_long, c_void_p, c_void_p, c_long, c_long, c_long, c_long,
            ctypes.c_float, c_long, c_void_p, c_long, ctypes.c_int,
        ]  # fmt: skip
        self._fn = fn
        self._bind_amx(lib)
        self._lib = lib

    @staticmethod
    def applies(nh: int, nkv: int, hd: int) -> bool:
        return nh % nkv == 0 and nh // nkv <= MAX_REP and hd % HD_MULTIPLE == 0

    def attend(
        self,
        qkv: Tensor,  # [T, (nh + 2 nkv) hd] bf16 contiguous, RoPE applied
        firsts: Tensor,  # [G] int64: each sequence's first row (>= T: a padding row, skipped)
        lens: Tensor,  # [G] int64: its queries (= its keys)
        nh: int,
        nkv: int,
        hd: int,
        window: int,  # 0: none
        out: Tensor,  # [>= T, nh hd] bf16, rows written at each sequence's query rows
        threads: int,
    ) -> None:
        if qkv.dtype != torch.bfloat16 or not qkv.is_contiguous() or out.stride(1) != 1:
            raise ValueError("prefill attention takes contiguous bf16 qkv and unit-stride out")
        firsts, lens = firsts.contiguous(), lens.contiguous()
        rc = self._fn(
            qkv.data_ptr(), qkv.shape[1], qkv.shape[0], firsts.data_ptr(), lens.data_ptr(),
            firsts.shape[0], nh, nkv, hd, hd**-0.5, window, out.data_ptr(), out.stride(0),
            threads,
        )  # fmt: skip
        if rc == -3:
            raise ValueError("this CPU has no AVX512-BF16 (vdpbf16ps)")
        if rc != 0:
            raise ValueError(f"prefill attention refused its arguments ({rc}): {nh=} {nkv=} {hd=}")


def reference(
    qkv: Tensor,
    firsts: list[int],
    lens: list[int],
    nh: int,
    nkv: int,
    hd: int,
    window: int,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The same attention with torch's SDPA in `dtype` (an additive causal / window mask),
    [T + 1, nh hd] in fp32."""
    t = qkv.shape[0]
    out = torch.zeros(t + 1, nh * hd)
    x = qkv.to(dtype)
    for first, n in zip(firsts, lens, strict=True):
        if first >= t:
            continue
        rows = x[first : first + n]
        q = rows[:, : nh * hd].view(n, nh, hd).transpose(0, 1)
        k = rows[:, nh * hd : (nh + nkv) * hd].view(n, nkv, hd).transpose(0, 1)
        v = rows[:, (nh + nkv) * hd :].view(n, nkv, hd).transpose(0, 1)
        i = torch.arange(n)
        seen = i[None, :] <= i[:, None]
        if window > 0:
            seen &= i[None, :] > i[:, None] - window
        mask = torch.zeros(n, n, dtype=dtype).masked_fill(~seen, float("-inf"))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out[first : first + n] = o.transpose(0, 1).reshape(n, nh * hd).float()
    return out


def _check(kernel: PrefillAttention) -> str | None:
    """Two sequences (one of 45 rows: blocks and key panels partial) and a padding row, GQA
    of 4 and of 3 heads, with and without a window, against `reference`; on both paths where
    the CPU has AMX."""
    return check_each_path(kernel, lambda: _check_path(kernel))


def _check_path(kernel: PrefillAttention) -> str | None:
    g = torch.Generator().manual_seed(0)
    for nh, nkv, hd, window in ((8, 2, 32, 0), (6, 2, 64, 7)):
        firsts, lens = [0, 45, 80], [45, 30, 1]  # the last: a padding row (first >= T)
        t = 75
        qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=g).bfloat16()
        out = torch.zeros(t + 1, nh * hd, dtype=torch.bfloat16)
        try:
            kernel.attend(
                qkv, torch.tensor(firsts), torch.tensor(lens), nh, nkv, hd, window, out, 2
            )
        except ValueError as exc:
            return f"prefill attention self-check failed: {exc}"
        want = reference(qkv, firsts, lens, nh, nkv, hd, window)
        err = (out.float() - want).abs().max().item()
        if not err < 0.03 * max(1.0, want.abs().max().item()):
            return f"prefill attention self-check failed: max error {err:.3g} ({nh=} {window=})"
    return None


_LOADER: Loader[PrefillAttention] = Loader(
    SOURCE,
    "tg_attn_bf16_abi",
    ABI,
    PrefillAttention,
    _check,
    what="bf16 prefill attention",
    fallback="torch's SDPA",
)


def load_prefill_attention(
    compiler: str | None = None, cache_dir: Path | None = None
) -> PrefillAttention | None:
    """The kernel, built and checked once per process; None after one warning line saying
    why, if it cannot be had."""
    return _LOADER.load(compiler, cache_dir)


def prefill_attention_unavailable_reason(
    compiler: str | None = None, cache_dir: Path | None = None
) -> str | None:
    return _LOADER.reason(compiler, cache_dir)

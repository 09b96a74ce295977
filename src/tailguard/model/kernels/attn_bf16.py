"""Causal attention of prompts' first chunks in bf16 (attn_bf16.c), on vdpbf16ps (CPUs with
AVX512-BF16: on a 2-core Zen 4 torch's CPU flash attention ran ~70 GFLOP/s against ~425 for
the cores' bf16 products; docs/benchmarks.md, issue 12, session 30) or on AMX tiles where the
CPU has them (`use_amx`, as the bf16 linear kernel; session 31).

    kernel = load_prefill_attention()   # None, with one logged line saying why, if unavailable
    kernel.attend(qkv, firsts, lens, nh, nkv, hd, window, out, threads)

qkv [T, (nh + 2 nkv) hd] bf16 after RoPE: sequence s's queries are its rows firsts[s] ..
firsts[s] + lens[s] - 1; a first chunk's keys and values are the same rows (row i is position
i), a later chunk's (`starts`: positions starts[s] + i) are read from the paged cache (`cache`).
Built and cached like the other kernels (build.py) and checked against torch's SDPA in fp32
before use, a later chunk included.
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
ABI = 4
HD_MULTIPLE = 32  # head_dim must be whole panels of 32 (attn_bf16.c)
MAX_REP = 12  # query heads per KV head (one block of 12 query rows holds them)


class PrefillAttention(AmxPath):
    """Blocks of 12 query rows on vdpbf16ps, or of 16 on AMX tiles (`use_amx`)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        c_long, c_void_p = ctypes.c_long, ctypes.c_void_p
        fn = lib.tg_prefill_attention_bf16
        fn.restype = ctypes.c_int
        # qkv, ld, T, firsts, lens, starts, nseq, nh, nkv, hd, scale, window, k_cache,
        # v_cache, tables, tbl_ld, block_size, out, out_ld, threads, warm, warm_panels,
        # warm_panel_bytes
        fn.argtypes = [
            c_void_p, c_long, c_long, c_void_p, c_void_p, c_void_p, c_long, c_long, c_long,
            c_long, ctypes.c_float, c_long, c_void_p, c_void_p, c_void_p, c_long, c_long,
            c_void_p, c_long, ctypes.c_int, c_void_p, c_long, c_long,
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
        starts: Tensor | None = None,  # [G] int64: each chunk's first position (None: all 0)
        cache: tuple[Tensor, Tensor, Tensor] | None = None,  # k, v [blocks, bs, nkv, hd], tables
        warm: Tensor | None = None,  # the next linear's panels [panels, ...], contiguous
    ) -> None:
        """Causal attention of each sequence's chunk. A chunk at start 0 reads its keys and
        values from its own qkv rows; a later chunk (starts[s] > 0) reads all its start + len
        keys from `cache` (k_cache, v_cache bf16 contiguous, block tables [G, B] int64), which
        must already hold this chunk's own. `warm`: the panels of the linear that runs next
        on the same threads (the layer's wo), which each thread prefetches into its L2, its
        own share of them, while it attends."""
        if qkv.dtype != torch.bfloat16 or not qkv.is_contiguous() or out.stride(1) != 1:
            raise ValueError("prefill attention takes contiguous bf16 qkv and unit-stride out")
        firsts, lens = firsts.contiguous(), lens.contiguous()
        st = None if starts is None else starts.contiguous()
        k_ptr = v_ptr = t_ptr = None
        tbl_ld = block_size = 0
        if cache is not None:
            k_cache, v_cache, tables = cache
            if {k_cache.dtype, v_cache.dtype} != {torch.bfloat16} or not (
                k_cache.is_contiguous() and v_cache.is_contiguous()
            ):
                raise ValueError("prefill attention reads a contiguous bf16 KV cache")
            tables = tables.contiguous()
            k_ptr, v_ptr, t_ptr = k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr()
            tbl_ld, block_size = tables.shape[1], k_cache.shape[1]
        warm_args: tuple[int | None, int, int] = (None, 0, 0)
        if warm is not None and warm.is_contiguous() and warm.dim() >= 1 and warm.shape[0] > 0:
            panels = warm.shape[0]
            warm_args = (warm.data_ptr(), panels, warm.numel() * warm.element_size() // panels)
        rc = self._fn(
            qkv.data_ptr(), qkv.shape[1], qkv.shape[0], firsts.data_ptr(), lens.data_ptr(),
            None if st is None else st.data_ptr(), firsts.shape[0], nh, nkv, hd, hd**-0.5,
            window, k_ptr, v_ptr, t_ptr, tbl_ld, block_size, out.data_ptr(), out.stride(0),
            threads, *warm_args,
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
    return _check_later_chunk(kernel, g)


def _check_later_chunk(kernel: PrefillAttention, g: torch.Generator) -> str | None:
    """A prompt's later chunk (positions 25..44, its keys in a paged cache of shuffled
    blocks) beside a first chunk of 30, with a window of 9, against `reference` of the
    whole prompt."""
    nh, nkv, hd, window = 8, 2, 32, 9
    prompt = torch.randn(45, (nh + 2 * nkv) * hd, generator=g).bfloat16()
    first = torch.randn(30, (nh + 2 * nkv) * hd, generator=g).bfloat16()
    qkv = torch.cat((prompt[25:], first))
    k_cache, v_cache, table = paged(prompt, nh, nkv, hd, block_size=4)
    out = torch.zeros(qkv.shape[0] + 1, nh * hd, dtype=torch.bfloat16)
    try:
        kernel.attend(
            qkv, torch.tensor([0, 20]), torch.tensor([20, 30]), nh, nkv, hd, window, out, 2,
            starts=torch.tensor([25, 0]),
            cache=(k_cache, v_cache, torch.cat((table, torch.zeros_like(table)))),
        )  # fmt: skip
    except ValueError as exc:
        return f"prefill attention self-check failed: {exc}"
    want = torch.cat((
        reference(prompt, [0], [45], nh, nkv, hd, window)[25:45],
        reference(first, [0], [30], nh, nkv, hd, window)[:30],
    ))  # fmt: skip
    err = (out[:50].float() - want).abs().max().item()
    if not err < 0.03 * max(1.0, want.abs().max().item()):
        return f"prefill attention self-check failed on a later chunk: max error {err:.3g}"
    return None


def paged(
    rows: Tensor, nh: int, nkv: int, hd: int, block_size: int, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """(k_cache, v_cache, block table [1, B]): a paged cache holding the keys and values of
    one sequence's qkv rows (positions 0..n-1) in shuffled blocks, block 0 left empty as the
    engine's null block; what a later chunk of that sequence reads."""
    n = rows.shape[0]
    nb = -(-n // block_size)
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)) + 1
    k_cache = torch.zeros(nb + 1, block_size, nkv, hd, dtype=rows.dtype)
    v_cache = torch.zeros_like(k_cache)
    for j in range(n):
        b, o = int(order[j // block_size]), j % block_size
        k_cache[b, o] = rows[j, nh * hd : (nh + nkv) * hd].view(nkv, hd)
        v_cache[b, o] = rows[j, (nh + nkv) * hd :].view(nkv, hd)
    return k_cache, v_cache, order[None, :]


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

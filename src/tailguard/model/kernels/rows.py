"""Row kernels over a step's logits (rows.c): greedy argmax and inverse-CDF sampling.

    kernel = load_row_kernel()            # None, with one logged line saying why, if unavailable
    ids = kernel.argmax(logits, rows)      # logits [R, V] fp32; rows: the row indices wanted
    ids = kernel.sample(logits, rows, temperatures, uniforms)

Built and cached like the small-M linear (build.py), checked against torch (`self_check`)
before first use; anything failing means None and the engine's torch path (engine/sampling.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from tailguard.model.kernels.build import Loader

__all__ = ["RowKernel", "load_row_kernel", "row_kernel_unavailable_reason", "self_check"]

SOURCE = Path(__file__).with_name("rows.c")
ABI = 8
MAX_BF16_HEAD_DIM = 256  # rows.c HD_MAX: the bf16 decode attention's fp32 sums
MAX_REP = 16  # rows.c REP_MAX: query heads per KV head the decode attention takes


class RowKernel:
    """argmax and sampling over chosen rows of fp32 CPU logits [R, V] with unit inner stride."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        c_long, c_void_p, c_int = ctypes.c_long, ctypes.c_void_p, ctypes.c_int
        self._argmax = lib.tg_argmax_rows
        self._argmax.restype = None
        # x, ld, rows, nrows, n, out, threads
        self._argmax.argtypes = [c_void_p, c_long, c_void_p, c_long, c_long, c_void_p, c_int]
        self._sample = lib.tg_sample_rows
        self._sample.restype = None
        # x, ld, rows, nrows, n, inv_temp, u, out, threads
        self._sample.argtypes = [
            c_void_p, c_long, c_void_p, c_long, c_long, c_void_p, c_void_p, c_void_p, c_int
        ]  # fmt: skip
        self._attn = lib.tg_decode_attention
        self._attn.restype = ctypes.c_int
        c_float = ctypes.c_float
        # q, q_ld, q_rows, nseq, pad_row, k, v, tables, tbl_ld, ctx, max_ctx, bs, nh, nkv, hd,
        # scale, window, out, out_ld, threads
        self._attn.argtypes = [
            c_void_p, c_long, c_void_p, c_long, c_long, c_void_p, c_void_p, c_void_p, c_long,
            c_void_p, c_long, c_long, c_long, c_long, c_long, c_float, c_long, c_void_p, c_long,
            c_int,
        ]  # fmt: skip
        self._attn_bf16 = lib.tg_decode_attention_bf16
        self._attn_bf16.restype = ctypes.c_int
        self._attn_bf16.argtypes = self._attn.argtypes
        self.lanes = int(lib.tg_rows_lanes())
        self._rms = lib.tg_rms_norm
        self._rms.restype = None
        self._rms.argtypes = [c_void_p, c_void_p, c_void_p, c_long, c_long, c_float]
        self._silu = lib.tg_silu_mul
        self._silu.restype = None
        self._silu.argtypes = [c_void_p, c_void_p, c_long, c_long]
        self._rope = lib.tg_rope_kv
        self._rope.restype = None
        # x, ld, T, heads, hd, cos, sin, bf16, nkv, slots, k_cache, v_cache, threads
        self._rope.argtypes = [
            c_void_p, c_long, c_long, c_long, c_long, c_void_p, c_void_p, c_int, c_long,
            c_void_p, c_void_p, c_void_p, c_int,
        ]  # fmt: skip
        c_int = ctypes.c_int
        self._rms_bf16 = lib.tg_rms_norm_bf16
        self._rms_bf16.restype = None
        self._rms_bf16.argtypes = [*self._rms.argtypes, c_int]
        self._silu_bf16 = lib.tg_silu_mul_bf16
        self._silu_bf16.restype = None
        self._silu_bf16.argtypes = [*self._silu.argtypes, c_int]
        self._round = lib.tg_round_bf16
        self._round.restype = None
        self._round.argtypes = [c_void_p, c_void_p, c_long]
        self._lib = lib

    def to_bf16(self, x: Tensor) -> Tensor:
        """Contiguous fp32 rounded to bf16 as the kernels' bf16 outputs are (nearest even,
        denormals kept: torch's rounding; NaN -> 0x7fc0 as c10's scalar conversion)."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"to_bf16 takes contiguous fp32: got {x.dtype}")
        y = torch.empty(x.shape, dtype=torch.bfloat16)
        self._round(x.data_ptr(), y.data_ptr(), x.numel())
        return y

    # The elementwise ops take contiguous fp32 (one thread: a decode step's few rows) or bf16
    # (rounded where torch's bf16 ops round; rows split over `threads`: a bf16 prefill's
    # thousands of rows), every tensor of a call in the same dtype.
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, threads: int = 1) -> Tensor:
        """weight * x / sqrt(mean(x^2) + eps) over the last dim of contiguous [T, H]."""
        y = torch.empty_like(x)
        args = (x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
        if x.dtype == torch.bfloat16:
            self._rms_bf16(*args, threads)
        else:
            self._rms(*args)
        return y

    def silu_mul(self, gate_up: Tensor, threads: int = 1) -> Tensor:
        """silu(gate) * up of contiguous [T, 2I] (gate first): [T, I]."""
        t, two_i = gate_up.shape
        y = gate_up.new_empty(t, two_i // 2)
        if gate_up.dtype == torch.bfloat16:
            self._silu_bf16(gate_up.data_ptr(), y.data_ptr(), t, two_i // 2, threads)
        else:
            self._silu(gate_up.data_ptr(), y.data_ptr(), t, two_i // 2)
        return y

    def rope_(
        self,
        x: Tensor,
        heads: int,
        head_dim: int,
        cos: Tensor,
        sin: Tensor,
        threads: int = 1,
        kv: tuple[int, Tensor, Tensor, Tensor] | None = None,
    ) -> None:
        """Rotate-half RoPE in place on the first `heads` heads of each row of contiguous
        x [T, >= heads * head_dim]; cos, sin contiguous [T, head_dim]. bf16: head_dim / 2 a
        whole number of lanes. With kv = (nkv, slots [T] int64, k_cache, v_cache), each row's
        last nkv rotated heads (K) and the nkv after them (V) are also written to its slot
        of the caches (contiguous [..., nkv, head_dim] in x's dtype), in the same pass."""
        nkv, slots, kc, vc = 0, None, None, None
        if kv is not None:
            nkv, slot_t, k_cache, v_cache = kv
            for c in (k_cache, v_cache):
                if c.dtype != x.dtype or not c.is_contiguous() or c.shape[-2:] != (nkv, head_dim):
                    raise ValueError(
                        f"KV cache must be contiguous {x.dtype} [..., {nkv}, {head_dim}]"
                    )
            if slot_t.dtype != torch.int64 or slot_t.shape != (x.shape[0],):
                raise ValueError(f"slots must be int64 [{x.shape[0]}]: got {slot_t.dtype}")
            if not 0 < nkv <= heads or slot_t.stride(0) != 1:
                raise ValueError(f"need 0 < nkv <= heads and unit-stride slots: nkv={nkv}")
            slots, kc, vc = slot_t.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        bf16 = int(x.dtype == torch.bfloat16)
        args = (x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim)
        self._rope(*args, cos.data_ptr(), sin.data_ptr(), bf16, nkv, slots, kc, vc, threads)

    def decode_attention(
        self,
        q: Tensor,
        q_rows: Tensor,
        pad_row: int,
        k_cache: Tensor,
        v_cache: Tensor,
        tables: Tensor,
        ctx_lens: Tensor,
        max_ctx: int,
        window: int,
        out: Tensor,
        threads: int = 1,
    ) -> None:
        """One query per sequence (a decode group), over the paged cache in place: for each
        sequence s with q_rows[s] < pad_row, out[q_rows[s]] = softmax(q K^T / sqrt(hd)) V over
        its last ctx_lens[s] positions (within `window`, 0: none), GQA heads as in
        transformers' repeat_kv. q [T, nh, hd] (rows may be strided: a view of the fused
        qkv), out [T, nh * hd] contiguous; caches [blocks, bs, nkv, hd]: all four fp32, or all
        bf16 (scores and sums in fp32, the output rounded once); tables [G, B] and ctx_lens [G]
        int64."""
        _, nh, hd = q.shape
        _, bs, nkv, _ = k_cache.shape
        if q.stride(2) != 1 or q.stride(1) != hd:
            raise ValueError(f"decode attention reads q rows of [nh, hd]: strides {q.stride()}")
        dtypes = {q.dtype, k_cache.dtype, v_cache.dtype, out.dtype}
        if dtypes not in ({torch.float32}, {torch.bfloat16}):
            raise ValueError(f"decode attention needs all fp32 or all bf16 tensors: got {dtypes}")
        fn = self._attn if q.dtype == torch.float32 else self._attn_bf16
        rc = fn(
            q.data_ptr(), q.stride(0), q_rows.data_ptr(), q_rows.shape[0], pad_row,
            k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
            ctx_lens.data_ptr(), max_ctx, bs, nh, nkv, hd, hd**-0.5, window, out.data_ptr(),
            out.stride(0), threads,
        )  # fmt: skip
        if rc == -1:
            raise ValueError(
                f"decode attention takes up to {MAX_REP} query heads a KV head, and bf16 up to "
                f"{MAX_BF16_HEAD_DIM} of head_dim"
            )
        if rc != 0:  # pragma: no cover - a few KiB of scratch per thread
            raise MemoryError("decode attention: no memory for the scores")

    @staticmethod
    def _checked(logits: Tensor) -> None:
        if (
            logits.dim() != 2
            or logits.dtype != torch.float32
            or logits.device.type != "cpu"
            or logits.stride(1) != 1
        ):
            raise ValueError(
                "row kernels need CPU fp32 logits [R, V] with unit inner stride: got "
                f"{logits.dtype} {tuple(logits.shape)} on {logits.device}"
            )

    def argmax(self, logits: Tensor, rows: Sequence[int], threads: int = 1) -> list[int]:
        """The first maximal column of each of `rows` (a NaN counts as the maximum)."""
        self._checked(logits)
        idx = torch.tensor(rows, dtype=torch.long)
        out = torch.empty(len(rows), dtype=torch.long)
        self._argmax(
            logits.data_ptr(), logits.stride(0), idx.data_ptr(), len(rows), logits.shape[1],
            out.data_ptr(), threads,
        )  # fmt: skip
        return out.tolist()

    def sample(
        self,
        logits: Tensor,
        rows: Sequence[int],
        temperatures: Sequence[float],
        uniforms: Tensor,
        threads: int = 1,
    ) -> list[int]:
        """For each of `rows`: the column where u * sum(e) falls in the running sum of
        e = exp((logits - max) / temperature), u from `uniforms` (float64, one per row, in
        [0, 1)): a draw from softmax(logits / temperature)."""
        self._checked(logits)
        n = len(rows)
        if uniforms.dtype != torch.float64 or uniforms.numel() != n:
            raise ValueError(f"need {n} float64 uniforms, got {uniforms.dtype} {uniforms.numel()}")
        idx = torch.tensor(rows, dtype=torch.long)
        inv = torch.tensor([1.0 / t for t in temperatures], dtype=torch.float32)
        u = uniforms.contiguous()
        out = torch.empty(n, dtype=torch.long)
        self._sample(
            logits.data_ptr(), logits.stride(0), idx.data_ptr(), n, logits.shape[1],
            inv.data_ptr(), u.data_ptr(), out.data_ptr(), threads,
        )  # fmt: skip
        return out.tolist()


def self_check(kernel: RowKernel) -> str | None:
    """None if argmax matches torch and sampling lands where the CDF says, else why not."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1000, generator=g)
    x[2, 17] = x[2, 900] = 50.0  # a tie: the first wins
    want = x.argmax(dim=-1).tolist()
    got = kernel.argmax(x, range(5))
    if got != want:
        return f"argmax self-check failed: {got} != {want}"
    flat = torch.zeros(3, 777)  # uniform rows: u picks column floor(u * 777)
    u = torch.tensor([0.0, 0.5, 0.999], dtype=torch.float64)
    got = kernel.sample(flat, range(3), [1.0, 0.7, 2.0], u)
    if [abs(a - int(b * 777)) <= 1 for a, b in zip(got, u.tolist(), strict=True)] != [True] * 3:
        return f"sampling self-check failed on uniform rows: {got}"
    peaked = torch.full((2, 300), -30.0)
    peaked[0, 123] = peaked[1, 299] = 30.0
    got = kernel.sample(peaked, [0, 1], [1.0, 1.0], torch.tensor([0.3, 0.99], dtype=torch.float64))
    if got != [123, 299]:
        return f"sampling self-check failed on peaked rows: {got}"
    special = rounding_cases()
    ours, torchs = kernel.to_bf16(special), special.bfloat16()
    # NaN stays NaN (torch's own paths disagree on its bits: 0x7fc0 scalar, 0xffff vectorized)
    same = (ours.view(torch.int16) == torchs.view(torch.int16)) | (ours.isnan() & torchs.isnan())
    if not same.all():
        bad = int((~same).nonzero()[0].item())
        return (
            f"bf16 rounding self-check failed: {special[bad].item()!r} -> "
            f"{int(ours.view(torch.int16)[bad].item()) & 0xFFFF:#06x}, torch "
            f"{int(torchs.view(torch.int16)[bad].item()) & 0xFFFF:#06x}"
        )
    return None


def rounding_cases() -> Tensor:
    """fp32 values whose bf16 rounding takes every path: ties to even both ways, just off
    ties, denormals (the hardware conversion flushes them, the kernels must not), NaNs with a
    sign and a payload (torch makes them 0x7fc0), infinities, zeros and the largest finite,
    each in a vector of its own and among ordinary values."""
    bits = [
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF, 0x00000001, 0x807FFFFF, 0x00400000,
        0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
        0x7F7FFFFF, 0x7F7F8000, 0x33800000, 0x80008000,
    ]  # fmt: skip
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(1)
    ordinary = torch.randn(64, generator=g) * 3
    alone = [torch.cat((v.repeat(16), ordinary[:3])) for v in special]  # + a scalar tail
    mixed = ordinary.clone()
    mixed[5 : 5 + len(bits)] = special
    return torch.cat((*alone, mixed, ordinary))


_LOADER: Loader[RowKernel] = Loader(
    SOURCE, "tg_rows_abi", ABI, RowKernel, self_check, what="row kernels", fallback="torch"
)


def row_kernel_unavailable_reason(
    compiler: str | None = None, cache_dir: Path | None = None
) -> str | None:
    """Why `load_row_kernel` gave None (after it ran), else None."""
    return _LOADER.reason(compiler, cache_dir)


def load_row_kernel(compiler: str | None = None, cache_dir: Path | None = None) -> RowKernel | None:
    """The row kernels, built and checked once per process (and per compiler / cache folder);
    None after one warning line saying why, if they cannot be had."""
    return _LOADER.load(compiler, cache_dir)

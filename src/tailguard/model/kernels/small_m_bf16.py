"""The bf16 linear of our own (gemv_bf16.c), for CPUs with AVX512-BF16, on AMX tiles where the
CPU has them (`use_amx`; the same panels serve both paths).

    kernel = load_bf16_kernel()      # None, with one logged line saying why, if unavailable
    wp = kernel.pack(w)              # w [N, K] bf16 -> panels, once
    y = kernel.linear(x, wp)         # x [M, K] bf16 -> [M, N] bf16 (fp32 sums, rounded once)

Built and cached by build.py like the fp32 kernel (small_m.py) and checked against a float64
product before use. A CPU without the instructions (AVX2 only), no compiler, a failed build or
a wrong result mean None: the engine uses oneDNN's bf16 matmul.

Measured on a 2-core AMD EPYC (Zen 4, avx512_bf16, no AMX; docs/benchmarks.md, issue 12,
session 30), the model M's shapes over distinct weights: 1.1-2.0x oneDNN's speed at 1-8 rows
(27-51 GB/s of weights against 18-27), 1.1-1.2x at 32, 1.04-1.15x at 64, equal at 256 rows
(~425 GFLOP/s each, the `vdpbf16ps` peak of the two cores): so one copy of each weight, in
this layout, serves every step. On a 2-core Xeon with AMX (session 31) the tile path runs
1.7-1.8x oneDNN's AMX at 1-16 rows, 1.4x at 64 and 0.9-1.1x at 256-1,024 (vdpbf16ps alone
there: ~90-150 GFLOP/s, 5-10x slower than AMX above 32 rows).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tailguard.model.kernels.build import Loader
from tailguard.model.kernels.pages import huge_empty
from tailguard.model.kernels.small_m import PanelWeight

__all__ = [
    "AmxPath",
    "Bf16Kernel",
    "bf16_kernel_unavailable_reason",
    "check_each_path",
    "load_bf16_kernel",
]

SOURCE = Path(__file__).with_name("gemv_bf16.c")
FUSED_MIN_ROWS = 33  # tg_bf16_linear_fused runs on AMX's blocked path only: above AMX_XB rows
ABI = 7  # tg_bf16_kernel_abi() of the source this module expects


class AmxPath:
    """The AMX switch of a library built from gemv_bf16.c or a C file that includes it
    (tg_bf16_set_amx; each library has its own): `amx` says whether its products run on AMX
    tiles, `use_amx` turns them on or off. On by default where the build, the CPU and Linux
    (the tile-state permission) allow."""

    amx: bool = False
    _set_amx: Any = None

    def _bind_amx(self, lib: ctypes.CDLL) -> None:
        fn = lib.tg_bf16_set_amx
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int]
        self._set_amx = fn
        self.amx = bool(fn(1))

    def use_amx(self, on: bool) -> bool:
        """On AMX tiles (on) or on vdpbf16ps alone; returns whether AMX is now on."""
        self.amx = bool(self._set_amx(int(on)))
        return self.amx


def check_each_path(kernel: AmxPath, check: Callable[[], str | None]) -> str | None:
    """`check()` on the vdpbf16ps path, then on AMX tiles where the kernel has them; the first
    failure (naming its path) or None. The kernel is left on the path it was on."""
    amx = kernel.amx
    try:
        for on in (False, True) if amx else (False,):
            kernel.use_amx(on)
            if (why := check()) is not None:
                return f"{why} ({'AMX' if on else 'vdpbf16ps'})"
    finally:
        kernel.use_amx(amx)
    return None


class Bf16Kernel(AmxPath):
    """y = x @ w^T for bf16 x [M, K] (any M) and w packed once by `pack` from [N, K] bf16."""

    dtype = torch.bfloat16

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        c_long, c_void_p = ctypes.c_long, ctypes.c_void_p
        fn = lib.tg_bf16_linear
        fn.restype = ctypes.c_int
        # x, ldx, panels, y, ldy, M, N, K, threads
        fn.argtypes = [c_void_p, c_long, c_void_p, c_void_p, c_long, c_long, c_long, c_long]
        fn.argtypes.append(ctypes.c_int)
        self._fn = fn
        fused = lib.tg_bf16_linear_fused
        fused.restype = ctypes.c_int
        # x, ldx, panels, y, ldy, M, N, K, threads, norm_w, eps, silu, res, ldres
        fused.argtypes = [*fn.argtypes, c_void_p, ctypes.c_float, ctypes.c_int, c_void_p, c_long]
        self._fused = fused
        self._pack = lib.tg_bf16_pack
        self._pack.restype = None
        self._pack.argtypes = [c_void_p, c_void_p, c_long, c_long]
        self.width = int(lib.tg_bf16_panel_width())
        self.supported = bool(lib.tg_bf16_supported())
        self._buffers = lib.tg_bf16_amx_buffers
        self._buffers.restype = ctypes.c_int
        self._buffers.argtypes = [ctypes.c_int]
        self._bind_amx(lib)  # the same panels serve both paths
        self._lib = lib  # keeps the library loaded

    def pack(self, w: Tensor) -> PanelWeight:
        """[N, K] bf16 -> panels [ceil(N / 32), ceil(K / 2), 64] (pairs of k side by side per
        output column; a new tensor, w is left as it is)."""
        if w.dim() != 2 or w.dtype != torch.bfloat16 or w.device.type != "cpu":
            raise ValueError(f"bf16 kernel packs CPU bf16 [N, K]: got {w.dtype} {w.shape}")
        w = w.detach().contiguous()
        n, k = w.shape
        panels = huge_empty((-(-n // self.width), -(-k // 2), 2 * self.width), w.dtype)
        self._pack(w.data_ptr(), panels.data_ptr(), n, k)
        return PanelWeight(panels, n, k)

    def linear(self, x: Tensor, w: PanelWeight, threads: int | None = None) -> Tensor:
        """[M, K] x [N, K]^T -> [M, N] bf16. x may be a row-strided view (read in place up to
        12 rows when its rows start on 4-byte boundaries; copied into pairs above)."""
        m, k = x.shape
        if k != w.in_features or x.stride(1) != 1 or x.dtype != torch.bfloat16:
            raise ValueError(
                f"bf16 kernel needs bf16 x [M, {w.in_features}] with unit inner stride: "
                f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}"
            )
        if x.data_ptr() % 4:  # the kernel reads (k, k+1) pairs as 32-bit words
            x = x.clone()
        n = w.out_features
        y = torch.empty(m, n, dtype=torch.bfloat16)
        nt = torch.get_num_threads() if threads is None else threads
        rc = self._fn(x.data_ptr(), x.stride(0), w.panels.data_ptr(), y.data_ptr(), n, m, n, k, nt)
        if rc != 0:  # pragma: no cover - -2: out of memory for x's paired copy
            raise MemoryError(f"bf16 kernel failed ({rc}) on x {tuple(x.shape)}, N={n}")
        return y

    def linear_fused(
        self,
        x: Tensor,
        w: PanelWeight,
        threads: int | None = None,
        *,
        silu: bool = False,
        norm: tuple[Tensor, float] | None = None,
        residual: Tensor | None = None,
    ) -> Tensor | None:
        """x @ w^T with a decoder layer's neighbouring ops in the same call (gemv_bf16.c's
        tg_bf16_linear_fused), each with the bits of the separate calls:
        - norm (weight [K] bf16, eps): x RMSNorm'd first, as the row kernel's rms_norm;
        - silu: w is w13 ([2I, K]: gate rows, then up rows) and the result silu(gate) * up
          [M, I], as `linear` and then rows.c's bf16 silu_mul;
        - residual (bf16 [M, N], unit inner stride): residual + the product, as torch's bf16
          add after `linear` (not with silu).
        None where that path does not run (up to 32 rows, off AMX, outputs not whole panels:
        make the separate calls)."""
        self._check_x(x, w)
        m, k = x.shape
        n = w.out_features // 2 if silu else w.out_features
        nw, eps = self._norm_args(norm, k)
        res, ldres = None, 0
        if residual is not None:
            if (
                silu
                or residual.shape != (m, n)
                or residual.stride(1) != 1
                or (residual.dtype != x.dtype)
            ):
                raise ValueError(
                    f"residual must be bf16 [{m}, {n}] with unit inner stride, and not with "
                    f"silu: got {residual.dtype} {tuple(residual.shape)} strides "
                    f"{residual.stride()}"
                )
            res, ldres = residual.data_ptr(), residual.stride(0)
        if not self.amx or m < FUSED_MIN_ROWS or n % self.width:
            return None  # the C call would return -4: no output buffer, no call (small steps)
        y = torch.empty(m, n, dtype=torch.bfloat16)
        nt = torch.get_num_threads() if threads is None else threads
        rc = self._fused(x.data_ptr(), x.stride(0), w.panels.data_ptr(), y.data_ptr(), n, m, n,
                         k, nt, nw, eps, int(silu), res, ldres)  # fmt: skip
        if rc == -4:
            return None
        if rc != 0:  # pragma: no cover - -2: out of memory
            raise MemoryError(f"bf16 kernel failed ({rc}) on x {tuple(x.shape)}, N={n}")
        return y

    def use_amx_buffers(self, on: bool) -> None:
        """Tests: off, `linear` and `linear_fused` with a residual, on AMX above 32 rows, take
        the path they fall back to where there is no memory for their per-thread buffer (K
        unchunked); on (the default) back."""
        self._buffers(int(on))

    @staticmethod
    def _check_x(x: Tensor, w: PanelWeight) -> None:
        if x.shape[1] != w.in_features or x.stride(1) != 1 or x.dtype != torch.bfloat16:
            raise ValueError(
                f"bf16 kernel needs bf16 x [M, {w.in_features}] with unit inner stride: "
                f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}"
            )

    @staticmethod
    def _norm_args(norm: tuple[Tensor, float] | None, k: int) -> tuple[int | None, float]:
        """(weight pointer or None, eps) of an RMSNorm folded into a call's x copy."""
        if norm is None:
            return None, 0.0
        weight, eps = norm
        if weight.shape != (k,) or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
            raise ValueError(f"norm weight must be contiguous bf16 [{k}]: got {weight.dtype} "
                             f"{tuple(weight.shape)}")  # fmt: skip
        return weight.data_ptr(), eps


def _check(kernel: Bf16Kernel) -> str | None:
    """Against a float64 product on shapes off every block size (odd K, > 12 rows, partial
    panels): None if right (within one bf16 rounding of the output), else why not."""
    if not kernel.supported:
        return "this CPU has no AVX512-BF16 (vdpbf16ps)"
    return check_each_path(kernel, lambda: _check_products(kernel))


def _check_products(kernel: Bf16Kernel) -> str | None:
    g = torch.Generator().manual_seed(0)
    shapes = ((1, 37, 46), (3, 50, 19), (8, 29, 68), (12, 64, 64), (13, 70, 33))
    amx_shapes = ((5, 40, 64), (16, 33, 96), (17, 64, 64), (45, 70, 128))  # K % 32 == 0
    for m, n, k in shapes + amx_shapes:
        x = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        for threads in (1, 2):
            got = kernel.linear(x, kernel.pack(w), threads).double()
            want = x.double() @ w.double().t()
            err = ((got - want).abs() / (want.abs() + 1.0)).max().item()
            if err > 2.0**-7:
                return f"self-check failed at M={m} N={n} K={k}: max relative error {err:.3g}"
    return None


_LOADER: Loader[Bf16Kernel] = Loader(
    SOURCE,
    "tg_bf16_kernel_abi",
    ABI,
    Bf16Kernel,
    _check,
    what="bf16 linear kernel",
    fallback="oneDNN",
)


def load_bf16_kernel(
    compiler: str | None = None, cache_dir: Path | None = None
) -> Bf16Kernel | None:
    """The kernel, built and checked once per process (and per compiler / cache folder);
    None after one warning line saying why, if it cannot be had."""
    return _LOADER.load(compiler, cache_dir)


def bf16_kernel_unavailable_reason(
    compiler: str | None = None, cache_dir: Path | None = None
) -> str | None:
    """Why load_bf16_kernel() gave None (after it ran), else None."""
    return _LOADER.reason(compiler, cache_dir)

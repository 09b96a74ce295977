"""The small-M fp32 linear (gemv.c): compiled once per machine, loaded with ctypes.

    kernel = load_small_m_kernel()   # None, with one logged line saying why, if unavailable
    wp = kernel.pack(w)              # w [N, K] fp32 -> panels, once
    y = kernel.linear(x, wp)         # x [M, K] -> [M, N]

Built and cached by build.py (`cc -O3 -march=native -fopenmp -shared -fPIC gemv.c`, keyed by
source, command, compiler version and CPU flags). The library is checked against torch on a
small odd-shaped product before use. Anything failing (no compiler, compile error, load
error, wrong result) means None: callers fall back to oneDNN.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from tailguard.model.kernels.build import Loader
from tailguard.model.kernels.pages import huge_empty

__all__ = [
    "MAX_M",
    "LinearKernel",
    "PanelWeight",
    "SmallMKernel",
    "load_small_m_kernel",
    "small_m_unavailable_reason",
]

SOURCE = Path(__file__).with_name("gemv.c")
ABI = 4  # tg_kernel_abi() of the source this module expects

# Rows up to which the kernel clearly beats oneDNN's fp32 matmul: measured on the 2-core
# AVX-512 Xeon (docs/benchmarks.md, issue 12, session 21) 0.7x its time at 16-32 rows,
# 0.85-0.95x at 64; 0.9-1.23x at 128-1,024 (noisy). The engine runs every row count on it;
# the self-check covers up to this size.
MAX_M = 64


@dataclass(frozen=True)
class PanelWeight:
    """A [N, K] weight in the kernel's layout: panels of `width` output columns, each
    [K, width], zero-padded to whole panels (gemv.c, tg_pack)."""

    panels: Tensor  # [ceil(N / width), K, width] fp32, contiguous
    out_features: int  # N
    in_features: int  # K

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


class LinearKernel(Protocol):
    """A linear of our own in one dtype: weights packed once, then y = x @ w^T for any M
    (SmallMKernel: fp32; small_m_bf16.Bf16Kernel: bf16)."""

    dtype: torch.dtype
    width: int  # output columns per panel
    amx: bool  # runs on AMX tiles (bf16 on CPUs that have them)

    def pack(self, w: Tensor) -> PanelWeight: ...

    def linear(self, x: Tensor, w: PanelWeight, threads: int | None = None) -> Tensor: ...

    def linear_fused(
        self,
        x: Tensor,
        w: PanelWeight,
        threads: int | None = None,
        *,
        silu: bool = False,
        norm: tuple[Tensor, float] | None = None,
        residual: Tensor | None = None,
    ) -> Tensor | None: ...


class SmallMKernel:
    """y = x @ w^T for fp32 x [M, K] (any M) and w packed once by `pack` from [N, K]."""

    dtype = torch.float32
    amx = False

    def __init__(self, lib: ctypes.CDLL, path: Path, max_m: int = MAX_M) -> None:
        self.path = path
        self.max_m = max_m
        c_long, c_void_p = ctypes.c_long, ctypes.c_void_p
        fn = lib.tg_linear_small_m
        fn.restype = ctypes.c_int
        # x, ldx, panels, y, ldy, M, N, K, threads
        fn.argtypes = [c_void_p, c_long, c_void_p, c_void_p, c_long, c_long, c_long, c_long]
        fn.argtypes.append(ctypes.c_int)
        self._fn = fn
        self._pack = lib.tg_pack
        self._pack.restype = None
        self._pack.argtypes = [c_void_p, c_void_p, c_long, c_long]
        self.width = int(lib.tg_panel_width())
        self._lib = lib  # keeps the library loaded

    def pack(self, w: Tensor) -> PanelWeight:
        """[N, K] fp32 -> the kernel's panels (a new tensor; w is left as it is)."""
        if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"small-M kernel packs CPU fp32 [N, K]: got {w.dtype} {w.shape}")
        w = w.detach().contiguous()
        n, k = w.shape
        panels = huge_empty((-(-n // self.width), k, self.width), torch.float32)
        self._pack(w.data_ptr(), panels.data_ptr(), n, k)
        return PanelWeight(panels, n, k)

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
        """No fused neighbours in fp32 (gemv.c): None, the caller makes the separate calls."""
        return None

    def linear(self, x: Tensor, w: PanelWeight, threads: int | None = None) -> Tensor:
        """[M, K] x [N, K]^T -> [M, N]. x may have a row stride (a view of wider rows): the
        kernel reads it and the panels through their data pointers, no copies."""
        m, k = x.shape
        if k != w.in_features or x.stride(1) != 1 or x.dtype != torch.float32:
            raise ValueError(
                f"small-M kernel needs fp32 x [M, {w.in_features}] with unit inner stride: "
                f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}"
            )
        n = w.out_features
        y = torch.empty(m, n, dtype=torch.float32)
        nt = torch.get_num_threads() if threads is None else threads
        rc = self._fn(x.data_ptr(), x.stride(0), w.panels.data_ptr(), y.data_ptr(), n, m, n, k, nt)
        if rc != 0:  # pragma: no cover - -2: out of memory for x's transposed copy
            raise MemoryError(f"small-M kernel failed ({rc}) on x {tuple(x.shape)}, N={n}")
        return y


def _check(kernel: SmallMKernel) -> str | None:
    """Compare against torch on shapes off every block size: None if right, else why not."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 37, 45), (3, 50, 19), (8, 29, 67), (kernel.max_m, 73, 33)):
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g)
        for threads in (1, 2):
            got = kernel.linear(x, kernel.pack(w), threads)
            want = x.double() @ w.double().t()
            err = (got.double() - want).abs().max().item()
            if err > 1e-4 * max(1.0, want.abs().max().item()):
                return f"self-check failed at M={m} N={n} K={k}: max error {err:.3g}"
    return None


_LOADER: Loader[SmallMKernel] = Loader(
    SOURCE,
    "tg_kernel_abi",
    ABI,
    SmallMKernel,
    _check,
    what="small-M kernel",
    fallback="oneDNN",
)


def load_small_m_kernel(
    compiler: str | None = None, cache_dir: Path | None = None
) -> SmallMKernel | None:
    """The kernel, built and checked once per process (and per compiler / cache folder);
    None after one warning line saying why, if it cannot be had."""
    return _LOADER.load(compiler, cache_dir)


def small_m_unavailable_reason(
    compiler: str | None = None, cache_dir: Path | None = None
) -> str | None:
    """Why load_small_m_kernel() gave None (after it ran), else None."""
    return _LOADER.reason(compiler, cache_dir)

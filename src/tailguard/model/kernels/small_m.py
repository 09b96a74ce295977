"""The small-M fp32 linear (gemv.c): compiled once per machine, loaded with ctypes.

    kernel = load_small_m_kernel()   # None, with one logged line saying why, if unavailable
    wp = kernel.pack(w)              # w [N, K] fp32 -> panels, once
    y = kernel.linear(x, wp)         # x [M, K] -> [M, N]

Build: `cc -O3 -march=native -fopenmp -shared -fPIC gemv.c` into
`$TAILGUARD_CACHE/kernels/<hash>.so` (default `~/.cache/tailguard/kernels`), the
hash covering the source, the command, the compiler's version and the CPU's flags: a new CPU
or compiler builds afresh, and a process that finds the library built uses it without a
compiler. The library is checked against torch on a small odd-shaped product before use.
Anything failing (no compiler, compile error, load error, wrong result) means None: callers
fall back to oneDNN.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "MAX_M",
    "PanelWeight",
    "SmallMKernel",
    "load_small_m_kernel",
    "small_m_unavailable_reason",
]

log = logging.getLogger("tailguard.engine")

SOURCE = Path(__file__).with_name("gemv.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ABI = 3  # tg_kernel_abi() of the source this module expects

# Rows up to which the kernel clearly beats oneDNN's fp32 matmul: measured on the 2-core
# AVX-512 Xeon (docs/benchmarks.md, issue 12, session 21) 0.7x its time at 16-32 rows,
# 0.85-0.95x at 64; 0.9-1.23x at 128-1,024 (noisy). The engine runs every row count on it;
# the self-check covers up to this size.
MAX_M = 64

_loaded: dict[tuple[str, str], SmallMKernel | str] = {}  # (compiler, cache dir) -> kernel | why not


def default_compiler() -> str:
    return os.environ.get("CC") or "cc"


def default_cache_dir() -> Path:
    """`$TAILGUARD_CACHE/kernels` (default `~/.cache/tailguard/kernels`), beside the
    embedded checkpoint."""
    root = os.environ.get("TAILGUARD_CACHE") or str(Path.home() / ".cache" / "tailguard")
    return Path(root) / "kernels"


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


class SmallMKernel:
    """y = x @ w^T for fp32 x [M, K] (any M) and w packed once by `pack` from [N, K]."""

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
        panels = torch.empty(-(-n // self.width), k, self.width, dtype=torch.float32)
        self._pack(w.data_ptr(), panels.data_ptr(), n, k)
        return PanelWeight(panels, n, k)

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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def build_library(source_path: Path, compiler: str, cache_dir: Path) -> Path:
    """Compile (or find) the library of one of this folder's C files; raises OSError /
    CalledProcessError / RuntimeError."""
    source = source_path.read_bytes()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    key = hashlib.sha256()
    for part in (source, compiler.encode(), " ".join(CFLAGS).encode(), version.encode()):
        key.update(part + b"\0")
    key.update(_cpu_flags().encode())
    path = cache_dir / f"{source_path.stem}-{key.hexdigest()[:20]}.so"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: concurrent processes never load a half file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *CFLAGS, "-o", tmp, str(source_path), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("tailguard: built %s", path)
    return path


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


def _load(compiler: str, cache_dir: Path) -> SmallMKernel | str:
    try:
        path = build_library(SOURCE, compiler, cache_dir)
    except FileNotFoundError:
        return f"no C compiler ({compiler!r} not found; set CC)"
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        return f"compiling {SOURCE.name} failed: {exc}"
    try:
        lib = ctypes.CDLL(str(path))
        if lib.tg_kernel_abi() != ABI:
            return f"{path} is not this version of the kernel"
        kernel = SmallMKernel(lib, path)
    except (OSError, AttributeError) as exc:
        return f"loading {path} failed: {exc}"
    return _check(kernel) or kernel


def load_small_m_kernel(
    compiler: str | None = None, cache_dir: Path | None = None
) -> SmallMKernel | None:
    """The kernel, built and checked once per process (and per compiler / cache folder);
    None after one warning line saying why, if it cannot be had."""
    key = (compiler or default_compiler(), str(cache_dir or default_cache_dir()))
    got = _loaded.get(key)
    if got is None:
        got = _loaded[key] = _load(key[0], Path(key[1]))
        if isinstance(got, str):
            log.warning("tailguard: small-M kernel unavailable, using oneDNN: %s", got)
    return got if isinstance(got, SmallMKernel) else None


def small_m_unavailable_reason(
    compiler: str | None = None, cache_dir: Path | None = None
) -> str | None:
    """Why load_small_m_kernel() gave None (after it ran), else None."""
    got = _loaded.get((compiler or default_compiler(), str(cache_dir or default_cache_dir())))
    return got if isinstance(got, str) else None

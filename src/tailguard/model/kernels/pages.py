"""Weight panels on 2 MiB pages where the kernel allows it (transparent huge pages).

    panels = huge_empty((n_panels, k, width), torch.float32)   # then write it once

Why: a decode step streams every weight once, ~850 MB in fp32 for the 246M model, and on 4 KiB
pages that is a TLB miss every 4 KiB, which the hardware prefetchers do not cross. On the
2-core AVX2 EPYC (docs/benchmarks.md, session 38) the small-M kernel streamed 21.2 -> 23.1 GB/s
at 1 row and 17.8 -> 21.6 at 8 rows with the panels on huge pages.

How: a fresh anonymous mapping (never touched, so its first writes fault in huge pages), advised
MADV_HUGEPAGE, the tensor placed at its first 2 MiB boundary. Where the kernel has THP off
("never") or the platform has no madvise, the same call gives ordinary pages: the advice is a
hint, and nothing else changes.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch
from torch import Tensor

__all__ = ["HUGE_PAGE", "MIN_HUGE_BYTES", "huge_empty"]

HUGE_PAGE = 2 << 20
# Below this a tensor stays on torch's allocator. At or above it, a tensor's last huge page may
# hold less than 2 MiB of it (at most 2 MiB of memory a tensor, which the 246M model's 65
# panel tensors of 4-131 MB can afford); the alignment slack is address space, never touched.
MIN_HUGE_BYTES = HUGE_PAGE


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialized contiguous CPU tensor, on huge pages where the OS grants them."""
    nbytes = math.prod(shape) * dtype.itemsize
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < MIN_HUGE_BYTES or advise is None:
        return torch.empty(shape, dtype=dtype)
    size = nbytes + HUGE_PAGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive with the tensor
    offset = -flat.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # THP compiled out: ordinary pages
        buf.madvise(advise, offset, (size - offset) // mmap.PAGESIZE * mmap.PAGESIZE)
    return flat[offset : offset + nbytes].view(dtype).view(shape)

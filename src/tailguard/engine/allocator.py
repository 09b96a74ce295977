"""Device allocator figures for EngineStats.

On CUDA they come from the caching allocator's own counters (`torch.cuda.memory_stats()`):
reserved minus allocated and inactive split bytes show fragmentation, `num_alloc_retries` counts
the cache flushes-and-retries that stall a step. On CPU only the process RSS is meaningful.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from tailguard.core.stats import AllocatorStats

# Fragmentation is fought by design (fixed pool, bucketed shapes); expandable segments are
# PyTorch's own advice for what is left. Must be set before CUDA initialises. The variable
# the runbook used (TORCH_CUDA_ALLOC_CONF) is silently ignored by PyTorch.
CUDA_ALLOC_CONF = "expandable_segments:True"


def configure_cuda_allocator() -> None:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)


def from_memory_stats(
    stats: Mapping[str, int], rss_bytes: int, device: str = "cuda"
) -> AllocatorStats:
    """Translate a `torch.cuda.memory_stats()` dict (recorded or live) into AllocatorStats."""
    return AllocatorStats(
        device=device,
        reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
        allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
        inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
        num_alloc_retries=int(stats.get("num_alloc_retries", 0)),
        num_ooms=int(stats.get("num_ooms", 0)),
        num_device_alloc=int(stats.get("num_device_alloc", 0)),
        rss_bytes=rss_bytes,
    )


def allocator_stats(device: torch.device, rss_bytes: int) -> AllocatorStats:
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        return from_memory_stats(torch.cuda.memory_stats(device), rss_bytes, str(device))
    return AllocatorStats(device=str(device), rss_bytes=rss_bytes)

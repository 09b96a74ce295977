"""Where tailguard keeps what it builds or generates once per machine."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_home"]


def cache_home() -> Path:
    """`$TAILGUARD_CACHE` (default `~/.cache/tailguard`): the embedded checkpoint, benchmark
    checkpoints, compiled kernels and the compiled request path, each in a folder of its own."""
    return Path(os.environ.get("TAILGUARD_CACHE") or Path.home() / ".cache" / "tailguard")

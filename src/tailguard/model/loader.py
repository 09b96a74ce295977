"""Load a Hugging Face Mistral checkpoint folder into our MistralModel.

A folder holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Every tensor is checked against the names and shapes the config
implies before anything is assigned, so a wrong folder fails with the tensor and file named,
not with a shape error deep inside a matmul.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tailguard.errors import ModelLoadError
from tailguard.model.config import SUPPORTED_DTYPES, MistralConfig, hf_weight_shapes
from tailguard.model.mistral import MistralModel

__all__ = [
    "best_cpu_dtype",
    "bf16_is_faster",
    "load_model",
    "onednn_isa_cap",
    "onednn_uses_amx",
    "read_cpu_flags",
    "resolve_dtype",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# Tensors some checkpoints carry that are recomputed, not learned (older transformers saved
# the rotary inverse frequencies). Skipped rather than refused.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(name: str) -> torch.dtype:
    """'bfloat16' / 'bf16' / 'float32' / 'auto' ... -> torch dtype; 'auto' = best_cpu_dtype()."""
    key = name.strip().lower().removeprefix("torch.")
    if key == "auto":
        return best_cpu_dtype()
    if key not in _DTYPES:
        raise ModelLoadError(
            f"dtype {name!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)} or auto",
            param="dtype",
        )
    return _DTYPES[key]


def read_cpu_flags() -> list[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        return Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []


def onednn_isa_cap() -> str:
    """ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), the cap on what oneDNN may use; "" if unset."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""


def onednn_uses_amx(flags: Collection[str], onednn_max_isa: str = "") -> bool:
    """True where the CPU has AMX bf16 tiles and oneDNN is not capped below them."""
    isa = onednn_max_isa.strip().upper()
    return "amx_bf16" in flags and (isa in ("", "ALL", "DEFAULT") or "AMX" in isa)


def best_cpu_dtype() -> torch.dtype:
    """bf16 where it is faster than fp32 on this CPU (`bf16_is_faster`), else fp32."""
    if not torch.backends.mkldnn.is_available():
        return torch.float32
    return torch.bfloat16 if bf16_is_faster(read_cpu_flags(), onednn_isa_cap()) else torch.float32


BF16_MIN_SPEEDUP = 1.15
"""Where only a probe can tell (AVX512-BF16 without AMX), bf16 must beat fp32 by this much:
fp32 keeps the small-M kernel and the fused decode stack, which a probe matmul does not see."""


def bf16_is_faster(
    cpu_flags: Collection[str],
    onednn_max_isa: str = "",
    probe: Callable[[], float] | None = None,
) -> bool:
    """True where bf16 matmuls beat fp32 on this CPU: AMX tiles that oneDNN may use, or,
    with AVX512-BF16 alone, a measured speedup of `probe()` (fp32 time / bf16 time, default
    `bf16_matmul_speedup`) of at least `BF16_MIN_SPEEDUP`.

    Measured (docs/benchmarks.md, session 27; 2 cores of one Xeon, oneDNN's ISA capped with
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 for the no-AMX half):
      - AMX: a 2048^3 bf16 matmul runs at ~1,700 GFLOP/s against ~300 in fp32, and the
        embedded model's 64-row decode step takes 3.6 ms in bf16 against 6.9 ms in fp32 (its
        32000-row head is compute-bound there), so bf16 wins for small models as for large.
      - AVX512-BF16 without AMX (oneDNN's `vdpbf16ps` kernels): on that Xeon bf16 matmuls were
        *slower* than fp32 (168 vs 215 GFLOP/s at 2048^3; 174 vs 239 at the embedded head's
        shape; session 17's Xeon of that kind 110-131 vs ~150), the embedded decode step 10.9
        ms in bf16 against 7.0 in fp32, model M's 32-row step 95 vs 80 ms. The project's brief
        reports bf16 at ~2x fp32 on other machines with the flag, so that case is measured, not
        assumed: a 64 x 2048 x 2048 matmul timed in both dtypes at start-up (~90 ms on one
        core, oneDNN capped to AVX512_CORE_BF16: speedup 0.87-1.01, so fp32).
      - Neither flag: bf16 is emulated, ~100x slower than fp32 (docs/model.md).
    `onednn_max_isa` is ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA): a cap below AMX means
    oneDNN will not use the tiles (then the probe decides, or fp32 below the bf16 instructions).
    """
    isa = onednn_max_isa.strip().upper()
    uncapped = isa in ("", "ALL", "DEFAULT")
    if onednn_uses_amx(cpu_flags, isa):
        return True
    if "avx512_bf16" not in cpu_flags:
        return False
    if not uncapped and not any(x in isa for x in ("BF16", "FP16", "AMX", "AVX10")):
        return False  # capped below the bf16 dot-product instructions: emulated again
    return (probe or bf16_matmul_speedup)() >= BF16_MIN_SPEEDUP


@functools.cache
def bf16_matmul_speedup(rows: int = 64, dim: int = 2048, reps: int = 5) -> float:
    """fp32 time / bf16 time of a (rows x dim) @ (dim x dim) matmul on this CPU, best of `reps`
    each after one warm-up (a decode step's shape; cached for the process)."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.full((rows, dim), 0.5, dtype=dtype)  # values do not change a GEMM's time
        w = torch.full((dim, dim), 0.25, dtype=dtype)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            torch.mm(a, w)
            times.append(time.perf_counter() - t0)
        best[dtype] = min(times[1:])
    return best[torch.float32] / best[torch.bfloat16]


def load_model(
    model_dir: Path, dtype: torch.dtype | None = None, device: str = "cpu"
) -> tuple[MistralModel, MistralConfig]:
    """Read config and weights, validate every tensor, return (eval-mode model, config).

    dtype: the explicit argument, else the config's `torch_dtype` / `dtype`, else fp32.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"model folder {model_dir} does not exist or is not a directory", param="model"
        )
    config = MistralConfig.from_dir(model_dir)
    target = dtype if dtype is not None else resolve_dtype(config.torch_dtype)
    files = _weight_files(model_dir)
    tensors = _read_tensors(files, hf_weight_shapes(config), target, config.tie_word_embeddings)
    # Construct on the meta device: no memory and no random init for parameters the
    # checkpoint is about to replace (seconds for a 7B model).
    with torch.device("meta"):
        model = MistralModel(config)
    model.load_hf_weights(tensors)
    model.requires_grad_(False)  # inference only: no autograd bookkeeping even outside no_grad
    return model.to(device).eval(), config


def _weight_files(model_dir: Path) -> dict[str, list[str] | None]:
    """Map each safetensors file to the tensor names the index assigns it (None: read all)."""
    index = model_dir / INDEX_FILE
    single = model_dir / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(
                f"{index}: cannot read its 'weight_map' ({exc!r}); regenerate the index "
                "or keep a single model.safetensors"
            ) from exc
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(str(model_dir / shard), []).append(name)
        for shard in shards:
            if not Path(shard).is_file():
                raise ModelLoadError(f"{shard} not found (listed in {index})", param=INDEX_FILE)
        return dict(shards)
    if single.is_file():
        return {str(single): None}
    raise ModelLoadError(
        f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards "
        "(only safetensors checkpoints are supported; convert .bin/.pth files first)",
        param=SINGLE_FILE,
    )


def _read_tensors(
    files: dict[str, list[str] | None],
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    tied: bool,
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for file, listed in files.items():
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                names = list(f.keys()) if listed is None else listed
                present = set(f.keys())
                for name in names:
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if tied and name == "lm_head.weight":
                        continue  # transformers ignores a stored head when tying; so do we
                    if name not in expected:
                        raise ModelLoadError(
                            f"{file}: unexpected tensor '{name}'; this does not look like a "
                            "Mistral checkpoint matching config.json"
                        )
                    if name not in present:
                        raise ModelLoadError(
                            f"{file}: tensor '{name}' listed in the index is absent"
                        )
                    if name in out:
                        raise ModelLoadError(
                            f"{file}: tensor '{name}' also stored in {where[name]}"
                        )
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != expected[name]:
                        raise ModelLoadError(
                            f"{file}: tensor '{name}' has shape {list(shape)}, config.json "
                            f"implies {list(expected[name])}; the config and weights disagree"
                        )
                    out[name] = f.get_tensor(name).to(dtype)
                    where[name] = file
        except SafetensorError as exc:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from exc
    missing = [n for n in expected if n not in out]
    if missing:
        shown = ", ".join(f"'{n}'" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(
            f"missing tensor {shown}{more} in {', '.join(Path(f).name for f in files)}; "
            "the checkpoint is incomplete or config.json describes a different model"
        )
    return out

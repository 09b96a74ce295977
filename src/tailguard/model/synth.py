"""Benchmark checkpoints the project makes itself: `tailguard model synth --preset NAME --out DIR`.

Each preset is a Mistral-architecture config; the folder written is an ordinary Hugging Face
checkpoint (config.json, model.safetensors, mistral-common's `tokenizer.model.v1`) that our
loader, transformers and vLLM all read. Weights are seeded N(0, 0.02) (norms 1), so two runs of
the same preset write identical bytes. No download, no torch: numpy writes the safetensors file
(bf16 by rounding the fp32 draws to nearest-even, as torch's `.to(torch.bfloat16)` does).

    embedded  the built-in model (hidden 256, 2 layers, 17.8M parameters), fp32
    m         hidden 1024, 16 layers, 16/4 heads, head_dim 64, SwiGLU 2816, untied head:
              246M parameters, bf16 (0.49 GB): a size where the weights, not Python, set the
              step time
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from tailguard.model.config import MistralConfig, hf_weight_shapes
from tailguard.model.embedded import (
    EMBEDDED_CONFIG,
    EMBEDDED_INIT_STD,
    EMBEDDED_SEED,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    mistral_v1_tokenizer_path,
    write_checkpoint,
)

__all__ = ["PRESETS", "num_parameters", "synth", "write_bf16_safetensors"]

M_CONFIG = MistralConfig(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    sliding_window=None,  # full attention: the common case, and what every baseline serves
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
    source="<preset m>",
)

PRESETS: dict[str, MistralConfig] = {
    "embedded": EMBEDDED_CONFIG,
    "m": M_CONFIG,
}


def num_parameters(config: MistralConfig) -> int:
    return sum(int(np.prod(s)) for s in hf_weight_shapes(config).values())


def synth(preset: str, out: Path, seed: int = EMBEDDED_SEED) -> Path:
    """Write the preset's checkpoint into `out` (created; must be absent or empty).

    Built under a temporary name beside `out` and renamed into place, so an interrupted run
    leaves no half-written folder that a loader would take for a checkpoint.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; pick a new --out folder")
    config = dataclasses.replace(PRESETS[preset], source=str(out / "config.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if config.torch_dtype == "float32":
            write_checkpoint(tmp, config, seed=seed, init_std=EMBEDDED_INIT_STD)
        elif config.torch_dtype == "bfloat16":
            write_bf16_safetensors(tmp / WEIGHTS_FILE, _draws(config, seed, EMBEDDED_INIT_STD))
            config.write(tmp)
            shutil.copyfile(mistral_v1_tokenizer_path(), tmp / TOKENIZER_FILE)
        else:  # pragma: no cover - presets are fixed above
            raise ValueError(f"preset dtype {config.torch_dtype} has no writer")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _draws(config: MistralConfig, seed: int, std: float) -> dict[str, np.ndarray]:
    """The same draws as `write_checkpoint` (same names, order, generator), rounded to bf16."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in hf_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = _to_bf16_bits(np.ones(shape, dtype=np.float32))
        else:
            w = rng.standard_normal(shape, dtype=np.float32)
            w *= np.float32(std)
            out[name] = _to_bf16_bits(w)
    return out


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), round to nearest even (finite inputs)."""
    u = x.view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def write_bf16_safetensors(file: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file of BF16 tensors given as uint16 bit patterns.

    The format is an 8-byte little-endian header length, a JSON header (dtype, shape, byte
    offsets per tensor), then the raw bytes; safetensors' numpy API has no bf16 type.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        if arr.dtype != np.uint16:
            raise TypeError(f"{name}: expected uint16 bf16 bit patterns, got {arr.dtype}")
        header[name] = {
            "dtype": "BF16",
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).astype("<u2", copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())

"""The built-in model: a small Mistral-architecture checkpoint generated from a fixed seed.

With no `--model`, tailguard serves this. It is written once as an ordinary checkpoint folder
(config.json + model.safetensors + mistral-common's `tokenizer.model.v1`) and then loaded by
the same loader as any real checkpoint, so the embedded path exercises the real one. No
network: the weights come from numpy's seeded generator and the tokenizer from the
mistral-common package data.

No torch here: the HTTP process resolves the default model folder (and its tokenizer) without
paying for a torch import.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np

from tailguard.errors import ModelLoadError
from tailguard.model.config import CONFIG_FILE, MistralConfig, hf_weight_shapes
from tailguard.paths import cache_home

__all__ = [
    "EMBEDDED_CONFIG",
    "EMBEDDED_SEED",
    "default_model_dir",
    "ensure_checkpoint",
    "write_checkpoint",
]

EMBEDDED_SEED = 20261202
# HF's initializer_range: random weights this size keep activations O(1) through the layers,
# so sampling from the embedded model is noisy text rather than one repeated token.
EMBEDDED_INIT_STD = 0.02
# Bump when the generation procedure changes, so old cache folders are not reused.
_GENERATOR_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.model.v1"

EMBEDDED_CONFIG = MistralConfig(
    vocab_size=32000,  # mistral-common's v1 SentencePiece vocabulary
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    sliding_window=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",  # stored fp32; the engine casts at load (bf16 where the CPU has it)
    source="<embedded>",
)


def default_model_dir() -> Path:
    """The embedded checkpoint folder, generated on first use.

    Lives in `$TAILGUARD_CACHE` (default `~/.cache/tailguard`) under a name that hashes the
    config, seed and generator version, so a change to any of them makes a new folder.
    """
    return ensure_checkpoint(cache_home() / f"embedded-mistral-{_fingerprint()}")


def ensure_checkpoint(
    path: Path,
    config: MistralConfig = EMBEDDED_CONFIG,
    seed: int = EMBEDDED_SEED,
    init_std: float = EMBEDDED_INIT_STD,
) -> Path:
    """Return `path`, first writing a seeded checkpoint there if it is absent.

    Atomic: the folder is built under a temporary name beside `path` and renamed into place,
    so concurrent processes never see a half-written folder; the loser of a rename race just
    discards its copy.
    """
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write_checkpoint(tmp, config, seed=seed, init_std=init_std)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / CONFIG_FILE).is_file():  # not a lost race: a real failure
                raise
    except OSError as exc:
        raise ModelLoadError(
            f"cannot write the embedded model to {path} ({exc}); set TAILGUARD_CACHE to a "
            "writable folder or pass --model"
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_checkpoint(
    folder: Path,
    config: MistralConfig,
    seed: int = EMBEDDED_SEED,
    init_std: float = EMBEDDED_INIT_STD,
    tokenizer: bool = True,
) -> None:
    """Write config.json, fp32 model.safetensors (seeded N(0, init_std), norms = 1), tokenizer.

    Also used by tests to make tiny checkpoints both our loader and transformers can read.
    """
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for name, shape in hf_weight_shapes(config).items():  # insertion order: deterministic
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shape, dtype=np.float32)
        else:
            w = rng.standard_normal(shape, dtype=np.float32)
            w *= np.float32(init_std)
            tensors[name] = w
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config.write(folder)
    if tokenizer:
        shutil.copyfile(mistral_v1_tokenizer_path(), folder / TOKENIZER_FILE)


def mistral_v1_tokenizer_path() -> Path:
    """mistral-common's bundled SentencePiece v1 tokenizer (vocab 32000, bos 1, eos 2)."""
    ref = resources.files("mistral_common") / "data" / TOKENIZER_FILE
    with resources.as_file(ref) as p:
        return Path(p)


def _fingerprint() -> str:
    spec = {
        "config": EMBEDDED_CONFIG.to_hf_dict(),
        "seed": EMBEDDED_SEED,
        "std": EMBEDDED_INIT_STD,
        "version": _GENERATOR_VERSION,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]

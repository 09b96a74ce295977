"""A tiny Mistral checkpoint for engine tests: the real loader and model, small enough to
serve thousands of requests in seconds on two cores."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tailguard.engine.config import EngineConfig
from tailguard.model.embedded import EMBEDDED_CONFIG, write_checkpoint

# The embedded model's architecture, shrunk: only the sizes differ.
TINY = dataclasses.replace(
    EMBEDDED_CONFIG,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    sliding_window=256,
    source="<tiny test model>",
)


# Fewer, smaller heads: for the long memory test, where attention over 1,000-token contexts
# dominates the cost and the model's quality does not matter.
MICRO = dataclasses.replace(
    TINY,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    source="<micro test model>",
)


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("micro-mistral")
    write_checkpoint(folder, MICRO, seed=99, tokenizer=False)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-mistral")
    write_checkpoint(folder, TINY, seed=1234, tokenizer=False)
    return folder


def tiny_engine_config(model_dir: Path, **overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(
        model_dir=str(model_dir),
        dtype="float32",
        threads=1,
        kv_cache_bytes=8 * 1024 * 1024,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        seq_buckets=(1, 2, 4, 8, 16, 32),
        token_buckets=(16, 32, 64, 128, 256),
    )
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]

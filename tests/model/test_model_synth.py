"""`tailguard model synth`: benchmark checkpoints written as ordinary HF folders."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tailguard.cli import main
from tailguard.model.config import MistralConfig
from tailguard.model.embedded import EMBEDDED_CONFIG, ensure_checkpoint
from tailguard.model.loader import load_model
from tailguard.model.synth import M_CONFIG, _to_bf16_bits, num_parameters, write_bf16_safetensors
from tailguard.model.tokenizer import MistralCommonTokenizer, load_tokenizer


def _digest(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def test_synth_embedded_writes_the_built_in_model_loaded_by_the_normal_loader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "emb"
    assert main(["model", "synth", "--preset", "embedded", "--out", str(out)]) == 0
    assert "18.3M parameters" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.model.v1",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["emb"]  # no temporary folder left
    assert MistralConfig.from_dir(out) == EMBEDDED_CONFIG
    builtin = ensure_checkpoint(tmp_path / "builtin")
    assert _digest(out / "model.safetensors") == _digest(builtin / "model.safetensors")
    model, config = load_model(out)
    assert model.embed_tokens.weight.shape == (32000, 256)
    tok = load_tokenizer(out)
    assert isinstance(tok, MistralCommonTokenizer) and tok.vocab_size == config.vocab_size
    # a second synth into the same (now full) folder is refused, not overwritten
    assert main(["model", "synth", "--preset", "embedded", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_preset_m_is_the_issue_checkpoint() -> None:
    m = M_CONFIG
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads) == (1024, 16, 16)
    assert (m.num_key_value_heads, m.head_dim, m.intermediate_size) == (4, 64, 2816)
    assert (m.vocab_size, m.tie_word_embeddings, m.torch_dtype) == (32000, False, "bfloat16")
    assert num_parameters(m) == 245_924_864


def test_bf16_writer_matches_torch_rounding_and_loads(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 33), dtype=np.float32)
    x[0, :6] = [1.0, -2.5, 3.14159, 1e-3, 65504.0, 1.00390625]  # the last is a rounding tie
    write_bf16_safetensors(
        tmp_path / "w.safetensors", {"a": _to_bf16_bits(x), "b": _to_bf16_bits(x[:2])}
    )
    got = load_file(str(tmp_path / "w.safetensors"))
    want = torch.from_numpy(x).to(torch.bfloat16)
    assert got["a"].dtype == torch.bfloat16 and torch.equal(got["a"], want)
    assert torch.equal(got["b"], want[:2])
    with pytest.raises(TypeError, match="uint16"):
        write_bf16_safetensors(tmp_path / "bad.safetensors", {"a": x})

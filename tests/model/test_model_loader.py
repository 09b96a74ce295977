"""Checkpoint loading: config validation, tensor checks, sharding, dtype choice."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.model.model_testkit import TINY, PagedCache, make_checkpoint

from tailguard.errors import ModelLoadError
from tailguard.model.config import MistralConfig
from tailguard.model.loader import (
    best_cpu_dtype,
    bf16_is_faster,
    bf16_matmul_speedup,
    load_model,
    resolve_dtype,
)


@pytest.fixture
def ckpt(tmp_path: Path, tiny_dir: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))


def _edit_config(folder: Path, **changes: Any) -> None:
    file = folder / "config.json"
    data = json.loads(file.read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    file.write_text(json.dumps(data))


def _edit_weights(folder: Path, edit: Any) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_round_trip_config(tiny_dir: Path) -> None:
    assert MistralConfig.from_dir(tiny_dir) == TINY


def test_missing_folder_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        load_model(tmp_path)


def test_missing_weights_file(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"expected model\.safetensors or model\.safetensors"):
        load_model(ckpt)


def test_missing_tensor_is_named(ckpt: Path) -> None:
    _edit_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_model(ckpt)


def test_misshaped_tensor_is_named(ckpt: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    _edit_weights(ckpt, shrink)
    with pytest.raises(ModelLoadError) as info:
        load_model(ckpt)
    msg = info.value.message
    assert "model.safetensors" in msg and "'model.layers.0.self_attn.k_proj.weight'" in msg
    assert "[16, 64]" in msg and "[32, 64]" in msg


def test_unexpected_tensor_is_named(ckpt: Path) -> None:
    name = "model.layers.0.self_attn.q_proj.bias"
    _edit_weights(ckpt, lambda t: t.__setitem__(name, torch.zeros(64)))
    with pytest.raises(ModelLoadError, match=rf"unexpected tensor '{name}'"):
        load_model(ckpt)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"field 'rope_scaling'.*yarn"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, r"field 'rope_parameters'"),
        ({"num_key_value_heads": 3}, r"field 'num_key_value_heads' 3 does not divide .*=4"),
        ({"hidden_size": ...}, r"field 'hidden_size' is missing"),
        ({"hidden_act": "gelu"}, r"field 'hidden_act'"),
        ({"model_type": "llama"}, r"field 'model_type' is 'llama'"),
        ({"sliding_window": 0}, r"field 'sliding_window' must be a positive integer"),
        ({"dtype": "int8"}, r"field 'torch_dtype' 'int8' is not supported"),
        ({"bos_token_id": 500}, r"field 'bos_token_id' must be a token id in \[0, 97\)"),
    ],
)
def test_bad_config_field_is_named(ckpt: Path, changes: dict[str, Any], pattern: str) -> None:
    _edit_config(ckpt, **changes)
    with pytest.raises(ModelLoadError, match=pattern) as info:
        load_model(ckpt)
    assert str(ckpt / "config.json") in info.value.message


def test_hf_defaults_for_absent_fields() -> None:
    base = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96}
    cfg = MistralConfig.from_dict({**base, "num_hidden_layers": 1, "num_attention_heads": 4})
    assert cfg.num_key_value_heads == 4  # multi-head attention, as transformers defaults
    assert cfg.head_dim == 16
    assert cfg.sliding_window == 4096  # transformers' default when the key is absent
    assert cfg.rope_theta == 10000.0
    legacy = {**base, "num_hidden_layers": 1, "num_attention_heads": 4, "sliding_window": None}
    assert MistralConfig.from_dict({**legacy, "rope_theta": 1e6}).rope_theta == 1e6
    assert MistralConfig.from_dict(legacy).sliding_window is None
    assert MistralConfig.from_dict({**legacy, "eos_token_id": [2, 5]}).eos_token_id == 2


def test_sharded_checkpoint_matches_single(tmp_path: Path, tiny_dir: Path) -> None:
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(tiny_dir / "config.json", sharded)
    tensors = load_file(tiny_dir / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / shard)
        weight_map |= dict.fromkeys(part, shard)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    single, config = load_model(tiny_dir)
    split, _ = load_model(sharded)
    ids = [5, 9, 13, 40, 2, 77, 8]
    a = PagedCache(config).run(single, [[(0, ids)]])[1]
    b = PagedCache(config).run(split, [[(0, ids)]])[1]
    assert torch.equal(a, b)

    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors not found"):
        load_model(sharded)


def test_dtype_precedence(ckpt: Path) -> None:
    assert load_model(ckpt)[0].embed_tokens.weight.dtype == torch.float32  # config says fp32
    _edit_config(ckpt, dtype="bfloat16", torch_dtype="bfloat16")
    model, config = load_model(ckpt)
    assert config.torch_dtype == "bfloat16"
    assert model.layers[0].attn.wqkv.weight.dtype == torch.bfloat16
    assert model.rope_cos.dtype == torch.float32  # tables stay fp32, cast per step
    explicit, _ = load_model(ckpt, dtype=torch.float32)
    assert explicit.lm_head.weight.dtype == torch.float32


def test_resolve_dtype() -> None:
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("torch.float32") is torch.float32
    assert resolve_dtype("auto") is best_cpu_dtype()
    assert best_cpu_dtype() in (torch.float32, torch.bfloat16)
    with pytest.raises(ModelLoadError, match="'int4' is not supported"):
        resolve_dtype("int4")


@pytest.mark.parametrize(
    ("flags", "isa", "want"),
    [
        ({"avx2", "fma"}, "", False),  # no native bf16: emulated, ~100x slower
        ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "", True),
        ({"avx512_bf16", "amx_bf16"}, "all", True),
        ({"avx512_bf16", "amx_bf16"}, "AVX512_CORE_AMX", True),
        ({"avx512_bf16", "amx_bf16"}, "avx10_1_512_amx_fp16", True),
        ({"avx512_bf16", "amx_bf16"}, "AVX2", False),
    ],
)
def test_bf16_only_where_amx_multiplies_it(flags: set[str], isa: str, want: bool) -> None:
    def never() -> float:
        raise AssertionError("the flags decide: no probe")

    assert bf16_is_faster(flags, isa, probe=never) is want


@pytest.mark.parametrize(
    ("speedup", "want"), [(0.78, False), (1.1, False), (1.15, True), (2.0, True)]
)
def test_avx512_bf16_without_amx_is_measured(speedup: float, want: bool) -> None:
    flags = {"avx512f", "avx512_bf16"}
    assert bf16_is_faster(flags, "", probe=lambda: speedup) is want
    capped = flags | {"amx_bf16"}  # AMX present but oneDNN capped below it: measured as well
    assert bf16_is_faster(capped, "AVX512_CORE_BF16", probe=lambda: speedup) is want


def test_the_probe_times_both_dtypes() -> None:
    speedup = bf16_matmul_speedup(rows=8, dim=128, reps=2)
    assert 0.0 < speedup < 1000.0


def test_auto_follows_the_onednn_isa_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    import tailguard.model.loader as loader

    monkeypatch.setattr(loader, "bf16_matmul_speedup", lambda: 0.78)  # as on the capped Xeon
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert best_cpu_dtype() is torch.float32  # with or without AMX on this machine
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    assert best_cpu_dtype() is torch.float32


def test_tied_checkpoint_ignores_stored_head(tmp_path: Path) -> None:
    tied = make_checkpoint(tmp_path / "tied", replace(TINY, tie_word_embeddings=True))
    _edit_weights(tied, lambda t: t.__setitem__("lm_head.weight", torch.zeros(97, 64)))
    model, _ = load_model(tied)
    assert model.lm_head is None

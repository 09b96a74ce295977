"""bench/gpu_check.sh's checks, run on CPU with a tiny model: each can pass, and fails when
its property is broken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import gpu_checks as gc


def test_parity_check_passes_on_cpu(tmp_path: Path) -> None:
    r = gc.check_parity(torch.device("cpu"), tmp_path / "p")
    assert r.ok, r.line()
    assert r.line().startswith("CHECK parity    PASS  max |ours - transformers| = ")


def test_engine_graph_and_allocator_checks_on_a_tiny_model(tiny_model_dir: Path) -> None:
    cpu = torch.device("cpu")
    small = dict(max_num_seqs=8, max_num_batched_tokens=256, seq_buckets=(1, 2, 4, 8))
    core = gc._engine(tiny_model_dir, cpu, "float32", decode_graphs="static", **small)
    r = gc.check_warmup(core)
    assert r.ok and "decode graphs captured" in r.detail, r.line()
    n_graphs = len(core.runner.graphs.keys)  # type: ignore[union-attr]
    assert f"; {n_graphs} decode graphs" in r.detail and n_graphs == 4 * len(
        core.runner.blocks_ladder
    )
    r = gc.check_allocator(core, requests=60)
    assert r.ok, r.line()
    assert "0 new KV allocations (CPU), 0 alloc retries, 0 escaped shapes" in r.detail
    assert core.runner.graph_steps > 0
    r = gc.check_engine(core, batches=(2, 4))
    assert r.ok and "batch 2: decode step eager" in r.detail and "batch 4:" in r.detail, r.line()
    r = gc.check_graphs(core, 4, 2)
    assert r.ok and r.detail.startswith("6 decode buckets, static replays"), r.line()  # 1,2,4 x 4,6


def test_graph_check_fails_without_graphs(tiny_model_dir: Path) -> None:
    core = gc._engine(tiny_model_dir, torch.device("cpu"), "float32", decode_graphs="off")
    assert gc.check_warmup(core).ok  # CPU without graphs asked for: nothing to capture
    r = gc.check_graphs(core)
    assert not r.ok and "no decode graphs were captured" in r.detail


def test_allocator_check_fails_on_an_escaped_shape(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tailguard.engine.plan as plan_mod

    padded = plan_mod.group_shape
    monkeypatch.setattr(  # the steps' block tables left unpadded (warm-up keeps its buckets)
        plan_mod, "group_shape", lambda n, q, b, *ladders: (*padded(n, q, b, *ladders)[:3], b)
    )
    core = gc._engine(
        tiny_model_dir,
        torch.device("cpu"),
        "float32",
        max_num_seqs=8,
        max_num_batched_tokens=256,
        seq_buckets=(1, 2, 4, 8),
    )
    core.warmup()
    r = gc.check_allocator(core, requests=30)
    assert not r.ok and "FAIL" in r.line() and "escaped shapes [('attn'" in r.detail

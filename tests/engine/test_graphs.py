"""Decode steps on the graphs' static buffers (engine/graphs.py), on CPU in `static` mode: the
same code as CUDA-graph replay but the capture. Same tokens as the eager path, every pure
decode step on a graph, mixed steps eager, no op shape outside warm-up."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tests.engine.conftest import tiny_engine_config
from tests.engine.test_core import assert_no_new_shapes, gen

from tailguard.engine.core import EngineCore
from tailguard.engine.graphs import DecodeGraphs
from tailguard.errors import ConfigError


def _run(
    model_dir: Path, mode: str, temperature: float = 0.0
) -> tuple[dict[str, list[int]], EngineCore, int]:
    """12 requests of 3-70 prompt tokens and 2-40 output tokens, joining over the first steps:
    decode batches grow and shrink and contexts cross block buckets 4 -> 6 -> 8."""
    core = EngineCore(tiny_engine_config(model_dir, decode_graphs=mode), model_dir)
    core.warmup()
    warm = core.stats().distinct_shapes
    rng = random.Random(5)
    pending = [
        gen(
            f"r{i}",
            [rng.randrange(3, 500) for _ in range(rng.randint(3, 70))],
            max_tokens=rng.randint(2, 40),
            temperature=temperature,
            seed=i if temperature else None,
        )
        for i in range(12)
    ]
    outs: dict[str, list[int]] = {}
    decode_steps = 0
    while pending or core.has_work():
        if pending:
            core.add(pending.pop())
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        note = core.log.take()[-1]
        decode_steps += note.num_prefill_tokens == 0
    assert_no_new_shapes(core, warm)
    return outs, core, decode_steps


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_static_graphs_give_the_eager_tokens(tiny_model_dir: Path, temperature: float) -> None:
    eager, eager_core, _ = _run(tiny_model_dir, "off", temperature)
    graphed, core, decode_steps = _run(tiny_model_dir, "static", temperature)
    assert graphed == eager
    assert eager_core.runner.graphs is None and eager_core.runner.graph_steps == 0
    assert decode_steps > 20 and core.runner.graph_steps == decode_steps  # pure decodes only
    used = {k for k in core.runner.shapes.seen if k[0] == "decode_graph"}
    assert ("decode_graph", 8, 4) in used and ("decode_graph", 1, 8) in used


def test_capture_is_one_graph_per_decode_bucket(tiny_model_dir: Path) -> None:
    cfg = tiny_engine_config(tiny_model_dir, decode_graphs="static", max_num_seqs=8)
    core = EngineCore(cfg, tiny_model_dir)
    core.warmup()
    graphs = core.runner.graphs
    assert graphs is not None
    ladder = core.runner.blocks_ladder
    assert sorted(graphs.keys) == sorted(
        ("decode_graph", g, b) for g in (1, 2, 4, 8) for b in ladder
    )


def test_a_failed_capture_serves_eagerly(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fail(self: DecodeGraphs, keys: object) -> float:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "capture", fail)
    core = EngineCore(tiny_engine_config(tiny_model_dir, decode_graphs="static"), tiny_model_dir)
    core.warmup()
    assert core.runner.graphs is None
    assert "decode graph capture failed, decode steps run eagerly" in caplog.text
    core.add(gen("a", [5, 6, 7], max_tokens=3))
    while core.has_work():
        core.step()
    assert core.runner.graph_steps == 0


def test_decode_graphs_mode_is_validated(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="decode_graphs='always': use auto, off or static"):
        tiny_engine_config(tiny_model_dir, decode_graphs="always")

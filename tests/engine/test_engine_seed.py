"""The engine's `seed` (`engine_seed` in the server's config) seeds unseeded sampling."""

from __future__ import annotations

from pathlib import Path

from tests.engine.conftest import tiny_engine_config

from tailguard.core.request import EngineRequest, SamplingParams
from tailguard.engine.core import EngineCore


def _sampled(model_dir: Path, seed: int) -> list[int]:
    core = EngineCore(tiny_engine_config(model_dir, seed=seed, warmup=False), model_dir)
    sampling = SamplingParams(max_tokens=24, temperature=1.5, ignore_eos=True)  # no seed
    core.add(EngineRequest(request_id="a", prompt_token_ids=(5, 6, 7), sampling=sampling))
    toks: list[int] = []
    while core.has_work():
        for out in core.step():
            toks.extend(out.new_token_ids)
    return toks


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_model_dir: Path) -> None:
    a, b, other = (
        _sampled(tiny_model_dir, 7),
        _sampled(tiny_model_dir, 7),
        _sampled(tiny_model_dir, 8),
    )
    assert len(a) == 24 and a == b
    assert other != a  # 24 tokens at temperature 1.5 from another seed: not the same

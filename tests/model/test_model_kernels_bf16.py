"""The bf16 linear kernel (model/kernels/gemv_bf16.c): against a float64 product on every
block-size edge, what it refuses, the model on it against oneDNN's bf16 and the fp32
reference, and where the engine uses it (bf16 without AMX) and where not."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
from tests.model.model_testkit import PagedCache, make_checkpoint

from tailguard.core.request import EngineRequest, SamplingParams
from tailguard.engine import runner as runner_mod
from tailguard.engine.config import EngineConfig
from tailguard.engine.core import EngineCore
from tailguard.model.embedded import default_model_dir
from tailguard.model.kernels import Bf16Kernel, bf16_kernel_unavailable_reason, load_bf16_kernel
from tailguard.model.kernels.small_m_bf16 import _check
from tailguard.model.loader import load_model, onednn_uses_amx
from tailguard.model.mistral import KernelLinear, MistralModel, PackedLinear

PREFILL_THEN_DECODES = [  # steps of one attention group each: (sequence, new tokens)
    [[(0, [5, 9, 17, 3, 44, 61, 2, 90, 13, 71, 4, 6, 8, 10]), (1, [40, 2, 7])]],
    [[(0, [11]), (1, [23])]],
    [[(0, [31]), (1, [8])]],
]


@pytest.fixture(scope="session")
def kernel() -> Bf16Kernel:
    """Built once per machine, loaded once per session; skipped on CPUs without AVX512-BF16."""
    k = load_bf16_kernel()
    if k is None:
        pytest.skip(f"bf16 kernel unavailable here: {bf16_kernel_unavailable_reason()}")
    return k


def _rel_err(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    want = x.double() @ w.double().t()
    return ((got.double() - want).abs() / (want.abs() + 1.0)).max().item()


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64_on_every_block_edge(kernel: Bf16Kernel, threads: int) -> None:
    """Rows 1-13 and 25 (in place up to 12, paired chunks above), odd K, partial panels: within
    one bf16 rounding of the exact product (fp32 sums, rounded once)."""
    g = torch.Generator().manual_seed(3)
    for m in (*range(1, 14), 25):
        for n, k in ((31, 64), (33, 65), (64, 128), (70, 7)):
            x = torch.randn(m, k, generator=g).bfloat16()
            w = torch.randn(n, k, generator=g).bfloat16()
            got = kernel.linear(x, kernel.pack(w), threads)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert _rel_err(got, x, w) < 2.0**-8, (m, n, k)


def test_kernel_reads_strided_and_misaligned_inputs(kernel: Bf16Kernel) -> None:
    """A view of wider rows (qkv-style) is read in place; a view starting on an odd element
    (not a 32-bit boundary) is copied first; both give the contiguous input's answer."""
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(9, 300, generator=g).bfloat16()
    w = torch.randn(96, 128, generator=g).bfloat16()
    wp = kernel.pack(w)
    for view in (wide[:, :128], wide[:, 1:129], wide[:3, 7:135]):
        assert torch.equal(kernel.linear(view, wp), kernel.linear(view.contiguous(), wp))


def test_kernel_refuses_what_it_cannot_read(kernel: Bf16Kernel) -> None:
    wp = kernel.pack(torch.randn(8, 16).bfloat16())
    with pytest.raises(ValueError, match="bf16 x"):
        kernel.linear(torch.randn(2, 16), wp)  # fp32
    with pytest.raises(ValueError, match=r"\[M, 16\]"):
        kernel.linear(torch.randn(2, 15).bfloat16(), wp)
    with pytest.raises(ValueError, match="unit inner stride"):
        kernel.linear(torch.randn(16, 2).bfloat16().t(), wp)
    with pytest.raises(ValueError, match="packs CPU bf16"):
        kernel.pack(torch.randn(8, 16))


def test_self_check_refuses_a_cpu_without_the_instructions_and_a_wrong_kernel(
    kernel: Bf16Kernel,
) -> None:
    class NoBf16:
        supported = False

    assert "AVX512-BF16" in (_check(NoBf16()) or "")  # type: ignore[arg-type]

    class OffByOne(Bf16Kernel):
        def linear(self, x: torch.Tensor, w: object, threads: int | None = None) -> torch.Tensor:
            return super().linear(x, w, threads) + 1  # type: ignore[arg-type]

    wrong = OffByOne.__new__(OffByOne)
    wrong.__dict__.update(kernel.__dict__)
    assert "self-check failed" in (_check(wrong) or "")
    assert _check(kernel) is None


def _logits(model: MistralModel) -> torch.Tensor:
    cache = PagedCache(model.config, 80, 4, model.dtype)
    out = [cache.run(model, groups)[1].float() for groups in PREFILL_THEN_DECODES]
    return torch.cat(out)


def test_model_on_the_kernel_is_as_close_to_fp32_as_onednn_bf16(
    kernel: Bf16Kernel, tmp_path: Path
) -> None:
    """Every projection and the head on the kernel (prefill rows through the paired path,
    decodes in place): logits as close to the fp32 model's as oneDNN's bf16 model's are."""
    folder = make_checkpoint(tmp_path / "ckpt")
    exact, _ = load_model(folder, dtype=torch.float32)
    onednn, _ = load_model(folder, dtype=torch.bfloat16)
    onednn.prepack()
    ours, _ = load_model(folder, dtype=torch.bfloat16)
    ours.prepack(kernel=kernel)
    assert isinstance(ours.layers[0].mlp.w13, KernelLinear)
    assert ours.lm_head is None
    ref = _logits(exact)
    onednn_err = (_logits(onednn) - ref).abs().max().item()
    ours_err = (_logits(ours) - ref).abs().max().item()
    assert ours_err <= 1.5 * onednn_err + 1e-2, (ours_err, onednn_err)


def test_a_kernel_of_another_dtype_is_not_used(kernel: Bf16Kernel, tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path / "ckpt")
    model, _ = load_model(folder, dtype=torch.float32)
    model.prepack(kernel=kernel)
    assert isinstance(model.layers[0].attn.wqkv, PackedLinear)


def _engine(monkeypatch: pytest.MonkeyPatch, amx: bool, **extra: object) -> EngineCore:
    monkeypatch.setattr(runner_mod, "onednn_uses_amx", lambda flags, isa: amx)
    cfg = EngineConfig(
        model_dir=str(default_model_dir()),
        dtype="bfloat16",
        threads=2,
        warmup=False,
        nice=0,
        **extra,  # type: ignore[arg-type]
    )
    return EngineCore(cfg, default_model_dir())


def test_engine_runs_bf16_on_the_kernel_without_amx_and_on_onednn_with_it(
    kernel: Bf16Kernel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ours = _engine(monkeypatch, amx=False)
    assert ours.runner.small_m_kernel is kernel
    assert isinstance(ours.runner.model.layers[0].attn.wqkv, KernelLinear)
    assert ours.runner.model._stack is None  # the fused decode stack is fp32 only
    with caplog.at_level(logging.INFO, logger="tailguard.engine"):
        tiles = _engine(monkeypatch, amx=True)
    assert tiles.runner.small_m_kernel is None
    assert isinstance(tiles.runner.model.layers[0].attn.wqkv, PackedLinear)
    assert "AMX" in caplog.text
    off = _engine(monkeypatch, amx=False, small_m_kernel=False)
    assert isinstance(off.runner.model.layers[0].attn.wqkv, PackedLinear)


def test_engine_generates_on_the_kernel(
    kernel: Bf16Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded model in bf16 on the kernel: decodes of 1-12 sequences and prefills run,
    every request gets its tokens, and the first greedy token of each (a prefill's last row)
    is the one oneDNN's bf16 model picks in most requests (summation order may flip a near tie
    in bf16, never most of them)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(2, 40))] for _ in range(12)]

    def greedy(core: EngineCore) -> dict[str, list[int]]:
        for i, p in enumerate(prompts):
            sp = SamplingParams(max_tokens=12, ignore_eos=True)
            core.add(EngineRequest(request_id=f"r{i}", prompt_token_ids=tuple(p), sampling=sp))
        got: dict[str, list[int]] = {}
        while core.has_work():
            for o in core.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        return got

    ours = greedy(_engine(monkeypatch, amx=False))
    onednn = greedy(_engine(monkeypatch, amx=False, small_m_kernel=False))
    assert all(len(ours[f"r{i}"]) == 12 for i in range(len(prompts)))
    same_first = sum(ours[r][0] == onednn[r][0] for r in ours)
    assert same_first >= 10, (ours, onednn)


def test_amx_rule() -> None:
    assert onednn_uses_amx(["amx_bf16", "avx512_bf16"])
    assert not onednn_uses_amx(["amx_bf16"], "AVX512_CORE_BF16")
    assert onednn_uses_amx(["amx_bf16"], "avx512_core_amx")
    assert not onednn_uses_amx(["avx512_bf16"])

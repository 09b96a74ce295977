"""The bf16 linear kernel (model/kernels/gemv_bf16.c): against a float64 product on every
block-size edge, what it refuses, the model on it against oneDNN's bf16 and the fp32
reference, on both of its paths (vdpbf16ps, and AMX tiles where the CPU has them), and where
the engine uses it and where not; the bf16 decode stack (decode_bf16.c) against the op-by-op
forward, bit for bit; the bf16 prefill attention (attn_bf16.c) against SDPA."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.model.model_testkit import TINY, PagedCache, built_or_skip, make_checkpoint

from tailguard.core.request import EngineRequest, SamplingParams
from tailguard.engine import runner as runner_mod
from tailguard.engine.config import EngineConfig
from tailguard.engine.core import EngineCore
from tailguard.model.embedded import default_model_dir
from tailguard.model.kernels import (
    Bf16Kernel,
    bf16_kernel_unavailable_reason,
    load_bf16_kernel,
    load_row_kernel,
)
from tailguard.model.kernels.attn_bf16 import (
    PrefillAttention,
    load_prefill_attention,
    paged,
    prefill_attention_unavailable_reason,
)
from tailguard.model.kernels.attn_bf16 import _check as prefill_check
from tailguard.model.kernels.attn_bf16 import reference as prefill_reference
from tailguard.model.kernels.decode import (
    Bf16DecodeStack,
    DecodeStack,
    decode_unavailable_reason,
    load_decode_stack,
)
from tailguard.model.kernels.decode import self_check as decode_self_check
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
    """Built once per machine, loaded once per session; skipped on CPUs without AVX512-BF16
    (or without a C compiler), and a failure anywhere else: a kernel that builds but fails its
    self-check must not turn these tests into skips."""
    return built_or_skip(load_bf16_kernel(), bf16_kernel_unavailable_reason(), "bf16 kernel")


@pytest.fixture(params=["vdpbf16ps", "amx"])
def amx(request: pytest.FixtureRequest, kernel: Bf16Kernel) -> Iterator[bool]:
    """The kernel on one of its paths for the test (AMX skipped where the CPU or the build has
    no tiles); the engine's runner then sets the decode stack to the same path."""
    on = request.param == "amx"
    before = kernel.amx
    if kernel.use_amx(on) != on:
        kernel.use_amx(before)
        pytest.skip("no AMX tiles here (CPU or build)")
    yield on
    kernel.use_amx(before)


def _rel_err(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    want = x.double() @ w.double().t()
    return ((got.double() - want).abs() / (want.abs() + 1.0)).max().item()


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64_on_every_block_edge(
    kernel: Bf16Kernel, amx: bool, threads: int
) -> None:
    """Rows 1-17, 25, 32, 33 and 45 (vdpbf16ps: in place up to 12, paired chunks above; AMX:
    one in-place tile up to 16, two up to 32, padded blocks of 32 above), odd K and K off 32
    (the vdpbf16ps path on an AMX machine), partial panels: within one bf16 rounding of the
    exact product (fp32 sums, rounded once)."""
    g = torch.Generator().manual_seed(3)
    for m in (*range(1, 18), 25, 32, 33, 45):
        for n, k in ((31, 64), (33, 65), (64, 128), (70, 7), (50, 96)):
            x = torch.randn(m, k, generator=g).bfloat16()
            w = torch.randn(n, k, generator=g).bfloat16()
            got = kernel.linear(x, kernel.pack(w), threads)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert _rel_err(got, x, w) < 2.0**-8, (m, n, k)


def test_kernel_reads_strided_and_misaligned_inputs(kernel: Bf16Kernel, amx: bool) -> None:
    """A view of wider rows (qkv-style) is read in place; a view starting on an odd element
    (not a 32-bit boundary) is copied first; both give the contiguous input's answer."""
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(40, 300, generator=g).bfloat16()  # 40 rows: AMX's padded blocks too
    w = torch.randn(96, 128, generator=g).bfloat16()
    wp = kernel.pack(w)
    views = (wide[:, :128], wide[:9, :128], wide[:, 1:129], wide[:3, 7:135], wide[:14, 2:130])
    views += (wide[:25, 32:160], wide[:32, 5:133])  # AMX: two in-place tiles
    for view in views:
        assert torch.equal(kernel.linear(view, wp), kernel.linear(view.contiguous(), wp))


def test_kernel_rows_do_not_depend_on_the_row_count(kernel: Bf16Kernel, amx: bool) -> None:
    """Each output row is the same bits whichever path its row count takes (AMX: one tile up to
    16 rows, two up to 32, padded blocks above; vdpbf16ps: in place up to 12, chunks above):
    the products run in the same order on every path."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(45, 256, generator=g).bfloat16()
    wp = kernel.pack(torch.randn(100, 256, generator=g).bfloat16())
    full = kernel.linear(x, wp)
    for m in (1, 8, 12, 13, 16, 17, 25, 32, 33):
        assert torch.equal(kernel.linear(x[:m], wp), full[:m]), m


@pytest.mark.parametrize("threads", [1, 2])
def test_x_read_in_place_or_copied_gives_the_same_bits(
    kernel: Bf16Kernel, amx: bool, threads: int
) -> None:
    """Above 32 rows on AMX, x is read in place where a thread has few panels (its partial last
    block still copied) and copied into blocks where it has many: the same bits either way,
    for a contiguous x and a view of wider rows, 64 to 70 rows."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(1056, 256, generator=g).bfloat16()  # 33 panels: copied at 1 or 2 threads
    many, few = kernel.pack(w), kernel.pack(w[:64])  # 2 panels: in place
    wide = torch.randn(70, 300, generator=g).bfloat16()
    for x in (wide[:, :256].contiguous(), wide[:, 32:288], wide[:64, :256]):
        assert torch.equal(kernel.linear(x, few, threads), kernel.linear(x, many, threads)[:, :64])


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_blocked_path_without_its_buffer_gives_the_same_bits(
    kernel: Bf16Kernel, amx: bool, threads: int
) -> None:
    """Above 32 rows on AMX, `linear` keeps its sums between k-chunks in a per-thread buffer
    (and stores each block's outputs during the next block's k-steps), and does without (K
    unchunked, each block stored right away) where there is no memory for it. The same bits
    either way (K 64 to 2,816, one and two x groups, a padded last block, a partial last
    panel), and within one bf16 rounding of the exact product."""
    if not amx:
        pytest.skip("the AMX blocked path only")
    g = torch.Generator().manual_seed(12)
    for m, n, k in ((33, 64, 64), (100, 200, 1024), (200, 96, 2816), (45, 40, 256)):
        x = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        packed = kernel.pack(w)
        want = kernel.linear(x, packed, threads)
        kernel.use_amx_buffers(False)
        try:
            got = kernel.linear(x, packed, threads)
        finally:
            kernel.use_amx_buffers(True)
        assert torch.equal(got, want), (m, n, k)
        assert _rel_err(want, x, w) < 2.0**-8, (m, n, k)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_silu_gives_the_two_calls_bits(kernel: Bf16Kernel, amx: bool, threads: int) -> None:
    """linear_fused(silu=True): silu(gate) * up of w13's product, bit for bit `linear` and
    then the row kernel's bf16 silu_mul, on AMX above 32 rows (k-chunks and x groups
    included: K 1,024, 300 rows; two x groups: K 2,816, 200 rows; an odd number of output
    panels; each panel's outputs stored while the next computes); None where it does not run
    (32 rows and fewer, vdpbf16ps), so the caller makes the two calls."""
    rows_kernel = load_row_kernel()
    assert rows_kernel is not None
    g = torch.Generator().manual_seed(8)
    cases = ((33, 64, 64), (45, 96, 256), (300, 160, 1024), (200, 96, 2816))
    for m, i, k in (*cases, (32, 64, 64), (7, 64, 64)):
        x = torch.randn(m, k, generator=g).bfloat16()
        w13 = kernel.pack((torch.randn(2 * i, k, generator=g) * 0.1).bfloat16())
        got = kernel.linear_fused(x, w13, threads, silu=True)
        if not amx or m <= 32:
            assert got is None
            continue
        assert got is not None
        want = rows_kernel.silu_mul(kernel.linear(x, w13, threads), threads)
        assert torch.equal(got, want), (m, i, k)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_residual_add_gives_the_two_calls_bits(
    kernel: Bf16Kernel, amx: bool, threads: int
) -> None:
    """linear_fused(residual=): residual + the product, bit for bit `linear` and then
    torch's bf16 add, on AMX above 32 rows (k-chunks and x groups: K 1,024 and 2,816 at 300
    rows; 12 panels of K 2,816 at 200 rows, more than one group of panels kept in L2; an odd
    panel count; a residual that is a strided view; each also without the per-thread buffer,
    K unchunked); None where it does not run
    (32 rows and fewer, N not whole panels, vdpbf16ps)."""
    g = torch.Generator().manual_seed(9)
    cases = ((33, 64, 64), (45, 96, 256), (300, 160, 1024), (70, 64, 2816), (200, 384, 2816))
    for m, n, k in (*cases, (32, 64, 64), (7, 64, 64), (40, 48, 64)):
        x = torch.randn(m, k, generator=g).bfloat16()
        w = kernel.pack((torch.randn(n, k, generator=g) * 0.1).bfloat16())
        wide = (torch.randn(m, n + 8, generator=g) * 4).bfloat16()
        for res in (wide[:, :n].contiguous(), wide[:, 8:]):
            got = kernel.linear_fused(x, w, threads, residual=res)
            if not amx or m <= 32 or n % kernel.width:
                assert got is None
                continue
            assert got is not None
            assert torch.equal(got, res + kernel.linear(x, w, threads)), (m, n, k)
            kernel.use_amx_buffers(False)
            try:
                unchunked = kernel.linear_fused(x, w, threads, residual=res)
            finally:
                kernel.use_amx_buffers(True)
            assert unchunked is not None and torch.equal(unchunked, got), (m, n, k)
    with pytest.raises(ValueError, match="residual must be bf16"):
        kernel.linear_fused(x, w, residual=torch.zeros(m, n))


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_residual_add_rounds_special_sums_as_torch(
    kernel: Bf16Kernel, amx: bool, threads: int
) -> None:
    """The residual store's 32-column fast path hands rows whose sums hold a denormal or a
    NaN (which vcvtne2ps2bf16 does not round as torch does) to the exact path: zero rows of x
    against residuals of denormals, NaNs and +-inf, beside ordinary rows, bit for bit
    `residual + linear(x)` (NaN where it is NaN)."""
    if not amx:
        pytest.skip("the fused residual store runs on AMX only")
    g = torch.Generator().manual_seed(11)
    m, n, k = 96, 64, 256
    x = torch.randn(m, k, generator=g).bfloat16()
    x[::3] = 0  # these rows' products are 0: their sums are the residual itself
    w = kernel.pack((torch.randn(n, k, generator=g) * 0.1).bfloat16())
    res = torch.randn(m, n, generator=g).bfloat16()
    res[::6, ::5] = torch.tensor(3e-39).bfloat16()  # a denormal
    res[3::6, 1::7] = -torch.tensor(1e-40).bfloat16()
    res[6::12, 2] = float("nan")
    res[9::12, 3] = float("inf")
    res[9::12, 4] = -float("inf")
    assert (res.float().abs() < 1.2e-38).any() and res.isnan().any()
    got = kernel.linear_fused(x, w, threads, residual=res)
    assert got is not None
    want = res + kernel.linear(x, w, threads)
    nan = want.isnan()  # NaN payloads differ (torch's vectorised add gives 0xffff): not compared
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("threads", [1, 2])
def test_folded_rms_norm_gives_the_two_calls_bits(
    kernel: Bf16Kernel, amx: bool, threads: int
) -> None:
    """linear_fused with a norm, and with silu too: RMSNorm inside the AMX x copy, bit for bit the
    row kernel's rms_norm and then `linear` / silu (K 64 to 2,816; 33-1,000 rows; rows
    of very different scales; a padded last block; the threads split by rows where each has
    4 blocks of 32 or more: 300 and 1,000 rows, 1,000 at 3 threads too); None where it does not
    run."""
    rows_kernel = load_row_kernel()
    assert rows_kernel is not None
    g = torch.Generator().manual_seed(10)
    shapes = ((33, 64, 64), (45, 96, 256), (300, 160, 1024), (70, 64, 2816), (1000, 64, 256))
    for m, n, k in (*shapes, (32, 64, 64), (40, 40, 64)):  # the last: not whole panels
        x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
        x = x.bfloat16()
        nw = (torch.rand(k, generator=g) + 0.5).bfloat16()
        w = kernel.pack((torch.randn(2 * n, k, generator=g) * 0.1).bfloat16())
        got = kernel.linear_fused(x, w, threads, norm=(nw, 1e-5))
        got_silu = kernel.linear_fused(x, w, threads, silu=True, norm=(nw, 1e-5))
        if not amx or m <= 32 or n % kernel.width:
            assert got is None and got_silu is None
            continue
        normed = rows_kernel.rms_norm(x, nw, 1e-5, threads)
        assert got is not None and got_silu is not None
        assert torch.equal(got, kernel.linear(normed, w, threads)), (m, n, k)
        want_silu = kernel.linear_fused(normed, w, threads, silu=True)
        assert want_silu is not None and torch.equal(got_silu, want_silu), (m, n, k)
        if m == 1000:
            assert torch.equal(kernel.linear_fused(x, w, 3, norm=(nw, 1e-5)), got), m
    with pytest.raises(ValueError, match="norm weight must be contiguous bf16"):
        kernel.linear_fused(x, w, norm=(torch.ones(k), 1e-5))


def test_pack_lays_out_pairs_of_k_per_panel(kernel: Bf16Kernel) -> None:
    """tg_bf16_pack (and the attention's key packing, the same pack_rows): panel p holds, for
    each pair of k, the pair of every one of its 32 rows side by side, zeros past N and K (the
    gathers' path for even K, the scalar loop for odd K; partial last panels)."""
    g = torch.Generator().manual_seed(13)
    for n, k in ((1, 2), (31, 64), (32, 64), (33, 65), (70, 256), (100, 7)):
        w = torch.randn(n, k, generator=g).bfloat16()
        got = kernel.pack(w).panels
        width = kernel.width
        padded = torch.zeros(-(-n // width) * width, -(-k // 2) * 2, dtype=torch.bfloat16)
        padded[:n, :k] = w
        want = padded.view(-1, width, padded.shape[1] // 2, 2).permute(0, 2, 1, 3)
        assert torch.equal(got, want.reshape(got.shape)), (n, k)


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


def _greedy(core: EngineCore, prompts: list[list[int]], tokens: int) -> dict[str, list[int]]:
    """Every prompt generated greedily to `tokens` tokens on `core`: request id -> tokens."""
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
        core.add(EngineRequest(request_id=f"r{i}", prompt_token_ids=tuple(p), sampling=sp))
    got: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


def test_engine_runs_bf16_on_the_kernel_unless_only_onednn_has_amx(
    kernel: Bf16Kernel, amx: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel on its path, with the decode stack on the same path; oneDNN's matmuls where
    oneDNN has AMX tiles and the kernel has not (its vdpbf16ps path is 5-10x slower than AMX at
    prefill sizes), or where the config turns the kernel off."""
    for onednn_amx in (False, True):
        ours = _engine(monkeypatch, amx=onednn_amx)
        if onednn_amx and not amx:
            assert ours.runner.small_m_kernel is None and ours.runner.model._stack is None
            assert isinstance(ours.runner.model.layers[0].attn.wqkv, PackedLinear)
            continue
        assert ours.runner.small_m_kernel is kernel and kernel.amx == amx
        assert isinstance(ours.runner.model.layers[0].attn.wqkv, KernelLinear)
        stack = ours.runner.model._stack  # and the bf16 decode stack, on the kernel's path
        assert stack is not None and stack.kernel.amx == amx
    with caplog.at_level(logging.INFO, logger="tailguard.engine"):
        kernel.use_amx(False)
        _engine(monkeypatch, amx=True)
        kernel.use_amx(amx)
    assert "AMX" in caplog.text
    off = _engine(monkeypatch, amx=False, small_m_kernel=False)
    assert isinstance(off.runner.model.layers[0].attn.wqkv, PackedLinear)


def test_engine_generates_on_the_kernel(
    kernel: Bf16Kernel, amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded model in bf16 on the kernel: decodes of 1-12 sequences and prefills run,
    every request gets its tokens, and the first greedy token of each (a prefill's last row)
    is the one oneDNN's bf16 model picks in most requests (summation order may flip a near tie
    in bf16, never most of them)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(2, 40))] for _ in range(12)]

    ours = _greedy(_engine(monkeypatch, amx=False), prompts, 12)
    onednn = _greedy(_engine(monkeypatch, amx=False, small_m_kernel=False), prompts, 12)
    assert all(len(ours[f"r{i}"]) == 12 for i in range(len(prompts)))
    same_first = sum(ours[r][0] == onednn[r][0] for r in ours)
    assert same_first >= 10, (ours, onednn)


def test_amx_rule() -> None:
    assert onednn_uses_amx(["amx_bf16", "avx512_bf16"])
    assert not onednn_uses_amx(["amx_bf16"], "AVX512_CORE_BF16")
    assert onednn_uses_amx(["amx_bf16"], "avx512_core_amx")
    assert not onednn_uses_amx(["avx512_bf16"])


# ---- the bf16 decode stack (decode_bf16.c) ----


def _bf16_stack_or_skip(kernel: Bf16Kernel) -> DecodeStack:
    """The bf16 decode stack where the bf16 kernel exists (a stack that then fails its
    self-check is a failure, not a skip)."""
    stack = load_decode_stack(torch.bfloat16)
    if stack is None or load_row_kernel() is None:
        pytest.fail(f"bf16 decode stack unavailable: {decode_unavailable_reason(torch.bfloat16)}")
    assert stack.dtype == torch.bfloat16
    return stack


def test_bf16_decode_stack_gives_the_op_by_op_bits(
    kernel: Bf16Kernel, amx: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 checkpoint (GQA, a 16-token window, head_dim 32 so RoPE runs on the row kernel)
    on the bf16 kernel and row kernels: a prefill op by op, then 12 decode steps of three
    sequences past the window on the stack, bit for bit the op-by-op forward's hidden states
    and KV cache (each phase rounds where the op it replaces rounds)."""
    stack = _bf16_stack_or_skip(kernel)
    assert stack.use_amx(amx) == amx  # the kernel's path
    calls = []
    run = DecodeStack.run

    def counted(self: DecodeStack, *a: object) -> None:
        calls.append(1)
        run(self, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeStack, "run", counted)
    folder = make_checkpoint(tmp_path / "ckpt", dataclasses.replace(TINY, head_dim=32))
    models = []
    for _ in range(2):
        m, _ = load_model(folder, dtype=torch.bfloat16)
        assert m.use_row_kernel(load_row_kernel())
        m.prepack(kernel=kernel)
        models.append(m)
    op, fused = models
    caches = [PagedCache(m.config, 80, 4, torch.bfloat16) for m in models]
    assert fused.use_decode_stack(stack, caches[1].kv)
    prompts = [[5, 9, 17, 3, 22, 8, 1, 40, 2], [40, 2], [7] * 21]
    steps = [[[(i, p) for i, p in enumerate(prompts)]]]
    steps += [[[(i, [11 + i + j]) for i in range(3)]] for j in range(12)]
    for groups in steps:
        _, want, _ = caches[0].run(op, groups)
        _, got, _ = caches[1].run(fused, groups)
        assert torch.equal(got, want)
    assert len(calls) == 12  # every decode step, not the prefill
    for (k0, v0), (k1, v1) in zip(caches[0].kv, caches[1].kv, strict=True):
        assert torch.equal(k1, k0) and torch.equal(v1, v0)


def test_bf16_decode_stack_is_bound_only_where_it_applies(
    kernel: Bf16Kernel, tmp_path: Path
) -> None:
    stack = _bf16_stack_or_skip(kernel)
    fp32_stack = load_decode_stack(torch.float32)
    wide = make_checkpoint(tmp_path / "wide", dataclasses.replace(TINY, head_dim=32))
    model, _ = load_model(wide, dtype=torch.bfloat16)
    kv = PagedCache(model.config, dtype=torch.bfloat16).kv
    assert model.use_row_kernel(load_row_kernel())
    assert not model.use_decode_stack(stack, kv)  # projections still plain linears
    model.prepack(kernel=kernel)
    assert not model.use_decode_stack(fp32_stack, kv)  # a stack of another dtype
    assert model.use_decode_stack(stack, kv)
    narrow, _ = load_model(make_checkpoint(tmp_path / "narrow"), dtype=torch.bfloat16)
    assert narrow.use_row_kernel(load_row_kernel())
    narrow.prepack(kernel=kernel)
    # head_dim 16: bf16 RoPE cannot run on the row kernel (half a head is not whole lanes)
    assert not narrow.use_decode_stack(stack, PagedCache(narrow.config, dtype=torch.bfloat16).kv)


def test_bf16_decode_stack_self_check_catches_a_wrong_stack(kernel: Bf16Kernel) -> None:
    stack = _bf16_stack_or_skip(kernel)
    assert decode_self_check(stack) is None

    class Skewed:  # the built stack, its output nudged past bf16's roundings
        def __getattr__(self, name: str) -> object:
            return getattr(stack, name)

        def run(self, layers: object, dims: object, x: torch.Tensor, *a: object) -> None:
            stack.run(layers, dims, x, *a)  # type: ignore[arg-type]
            x[0, 0] += 4.0

    assert "decode stack self-check failed" in (decode_self_check(Skewed()) or "")  # type: ignore[arg-type]


def _counting_greedy_heads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the bf16 stack's greedy head from now on (one entry per call)."""
    calls: list[int] = []
    head = Bf16DecodeStack.greedy_head

    def counted(self: Bf16DecodeStack, *a: object) -> torch.Tensor:
        calls.append(1)
        return head(self, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(Bf16DecodeStack, "greedy_head", counted)
    return calls


def test_engine_greedy_tokens_identical_with_and_without_the_bf16_stack(
    kernel: Bf16Kernel, amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded model in bf16: 20 sequences (decode batches above the kernel's 12 direct
    rows and AMX's 16-row tile, so the blocked paths run too) generate the same greedy tokens
    with the stack (and its greedy head: the final norm, the head and the argmax in one C
    call) as op by op."""
    _bf16_stack_or_skip(kernel)
    rng = random.Random(21)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(2, 60))] for _ in range(20)]

    fused = _engine(monkeypatch, amx=False)
    assert fused.runner.model._stack is not None
    assert fused.runner.model._stack.greedy_head is not None
    unfused = _engine(monkeypatch, amx=False, fused_decode=False)
    calls = _counting_greedy_heads(monkeypatch)
    assert _greedy(fused, prompts, 16) == _greedy(unfused, prompts, 16)
    assert len(calls) == 15  # every decode step of the fused engine (16 tokens: 1 + 15)


def test_greedy_head_gives_the_op_by_op_tokens(kernel: Bf16Kernel, amx: bool) -> None:
    """The stack's greedy head against the op-by-op tail on the same rows: the row kernel's
    RMSNorm, the head on the bf16 kernel, torch's argmax of the bf16 logits; rows picked out
    of order and repeated, one row NaN (torch's argmax takes the first NaN), and rows it
    cannot read refused with a clear error."""
    stack = _bf16_stack_or_skip(kernel)
    assert stack.use_amx(amx) == amx
    rows_kernel = load_row_kernel()
    assert rows_kernel is not None
    g = torch.Generator().manual_seed(3)
    t, h, vocab = 21, 64, 1000  # 21 rows read: past AMX's 16-row tile on the AMX path
    x = torch.randn(t, h, generator=g).bfloat16()
    x[5, 7] = float("nan")
    norm_w = (torch.rand(h, generator=g) + 0.5).bfloat16()
    head = (torch.randn(vocab, h, generator=g) * 0.2).bfloat16()
    for rows in ([3, 0, 20, 7, 5], [2, 2, 9, 1, 4, 6, 8, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]):
        idx = torch.tensor(rows)
        got = stack.greedy_head(x, idx, norm_w, 1e-5, stack.pack(head), vocab, 2)
        normed = rows_kernel.rms_norm(x, norm_w, 1e-5, 2)[idx]
        logits = kernel.linear(normed, kernel.pack(head), 2)
        assert got.tolist() == logits.float().argmax(-1).tolist()
    assert torch.isnan(
        kernel.linear(rows_kernel.rms_norm(x, norm_w, 1e-5)[5:6], kernel.pack(head))
    ).any()
    with pytest.raises(ValueError, match="greedy head refused"):
        stack.greedy_head(x, torch.tensor([0, t]), norm_w, 1e-5, stack.pack(head), vocab, 2)
    with pytest.raises(ValueError, match="contiguous bf16"):
        stack.greedy_head(x.float(), torch.tensor([0]), norm_w, 1e-5, stack.pack(head), vocab, 2)


def test_engine_takes_the_greedy_head_only_when_every_sequence_is_greedy(
    kernel: Bf16Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a sampled sequence in it needs the logits: it runs the forward and the
    head in Python; the greedy sequence beside it gets the same tokens as alone."""
    _bf16_stack_or_skip(kernel)
    core = _engine(monkeypatch, amx=False)
    calls = _counting_greedy_heads(monkeypatch)
    alone = _greedy(core, [[5, 9, 17, 3]], 6)
    assert len(calls) == 5
    calls.clear()
    core.add(
        EngineRequest(
            request_id="r0",
            prompt_token_ids=(5, 9, 17, 3),
            sampling=SamplingParams(max_tokens=6, ignore_eos=True),
        )
    )
    hot = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=1)
    core.add(EngineRequest(request_id="hot", prompt_token_ids=(40, 2, 7), sampling=hot))
    got: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert calls == [] and got["r0"] == alone["r0"] and len(got["hot"]) == 6


# ---- first chunks' causal attention in bf16 (attn_bf16.c) ----


def _prefill_or_fail(kernel: Bf16Kernel) -> PrefillAttention:
    """Where the bf16 kernel exists, the prefill attention must too (its self-check passing),
    on the kernel's path (vdpbf16ps or AMX tiles)."""
    got = load_prefill_attention()
    if got is None:
        pytest.fail(f"prefill attention unavailable: {prefill_attention_unavailable_reason()}")
    assert got.use_amx(kernel.amx) == kernel.amx
    return got


@pytest.mark.parametrize(
    ("nh", "nkv", "hd", "window"),
    [(16, 4, 64, 0), (12, 4, 32, 9), (8, 8, 32, 0), (8, 2, 128, 5)],
)
def test_prefill_attention_matches_sdpa_in_fp32(
    kernel: Bf16Kernel, amx: bool, nh: int, nkv: int, hd: int, window: int
) -> None:
    """Sequences of 1-70 rows (partial key panels and query blocks of 12 or 16 rows, keys off
    AMX's 32), a padding row, GQA 4, 3 and 1, a sliding window: within the error torch's own
    bf16 SDPA makes against fp32. On AMX, head_dim 32 and 64 take attend_block_amx, 128 the
    tiles of attend_block."""
    attn = _prefill_or_fail(kernel)
    g = torch.Generator().manual_seed(nh + hd + window)
    lens = [1, 70, 33, 12, 64]
    firsts = [sum(lens[:i]) for i in range(len(lens))]
    t = sum(lens)
    qkv = (torch.randn(t, (nh + 2 * nkv) * hd, generator=g) * 2).bfloat16()
    out = torch.zeros(t + 1, nh * hd, dtype=torch.bfloat16)
    firsts_t = torch.tensor([*firsts, t])  # the last row is padding: skipped
    attn.attend(qkv, firsts_t, torch.tensor([*lens, 1]), nh, nkv, hd, window, out, 2)
    want = prefill_reference(qkv, firsts, lens, nh, nkv, hd, window)
    err = (out.float() - want).abs().max().item()
    assert err < 0.02 * want.abs().max().item(), err
    assert torch.equal(out[t], torch.zeros(nh * hd, dtype=torch.bfloat16))  # padding row
    # the same rows through torch's bf16 SDPA, sequence by sequence: our error is no worse
    sdpa = prefill_reference(qkv, firsts, lens, nh, nkv, hd, window, dtype=torch.bfloat16)
    assert err <= 1.5 * (sdpa - want).abs().max().item() + 1e-2
    # the next linear's panels prefetched on the way (`warm`, wo in the model): same bits
    wo = kernel.pack(torch.randn(nh * hd, nh * hd, generator=g).bfloat16())
    warmed = torch.zeros_like(out)
    attn.attend(
        qkv, firsts_t, torch.tensor([*lens, 1]), nh, nkv, hd, window, warmed, 2, warm=wo.panels
    )
    assert torch.equal(warmed, out)


@pytest.mark.parametrize("window", [0, 100])
def test_prefill_attention_reads_later_chunks_keys_from_the_cache(
    kernel: Bf16Kernel, amx: bool, window: int
) -> None:
    """Later chunks of prompts longer than a step (M's heads: 16 / 4, head_dim 64): 172
    queries at positions 128-299 and a 1-query chunk at 299 read their keys from paged caches
    of shuffled blocks, beside a 40-token first chunk and a padding row; each as the whole
    prompt's attention gives those rows, within what bf16 SDPA is off fp32."""
    attn = _prefill_or_fail(kernel)
    nh, nkv, hd, bs = 16, 4, 64, 16
    g = torch.Generator().manual_seed(12)
    width = (nh + 2 * nkv) * hd
    long_a, long_b, first = (torch.randn(n, width, generator=g).bfloat16() for n in (300, 300, 40))
    (ka, va, ta), (kb, vb, tb) = (paged(p, nh, nkv, hd, bs, seed) for p, seed in
                                  ((long_a, 1), (long_b, 2)))  # fmt: skip
    nb = ka.shape[0]  # one cache for both prompts: b's blocks after a's (block 0 the null)
    k_cache, v_cache = torch.cat((ka, kb[1:])), torch.cat((va, vb[1:]))
    tables = torch.zeros(4, ta.shape[1], dtype=torch.long)
    tables[0], tables[1] = ta[0], tb[0] + nb - 1
    qkv = torch.cat((long_a[128:], long_b[299:], first))  # rows 0-171, 172, 173-212
    t = qkv.shape[0]
    out = torch.zeros(t + 1, nh * hd, dtype=torch.bfloat16)
    attn.attend(
        qkv, torch.tensor([0, 172, 173, t]), torch.tensor([172, 1, 40, 1]), nh, nkv, hd, window,
        out, 2, starts=torch.tensor([128, 299, 0, 0]), cache=(k_cache, v_cache, tables),
    )  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        want = torch.cat((
            prefill_reference(long_a, [0], [300], nh, nkv, hd, window, dtype)[128:300],
            prefill_reference(long_b, [0], [300], nh, nkv, hd, window, dtype)[299:300],
            prefill_reference(first, [0], [40], nh, nkv, hd, window, dtype)[:40],
        ))  # fmt: skip
        if dtype == torch.float32:
            err = (out[:t].float() - want).abs().max().item()
            exact = want
        else:
            assert err <= 1.5 * (want - exact).abs().max().item() + 1e-2, err
    assert torch.equal(out[t], torch.zeros(nh * hd, dtype=torch.bfloat16))  # padding row
    with pytest.raises(ValueError, match="refused its arguments"):  # a later chunk, no cache
        attn.attend(qkv, torch.tensor([0]), torch.tensor([172]), nh, nkv, hd, 0, out, 2,
                    starts=torch.tensor([128]))  # fmt: skip
    fp32_v = (k_cache, v_cache.float(), tables)
    with pytest.raises(ValueError, match="contiguous bf16 KV cache"):
        attn.attend(qkv, torch.tensor([0]), torch.tensor([172]), nh, nkv, hd, 0, out, 2,
                    starts=torch.tensor([128]), cache=fp32_v)  # fmt: skip


def test_prefill_attention_refuses_shapes_it_does_not_take(kernel: Bf16Kernel) -> None:
    attn = _prefill_or_fail(kernel)
    assert not attn.applies(16, 4, 48) and not attn.applies(32, 2, 64)
    qkv = torch.zeros(4, 6 * 48, dtype=torch.bfloat16)
    out = torch.zeros(5, 4 * 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="refused"):
        attn.attend(qkv, torch.tensor([0]), torch.tensor([4]), 4, 1, 48, 0, out, 2)
    with pytest.raises(ValueError, match="contiguous bf16"):
        attn.attend(qkv.float(), torch.tensor([0]), torch.tensor([4]), 4, 1, 48, 0, out, 2)


def test_prefill_attention_self_check_catches_a_wrong_kernel(kernel: Bf16Kernel) -> None:
    attn = _prefill_or_fail(kernel)
    assert prefill_check(attn) is None

    class Shifted:  # the built kernel, one output row moved
        def __getattr__(self, name: str) -> object:
            return getattr(attn, name)

        def attend(self, qkv: torch.Tensor, *a: object) -> None:
            attn.attend(qkv, *a)  # type: ignore[arg-type]
            out = a[-2]
            assert isinstance(out, torch.Tensor)
            out[3] = out[4]

    assert "prefill attention self-check failed" in (prefill_check(Shifted()) or "")  # type: ignore[arg-type]


def _bf16_model(folder: Path, kernel: Bf16Kernel, attn: PrefillAttention | None) -> MistralModel:
    """A bf16 model on the linear kernel and the row kernels, the prefill attention bound
    where `attn` is given."""
    m, _ = load_model(folder, dtype=torch.bfloat16)
    assert m.use_row_kernel(load_row_kernel())
    m.prepack(kernel=kernel)
    assert m.use_prefill_attention(attn) == (attn is not None)
    return m


def test_model_prefill_on_the_kernel_is_as_close_to_fp32_as_sdpa(
    kernel: Bf16Kernel, amx: bool, tmp_path: Path
) -> None:
    """head_dim 32 (RoPE on the row kernel, whole key panels): first chunks of three prompts
    on the kernel, then two decode steps; logits as close to the fp32 model's as the SDPA
    path's, and only where it applies (head_dim 16, or RoPE off the row kernel: not bound)."""
    attn = _prefill_or_fail(kernel)
    folder = make_checkpoint(tmp_path / "ckpt", dataclasses.replace(TINY, head_dim=32))
    exact, _ = load_model(folder, dtype=torch.float32)
    models = [_bf16_model(folder, kernel, attn if use else None) for use in (False, True)]
    steps = [[[(0, [5, 9, 17, 3, 22, 8, 1, 40, 2] * 3), (1, [40, 2]), (2, [7] * 14)]]]
    steps += [[[(i, [11 + i + j]) for i in range(3)]] for j in range(2)]
    caches = [PagedCache(m.config, 80, 4, m.dtype) for m in (exact, *models)]
    errs = []
    for groups in steps:
        _, ref, _ = caches[0].run(exact, groups)
        got = [c.run(m, groups)[1].float() for c, m in zip(caches[1:], models, strict=True)]
        errs.append([(g - ref).abs().max().item() for g in got])
    for sdpa_err, ours_err in errs:
        assert ours_err <= 1.5 * sdpa_err + 1e-2, errs
    narrow, _ = load_model(make_checkpoint(tmp_path / "narrow"), dtype=torch.bfloat16)
    assert narrow.use_row_kernel(load_row_kernel())
    assert not narrow.use_prefill_attention(attn)  # head_dim 16
    plain, _ = load_model(folder, dtype=torch.bfloat16)
    assert not plain.use_prefill_attention(attn)  # RoPE not on the row kernel


def _as_close_as_sdpa(
    exact: MistralModel, models: list[MistralModel], steps: list[list[list[tuple[int, list[int]]]]]
) -> None:
    """Run the steps on the fp32 model and on models [SDPA, ours]: ours within 1.5x of the
    SDPA path's distance from fp32 at every step."""
    caches = [PagedCache(m.config, 80, 4, m.dtype) for m in (exact, *models)]
    for groups in steps:
        _, ref, _ = caches[0].run(exact, groups)
        sdpa, ours = (c.run(m, groups)[1].float() for c, m in zip(caches[1:], models, strict=True))
        sdpa_err, ours_err = ((x - ref).abs().max().item() for x in (sdpa, ours))
        assert ours_err <= 1.5 * sdpa_err + 1e-2, (groups, ours_err, sdpa_err)


def test_model_prompt_chunks_after_the_first_run_on_the_kernel(
    kernel: Bf16Kernel, amx: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt longer than a step: its second and third chunks (positions 24-39, 40-44)
    attend on the kernel, their earlier keys read from the paged cache, as close to the fp32
    model's logits as the SDPA path (gathers and an additive mask) is; every layer's call
    carries the chunk's start."""
    attn = _prefill_or_fail(kernel)
    folder = make_checkpoint(tmp_path / "ckpt", dataclasses.replace(TINY, head_dim=32))
    exact, _ = load_model(folder, dtype=torch.float32)
    models = [_bf16_model(folder, kernel, attn if use else None) for use in (False, True)]
    prompt = [5, 9, 17, 3, 22, 8, 1, 40, 2] * 5
    steps = [[[(0, prompt[:24]), (1, [7] * 10)]], [[(0, prompt[24:40])]], [[(0, prompt[40:])]]]
    starts: list[list[int]] = []
    real = type(attn).attend

    def counted(self: PrefillAttention, *a: object, **k: object) -> None:
        st = k.get("starts")
        starts.append(st.tolist() if isinstance(st, torch.Tensor) else [])
        real(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(type(attn), "attend", counted)
    _as_close_as_sdpa(exact, models, steps)
    layers = models[1].config.num_hidden_layers
    assert starts == [[0, 0]] * layers + [[24]] * layers + [[40]] * layers
    # a layer that cannot take the kernel (RoPE off the row kernel) builds the additive mask
    # for its CHUNKED groups and runs SDPA, the other layers still on the kernel
    models[1].layers[0].attn.fused_rope = None  # type: ignore[union-attr]
    starts.clear()
    _as_close_as_sdpa(exact, models, steps)
    assert starts == [[0, 0]] * (layers - 1) + [[24]] * (layers - 1) + [[40]] * (layers - 1)


def _prefill_with_and_without(
    kernel: Bf16Kernel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """A bf16 model (head_dim 32) on the kernel and the row kernels, a 40-token prefill with
    and without the `KernelLinear.fused` calls that pass `kind` ("silu", "norm" or
    "residual"; the others left as they are): both hidden states, and whether each such call
    ran fused."""
    folder = make_checkpoint(tmp_path / "ckpt", dataclasses.replace(TINY, head_dim=32))
    model, _ = load_model(folder, dtype=torch.bfloat16)
    assert model.use_row_kernel(load_row_kernel())
    model.prepack(kernel=kernel)
    step = [[(0, list(range(3, 43)))]]  # one group: a 40-token first chunk
    calls: list[bool] = []
    off = [False]
    real = KernelLinear.fused

    def fused(self: KernelLinear, x: torch.Tensor, **kw: Any) -> torch.Tensor | None:
        if kw.get(kind) is None or kw.get(kind) is False:  # not a call of this kind
            return real(self, x, **kw)
        if off[0]:
            return None
        out = real(self, x, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(KernelLinear, "fused", fused)
    with_fused, _, _ = PagedCache(model.config, 80, 4, torch.bfloat16).run(model, step)
    off[0] = True
    without, _, _ = PagedCache(model.config, 80, 4, torch.bfloat16).run(model, step)
    return with_fused, without, calls


def test_model_prefill_with_the_fused_silu_gives_the_same_bits(
    kernel: Bf16Kernel, amx: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model on the kernel and row kernels: a 40-token prefill runs the MLP's
    silu(gate) * up inside w13 on AMX (every layer), with the same hidden states as the two
    calls."""
    with_fused, without, calls = _prefill_with_and_without(kernel, tmp_path, monkeypatch, "silu")
    assert torch.equal(with_fused, without)
    assert calls == [amx] * TINY.num_hidden_layers


def test_model_prefill_with_the_fused_residual_adds_gives_the_same_bits(
    kernel: Bf16Kernel, amx: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model on the kernel: a 40-token prefill adds each layer's residual inside wo's
    and w2's stores on AMX, with the same hidden states as the separate adds."""
    with_fused, without, calls = _prefill_with_and_without(
        kernel, tmp_path, monkeypatch, "residual"
    )
    assert torch.equal(with_fused, without)
    assert calls == [amx] * 2 * TINY.num_hidden_layers  # wo and w2


def test_model_prefill_with_the_folded_norms_gives_the_same_bits(
    kernel: Bf16Kernel, amx: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model on the kernel and row kernels: a 40-token prefill runs each layer's
    attn_norm inside wqkv's x copy and ffn_norm inside w13's on AMX, with the same hidden
    states as the norms' own passes."""
    folded, apart, norms = _prefill_with_and_without(kernel, tmp_path, monkeypatch, "norm")
    assert torch.equal(folded, apart)
    assert norms == [amx] * 2 * TINY.num_hidden_layers  # wqkv and w13


def test_engine_binds_the_prefill_attention_with_the_bf16_kernel(
    kernel: Bf16Kernel, amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded model (head_dim 32) in bf16 on the kernel: every layer's first chunks on
    the attention kernel, on the linears' path (vdpbf16ps or AMX tiles); not with oneDNN's
    matmuls."""
    attn = _prefill_or_fail(kernel)
    attn.use_amx(not amx)  # the engine sets it to the kernel's path
    ours = _engine(monkeypatch, amx=False)
    assert all(ly.attn.prefill is attn for ly in ours.runner.model.layers)  # type: ignore[union-attr]
    assert attn.amx == amx
    off = _engine(monkeypatch, amx=False, small_m_kernel=False)
    assert all(ly.attn.prefill is None for ly in off.runner.model.layers)  # type: ignore[union-attr]


def test_kernels_interleave_with_torchs_own_bf16_ops(kernel: Bf16Kernel, amx: bool) -> None:
    """Our tile kernels configure and release AMX's tile state in torch's own OpenMP threads,
    between torch's (oneDNN's) bf16 matmuls and SDPA, which may keep tiles configured across
    calls: each of torch's results stays bit for bit what it was before any call of ours."""
    attn = _prefill_or_fail(kernel)
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 16, 300, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 4, 300, 64, generator=g).bfloat16() for _ in range(2))
    x, w = (
        torch.randn(40, 512, generator=g).bfloat16(),
        torch.randn(700, 512, generator=g).bfloat16(),
    )
    want_sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want_mm = x @ w.t()
    wp = kernel.pack(torch.randn(96, 256, generator=g).bfloat16())
    qkv = torch.randn(45, 8 * 32, generator=g).bfloat16()  # 4 query, 2 KV heads of 32
    out = torch.zeros(46, 4 * 32, dtype=torch.bfloat16)
    for rows in (8, 40, 3, 33):
        kernel.linear(torch.randn(rows, 256, generator=g).bfloat16(), wp)
        assert torch.equal(
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), want_sdpa
        )
        attn.attend(qkv, torch.tensor([0]), torch.tensor([45]), 4, 2, 32, 0, out, 2)
        assert torch.equal(x @ w.t(), want_mm)

"""The small-M fp32 kernel (model/kernels/gemv.c): against torch on every block-size edge,
the fallback when it cannot be built, and the model / engine with it against oneDNN."""

from __future__ import annotations

import gc
import logging
import random
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests.model.model_testkit import PagedCache, built_or_skip, make_checkpoint

from tailguard.core.request import EngineRequest, SamplingParams
from tailguard.engine.config import EngineConfig
from tailguard.engine.core import EngineCore
from tailguard.model.batch import AttnGroup
from tailguard.model.config import MistralConfig
from tailguard.model.embedded import default_model_dir
from tailguard.model.kernels import (
    RowKernel,
    SmallMKernel,
    load_row_kernel,
    load_small_m_kernel,
    small_m_unavailable_reason,
)
from tailguard.model.kernels.decode import (
    DecodeStack,
    decode_unavailable_reason,
    load_decode_stack,
)
from tailguard.model.kernels.decode import self_check as decode_self_check
from tailguard.model.kernels.pages import HUGE_PAGE, huge_empty
from tailguard.model.kernels.rows import row_kernel_unavailable_reason, self_check
from tailguard.model.loader import load_model
from tailguard.model.mistral import (
    Attention,
    KernelLinear,
    MistralModel,
    PackedLinear,
    RMSNorm,
    _rope_table,
    apply_rope,
    attention_mask,
)


@pytest.fixture(scope="session")
def kernel() -> SmallMKernel:
    """Built once per machine (cached under ~/.cache/tailguard/kernels), loaded once per session."""
    return built_or_skip(load_small_m_kernel(), small_m_unavailable_reason(), "small-M kernel")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= 1e-4 * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_torch_on_every_block_edge(kernel: SmallMKernel, threads: int) -> None:
    """M 1..16 and past the 12-row (AVX-512) / 6-row register chunks up to max_m, N around
    the panel width (32 / 16 columns, the last panel zero-padded), odd K, 1-3 threads (more
    threads than panels too)."""
    g = torch.Generator().manual_seed(threads)
    for m in [*range(1, 17), 23, 24, 25, 37, kernel.max_m]:
        for n in (1, 3, 15, 16, 17, 31, 32, 33, 65, 97):
            for k in (1, 7, 16, 17, 33, 100):
                x = torch.randn(m, k, generator=g)
                w = torch.randn(n, k, generator=g)
                got = kernel.linear(x, kernel.pack(w), threads)
                assert got.shape == (m, n) and got.dtype == torch.float32
                _assert_close(got, _reference(x, w), f"M={m} N={n} K={k} threads={threads}")


def test_kernel_reads_row_strided_inputs_and_model_sized_shapes(kernel: SmallMKernel) -> None:
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(8, 300, generator=g)
    x = wide[:, 10:266]  # [8, 256] view, row stride 300: read in place
    w = torch.randn(1536, 256, generator=g)
    _assert_close(kernel.linear(x, kernel.pack(w)), _reference(x, w), "strided x")
    # weights of 4 MiB and more with panels past L1 (AVX2: 7-64 rows on the k-blocked walk,
    # 7-12 of them on its inlined two-chunk walks, 3-12 with two panels walked together), K off
    # the 32-row block, N off the panel (an odd panel out of the pairs at N 1000, none at
    # 1024), 13 rows in uneven chunks; 1 and 2 threads share the pairs out
    for m, n, k in (
        (8, 5632, 1024), (8, 1024, 2816), (1, 32000, 64), (16, 1536, 1024), (13, 1000, 1100),
        (64, 1000, 1100), *((m, 1000, 1100) for m in range(1, 13)), (4, 1024, 1100),
    ):  # fmt: skip
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g)
        packed, want = kernel.pack(w), _reference(x, w)
        for threads in (1, 2):
            got = kernel.linear(x, packed, threads)
            _assert_close(got, want, f"M={m} N={n} K={k} threads={threads}")
    w = torch.randn(40, 24, generator=g)
    wt = w.t().contiguous().t()  # not contiguous: packed from a contiguous copy
    x = torch.randn(3, 24, generator=g)
    assert torch.equal(kernel.linear(x, kernel.pack(wt)), kernel.linear(x, kernel.pack(w)))


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding `addr` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= addr < hi:
                flags = next(f for f in lines[i + 1 :] if f.startswith("VmFlags:"))
                return flags.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="needs Linux with transparent huge pages (madvise refuses the advice without them)",
)
def test_panels_of_model_sized_weights_lie_on_advised_huge_pages(kernel: SmallMKernel) -> None:
    """A weight of 2 MiB or more is packed into a fresh mapping advised MADV_HUGEPAGE, starting
    on a 2 MiB boundary, and reads the same as ordinary memory; a small one stays on torch's
    allocator."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1536, 1024, generator=g)  # 6 MiB in fp32
    packed = kernel.pack(w)
    ptr = packed.panels.data_ptr()
    assert ptr % HUGE_PAGE == 0
    assert "hg" in _vm_flags(ptr), "the panels' mapping was not advised MADV_HUGEPAGE"
    x = torch.randn(8, 1024, generator=g)
    _assert_close(kernel.linear(x, packed), _reference(x, w), "panels on huge pages")
    small = huge_empty((HUGE_PAGE // 8,), torch.float32)  # 1 MiB: torch's allocator
    assert "hg" not in _vm_flags(small.data_ptr())
    big = huge_empty((3, HUGE_PAGE // 4), torch.float32)  # 6 MiB
    gc.collect()  # the mapping is held by the tensor alone, nothing else refers to it
    big.fill_(2.0)
    assert (
        big.shape == (3, HUGE_PAGE // 4) and big.is_contiguous() and big.sum() == 6 * HUGE_PAGE // 4
    )


def test_kernel_refuses_what_it_cannot_read(kernel: SmallMKernel) -> None:
    w = kernel.pack(torch.randn(8, 16))
    assert w.panels.shape == (1, 16, kernel.width) and w.nbytes == 16 * kernel.width * 4
    with pytest.raises(ValueError, match="needs fp32 x"):
        kernel.linear(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="needs fp32 x"):
        kernel.linear(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="packs CPU fp32"):
        kernel.pack(torch.randn(8, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="needs fp32 x"):
        kernel.linear(torch.randn(2, 16, dtype=torch.bfloat16), w)


def _fake_compiler(folder: Path) -> Path:
    """Answers --version like a compiler, fails every compile."""
    cc = folder / "fakecc"
    cc.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo fakecc 1.0; exit 0; fi\n'
        'echo "fakecc: error: no such luck" >&2\nexit 1\n'
    )
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    return cc


def _fallback_lines(
    load: Callable[..., object], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> list[str]:
    """Ask `load` twice with no compiler (cache k1) and with one that fails (cache k2): both
    answers None; the log lines the asks left."""
    missing = str(tmp_path / "no-such-cc")
    broken = str(_fake_compiler(tmp_path))
    with caplog.at_level(logging.WARNING, logger="tailguard.engine"):
        for _ in range(2):  # the second ask is answered from the first, silently
            assert load(missing, tmp_path / "k1") is None
            assert load(broken, tmp_path / "k2") is None
    return [r.getMessage() for r in caplog.records]


def test_no_compiler_or_failed_build_falls_back_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lines = _fallback_lines(load_small_m_kernel, tmp_path, caplog)
    assert len(lines) == 2, lines
    assert "small-M kernel unavailable, using oneDNN: no C compiler" in lines[0]
    assert "no-such-cc" in lines[0]
    assert "compiling gemv.c failed" in lines[1] and "no such luck" in lines[1]
    missing = str(tmp_path / "no-such-cc")
    assert small_m_unavailable_reason(missing, tmp_path / "k1") is not None
    assert not list((tmp_path / "k2").glob("*")), "a failed build leaves no file behind"


def test_row_kernels_fall_back_with_one_line_and_are_checked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """rows.c is built like gemv.c: no compiler or a failed build is None plus one warning;
    a library that builds is self-checked against torch before use, and the check catches a
    wrong argmax or a wrong draw."""
    lines = _fallback_lines(load_row_kernel, tmp_path, caplog)
    assert len(lines) == 2, lines
    assert "row kernels unavailable, using torch: no C compiler" in lines[0]
    assert "compiling rows.c failed" in lines[1]
    built = load_row_kernel(cache_dir=tmp_path / "r3")
    if built is None:
        pytest.skip("no working C compiler here")
    assert self_check(built) is None
    assert [p.name.startswith("rows-") for p in (tmp_path / "r3").glob("*.so")] == [True]

    class OffByOne:  # the built kernel, one column off
        def argmax(self, *a: object) -> list[int]:
            return [i + 1 for i in built.argmax(*a)]  # type: ignore[arg-type]

        def sample(self, *a: object) -> list[int]:
            return [i + 1 for i in built.sample(*a)]  # type: ignore[arg-type]

    assert "argmax self-check failed" in (self_check(OffByOne()) or "")  # type: ignore[arg-type]
    OffByOne.argmax = lambda self, *a: built.argmax(*a)  # type: ignore[method-assign,assignment]
    assert "sampling self-check failed" in (self_check(OffByOne()) or "")  # type: ignore[arg-type]


def test_bf16_rounding_is_torchs_and_the_check_catches_a_flush(tmp_path: Path) -> None:
    """Every bf16 kernel output rounds through rows.c's rne/store_bf16, which take the
    hardware conversion (vcvtneps2bf16) where the CPU has one: torch's bits on ties, denormals,
    infinities and NaN, and a build that trusts the hardware for denormals and NaN too fails
    the self-check (so the engine would fall back to torch, not serve other bits)."""
    from tailguard.model.kernels.build import Loader
    from tailguard.model.kernels.rows import ABI, SOURCE, RowKernel, rounding_cases

    kernel = _row_kernel_or_skip()
    x = rounding_cases()
    got, want = kernel.to_bf16(x), x.bfloat16()
    finite = ~x.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    assert got[~finite].isnan().all() and (got[~finite].view(torch.int16) == 0x7FC0).all()
    assert torch.equal(kernel.to_bf16(x[:5]).view(torch.int16), want[:5].view(torch.int16))
    if " avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no vcvtneps2bf16 on this CPU: the integer path is the only one")
    flushing = tmp_path / "rows.c"  # the hardware's own rounding for every vector
    src = SOURCE.read_text()
    trusting = src.replace("return _mm512_fpclass_ps_mask((__m512)v, 0xA1) == 0;", "return 1;")
    assert trusting != src
    flushing.write_text(trusting)
    bad = Loader(flushing, "tg_rows_abi", ABI, RowKernel, lambda k: None, what="t", fallback="t")
    built = bad.load(None, tmp_path / "cache")
    assert built is not None
    assert "bf16 rounding self-check failed" in (self_check(built) or "")


def _logits(model: MistralModel, prompts: list[list[int]]) -> torch.Tensor:
    cache = PagedCache(model.config, num_blocks=80, block_size=4)
    _, logits, _ = cache.run(model, [[(i, p) for i, p in enumerate(prompts)]])
    return logits


def test_model_with_failed_kernel_is_exactly_the_onednn_model(tmp_path: Path) -> None:
    """The fallback is the oneDNN path itself: bit-identical logits."""
    folder = make_checkpoint(tmp_path / "ckpt")
    prompts = [[5, 9, 17, 3], [40, 2]]
    onednn, _ = load_model(folder, dtype=torch.float32)
    onednn.prepack()
    missing = load_small_m_kernel(str(tmp_path / "no-such-cc"), tmp_path / "k")
    fallback, _ = load_model(folder, dtype=torch.float32)
    fallback.prepack(kernel=missing)
    assert isinstance(fallback.layers[0].attn.wqkv, PackedLinear)
    assert torch.equal(_logits(onednn, prompts), _logits(fallback, prompts))


def test_model_with_kernel_matches_plain_model(kernel: SmallMKernel, tmp_path: Path) -> None:
    """Every projection and the head on the kernel (decode-sized rows) or the batched matmul
    over its panels (more rows): logits within fp32 rounding of the unpacked model."""
    folder = make_checkpoint(tmp_path / "ckpt")
    plain, _ = load_model(folder, dtype=torch.float32)
    model, _ = load_model(folder, dtype=torch.float32)
    model.prepack(kernel=kernel)
    assert isinstance(model.layers[0].mlp.w13, KernelLinear)
    assert model.lm_head is None
    for rows in (3, 2 * kernel.max_m + 2):  # decode-sized rows, then prefill-sized
        prompts = [[(7 * i + j) % 250 + 3 for j in range(rows // 2)] for i in range(2)]
        err = (_logits(model, prompts) - _logits(plain, prompts)).abs().max().item()
        assert err < 1e-4, rows


def _greedy(config: EngineConfig, prompts: list[list[int]]) -> dict[str, list[int]]:
    core = EngineCore(config, Path(config.model_dir or ""))
    lin = core.runner.model.layers[0].attn.wqkv
    assert isinstance(lin, KernelLinear) == config.small_m_kernel
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=24, ignore_eos=True)
        core.add(EngineRequest(request_id=f"r{i}", prompt_token_ids=tuple(p), sampling=sp))
    got: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


def test_engine_greedy_tokens_identical_with_and_without_kernel(kernel: SmallMKernel) -> None:
    """The embedded model, fp32, 2 threads: decode steps of 1-12 sequences (kernel rows) and
    prefills (oneDNN rows) give the same greedy tokens as oneDNN alone."""
    folder = default_model_dir()
    rng = random.Random(12)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(2, 40))] for _ in range(12)]
    base = dict(model_dir=str(folder), dtype="float32", threads=2, warmup=False, nice=0)
    with_kernel = _greedy(EngineConfig(**base, small_m_kernel=True), prompts)  # type: ignore[arg-type]
    without = _greedy(EngineConfig(**base, small_m_kernel=False), prompts)  # type: ignore[arg-type]
    assert with_kernel == without


def _row_kernel_or_skip() -> RowKernel:
    return built_or_skip(load_row_kernel(), row_kernel_unavailable_reason(), "row kernels")


# Three sequences (9, 2 and 21 prompt tokens) prefilled in one step, then two decode steps
_PROMPTS = [[5, 9, 17, 3, 22, 8, 1, 40, 2], [40, 2], [7] * 21]
PREFILL_THEN_TWO_DECODES = [
    [[(i, p) for i, p in enumerate(_PROMPTS)]],
    [[(i, [11 + i]) for i in range(3)]],
    [[(i, [30 + i]) for i in range(3)]],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize(
    "shape",
    [(8, 2, 32), (8, 2, 64), (8, 2, 128), (6, 2, 64)],
    ids=["generic", "rep4-hd64", "rep4-hd128", "rep3"],  # rows.c specialises rep 4, hd 64 / 128
)
def test_decode_attention_kernel_matches_the_sdpa_path(
    window: int, dtype: torch.dtype, shape: tuple[int, int, int]
) -> None:
    """One decode group read straight from a paged cache (blocks scattered, contexts 1-300,
    GQA query / KV heads, two padding rows, optionally a sliding window) against the
    gather + SDPA path of `Attention.attend` with the engine's mask. bf16: the kernel reads the
    bf16 cache and rounds its output once; the reference is the fp32 path on the same bf16
    values, rounded to bf16, so the two may differ by one bf16 step."""
    kernel = _row_kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    (nh, nkv, hd), bs, blocks = shape, 16, 120
    cfg = MistralConfig(
        vocab_size=64, hidden_size=nh * hd, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=window or None, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    attn = Attention(cfg)
    k_cache = torch.randn(blocks, bs, nkv, hd, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, nkv, hd, generator=g).to(dtype)
    ctx = [1, 300, 17, 16, 33, 129, 1, 1]  # the last two rows are padding
    n_tok = 6
    width = max(-(-c // bs) for c in ctx)
    free = torch.randperm(blocks - 1, generator=g) + 1  # block 0 is the null block
    tables, used = [], 0
    for c in ctx:
        need = -(-c // bs)
        tables.append(free[used : used + need].tolist() + [0] * (width - need))
        used += need
    group = AttnGroup(
        token_index=torch.tensor([[i] for i in range(n_tok)] + [[n_tok], [n_tok]]),
        block_tables=torch.tensor(tables),
        context_lens=torch.tensor(ctx),
        query_start=torch.tensor([c - 1 for c in ctx]),
    )
    q = torch.randn(n_tok, nh, hd, generator=g).to(dtype)
    q_ext = torch.cat((q, q.new_zeros(1, nh, hd))).float()
    mask = attention_mask(group, n_tok, width * bs, window or None)
    want = torch.zeros(n_tok + 1, nh * hd)
    attn.attend(q_ext, group, mask, k_cache.float(), v_cache.float(), want)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one step of its 8-bit mantissa
    outs = []
    for threads in (1, 2, 3):
        got = torch.full((n_tok + 1, nh * hd), 7.0, dtype=dtype)
        kernel.decode_attention(
            q, group.token_index[:, 0].contiguous(), n_tok, k_cache, v_cache,
            group.block_tables, group.context_lens, width * bs, window, got, threads,
        )  # fmt: skip
        torch.testing.assert_close(
            got[:n_tok].float(), want[:n_tok].to(dtype).float(), rtol=tol, atol=tol
        )
        assert (got[n_tok] == 7.0).all(), "padding rows are skipped, not written"
        outs.append(got)
    # the (sequence, KV head) pairs are handed out to threads as they free up (contexts differ):
    # which thread runs a pair must not change a bit
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    if dtype == torch.bfloat16:  # the fp32 kernel on the same values: the output rounds once
        got32 = torch.zeros(n_tok + 1, nh * hd)
        kernel.decode_attention(
            q.float(), group.token_index[:, 0].contiguous(), n_tok, k_cache.float(),
            v_cache.float(), group.block_tables, group.context_lens, width * bs, window, got32,
        )  # fmt: skip
        torch.testing.assert_close(got[:n_tok], got32[:n_tok].to(dtype), rtol=0, atol=0)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(ValueError, match="all fp32 or all bf16"):
        kernel.decode_attention(
            q, group.token_index[:, 0].contiguous(), n_tok, k_cache.to(other), v_cache,
            group.block_tables, group.context_lens, width * bs, window, got,
        )  # fmt: skip


def test_engine_generates_the_same_tokens_with_the_decode_attention_kernel(
    tmp_path: Path,
) -> None:
    """Greedy generation on the embedded model, row kernels on and off: same tokens. In fp32,
    the kernels' dtype: `auto` serves bf16 on a CPU with native bf16, where they stay off."""
    _row_kernel_or_skip()
    model = default_model_dir()
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(3, 32000) for _ in range(rng.randint(3, 90))) for _ in range(12)]
    runs = []
    for on in (False, True):
        core = EngineCore(
            EngineConfig(model_dir=str(model), threads=1, nice=0, row_kernels=on, dtype="float32"),
            model,
        )
        assert (core.runner.model.layers[0].attn.fused is not None) == on
        core.warmup()
        for i, p in enumerate(prompts):
            sp = SamplingParams(max_tokens=24, ignore_eos=True)
            core.add(EngineRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=sp))
        tokens: dict[str, list[int]] = {}
        while core.has_work():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_fused_forward_matches_the_torch_forward(tmp_path: Path) -> None:
    """RMSNorm, RoPE, silu(gate) * up and decode attention on the row kernels against the
    plain torch forward of the same checkpoint: a prefill, then two decode steps."""
    kernel = _row_kernel_or_skip()
    folder = make_checkpoint(tmp_path / "ckpt")
    plain, _ = load_model(folder, dtype=torch.float32)
    fused, _ = load_model(folder, dtype=torch.float32)
    assert fused.use_row_kernel(kernel)
    caches = [PagedCache(m.config, num_blocks=80, block_size=4) for m in (plain, fused)]
    for groups in PREFILL_THEN_TWO_DECODES:
        _, want, _ = caches[0].run(plain, groups)
        _, got, _ = caches[1].run(fused, groups)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bf16_decode_groups_attend_on_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model on the row kernels: every decode group reads the bf16 cache on the kernel,
    and the outputs are as close to the fp32 forward as the plain bf16 forward's are."""
    kernel = _row_kernel_or_skip()
    folder = make_checkpoint(tmp_path / "ckpt")
    exact, _ = load_model(folder, dtype=torch.float32)
    plain, _ = load_model(folder, dtype=torch.bfloat16)
    fused, _ = load_model(folder, dtype=torch.bfloat16)
    assert fused.use_row_kernel(kernel)
    calls = []
    real = kernel.decode_attention
    monkeypatch.setattr(
        kernel, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    caches = [PagedCache(m.config, 80, 4, m.dtype) for m in (exact, plain, fused)]
    for n, groups in enumerate(PREFILL_THEN_TWO_DECODES):
        _, ref, _ = caches[0].run(exact, groups)
        _, want, _ = caches[1].run(plain, groups)
        _, got, _ = caches[2].run(fused, groups)
        torch_err = (want.float() - ref).abs().max().item()
        kernel_err = (got.float() - ref).abs().max().item()
        assert kernel_err <= 1.5 * torch_err + 1e-3, (n, kernel_err, torch_err)
        if n == 1:
            assert len(calls) == fused.config.num_hidden_layers  # one group, every layer
    assert len(calls) == 2 * fused.config.num_hidden_layers  # both decode steps


def _stack_or_skip() -> DecodeStack:
    """The decode stack; a skip only where no C compiler exists (a stack that builds but
    fails its self-check is a failure)."""
    stack = load_decode_stack()
    if stack is None or load_row_kernel() is None or load_small_m_kernel() is None:
        why = decode_unavailable_reason() or small_m_unavailable_reason() or "row kernels"
        if "no C compiler" not in why:
            pytest.fail(f"the compiled kernels are unavailable: {why}")
        pytest.skip(why)
    return stack


def test_decode_stack_forward_matches_the_torch_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole decoder stack in one compiled call (decode.c) against the plain torch forward
    of the same checkpoint (GQA, a 16-token window, untied head): a prefill (op by op), then
    decode steps of three sequences past the window, each on the stack."""
    stack = _stack_or_skip()
    calls = []
    run = DecodeStack.run

    def counted(self: DecodeStack, *a: object) -> None:
        calls.append(1)
        run(self, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeStack, "run", counted)
    folder = make_checkpoint(tmp_path / "ckpt")
    plain, _ = load_model(folder, dtype=torch.float32)
    fused, _ = load_model(folder, dtype=torch.float32)
    caches = [PagedCache(m.config, num_blocks=80, block_size=4) for m in (plain, fused)]
    assert fused.use_row_kernel(load_row_kernel())
    fused.prepack(kernel=load_small_m_kernel())
    assert fused.use_decode_stack(stack, caches[1].kv)
    prompts = [[5, 9, 17, 3, 22, 8, 1, 40, 2], [40, 2], [7] * 21]
    steps = [[[(i, p) for i, p in enumerate(prompts)]]]
    steps += [[[(i, [11 + i + j]) for i in range(3)]] for j in range(12)]
    for groups in steps:
        _, want, _ = caches[0].run(plain, groups)
        _, got, _ = caches[1].run(fused, groups)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(calls) == 12  # every decode step, not the prefill
    for (k0, v0), (k1, v1) in zip(caches[0].kv, caches[1].kv, strict=True):
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)  # the cache writes too
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)


def test_decode_stack_is_bound_only_where_it_applies(tmp_path: Path) -> None:
    stack = _stack_or_skip()
    folder = make_checkpoint(tmp_path / "ckpt")
    model, _ = load_model(folder, dtype=torch.float32)
    kv = PagedCache(model.config).kv
    assert not model.use_decode_stack(stack, kv)  # no row kernel, no small-M panels yet
    assert model.use_row_kernel(load_row_kernel())
    assert not model.use_decode_stack(stack, kv)  # projections still plain linears
    model.prepack(kernel=load_small_m_kernel())
    assert not model.use_decode_stack(None, kv)
    assert model.use_decode_stack(stack, kv)


def test_engine_greedy_tokens_identical_with_and_without_the_decode_stack() -> None:
    """The embedded model, fp32: 20 sequences (decode batches above the kernel's 6-12 direct
    rows, so the stack's transposed-chunk path runs too) generate the same greedy tokens with
    the fused decode stack as op by op."""
    _stack_or_skip()
    folder = default_model_dir()
    rng = random.Random(21)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(2, 60))] for _ in range(20)]
    base = dict(model_dir=str(folder), dtype="float32", threads=2, warmup=False, nice=0)
    fused = EngineConfig(**base, fused_decode=True)  # type: ignore[arg-type]
    assert EngineCore(fused, folder).runner.model._stack is not None
    unfused = EngineConfig(**base, fused_decode=False)  # type: ignore[arg-type]
    assert _greedy(fused, prompts) == _greedy(unfused, prompts)


def test_decode_stack_self_check_catches_a_wrong_stack() -> None:
    stack = _stack_or_skip()
    assert decode_self_check(stack) is None

    class Skewed:  # the built stack, its output nudged
        def __getattr__(self, name: str) -> object:
            return getattr(stack, name)

        def run(self, layers: object, dims: object, x: torch.Tensor, *a: object) -> None:
            stack.run(layers, dims, x, *a)  # type: ignore[arg-type]
            x[0, 0] += 0.01

    assert "decode stack self-check failed" in (decode_self_check(Skewed()) or "")  # type: ignore[arg-type]


def test_a_library_is_rebuilt_when_a_file_it_includes_changes(tmp_path: Path) -> None:
    """decode_bf16.c includes gemv_bf16.c, which includes gemv_amx.c and rows.c: the cache key
    covers every file included at any depth (each once), so editing one builds a new library
    instead of loading the stale one."""
    from tailguard.model.kernels.build import build_library, default_compiler

    def build() -> Path:
        return build_library(tmp_path / "whole.c", default_compiler(), tmp_path / "cache")

    (tmp_path / "deep.c").write_text("int tg_deep(void) { return 0; }\n")
    (tmp_path / "part.c").write_text('#include "deep.c"\nint tg_part(void) { return 1; }\n')
    (tmp_path / "whole.c").write_text('#include "part.c"\nint tg_whole(void) { return 2; }\n')
    try:
        first = build()
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"no working C compiler here: {exc}")
    assert build() == first
    (tmp_path / "part.c").write_text('#include "deep.c"\nint tg_part(void) { return 3; }\n')
    second = build()
    assert second != first and second.exists()
    (tmp_path / "deep.c").write_text("int tg_deep(void) { return 4; }\n")
    third = build()  # a file two levels down (whole.c does not name it)
    assert third not in (first, second) and third.exists()


def test_bf16_elementwise_kernels_round_where_torch_rounds() -> None:
    """RMSNorm, silu(gate) * up and RoPE on bf16 rows against the model's torch ops in bf16:
    the same rounding points, so equal but for the last bit where fp32 sums (the mean, exp)
    are taken in another order; over 1 and 2 threads, 1 and 40 rows."""
    kernel = _row_kernel_or_skip()
    g = torch.Generator().manual_seed(5)
    bf = torch.bfloat16
    one_step = 2**-7  # the bf16 step at 1.0
    for rows, threads in ((1, 1), (40, 2)):
        x = (torch.randn(rows, 256, generator=g) * 3).to(bf)
        norm = RMSNorm(256, 1e-5).to(bf)
        norm.weight.data = (torch.rand(256, generator=g) + 0.5).to(bf)
        want = norm(x)
        got = kernel.rms_norm(x, norm.weight.data, 1e-5, threads)
        torch.testing.assert_close(got.float(), want.float(), rtol=one_step, atol=0)
        assert (got == want).float().mean() > 0.95

        gu = (torch.randn(rows, 2 * 96, generator=g) * 4).to(bf)
        gate, up = gu.chunk(2, dim=-1)
        want = F.silu(gate) * up
        got = kernel.silu_mul(gu, threads)
        # two roundings (silu, then the product), each possibly a step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * one_step, atol=1e-6)
        assert (got == want).float().mean() > 0.95

        heads, hd = 6, 64
        qkv = torch.randn(rows, heads * hd + 32, generator=g).to(bf)
        pos = torch.randint(0, 500, (rows,), generator=g)
        cos_t, sin_t = (t.index_select(0, pos).to(bf) for t in _rope_table(512, hd, 1e4))
        want = apply_rope(
            qkv[:, : heads * hd].view(rows, heads, hd), cos_t[:, None], sin_t[:, None]
        )
        got = qkv.clone()
        kernel.rope_(got, heads, hd, cos_t, sin_t, threads)
        assert torch.equal(got[:, : heads * hd].view(rows, heads, hd), want)
        assert torch.equal(got[:, heads * hd :], qkv[:, heads * hd :]), "only `heads` heads"
        # above rows.c's HD_MAX the row's cos / sin are widened in slices: same bits
        big = torch.randn(rows, 2 * 512, generator=g).to(bf)
        cos_b, sin_b = (t.index_select(0, pos).to(bf) for t in _rope_table(512, 512, 1e4))
        want_b = apply_rope(big.view(rows, 2, 512), cos_b[:, None], sin_b[:, None])
        kernel.rope_(big, 2, 512, cos_b, sin_b, threads)
        assert torch.equal(big.view(rows, 2, 512), want_b)

        # with kv: the last 2 rotated heads (K) and the 2 after them (V) into the caches, in
        # bf16 and fp32, with the same rotation as without
        nkv, hd2 = 2, 32
        for dt in (bf, torch.float32):
            qkv2 = torch.randn(rows, (heads + nkv) * hd2, generator=g).to(dt)
            cos2, sin2 = (t.index_select(0, pos).to(dt) for t in _rope_table(512, hd2, 1e4))
            slots = torch.randperm(3 * rows, generator=g)[:rows]
            k_cache = torch.zeros(3 * rows // 4 + 1, 4, nkv, hd2, dtype=dt)
            v_cache = torch.zeros_like(k_cache)
            want2 = qkv2.clone()
            kernel.rope_(want2, heads, hd2, cos2, sin2, threads)
            got2 = qkv2.clone()
            kernel.rope_(got2, heads, hd2, cos2, sin2, threads, kv=(nkv, slots, k_cache, v_cache))
            assert torch.equal(got2, want2)
            flat_k, flat_v = k_cache.view(-1, nkv, hd2), v_cache.view(-1, nkv, hd2)
            assert torch.equal(
                flat_k[slots], want2[:, (heads - nkv) * hd2 : heads * hd2].view(rows, nkv, hd2)
            )
            assert torch.equal(flat_v[slots], want2[:, heads * hd2 :].view(rows, nkv, hd2))
            untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
            untouched[slots] = False
            assert not flat_k[untouched].any() and not flat_v[untouched].any(), "only the slots"
            with pytest.raises(ValueError, match="KV cache"):
                kernel.rope_(
                    got2, heads, hd2, cos2, sin2, 1, kv=(nkv, slots, k_cache.half(), v_cache)
                )

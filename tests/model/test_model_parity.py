"""Our MistralModel against transformers' MistralForCausalLM on the same seeded weights.

The reference is HF's full-sequence forward: with causal attention the logits at position i
do not depend on later tokens, so one HF call gives the expected logits for every prefill
chunk and decode step we run through the paged cache. TINY has sliding_window=16 and the
sequences run to 40 tokens, so most positions are past the window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.model.model_testkit import PagedCache, hf_model

from tailguard.model.loader import load_model

ATOL = 1e-4  # fp32: observed differences are ~5e-6 on logits of magnitude ~5


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


@pytest.fixture(scope="module")
def models(tiny_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    return load_model(tiny_dir)[0], hf_model(tiny_dir)


@pytest.mark.parametrize("which", ["window16", "full_tied"])
def test_prefill_logits_match(
    which: str, tiny_dir: Path, tiny_full_tied_dir: Path, paged: type[PagedCache]
) -> None:
    folder = tiny_dir if which == "window16" else tiny_full_tied_dir
    ours, config = load_model(folder)
    hf = hf_model(folder)
    ids = _tokens(40, seed=1)
    cache = paged(config)
    # Padding everywhere the runner may put it: flat tail, query columns, table columns, rows.
    hidden, logits, _ = cache.run(
        ours, [[(0, ids)]], pad_tokens=5, pad_rows=1, pad_queries=3, pad_blocks=2
    )
    assert torch.isfinite(hidden).all(), "padding rows must stay finite"
    torch.testing.assert_close(logits[:40], _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_match(
    models: tuple[torch.nn.Module, torch.nn.Module], paged: type[PagedCache]
) -> None:
    ours, hf = models
    ids = _tokens(40, seed=2)
    expected = _hf_logits(hf, ids)
    cache = paged(ours.config)
    # Prefill in two chunks (the second crosses block and window boundaries), then decode one
    # token per step inside an 8-token bucket with a padded decode row.
    got = [cache.run(ours, [[(0, ids[:7])]])[1][:7], cache.run(ours, [[(0, ids[7:20])]])[1][:13]]
    for tok in ids[20:]:
        hidden, logits, last = cache.run(ours, [[(0, [tok])]], pad_tokens=7, pad_rows=2)
        assert torch.isfinite(hidden).all()
        got.append(logits[last[0]])
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_mixed_batch_one_forward(
    models: tuple[torch.nn.Module, torch.nn.Module], paged: type[PagedCache]
) -> None:
    """One forward: a decode group (two sequences mid-generation) + a prefill group of two
    prompts of different lengths, blocks interleaved between sequences."""
    ours, hf = models
    seqs = {s: _tokens(n, seed=10 + s) for s, n in [(0, 25), (1, 9), (2, 13), (3, 38)]}
    cache = paged(ours.config)
    cache.run(ours, [[(0, seqs[0][:24]), (1, seqs[1][:8])]])  # earlier steps, both prefilled
    _, logits, last = cache.run(
        ours,
        [[(0, seqs[0][24:]), (1, seqs[1][8:])], [(2, seqs[2]), (3, seqs[3])]],
        pad_tokens=4,
        pad_rows=1,
    )
    for group, members in zip(last, [(0, 1), (2, 3)], strict=True):
        for flat_last, seq in zip(group, members, strict=True):
            ref = _hf_logits(hf, seqs[seq])
            torch.testing.assert_close(logits[flat_last], ref[-1], atol=ATOL, rtol=0)
    # the whole prefill of sequence 3 (38 tokens, past the window), not just its last row
    start = 2 + len(seqs[2])
    torch.testing.assert_close(
        logits[start : start + 38], _hf_logits(hf, seqs[3]), atol=ATOL, rtol=0
    )


def test_greedy_generation_token_identical(
    models: tuple[torch.nn.Module, torch.nn.Module], paged: type[PagedCache]
) -> None:
    """Two prompts generated together through the paged cache vs HF generate, one by one."""
    ours, hf = models
    prompts = {0: _tokens(6, seed=20), 1: _tokens(11, seed=21)}
    new_tokens = 24  # 11 + 24 = 35 tokens: well past the 16-token window
    expected = {}
    for seq, prompt in prompts.items():
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # no early stop on eos
                do_sample=False,
                pad_token_id=0,
            )
        expected[seq] = out[0, len(prompt) :].tolist()

    cache = paged(ours.config)
    _, logits, last = cache.run(ours, [[(0, prompts[0]), (1, prompts[1])]])
    generated: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(new_tokens):
        logits = logits.clone()
        logits[:, ours.config.eos_token_id] = -torch.inf  # what min_new_tokens does in HF
        for seq, flat in zip((0, 1), last[0], strict=True):
            generated[seq].append(int(logits[flat].argmax()))
        _, logits, last = cache.run(
            ours, [[(0, generated[0][-1:]), (1, generated[1][-1:])]], pad_tokens=2
        )
    assert generated == expected


def test_bf16_runs_close_to_fp32(tiny_dir: Path, paged: type[PagedCache]) -> None:
    """Serving dtype: same code path in bf16 stays finite and near the fp32 logits."""
    fp32, config = load_model(tiny_dir)
    bf16, _ = load_model(tiny_dir, dtype=torch.bfloat16)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    ids = _tokens(40, seed=3)
    ref = paged(config).run(fp32, [[(0, ids)]])[1]
    cache = paged(config)
    cache.kv = [(k.bfloat16(), v.bfloat16()) for k, v in cache.kv]
    _, got, _ = cache.run(bf16, [[(0, ids)]], pad_tokens=3, pad_rows=1)
    assert got.dtype == torch.float32
    assert torch.isfinite(got).all()
    # bf16 has 8 mantissa bits: compare relative to the logit scale, and the argmax mostly agrees
    assert (got[:40] - ref).abs().max() < 0.1 * ref.abs().max()
    assert (got[:40].argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_mask_window_boundary_and_padding() -> None:
    """transformers' window: q sees k iff q - W < k <= q (W keys including itself)."""
    from tailguard.model.batch import AttnGroup
    from tailguard.model.mistral import attention_mask

    group = AttnGroup(
        token_index=torch.tensor([[0, 1, 9], [9, 9, 9]]),  # T = 9: one padded query, one row
        block_tables=torch.tensor([[1, 2, 3], [0, 0, 0]]),
        context_lens=torch.tensor([22, 1]),
        query_start=torch.tensor([20, 0]),
    )
    mask = attention_mask(group, num_tokens=9, kv_len=24, sliding_window=4)[:, 0]  # [G, Q, S]
    visible = mask == 0
    assert visible[0, 0].nonzero().flatten().tolist() == [17, 18, 19, 20]
    assert visible[0, 1].nonzero().flatten().tolist() == [18, 19, 20, 21]
    # padding queries see at least key 0, so softmax never meets an all -inf row
    assert visible[0, 2, 0] and visible[1].any(-1).all()
    assert mask.dtype == torch.float32 and not mask.isnan().any()


def test_forward_writes_cache_in_place(tiny_dir: Path, paged: type[PagedCache]) -> None:
    ours, config = load_model(tiny_dir)
    cache = paged(config)
    before = [(k.data_ptr(), v.data_ptr()) for k, v in cache.kv]
    snapshot = [k.clone() for k, _ in cache.kv]
    cache.run(ours, [[(0, _tokens(9, seed=4))]], pad_tokens=3)
    assert [(k.data_ptr(), v.data_ptr()) for k, v in cache.kv] == before
    changed = [
        (k != s).any(dim=(1, 2, 3)).nonzero().flatten().tolist()
        for (k, _), s in zip(cache.kv, snapshot, strict=True)
    ]
    # the sequence's 3 blocks (9 tokens / block 4) and the null block (padding writes)
    assert all(set(c) == {0, *cache.tables[0]} for c in changed)


def test_first_chunks_attend_causally_as_the_mask_does(
    tiny_full_tied_dir: Path, paged: type[PagedCache]
) -> None:
    """A group of first chunks (two prompts of different lengths, padded queries, a padding
    row, spare table columns) takes SDPA's causal flag on CPU; its hidden states match the
    additive-mask path's on the same batch, and the mask path still serves later chunks and
    windows shorter than the queries."""
    from dataclasses import replace

    from tailguard.model.mistral import CAUSAL

    ours, config = load_model(tiny_full_tied_dir)
    a, b = _tokens(37, seed=31), _tokens(22, seed=32)
    cache = paged(config)
    batch, _ = cache.batch(
        [[(0, a), (1, b)]], pad_tokens=3, pad_rows=1, pad_queries=5, pad_blocks=2
    )
    group = batch.groups[0]
    assert group.from_start
    assert ours._group_mask(group, torch.zeros(1, 1), 4) is CAUSAL
    masked = replace(batch, groups=(replace(group, from_start=False),))
    assert isinstance(ours._group_mask(masked.groups[0], torch.zeros(1, 1), 4), torch.Tensor)
    hidden = {}
    for name, bt in (("causal", batch), ("mask", masked)):
        kv = paged(config).kv  # a fresh cache each: both runs write the same slots
        with torch.inference_mode():
            hidden[name] = ours(bt, kv)
    n_real = len(a) + len(b)
    torch.testing.assert_close(
        hidden["causal"][:n_real], hidden["mask"][:n_real], atol=1e-5, rtol=0
    )
    assert torch.isfinite(hidden["causal"]).all(), "padding rows must stay finite"
    # a later chunk (queries not at position 0) and a window shorter than the queries: masks
    later, _ = cache.batch([[(0, _tokens(5, seed=33))]])
    assert not later.groups[0].from_start
    ours.config = replace(config, sliding_window=8)  # this test's own model
    assert isinstance(ours._group_mask(group, torch.zeros(1, 1), 4), torch.Tensor)

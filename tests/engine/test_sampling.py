"""Batched inverse-CDF sampling (engine/sampling.py): the right distribution, top-p, seeds."""

from __future__ import annotations

import math

import torch

from tailguard.engine.sampling import sample_rows


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_samples_follow_softmax_at_the_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n, temp = 20_000, 0.7
    picks = sample_rows(logits.repeat(n, 1), [temp] * n, [1.0] * n, [None] * n, _gen(1))
    counts = torch.bincount(torch.tensor(picks), minlength=5).double()
    expected = torch.softmax(logits.double() / temp, dim=0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom: p = 0.001


def test_each_row_uses_its_own_temperature() -> None:
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0]] * 4000)
    temps = [0.05] * 2000 + [100.0] * 2000  # near-greedy, then near-uniform
    picks = sample_rows(logits, temps, [1.0] * 4000, [None] * 4000, _gen(2))
    assert all(p == 0 for p in picks[:2000])
    assert sum(p != 0 for p in picks[2000:]) > 1200  # ~3/4 of a near-uniform draw


def test_top_p_never_samples_outside_the_nucleus_and_keeps_the_best() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 3000
    picks = sample_rows(logits.repeat(n, 1), [1.0] * n, [0.7] * n, [None] * n, _gen(3))
    assert set(picks) == {0, 1}  # 0.5 + 0.3 covers 0.7; 0.15 and 0.05 are cut
    tiny = sample_rows(logits.repeat(50, 1), [1.0] * 50, [1e-6] * 50, [None] * 50, _gen(4))
    assert set(tiny) == {0}


def test_zero_probability_tokens_are_never_picked() -> None:
    logits = torch.tensor([[-math.inf, 0.0, -math.inf, 0.0, -math.inf]] * 5000)
    picks = sample_rows(logits, [1.0] * 5000, [1.0] * 5000, [None] * 5000, _gen(5))
    assert set(picks) == {1, 3}


def test_a_seeded_row_does_not_depend_on_its_neighbours() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 1000)
    alone = sample_rows(row, [1.0], [0.9], [_gen(42)], _gen(7))
    others = torch.randn(5, 1000)
    mixed = sample_rows(
        torch.cat([others[:2], row, others[2:]]),
        [1.0, 0.5, 1.0, 2.0, 1.0, 1.0],
        [1.0, 1.0, 0.9, 1.0, 0.5, 1.0],
        [None, None, _gen(42), None, _gen(9), None],
        _gen(8),
    )
    assert mixed[2] == alone[0]


def test_no_rows() -> None:
    assert sample_rows(torch.zeros(0, 10), [], [], [], _gen(0)) == []

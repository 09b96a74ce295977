"""Batched inverse-CDF sampling (engine/sampling.py): the right distribution, top-p, seeds."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tests.model.model_testkit import built_or_skip

from tailguard.engine import sampling
from tailguard.engine.sampling import greedy_rows
from tailguard.model.kernels import load_row_kernel
from tailguard.model.kernels.rows import row_kernel_unavailable_reason

KERNEL = load_row_kernel()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# every test runs on the torch path and on the row kernel (model/kernels/rows.c)
@pytest.fixture(params=["torch", "kernel"])
def sample_rows(request: pytest.FixtureRequest) -> Callable[..., list[int]]:
    if request.param == "torch":
        return sampling.sample_rows
    kernel = built_or_skip(KERNEL, row_kernel_unavailable_reason(), "row kernels")

    def with_kernel(*args: Any, **kwargs: Any) -> list[int]:
        return sampling.sample_rows(*args, kernel=kernel, **kwargs)

    return with_kernel


def test_samples_follow_softmax_at_the_temperature(sample_rows: Callable[..., list[int]]) -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n, temp = 20_000, 0.7
    picks = sample_rows(logits.repeat(n, 1), [temp] * n, [1.0] * n, [None] * n, _gen(1))
    counts = torch.bincount(torch.tensor(picks), minlength=5).double()
    expected = torch.softmax(logits.double() / temp, dim=0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom: p = 0.001


def test_each_row_uses_its_own_temperature(sample_rows: Callable[..., list[int]]) -> None:
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0]] * 4000)
    temps = [0.05] * 2000 + [100.0] * 2000  # near-greedy, then near-uniform
    picks = sample_rows(logits, temps, [1.0] * 4000, [None] * 4000, _gen(2))
    assert all(p == 0 for p in picks[:2000])
    assert sum(p != 0 for p in picks[2000:]) > 1200  # ~3/4 of a near-uniform draw


def test_top_p_never_samples_outside_the_nucleus_and_keeps_the_best(
    sample_rows: Callable[..., list[int]],
) -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 3000
    picks = sample_rows(logits.repeat(n, 1), [1.0] * n, [0.7] * n, [None] * n, _gen(3))
    assert set(picks) == {0, 1}  # 0.5 + 0.3 covers 0.7; 0.15 and 0.05 are cut
    tiny = sample_rows(logits.repeat(50, 1), [1.0] * 50, [1e-6] * 50, [None] * 50, _gen(4))
    assert set(tiny) == {0}


def test_zero_probability_tokens_are_never_picked(sample_rows: Callable[..., list[int]]) -> None:
    logits = torch.tensor([[-math.inf, 0.0, -math.inf, 0.0, -math.inf]] * 5000)
    picks = sample_rows(logits, [1.0] * 5000, [1.0] * 5000, [None] * 5000, _gen(5))
    assert set(picks) == {1, 3}


def test_a_seeded_row_does_not_depend_on_its_neighbours(
    sample_rows: Callable[..., list[int]],
) -> None:
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


def test_no_rows(sample_rows: Callable[..., list[int]]) -> None:
    assert sample_rows(torch.zeros(0, 10), [], [], [], _gen(0)) == []


def test_rows_of_a_larger_batch_are_sampled_in_place(
    sample_rows: Callable[..., list[int]],
) -> None:
    """`rows` picks rows of the step's logits without copying them out: row 3 is near-greedy
    on token 7, row 1 on token 2; the other rows are never read."""
    logits = torch.zeros(5, 10)
    logits[3, 7] = logits[1, 2] = 40.0
    logits[0] = logits[2] = logits[4] = math.nan
    picks = sample_rows(logits, [1.0, 0.5], [1.0, 1.0], [None, None], _gen(11), rows=[3, 1])
    assert picks == [7, 2]


def test_both_paths_draw_the_same_tokens_from_the_same_uniforms() -> None:
    """Same generator state, same picks: the kernel locates the same uniform in the same
    distribution (a pick may differ only where float rounding moves a boundary)."""
    kernel = built_or_skip(KERNEL, row_kernel_unavailable_reason(), "row kernels")
    logits = torch.randn(400, 3000, generator=_gen(12)) * 2
    temps = [0.3 + (i % 7) * 0.3 for i in range(400)]
    ones = [1.0] * 400
    plain = sampling.sample_rows(logits, temps, ones, [None] * 400, _gen(13))
    fast = sampling.sample_rows(logits, temps, ones, [None] * 400, _gen(13), kernel=kernel)
    assert sum(a != b for a, b in zip(plain, fast, strict=True)) <= 2


def test_greedy_rows_match_torch_argmax_ties_and_nan_included() -> None:
    logits = torch.randn(6, 1000, generator=_gen(14))
    logits[1, 10] = logits[1, 600] = 99.0  # a tie: the first wins
    logits[4, 321] = math.nan  # torch counts a NaN as the maximum
    logits[5] = -math.inf
    want = logits.argmax(dim=-1).tolist()
    rows = [5, 4, 1, 0]
    assert greedy_rows(logits, rows) == [want[r] for r in rows]
    if KERNEL is not None:
        assert greedy_rows(logits, rows, KERNEL) == [want[r] for r in rows]
        assert greedy_rows(logits, rows, KERNEL, threads=2) == [want[r] for r in rows]

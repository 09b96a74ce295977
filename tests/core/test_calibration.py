"""The step-cost fit and the measured prediction error, stepped by hand."""

from __future__ import annotations

import pytest

from tailguard.core.calibration import Calibration, PadTable, RecentMax, StepCostModel, padded


def cal(**kw: float) -> Calibration:
    args = {"quantile": 0.9, "window": 10, "min_samples": 5, "prior_ratio": 1.5,
            "prior_excess_s": 0.01}  # fmt: skip
    args.update(kw)
    return Calibration(**args)  # type: ignore[arg-type]


def test_priors_stand_until_a_size_class_has_enough_samples() -> None:
    c = cal()
    for _ in range(4):
        c.observe(0.1, 0.15, 0.0)
    c.refresh(0.0)
    assert c.excess_s(0.1) is None and c.bound(0.1) == pytest.approx(0.15)  # 1.5 x 0.1
    assert c.bound(0.001) == pytest.approx(0.011)  # the prior excess for a small one
    c.observe(0.1, 0.15, 0.0)
    c.refresh(0.0)
    assert c.excess_s(0.1) == pytest.approx(0.05) and c.bound(0.1) == pytest.approx(0.15)


def test_each_size_class_plans_for_its_own_quantile() -> None:
    c = cal()
    for i in range(10):  # 100 ms predictions: 0..90 ms late; the 0.9 quantile is 80 ms
        c.observe(0.1, 0.1 + i / 100, 0.0)
    for i in range(10):  # 1 s predictions: 0..9 ms late; the 0.9 quantile is 8 ms
        c.observe(1.0, 1.0 + i / 1000, 0.0)
    c.refresh(0.0)
    assert c.size_class(0.1) != c.size_class(1.0)
    assert c.bound(0.1) == pytest.approx(0.18)
    assert c.bound(1.0) == pytest.approx(1.008)
    # below the smallest measured class: its figure; above a measured class: the nearest below
    assert c.bound(0.001) == pytest.approx(0.081)
    assert c.bound(0.3) == pytest.approx(0.38)
    assert c.bound(5.0) == pytest.approx(5.008)


def test_the_bound_never_falls_as_the_prediction_grows() -> None:
    c = cal(min_samples=1)
    c.observe(0.03, 0.2, 0.0)  # a 30 ms prediction (class up to 40 ms) that took 200 ms
    c.observe(0.05, 0.05, 0.0)  # 50 ms predictions are right
    c.refresh(0.0)
    sizes = [0.001 * 1.3**i for i in range(30)]
    bounds = [c.bound(p) for p in sizes]
    assert bounds == sorted(bounds)
    assert c.bound(0.05) == pytest.approx(0.04 + 0.17)  # the top of the 40 ms class
    assert c.bound(0.5) == pytest.approx(0.5)


def _stalled_sparse_class(tail_samples: int) -> Calibration:
    """A dense 10-ms class (300 answers 5-9 ms late) beside a sparse 20-ms one (40 answers
    10-14 ms late) that one stall made 155 ms late once: the state that held admission at 0.76-0.89
    of its goodput (session 27)."""
    c = cal(quantile=0.99, window=512, min_samples=32, tail_samples=tail_samples)
    for i in range(300):
        c.observe(0.008, 0.008 + 0.005 + 0.001 * (i % 5), now_s=i * 0.01)
    for i in range(39):
        c.observe(0.015, 0.015 + 0.010 + 0.001 * (i % 5), now_s=i * 0.01 + 0.005)
    c.observe(0.015, 0.015 + 0.155, now_s=1.0)
    c.refresh(1.0)
    return c


def test_one_stall_in_a_sparse_class_is_not_its_quantile_once_pooled() -> None:
    alone = _stalled_sparse_class(tail_samples=0)
    assert alone.bound(0.015) == pytest.approx(0.17)  # the class plans for the stall
    assert alone.bound(0.03) >= 0.02 + 0.155  # and everything above it plans for it too
    pooled = _stalled_sparse_class(tail_samples=2)  # pools to 200: the 10-ms class's 300 join
    assert pooled.bound(0.015) == pytest.approx(0.015 + 0.014)  # the 20-ms class's own lateness
    assert pooled.bound(0.03) < 0.06
    assert pooled.bound(0.008) == pytest.approx(0.008 + 0.009)  # a dense class is its own


def test_a_sparse_class_that_really_runs_late_keeps_its_excess_in_the_pool() -> None:
    c = cal(quantile=0.99, window=512, min_samples=32, tail_samples=2)
    for _ in range(300):
        c.observe(0.008, 0.010, now_s=0.0)  # 2 ms late
    for _ in range(40):
        c.observe(0.015, 0.065, now_s=0.0)  # every one 50 ms late: 12% of the pool
    c.refresh(0.0)
    assert c.bound(0.015) == pytest.approx(0.065)


def test_old_samples_age_out() -> None:
    c = cal(min_samples=2)
    c.observe(0.003, 0.13, 0.0)  # measured while the step-cost fit was wrong
    c.observe(0.003, 0.13, 0.0)
    c.refresh(1.0)
    assert c.bound(0.1) == pytest.approx(0.1 + 0.127)
    c.observe(0.1, 0.11, 25.0)
    c.observe(0.1, 0.11, 25.0)
    c.refresh(31.0)  # the first two are over 30 s old
    assert c.bound(0.1) == pytest.approx(0.11)


def test_live_excess_widens_the_bound_and_overdue_uses_the_measured_one() -> None:
    c = cal(min_samples=1)
    c.observe(0.1, 0.14, 0.0)
    c.refresh(0.0)
    assert not c.overdue(0.1, 0.139) and c.overdue(0.1, 0.141)
    c.live_excess_s = 0.2
    assert c.bound(0.1) == pytest.approx(0.3)
    assert c.overdue(0.1, 0.141)  # overdue compares with the measured bound, not the live one


def test_cost_model_fits_its_shape_from_the_warm_up_then_follows_the_level() -> None:
    m = StepCostModel(0.001, 0.001)
    for n in (16, 64, 256, 512, 1024, 32, 128):  # warm-up: every size once
        m.observe(n, 0.005 + 0.00002 * n)
    m.refit()
    assert m.a == pytest.approx(0.005, rel=1e-6) and m.b == pytest.approx(0.00002, rel=1e-6)
    for _ in range(100):  # another process takes half the CPU: every step twice as long
        m.observe(200, 2 * (0.005 + 0.00002 * 200))
    m.refit()
    assert m.step_s(200) == pytest.approx(2 * 0.009, rel=1e-3)
    assert m.step_s(1024) == pytest.approx(2 * (0.005 + 0.00002 * 1024), rel=1e-3)


def test_one_size_only_keeps_the_prior_shape_until_sizes_differ() -> None:
    m = StepCostModel(0.004, 0.0002)
    for _ in range(8):
        m.observe(100, 0.048)
    m.refit()
    assert (m.a, m.b) == (0.004, 0.0002)  # not fitted: one size cannot split the cost
    m.observe(300, 0.088)
    m.refit()
    assert m.step_s(100) == pytest.approx(0.048) and m.step_s(300) == pytest.approx(0.088)


def test_a_long_run_of_decode_steps_does_not_tilt_the_fit() -> None:
    m = StepCostModel(0.0, 1.0)
    for n in (32, 64, 128, 256, 512, 1024):  # warm-up: every size once, 2 ms + 0.05 ms/token
        m.observe(n, 0.002 + n * 5e-5)
    m.refit()
    for _ in range(5000):  # then a long generation: one-token steps, 20% slower than the fit
        m.observe(1, 1.2 * (0.002 + 5e-5))
    assert m.step_s(200) == pytest.approx(1.2 * (0.002 + 200 * 5e-5), rel=1e-3)


def test_recent_max_keeps_the_worst_sample_for_one_to_two_windows() -> None:
    m = RecentMax(window_s=1.0)
    assert m.value(0.0) == 0.0
    m.observe(0.05, 0.1)
    m.observe(0.02, 0.5)
    assert m.value(0.9) == 0.05
    assert m.value(1.5) == 0.05  # the previous window still counts
    m.observe(0.01, 1.6)
    assert m.value(2.4) == 0.05
    assert m.value(3.2) == 0.01  # 0.05's window is two windows old: forgotten
    assert m.value(10.0) == 0.0  # nothing for two windows


def test_a_ladder_of_quantiles_each_with_monotonic_bounds() -> None:
    c = cal(quantile=0.9, ladder=(1.0, 0.5), min_samples=1, window=100)
    assert c.ladder == (1.0, 0.9, 0.5) and c.target_level == 1
    for i in range(10):  # 100 ms predictions: 0..90 ms late
        c.observe(0.1, 0.1 + i / 100, float(i))
    c.observe(1.0, 1.0, 10.0)  # 1 s predictions are right
    c.refresh(10.0)
    assert c.bound(0.1, 0) == pytest.approx(0.19)  # the window's largest
    assert c.bound(0.1) == c.bound(0.1, 1) == pytest.approx(0.18)  # the target
    assert c.bound(0.1, 2) == pytest.approx(0.14)  # the median
    assert [c.bound(1.0, level) for level in range(3)] == pytest.approx([1.0] * 3)
    sizes = [0.001 * 1.3**i for i in range(30)]
    for level in range(3):
        bounds = [c.bound(p, level) for p in sizes]
        assert bounds == sorted(bounds), level
    assert all(c.bound(p, 0) >= c.bound(p, 1) >= c.bound(p, 2) for p in sizes)


def test_cost_model_prices_head_rows_from_the_warm_up_at_the_padded_sizes() -> None:
    m = StepCostModel(0.001, 0.001, token_buckets=(16, 32, 64, 128), row_buckets=(1, 8, 16))
    for n in (16, 32, 64, 128):  # warm-up forwards: one head row each
        m.observe(n, 0.004 + 0.0001 * n + 0.0005)
    for r in (1, 8, 16):  # the head alone, per row bucket (0 tokens)
        m.observe(0, 0.0005 * r, r)
    m.refit()
    assert (m.a, m.b, m.c) == pytest.approx((0.004, 0.0001, 0.0005), rel=1e-6)
    # 20 tokens run as 32, 9 head rows as 16
    assert m.step_s(20, 9) == pytest.approx(0.004 + 0.0001 * 32 + 0.0005 * 16, rel=1e-6)
    for _ in range(200):  # live decode steps of 12 sequences (padded 16 x 16), 1.5x the shape
        m.observe(16, 1.5 * (0.004 + 0.0016 + 0.008), 16)
    assert m.step_s(12, 12) == pytest.approx(1.5 * 0.0136, rel=1e-3)


def test_cost_model_without_rows_ignores_the_head_and_the_buckets() -> None:
    m = StepCostModel(0.001, 0.001, rows=False)
    for n in (16, 32, 64, 128):
        m.observe(n, 0.004 + 0.0001 * n)
    for r in (1, 8, 16):
        m.observe(0, 0.0005 * r, r)  # not a step of this model: ignored
    m.refit()
    assert (m.a, m.b, m.c) == pytest.approx((0.004, 0.0001, 0.0), rel=1e-6)
    assert m.step_s(20, 9) == pytest.approx(0.004 + 0.0001 * 20, rel=1e-6)


def test_pad_table_pads_as_padded_does() -> None:
    """The lookup table that prices admission's steps gives `padded`'s bucket for every count:
    whole and fractional, at and between buckets, past the last one, zero and negative."""
    buckets = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    table = PadTable(buckets)
    counts = [-1.0, 0, 0.0, 0.25, 1, 1.5, 2, 3, 3.999, 4, 17, 23.5, 24, 47.01, 63.9, 64, 64.5, 100]
    for n in counts:
        assert table.padded(n) == padded(n, buckets), n
    assert all(PadTable(()).padded(n) == n for n in counts)
    m = StepCostModel(0.004, 0.0001, token_buckets=buckets, row_buckets=(1, 8, 16))
    m.c0 = 0.0005
    for n in counts:
        assert m.step_s(n, 9) == pytest.approx(m.level * m._shape(n, 9), abs=0.0)

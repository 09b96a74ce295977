"""The step-cost fit and the measured prediction error, stepped by hand."""

from __future__ import annotations

import pytest

from tailguard.core.calibration import Calibration, RecentMax, StepCostModel


def cal(**kw: float) -> Calibration:
    args = {
        "quantile": 0.9,
        "window": 10,
        "min_samples": 5,
        "prior_ratio": 1.5,
        "prior_excess_s": 0.01,
        "floor_s": 0.01,
    }
    args.update(kw)
    return Calibration(**args)  # type: ignore[arg-type]


def test_quantiles_replace_the_priors_once_enough_samples_are_in() -> None:
    c = cal()
    for _ in range(4):
        c.observe(0.1, 0.1)
    c.refresh()
    assert (c.ratio, c.excess_s) == (1.5, 0.01)  # 4 < min_samples
    c.observe(0.1, 0.1)
    c.refresh()
    assert c.ratio == pytest.approx(1.0) and c.excess_s == pytest.approx(0.0)
    # 10 samples: ratios 1.0 .. 1.9; the 0.9 quantile is the 9th smallest
    for i in range(10):
        c.observe(0.1, 0.1 * (1 + i / 10))
    c.refresh()
    assert c.ratio == pytest.approx(1.8) and c.excess_s == pytest.approx(0.08)
    assert c.bound(0.2) == pytest.approx(0.36)  # the ratio dominates a large prediction
    assert c.bound(0.001) == pytest.approx(0.081)  # the excess a small one


def test_short_predictions_give_no_ratio_samples() -> None:
    c = cal(min_samples=1)
    c.observe(0.001, 0.005)  # 5x, but it is 4 ms of fixed delay
    c.refresh()
    assert c.ratio == 1.5 and c.excess_s == pytest.approx(0.004)


def test_live_terms_widen_the_bound_and_overdue_uses_the_measured_one() -> None:
    c = cal()
    assert not c.overdue(0.1, 0.14) and c.overdue(0.1, 0.16)
    c.live_ratio = 3.0
    assert c.bound(0.1) == pytest.approx(0.3)
    assert c.overdue(0.1, 0.16)  # overdue compares with the measured bound, not the live one


def test_cost_model_fits_overhead_and_per_token_cost() -> None:
    m = StepCostModel(0.001, 0.001)
    for n in (16, 64, 256, 512, 1024, 32, 128):
        m.observe(n, 0.005 + 0.00002 * n)
    m.refit()
    assert m.a == pytest.approx(0.005, rel=1e-6) and m.b == pytest.approx(0.00002, rel=1e-6)
    same = StepCostModel(0.004, 0.0002)
    for _ in range(8):
        same.observe(100, 0.048)  # one size only: the prior's split, at the measured level
    same.refit()
    assert same.step_s(100) == pytest.approx(0.048)
    assert same.a / same.b == pytest.approx(0.004 / 0.0002)


def test_a_long_run_of_decode_steps_does_not_erase_what_larger_steps_cost() -> None:
    m = StepCostModel(0.0, 1.0)
    for n in (32, 64, 128, 256, 512, 1024):  # warm-up: every size once, 2 ms + 0.05 ms/token
        m.observe(n, 0.002 + n * 5e-5)
    for _ in range(5000):  # then a long generation: one-token steps, a bit slower than the fit
        m.observe(1, 0.0025)
    m.refit()
    assert m.step_s(200) == pytest.approx(0.002 + 200 * 5e-5, rel=0.1)
    assert m.step_s(1) == pytest.approx(0.0025, rel=0.3)


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

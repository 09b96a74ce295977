"""Admission policy stepped by hand: no clock, no HTTP, no engine."""

from __future__ import annotations

import pytest

from tailguard.core.admission import (
    AdmissionConfig,
    AdmissionController,
    StepCostModel,
    retry_after_header,
)
from tailguard.core.request import Priority

INT, BAT = Priority.INTERACTIVE, Priority.BATCH


def make(**kw: object) -> AdmissionController:
    # a = 10 ms per step, b = 0.1 ms per token, 1024 tokens per step; the prediction alone
    # unless a test is about the adaptive cap
    kw.setdefault("adaptive_cap", False)
    cfg = AdmissionConfig(prior_step_overhead_s=0.010, prior_s_per_token=0.0001, **kw)  # type: ignore[arg-type]
    return AdmissionController(cfg)


def decide(
    c: AdmissionController,
    rid: str,
    *,
    tokens: int = 100,
    deadline: float = 0.15,
    prio: Priority = INT,
    out: int = 0,
    single: bool = True,
):  # type: ignore[no-untyped-def]
    return c.decide(
        rid,
        now_s=0.0,
        deadline_s=deadline,
        prompt_tokens=tokens,
        output_tokens=out,
        priority=prio,
        single_pass=single,
    )


def test_admits_until_the_predicted_finish_passes_the_deadline() -> None:
    c = make(safety_margin=1.0)
    # each 1000-token request adds ~0.1 s of tokens + 0.01 s per step
    assert decide(c, "a", tokens=1000).admitted
    d = decide(c, "b", tokens=1000, deadline=0.15)
    assert not d.admitted
    assert "predicted" in d.reason and "deadline" in d.reason
    assert c.queued_requests == 1 and c.queued_tokens == 1000
    assert decide(c, "c", tokens=1000, deadline=0.5).admitted  # a longer deadline fits


def test_release_and_progress_shrink_the_ledger() -> None:
    c = make()
    decide(c, "g", tokens=50, out=20, single=False)
    assert c.queued_tokens == 70
    c.progress("g", prefill_done=True, output_tokens_done=5)
    assert c.queued_tokens == 15
    c.release("g")
    assert c.queued_tokens == 0 and c.queued_requests == 0
    c.release("g")  # idempotent
    c.progress("unknown", prefill_done=True, output_tokens_done=1)
    assert c.queued_tokens == 0


def test_interactive_work_does_not_wait_behind_batch_work() -> None:
    c = make(safety_margin=1.0)
    for i in range(3):
        assert decide(c, f"b{i}", tokens=400, prio=BAT, deadline=10.0).admitted
    assert not decide(c, "late-batch", tokens=400, prio=BAT).admitted
    assert decide(c, "vip", tokens=400, prio=INT).admitted


def test_hard_caps_and_the_batch_share() -> None:
    c = make(max_queued_requests=10, batch_share=0.5)
    for i in range(5):
        assert decide(c, f"b{i}", tokens=1, prio=BAT, deadline=100).admitted
    d = decide(c, "b5", tokens=1, prio=BAT, deadline=100)
    assert not d.admitted and "requests already queued" in d.reason
    for i in range(5):
        assert decide(c, f"i{i}", tokens=1, prio=INT, deadline=100).admitted
    assert not decide(c, "i5", tokens=1, prio=INT, deadline=100).admitted
    c2 = make(max_queued_tokens=1000)
    assert not decide(c2, "big", tokens=500, out=600, single=False, deadline=100).admitted


def test_generation_deadline_bounds_the_first_token_not_the_whole_output() -> None:
    c = make(safety_margin=1.0)
    d = decide(c, "g", tokens=10, out=10_000, single=False, deadline=0.15)
    assert d.admitted and d.predicted_s < 0.15
    assert d.engine_deadline_s == pytest.approx(0.15)


def test_single_pass_engine_deadline_leaves_room_for_its_own_compute() -> None:
    c = make()
    d = decide(c, "s", tokens=1000, deadline=1.0)
    assert d.admitted and d.engine_deadline_s == pytest.approx(1.0 - (0.010 + 0.1))


def test_retry_after_grows_with_the_queue_and_has_bounds() -> None:
    c = make(safety_margin=1.0, max_retry_after_s=30.0)
    for i in range(200):
        decide(c, f"q{i}", tokens=1000, deadline=1000.0)
    small = decide(c, "x", tokens=10, deadline=0.15).retry_after_s
    for i in range(200, 400):
        decide(c, f"q{i}", tokens=1000, deadline=1000.0)
    large = decide(c, "y", tokens=10, deadline=0.15).retry_after_s
    assert 1.0 <= small < large <= 30.0
    # 200k tokens ahead at ~9.8 k tokens/s: about 20 s
    assert small == pytest.approx(200_000 * 0.0001 + 196 * 0.010, rel=0.1)
    assert retry_after_header(0.2) == "1" and retry_after_header(2.01) == "3"


def test_cost_model_fits_overhead_and_per_token_cost() -> None:
    m = StepCostModel(0.001, 0.001)
    for n in (16, 64, 256, 512, 1024, 32, 128):
        m.observe(n, 0.005 + 0.00002 * n)
    m.refit()
    assert m.a == pytest.approx(0.005, rel=1e-6) and m.b == pytest.approx(0.00002, rel=1e-6)
    assert m.drain_s(2048, 1024) == pytest.approx(2 * 0.005 + 2048 * 0.00002)
    same = StepCostModel(0.004, 0.0002)
    for _ in range(8):
        same.observe(100, 0.048)  # one size only: all per-token (never underestimates growth)
    same.refit()
    assert same.step_s(100) == pytest.approx(0.048) and same.step_s(1000) == pytest.approx(0.48)


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="batch_share"):
        AdmissionConfig(batch_share=0.0)
    with pytest.raises(ValueError, match="max_queued_requests"):
        AdmissionConfig(max_queued_requests=0)


def test_adaptive_cap_starts_at_half_a_step_grows_on_time_and_halves_when_late() -> None:
    c = make(adaptive_cap=True, safety_margin=1.0)
    assert c.cap_tokens == 512
    # a burst against an idle-looking engine: only half a step's worth is let in at first
    admitted = [decide(c, f"a{i}", tokens=100, deadline=10.0).admitted for i in range(40)]
    assert sum(admitted) == 5
    refused = decide(c, "over", tokens=100, deadline=10.0)
    assert not refused.admitted and "adaptive limit" in refused.reason
    for i in range(5):  # all answered on time: the cap grows by their tokens
        c.release(f"a{i}", now_s=1.0)
    assert c.cap_tokens == 512 + 5 * 101
    for i in range(10):  # and again: it doubles per round trip while answers are on time
        assert decide(c, f"c{i}", tokens=100, deadline=10.0).admitted
        c.release(f"c{i}", now_s=1.0)
    grown = 512 + 15 * 101
    assert c.cap_tokens == grown
    assert decide(c, "b0", tokens=100, deadline=10.0).admitted
    c.release("b0", now_s=11.0)  # late: halve
    assert c.cap_tokens == grown / 2
    for _ in range(10):  # never below half a step's worth
        decide(c, "late", tokens=10, deadline=0.5)
        c.release("late", now_s=5.0)
    assert c.cap_tokens == 512
    # a request bigger than the cap is still admitted when nothing is queued ahead of it
    assert decide(c, "big", tokens=3000, deadline=10.0).admitted
    assert not decide(c, "next", tokens=10, deadline=10.0).admitted


def test_generation_is_judged_at_its_first_token_not_at_the_end() -> None:
    c = make(adaptive_cap=True, safety_margin=1.0)
    assert decide(c, "g", tokens=50, out=200, single=False, deadline=0.5).admitted
    c.progress("g", prefill_done=True, output_tokens_done=1, now_s=0.2)  # first token on time
    grown = c.cap_tokens
    assert grown > 512
    c.release("g", now_s=30.0)  # the whole generation took long: not a deadline miss
    assert c.cap_tokens == grown


def test_saturated_answers_before_tokenizing_and_agrees_with_decide() -> None:
    c = make()
    kw = {"now_s": 0.0, "deadline_s": 0.15, "priority": INT, "single_pass": True}
    assert c.saturated(**kw) is None  # type: ignore[arg-type]
    assert c.queued_requests == 0  # asking commits nothing
    i = 0
    while decide(c, f"r{i}", tokens=200).admitted:
        i += 1
    # a 200-token request no longer fits, but a one-token one still might
    d1 = c.saturated(**kw)  # type: ignore[arg-type]
    if d1 is None:
        assert decide(c, "one", tokens=1).admitted
        c.release("one")
    while c.saturated(**kw) is None:  # type: ignore[arg-type]
        assert decide(c, f"s{i}", tokens=1).admitted
        i += 1
    d = c.saturated(**kw)  # type: ignore[arg-type]
    assert d is not None and not d.admitted and d.retry_after_s >= 1.0 and d.reason
    before = c.queued_requests
    for tokens in (1, 10, 1000):  # whatever the real size: decide says no too
        assert not decide(c, f"x{tokens}", tokens=tokens).admitted
    assert c.queued_requests == before


def test_recent_max_keeps_the_worst_sample_for_one_to_two_windows() -> None:
    from tailguard.core.admission import RecentMax

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


def test_cost_model_plans_for_the_slowest_recent_step() -> None:
    m = StepCostModel(0.0, 1e-4)
    for n in (100, 200, 400, 800) * 20:  # a steady engine: 2 ms + 0.1 ms per token
        m.observe(n, 0.002 + n * 1e-4)
    m.refit()
    assert m.slowdown == pytest.approx(1.0)
    assert m.drain_s(800, 1024) == pytest.approx(0.082)
    for _ in range(4):  # the burst starts taking the engine's CPU: steps run 2x slower
        m.observe(800, 2 * 0.082)
    m.refit()
    assert m.slowdown > 1.5  # planned for at once, long before the 256-step fit moves much
    assert m.drain_s(800, 1024) > 1.5 * 0.082
    for n in (100, 200, 400, 800) * 4:  # 16 normal steps later it is forgotten
        m.observe(n, m.a + n * m.b)
    m.refit()
    assert m.slowdown < 1.2

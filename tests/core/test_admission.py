"""Admission policy stepped by hand: no clock, no HTTP, no engine.

The step cost is a = 10 ms per step plus b = 0.1 ms per token, 1024 tokens and 64 sequences per
step; the priors of the calibration are neutral (ratio 1, excess 0) and the overload headroom is
off unless a test is about them, so every prediction below can be computed by hand from the
model in core/admission.py.
"""

from __future__ import annotations

import pytest

from tailguard.core.admission import (
    AdmissionConfig,
    AdmissionController,
    Decision,
    retry_after_header,
)
from tailguard.core.calibration import Calibration
from tailguard.core.request import EngineOutput, FinishReason, Priority
from tailguard.core.stats import StepStats

INT, BAT = Priority.INTERACTIVE, Priority.BATCH
A, B = 0.010, 0.0001


def make(**kw: object) -> AdmissionController:
    kw.setdefault("prior_ratio", 1.0)
    kw.setdefault("prior_excess_s", 0.0)
    kw.setdefault("overload_headroom", 0.0)
    cfg = AdmissionConfig(prior_step_overhead_s=A, prior_s_per_token=B, **kw)  # type: ignore[arg-type]
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
    now: float = 0.0,
) -> Decision:
    return c.decide(
        rid,
        now_s=now,
        deadline_s=now + deadline,
        prompt_tokens=tokens,
        output_tokens=out,
        priority=prio,
        single_pass=single,
    )


def output(rid: str, new: int = 1, finished: bool = False, **kw: object) -> EngineOutput:
    reason = kw.pop("reason", FinishReason.DONE if finished else None)
    return EngineOutput(
        rid,
        new_token_ids=[7] * new,
        finished=finished,
        finish_reason=reason,
        **kw,  # type: ignore[arg-type]
    )


def test_an_idle_server_admits_and_predicts_one_step() -> None:
    c = make()
    d = decide(c, "a", tokens=1000)
    assert d.admitted and d.code == "" and d.predicted_s == pytest.approx(A + 1000 * B)
    assert c.queued_requests == 1 and c.queued_tokens == 1000


def test_refuses_only_what_is_predicted_to_be_late() -> None:
    c = make()
    assert decide(c, "a", tokens=1000).admitted
    # 2,000 tokens in 2 steps, after the 1,000-token step now running: 0.22 + 0.11 s
    d = decide(c, "b", tokens=1000, deadline=0.15)
    assert not d.admitted and d.code == "late"
    assert d.predicted_s == pytest.approx(2 * A + 2000 * B + (A + 1000 * B))
    assert "predicted 330 ms to finish" in d.reason and "leaves 150 ms" in d.reason
    assert c.queued_requests == 1  # a refusal commits nothing
    assert decide(c, "c", tokens=1000, deadline=0.34).admitted  # a longer deadline fits


def test_the_running_step_counts_only_what_is_left_of_it() -> None:
    c = make()
    assert decide(c, "a", tokens=1000, now=0.0).admitted
    c.step_ended(0.0)  # the step for "a" began at 0
    d = decide(c, "b", tokens=10, now=0.06, deadline=10.0)
    # 1,010 tokens in 1 step after the remaining 0.05 s of the running one
    assert d.predicted_s == pytest.approx(A + 1010 * B + (A + 1000 * B - 0.06))


def test_a_long_deadline_is_admitted_whatever_is_queued() -> None:
    c = make()
    for i in range(64):  # 64 concurrent generations, 32-token prompts, 60 s deadline
        assert decide(c, f"g{i}", tokens=32, out=16, single=False, deadline=60.0).admitted
    assert c.queued_requests == 64 and c.queued_tokens == 64 * 48


def test_the_ledger_follows_engine_outputs() -> None:
    c = make()
    decide(c, "g", tokens=50, out=20, single=False, deadline=10.0)
    assert c.queued_tokens == 70 and c.decoding == 0
    c.observe_output(output("g", new=1), now_s=0.05)  # first token: prefill done, holds a slot
    assert c.queued_tokens == 19 and c.decoding == 1
    c.observe_output(output("g", new=4), now_s=0.06)
    assert c.queued_tokens == 15
    c.observe_output(output("g", new=1, finished=True, reason=FinishReason.STOP), now_s=0.07)
    assert c.queued_tokens == 0 and c.queued_requests == 0 and c.decoding == 0
    c.release("g")  # the handler's release afterwards is a no-op
    c.observe_output(output("unknown"), now_s=0.1)
    assert c.queued_tokens == 0
    decide(c, "s", tokens=30, deadline=10.0)
    c.release("s")  # a handler that failed before the engine answered releases it
    assert c.queued_tokens == 0 and c.queued_requests == 0


def test_interactive_work_does_not_wait_behind_waiting_batch_work() -> None:
    c = make()
    for i in range(3):
        assert decide(c, f"b{i}", tokens=400, prio=BAT, deadline=10.0).admitted
    late = decide(c, "late-batch", tokens=400, prio=BAT)
    assert not late.admitted
    vip = decide(c, "vip", tokens=400, prio=INT, deadline=0.2)
    # its own 400 tokens, after the step now running (1,024 of the 1,200 batch tokens)
    assert vip.admitted and vip.predicted_s == pytest.approx(A + 400 * B + A + 1024 * B)


def test_full_batch_slots_wait_for_the_first_decodes_to_finish() -> None:
    c = make(max_num_seqs=4)
    for i, remaining in enumerate((5, 3, 8, 10)):
        decide(c, f"g{i}", tokens=10, out=remaining + 1, single=False, deadline=10.0)
        c.observe_output(output(f"g{i}", new=1), now_s=0.0)
    assert c.decoding == 4
    c.step_ended(0.0)
    d = decide(c, "s", tokens=100, deadline=10.0)
    # no free slot: 3 decode steps until "g1" ends, then its step; each step decodes 4 tokens
    steps = 3 + 1
    running = A + B * 4  # the step now running decodes the 4 held sequences
    assert d.predicted_s == pytest.approx(steps * (A + 4 * B) + 100 * B + running)


def test_calibration_widens_the_bound_after_late_answers_and_tightens_after_good_ones() -> None:
    c = make(calibration_min_samples=4, calibration_window=8)
    raw = A + 1000 * B
    for i in range(4):  # the engine took twice as long as predicted
        t0 = 1.0 * i
        decide(c, f"slow{i}", tokens=1000, deadline=10.0, now=t0)
        c.observe_output(output(f"slow{i}", finished=True), now_s=t0 + 2 * raw)
    c.refresh(5.0)
    assert c.calibration[True].excess_s(raw) == pytest.approx(raw)
    assert c.calibration[True].bound(raw) == pytest.approx(2 * raw)
    # with work in flight a request plans for the calibrated bound (plus the step running)
    assert decide(c, "busy", tokens=1000, deadline=10.0, now=5.0).predicted_s == pytest.approx(raw)
    d = decide(c, "x", tokens=1000, deadline=10.0, now=5.0)
    two_steps = 2 * A + 2000 * B
    assert d.predicted_s == pytest.approx(c.calibration[True].bound(two_steps) + raw)
    assert d.predicted_s > two_steps + raw + raw  # the measured excess is in it
    c.release("x")
    c.release("busy")
    for i in range(8):  # then predictions were right: the window forgets the slow ones
        t0 = 6.0 + 1.0 * i
        decide(c, f"ok{i}", tokens=1000, deadline=10.0, now=t0)
        c.observe_output(output(f"ok{i}", finished=True), now_s=t0 + raw)
    c.refresh(15.0)
    assert c.calibration[True].excess_s(raw) == pytest.approx(0.0)
    assert decide(c, "y", tokens=1000, now=15.0).predicted_s == pytest.approx(raw)


def test_a_generation_is_sampled_at_its_first_token_not_at_the_end() -> None:
    c = make(calibration_min_samples=1)
    decide(c, "g", tokens=1000, out=500, single=False, deadline=10.0)
    raw = A + 1000 * B
    c.observe_output(output("g", new=1), now_s=raw)  # first token exactly as predicted
    c.observe_output(output("g", new=499, finished=True), now_s=20.0)  # a long generation
    c.refresh(21.0)
    assert c.calibration[False].excess_s(raw) == pytest.approx(0.0)
    assert c.calibration[True].samples == 0


def test_an_aborted_request_gives_no_sample_but_an_expired_one_does() -> None:
    c = make(calibration_min_samples=1)
    decide(c, "a", tokens=1000, deadline=10.0)
    c.observe_output(output("a", finished=True, reason=FinishReason.ABORTED), now_s=5.0)
    assert c.calibration[True].samples == 0
    decide(c, "e", tokens=1000, deadline=10.0)
    c.observe_output(output("e", new=0, finished=True, reason=FinishReason.EXPIRED), now_s=0.33)
    c.refresh(1.0)
    assert c.calibration[True].excess_s(0.11) == pytest.approx(0.22)  # 0.33 s, 0.11 predicted


def test_requests_in_flight_past_their_bound_widen_it_at_once() -> None:
    c = make()
    raw = A + 1000 * B
    decide(c, "stuck", tokens=1000, deadline=10.0)
    c.refresh(raw / 2)
    assert c.calibration[True].live_excess_s == 0.0  # not overdue yet
    c.refresh(3 * raw)  # the engine stalled: "stuck" has taken 3x its prediction so far
    assert c.calibration[True].live_excess_s == pytest.approx(2 * raw)
    engine = c.engine_s(10, interactive=True, now_s=3 * raw)
    d = decide(c, "next", tokens=10, deadline=10.0, now=3 * raw)
    assert d.predicted_s == pytest.approx(engine + 2 * raw)
    c.observe_output(output("stuck", finished=True), now_s=3 * raw)
    c.refresh(3 * raw)
    assert c.calibration[True].live_excess_s == 0.0


def test_priors_stand_until_enough_answers_are_in() -> None:
    c = AdmissionController(AdmissionConfig(prior_step_overhead_s=A, prior_s_per_token=B))
    cal = c.calibration[True]
    assert cal.excess_s(0.1) is None
    # small predictions are dominated by the fixed delay, large ones by the ratio
    assert cal.bound(0.002) == pytest.approx(0.012)
    assert cal.bound(0.1) == pytest.approx(0.125)


def test_the_front_end_delay_is_added_after_calibration() -> None:
    c = make()
    c.frontend_delay_s = 0.03
    d = decide(c, "a", tokens=1000)
    assert d.predicted_s == pytest.approx(A + 1000 * B + 0.03)


def test_admission_off_admits_everything_the_caps_allow() -> None:
    c = make(enabled=False, max_queued_requests=100)
    for i in range(100):
        d = decide(c, f"r{i}", tokens=1000, deadline=0.001)
        assert d.admitted and d.engine_deadline_s == float("inf")
    d = decide(c, "over", tokens=1, deadline=100)
    assert not d.admitted and d.code == "queue_requests"
    assert c.saturated(now_s=0.0, deadline_s=0.0, priority=INT, single_pass=True) is not None


def test_hard_caps_and_the_batch_share() -> None:
    c = make(max_queued_requests=10, batch_share=0.5)
    for i in range(5):
        assert decide(c, f"b{i}", tokens=1, prio=BAT, deadline=100).admitted
    d = decide(c, "b5", tokens=1, prio=BAT, deadline=100)
    assert not d.admitted and d.code == "queue_requests" and "cap 5 for this priority" in d.reason
    for i in range(5):
        assert decide(c, f"i{i}", tokens=1, prio=INT, deadline=100).admitted
    assert decide(c, "i5", tokens=1, prio=INT, deadline=100).code == "queue_requests"
    c2 = make(max_queued_tokens=1000)
    d = decide(c2, "big", tokens=500, out=600, single=False, deadline=100)
    assert d.code == "queue_tokens"


def test_a_request_whose_deadline_passed_in_the_intake_is_refused() -> None:
    c = make()
    d = decide(c, "old", tokens=10, deadline=-0.02)
    assert not d.admitted and d.code == "deadline_passed" and "passed 20 ms ago" in d.reason


def test_generation_deadline_bounds_the_first_token_not_the_whole_output() -> None:
    c = make()
    d = decide(c, "g", tokens=10, out=10_000, single=False, deadline=0.15)
    assert d.admitted and d.predicted_s == pytest.approx(A + 10 * B)
    assert d.engine_deadline_s == pytest.approx(0.15)


def test_single_pass_engine_deadline_leaves_room_for_its_own_compute() -> None:
    c = make()
    d = decide(c, "s", tokens=1000, deadline=1.0)
    assert d.admitted and d.engine_deadline_s == pytest.approx(1.0 - (A + 1000 * B))


def test_retry_after_is_the_time_past_the_deadline_with_bounds() -> None:
    c = make(max_retry_after_s=30.0, max_queued_tokens=10**6)
    for i in range(100):
        decide(c, f"q{i}", tokens=1000, deadline=1000.0)
    d = decide(c, "x", tokens=10, deadline=0.15)
    assert not d.admitted
    assert d.retry_after_s == pytest.approx(d.predicted_s - 0.15)
    for i in range(100, 400):
        decide(c, f"q{i}", tokens=1000, deadline=1000.0)
    assert decide(c, "y", tokens=10, deadline=0.15).retry_after_s == 30.0  # capped
    assert decide(make(), "z", tokens=1, deadline=-1).retry_after_s == 1.0  # floor
    assert retry_after_header(0.2) == "1" and retry_after_header(2.01) == "3"


def test_saturated_answers_before_tokenizing_and_agrees_with_decide() -> None:
    c = make()
    kw = {"now_s": 0.0, "deadline_s": 0.15, "priority": INT, "single_pass": True}
    assert c.saturated(**kw) is None  # type: ignore[arg-type]
    assert c.queued_requests == 0  # asking commits nothing
    i = 0
    while decide(c, f"r{i}", tokens=200).admitted:
        i += 1
    while c.saturated(**kw) is None:  # type: ignore[arg-type]
        assert decide(c, f"s{i}", tokens=1).admitted
        i += 1
    d = c.saturated(**kw)  # type: ignore[arg-type]
    assert d is not None and not d.admitted and d.retry_after_s >= 1.0 and d.code == "late"
    before = c.queued_requests
    for tokens in (1, 10, 1000):  # whatever the real size: decide says no too
        assert not decide(c, f"x{tokens}", tokens=tokens).admitted
    assert c.queued_requests == before


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="batch_share"):
        AdmissionConfig(batch_share=0.0)
    with pytest.raises(ValueError, match="max_queued_requests"):
        AdmissionConfig(max_queued_requests=0)
    with pytest.raises(ValueError, match="target_quantile"):
        AdmissionConfig(target_quantile=1.0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        AdmissionConfig(max_num_batched_tokens=64, max_num_seqs=64)


def test_beyond_the_held_sequences_the_waiting_generations_run_through_their_outputs() -> None:
    c = make(max_num_seqs=4)
    decide(c, "g0", tokens=10, out=7, single=False, deadline=10.0)
    c.observe_output(output("g0", new=1), now_s=0.0)  # held, 6 output tokens to go
    for i in range(4):  # 4 generations waiting, 10 output tokens each: they take every slot
        decide(c, f"w{i}", tokens=10, out=10, single=False, deadline=10.0)
    c.step_ended(0.0)
    d = decide(c, "s", tokens=100, deadline=10.0)
    # 2 slots must free: g0's 6 steps, then the 46 output tokens ahead shared by 4 slots (12)
    steps = 6 + 12 + 1
    running = A + B * (1 + 40)  # the step now running: g0's decode and the 40 waiting prompt tokens
    assert d.predicted_s == pytest.approx(steps * (A + B) + 140 * B + running)


def test_an_idle_ledger_admits_whatever_the_calibration_still_holds() -> None:
    """A stall's misses stay in the calibration for its window; while nothing admitted is in
    flight they must not turn work away (refusing protects nobody, and a refused request gives
    no sample that could correct the figure). Only the request's own compute can refuse it."""
    c = make(calibration_min_samples=4, calibration_window=8)
    raw = A + 1000 * B
    for i in range(4):  # a stall: every answer 300 ms later than predicted
        decide(c, f"s{i}", tokens=1000, deadline=10.0, now=float(i))
        c.observe_output(output(f"s{i}", finished=True), now_s=i + raw + 0.3)
    c.refresh(5.0)
    assert c.calibration[True].bound(raw) == pytest.approx(raw + 0.3)
    d = decide(c, "x", tokens=1000, deadline=0.15, now=5.0)
    assert d.admitted and d.predicted_s == pytest.approx(raw)
    # busy again: the next one plans for the stall's figure and is refused
    d = decide(c, "y", tokens=10, deadline=0.15, now=5.0)
    assert not d.admitted and d.code == "late"
    # and an idle ledger still refuses what its own compute cannot finish in time
    c.release("x")
    d = decide(c, "z", tokens=100_000, deadline=0.15, now=5.0)
    assert not d.admitted and d.code == "late"


def test_misses_of_one_output_batch_count_once() -> None:
    """Answers read together that are all later than their class plans for were held up by
    one event: the worst of them is one sample; answers on time count one by one."""
    cal = Calibration(quantile=0.99, window=512, min_samples=4, prior_ratio=1.0, prior_excess_s=0.0)
    for i in range(150):  # a class measured at 5 ms of excess
        cal.observe(0.030, 0.035 - 0.001 * (i % 5), now_s=i * 0.01)
    cal.refresh(2.0)
    assert cal.excess_s(0.030) == pytest.approx(0.005)
    for _ in range(3):  # one stall: three misses in one batch (same read time)
        cal.observe(0.030, 0.180, now_s=2.0)
    for _ in range(2):  # on-time answers of one batch all count
        cal.observe(0.030, 0.031, now_s=2.01)
    cal.refresh(2.1)
    assert cal.samples == 150 + 1 + 2
    assert cal.excess_s(0.030) == pytest.approx(0.005)  # one stall sample is above the q99
    for _ in range(3):  # the same three misses read apart are three events
        cal.observe(0.030, 0.180, now_s=2.2 + _ * 0.01)
    cal.refresh(2.3)
    assert cal.excess_s(0.030) == pytest.approx(0.150)


def test_the_ladder_runs_from_the_window_max_through_the_target_to_the_largest_risk() -> None:
    assert AdmissionConfig().ladder() == (1.0, 0.995, 0.99, 0.98, 0.95)
    assert AdmissionConfig(max_request_risk=0.1).ladder() == (1.0, 0.995, 0.99, 0.98, 0.95, 0.9)
    assert AdmissionConfig(max_request_risk=0.0).ladder() == (1.0, 0.995, 0.99)
    assert AdmissionConfig(target_quantile=0.9, max_request_risk=0.1).ladder() == (1.0, 0.95, 0.9)
    assert AdmissionConfig().miss_budget == pytest.approx(0.005)
    with pytest.raises(ValueError, match="max_request_risk"):
        AdmissionConfig(max_request_risk=0.5)


def _two_in_a_hundred_late(c: AdmissionController, raw: float) -> None:
    """The class of `raw` measured: 98 answers 1 ms late, 2 held up 200 ms by stalls."""
    cal = c.calibration[True]
    for i in range(100):
        cal.observe(raw, raw + (0.2 if i in (30, 70) else 0.001), now_s=i * 0.001)
    cal.refresh(0.1)


def test_an_edge_request_spends_the_miss_budget_instead_of_being_refused() -> None:
    """The target (99% in time) is an aggregate: a request whose only risk is the 2% stall
    tail is refused when every request must plan for the 0.99 quantile, and admitted while the
    recently admitted ones' expected misses leave room in the budget; once they do not, it is
    refused."""
    strict = make(calibration_min_samples=4, calibration_window=100, max_request_risk=0.0)
    loose = make(calibration_min_samples=4, calibration_window=100)
    for c in (strict, loose):
        assert decide(c, "held", tokens=10, deadline=10.0).admitted  # the ledger is not idle
        _two_in_a_hundred_late(c, c.engine_s(100, interactive=True, now_s=0.0))
    d = decide(strict, "x", tokens=100)
    assert not d.admitted and d.code == "late"
    # behind the queue (a raw prediction over half the time left) the target quantile stands:
    # 32 ms of a 60 ms deadline would fit at the 0.98 quantile, but its error is the queue's
    d = decide(loose, "q", tokens=100, deadline=0.06)
    assert not d.admitted and d.code == "late"
    raw = loose.engine_s(100, interactive=True, now_s=0.0)
    d = decide(loose, "x", tokens=100)
    assert d.admitted and d.predicted_s == pytest.approx(raw + 0.001)
    assert loose.expected_miss_share == pytest.approx(0.02 / 100)  # planned at the 0.98 quantile
    loose.release("x")
    admitted = 1
    while decide(loose, f"x{admitted}", tokens=100).admitted:
        loose.release(f"x{admitted}")
        admitted += 1
        assert admitted < 1000
    # the average risk reaches the budget (half the 1% allowed) after ~28 such admissions
    # (0.02 * (1 - 0.99^n))
    assert 24 <= admitted <= 32 and loose.expected_miss_share == pytest.approx(0.005, abs=3e-4)
    # a request with room even for the stall carries no risk, and pays the budget back
    before = loose.expected_miss_share
    assert decide(loose, "safe", tokens=100, deadline=1.0).admitted
    assert loose.expected_miss_share == pytest.approx(before * 0.99)


def test_a_step_is_priced_with_its_head_rows_at_the_engine_buckets() -> None:
    c = make(token_buckets=(16, 64, 256, 1024), row_buckets=(1, 16, 64))
    warm = [StepStats(0.0, A + B * n + 0.001, 1, n, 1, n, n, 0) for n in (16, 64, 256, 1024)]
    heads = [StepStats(0.0, 0.001 * r, r, 0, r, 0, 0, 0) for r in (1, 16, 64)]
    for step in warm + heads:
        c.observe_step(step)
    c.cost.refit()
    assert c.cost.c == pytest.approx(0.001)
    for i in range(20):  # 20 generations decoding
        decide(c, f"g{i}", tokens=10, out=50, single=False, deadline=10.0)
        c.observe_output(output(f"g{i}"), now_s=0.0)
    c.step_ended(0.0)
    d = decide(c, "x", tokens=30, deadline=10.0)
    # one step: 20 decodes + 30 prompt tokens (50, run as 64), 21 head rows (run as 64); the
    # step running now decodes the 20 (run as 64 tokens and 64 rows)
    step = A + B * 64 + 0.001 * 64
    assert d.predicted_s == pytest.approx(step + step)


def test_the_tokens_step_cost_is_the_previous_linear_model() -> None:
    c = make(step_cost="tokens", token_buckets=(16, 64, 256, 1024), row_buckets=(1, 16, 64))
    for n in (16, 64, 256, 1024):
        c.observe_step(StepStats(0.0, A + B * n, 1, n, 1, n, n, 0))
    c.observe_step(StepStats(0.0, 0.064, 64, 0, 64, 0, 0, 0))  # a head run: not priced
    c.cost.refit()
    assert (c.cost.a, c.cost.b, c.cost.c) == pytest.approx((A, B, 0.0))
    assert decide(c, "x", tokens=50).predicted_s == pytest.approx(A + 50 * B)


def test_under_overload_the_queue_is_kept_short_of_the_deadline() -> None:
    """Once recent decisions refuse, a request is planned for only part of its time left:
    the refused share, up to overload_headroom."""
    c = make(overload_headroom=0.33, overload_window_s=1.0)
    assert decide(c, "a", tokens=1000, now=0.0).admitted
    assert c.headroom(0.0) == 0.0  # nothing refused yet: the whole deadline is planned for
    # 1,010 tokens in 1 step after the running one: 0.111 + 0.11 = 0.221 s
    assert decide(c, "b", tokens=10, deadline=0.25, now=0.0).admitted
    assert not decide(c, "x", tokens=1000, deadline=0.15, now=0.0).admitted  # 1 of 3 refused
    assert c.headroom(0.0) == pytest.approx(0.33)  # a third refused, capped at 0.33
    # "b" again: it fitted 0.25 s; with a third of it kept free (0.167 s) it does not
    d = decide(c, "b2", tokens=10, deadline=0.25, now=0.0)
    assert not d.admitted and d.code == "late"
    assert "planned for (overloaded" in d.reason and "leaves 250 ms" in d.reason
    # a deadline long enough for the queue is admitted all the same (scales with it)
    assert decide(c, "long", tokens=10, deadline=0.40, now=0.0).admitted


def test_the_overload_headroom_fades_with_the_window_and_spares_an_idle_engine() -> None:
    c = make(overload_headroom=0.33, overload_window_s=1.0)
    assert decide(c, "a", tokens=1000, now=0.0).admitted
    for i in range(5):
        assert not decide(c, f"x{i}", tokens=1000, now=0.0).admitted
    assert c.headroom(0.1) == pytest.approx(0.33)  # capped
    assert c.headroom(0.7) == pytest.approx(0.33)  # the older half-window still counts
    assert c.headroom(1.6) == 0.0  # both halves rolled past: forgotten
    # refusals counted through `saturated` (commit=False) count too; its admits do not
    assert c.saturated(now_s=2.0, deadline_s=2.0001, priority=INT, single_pass=True)
    assert c.headroom(2.0) > 0.0
    c.release("a")  # nothing in flight: an idle engine plans for the whole deadline
    assert c.headroom(2.0) == 0.0
    assert decide(c, "big", tokens=1000, deadline=0.12, now=2.0).admitted  # 0.11 s of 0.12


def test_admission_off_keeps_no_overload_headroom() -> None:
    c = make(enabled=False, overload_headroom=0.33)
    for i in range(4):
        assert decide(c, f"a{i}", tokens=1000).admitted
    assert c.headroom(0.0) == 0.0

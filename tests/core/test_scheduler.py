"""The scheduler, stepped by hand with fake model results: no model, no torch."""

from __future__ import annotations

from tests.core.factories import fake_results, make_request, make_scheduler

from tailguard.core.request import EngineError, FinishReason, Priority, RequestKind
from tailguard.core.scheduler import Scheduler, SeqResult


def run_to_completion(sched: Scheduler, now: float = 0.0, max_steps: int = 1000) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not sched.has_work():
            break
        out = sched.schedule(now)
        for o in sched.update(out, fake_results(out), now):
            if o.finished:
                finished[o.request_id] = o
    return finished


def test_generation_runs_prefill_then_decodes_and_frees_blocks() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", prompt_len=6, max_tokens=3))
    out = sched.schedule(0.0)
    assert [(s.seq.request_id, s.start, s.num_new) for s in out.scheduled] == [("a", 0, 6)]
    outputs = sched.update(out, fake_results(out), 0.0)
    assert outputs[0].new_token_ids == [7] and not outputs[0].finished
    out = sched.schedule(0.0)
    assert [(s.start, s.num_new) for s in out.scheduled] == [(6, 1)]
    done = run_to_completion(sched)
    assert done["a"].finish_reason == FinishReason.LENGTH and done["a"].num_output_tokens == 3
    assert sched.pool.num_used == 0


def test_eos_stops_unless_ignored() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", max_tokens=10, ignore_eos=False))
    out = sched.schedule(0.0)
    (o,) = sched.update(out, fake_results(out, token=2), 0.0)
    assert o.finished and o.finish_reason == FinishReason.STOP


def test_long_prompt_is_chunked_and_decodes_keep_running() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, num_blocks=128)
    sched.add(make_request("short", prompt_len=4, max_tokens=20))
    out = sched.schedule(0.0)
    sched.update(out, fake_results(out), 0.0)
    sched.add(make_request("long", prompt_len=100, max_tokens=1))
    steps_with_decode = 0
    for _ in range(7):
        out = sched.schedule(0.0)
        by_id = {s.seq.request_id: s for s in out.scheduled}
        assert out.num_tokens <= 16
        if "short" in by_id:
            assert by_id["short"].num_new == 1
            steps_with_decode += 1
        sched.update(out, fake_results(out), 0.0)
    assert steps_with_decode == 7  # the decode ran every step while the long prompt prefilled


def test_single_pass_query_finishes_after_prefill_with_results() -> None:
    sched = make_scheduler()
    sched.add(make_request("q", prompt_len=10, kind=RequestKind.SCORE))
    out = sched.schedule(0.0)
    (o,) = sched.update(out, fake_results(out), 0.0)
    assert o.finished and o.finish_reason == FinishReason.DONE
    assert o.top_logprobs == [(7, -0.1)] and o.new_token_ids == []


def test_priority_then_earliest_deadline_first() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("batch-early", priority=Priority.BATCH, deadline_s=1.0))
    sched.add(make_request("batch-late", priority=Priority.BATCH, deadline_s=5.0))
    sched.add(make_request("interactive", priority=Priority.INTERACTIVE, deadline_s=9.0))
    order = []
    for _ in range(3):
        out = sched.schedule(0.0)
        order.append(out.scheduled[0].seq.request_id)
        # finish it at once so the next one gets the single slot
        sched.update(out, fake_results(out), 0.0)
        sched.abort(order[-1])
    assert order == ["interactive", "batch-early", "batch-late"]


def test_expired_requests_are_dropped_unexecuted() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("running", max_tokens=50))
    out = sched.schedule(0.0)
    sched.update(out, fake_results(out), 0.0)
    sched.add(make_request("expires", deadline_s=0.5))  # queued behind a full batch
    out = sched.schedule(1.0)
    assert [s.seq.request_id for s in out.scheduled] == ["running"]
    (expired,) = out.finished
    assert expired.request_id == "expires" and expired.finish_reason == FinishReason.EXPIRED
    assert sched.counters.expired == 1


def test_pool_exhaustion_preempts_lowest_priority_and_recomputes() -> None:
    # 8 usable blocks of 4 tokens: two sequences of 12 prompt + 8 output tokens cannot both fit
    sched = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64)
    sched.add(make_request("hi", prompt_len=12, max_tokens=8, priority=Priority.INTERACTIVE))
    sched.add(make_request("lo", prompt_len=12, max_tokens=8, priority=Priority.BATCH))
    plans = []
    finished = {}
    while sched.has_work():
        out = sched.schedule(0.0)
        plans.append([(s.seq.request_id, s.start, s.num_new) for s in out.scheduled])
        finished.update({o.request_id: o for o in sched.update(out, fake_results(out), 0.0)})
    assert plans[0] == [("hi", 0, 12), ("lo", 0, 12)]  # both prefill
    assert plans[1:5] == [[("hi", 12 + i, 1), ("lo", 12 + i, 1)] for i in range(4)]
    # the pool is full at 16 tokens each: the batch sequence is the victim, hi runs alone...
    assert plans[5:8] == [[("hi", 16 + i, 1)] for i in range(3)]
    # ...and lo recomputes its prompt and the 5 tokens it had (17 = 12 + 5), then decodes
    assert plans[8:] == [[("lo", 0, 17)], [("lo", 17, 1)], [("lo", 18, 1)]]
    assert sched.counters.preemptions == 1
    assert {k: v.num_output_tokens for k, v in finished.items()} == {"hi": 8, "lo": 8}
    assert all(v.finish_reason == FinishReason.LENGTH for v in finished.values())
    assert sched.pool.num_used == 0


def test_abort_returns_blocks_at_once() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", prompt_len=30, max_tokens=10))
    out = sched.schedule(0.0)
    sched.update(out, fake_results(out), 0.0)
    assert sched.pool.num_used > 0
    aborted = sched.abort("a")
    assert aborted is not None and aborted.finish_reason == FinishReason.ABORTED
    assert sched.pool.num_used == 0 and not sched.has_work()


def test_abort_while_waiting() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("a"))
    sched.add(make_request("b"))
    assert sched.abort("b") is not None
    done = run_to_completion(sched)
    assert set(done) == {"a"}


def test_request_over_context_is_refused_with_both_numbers() -> None:
    sched = make_scheduler(max_model_len=32)
    sched.add(make_request("big", prompt_len=30, max_tokens=10))
    out = sched.schedule(0.0)
    (o,) = out.finished
    assert (o.finish_reason, o.error_code) == (FinishReason.ERROR, EngineError.INVALID)
    assert o.error is not None and "30" in o.error and "32" in o.error


def test_budget_limits_sequences_and_tokens() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=20)
    for i in range(6):
        sched.add(make_request(f"r{i}", prompt_len=8))
    out = sched.schedule(0.0)
    # three sequences (max_num_seqs), 20 tokens: the third prompt is chunked to what is left
    assert [(s.seq.request_id, s.start, s.num_new) for s in out.scheduled] == [
        ("r0", 0, 8),
        ("r1", 0, 8),
        ("r2", 0, 4),
    ]


def test_request_larger_than_the_kv_pool_fails_as_out_of_memory() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4)  # 4 usable blocks: 16 tokens
    sched.add(make_request("huge", prompt_len=20, max_tokens=4))
    (o,) = sched.schedule(0.0).finished
    assert (o.finish_reason, o.error_code) == (FinishReason.ERROR, EngineError.OUT_OF_MEMORY)
    assert o.error is not None and "KV blocks" in o.error


def test_runner_failure_alone_is_reported_as_out_of_memory() -> None:
    sched = make_scheduler()
    sched.add(make_request("a", prompt_len=8))
    out = sched.schedule(0.0)
    (o,) = sched.update(out, [SeqResult(error="no room for the activations")], 0.0)
    assert (o.finish_reason, o.error_code) == (FinishReason.ERROR, EngineError.OUT_OF_MEMORY)
    assert o.error == "no room for the activations" and sched.pool.num_used == 0

"""The rules about the work itself: overload, admission mis-calibration, prefill-heavy traffic
and KV-pool exhaustion. Each returns a Finding (finding.py); diagnosis.py runs them all.
"""

from __future__ import annotations

from tailguard.tools.doctor import thresholds as T
from tailguard.tools.doctor.finding import (
    Cause,
    Evidence,
    Finding,
    Strongest,
    combine,
    ev,
    summary,
)
from tailguard.tools.doctor.loadreport import LoadSummary
from tailguard.tools.doctor.observation import (
    LATENCY,
    Observation,
    ServerWindow,
    Symptom,
    refused,
)
from tailguard.tools.doctor.rules import capacity, queue_slow_share, requests_in_window

PREDICTION = "tailguard_admission_prediction_ratio"


def tokens_per_seq(sw: ServerWindow) -> float | None:
    """Mean tokens per sequence per engine step (1 for pure decode); None without batches."""
    toks, seqs = sw.hist("tailguard_batch_tokens"), sw.hist("tailguard_batch_size")
    if toks.count <= 0 or seqs.count <= 0 or seqs.mean <= 0:
        return None
    return toks.mean / seqs.mean


def _rates(sw: ServerWindow, window_s: float) -> tuple[float, float, float]:
    """(offered, served ok, capacity estimate) in requests/s. Offered counts the queue's growth;
    capacity is what was served divided by the share of the window the engine was stepping
    (what was served when it reports no steps)."""
    w = max(window_s, 1e-9)
    # what arrived: answered, refused, and the growth of the queue still waiting at the end
    grew = sw.after.get("tailguard_requests_waiting") - sw.before.get("tailguard_requests_waiting")
    offered = (requests_in_window(sw) + max(0.0, grew)) / w
    served = sw.hist(LATENCY, outcome="ok").count / w
    busy = sw.delta("tailguard_engine_step_seconds_sum") / w
    est = served / min(1.0, busy) if busy >= 0.05 else served
    return offered, served, est


def preempting(sw: ServerWindow) -> bool:
    """Sequences preempted (recomputed later) on over 1% of the window's requests."""
    rq = max(1.0, sw.hist(LATENCY, outcome="ok").count)
    return sw.delta("tailguard_preemptions_total") / rq > T.PREEMPT_PER_REQUEST


def kv_bound(sw: ServerWindow, window_s: float, sla_s: float) -> bool:
    """The KV pool caps the batch: preempting, the batch under half full, and requests queueing
    past SLA/2 (or refused). The queue, or admission's refusals, then measure the pool's
    capacity, not the engine's compute: the fix is the pool (kv_exhaustion), not capacity."""
    c = capacity(sw, window_s)
    queued = queue_slow_share(sw, sla_s) > T.QUEUE_SLOW_SHARE or refused(sw) > 0
    return preempting(sw) and c.fill is not None and c.fill < T.KV_BOUND_FILL and queued


def _client_refusals(ld: LoadSummary | None) -> list[Evidence]:
    """The load report's refusals (429/503), how many said when to retry, the offered rate."""
    if ld is None or not ld.requests:
        return []
    share = ld.refused / ld.requests
    return [
        ev("client refused share (429/503)", share, T.REJECT_SHARE, share > T.REJECT_SHARE,
           0.5, where="load report"),
        ev("refusals that carried Retry-After", ld.retry_after, None, False, 0.0,
           where="load report"),
        ev("offered rate (load report)", ld.offered_rps, None, False, 0.0, unit=" req/s",
           where="load report"),
    ]  # fmt: skip


def overload(obs: Observation, sym: Symptom) -> Finding:
    """Demand above capacity: refusals (decisive), or a queue on a full engine."""
    sla, win = sym.sla_s, obs.window_s
    ld = obs.load
    client = _client_refusals(ld)
    client_refusing = any(e.fired for e in client)
    best: tuple[float, list[Evidence], str, bool, str] = (0.0, client, "", client_refusing, "")
    for sw in obs.servers:
        w, c = sw.name, capacity(sw, win)
        rq = requests_in_window(sw)
        rej_share = refused(sw) / rq if rq else 0.0
        wait_b = sw.before.get("tailguard_requests_waiting")
        wait_a = sw.after.get("tailguard_requests_waiting")
        cap = sw.after.get("tailguard_max_num_seqs")
        backlog = wait_a >= max(T.WAITING_MIN, cap) and wait_a > wait_b
        q_share = queue_slow_share(sw, sla)
        offered, _served, est = _rates(sw, win)
        tps = tokens_per_seq(sw)
        ev_ = [
            ev("server refused share (overloaded, expired, cache answers)", rej_share,
               T.REJECT_SHARE, rej_share > T.REJECT_SHARE, 0.5, where=w),
            ev("mean batch fill", -1.0 if c.fill is None else c.fill, T.BATCH_FULL_RATIO,
               c.fill is not None and c.fill >= T.BATCH_FULL_RATIO, 0.3, where=w),
            ev("engine busy (step time / window) with requests in its queue", c.busy,
               T.ENGINE_BUSY_RATIO, c.busy_with_queue, 0.3, where=w),
            ev("queue-time share over SLA/2", q_share, T.QUEUE_SLOW_SHARE,
               q_share > T.QUEUE_SLOW_SHARE, 0.35, where=w),
            ev("waiting queue growth (before -> after)", wait_a - wait_b,
               max(T.WAITING_MIN, cap), backlog, 0.3, where=w),
            *([ev("per-token time in the window / the server's mean before it (vLLM: the "
                  "running batch outgrew the hardware)", c.decode_slowdown, T.DECODE_SLOWDOWN,
                  c.batch_outgrown, 0.5, unit="x", where=w)]
              if c.decode_slowdown is not None else []),
            ev("offered rate (served + refused)", offered, None, False, 0.0, unit=" req/s",
               where=w),
            ev("capacity measured (served / engine busy share)", est, None, False, 0.0,
               unit=" req/s", where=w),
            *client,
        ]  # fmt: skip
        conf = combine(ev_)
        refusing = rej_share > T.REJECT_SHARE or client_refusing
        idle = sw.has("tailguard_engine_step_seconds_sum") and c.busy < T.ENGINE_BUSY_RATIO
        note = ""
        if refusing and idle and not c.saturated:
            conf, note = conf * 0.3, "refusing while the engine was mostly idle: see admission"
        elif not refusing and not c.saturated:
            conf, note = conf * 0.3, "queueing with room in the engine: a dispatch problem"
        elif not refusing and tps is not None and tps > T.PREFILL_TOKENS_PER_SEQ:
            conf, note = conf * 0.6, "the queue is prompt tokens: see prefill_heavy"
        pool_caps = kv_bound(sw, win, sla)
        if pool_caps:
            conf, note = conf * 0.6, "sequences wait for KV blocks: see kv_exhaustion"
        if conf >= best[0]:
            ratio = f" ({offered / est:.1f}x)" if est > 0 else ""
            rates = f"offered {offered:.0f} req/s against a measured capacity of ~{est:.0f}{ratio}"
            # Ranked first: refusals from an engine that was not idle, or a saturated engine
            # whose queue grew under demand well over what it served (a neighbour that slowed
            # it is then listed after: the queue grows faster than it drains either way).
            swamped = c.saturated and backlog and offered >= T.OFFERED_OVER_CAPACITY * est
            first = ((refusing and not (idle and not c.saturated)) or swamped) and not pool_caps
            best = (round(conf, 3), ev_, w, first, rates + (f"; {note}" if note else ""))
    conf, evidence, where, first, rates = best
    if not obs.servers:
        conf = combine(evidence)
        if ld is not None and ld.offered_rps:
            rates = f"offered {ld.offered_rps:.0f} req/s; the servers' capacity was not read"
    text = summary(evidence, "queue short, batches have room, nothing refused")
    return Finding(
        cause=Cause.OVERLOAD,
        title="overload (demand above capacity)",
        confidence=round(conf, 3),
        summary=f"{rates}: {text}" if rates else text,
        evidence=tuple(evidence),
        where=where,
        first=first,
        fix=(
            "add capacity (replicas, a bigger device) or pace the clients: this is not a tuning "
            "problem",
            "keep admission control on so excess is refused fast with Retry-After instead of "
            "queueing past the SLA; batch clients should follow Retry-After "
            "(`tailguard batch` does)",
        ),
    )


def admission(obs: Observation, sym: Symptom) -> Finding:
    """Admission's cost model is wrong: it refuses work the engine had room for, or it admits
    work that then misses its deadline (tailguard_admission_prediction_ratio)."""
    best = Strongest()
    for sw in obs.servers:
        if sw.kind == "vllm":
            continue
        w, c = sw.name, capacity(sw, obs.window_s)
        rq = requests_in_window(sw)
        rej_share = refused(sw) / rq if rq else 0.0
        idle = sw.has("tailguard_engine_step_seconds_sum") and c.busy < T.ENGINE_BUSY_RATIO
        h = sw.hist(PREDICTION)
        late = h.share_over(1.0) if h.count else -1.0
        generous = h.share_le(T.PREDICTION_HELD_MIN) if h.count else -1.0
        refusing = rej_share > T.REJECT_SHARE
        ev_ = [
            ev("refused share while the engine was mostly idle", rej_share, T.REJECT_SHARE,
               refusing and idle and not c.saturated, 0.5, where=w),
            ev("engine busy (step time / window)", c.busy, T.ENGINE_BUSY_RATIO, False, 0.0,
               where=w),
            ev("admitted requests later than admission planned (prediction ratio > 1)", late,
               T.PREDICTION_LATE_SHARE,
               late > T.PREDICTION_LATE_SHARE and late * h.count >= T.PREDICTION_LATE_MIN, 0.55,
               where=w, risk=True),
            ev("predictions with 2x margin (ratio <= 0.5) while refusing", generous, 0.9,
               refusing and generous > 0.9, 0.3, where=w, risk=True),
        ]  # fmt: skip
        best.offer(ev_, w)
    return best.finding(
        Cause.ADMISSION,
        "admission control mis-calibrated (its cost model is wrong)",
        healthy="predictions hold; refusals only with a busy engine",
        missing="no tailguard admission figures (vLLM, or another server)",
        fix=(
            "check the calibration: tailguard_admission_excess_seconds per size class, and "
            'tailguard_admission_prediction_ratio bucket{le="1.0"}/count (share that held)',
            "over-refusing: lower admission_quantile or let samples age out (30 s) after a "
            "slow patch; late admissions: raise admission_quantile",
        ),
    )


def prefill_heavy(obs: Observation, sym: Symptom) -> Finding:
    """Long prompts take whole steps while decodes and short prompts wait behind them."""
    sla = sym.sla_s
    best = Strongest()
    for sw in obs.servers:
        w = sw.name
        tps = tokens_per_seq(sw)
        step = sw.hist("tailguard_engine_step_seconds")
        q_share = queue_slow_share(sw, sla)
        prompt = sw.hist("vllm:request_prompt_tokens")
        gen = sw.hist("vllm:request_generation_tokens")
        pre = sw.hist("vllm:request_prefill_time_seconds")
        inf = sw.hist("vllm:request_inference_time_seconds")
        pre_share = pre.sum / inf.sum if inf.sum > 0 else -1.0
        ev_ = [
            ev("tokens per sequence per step (batch tokens / batch sequences)",
               -1.0 if tps is None else tps, T.PREFILL_TOKENS_PER_SEQ,
               tps is not None and tps > T.PREFILL_TOKENS_PER_SEQ, 0.5, where=w),
            ev("mean engine step", step.mean if step.count else -1.0,
               T.PREFILL_STEP_SLA_FRACTION * sla,
               step.count > 0 and step.mean > T.PREFILL_STEP_SLA_FRACTION * sla, 0.3, unit="s",
               where=w),
            ev("queue-time share over SLA/2", q_share, T.QUEUE_SLOW_SHARE,
               q_share > T.QUEUE_SLOW_SHARE, 0.3, where=w),
        ]  # fmt: skip
        if prompt.count:  # vLLM: per-request token histograms instead of per-step batches
            ratio = prompt.mean / gen.mean if gen.mean > 0 else prompt.mean
            ev_ += [
                ev("mean prompt tokens (and prompt / generated >= 8)", prompt.mean,
                   T.PROMPT_TOKENS_LONG, prompt.mean > T.PROMPT_TOKENS_LONG and ratio >= 8, 0.5,
                   where=w),
                ev("prefill share of request inference time", pre_share, 0.5, pre_share > 0.5,
                   0.3, where=w),
            ]  # fmt: skip
        conf = combine(ev_)
        if not any(e.fired and e.weight == 0.5 for e in ev_):  # long steps alone: not prompts
            conf *= 0.3
        best.offer(ev_, w, conf)
    return best.finding(
        Cause.PREFILL,
        "prefill-heavy traffic (long prompts take whole steps)",
        healthy="steps are mostly decode; prompts short",
        fix=(
            "bound the prompt tokens per step (max_num_batched_tokens) so a long prompt is "
            "chunked across steps and decodes keep running between its chunks",
            "route long-prompt traffic (documents, RAG) to its own replicas, or give it a "
            "looser SLA class; cap prompt length at the API",
        ),
    )


def kv_exhaustion(obs: Observation, sym: Symptom) -> Finding:
    """The KV pool runs dry: sequences are preempted and their prefill recomputed later; when
    it also caps the batch (kv_bound), the queue behind it is the pool's doing."""
    best = Strongest()
    for sw in obs.servers:
        w = sw.name
        c = capacity(sw, obs.window_s)
        preempt = sw.delta("tailguard_preemptions_total")
        rq = max(1.0, sw.hist(LATENCY, outcome="ok").count)
        usage = max(sw.before.get("tailguard_kv_cache_usage_ratio"),
                    sw.after.get("tailguard_kv_cache_usage_ratio"))  # fmt: skip
        has = sw.has("tailguard_preemptions_total") or sw.has("tailguard_kv_cache_usage_ratio")
        if not has:
            continue
        ev_ = [
            ev("preemptions (recomputes) per request", preempt / rq, T.PREEMPT_PER_REQUEST,
               preempt / rq > T.PREEMPT_PER_REQUEST, 0.55, where=w, risk=True),
            ev("preemptions in the window", preempt, None, False, 0.0, where=w),
            ev("KV usage at a window end", usage, T.KV_USAGE_FULL, usage >= T.KV_USAGE_FULL, 0.25,
               where=w),
            ev("requests queued or refused while preempting with the batch under half full",
               -1.0 if c.fill is None else c.fill, T.KV_BOUND_FILL,
               kv_bound(sw, obs.window_s, sym.sla_s), 0.4, where=w),
        ]  # fmt: skip
        best.offer(ev_, w)
    return best.finding(
        Cause.KV_EXHAUSTION,
        "KV-pool exhaustion (preemptions and recomputes)",
        healthy="no preemptions; the KV pool has room",
        missing="no KV figures exported",
        fix=(
            "give the KV pool more blocks (gpu_memory_utilization / num_kv_blocks) or run more "
            "replicas",
            "lower max_num_seqs (or max_model_len) so the admitted sequences fit the pool",
            "cap max_tokens of long generations; each preemption recomputes its whole prefix",
        ),
    )


__all__ = [
    "admission",
    "kv_bound",
    "kv_exhaustion",
    "overload",
    "preempting",
    "prefill_heavy",
    "tokens_per_seq",
]

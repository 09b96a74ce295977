"""Every rule on recorded windows: the broken side names its cause, the fixed side names none."""

from __future__ import annotations

import json
from dataclasses import replace

import msgspec
import pytest
from tests.tools.doctor.doctor_testkit import FIXTURES

from tailguard.tools.doctor import thresholds as T
from tailguard.tools.doctor.collect import CollectError, load_recorded
from tailguard.tools.doctor.diagnosis import Diagnosis, diagnose
from tailguard.tools.doctor.finding import Cause, Finding
from tailguard.tools.doctor.report import render_json, render_text


def run(name: str) -> Diagnosis:
    return diagnose(load_recorded(FIXTURES / name))


def finding(d: Diagnosis, cause: Cause) -> Finding:
    return next(f for f in (*d.causes, *d.notes) if f.cause is cause)


def fired(f: Finding) -> dict[str, float]:
    return {e.what: e.value for e in f.evidence if e.fired}


@pytest.mark.parametrize(
    ("scenario", "cause"),
    [
        ("churn_missed", Cause.CHURN),
        ("starvation", Cause.STARVATION),
        ("overload", Cause.OVERLOAD),
        ("fragmentation", Cause.FRAGMENTATION),
        ("fragmentation_engine_stats", Cause.FRAGMENTATION),
        ("healthy", Cause.NONE),
        ("healthy_two_replicas", Cause.NONE),
        ("fragmentation_fixed", Cause.NONE),
        # the second window: a per-connection cap on a server that met its SLA
        ("churn", Cause.RISK),
        ("risk_threads", Cause.RISK),
        # refusals are a missed SLA: overload, even with every admitted answer in time
        ("overload_shedding", Cause.OVERLOAD),
        ("overload_over_refusing", Cause.ADMISSION),
        ("admission_late", Cause.ADMISSION),
        ("gc", Cause.GC),
        ("kv_exhaustion", Cause.KV_EXHAUSTION),
        ("prefill_heavy", Cause.PREFILL),
        ("noisy_neighbour", Cause.NOISY_NEIGHBOUR),
        ("vllm_healthy", Cause.NONE),
        ("vllm_preempt", Cause.KV_EXHAUSTION),
        ("vllm_overload", Cause.OVERLOAD),
        ("vllm_prefill", Cause.PREFILL),
        ("vllm_refusing", Cause.OVERLOAD),
    ],
)
def test_verdict(scenario: str, cause: Cause) -> None:
    d = run(scenario)
    assert d.verdict is cause, render_text(d)
    exit_code = {Cause.NONE: 0, Cause.RISK: 3}.get(cause, 1)
    assert d.exit_code == exit_code
    if cause not in (Cause.NONE, Cause.RISK):
        # exactly one cause was injected: the others stay below the bar
        assert [f.cause for f in d.causes] == [cause], render_text(d)


def test_churn_on_a_window_that_met_the_sla_is_a_risk_not_a_cause() -> None:
    d = run("churn")
    assert not d.symptom.missed and d.causes == ()
    [risk] = d.risks
    assert risk.cause is Cause.CHURN
    assert {e.what: e.value for e in risk.risks}["downstream_cx_max_requests_reached"] == 30
    text = render_text(d)
    assert "met its SLA: no cause is named" in text and "fix: remove max_requests" in text


def test_churn_evidence_names_the_envoy_counters() -> None:
    f = finding(run("churn_missed"), Cause.CHURN)
    ev = fired(f)
    assert ev["downstream_cx_max_requests_reached"] == 300
    assert ev["upstream_cx_max_requests"] == 300
    # the slow requests would have met the SLA but for their connection set-up
    assert ev["requests that connection set-up pushed over the SLA"] >= T.SLOW_NEW_CX_MIN
    assert f.confidence >= 0.8
    assert any("max_requests_per_connection" in x for x in f.fix)


def test_starvation_evidence() -> None:
    f = finding(run("starvation"), Cause.STARVATION)
    ev = fired(f)
    # server 4 intra-op threads (less the front-end's 1) + a pool of 4, on 2 cores
    assert ev["compute threads per core on host (exported)"] == pytest.approx(3.5)
    assert (
        ev["event-loop lag share over SLA/3 (server's probe or the doctor's)"]
        > T.LOOP_LAG_SLOW_SHARE
    )
    assert ev["queue-time share over SLA/2, engine not at capacity"] > T.QUEUE_SLOW_SHARE


def test_overload_needs_full_batches_and_says_capacity() -> None:
    d = run("overload")
    f = finding(d, Cause.OVERLOAD)
    assert fired(f)["mean batch fill"] >= T.BATCH_FULL_RATIO
    assert "waiting queue growth (before -> after)" in fired(f)
    assert "capacity" in f.fix[0]
    # the same queueing does not read as starvation: the engine is at capacity
    assert finding(d, Cause.STARVATION).confidence < T.CAUSE_MIN_CONFIDENCE


def test_shedding_is_overload_with_offered_rate_against_capacity() -> None:
    d = run("overload_shedding")
    assert d.symptom.missed and not d.symptom.tail  # every admitted answer was in time
    f = d.causes[0]
    assert f.cause is Cause.OVERLOAD and f.first
    assert f.summary.startswith("offered ")
    assert "measured capacity" in f.summary


def test_refusing_with_an_idle_engine_is_admission_not_overload() -> None:
    d = run("overload_over_refusing")
    assert not finding(d, Cause.OVERLOAD).is_cause
    f = finding(d, Cause.ADMISSION)
    assert fired(f)["refused share while the engine was mostly idle"] > 0.8


def test_fragmentation_from_metrics_and_from_engine_stats_agree() -> None:
    a = finding(run("fragmentation"), Cause.FRAGMENTATION)
    b = finding(run("fragmentation_engine_stats"), Cause.FRAGMENTATION)
    assert fired(a) == fired(b)
    ev = fired(a)
    assert ev["alloc retries in window"] == 23
    assert ev["cudaMalloc calls after warm-up"] == 1710 - 312
    assert ev["new forward shapes after warm-up"] == 37
    assert ev["reserved-minus-allocated ratio"] == pytest.approx((78 - 49) / 78, abs=1e-4)


def test_fragmentation_needs_warm_engine() -> None:
    obs = load_recorded(FIXTURES / "fragmentation_engine_stats")
    sw = obs.servers[0]
    assert sw.engine_before is not None
    cold = replace(sw, engine_before=msgspec.structs.replace(sw.engine_before, warmup_done=False))
    d = diagnose(replace(obs, servers=(cold,)))
    f = finding(d, Cause.FRAGMENTATION)
    # during warm-up cudaMallocs and new shapes are expected; only the gap still counts
    assert "alloc retries in window" not in fired(f)
    assert "cudaMalloc calls after warm-up" not in fired(f)
    assert not f.is_cause


def test_a_busy_host_alone_names_no_cause() -> None:
    # 16 cores, the server uses ~1.5 of them; the host's CPU is context, not starvation
    obs = load_recorded(FIXTURES / "fragmentation_fixed")
    d = diagnose(replace(obs, host_cpu_busy=0.99))
    assert d.verdict is Cause.NONE
    assert not finding(d, Cause.STARVATION).is_cause


def test_too_little_traffic_names_no_starvation() -> None:
    obs = load_recorded(FIXTURES / "starvation")
    d = diagnose(replace(obs, load=None, servers=()))
    assert d.verdict is Cause.NONE
    assert not d.symptom.enough_traffic


def test_sla_override_changes_the_symptom() -> None:
    obs = load_recorded(FIXTURES / "healthy")
    assert obs.sla_s == pytest.approx(0.15)  # from tailguard_sla_seconds
    tight = diagnose(replace(obs, sla_override_s=0.05))
    assert tight.symptom.within_sla < T.SLA_TARGET_SHARE
    # a tail that no rule explains is not "healthy": it is named as such, exit 1
    assert tight.verdict is Cause.UNEXPLAINED and tight.exit_code == 1
    assert "no rule explains" in render_text(tight)


def test_json_report_is_plain_and_ordered() -> None:
    d = run("churn_missed")
    doc = json.loads(render_json(d))
    assert doc["verdict"] == "churn" and doc["exit_code"] == 1
    assert doc["causes"][0]["cause"] == "churn"
    confs = [f["confidence"] for f in doc["causes"] + doc["notes"]]
    assert confs == sorted(confs, reverse=True)
    assert doc["symptom"]["client"]["requests"] == 800
    assert doc["symptom"]["missed"] is True


def test_text_report_leads_with_the_cause() -> None:
    text = render_text(run("starvation"))
    lines = text.splitlines()
    first_cause = next(i for i, x in enumerate(lines) if x.startswith("1. "))
    assert "STARVATION" in lines[first_cause]
    assert lines[-1] == "verdict: starvation (exit 1)"
    assert "no standing risk seen" in render_text(run("healthy"))


def test_recorded_folder_without_meta_is_a_collect_error() -> None:
    with pytest.raises(CollectError, match=r"no meta\.json"):
        load_recorded(FIXTURES / "does-not-exist")

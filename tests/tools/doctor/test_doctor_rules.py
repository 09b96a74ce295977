"""Every rule on recorded windows: the broken side names its cause, the fixed side names none."""

from __future__ import annotations

import json
from dataclasses import replace

import msgspec
import pytest
from tests.tools.doctor.doctor_testkit import FIXTURES

from tailguard.tools.doctor import thresholds as T
from tailguard.tools.doctor.collect import CollectError, load_recorded
from tailguard.tools.doctor.report import render_json, render_text
from tailguard.tools.doctor.rules import Cause, Diagnosis, Finding, diagnose


def run(name: str) -> Diagnosis:
    return diagnose(load_recorded(FIXTURES / name))


def finding(d: Diagnosis, cause: Cause) -> Finding:
    return next(f for f in (*d.causes, *d.notes) if f.cause is cause)


def fired(f: Finding) -> dict[str, float]:
    return {e.what: e.value for e in f.evidence if e.fired}


@pytest.mark.parametrize(
    ("scenario", "cause"),
    [
        ("churn", Cause.CHURN),
        ("starvation", Cause.STARVATION),
        ("overload", Cause.OVERLOAD),
        ("fragmentation", Cause.FRAGMENTATION),
        ("fragmentation_engine_stats", Cause.FRAGMENTATION),
        ("healthy", Cause.NONE),
        ("healthy_two_replicas", Cause.NONE),
        ("overload_shedding", Cause.NONE),
        ("overload_over_refusing", Cause.NONE),
        ("fragmentation_fixed", Cause.NONE),
    ],
)
def test_verdict(scenario: str, cause: Cause) -> None:
    d = run(scenario)
    assert d.verdict is cause, render_text(d)
    assert d.exit_code == (0 if cause is Cause.NONE else 1)
    if cause is not Cause.NONE:
        # exactly one cause was injected: the others stay below the bar
        assert [f.cause for f in d.causes] == [cause], render_text(d)


def test_churn_evidence_names_the_envoy_counters() -> None:
    f = finding(run("churn"), Cause.CHURN)
    ev = fired(f)
    assert ev["downstream_cx_max_requests_reached"] == 30
    assert ev["upstream_cx_max_requests"] == 30
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


def test_shedding_is_a_note_not_a_cause() -> None:
    d = run("overload_shedding")
    f = finding(d, Cause.OVERLOAD)
    assert not f.is_cause and f.confidence > 0.3
    assert f.summary.startswith("shedding load")
    assert "shedding load" in render_text(d)


def test_refusing_with_an_idle_engine_is_not_overload() -> None:
    f = finding(run("overload_over_refusing"), Cause.OVERLOAD)
    assert not f.is_cause
    assert f.summary.startswith("refusing while the engine was mostly idle")
    assert fired(f)["client refused share (429/503)"] > 0.8


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


def test_busy_host_with_idle_servers_points_at_the_neighbours() -> None:
    # 16 cores, the server uses ~1.5 of them: the busy host is someone else's doing
    obs = load_recorded(FIXTURES / "fragmentation_fixed")
    f = finding(diagnose(replace(obs, host_cpu_busy=0.99)), Cause.STARVATION)
    assert fired(f) == {"host CPU busy, all processes (/proc/stat)": 0.99}
    assert f.summary.startswith("the host is busy (99%) but the servers use only 9%")
    assert not f.is_cause  # a busy host alone is not a cause
    # on 2 cores the same server load is most of the host: no neighbour to blame
    healthy = load_recorded(FIXTURES / "healthy")
    g = finding(diagnose(replace(healthy, host_cpu_busy=0.99)), Cause.STARVATION)
    assert not g.summary.startswith("the host is busy")


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
    d = run("churn")
    doc = json.loads(render_json(d))
    assert doc["verdict"] == "churn" and doc["exit_code"] == 1
    assert doc["causes"][0]["cause"] == "churn"
    confs = [f["confidence"] for f in doc["causes"] + doc["notes"]]
    assert confs == sorted(confs, reverse=True)
    assert doc["symptom"]["client"]["requests"] == 800


def test_text_report_leads_with_the_cause() -> None:
    text = render_text(run("starvation"))
    lines = text.splitlines()
    first_cause = next(i for i, x in enumerate(lines) if x.startswith("1. "))
    assert "STARVATION" in lines[first_cause]
    assert lines[-1] == "verdict: starvation (exit 1)"
    assert "no cause found" in render_text(run("healthy"))


def test_recorded_folder_without_meta_is_a_collect_error() -> None:
    with pytest.raises(CollectError, match=r"no meta\.json"):
        load_recorded(FIXTURES / "does-not-exist")

"""Parsers and window arithmetic: the numbers every rule builds on."""

from __future__ import annotations

import math

import pytest
from tests.tools.doctor.doctor_testkit import FIXTURES

from tailguard.tools.doctor.loadreport import LoadRequest, summarize
from tailguard.tools.doctor.snapshot import (
    ParseError,
    counter_delta,
    envoy_sum,
    histogram_delta,
    parse_envoy_stats,
    parse_prometheus_range,
    parse_prometheus_text,
)

HIST = """# TYPE mistral_inference_latency_seconds histogram
mistral_inference_latency_seconds_bucket{{endpoint="chat",outcome="ok",le="0.1"}} {a}
mistral_inference_latency_seconds_bucket{{endpoint="chat",outcome="ok",le="0.15"}} {b}
mistral_inference_latency_seconds_bucket{{endpoint="chat",outcome="ok",le="0.2"}} {c}
mistral_inference_latency_seconds_bucket{{endpoint="chat",outcome="ok",le="+Inf"}} {d}
mistral_inference_latency_seconds_count{{endpoint="chat",outcome="ok"}} {d}
mistral_inference_latency_seconds_sum{{endpoint="chat",outcome="ok"}} {s}
# TYPE tailguard_requests_total counter
tailguard_requests_total{{endpoint="chat",outcome="ok"}} {d}
"""


def test_histogram_delta_shares_are_exact_at_bucket_bounds() -> None:
    before = parse_prometheus_text(HIST.format(a=10, b=10, c=10, d=10, s=0.5))
    after = parse_prometheus_text(HIST.format(a=60, b=109, c=110, d=120, s=20.0))
    h = histogram_delta(before, after, "mistral_inference_latency_seconds", outcome="ok")
    assert h.count == 110
    assert h.share_le(0.15) == pytest.approx(99 / 110)
    assert h.share_le(0.17) == pytest.approx(99 / 110)  # not a bound: the bound below counts
    assert h.quantile_upper(0.5) == 0.15  # 50 of 110 under 0.1 s: the median is above it
    assert h.quantile_upper(0.99) == math.inf  # 10 of 110 beyond 0.2 s
    assert h.mean == pytest.approx(19.5 / 110)
    assert counter_delta(before, after, "tailguard_requests_total") == 110


def test_counter_reset_counts_from_zero() -> None:
    before = parse_prometheus_text(HIST.format(a=60, b=109, c=110, d=120, s=20.0))
    after = parse_prometheus_text(HIST.format(a=5, b=5, c=5, d=5, s=0.2))
    assert counter_delta(before, after, "tailguard_requests_total") == 5
    assert histogram_delta(before, after, "mistral_inference_latency_seconds").count == 5


def test_prometheus_text_rejects_garbage() -> None:
    with pytest.raises(ParseError, match="Prometheus text"):
        parse_prometheus_text("<html>not metrics</html>\n{{{")


def test_envoy_plain_and_json_agree_and_skip_admin() -> None:
    plain = parse_envoy_stats((FIXTURES / "healthy" / "envoy.after.txt").read_text())
    assert plain.get("http.ingress.downstream_rq_total") == 3500
    # the admin listener's own requests are not traffic
    assert envoy_sum(plain, "http", "downstream_rq_total", skip=("admin",)) == 3500
    assert envoy_sum(plain, "http", "downstream_rq_total") == 3504
    as_json = parse_envoy_stats((FIXTURES / "churn" / "envoy.after.txt").read_text())
    assert as_json.get("http.ingress.downstream_cx_max_requests_reached") == 35
    assert envoy_sum(as_json, "listener", "ssl.handshake", skip=("admin",)) == 94


def test_envoy_rejects_non_stats_page() -> None:
    with pytest.raises(ParseError, match="admin /stats"):
        parse_envoy_stats("<html>\nhello\n</html>")


def test_prometheus_range_gives_first_and_last_per_instance() -> None:
    doc = {
        "status": "success",
        "data": {
            "resultType": "matrix",
            "result": [
                {
                    "metric": {
                        "__name__": "tailguard_requests_total",
                        "instance": "a:1",
                        "job": "tg",
                        "outcome": "ok",
                    },
                    "values": [[100.0, "10"], [160.0, "250"]],
                },
                {
                    "metric": {
                        "__name__": "tailguard_requests_total",
                        "instance": "b:1",
                        "outcome": "ok",
                    },
                    "values": [[160.0, "7"]],  # born inside the window: it started at 0
                },
            ],
        },
    }
    out = parse_prometheus_range(doc)
    a0, a1 = out["a:1"]
    assert counter_delta(a0, a1, "tailguard_requests_total", outcome="ok") == 240
    b0, b1 = out["b:1"]
    assert counter_delta(b0, b1, "tailguard_requests_total") == 7
    with pytest.raises(ParseError, match="error"):
        parse_prometheus_range({"status": "error", "error": "bad query"})


def test_load_summary_counts_refusals_apart_from_the_tail() -> None:
    def r(lat: float | None, status: int = 200, new: bool = False) -> LoadRequest:
        return LoadRequest(
            lat, status, status == 200 and lat is not None, new, 0.1 if new else None
        )

    reqs = [r(0.05) for _ in range(89)] + [r(0.4, new=True) for _ in range(5)]
    reqs.append(r(0.2, new=True))  # 0.1 s of connect made it miss the SLA
    reqs += [r(0.002, status=503) for _ in range(20)] + [r(None, status=0) for _ in range(5)]
    s = summarize(reqs, sla_s=0.15)
    assert (s.requests, s.ok, s.refused) == (120, 95, 20)
    assert s.slow == 11  # 6 over the SLA + 5 that never got an answer; refusals are not slow
    assert s.within_sla == pytest.approx(89 / 100)
    assert s.slow_on_new == 6 and s.new_connections == 6
    assert s.slow_from_connect == 1
    assert s.p99_s == pytest.approx(0.4) and s.p50_s == pytest.approx(0.05)

"""Config, SLA parsing, schedules and the SLA/trust arithmetic: no sockets."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tailguard.errors import ConfigError
from tailguard.tools.load.analysis import RunFacts, analyse
from tailguard.tools.load.config import LoadConfig, Profile, parse_duration, parse_sla
from tailguard.tools.load.records import RequestRecord
from tailguard.tools.load.schedule import expected_count, intended_times
from tailguard.tools.load.server_metrics import compare, parse_histogram


def test_parse_duration() -> None:
    assert parse_duration("150ms") == pytest.approx(0.15)
    assert parse_duration("2m") == 120.0
    assert parse_duration("3") == 3.0
    with pytest.raises(ConfigError, match="150ms"):
        parse_duration("fast")


def test_parse_sla_terms() -> None:
    p = parse_sla("p99<=150ms")
    assert (p.metric, p.percentile, p.threshold) == ("percentile", 99.0, pytest.approx(0.15))
    assert parse_sla("p99.9<=1s").percentile == 99.9
    assert parse_sla("max<=200ms").threshold == pytest.approx(0.2)
    assert parse_sla("errors<=0.1%").threshold == pytest.approx(0.001)
    g = parse_sla("goodput>=500/s")
    assert (g.metric, g.threshold, g.bound_s) == ("goodput", 500.0, None)
    assert parse_sla("goodput(180ms)>=10/s").bound_s == pytest.approx(0.18)
    for bad in ("p99>=150ms", "p99<=150", "p100<=1s", "errors>=1%", "latency<=1s", "goodput<=5/s"):
        with pytest.raises(ConfigError, match="--sla"):
            parse_sla(bad)


def test_profile_validation_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--rate"):
        Profile("constant", duration_s=1)
    with pytest.raises(ConfigError, match="does not take --count"):
        Profile("constant", rate=1, duration_s=1, count=3)
    with pytest.raises(ConfigError, match="exactly one target"):
        Profile("ramp", hold_s=1)
    with pytest.raises(ConfigError, match="--concurrency 10 > --requests 5"):
        Profile("closed", concurrency=10, requests=5)
    assert Profile("burst", count=3).open_loop
    assert not Profile("closed", concurrency=1, requests=1).open_loop
    assert not Profile("ramp", to_inflight=10, hold_s=1).open_loop
    assert Profile("ramp", to_rate=10, hold_s=1).open_loop


def test_loadconfig_validation() -> None:
    prof = Profile("burst", count=1)
    with pytest.raises(ConfigError, match="http://"):
        LoadConfig("localhost:8000", prof)
    with pytest.raises(ConfigError, match="--body"):
        LoadConfig("http://x/y", prof, endpoint="raw")
    with pytest.raises(ConfigError, match="goodput needs a latency bound"):
        LoadConfig("http://x", prof, sla=(parse_sla("goodput>=5/s"),))
    cfg = LoadConfig("http://x", prof, sla=(parse_sla("p99<=150ms"), parse_sla("goodput>=5/s")))
    assert cfg.goodput_bound_s() == pytest.approx(0.15)


@pytest.mark.parametrize(
    ("endpoint", "path", "keys"),
    [
        ("infer", "/v1/infer", {"prompt", "top_k"}),
        ("completions", "/v1/completions", {"model", "prompt", "max_tokens"}),
        ("chat", "/v1/chat/completions", {"model", "messages", "max_tokens"}),
        ("embeddings", "/v1/embeddings", {"model", "input"}),
    ],
)
def test_endpoint_bodies(endpoint: str, path: str, keys: set[str]) -> None:
    cfg = LoadConfig("http://h:1/", Profile("burst", count=1), endpoint=endpoint)  # type: ignore[arg-type]
    assert cfg.target_url == "http://h:1" + path
    body = json.loads(cfg.request_body())
    assert set(body) == keys
    if "model" in body:
        assert body["model"] == "tailguard-embedded"
    raw = LoadConfig("http://h:1/x?y", Profile("burst", count=1), endpoint="raw", body=b"{}")
    assert raw.target_url == "http://h:1/x?y" and raw.request_body() == b"{}"


def test_schedules() -> None:
    c = list(intended_times(Profile("constant", rate=100, duration_s=2)))
    assert len(c) == 200 and c[0] == 0.0 and c[-1] == pytest.approx(1.99)
    p1 = list(intended_times(Profile("poisson", rate=500, duration_s=4, seed=7)))
    p2 = list(intended_times(Profile("poisson", rate=500, duration_s=4, seed=7)))
    assert p1 == p2 and 1800 < len(p1) < 2200 and p1 == sorted(p1)
    ramp = Profile("ramp", to_rate=40, steps=4, hold_s=1)
    assert ramp.ramp_levels() == [10, 20, 30, 40]
    r = list(intended_times(ramp))
    assert len(r) == expected_count(ramp) == 100
    assert sum(1 for t in r if 3 <= t < 4) == 40
    assert list(intended_times(Profile("burst", count=3))) == [0.0, 0.0, 0.0]


def _facts(wall: float = 1.0, cpu: float = 0.1, lags: list[float] | None = None) -> RunFacts:
    return RunFacts("t", wall, cpu, lags or [0.001] * 100, 1024, "asyncio")


def _rec(i: int, latency: float, ok: bool = True, status: int = 200) -> RequestRecord:
    r = RequestRecord(i, i * 0.01, sent_s=i * 0.01, status=status, ok=ok)
    r.latency_s = r.service_s = latency
    r.done_s = r.intended_s + latency
    r.error = None if ok else f"http {status}"
    return r


def test_sla_checks_count_failures_as_never_within_a_bound() -> None:
    # 1000 requests: 985 fast, 5 slow, 10 fast failures. p99<=150ms allows 10 bad; 15 are bad.
    recs = [_rec(i, 0.01) for i in range(985)]
    recs += [_rec(985 + i, 0.5) for i in range(5)]
    recs += [_rec(990 + i, 0.002, ok=False, status=503) for i in range(10)]
    sla = tuple(
        parse_sla(s) for s in ("p99<=150ms", "p98<=150ms", "max<=1s", "errors<=1%", "errors<=0.5%")
    )
    cfg = LoadConfig("http://x", Profile("burst", count=1000), sla=sla)
    res = analyse(cfg, recs, [], _facts(), None, None)
    passed = {r.text: r.passed for r in res.sla}
    assert passed == {
        "p99<=150ms": False,  # 15 bad > 10 allowed, although the latency p99 alone is fast
        "p98<=150ms": True,  # 15 bad <= 20 allowed
        "max<=1s": False,  # failures are never within
        "errors<=1%": True,
        "errors<=0.5%": False,
    }
    assert res.summary.share_within["0.15"] == pytest.approx(0.985)
    assert res.exit_code() == 1 and res.client.trusted


def test_untrusted_client_exits_2_and_says_by_how_much() -> None:
    recs = [_rec(i, 0.01) for i in range(100)]
    cfg = LoadConfig("http://x", Profile("burst", count=100), sla=(parse_sla("p50<=1s"),))
    busy = analyse(cfg, recs, [], _facts(wall=1.0, cpu=0.99), None, None)
    assert busy.exit_code() == 2 and "CPU saturated: 99%" in busy.client.reasons[0]
    laggy = analyse(cfg, recs, [], _facts(lags=[0.2] * 100), None, None)
    assert laggy.exit_code() == 2 and "p99 200.0 ms" in laggy.client.reasons[0]
    assert laggy.client.overstated_by_s == pytest.approx(0.2)
    ok = analyse(cfg, recs, [], _facts(), None, None)
    assert ok.exit_code() == 0 and ok.client.trusted


def test_no_response_at_all_means_could_not_start() -> None:
    recs = [_rec(i, 0.001, ok=False, status=0) for i in range(3)]
    for r in recs:
        r.error = "connection refused"
    cfg = LoadConfig("http://x", Profile("burst", count=3))
    res = analyse(cfg, recs, [], _facts(), None, None)
    assert res.exit_code() == 2 and "connection refused" in (res.could_not_start or "")


def test_hdr_percentiles_are_not_rounded_to_two_digits() -> None:
    # locust would report 175..185 ms all as 180 ms; HdrHistogram keeps 3 significant digits
    recs = [_rec(i, 0.175 + 0.001 * (i % 11)) for i in range(1100)]
    cfg = LoadConfig("http://x", Profile("burst", count=1100))
    lat = analyse(cfg, recs, [], _facts(), None, None).summary.latency
    assert lat.p50 == pytest.approx(0.180, abs=0.0002)
    assert lat.p99 == pytest.approx(0.185, abs=0.0002)
    assert lat.max == pytest.approx(0.185) and not math.isnan(lat.mean or math.nan)


def test_load_tool_never_imports_torch_or_the_engine() -> None:
    code = (
        "import sys, tailguard.tools.load.cli, tailguard.tools.load.runner;"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.',"
        " 'tailguard.engine', 'tailguard.server', 'tailguard.model'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_server_histogram_deltas_use_bucket_counts() -> None:
    name = "mistral_inference_latency_seconds"

    def text(ok_fast: int, ok_slow: int, shed: int) -> str:
        lines = ["# TYPE x histogram"]
        for outcome, fast, slow in (("ok", ok_fast, ok_slow), ("overloaded", shed, 0)):
            lab = f'endpoint="infer",outcome="{outcome}"'
            lines += [
                f'{name}_bucket{{{lab},le="0.15"}} {fast}',
                f'{name}_bucket{{{lab},le="0.2"}} {fast + slow // 2} 1700000000000',
                f'{name}_bucket{{{lab},le="+Inf"}} {fast + slow}',
                f"{name}_count{{{lab}}} {fast + slow}",
            ]
        return "\n".join(lines)

    before = parse_histogram(text(100, 0, 0))
    after = parse_histogram(text(190, 10, 50))
    side = compare(before, after, (0.15, 0.18))
    assert side.count == 150 and side.missing_bounds == (0.18,)
    within = {c.bound_s: (c.within, c.share) for c in side.checks}
    assert within[0.15] == (140, pytest.approx(140 / 150))
    assert within[0.2] == (145, pytest.approx(145 / 150))
    # a labelled histogram appears on first use: no series before the run is zero, not an error
    first = compare(parse_histogram(""), after, (0.15,))
    assert first.error is None and first.count == 250
    assert "no mistral_inference_latency_seconds_bucket" in (
        compare(before, parse_histogram(""), ()).error or ""
    )

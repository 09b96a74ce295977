"""`tailguard lab random`: the draw, the truth each run is judged by, the score, and one small
real run (two drawn windows over real sockets) in `make test`."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from tailguard.cli import main
from tailguard.tools.doctor.finding import Cause
from tailguard.tools.doctor.loadreport import LoadSummary
from tailguard.tools.lab.random_lab import KINDS, draw, matrix, score
from tailguard.tools.lab.runner import SideResult, expected_verdict
from tailguard.tools.lab.setups import TailguardServer


def tails(within_sla: float = 1.0, refused: int = 0) -> LoadSummary:
    return LoadSummary(requests=200, ok=200 - refused, failed=refused, refused=refused,
                       p50_s=0.02, p99_s=0.05, max_s=0.06, within_sla=within_sla, slow=0,
                       new_connections=1, known_connection=200, slow_on_new=0,
                       slow_from_connect=0, mean_connect_s=0.001)  # fmt: skip


def test_draw_is_reproducible_and_covers_every_kind() -> None:
    a, b = draw(60, seed=5), draw(60, seed=5)
    assert [c.describe() for c in a] == [c.describe() for c in b]
    assert {c.kind for c in a} == set(KINDS)
    assert [c.describe() for c in draw(60, seed=6)] != [c.describe() for c in a]
    only = draw(10, seed=5, kinds=("gc",))
    assert {c.kind for c in only} == {"gc"} and all(c.standing_risk for c in only)
    with pytest.raises(ValueError, match="unknown kind"):
        draw(1, 1, kinds=("nope",))


def test_drawn_parameters_stay_in_their_ranges() -> None:
    for c in draw(200, seed=9):
        p = dict(c.params)
        if c.kind == "neighbour":
            assert 8 <= c.hogs <= 16
        if c.kind == "churn_cap":
            assert c.setup.envoy is not None
            cap = c.setup.envoy.max_requests_per_connection
            assert cap is not None and 2 <= cap <= 20
        if c.kind.startswith("overload"):
            assert 2.0 <= float(p["offered"].rstrip("x")) <= 3.5
            assert ("--admission" in c.setup.server.flags) == (c.kind == "overload_queue")
        if c.kind == "kv_pool":
            flags = c.setup.server.flags
            blocks = int(flags[flags.index("--simulated-kv-blocks") + 1])
            lo, hi = (int(x) for x in p["prompt"].split(".."))
            longest = -(-(hi + int(p["out"])) // 16)  # blocks of 16 tokens
            mean = -(-((lo + hi) / 2 + int(p["out"])) // 16)
            assert longest < blocks <= max(longest + 1, round(4 * mean))  # a single one fits
            assert c.injected is Cause.KV_EXHAUSTION and c.standing_risk
        if c.kind == "threads":
            assert isinstance(c.setup.server, TailguardServer) and c.setup.server.engine == "real"
            n = int(c.setup.server.flags[c.setup.server.flags.index("--engine-threads") + 1])
            cores = os.cpu_count() or 2
            assert 2 * cores <= n <= 4 * cores  # over the doctor's 1.5x: a standing risk
            assert c.injected is Cause.STARVATION and c.standing_risk


def test_a_small_simulated_kv_pool_really_preempts(tmp_path: Path) -> None:
    """The kv_pool injection is the shipped scheduler and block pool running short: 12 blocks
    (one is the null block: 176 tokens) for 20 generations at once: 20-30 prompt tokens fit
    several sequences, 64 output tokens each outgrow the pool."""
    import sys
    import urllib.request

    from tailguard.tools.doctor.snapshot import parse_prometheus_text
    from tailguard.tools.lab.procs import free_port, serving

    port = free_port()
    cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--engine", "simulated", "--port",
           str(port), "--simulated-kv-blocks", "12", "--admission", "off"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with serving("server", cmd, tmp_path / "server.log", url + "/ready", timeout_s=30):
        rc = main(["load", url, "--endpoint", "completions", "--random-input-len", "20:30",
                   "--random-output-len", "64", "--profile", "burst", "--count", "20",
                   "--quiet", "--max-cpu", "8", "--max-send-lag", "1s"])  # fmt: skip
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            snap = parse_prometheus_text(r.read().decode())
    assert rc == 0  # every request answered
    assert snap.get("tailguard_kv_cache_blocks_total") == 11  # one is the null block
    assert snap.get("tailguard_preemptions_total") > 0


def test_truth_follows_what_the_client_saw() -> None:
    missed, late_refused, met = tails(0.9), tails(1.0, refused=50), tails(1.0)
    assert expected_verdict(Cause.GC, True, missed) is Cause.GC
    assert expected_verdict(Cause.OVERLOAD, False, late_refused) is Cause.OVERLOAD
    assert expected_verdict(Cause.GC, True, met) is Cause.RISK  # a standing hazard, in time
    assert expected_verdict(Cause.NOISY_NEIGHBOUR, False, met) is Cause.NONE
    assert expected_verdict(Cause.NONE, False, missed) is None  # void: the machine's own noise


def test_score_counts_causes_named_on_met_windows() -> None:
    def r(expected: Cause, verdict: Cause, t: LoadSummary, risk: bool = False) -> SideResult:
        return SideResult("r", "k", "x", expected, 1, verdict=verdict, tails=t, standing_risk=risk)

    results = [
        r(Cause.GC, Cause.GC, tails(0.9)),
        r(Cause.CHURN, Cause.RISK, tails(), risk=True),
        r(Cause.NOISY_NEIGHBOUR, Cause.STARVATION, tails()),  # named a cause, SLA was met
        r(Cause.NONE, Cause.UNEXPLAINED, tails(0.8)),  # void
        replace(r(Cause.GC, Cause.GC, tails()), verdict=None, error="boom"),
    ]
    s = score(results)
    assert (s.judged, s.right, s.cause_on_met, s.void, s.failed, s.missed) == (3, 2, 1, 1, 1, 1)
    assert not s.passed
    text = matrix(results)
    assert text.splitlines()[0].startswith("truth \\ named")
    assert any(line.startswith("void") for line in text.splitlines())


def test_lab_random_small_real_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # seed 1 draws one healthy window and one flood against admission control
    rc = main(["lab", "random", "--runs", "2", "--seed", "1", "--kinds",
               "healthy,overload_refuse", "--out", str(tmp_path), "--gap", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "should say overload, said overload" in out
    assert "truth \\ named" in out and "acceptance: met" in out

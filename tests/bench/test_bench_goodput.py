"""bench/bench_goodput.py, small and fast: the whole pipeline runs (oracle sweep with admission
off, open-loop levels with admission on and a baseline admission beside it, `tailguard batch`
on both) and accounts for every request.
A functional test, not a timed one: the targets are measured by the full run (make bench)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "bench_goodput.py"


def test_quick_goodput_run_accounts_for_every_request(tmp_path: Path) -> None:
    out = tmp_path / "goodput.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--server-arg=--engine=simulated"]
    cmd += ["--baseline-arg=--admission-max-request-risk=0"]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: a target missed
    res = json.loads(out.read_text())
    assert set(res["oracle"]) == {"infer", "complete1", "gen16"}
    assert all(v > 0 for v in res["oracle"].values()), res["oracle"]
    assert set(res["levels"]) == {"admission", "baseline"}
    for variant, by_workload in res["levels"].items():
        assert set(by_workload) == {"infer", "complete1", "gen16"}
        for name, levels in by_workload.items():
            assert [lv["factor"] for lv in levels] == [0.5, 2.0], (variant, name)
            for lv in levels:
                assert lv["errors"] == 0, (variant, name, lv)
                assert lv["admitted"] + lv["refused"] == lv["sent"] > 0, (variant, name, lv)
                assert lv["admitted_in_time"] <= lv["admitted"]
    for batch in res["batch"].values():
        assert batch["lost"] == 0 and batch["duplicated"] == 0
        assert batch["ok"] == 300
    assert set(res["batch"]) == {"admission", "baseline"}
    lines = proc.stdout.strip().splitlines()
    tail = lines[-21:]
    assert sum(line.startswith("goodput ") for line in tail) == 6, tail
    assert sum(line.startswith("[baseline] goodput ") for line in tail) == 6, tail
    assert sum(line.startswith("admission / baseline goodput ") for line in tail) == 6, tail
    assert tail[6].startswith("batch 300: makespan"), tail
    assert tail[13].startswith("[baseline] batch 300: makespan"), tail
    assert tail[-1].startswith("admission / baseline batch makespan: "), tail

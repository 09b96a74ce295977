"""bench/bench_goodput.py, small and fast: the whole pipeline runs (oracle sweep with admission
off, open-loop levels with admission on, `tailguard batch`) and accounts for every request.
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
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: a target missed
    res = json.loads(out.read_text())
    assert set(res["oracle"]) == {"infer", "complete1", "gen16"}
    assert all(v > 0 for v in res["oracle"].values()), res["oracle"]
    for name, levels in res["levels"].items():
        assert [lv["factor"] for lv in levels] == [0.5, 2.0], name
        for lv in levels:
            assert lv["errors"] == 0, (name, lv)
            assert lv["admitted"] + lv["refused"] == lv["sent"] > 0, (name, lv)
            assert lv["admitted_in_time"] <= lv["admitted"]
    assert res["batch"]["lost"] == 0 and res["batch"]["duplicated"] == 0
    assert res["batch"]["ok"] == 300
    tail = proc.stdout.strip().splitlines()[-7:]
    assert sum(line.startswith("goodput ") for line in tail) == 6, tail
    assert tail[-1].startswith("batch 300: makespan"), tail

"""Repeat one bench_goodput open-loop level against ONE default server, printing admission's
internals after each run: for a rare state seen once (session 26, infer at 4x the oracle: the
engine ran 7-ms steps of ~5 sequences and goodput fell to 0.83 of the target) that a full run
cannot show twice.

    .venv/bin/python bench/goodput_repeat.py --workload infer --rate 2927 --runs 8

Per run: goodput, refusals, share in time, the engine's steps and cores; then the refusal
reasons, the calibration's excess per prediction size, the step-cost fit and the miss share.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from pathlib import Path

import bench_goodput as bg
from tailguard.tools.lab.procs import free_port, serving

NAMES = (
    "tailguard_admission_refusals_total",
    "tailguard_admission_excess_seconds",
    "tailguard_admission_step_cost_seconds",
    "tailguard_admission_expected_miss_share",
)


def internals(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return [line for line in text.splitlines() if line.startswith(NAMES)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="infer", choices=list(bg.WORKLOADS))
    ap.add_argument("--rate", type=float, required=True, help="requests/s (e.g. 4x the oracle)")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--level-s", type=float, default=10.0)
    ap.add_argument("--sla-ms", type=float, default=150.0)
    ap.add_argument("--no-deadline-header", action="store_true")
    a = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--sla-ms", f"{a.sla_ms:g}"]
    cmd += ["--log-level", "warning", "--port", str(port)]
    log = Path("/tmp") / f"goodput-repeat-{port}.log"
    w = bg.WORKLOADS[a.workload]
    with serving("server", cmd, log, url + "/ready"):
        for i in range(a.runs):
            level = bg.measured_level(
                url, w, a.rate, a.level_s, a.sla_ms / 1e3, 400 + i, not a.no_deadline_header
            )
            lv = bg._run(level)
            print(
                f"run {i}: goodput {lv.goodput:.0f}/s refused {lv.refused}/{lv.sent} in time "
                f"{lv.in_time_share:.2%} {lv.engine}",
                flush=True,
            )
            for line in internals(url):
                print("   ", line)
            time.sleep(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Repeat one bench_goodput open-loop level against ONE default server, printing admission's
internals after each run: for a rare state seen once (session 26, infer at 4x the oracle: the
engine ran 7-ms steps of ~5 sequences and goodput fell to 0.83 of the target) that a full run
cannot show twice.

    .venv/bin/python bench/goodput_repeat.py --workload infer --rate 2927 --runs 8

Per run: goodput, refusals, share in time, the engine's steps and cores; then the refusal
reasons, the calibration's excess per prediction size, the step-cost fit and the miss share.

`--stall-ms X --stall-at-s T[,T2...]` freezes the engine process (SIGSTOP, then SIGCONT X ms
later) T seconds into every run, as a GC pause or a noisy neighbour would, and prints goodput
second by second: whether admission recovers from a stall or stays collapsed after it.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
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


def engine_pid(server_pid: int) -> int:
    """The server's engine process: the server's child."""
    kids = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    if not kids:
        raise SystemExit(f"server {server_pid} has no child process to stall")
    return int(kids[0])


def stall_later(pid: int, at_s: list[float], stall_s: float) -> None:
    """Freeze `pid` for `stall_s` at each of `at_s` seconds from now (in a daemon thread)."""

    def run() -> None:
        start = time.monotonic()
        for t in sorted(at_s):
            time.sleep(max(0.0, start + t - time.monotonic()))
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stall_s)
            os.kill(pid, signal.SIGCONT)

    threading.Thread(target=run, daemon=True).start()


def timeline(lv: bg.OpenLevel, sla_s: float, seconds: float) -> str:
    """In-time answers and refusals per second of intended send time."""
    n = math.ceil(seconds)
    good, refused = [0] * n, [0] * n
    for x in lv.samples:
        k = min(n - 1, int(x.done_s - x.latency_s - lv.start_s))
        if x.status == 200 and x.latency_s <= sla_s:
            good[k] += 1
        elif x.status in bg.REFUSED:
            refused[k] += 1
    return "in time/s " + " ".join(map(str, good)) + " | refused/s " + " ".join(map(str, refused))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="infer", choices=list(bg.WORKLOADS))
    ap.add_argument("--rate", type=float, required=True, help="requests/s (e.g. 4x the oracle)")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--level-s", type=float, default=10.0)
    ap.add_argument("--sla-ms", type=float, default=150.0)
    ap.add_argument("--no-deadline-header", action="store_true")
    ap.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    ap.add_argument("--stall-ms", type=float, default=0.0, help="freeze the engine this long")
    ap.add_argument(
        "--stall-at-s", default="3", help="seconds into each run, comma-separated (e.g. 2,5,8)"
    )
    a = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--sla-ms", f"{a.sla_ms:g}"]
    cmd += ["--log-level", "warning", "--port", str(port), *a.server_arg]
    log = Path("/tmp") / f"goodput-repeat-{port}.log"
    w = bg.WORKLOADS[a.workload]
    stall_at = [float(x) for x in a.stall_at_s.split(",")]
    with serving("server", cmd, log, url + "/ready") as proc:
        engine = engine_pid(proc.popen.pid)
        for i in range(a.runs):
            if a.stall_ms > 0:
                stall_later(engine, stall_at, a.stall_ms / 1e3)
            level = bg.measured_level(
                url, w, a.rate, a.level_s, a.sla_ms / 1e3, 400 + i, not a.no_deadline_header
            )
            lv = bg._run(level)
            print(
                f"run {i}: goodput {lv.goodput:.0f}/s refused {lv.refused}/{lv.sent} in time "
                f"{lv.in_time_share:.2%} {lv.engine}",
                flush=True,
            )
            print("   ", timeline(lv, a.sla_ms / 1e3, a.level_s))
            for line in internals(url):
                print("   ", line)
            time.sleep(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())

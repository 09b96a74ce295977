"""Goodput of admission against the oracle, side by side in one run.

For each workload (`/v1/infer` with varied prompts, one-token `/v1/completions`, 16-token
streamed generations with the deadline on the first token):

1. Oracle: a server with `--admission off`, closed-loop clients at rising concurrency; the
   oracle goodput is the highest throughput whose client-side p99 stays within the SLA.
2. A server with default admission, open-loop (Poisson arrivals, timed from each request's
   intended send time) at 0.5x, 1x, 1.5x, 2x and 4x the oracle rate. Goodput = answers within
   their deadline per second. Target at every level: goodput >= 90% of min(offered, oracle),
   and >= 99% of admitted answers within their deadline.
3. `tailguard batch` on N one-token completions with varied prompts against the default server:
   makespan <= 1.15x the oracle makespan (N / oracle goodput), >= 99% within the SLA, retries
   <= 2% of N, 0 lost, 0 duplicated.

The clients are bench/lean_http.py: at 4x the infer oracle it takes ~90 us of client CPU a
request (0.26 of a core at 2,888/s, JSON bodies and tasks included) where aiohttp took ~190 us
(0.48 at 2,549/s) and lagged its own sends by 35-80 ms at p99 (the server's TTFT was in time
where the client's was not). Every prompt is different (8-60 words), so the degradation
cache never answers. Each request propagates its deadline as `X-Request-Timeout-Ms`: the SLA
less the client's own send lag, as a client that holds a deadline does (`tailguard load
--deadline`); `--no-deadline-header` turns it off and `--baseline-no-deadline-header` runs the
baseline server without it, level by level.
The load client runs on the same machine, as it did for the oracle: its CPU is part of the
budget of both.
The last lines are the ratios.

    .venv/bin/python bench/bench_goodput.py                  # the embedded model, ~8 minutes
    .venv/bin/python bench/bench_goodput.py --quick --server-arg=--engine=simulated   # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench_batch import _run, run_tailguard
from lean_http import LeanSession
from tailguard.tools.batch.report import percentile
from tailguard.tools.lab.procs import free_port, serving
from tailguard.tools.load.server_metrics import HistogramSnapshot, parse_histogram

WORDS = (  # noqa: SIM905 (a sentence reads better than 41 quoted words)
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone "
    "cloud forest ember harbor lantern meadow orbit prism quartz summit thunder valley willow"
).split()
REFUSED = (429, 503)


@dataclass(frozen=True)
class Workload:
    name: str
    path: str
    stream: bool  # deadline on the first streamed bytes (the first token), not the whole answer
    body: Callable[[random.Random, int], dict[str, Any]]


def _prompt(rng: random.Random, i: int, lo: int = 8, hi: int = 60) -> str:
    words = rng.choices(WORDS, k=rng.randint(lo, hi))
    return f"{i} " + " ".join(words)  # the index makes every prompt distinct


WORKLOADS = {
    "infer": Workload(
        "infer", "/v1/infer", False, lambda r, i: {"prompt": _prompt(r, i), "top_k": 1}
    ),
    "complete1": Workload(
        "complete1",
        "/v1/completions",
        False,
        lambda r, i: {"prompt": _prompt(r, i), "max_tokens": 1, "temperature": 0},
    ),
    "gen16": Workload(
        "gen16",
        "/v1/completions",
        True,
        lambda r, i: {
            "prompt": _prompt(r, i, 24, 24),  # ~32 tokens
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": True,
        },
    ),
}


@dataclass
class Sample:
    status: int  # 0: connection error or timeout
    latency_s: float  # intended send -> deadline event (answer, or first streamed bytes)
    done_s: float  # monotonic time the deadline event happened
    send_lag_s: float = 0.0  # intended send -> the client's task started sending (its own lag)


async def _send(
    s: LeanSession,
    path: str,
    body: bytes,
    stream: bool,
    t0: float,
    out: list[Sample],
    deadline_s: float | None,
) -> None:
    lag = time.monotonic() - t0
    headers = None
    if deadline_s is not None:  # the budget left after the client's own lag, at least 1 ms
        headers = {"X-Request-Timeout-Ms": f"{max(1.0, (deadline_s - lag) * 1e3):.0f}"}
    try:
        status, first, end = await s.post(path, body, headers)
        t_event = first if stream and status == 200 else end
        out.append(Sample(status, t_event - t0, t_event, lag))
    except (TimeoutError, OSError):
        t = time.monotonic()
        out.append(Sample(0, t - t0, t, lag))


def pct(values: list[float], q: float) -> float:
    return percentile(sorted(values), q)


# ---- 1. the oracle ----------------------------------------------------------------------------
@dataclass
class Level:
    concurrency: int
    throughput: float  # answers per second
    p99_ms: float
    errors: int


ENGINE_STEP = "tailguard_engine_step_seconds"
BATCH_SIZE = "tailguard_batch_size"
INTAKE_WAIT = "tailguard_intake_wait_seconds"
LOOP_LAG = "tailguard_event_loop_lag_seconds"


CPU_SECONDS = "tailguard_process_cpu_seconds_total{"


@dataclass
class Scrape:
    """One GET of the server's /metrics: some histograms, its CPU seconds by process (http,
    engine), and the load client's own CPU seconds and the clock when it was taken."""

    hist: dict[str, HistogramSnapshot]
    cpu: dict[str, float]
    client_cpu_s: float
    t_s: float


async def scrape(url: str, names: tuple[str, ...]) -> Scrape:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s,
        s.get(url) as r,
    ):
        text = await r.text()
    cpu = {}
    for line in text.splitlines():
        if line.startswith(CPU_SECONDS):
            label = line.split('process="', 1)[1].split('"', 1)[0]
            cpu[label] = float(line.rsplit(None, 1)[1])
    hist = {n: parse_histogram(text, n) for n in names}
    return Scrape(hist, cpu, time.process_time(), time.monotonic())


@dataclass
class EngineWindow:
    """What the engine and the processes did between two scrapes."""

    busy: float = math.nan  # share of the window's wall time the engine spent in steps
    step_ms: float = math.nan  # mean engine step
    seqs_per_step: float = math.nan  # mean sequences per engine step
    cores: str = ""  # cores used, by process: the server's and the load client

    @classmethod
    def between(cls, a: Scrape, b: Scrape, idle_s: float = 0.0) -> EngineWindow:
        """`idle_s`: pauses inside the window not to count as the engine's wall time."""
        wall = b.t_s - a.t_s
        cores = " ".join(f"{k} {(b.cpu[k] - a.cpu.get(k, 0.0)) / wall:.2f}" for k in sorted(b.cpu))
        w = cls(cores=f"{cores} client {(b.client_cpu_s - a.client_cpu_s) / wall:.2f}")
        step0, step1 = a.hist[ENGINE_STEP], b.hist[ENGINE_STEP]
        steps = step1.count - step0.count
        if steps > 0:
            busy = step1.sum - step0.sum
            w.busy, w.step_ms = busy / (wall - idle_s), busy / steps * 1e3
            w.seqs_per_step = (b.hist[BATCH_SIZE].sum - a.hist[BATCH_SIZE].sum) / steps
        return w

    def __str__(self) -> str:
        return (
            f"engine busy {self.busy:.0%} ({self.step_ms:.1f} ms steps of "
            f"{self.seqs_per_step:.1f} seqs), cores: {self.cores}"
        )


async def closed_loop(
    base: str, w: Workload, conc: int, seconds: float, seed: int, warm_s: float = 0.5
) -> tuple[list[float], int]:
    """One closed-loop run: the latencies of the answers inside the window, and the errors."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    start = time.monotonic()
    window = (start + warm_s, start + warm_s + seconds)
    counter = iter(range(seed * 10**6, 10**12))

    async def worker(s: LeanSession) -> None:
        while (t0 := time.monotonic()) < window[1]:
            body = json.dumps(w.body(rng, next(counter))).encode()
            await _send(s, w.path, body, w.stream, t0, samples, None)

    async with LeanSession(base) as s:
        await asyncio.gather(*(worker(s) for _ in range(conc)))
    inside = [x for x in samples if window[0] <= x.done_s <= window[1]]
    ok = [x.latency_s for x in inside if x.status == 200]
    return ok, len(inside) - len(ok)


async def measure_level(
    base: str, w: Workload, conc: int, seconds: float, repeats: int, gap_s: float
) -> Level:
    """`repeats` runs of `seconds` at one concurrency, a pause between them, pooled: one short
    run's p99 is its few slowest answers, and the oracle swung 51% between two runs with one
    run per level (session 17). Throughput is the pooled answers over the pooled time."""
    ok: list[float] = []
    errors = 0
    first = await scrape(base + "/metrics", (ENGINE_STEP, BATCH_SIZE))
    for r in range(repeats):
        if r:
            await asyncio.sleep(gap_s)
        got, bad = await closed_loop(base, w, conc, seconds, seed=conc * 100 + r)
        ok += got
        errors += bad
    last = await scrape(base + "/metrics", (ENGINE_STEP, BATCH_SIZE))
    print(f"      {EngineWindow.between(first, last, gap_s * (repeats - 1))}", flush=True)
    return Level(conc, len(ok) / (seconds * repeats), pct(ok, 99) * 1e3, errors)


async def oracle_sweep(
    base: str,
    w: Workload,
    sla_s: float,
    seconds: float,
    levels: list[int],
    repeats: int = 2,
    gap_s: float = 1.0,
) -> tuple[float, list[Level]]:
    found: list[Level] = []
    for conc in levels:
        lv = await measure_level(base, w, conc, seconds, repeats, gap_s)
        found.append(lv)
        print(
            f"    concurrency {conc:4d}: {lv.throughput:7.1f} answers/s  p99 {lv.p99_ms:7.1f} ms"
            f"  errors {lv.errors}",
            flush=True,
        )
        if lv.p99_ms > 2 * sla_s * 1e3:
            break
    good = [lv.throughput for lv in found if lv.p99_ms <= sla_s * 1e3 and lv.errors == 0]
    return max(good, default=0.0), found


# ---- 2. admission on, open loop ---------------------------------------------------------------
@dataclass
class OpenLevel:
    factor: float
    offered: float  # requests per second sent
    sent: int
    goodput: float  # answers within the deadline per second
    refused: int
    errors: int  # neither an answer nor a refusal
    admitted: int
    admitted_in_time: int
    admitted_p99_ms: float
    refusal_p99_ms: float
    target_goodput: float = 0.0
    # the server's own view of the level: admitted requests' actual / planned time (the
    # calibrated bound), as bucket upper bounds of its histogram's p50 / p90 / p99
    ratio_p50: float = math.nan
    ratio_p90: float = math.nan
    ratio_p99: float = math.nan
    send_lag_p99_ms: float = math.nan  # the load client's own lag before sending
    server_in_time: float = math.nan  # stream: share of the server's TTFT (read -> first token
    # taken by the handler) within the SLA; the rest of the client's lateness is outside it
    intake_p99_s: float = math.nan  # server: socket read -> parsed, p99 (a bucket bound)
    loop_lag_p99_s: float = math.nan  # server: HTTP event-loop lag, p99 (a bucket bound)
    engine: EngineWindow = field(default_factory=EngineWindow)
    error_statuses: dict[int, int] = field(default_factory=dict)  # 0: no HTTP answer
    samples: list[Sample] = field(default_factory=list, repr=False)  # every request, for timelines
    start_s: float = 0.0  # monotonic time of the first intended send

    @property
    def goodput_share(self) -> float:
        return self.goodput / self.target_goodput if self.target_goodput else math.nan

    @property
    def in_time_share(self) -> float:
        return self.admitted_in_time / self.admitted if self.admitted else 1.0

    @property
    def met(self) -> bool:
        return self.goodput >= 0.9 * self.target_goodput and self.in_time_share >= 0.99


async def open_loop(
    base: str, w: Workload, rate: float, seconds: float, sla_s: float, seed: int, propagate: bool
) -> OpenLevel:
    rng = random.Random(seed)
    samples: list[Sample] = []
    tasks: list[asyncio.Task[None]] = []
    n = max(1, int(rate * seconds))
    async with LeanSession(base) as s:
        t = start = time.monotonic()
        for i in range(n):
            t += rng.expovariate(rate)
            delay = t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            body = json.dumps(w.body(rng, i)).encode()
            deadline = sla_s if propagate else None
            tasks.append(
                asyncio.create_task(_send(s, w.path, body, w.stream, t, samples, deadline))
            )
        await asyncio.gather(*tasks)
    span = max(seconds, t - start)
    ok = [x.latency_s for x in samples if x.status == 200]
    refused = [x.latency_s for x in samples if x.status in REFUSED]
    in_time = sum(x <= sla_s for x in ok)
    return OpenLevel(
        factor=0.0,
        offered=n / span,
        sent=n,
        goodput=in_time / span,
        refused=len(refused),
        errors=len(samples) - len(ok) - len(refused),
        admitted=len(ok),
        admitted_in_time=in_time,
        admitted_p99_ms=pct(ok, 99) * 1e3,
        refusal_p99_ms=pct(refused, 99) * 1e3,
        send_lag_p99_ms=pct([x.send_lag_s for x in samples], 99) * 1e3,
        error_statuses=dict(
            Counter(x.status for x in samples if x.status != 200 and x.status not in REFUSED)
        ),
        samples=samples,
        start_s=start,
    )


# ---- report -----------------------------------------------------------------------------------
PREDICTION_RATIO = "tailguard_admission_prediction_ratio"
SERVER_TTFT = "tailguard_time_to_first_token_seconds"


def ratio_quantiles(
    before: HistogramSnapshot, after: HistogramSnapshot, qs: tuple[float, ...] = (0.5, 0.9, 0.99)
) -> list[float]:
    """Upper bounds of the buckets holding each quantile of the level's own samples (after -
    before): "p99 <= 0.75" says admission planned for at least 1.33x what its admitted requests
    took (it refused work that fitted); above 1, it was optimistic."""
    n = after.count - before.count
    if n <= 0 or after.error or before.error:
        return [math.nan for _ in qs]
    bounds = sorted(after.buckets)
    cum = [after.buckets[b] - before.buckets.get(b, 0.0) for b in bounds]
    return [next(b for b, c in zip(bounds, cum, strict=True) if c >= q * n) for q in qs]


async def measured_level(
    base: str, w: Workload, rate: float, seconds: float, sla_s: float, seed: int, propagate: bool
) -> OpenLevel:
    """`open_loop`, with the server's histograms, CPU and engine steps scraped around it."""
    url = base + "/metrics"
    names = (PREDICTION_RATIO, SERVER_TTFT, ENGINE_STEP, BATCH_SIZE, INTAKE_WAIT, LOOP_LAG)
    a = await scrape(url, names)
    lv = await open_loop(base, w, rate, seconds, sla_s, seed, propagate)
    b = await scrape(url, names)
    first, last = a.hist, b.hist
    lv.engine = EngineWindow.between(a, b)
    ttft0, ttft1 = first[SERVER_TTFT], last[SERVER_TTFT]
    lv.ratio_p50, lv.ratio_p90, lv.ratio_p99 = ratio_quantiles(
        first[PREDICTION_RATIO], last[PREDICTION_RATIO]
    )
    (lv.intake_p99_s,) = ratio_quantiles(first[INTAKE_WAIT], last[INTAKE_WAIT], (0.99,))
    (lv.loop_lag_p99_s,) = ratio_quantiles(first[LOOP_LAG], last[LOOP_LAG], (0.99,))
    n = ttft1.count - ttft0.count
    if w.stream and n > 0 and sla_s in ttft1.buckets:
        lv.server_in_time = (ttft1.buckets[sla_s] - ttft0.buckets.get(sla_s, 0.0)) / n
    return lv


def print_levels(w: Workload, oracle: float, levels: list[OpenLevel]) -> None:
    print(f"  {w.name}: oracle {oracle:.1f}/s")
    print(
        "    factor  offered/s  goodput/s  target/s  share   refused  admitted  in time  "
        "adm p99 ms  refusal p99 ms  errors  actual/planned p50 p90 p99"
    )
    for lv in levels:
        print(
            f"    {lv.factor:5.1f}x  {lv.offered:9.1f}  {lv.goodput:9.1f}  {lv.target_goodput:8.1f}"
            f"  {lv.goodput_share:5.2f}  {lv.refused / lv.sent:7.1%}  {lv.admitted:8d}"
            f"  {lv.in_time_share:7.2%}  {lv.admitted_p99_ms:10.1f}  {lv.refusal_p99_ms:14.1f}"
            f"  {lv.errors:6d}  {lv.ratio_p50:5.2f} {lv.ratio_p90:5.2f} {lv.ratio_p99:5.2f}"
        )


def _batch_line(batch: Any, n: int, oracle: float, sla_s: float) -> tuple[str, bool]:
    ideal = n / oracle if oracle else math.inf
    within = sum(x <= sla_s for x in batch.latencies_s) / n
    retries = batch.retries or 0
    met = (
        batch.makespan_s <= 1.15 * ideal
        and within >= 0.99
        and retries <= 0.02 * n
        and batch.lost == 0
        and batch.duplicated == 0
    )
    return (
        f"batch {n}: makespan {batch.makespan_s:.2f} s / oracle {ideal:.2f} s = "
        f"{batch.makespan_s / ideal:.3f}x (target <= 1.15x), within SLA {within:.2%}, "
        f"retries {retries} ({retries / n:.2%}, target <= 2%), lost {batch.lost}, "
        f"duplicated {batch.duplicated}: {'met' if met else 'MISSED'}"
    ), met


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="infer,complete1,gen16")
    ap.add_argument("--sla-ms", type=float, default=150.0)
    ap.add_argument("--factors", default="0.5,1,1.5,2,4", help="open-loop rates x the oracle")
    ap.add_argument("--level-s", type=float, default=10.0, help="seconds per open-loop level")
    ap.add_argument("--sweep-s", type=float, default=3.0, help="seconds per oracle level")
    ap.add_argument(
        "--sweep", default="1,2,4,6,8,12,16,20,24,32,48,64,96,128", help="concurrencies"
    )
    ap.add_argument("--sweep-repeats", type=int, default=2, help="runs pooled per oracle level")
    ap.add_argument("--batch-requests", type=int, default=10_000)
    ap.add_argument("--gap-s", type=float, default=3.0, help="pause between levels")
    ap.add_argument("--quick", action="store_true", help="a seconds-long functional run")
    ap.add_argument("--server-arg", action="append", default=[], help="extra serve argument")
    ap.add_argument(
        "--baseline-arg",
        action="append",
        default=[],
        help="serve argument of a second admission server run level by level beside the "
        "default one (e.g. --baseline-arg=--admission-max-request-risk=0); ratios printed",
    )
    ap.add_argument(
        "--baseline-src",
        help="run the baseline server from this checkout's src/ (e.g. a git worktree of main): "
        "an A/B of code, not of settings; combine with --baseline-arg or alone",
    )
    ap.add_argument(
        "--oracle",
        default="",
        help="skip the sweep and take these oracle rates (e.g. infer=89.5,complete1=80.8): "
        "for quick experiments; a reported run measures them",
    )
    ap.add_argument(
        "--no-deadline-header",
        action="store_true",
        help="clients send no X-Request-Timeout-Ms (the server then counts the SLA from arrival)",
    )
    ap.add_argument(
        "--baseline-no-deadline-header",
        action="store_true",
        help="a baseline server (same flags unless --baseline-arg) whose clients send no "
        "deadline header: an A/B of deadline propagation",
    )
    ap.add_argument("--json", type=Path, help="also write every figure here")
    a = ap.parse_args()
    if a.quick:
        a.factors, a.level_s, a.sweep_s, a.sweep = "0.5,2", 1.5, 1.0, "2,8,32"
        a.sweep_repeats = 1
        a.batch_requests, a.gap_s = min(a.batch_requests, 300), 0.2
    sla_s = a.sla_ms / 1e3
    factors = [float(x) for x in a.factors.split(",")]
    workloads = [WORKLOADS[x] for x in a.workloads.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    serve = [sys.executable, "-m", "tailguard.cli", "serve", "--sla-ms", f"{a.sla_ms:g}"]
    serve += ["--log-level", "warning", *a.server_arg]

    def server(name: str, *flags: str) -> Any:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [*serve, "--port", str(port), *flags]
        env = None
        if name == "baseline" and a.baseline_src:
            src = str(Path(a.baseline_src).resolve())
            env = {"PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        return serving(name, cmd, logs / f"{name}.log", url + "/ready", env=env), url

    oracles: dict[str, float] = {}
    print(
        f"1. oracle: --admission off, closed loop, {a.sweep_repeats} x {a.sweep_s:g} s per level",
        flush=True,
    )
    oracles.update({k: float(v) for k, v in (x.split("=") for x in a.oracle.split(",") if x)})
    ctx, base = server("oracle", "--admission", "off")
    with ctx if len(oracles) < len(workloads) else contextlib.nullcontext():
        for w in (w for w in workloads if w.name not in oracles):
            print(f"  {w.name} ({w.path}{', stream, deadline on the first token' * w.stream})")
            sweep = [int(x) for x in a.sweep.split(",")]
            oracles[w.name], _ = _run(
                oracle_sweep(base, w, sla_s, a.sweep_s, sweep, a.sweep_repeats)
            )
            print(f"    oracle goodput {oracles[w.name]:.1f}/s", flush=True)
            time.sleep(a.gap_s)

    ab = bool(a.baseline_arg or a.baseline_src or a.baseline_no_deadline_header)
    propagate = {
        "admission": not a.no_deadline_header,
        "baseline": not (a.no_deadline_header or a.baseline_no_deadline_header),
    }
    variants = {"admission": []} | ({"baseline": a.baseline_arg} if ab else {})
    results: dict[str, dict[str, list[OpenLevel]]] = {v: {} for v in variants}
    batches: dict[str, Any] = {}
    print(
        f"2. default admission, open loop, {a.level_s:g} s per level, deadline header "
        f"{'off' if a.no_deadline_header else 'on'}",
        flush=True,
    )
    if ab:
        what = " ".join(
            [
                *a.baseline_arg,
                *([f"src {a.baseline_src}"] if a.baseline_src else []),
                *(["no deadline header"] if a.baseline_no_deadline_header else []),
            ]
        )
        print(f"   baseline: admission with {what}, level by level beside it")
    with contextlib.ExitStack() as stack:
        bases = {}
        for v, flags in variants.items():
            ctx, bases[v] = server(v, *flags)
            stack.enter_context(ctx)
        level = 0
        for w in workloads:
            for f in factors:
                rate = max(1.0, f * oracles[w.name])
                # ABBA: the variants' order flips every level, so that neither always runs
                # right after the other (gen16 at 2x had read 0.91-0.97 of the baseline in five
                # runs over sessions 34-35, the admission side always first)
                order = list(bases.items())
                level += 1
                for v, base in order[:: -1 if level % 2 == 0 else 1]:
                    lv = _run(
                        measured_level(base, w, rate, a.level_s, sla_s, int(f * 100), propagate[v])
                    )
                    lv.factor = f
                    lv.target_goodput = min(lv.offered, oracles[w.name])
                    results[v].setdefault(w.name, []).append(lv)
                    print(
                        f"    {v} {w.name} {f:g}x: offered {lv.offered:.0f}/s goodput "
                        f"{lv.goodput:.0f}/s refused {lv.refused}/{lv.sent}, actual/planned "
                        f"p50 {lv.ratio_p50:g} p90 {lv.ratio_p90:g} p99 {lv.ratio_p99:g}"
                        + (f", server TTFT in time {lv.server_in_time:.2%}" * w.stream)
                        + f", client send lag p99 {lv.send_lag_p99_ms:.1f} ms"
                        + (f", errors by status {lv.error_statuses}" * bool(lv.errors))
                        + f", server intake p99 <= {lv.intake_p99_s * 1e3:g} ms, loop lag p99"
                        f" <= {lv.loop_lag_p99_s * 1e3:g} ms" + f", {lv.engine}",
                        flush=True,
                    )
                    time.sleep(a.gap_s)
        if "complete1" in oracles and a.batch_requests:
            n = a.batch_requests
            rng = random.Random(7)
            bodies = [WORKLOADS["complete1"].body(rng, i) for i in range(n)]
            body = {"prompt": "batch job", "max_tokens": 1, "temperature": 0}
            for v, base in bases.items():
                print(f"3. tailguard batch ({v}): {n} one-token completions", flush=True)
                with tempfile.TemporaryDirectory() as tmp:
                    batches[v] = run_tailguard(
                        base, n, body, a.sla_ms, Path(tmp), path="/v1/completions", bodies=bodies
                    )
                time.sleep(a.gap_s)

    lines = []
    ok = True
    for v in variants:
        print(f"\nsummary, {v} (client-side times, from each request's intended send time)")
        for w in workloads:
            print_levels(w, oracles[w.name], results[v][w.name])
    for v in variants:
        tag = "" if v == "admission" else f"[{v}] "
        for w in workloads:
            for lv in results[v][w.name]:
                lines.append(
                    f"{tag}goodput {w.name} {lv.factor:g}x: {lv.goodput_share:.3f} of "
                    f"min(offered, oracle) (target >= 0.90), admitted in time "
                    f"{lv.in_time_share:.2%} (target >= 99%): {'met' if lv.met else 'MISSED'}"
                )
        batch_ok = True
        if v in batches:
            line, batch_ok = _batch_line(batches[v], a.batch_requests, oracles["complete1"], sla_s)
            lines.append(tag + line)
        if v == "admission":
            ok = batch_ok and all(lv.met for lvs in results[v].values() for lv in lvs)
    if ab:
        for w in workloads:
            pairs = zip(results["admission"][w.name], results["baseline"][w.name], strict=True)
            for x, y in pairs:
                ratio = x.goodput / y.goodput if y.goodput else math.inf
                lines.append(
                    f"admission / baseline goodput {w.name} {x.factor:g}x: {ratio:.3f} "
                    f"(in time {x.in_time_share:.2%} vs {y.in_time_share:.2%})"
                )
        if len(batches) == 2:
            x, y = batches["admission"], batches["baseline"]
            lines.append(
                f"admission / baseline batch makespan: {x.makespan_s / y.makespan_s:.3f} "
                f"(retries {x.retries} vs {y.retries})"
            )
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "oracle": oracles,
                    "levels": {
                        v: {k: [asdict(x) for x in lv] for k, lv in r.items()}
                        for v, r in results.items()
                    },
                    "batch": {v: vars(b) | {"latencies_s": None} for v, b in batches.items()},
                },
                default=str,
                indent=1,
            )
        )
    print()
    for line in lines:
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

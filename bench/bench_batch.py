"""`tailguard batch` against the runbook's orchestrator, side by side, on one server.

1. Measure the server's peak goodput: closed-loop clients at doubling concurrency, counting
   only responses that succeeded within the SLA; the best level (refined around it) is the
   peak. The ideal makespan of the job is N / peak.
2. Run the N-request /v1/infer job with `tailguard batch` (a real process, as a user runs it)
   and check the output: every custom_id exactly once.
3. Run the runbook's way: all N requests through one `asyncio.gather`, each taking a token from
   an 8,000/s bucket first (a rate limit, not a concurrency limit), no retries.

Prints both side by side; the last line is tailguard's makespan as a ratio to the ideal.

    .venv/bin/python bench/bench_batch.py                  # self-contained: local sim server
    .venv/bin/python bench/bench_batch.py --url http://127.0.0.1:8000   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from tailguard.tools.batch.limiter import TokenBucket
from tailguard.tools.batch.report import percentile

T = TypeVar("T")
SIM_ARGS = ["--slots", "32", "--service-ms", "25", "--growth", "0.5", "--max-in-flight", "256"]


# Durations use time.monotonic(), as the runner does: uvloop's loop.time() has millisecond
# resolution and is cached per loop iteration. The bench's own clients run on uvloop too, like
# the runner, so the peak is not understated by a slower client.


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


@dataclass
class Level:
    concurrency: int
    goodput: float  # in-SLA successes per second
    throughput: float  # successes per second
    p99_ms: float
    rejected: int


@dataclass
class Result:
    name: str
    makespan_s: float
    ok: int = 0
    lost: int = 0
    duplicated: int = 0
    latencies_s: list[float] = field(default_factory=list)  # successful requests
    retries: int | None = None
    statuses: Counter[str] = field(default_factory=Counter)


def unique_body(template: dict[str, object], tag: str, i: int) -> dict[str, object]:
    """The template with a prompt no other request of the bench uses: a server that caches
    or coalesces identical prompts would otherwise answer from its cache, and the "peak" and
    the job would measure the cache, not the server."""
    body = dict(template)
    if isinstance(body.get("prompt"), str):
        body["prompt"] = f"{body['prompt']} ({tag} {i})"
    elif isinstance(ids := body.get("input_ids"), list):
        body["input_ids"] = [
            *ids,
            *(1000 + int(d) for d in f"{i}"),
            sum(map(ord, tag)) % 997 + 2,
        ]
    return body


# ---- 1. peak goodput ----------------------------------------------------------------------
async def _closed_loop(
    url: str, template: dict[str, object], conc: int, seconds: float, sla_s: float
) -> Level:
    lat: list[float] = []
    good = ok = rejected = sent = 0
    warm_end = time.monotonic() + 0.3  # let the level settle before counting
    end = warm_end + seconds
    headers = {"Content-Type": "application/json"}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal good, ok, rejected
        nonlocal sent
        while (t0 := time.monotonic()) < end:
            sent += 1
            body = json.dumps(unique_body(template, f"sweep-c{conc}", sent)).encode()
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, TimeoutError, OSError):
                status = 0
            t1 = time.monotonic()
            if status == 503:
                await asyncio.sleep(0.01)  # do not spin on refusals
            if not warm_end <= t1 <= end:  # completions inside the window, whenever sent
                continue
            if 200 <= status < 300:
                ok += 1
                lat.append(t1 - t0)
                good += (t1 - t0) <= sla_s
            else:
                rejected += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(conc)))
    lat.sort()
    return Level(conc, good / seconds, ok / seconds, percentile(lat, 99) * 1000, rejected)


async def peak_goodput(
    url: str, body: dict[str, object], sla_s: float, seconds: float
) -> list[Level]:
    levels: list[Level] = []
    conc = 1
    while conc <= 1024:
        lv = await _closed_loop(url, body, conc, seconds, sla_s)
        levels.append(lv)
        print(
            f"  concurrency {conc:5d}: goodput {lv.goodput:8.1f}/s  throughput "
            f"{lv.throughput:8.1f}/s  p99 {lv.p99_ms:7.1f} ms  rejected {lv.rejected}",
            flush=True,
        )
        best = max(x.goodput for x in levels)
        if lv.goodput < 0.5 * best and len(levels) > 2:
            break  # past the peak: latency is over the SLA or the server refuses
        conc *= 2
    # Refine between the best level and its neighbours.
    best_lv = max(levels, key=lambda x: x.goodput)
    for c in (int(best_lv.concurrency * 0.75), int(best_lv.concurrency * 1.5)):
        if c > 1 and all(x.concurrency != c for x in levels):
            lv = await _closed_loop(url, body, c, seconds, sla_s)
            levels.append(lv)
            print(f"  concurrency {c:5d}: goodput {lv.goodput:8.1f}/s (refinement)", flush=True)
    return levels


# ---- 2. tailguard batch -------------------------------------------------------------------
def run_tailguard(
    base_url: str,
    n: int,
    body: dict[str, object],
    sla_ms: float,
    tmp: Path,
    path: str = "/v1/infer",
    bodies: list[dict[str, Any]] | None = None,
) -> Result:
    """`tailguard batch` on n requests to `path`: `bodies`, else `body` with distinct prompts."""
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    with inp.open("w") as f:
        for i in range(n):
            line = {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": path,
                "body": bodies[i] if bodies is not None else unique_body(body, "job", i),
            }
            f.write(json.dumps(line) + "\n")
    summary_path = tmp / "summary.json"
    cmd = [
        sys.executable, "-m", "tailguard.cli", "batch", str(inp), "--output", str(out),
        "--endpoint", base_url, "--sla-ms", f"{sla_ms:g}", "--no-progress",
        "--summary-json", str(summary_path),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    print(proc.stdout, end="")
    if proc.returncode not in (0, 1):
        print(proc.stderr, file=sys.stderr)
        raise SystemExit(f"tailguard batch failed with exit code {proc.returncode}")
    s = json.loads(summary_path.read_text())
    ids = Counter(json.loads(x)["custom_id"] for x in out.read_text().splitlines())
    res = Result("tailguard batch", makespan_s=s["makespan_s"], retries=s["retries"])
    res.ok = len(ids)
    res.lost = n - len(ids)
    res.duplicated = sum(ids.values()) - len(ids)
    # Per-request latencies from the ledger's record of the successful attempt.
    db = sqlite3.connect(str(out) + ".ledger.sqlite")
    res.latencies_s = [r[0] / 1000 for r in db.execute("SELECT latency_ms FROM results WHERE ok")]
    db.close()
    res.statuses = Counter({k: v for k, v in s["retry_reasons"].items()})
    print(f"  (process wall time incl. Python start-up: {wall:.2f} s)")
    return res


# ---- 3. the runbook's way -----------------------------------------------------------------
async def run_runbook(
    url: str, n: int, template: dict[str, object], rate: float, timeout_s: float
) -> Result:
    bucket = TokenBucket(rate, now=time.monotonic())
    res = Result("runbook (gather + 8000/s)", makespan_s=0.0)
    headers = {"Content-Type": "application/json"}

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = json.dumps(unique_body(template, "runbook", i)).encode()
        delay = bucket.reserve(time.monotonic())
        if delay > 0:
            await asyncio.sleep(delay)
        t0 = time.monotonic()
        try:
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                status = str(r.status)
        except TimeoutError:
            status = "timeout"
        except (aiohttp.ClientError, OSError) as exc:
            status = type(exc).__name__
        res.statuses[status] += 1
        if status.startswith("2"):
            res.ok += 1
            res.latencies_s.append(time.monotonic() - t0)

    # As the runbook's client: no connection cap, so all N are on the wire at once.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(one(session, i) for i in range(n)))
    res.makespan_s = time.monotonic() - t0
    res.lost = n - res.ok  # no retries: a refused or failed request is a lost result
    return res


# ---- report -------------------------------------------------------------------------------
def side_by_side(results: list[Result], n: int, ideal_s: float, sla_s: float) -> None:
    def row(label: str, values: list[str]) -> None:
        print(f"  {label:<28}" + "".join(f"{v:>30}" for v in values))

    row("", [r.name for r in results])
    row("makespan s", [f"{r.makespan_s:.2f}" for r in results])
    row("makespan / ideal", [f"{r.makespan_s / ideal_s:.3f}x" for r in results])
    row("results kept", [f"{r.ok} of {n}" for r in results])
    row("lost", [str(r.lost) for r in results])
    row("duplicated", [str(r.duplicated) for r in results])
    row(
        "goodput (in SLA)/s",
        [f"{sum(x <= sla_s for x in r.latencies_s) / r.makespan_s:.0f}" for r in results],
    )
    for q in (50, 99):
        row(
            f"latency p{q} ms (kept)",
            [f"{percentile(sorted(r.latencies_s), q) * 1000:.1f}" for r in results],
        )
    row(
        "latency max ms (kept)",
        [f"{max(r.latencies_s, default=math.nan) * 1000:.1f}" for r in results],
    )
    row(
        f"within SLA ({sla_s * 1000:g} ms), of N",
        [f"{sum(x <= sla_s for x in r.latencies_s) / n * 100:.2f}%" for r in results],
    )
    row(
        "retries", [str(r.retries) if r.retries is not None else "none (no retry)" for r in results]
    )
    row(
        "outcomes",
        [", ".join(f"{k}:{v}" for k, v in r.statuses.most_common(4)) or "-" for r in results],
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="base URL of a running server; omit to start the sim server")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--sla-ms", type=float, default=150.0)
    p.add_argument("--level-s", type=float, default=2.0, help="seconds per sweep level")
    p.add_argument("--runbook-rate", type=float, default=8000.0)
    p.add_argument(
        "--body",
        default='{"prompt": "The quick brown fox", "top_k": 5}',
        help="request body template; every request gets its own prompt (no cache hits)",
    )
    p.add_argument("--gap-s", type=float, default=5.0, help="pause between phases")
    p.add_argument("--skip-runbook", action="store_true")
    p.add_argument(
        "--sim-args", default=" ".join(SIM_ARGS), help="sim server options (self-contained mode)"
    )
    a = p.parse_args()
    body_obj = json.loads(a.body)
    sla_s = a.sla_ms / 1000

    with contextlib.ExitStack() as stack:
        base = a.url
        if base is None:
            sim_args = a.sim_args.split()
            sim = subprocess.Popen(
                [sys.executable, "-m", "tailguard.tools.batch.simserver", "--port", "0", *sim_args],
                stdout=subprocess.PIPE,
                text=True,
            )
            stack.callback(sim.wait)
            stack.callback(sim.kill)
            assert sim.stdout is not None
            base = sim.stdout.readline().split()[-1]
            print(f"sim server {' '.join(sim_args)} at {base}")
        base = base.rstrip("/")
        url = base + "/v1/infer"
        print(f"1. peak goodput of {url} (SLA {a.sla_ms:g} ms, {a.level_s:g} s per level)")
        levels = _run(peak_goodput(url, body_obj, sla_s, a.level_s))
        peak = max(levels, key=lambda x: x.goodput)
        ideal = a.requests / peak.goodput
        print(
            f"   peak goodput {peak.goodput:.1f}/s at concurrency {peak.concurrency}; "
            f"ideal makespan for {a.requests} requests: {ideal:.2f} s"
        )
        time.sleep(a.gap_s)
        print(f"2. tailguard batch, {a.requests} requests")
        with tempfile.TemporaryDirectory() as tmp:
            ours = run_tailguard(base, a.requests, body_obj, a.sla_ms, Path(tmp))
        results = [ours]
        if not a.skip_runbook:
            time.sleep(a.gap_s)
            print(f"3. runbook: asyncio.gather of {a.requests} behind {a.runbook_rate:g}/s")
            results.append(_run(run_runbook(url, a.requests, body_obj, a.runbook_rate, 60.0)))
        print()
        side_by_side(results, a.requests, ideal, sla_s)
        within = sum(x <= sla_s for x in ours.latencies_s) / a.requests
        ok = (
            ours.makespan_s <= 1.15 * ideal
            and within >= 0.99
            and ours.lost == 0
            and ours.duplicated == 0
        )
        print(
            f"\ntailguard batch: makespan {ours.makespan_s:.2f} s / ideal {ideal:.2f} s = "
            f"{ours.makespan_s / ideal:.3f}x (target <= 1.15x); within SLA {within * 100:.2f}% "
            f"(target >= 99%); lost {ours.lost}, duplicated {ours.duplicated}: "
            f"{'PASS' if ok else 'MISS'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a person sees: a live progress bar while running, a summary at the end."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from tailguard.tools.batch.runner import BatchRunner, RunStats

__all__ = ["LiveProgress", "Summary", "percentile", "summarize"]


def percentile(sorted_values: list[float], q: float) -> float:
    """Exact nearest-rank percentile (q in [0, 100]) of an already sorted list; NaN if empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class Summary:
    total: int  # requests in the job
    already_done: int  # finished before this run (resume)
    done_this_run: int
    succeeded: int  # lines in the output file (whole job)
    failed: int  # lines in the errors file (whole job)
    makespan_s: float  # this run, first send to last commit
    throughput_rps: float  # successes committed by this run per second of makespan
    latency_ms: dict[str, float]  # successful attempts: p50 p90 p99 p99.9 max
    e2e_ms: dict[str, float]  # first send to success, retries included
    sla_ms: float
    within_sla: float  # share of successful attempts at or under the SLA, 0..1
    attempts: int
    retries: int
    retry_reasons: dict[str, int]
    endpoints: list[dict[str, object]]
    interrupted: bool
    output: str
    errors: str
    ledger: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _quantiles(values_s: list[float]) -> dict[str, float]:
    v = sorted(values_s)
    out = {f"p{q:g}": percentile(v, q) * 1000 for q in (50, 90, 99, 99.9)}
    out["max"] = v[-1] * 1000 if v else math.nan
    return {k: round(x, 3) for k, x in out.items()}


def summarize(
    runner: BatchRunner, stats: RunStats, *, succeeded: int, failed: int, paths: tuple[Path, ...]
) -> Summary:
    makespan = max(stats.finished - stats.started, 1e-9)
    sla_s = runner.cfg.sla_ms / 1000
    lat = stats.latencies_s
    within = sum(1 for x in lat if x <= sla_s) / len(lat) if lat else math.nan
    eps = [
        {
            "url": e.url,
            "sent": e.stats.sent,
            "ok": e.stats.ok,
            "overloaded": e.stats.overloaded,
            "failed": e.stats.failed,
            "ejections": e.stats.ejections,
            "final_limit": e.limiter.current,
        }
        for e in runner.pool.endpoints
    ]
    return Summary(
        total=stats.total,
        already_done=stats.already_done,
        done_this_run=stats.done,
        succeeded=succeeded,
        failed=failed,
        makespan_s=round(makespan, 4),
        throughput_rps=round(stats.ok / makespan, 2),
        latency_ms=_quantiles(lat),
        e2e_ms=_quantiles(stats.e2e_s),
        sla_ms=runner.cfg.sla_ms,
        within_sla=round(within, 5),
        attempts=stats.attempts,
        retries=stats.retries,
        retry_reasons=dict(stats.retry_reasons),
        endpoints=eps,
        interrupted=stats.interrupted,
        output=str(paths[0]),
        errors=str(paths[1]),
        ledger=str(paths[2]),
    )


def print_summary(s: Summary, console: Console) -> None:
    def q(d: dict[str, float]) -> str:
        return "  ".join(f"{k} {v:.1f}" for k, v in d.items())

    head = "interrupted" if s.interrupted else "finished"
    console.print(
        f"[bold]tailguard batch {head}[/]: {s.succeeded + s.failed}/{s.total} done "
        f"({s.succeeded} succeeded, {s.failed} failed; {s.already_done} were done before "
        "this run)"
    )
    console.print(
        f"  makespan {s.makespan_s:.2f} s, throughput {s.throughput_rps:.0f} req/s "
        f"({s.done_this_run} results this run)"
    )
    if s.latency_ms and not math.isnan(s.latency_ms["p50"]):
        console.print(f"  latency ms (successful attempt): {q(s.latency_ms)}")
        console.print(f"  end-to-end ms (retries included): {q(s.e2e_ms)}")
        console.print(f"  within SLA ({s.sla_ms:g} ms): {s.within_sla * 100:.2f}%")
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(s.retry_reasons.items())) or "none"
    console.print(f"  attempts {s.attempts}, retries {s.retries} ({reasons})")
    for e in s.endpoints:
        console.print(
            f"  endpoint {e['url']}: sent {e['sent']}, ok {e['ok']}, overloaded "
            f"{e['overloaded']}, failed {e['failed']}, ejections {e['ejections']}, "
            f"final limit {e['final_limit']}"
        )
    console.print(f"  output: {s.output} ({s.succeeded} lines)")
    console.print(f"  errors: {s.errors} ({s.failed} lines)")
    console.print(f"  ledger: {s.ledger}")


class LiveProgress:
    """A rich progress bar fed from the runner's counters a few times a second."""

    def __init__(self, runner: BatchRunner, console: Console) -> None:
        self.runner = runner
        self.progress = Progress(
            TextColumn("[bold]batch"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:>6.0f} req/s"),
            TextColumn("limit {task.fields[limit]:>4} in-flight {task.fields[inflight]:>4}"),
            TextColumn("{task.fields[rps]}"),
            TextColumn("{task.fields[health]}"),
            TextColumn("retries {task.fields[retries]} errors {task.fields[errors]}"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        st = runner.stats
        self.task = self.progress.add_task(
            "batch",
            total=st.total,
            completed=st.already_done,
            rate=0.0,
            limit=0,
            inflight=0,
            rps="",
            health="",
            retries=0,
            errors=0,
        )

    async def run(self) -> None:
        with self.progress:
            try:
                while True:
                    self.refresh(time.monotonic())
                    await asyncio.sleep(0.25)
            except asyncio.CancelledError:
                self.refresh(time.monotonic())

    def refresh(self, now: float) -> None:
        r = self.runner
        st = r.stats
        elapsed = max(now - st.started, 1e-9) if st.started else 0.0
        cap = f"cap {r.cfg.max_rps:g}/s" if r.cfg.max_rps else ""
        states = [e.state(now) for e in r.pool.endpoints]
        # Say so when nothing can be sent: the job waits for an endpoint to come back.
        up = sum(s in ("healthy", "probing") for s in states)
        health = "" if up == len(states) else f"[yellow]endpoints up {up}/{len(states)}[/]"
        self.progress.update(
            self.task,
            completed=st.already_done + st.done,
            rate=st.done / elapsed if elapsed else 0.0,
            limit=r.pool.total_limit(now),
            inflight=r.in_flight,
            rps=cap,
            health=health,
            retries=st.retries,
            errors=st.failed,
        )

"""`--profile sweep`: find the server's maximum first, then step the offered load up to and past it.

    run_sweep(cfg)
    ├── probes (GuideLLM's order)   synchronous: 1 request in flight for --duration -> the
    │                               lowest rate; throughput: --concurrency in flight -> the max
    │                               (a worker refused with Retry-After waits up to 0.25 s)
    ├── rate steps                  --steps open-loop runs (poisson or constant arrivals) at
    │                               rates evenly spaced from the synchronous rate to
    │                               PAST_MAX x the max (or --rate LOW .. --to-rate HIGH, no probes)
    └── knee                        the highest offered rate whose step holds every --sla term
                                    (without --sla: whose throughput kept up with the offered rate)

Each step is an ordinary run (`run_load`), with bodies continuing where the previous step's
ended, so no body repeats across the sweep. Throughput and goodput of a step are per second of
its wall time (sending plus draining), as vLLM's `bench serve` reports them.

Exit code: 2 when a probe could not start or a rate step could not be trusted; with --sla, 0
when at least one rate step holds every term, 1 when none does; without --sla, 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tailguard.tools.load.analysis import LoadResult, Percentiles, config_facts
from tailguard.tools.load.config import SWEEP_CONCURRENCY, LoadConfig, Profile
from tailguard.tools.load.runner import ProgressCallback, run_load
from tailguard.tools.load.sources import BodySource

__all__ = ["PAST_MAX", "SweepPoint", "SweepResult", "find_knee", "run_sweep", "sweep_rates"]

PAST_MAX = 1.2  # the last step offers 20 % more than the measured max: past saturation
KEEP_UP = 0.9  # without an SLA, a step "keeps up" when its throughput is >= 90 % of offered
# The probes' workers wait out a 503's Retry-After, at most this long, before sending again: 64
# workers re-sending at once to a server that refuses in microseconds measured 2,200 refusals/s
# for 10 ok/s (the refusals took the CPU the engine needed on a shared 2-core machine).
PROBE_BACKOFF_S = 0.25


@dataclass(frozen=True)
class SweepPoint:
    """One step of a sweep, as plotted and compared."""

    label: str  # "synchronous", "throughput", "rate 42/s"
    kind: str  # "probe" or "rate"
    offered_rps: float | None  # the step's arrival rate; None for the closed-loop probes
    concurrency: int | None  # probes: requests held in flight
    total: int
    ok: int
    throughput_rps: float  # ok requests / wall time
    goodput_rps: float | None  # good requests / wall time (None: no SLA to be good against)
    good_share: float | None  # good / total (DistServe's SLO attainment)
    latency_p50_s: float | None
    latency_p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    itl_p99_s: float | None
    output_tokens_per_s: float
    wall_s: float
    trusted: bool
    sla_passed: bool
    exit_code: int

    @classmethod
    def of(cls, label: str, kind: str, res: LoadResult) -> SweepPoint:
        s, p, w = res.summary, res.config.profile, res.facts.wall_s
        return cls(
            label=label,
            kind=kind,
            offered_rps=p.rate if kind == "rate" else None,
            concurrency=p.to_inflight if kind == "probe" else None,
            total=s.total,
            ok=s.ok,
            throughput_rps=s.requests_per_s,
            goodput_rps=(s.good / w if w > 0 else 0.0) if s.good is not None else None,
            good_share=s.good / s.total if s.good is not None and s.total else None,
            latency_p50_s=s.latency.p50,
            latency_p99_s=s.latency.p99,
            ttft_p50_s=s.ttft.p50,
            ttft_p99_s=s.ttft.p99,
            tpot_p50_s=s.tpot.p50,
            tpot_p99_s=s.tpot.p99,
            itl_p99_s=_p99(s.itl),
            output_tokens_per_s=s.output_tokens_per_s,
            wall_s=w,
            trusted=res.client.trusted and res.could_not_start is None,
            sla_passed=res.sla_passed,
            exit_code=res.exit_code(),
        )


def _p99(p: Percentiles) -> float | None:
    return p.p99


@dataclass
class SweepResult:
    config: LoadConfig
    probes: list[SweepPoint]
    points: list[SweepPoint]  # the rate steps, in offered-rate order
    knee: SweepPoint | None
    knee_rule: str  # how the knee was chosen, one sentence
    could_not_start: str | None
    started_at: str
    source: dict[str, object] = field(default_factory=dict)
    source_text: str = ""
    steps: list[LoadResult] = field(default_factory=list, repr=False)  # probes then rates

    def exit_code(self) -> int:
        if self.could_not_start or not all(p.trusted for p in self.points):
            return 2
        if self.config.sla and not any(p.sla_passed for p in self.points):
            return 1
        return 0

    def verdict(self) -> str:
        if self.could_not_start:
            return f"COULD NOT START: {self.could_not_start}"
        bad = [p.label for p in self.points if not p.trusted]
        if bad:
            return f"UNTRUSTWORTHY: the client fell behind at {', '.join(bad)}"
        knee = f"knee at {self.knee.offered_rps:.3g} req/s" if self.knee else "no knee"
        if not self.config.sla:
            return f"sweep done, {knee} (no SLA given)"
        return f"SLA PASS up to the {knee}" if self.exit_code() == 0 else "SLA FAIL at every rate"

    def to_dict(self) -> dict[str, object]:
        cfg = self.config
        return {
            "kind": "sweep",
            "started_at": self.started_at,
            "verdict": self.verdict(),
            "exit_code": self.exit_code(),
            "config": config_facts(cfg, self.source, self.source_text),
            "probes": [asdict(p) for p in self.probes],
            "points": [asdict(p) for p in self.points],
            "knee": asdict(self.knee) if self.knee else None,
            "knee_rule": self.knee_rule,
            "could_not_start": self.could_not_start,
        }


def sweep_rates(low: float, high: float, steps: int) -> list[float]:
    """`steps` rates evenly spaced from low to high, both included."""
    return [low + (high - low) * i / (steps - 1) for i in range(steps)]


def find_knee(points: list[SweepPoint], with_sla: bool) -> tuple[SweepPoint | None, str]:
    """The highest offered rate that held the SLA (or kept up, without one)."""
    if with_sla:
        held = [p for p in points if p.sla_passed and p.trusted]
        rule = "the highest offered rate whose step held every --sla term"
    else:
        held = [
            p
            for p in points
            if p.trusted and p.offered_rps and p.throughput_rps >= KEEP_UP * p.offered_rps
        ]
        rule = f"the highest offered rate whose throughput was >= {KEEP_UP:.0%} of it (no --sla)"
    best = max(held, key=lambda p: p.offered_rps or 0.0, default=None)
    return best, rule


StepCallback = Callable[[str, LoadResult], None]


async def run_sweep(
    cfg: LoadConfig,
    *,
    source: BodySource | None = None,
    on_step: StepCallback | None = None,
    progress: ProgressCallback | None = None,
) -> SweepResult:
    p = cfg.profile
    assert p.kind == "sweep" and p.duration_s is not None
    source = source or BodySource(cfg)
    await source.ask_server_vocab()  # once: every step's bodies continue from this source
    used = 0
    steps: list[LoadResult] = []

    async def step(label: str, profile: Profile) -> LoadResult:
        nonlocal used
        backoff = PROBE_BACKOFF_S if profile.kind == "ramp" else 0.0
        step_cfg = replace(cfg, profile=profile, reject_backoff_s=backoff)
        res = await run_load(step_cfg, progress, source.at_offset(used))
        used += len(res.records)
        steps.append(res)
        if on_step is not None:
            on_step(label, res)
        return res

    probes: list[SweepPoint] = []
    started = ""
    if p.rate is not None and p.to_rate is not None:
        rates = sweep_rates(p.rate, p.to_rate, p.steps)
    else:
        sync = await step(
            "synchronous", Profile("ramp", to_inflight=1, steps=1, hold_s=p.duration_s)
        )
        started = sync.facts.started_at
        probes.append(SweepPoint.of("synchronous", "probe", sync))
        if sync.could_not_start:
            return _stopped(cfg, probes, steps, source, sync.could_not_start, started)
        c = p.concurrency or SWEEP_CONCURRENCY
        top = await step("throughput", Profile("ramp", to_inflight=c, steps=1, hold_s=p.duration_s))
        probes.append(SweepPoint.of("throughput", "probe", top))
        low, high = probes[0].throughput_rps, PAST_MAX * probes[1].throughput_rps
        if low <= 0 or high <= 0:
            why = "the probes finished no request ok; is the server answering?"
            return _stopped(cfg, probes, steps, source, why, started)
        rates = sweep_rates(min(low, high / PAST_MAX), max(high, low * PAST_MAX), p.steps)
    points = []
    for r in rates:
        label = f"rate {r:.3g}/s"
        res = await step(label, Profile(p.arrivals, rate=r, duration_s=p.duration_s, seed=p.seed))
        started = started or res.facts.started_at
        points.append(SweepPoint.of(label, "rate", res))
    knee, rule = find_knee(points, bool(cfg.sla))
    return SweepResult(
        cfg,
        probes,
        points,
        knee,
        rule,
        None,
        started,
        source.to_dict(),
        source.describe(used),
        steps,
    )


def _stopped(
    cfg: LoadConfig,
    probes: list[SweepPoint],
    steps: list[LoadResult],
    source: BodySource,
    why: str,
    started: str,
) -> SweepResult:
    return SweepResult(cfg, probes, [], None, "", why, started, source.to_dict(), "", steps)


def write_sweep_report(result: SweepResult, out_dir: Path, *, csv: bool = False) -> list[Path]:
    """result.json and report.html for the sweep; each step's own report under steps/."""
    import json

    from tailguard.tools.load.report import write_report
    from tailguard.tools.load.sweep_html import render_sweep_html

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [p.label for p in result.probes] + [p.label for p in result.points]
    for k, (label, res) in enumerate(zip(labels, result.steps, strict=False)):
        name = f"{k:02d}-" + label.replace("/s", "").replace(" ", "-")
        write_report(res, out_dir / "steps" / name, csv=csv)
    paths = [out_dir / "result.json", out_dir / "report.html"]
    paths[0].write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    paths[1].write_text(render_sweep_html(result.to_dict()), encoding="utf-8")
    return paths

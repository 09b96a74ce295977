"""From raw records to figures: percentiles, SLA checks, the trust verdict, the exit code.

Rules that keep a stall from hiding:
- every request is in every figure; a failed request keeps its measured latency in the
  percentiles and is never "within" a latency bound in an SLA check;
- latency is measured from the intended send time (open-loop);
- percentiles come from an HdrHistogram (3 significant digits); max and shares are exact.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from hdrh.histogram import HdrHistogram

from tailguard.tools.load.config import LoadConfig, SlaCheck
from tailguard.tools.load.records import RequestRecord, Sample
from tailguard.tools.load.server_metrics import HistogramSnapshot, ServerSide, compare

__all__ = [
    "PERCENTILES",
    "ClientHealth",
    "LoadResult",
    "Percentiles",
    "RunFacts",
    "SlaResult",
    "Summary",
    "TokenCounts",
    "analyse",
    "meets",
    "percentiles_of",
]

PERCENTILES = (50.0, 90.0, 99.0, 99.9, 99.99)
PROJECT_BOUNDS_S = (0.15, 0.2)  # the project SLA; its shares are always reported
_US = 1_000_000
_HDR_MAX_US = 3600 * _US  # an hour; longer latencies are clamped (and max stays exact)


@dataclass(frozen=True)
class RunFacts:
    """What the runner measured about itself."""

    started_at: str  # ISO-8601 UTC wall clock
    wall_s: float  # run start -> last request finished
    cpu_s: float  # client process CPU time during the run
    loop_lags_s: list[float]  # one per self-monitor timer tick
    nofile_limit: int  # RLIMIT_NOFILE soft limit the run had
    event_loop: str  # "uvloop" or "asyncio"
    machine_cpu: float = 0.0  # whole machine busy share (all cores) during the run
    source: dict[str, object] = field(default_factory=dict)  # where the bodies came from
    source_text: str = ""  # the same, one line for the header


@dataclass(frozen=True)
class Percentiles:
    count: int
    p50: float | None  # seconds
    p90: float | None
    p99: float | None
    p99_9: float | None
    p99_99: float | None
    max: float | None  # exact
    mean: float | None


def percentiles_of(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(0, None, None, None, None, None, None, None)
    h = HdrHistogram(1, _HDR_MAX_US, 3)
    for v in values:
        h.record_value(min(max(1, round(v * _US)), _HDR_MAX_US))
    p = h.get_percentile_to_value_dict(list(PERCENTILES))
    return Percentiles(
        count=len(values),
        p50=p[50.0] / _US,
        p90=p[90.0] / _US,
        p99=p[99.0] / _US,
        p99_9=p[99.9] / _US,
        p99_99=p[99.99] / _US,
        max=max(values),
        mean=sum(values) / len(values),
    )


@dataclass(frozen=True)
class TokenCounts:
    """Token counts per request, as the server's usage reported them."""

    requests: int  # requests whose response carried a count
    total: int
    min: int | None
    mean: float | None
    max: int | None


def _counts(values: list[int]) -> TokenCounts:
    if not values:
        return TokenCounts(0, 0, None, None, None)
    n, tot = len(values), sum(values)
    return TokenCounts(n, tot, min(values), tot / n, max(values))


_EMPTY = Percentiles(0, None, None, None, None, None, None, None)
_NO_TOKENS = TokenCounts(0, 0, None, None, None)


@dataclass(frozen=True)
class Summary:
    total: int  # requests sent (every one is counted)
    ok: int
    failed: int  # non-2xx, timeouts, refused, reset...
    errors_by_kind: dict[str, int]  # "http 503" -> 12, "timeout" -> 3 (detail after ':' cut)
    timeouts: int
    new_connections: int
    reused_connections: int
    rate_window_s: float  # seconds that throughput and goodput are divided by
    throughput: float  # finished requests/s over rate_window_s
    goodput: float | None  # ok and within the goodput bound, per second
    goodput_bound_s: float | None
    latency: Percentiles  # from intended send time: what users saw
    service: Percentiles  # from actual send time: what a closed-loop tool would report
    ttfb: Percentiles  # sent -> response headers, requests that got a response
    first_token: Percentiles  # sent -> first SSE event (streams)
    connect: Percentiles  # TCP(+TLS) setup of new connections
    share_within: dict[str, float]  # bound seconds (str) -> share of ALL requests ok within it
    slow_over: dict[str, int]  # bound seconds (str) -> requests not ok-within it
    # token-level measures (streams; counts from the server's usage)
    ttft: Percentiles = _EMPTY  # intended send -> first content event, ok requests
    tpot: Percentiles = _EMPTY  # time per output token after the first, ok requests
    itl: Percentiles = _EMPTY  # every gap between content events, ok requests
    prompt_tokens: TokenCounts = _NO_TOKENS
    output_tokens: TokenCounts = _NO_TOKENS
    requests_per_s: float = 0.0  # ok requests / wall time (vLLM's "request throughput")
    output_tokens_per_s: float = 0.0  # output tokens of ok requests / wall time
    total_tokens_per_s: float = 0.0  # prompt + output tokens of ok requests / wall time
    goodput_terms: tuple[str, ...] = ()  # what a good request met (DistServe goodput)
    good: int | None = None  # requests that met every goodput term
    slo_met: dict[str, int] = field(default_factory=dict)  # SLO term -> requests meeting it


@dataclass(frozen=True)
class ClientHealth:
    """Whether the client itself kept up. Its lateness is inside every latency it reports."""

    trusted: bool
    reasons: tuple[str, ...]  # why not, with numbers; empty when trusted
    overstated_by_s: float  # how much client delay may be inside the latencies (p99 estimate)
    loop_lag_p99_s: float
    loop_lag_max_s: float
    send_lag_p99_s: float  # actual - intended send time (open-loop)
    send_lag_max_s: float
    cpu_mean: float  # share of one core over the run
    cpu_max: float  # worst sample interval
    nofile_limit: int
    event_loop: str
    machine_cpu: float  # whole machine busy share, all cores: context for a starved client


@dataclass(frozen=True)
class SlaResult:
    text: str
    passed: bool
    observed: str  # human-readable observed value
    detail: str


@dataclass
class LoadResult:
    config: LoadConfig
    facts: RunFacts
    summary: Summary
    client: ClientHealth
    sla: list[SlaResult]
    server: ServerSide | None
    could_not_start: str | None  # why, when no request got any HTTP response
    records: list[RequestRecord] = field(repr=False)
    samples: list[Sample] = field(repr=False)

    @property
    def sla_passed(self) -> bool:
        return all(s.passed for s in self.sla)

    def exit_code(self) -> int:
        """0 all SLA terms hold, 1 one fails, 2 the run could not start or cannot be trusted."""
        if self.could_not_start or not self.client.trusted:
            return 2
        return 0 if self.sla_passed else 1

    def verdict(self) -> str:
        code = self.exit_code()
        if self.could_not_start:
            return f"COULD NOT START: {self.could_not_start}"
        if code == 2:
            return "UNTRUSTWORTHY: " + "; ".join(self.client.reasons)
        if not self.sla:
            return "no SLA given"
        return "SLA PASS" if code == 0 else "SLA FAIL"

    def to_dict(self) -> dict[str, object]:
        cfg, p = self.config, self.config.profile
        return {
            "started_at": self.facts.started_at,
            "verdict": self.verdict(),
            "exit_code": self.exit_code(),
            "config": {
                **config_facts(cfg, self.facts.source, self.facts.source_text),
                "timeout_s": cfg.timeout_s,
                "loop": p.loop_label,
                "open_loop": p.open_loop,
                "latency_measured_from": "intended send time" if p.open_loop else "send time",
                "metrics_url": cfg.metrics_url,
            },
            "wall_s": self.facts.wall_s,
            "summary": asdict(self.summary),
            "sla": [asdict(s) for s in self.sla],
            "sla_passed": self.sla_passed,
            "trust": asdict(self.client),
            "server": asdict(self.server) if self.server else None,
            "could_not_start": self.could_not_start,
        }


def config_facts(cfg: LoadConfig, source: dict[str, object], source_text: str) -> dict[str, object]:
    """The settings every report records (a single run's and a sweep's)."""
    return {
        "url": cfg.target_url,
        "endpoint": cfg.endpoint,
        "stream": cfg.stream,
        "profile": {k: v for k, v in asdict(cfg.profile).items() if v is not None},
        "profile_text": cfg.profile.describe(),
        "sla": [s.text for s in cfg.sla],
        "slo_attainment": cfg.slo_attainment,
        "source": source,
        "source_text": source_text,
    }


def _share_key(bound: float) -> str:
    return f"{bound:g}"


def _summary(cfg: LoadConfig, recs: list[RequestRecord], wall_s: float) -> Summary:
    total = len(recs)
    ok = sum(1 for r in recs if r.ok)
    kinds = Counter((r.error or "").split(":", 1)[0] for r in recs if not r.ok)
    bounds = sorted(
        {s.latency_bound_s for s in cfg.sla if s.latency_bound_s is not None}
        | {b for b in (cfg.goodput_bound_s(),) if b is not None}
        | set(PROJECT_BOUNDS_S)
    )
    # The window throughput is divided by: the sending time of a time-bounded open-loop
    # profile (so a server that keeps up shows goodput == offered rate), else wall time.
    planned = cfg.profile.planned_duration_s()
    window = planned if planned else wall_s
    within = {b: sum(1 for r in recs if r.ok and r.latency_s <= b) for b in bounds}
    gb = cfg.goodput_bound_s()
    terms = cfg.slo_terms()
    good: int | None = None
    goodput_terms = tuple(t.text for t in terms)
    if gb is not None:
        goodput_terms = (f"e2e<={_ms(gb)}", *goodput_terms)
    if gb is not None or terms:
        good = sum(
            1
            for r in recs
            if r.ok and (gb is None or r.latency_s <= gb) and all(meets(t, r) for t in terms)
        )
    oks = [r for r in recs if r.ok]
    prompt = [r.prompt_tokens for r in oks if r.prompt_tokens is not None]
    output = [r.output_tokens for r in oks if r.output_tokens is not None]
    per_wall = 1 / wall_s if wall_s > 0 else 0.0
    return Summary(
        total=total,
        ok=ok,
        failed=total - ok,
        errors_by_kind=dict(kinds.most_common()),
        timeouts=kinds.get("timeout", 0),
        new_connections=sum(1 for r in recs if r.new_connection),
        reused_connections=sum(1 for r in recs if not r.new_connection and r.status),
        rate_window_s=window,
        throughput=total / window if window > 0 else 0.0,
        goodput=good / window if good is not None and window > 0 else None,
        goodput_bound_s=gb,
        latency=percentiles_of([r.latency_s for r in recs]),
        service=percentiles_of([r.service_s for r in recs]),
        ttfb=percentiles_of([r.ttfb_s for r in recs if r.ttfb_s is not None]),
        first_token=percentiles_of([r.first_token_s for r in recs if r.first_token_s is not None]),
        connect=percentiles_of([r.connect_s for r in recs if r.connect_s is not None]),
        share_within={_share_key(b): (n / total if total else 0.0) for b, n in within.items()},
        slow_over={_share_key(b): total - n for b, n in within.items()},
        ttft=percentiles_of([r.ttft_s for r in oks if r.ttft_s is not None]),
        tpot=percentiles_of([r.tpot_s for r in oks if r.tpot_s is not None]),
        itl=percentiles_of([g for r in oks if r.itl_s for g in r.itl_s]),
        prompt_tokens=_counts(prompt),
        output_tokens=_counts(output),
        requests_per_s=len(oks) * per_wall,
        output_tokens_per_s=sum(output) * per_wall,
        total_tokens_per_s=(sum(prompt) + sum(output)) * per_wall,
        goodput_terms=goodput_terms,
        good=good,
        slo_met={t.text: sum(1 for r in recs if meets(t, r)) for t in terms},
    )


def meets(term: SlaCheck, r: RequestRecord) -> bool:
    """Whether one request met one per-request SLO term; a failed request never does."""
    if not r.ok:
        return False
    bound = term.threshold
    if term.metric == "e2e":
        return r.latency_s <= bound
    if r.ttft_s is None:  # no content event: no token timings to hold
        return False
    if term.metric == "ttft":
        return r.ttft_s <= bound
    if term.metric == "tpot":  # a one-token answer has no time per output token: 0
        return (r.tpot_s or 0.0) <= bound
    return max(r.itl_s or [0.0]) <= bound  # itl: every gap of the request


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1000:.1f} ms"


_SLO_FIGURE = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "latency"}


def _check(s: SlaCheck, sm: Summary, attainment: float) -> SlaResult:
    total = sm.total or 1
    if s.per_request:
        met = sm.slo_met.get(s.text, 0)
        allowed_bad = math.floor(sm.total * (1 - attainment) + 1e-9)
        pct: Percentiles = getattr(sm, _SLO_FIGURE[s.metric])
        at = _pct_value(pct, attainment * 100)
        return SlaResult(
            s.text,
            sm.total > 0 and sm.total - met <= allowed_bad,
            f"{met / total:.2%} met",
            f"{met} of {sm.total} requests ok with {s.metric} <= {_ms(s.threshold)} (needs "
            f">= {attainment:.2%}); {s.metric} p{attainment * 100:g} {_ms(at)}",
        )
    if s.metric in ("percentile", "max"):
        share = sm.share_within[_share_key(s.threshold)]
        need = 1.0 if s.metric == "max" else (s.percentile or 0) / 100
        slow = sm.slow_over[_share_key(s.threshold)]
        # A share below `need` by less than one request's worth is still a pass only when
        # the count says so: compare counts, not floats.
        allowed_slow = math.floor(sm.total * (1 - need) + 1e-9)
        passed = sm.total > 0 and slow <= allowed_slow
        value = sm.latency.max if s.metric == "max" else _pct_value(sm.latency, s.percentile)
        return SlaResult(
            s.text,
            passed,
            _ms(value),
            f"{share:.4%} of {sm.total} requests ok within {_ms(s.threshold)} (needs "
            f">= {need:.4%}); {slow} slow or failed, {allowed_slow} allowed",
        )
    if s.metric == "errors":
        share = sm.failed / total
        allowed = math.floor(sm.total * s.threshold + 1e-9)
        return SlaResult(
            s.text,
            sm.total > 0 and sm.failed <= allowed,
            f"{share:.4%}",
            f"{sm.failed} of {sm.total} failed, {allowed} allowed",
        )
    if s.metric == "goodput":
        good = sm.goodput or 0.0
        return SlaResult(
            s.text,
            good >= s.threshold,
            f"{good:.1f}/s",
            f"{sm.good} requests ok meeting {', '.join(sm.goodput_terms)} over "
            f"{sm.rate_window_s:.2f} s",
        )
    return SlaResult(
        s.text,
        sm.throughput >= s.threshold,
        f"{sm.throughput:.1f}/s",
        f"{sm.total} requests over {sm.rate_window_s:.2f} s",
    )


def _pct_value(p: Percentiles, pct: float | None) -> float | None:
    """The reported percentile nearest at or above `pct` (p99.5 reads p99.9)."""
    table = [(50.0, p.p50), (90.0, p.p90), (99.0, p.p99), (99.9, p.p99_9), (99.99, p.p99_99)]
    for q, v in table:
        if pct is not None and q >= pct:
            return v
    return p.max


def _quantile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def _health(
    cfg: LoadConfig, recs: list[RequestRecord], samples: list[Sample], facts: RunFacts
) -> ClientHealth:
    lags = sorted(facts.loop_lags_s)
    send_lags = sorted(max(0.0, r.sent_s - r.intended_s) for r in recs) if recs else []
    lag99, lagmax = _quantile(lags, 0.99), (lags[-1] if lags else 0.0)
    send99, sendmax = _quantile(send_lags, 0.99), (send_lags[-1] if send_lags else 0.0)
    cpu_mean = facts.cpu_s / facts.wall_s if facts.wall_s > 0 else 0.0
    cpu_max = max((s.cpu for s in samples), default=cpu_mean)
    t = cfg.trust
    reasons: list[str] = []
    if lag99 > t.max_loop_lag_s:
        reasons.append(
            f"client event loop lagged: p99 {_ms(lag99)}, max {_ms(lagmax)} "
            f"(limit {_ms(t.max_loop_lag_s)}); latencies include up to that much client delay"
        )
    if cfg.profile.open_loop and send99 > t.max_send_lag_s:
        reasons.append(
            f"client sent late: p99 {_ms(send99)}, max {_ms(sendmax)} after the intended time "
            f"(limit {_ms(t.max_send_lag_s)}); lower the rate or use a faster client machine"
        )
    if cpu_mean > t.max_cpu:
        reasons.append(
            f"client CPU saturated: {cpu_mean:.0%} of one core on average "
            f"(limit {t.max_cpu:.0%}); the client, not the server, may be the bottleneck"
        )
    if reasons and facts.machine_cpu > 0.9:
        reasons.append(
            f"the machine was {facts.machine_cpu:.0%} busy (all cores): other processes, "
            "the server among them, took CPU from the client"
        )
    return ClientHealth(
        trusted=not reasons,
        reasons=tuple(reasons),
        overstated_by_s=max(lag99, send99 if cfg.profile.open_loop else 0.0),
        loop_lag_p99_s=lag99,
        loop_lag_max_s=lagmax,
        send_lag_p99_s=send99,
        send_lag_max_s=sendmax,
        cpu_mean=cpu_mean,
        cpu_max=cpu_max,
        nofile_limit=facts.nofile_limit,
        event_loop=facts.event_loop,
        machine_cpu=facts.machine_cpu,
    )


def _could_not_start(recs: list[RequestRecord]) -> str | None:
    if not recs:
        return "the profile sent no requests"
    if any(r.status for r in recs):
        return None
    kinds = Counter((r.error or "unknown").split(":", 1)[0] for r in recs)
    kind, n = kinds.most_common(1)[0]
    return f"no request got an HTTP response ({n} x {kind}); is the server up at this URL?"


def analyse(
    cfg: LoadConfig,
    recs: list[RequestRecord],
    samples: list[Sample],
    facts: RunFacts,
    before: HistogramSnapshot | None,
    after: HistogramSnapshot | None,
) -> LoadResult:
    summary = _summary(cfg, recs, facts.wall_s)
    server = None
    if before is not None and after is not None:
        bounds = tuple(s.latency_bound_s for s in cfg.sla if s.latency_bound_s is not None)
        server = compare(before, after, bounds)
    return LoadResult(
        config=cfg,
        facts=facts,
        summary=summary,
        client=_health(cfg, recs, samples, facts),
        sla=[_check(s, summary, cfg.slo_attainment) for s in cfg.sla],
        server=server,
        could_not_start=_could_not_start(recs),
        records=recs,
        samples=samples,
    )

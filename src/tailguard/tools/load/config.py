"""Load-test configuration: frozen dataclasses that refuse bad values at construction.

    LoadConfig
    ├── target: url, endpoint kind, body, model, stream, timeout
    ├── Profile       constant | poisson | ramp (to a rate or an in-flight count) | burst | closed
    │                 | sweep (probe the max, then step rates up to and past it)
    ├── SourceSpec    default prompt (unique per request) | --dataset FILE | random lengths
    └── SlaCheck[]    parsed from "p99<=150ms", "max<=200ms", "errors<=0.1%", "goodput>=500/s",
                      and per-request SLO terms "ttft<=150ms", "tpot<=50ms", "itl<=", "e2e<=2s"

Every error names the value that is wrong and how to write it instead (ConfigError).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Literal

from tailguard.errors import ConfigError

__all__ = [
    "ENDPOINT_PATHS",
    "EndpointKind",
    "LoadConfig",
    "Profile",
    "ProfileKind",
    "SlaCheck",
    "SourceSpec",
    "TrustLimits",
    "build_body",
    "endpoint_body",
    "parse_duration",
    "parse_length",
    "parse_sla",
]

EndpointKind = Literal["infer", "completions", "chat", "embeddings", "raw"]
ProfileKind = Literal["constant", "poisson", "ramp", "burst", "closed", "sweep"]

# Appended to the base URL; `raw` posts to the URL exactly as given.
ENDPOINT_PATHS: dict[str, str] = {
    "infer": "/v1/infer",
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "embeddings": "/v1/embeddings",
    "raw": "",
}
DEFAULT_MODEL = "tailguard-embedded"
DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Summarise this sentence."

_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s|m|h)?\s*$")
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str | float, *, what: str = "duration") -> float:
    """'150ms' -> 0.15, '2m' -> 120.0, '3' -> 3.0 (seconds)."""
    if isinstance(text, int | float):
        return float(text)
    m = _DURATION_RE.match(text)
    if not m:
        raise ConfigError(f"{what}: cannot read {text!r} as a duration; write e.g. 150ms, 10s, 2m")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


@dataclass(frozen=True)
class Profile:
    """How requests are sent. Open-loop profiles fix every send time before the run starts."""

    kind: ProfileKind
    rate: float | None = None  # requests/s (constant, poisson; ramp start rate if given)
    duration_s: float | None = None  # seconds of sending (constant, poisson)
    count: int | None = None  # burst: requests sent at once
    concurrency: int | None = None  # closed: workers, each with one request in flight
    requests: int | None = None  # closed: exact number of requests sent in total
    to_rate: float | None = None  # ramp: last step's rate (requests/s)
    to_inflight: int | None = None  # ramp: last step's in-flight requests (closed-loop steps)
    steps: int = 5  # ramp: number of equal steps up to the target
    hold_s: float | None = None  # ramp: seconds each step is held
    seed: int = 0  # poisson: arrival-time seed, so a run can be repeated
    arrivals: Literal["constant", "poisson"] = "poisson"  # sweep: arrival process of each step

    def __post_init__(self) -> None:
        k = self.kind
        given = {
            name: getattr(self, name)
            for name in (
                "rate",
                "duration_s",
                "count",
                "concurrency",
                "requests",
                "to_rate",
                "to_inflight",
                "hold_s",
            )
            if getattr(self, name) is not None
        }
        allowed = {
            "constant": {"rate", "duration_s"},
            "poisson": {"rate", "duration_s"},
            "burst": {"count"},
            "closed": {"concurrency", "requests"},
            "ramp": {"rate", "to_rate", "to_inflight", "hold_s"},
            "sweep": {"rate", "to_rate", "duration_s", "concurrency"},
        }
        if k not in allowed:
            raise ConfigError(
                f"profile {k!r} is unknown; use one of constant, poisson, ramp, burst, closed, "
                "sweep"
            )
        extra = set(given) - allowed[k]
        if extra:
            flags = ", ".join("--" + n.replace("_s", "").replace("_", "-") for n in sorted(extra))
            raise ConfigError(f"profile {k!r} does not take {flags}; remove it or change --profile")
        if k in ("constant", "poisson"):
            _need_positive(k, "--rate", self.rate)
            _need_positive(k, "--duration", self.duration_s)
        elif k == "burst":
            _need_positive(k, "--count", self.count)
        elif k == "closed":
            _need_positive(k, "--concurrency", self.concurrency)
            _need_positive(k, "--requests", self.requests)
            assert self.concurrency is not None and self.requests is not None
            if self.concurrency > self.requests:
                raise ConfigError(
                    f"closed: --concurrency {self.concurrency} > --requests {self.requests}; "
                    "workers beyond the request count would send nothing; lower --concurrency"
                )
        elif k == "sweep":
            _need_positive(k, "--duration", self.duration_s)
            if self.steps < 2:
                raise ConfigError(f"sweep: --steps must be >= 2, got {self.steps}")
            if (self.rate is None) != (self.to_rate is None):
                raise ConfigError(
                    "sweep: give both --rate LOW and --to-rate HIGH to skip the probes, or "
                    "neither (the sweep then measures them)"
                )
            if self.rate is not None:
                _need_positive(k, "--rate", self.rate)
                _need_positive(k, "--to-rate", self.to_rate)
                assert self.to_rate is not None
                if self.to_rate <= self.rate:
                    raise ConfigError(
                        f"sweep: --to-rate {self.to_rate:g} must be above --rate {self.rate:g}"
                    )
            if self.concurrency is not None:
                _need_positive(k, "--concurrency", self.concurrency)
        else:  # ramp
            if (self.to_rate is None) == (self.to_inflight is None):
                raise ConfigError(
                    "ramp: give exactly one target, --to-rate R (open-loop) or --to-inflight N "
                    "(closed-loop steps)"
                )
            if self.to_rate is not None:
                _need_positive(k, "--to-rate", self.to_rate)
            if self.to_inflight is not None:
                _need_positive(k, "--to-inflight", self.to_inflight)
                if self.rate is not None:
                    raise ConfigError("ramp --to-inflight steps concurrency; drop --rate")
            if self.rate is not None and self.rate <= 0:
                raise ConfigError(f"ramp: --rate (start rate) must be > 0, got {self.rate}")
            _need_positive(k, "--hold", self.hold_s)
            if self.steps < 1:
                raise ConfigError(f"ramp: --steps must be >= 1, got {self.steps}")

    @property
    def open_loop(self) -> bool:
        """True when send times do not depend on responses (no coordinated omission)."""
        return self.kind in ("constant", "poisson", "burst") or (
            self.kind == "ramp" and self.to_rate is not None
        )

    @property
    def loop_label(self) -> str:
        return "open-loop" if self.open_loop else "closed-loop"

    def ramp_levels(self) -> list[float]:
        """The rate (or in-flight count) of each ramp step, ending at the target."""
        if self.kind != "ramp":
            return []
        target = float(self.to_rate if self.to_rate is not None else self.to_inflight or 0)
        start = self.rate if self.rate is not None else target / self.steps
        if self.steps == 1:
            return [target]
        return [start + (target - start) * i / (self.steps - 1) for i in range(self.steps)]

    def planned_duration_s(self) -> float | None:
        """Seconds of sending for time-bounded profiles; None for count-bounded ones."""
        if self.kind in ("constant", "poisson", "sweep"):
            return self.duration_s
        if self.kind == "ramp":
            assert self.hold_s is not None
            return self.hold_s * self.steps
        return None

    def describe(self) -> str:
        k = self.kind
        if k in ("constant", "poisson"):
            return f"{k} {self.rate:g} req/s for {self.duration_s:g} s"
        if k == "burst":
            return f"burst of {self.count} at once"
        if k == "closed":
            return f"closed-loop {self.concurrency} workers, exactly {self.requests} requests"
        if k == "sweep":
            span = (
                f"{self.rate:g} to {self.to_rate:g} req/s"
                if self.rate is not None
                else f"probed rates (max at {self.concurrency or SWEEP_CONCURRENCY} in flight)"
            )
            each = f"{self.duration_s:g} s each"
            return f"sweep of {self.steps} {self.arrivals} steps over {span}, {each}"
        levels = ", ".join(f"{v:g}" for v in self.ramp_levels())
        unit = "req/s" if self.to_rate is not None else "in flight"
        return f"ramp {levels} {unit}, {self.hold_s:g} s per step"


SWEEP_CONCURRENCY = 64  # sweep's throughput probe: requests held in flight to find the max


def _need_positive(kind: str, flag: str, value: float | None) -> None:
    if value is None:
        raise ConfigError(f"profile {kind!r} needs {flag}")
    if not (value > 0) or math.isinf(value):
        raise ConfigError(f"profile {kind!r}: {flag} must be a positive number, got {value}")


SlaMetric = Literal[
    "percentile", "max", "errors", "goodput", "throughput", "ttft", "tpot", "itl", "e2e"
]
# Per-request SLO terms (DistServe): a request is good when it meets every one of them.
PER_REQUEST_METRICS = ("ttft", "tpot", "itl", "e2e")
STREAM_METRICS = ("ttft", "tpot", "itl")  # need token timings, i.e. --stream
_SLA_RE = re.compile(
    r"^\s*(?P<metric>p[0-9]+(?:\.[0-9]+)?|max|errors|goodput|throughput|ttft|tpot|itl|e2e)"
    r"(?:\((?P<arg>[^)]*)\))?\s*(?P<op><=|>=)\s*(?P<num>[0-9]*\.?[0-9]+)\s*(?P<unit>us|ms|s|%|/s)?\s*$"
)


@dataclass(frozen=True)
class SlaCheck:
    """One SLA term. Latency terms are checked on counts, never on an interpolated value.

    `p99<=150ms` holds when at least 99 % of ALL requests succeeded within 150 ms (a failed
    request is never within a bound). `max<=200ms` holds when every request did.
    """

    text: str  # as the user wrote it
    metric: SlaMetric
    op: Literal["<=", ">="]
    threshold: float  # seconds (latency), fraction (errors), requests/s (goodput, throughput)
    percentile: float | None = None  # 99.0 for p99
    bound_s: float | None = None  # goodput's latency bound when given as goodput(150ms)

    @property
    def latency_bound_s(self) -> float | None:
        return self.threshold if self.metric in ("percentile", "max") else None

    @property
    def per_request(self) -> bool:
        """A DistServe SLO term: checked on every request, all of them make goodput."""
        return self.metric in PER_REQUEST_METRICS


def parse_sla(text: str) -> SlaCheck:
    m = _SLA_RE.match(text)
    hint = (
        'write e.g. "p99<=150ms", "max<=200ms", "errors<=0.1%", "goodput>=500/s", '
        '"ttft<=150ms", "tpot<=50ms", "itl<=100ms", "e2e<=2s"'
    )
    if not m:
        raise ConfigError(f"--sla {text!r}: cannot parse; {hint}")
    metric, op, unit = m["metric"], m["op"], m["unit"]
    num = float(m["num"])
    if metric in PER_REQUEST_METRICS:
        if op != "<=" or unit not in ("us", "ms", "s") or m["arg"]:
            raise ConfigError(f"--sla {text!r}: an SLO term is '<=' with a time unit; {hint}")
        return SlaCheck(text, metric, "<=", num * _UNIT_S[unit])  # type: ignore[arg-type]
    if metric.startswith("p") or metric == "max":
        if op != "<=" or unit not in ("us", "ms", "s"):
            raise ConfigError(f"--sla {text!r}: a latency term is '<=' with a time unit; {hint}")
        if m["arg"]:
            raise ConfigError(f"--sla {text!r}: only goodput takes a (bound); {hint}")
        seconds = num * _UNIT_S[unit]
        if metric == "max":
            return SlaCheck(text, "max", "<=", seconds)
        pct = float(metric[1:])
        if not 0 < pct < 100:
            raise ConfigError(f"--sla {text!r}: percentile must be between 0 and 100 exclusive")
        return SlaCheck(text, "percentile", "<=", seconds, percentile=pct)
    if metric == "errors":
        if op != "<=" or unit not in ("%", None) or m["arg"]:
            raise ConfigError(f"--sla {text!r}: write errors<=0.1% (or a fraction: errors<=0.001)")
        frac = num / 100 if unit == "%" else num
        if frac > 1:
            raise ConfigError(f"--sla {text!r}: an error share above 100 % makes no sense")
        return SlaCheck(text, "errors", "<=", frac)
    if op != ">=" or unit != "/s":
        raise ConfigError(f"--sla {text!r}: write {metric}>=500/s")
    bound = parse_duration(m["arg"], what=f"--sla {text!r} bound") if m["arg"] else None
    if metric == "throughput" and bound is not None:
        raise ConfigError(f"--sla {text!r}: throughput takes no bound; use goodput(150ms)>=N/s")
    return SlaCheck(text, metric, ">=", num, bound_s=bound)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TrustLimits:
    """When the client's own delays make a run untrustworthy (exit code 2)."""

    max_loop_lag_s: float = 0.05  # event-loop lag (timer overshoot), p99 over the run
    max_send_lag_s: float = 0.05  # open-loop: p99 of (actual send - intended send)
    max_cpu: float = 0.95  # share of one core the client process may use on average

    def __post_init__(self) -> None:
        for name in ("max_loop_lag_s", "max_send_lag_s", "max_cpu"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"trust limit {name} must be > 0, got {getattr(self, name)}")


def parse_length(text: str, *, what: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64:256' -> (64, 256): token counts drawn uniformly in [N, M]."""
    lo_s, sep, hi_s = text.partition(":")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
    except ValueError:
        raise ConfigError(
            f"{what} {text!r}: write N or N:M (token counts, e.g. 128 or 64:256)"
        ) from None
    if lo < 1 or hi < lo:
        raise ConfigError(f"{what} {text!r}: need 1 <= N <= M, got N={lo}, M={hi}")
    return lo, hi


@dataclass(frozen=True)
class SourceSpec:
    """Where request bodies come from. Every request gets a different body unless a dataset
    is shorter than the run (then bodies repeat, and the header says so)."""

    dataset: str | None = None  # JSONL of bodies, or OpenAI Batch input lines
    input_len: tuple[int, int] | None = None  # random prompts: tokens drawn in [N, M]
    output_len: tuple[int, int] | None = None  # max_tokens drawn in [N, M], with ignore_eos
    tokenizer: str | None = None  # model folder (or "embedded") for vocabulary and chat text
    seed: int = 0  # lengths and tokens; the same seed sends the same bodies

    def __post_init__(self) -> None:
        if self.dataset is not None and self.input_len is not None:
            raise ConfigError(
                "--dataset and --random-input-len both choose the prompts; give one of them"
            )

    @property
    def kind(self) -> str:
        if self.dataset is not None:
            return "dataset"
        return "random" if self.input_len is not None else "default"


@dataclass(frozen=True)
class LoadConfig:
    """Everything one load run needs. Build it from the CLI or in-process (`run_load`)."""

    url: str  # base URL (http://host:port) or, for endpoint 'raw', the full URL
    profile: Profile
    endpoint: EndpointKind = "infer"
    body: bytes | None = None  # raw body (required for 'raw'; overrides the built body otherwise)
    model: str = DEFAULT_MODEL
    prompt: str = DEFAULT_PROMPT
    stream: bool = False  # completions/chat: ask for SSE and time the first token
    timeout_s: float = 30.0  # per request; a timed-out request counts as >= this
    sla: tuple[SlaCheck, ...] = ()
    trust: TrustLimits = field(default_factory=TrustLimits)
    metrics_url: str | None = None  # server /metrics to scrape before and after
    headers: tuple[tuple[str, str], ...] = ()
    sample_interval_s: float = 0.1  # in-flight / throughput time-series resolution
    loop_lag_interval_s: float = 0.01  # self-monitor timer period
    source: SourceSpec = field(default_factory=SourceSpec)
    slo_attainment: float = 0.99  # share of requests a per-request SLO term must hold for
    body_offset: int = 0  # first body index (a sweep's steps continue where the last ended)
    reject_backoff_s: float = 0.0  # closed-loop: wait out a refusal's Retry-After, at most this
    # Deadline propagation: "auto" (the SLO term the server's deadline stands for), "off", or
    # seconds. Each request carries X-Request-Timeout-Ms = this budget less its own send lag.
    deadline: float | Literal["auto", "off"] = "auto"

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"URL {self.url!r} must start with http:// or https://")
        if self.endpoint not in ENDPOINT_PATHS:
            raise ConfigError(
                f"--endpoint {self.endpoint!r} unknown; use one of {', '.join(ENDPOINT_PATHS)}"
            )
        if self.endpoint == "raw" and self.body is None:
            raise ConfigError("--endpoint raw posts --body FILE as-is; give --body")
        if self.stream and self.endpoint not in ("completions", "chat"):
            raise ConfigError(f"--stream applies to completions and chat, not {self.endpoint}")
        if not self.timeout_s > 0:
            raise ConfigError(f"--timeout must be > 0, got {self.timeout_s}")
        if not 0 < self.sample_interval_s <= 10:
            raise ConfigError(f"sample interval must be in (0, 10] s, got {self.sample_interval_s}")
        goodput_without_bound = any(s.metric == "goodput" and s.bound_s is None for s in self.sla)
        per_request = [s for s in self.sla if s.per_request]
        if goodput_without_bound and self.goodput_bound_s() is None and not per_request:
            raise ConfigError(
                "--sla goodput needs a latency bound: add a latency term (p99<=150ms), an SLO "
                "term (ttft<=150ms) or write goodput(150ms)>=500/s"
            )
        streamed = [s.text for s in per_request if s.metric in STREAM_METRICS]
        if streamed and not self.stream:
            raise ConfigError(
                f"--sla {streamed[0]!r} needs token timings: add --stream (completions or chat)"
            )
        if not 0 < self.slo_attainment <= 1:
            raise ConfigError(
                f"--slo-attainment must be in (0, 100 %], got {self.slo_attainment:.4g}"
            )
        src = self.source
        if src.kind != "default" and self.body is not None:
            raise ConfigError("--body gives one fixed body; drop it to use --dataset or --random-*")
        if src.kind == "random" and self.endpoint == "raw":
            raise ConfigError(
                "--random-input-len builds bodies for an endpoint; use --endpoint completions, "
                "chat, infer or embeddings"
            )
        if isinstance(self.deadline, float) and not self.deadline > 0:
            raise ConfigError(f"--deadline must be > 0 (or auto, off), got {self.deadline}")
        generating = self.endpoint in ("completions", "chat")
        if src.output_len is not None and not generating and src.kind != "dataset":
            raise ConfigError(
                f"--random-output-len sets max_tokens; {self.endpoint} generates no tokens "
                "(use --endpoint completions or chat)"
            )

    @property
    def target_url(self) -> str:
        return (
            self.url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]
            if self.endpoint != "raw"
            else (self.url)
        )

    def slo_terms(self) -> tuple[SlaCheck, ...]:
        """The per-request SLO terms (ttft, tpot, itl, e2e) every good request meets."""
        return tuple(s for s in self.sla if s.per_request)

    def deadline_s(self) -> float | None:
        """The budget each request propagates to the server, or None (no header).

        `auto`: the SLO term matching the server's deadline event, which is the first token of a
        stream (ttft) and the whole answer otherwise (e2e, else the goodput bound)."""
        if self.deadline == "off":
            return None
        if not isinstance(self.deadline, str):
            return self.deadline
        want = "ttft" if self.stream else "e2e"
        terms = [s.threshold for s in self.sla if s.metric == want]
        if terms:
            return min(terms)
        return None if self.stream else self.goodput_bound_s()

    def goodput_bound_s(self) -> float | None:
        """Latency bound for goodput: explicit, else the tightest latency term of the SLA."""
        explicit = [s.bound_s for s in self.sla if s.metric == "goodput" and s.bound_s is not None]
        if explicit:
            return min(explicit)
        bounds = [s.latency_bound_s for s in self.sla if s.latency_bound_s is not None]
        return min(bounds) if bounds else None

    def request_body(self) -> bytes:
        return self.body if self.body is not None else build_body(self)


def build_body(cfg: LoadConfig) -> bytes:
    """The JSON body each endpoint kind posts (the lead's contract for tailguard serve)."""
    obj = endpoint_body(cfg.endpoint, cfg.model, cfg.prompt)
    if cfg.stream:
        obj["stream"] = True
    return json.dumps(obj).encode()


def endpoint_body(ep: str, model: str, prompt: str) -> dict[str, object]:
    if ep == "infer":
        return {"prompt": prompt, "top_k": 5}
    if ep == "completions":
        return {"model": model, "prompt": prompt, "max_tokens": 16}
    if ep == "chat":
        return {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 16,
        }
    if ep == "embeddings":
        return {"model": model, "input": prompt}
    raise ConfigError("--endpoint raw has no built body; give --body FILE")

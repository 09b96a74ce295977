"""The one module that imports prometheus_client: plain figures in, Prometheus text out.

Names and labels are the contract in docs/metrics.md. Latency histograms use the SLA buckets so
an SLA check is an exact bucket ratio (`bucket{le="0.15"} / count`), never histogram_quantile.
"""

from __future__ import annotations

import itertools
import math
import os
import resource
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tailguard.core.gc_timer import GCTimer
from tailguard.core.sla import SLA_BUCKETS
from tailguard.core.stats import EngineStats, StepStats

__all__ = ["CONTENT_TYPE", "HOT", "SLA_BUCKETS", "HotHistogram", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_CONN_BUCKETS = (1, 2, 5, 10, 100, 1000, 10_000, 100_000)
# actual / planned time of admitted requests: > 1 means admission was optimistic (late risk)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)


class HotHistogram:
    """A histogram the request path observes in plain Python: one bisect and two additions
    (prometheus_client's take a lock per bucket and walk the buckets in Python, ~1 us each,
    several per request). Cumulative from start; `RequestPathCollector` exports it through
    prometheus_client's public metric-family API, so every scrape is exact."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, buckets: Sequence[float]) -> None:
        self._bounds = (*buckets, math.inf)
        self.counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # bisect_left: the first bucket with amount <= bound, as prometheus_client counts it
        # (most request-path figures fall in the first bucket: one comparison, no bisect)
        bounds = self._bounds
        self.counts[0 if amount <= bounds[0] else bisect_left(bounds, amount)] += 1
        self.sum += amount

    def buckets(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs, +Inf last, as the exposition format wants them."""
        return list(
            zip(map(floatToGoString, self._bounds), itertools.accumulate(self.counts), strict=True)
        )


@dataclass(frozen=True)
class HotSpec:
    """One histogram family of the request path (and the counter of its observations)."""

    name: str
    doc: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...]
    counter: tuple[str, str] | None = None  # (name, doc) of a counter of the observations


# The request path's series, declared here and exported by RequestPathCollector.
HOT: dict[str, HotSpec] = {
    "latency": HotSpec(
        "mistral_inference_latency_seconds",
        "End-to-end server time, request read -> response written",
        ("endpoint", "outcome"),
        SLA_BUCKETS,
        ("tailguard_requests", "Requests answered"),
    ),
    "rejection": HotSpec(
        "tailguard_rejection_seconds",
        "Server time of rejections",
        ("reason",),
        SLA_BUCKETS,
        ("tailguard_rejections", "Requests refused"),
    ),
    "queue": HotSpec(
        "tailguard_queue_seconds", "Arrival -> first scheduled", ("priority",), SLA_BUCKETS
    ),
    "prediction": HotSpec(
        "tailguard_admission_prediction_ratio",
        "Admitted requests: actual time to the deadline event / the time admission planned "
        "for (the calibrated bound)",
        ("kind",),
        _RATIO_BUCKETS,
    ),
    "per_connection": HotSpec(
        "tailguard_requests_per_connection", "Requests per closed connection", (), _CONN_BUCKETS
    ),
    "intake": HotSpec(
        "tailguard_intake_wait_seconds",
        "Read from a socket -> parsed (request data waiting for a per-iteration slot)",
        (),
        _LAG_BUCKETS,
    ),
}
REFUSALS_DOC = (
    "Requests admission refused, by why (late, deadline_passed, queue_requests, queue_tokens) "
    "and kind (single_pass: deadline on the answer; generate: on the first token)"
)


class RequestPathCollector(Collector):
    """Exports the request path's plain-Python figures as metric families at every scrape."""

    def __init__(self) -> None:
        self.hot: dict[str, dict[tuple[str, ...], HotHistogram]] = {k: {} for k in HOT}
        self.refusals: dict[tuple[str, str], int] = {}  # (reason, kind) -> count
        self.connections_opened = 0
        self.connections_active = 0

    def child(self, family: str, labels: tuple[str, ...] = ()) -> HotHistogram:
        children = self.hot[family]
        h = children.get(labels)
        if h is None:
            h = children[labels] = HotHistogram(HOT[family].buckets)
        return h

    def collect(self) -> Iterator[Metric]:
        for key, spec in HOT.items():
            children = list(self.hot[key].items())  # a copy: the loop may add children
            hist = HistogramMetricFamily(spec.name, spec.doc, labels=spec.labels)
            for labels, h in children:
                hist.add_metric(list(labels), h.buckets(), h.sum)
            yield hist
            if spec.counter is not None:
                counter = CounterMetricFamily(*spec.counter, labels=spec.labels)
                for labels, h in children:
                    counter.add_metric(list(labels), sum(h.counts))
                yield counter
        refused = CounterMetricFamily(
            "tailguard_admission_refusals", REFUSALS_DOC, labels=("reason", "kind")
        )
        for (reason, kind), n in list(self.refusals.items()):
            refused.add_metric([reason, kind], n)
        yield refused
        yield CounterMetricFamily(
            "tailguard_connections_opened", "TCP connections accepted", self.connections_opened
        )
        yield GaugeMetricFamily(
            "tailguard_connections_active", "Open TCP connections", self.connections_active
        )


@dataclass(frozen=True)
class MetricSpec:
    """One prometheus_client metric of the server, declared in REGISTERED."""

    attr: str  # the ServerMetrics attribute it is
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def create(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
        if self.kind is Histogram:
            assert self.buckets is not None, self.name
            return Histogram(
                self.name, self.doc, self.labels, buckets=self.buckets, registry=registry
            )
        return self.kind(self.name, self.doc, self.labels, registry=registry)


# The rest of the server's series: (attribute, kind, name, help, labels, buckets).
REGISTERED: tuple[MetricSpec, ...] = (
    MetricSpec(
        "ttft",
        Histogram,
        "tailguard_time_to_first_token_seconds",
        "Arrival -> first output token",
        ("endpoint",),
        SLA_BUCKETS,
    ),
    MetricSpec(
        "tpot",
        Histogram,
        "tailguard_time_per_output_token_seconds",
        "Mean inter-token time per finished generation",
        (),
        SLA_BUCKETS,
    ),
    MetricSpec(
        "calibration",
        Gauge,
        "tailguard_admission_excess_seconds",
        "Admission's measured prediction error (actual - predicted) at its target quantile, "
        "planned for predictions up to `le` seconds (le=live: from requests in flight that "
        "are already past their bound)",
        ("kind", "le"),
        None,
    ),
    MetricSpec(
        "step_cost",
        Gauge,
        "tailguard_admission_step_cost_seconds",
        "Admission's fit of the engine step time, a + b * tokens + c * rows (padded sizes): term "
        "a (s per step), b (s per token) and c (s per output-head row)",
        ("term",),
        None,
    ),
    MetricSpec(
        "expected_misses",
        Gauge,
        "tailguard_admission_expected_miss_share",
        "The recently admitted requests' average predicted chance of missing their deadline "
        "(admission spends up to half of 1 - admission_quantile on requests at the edge)",
        (),
        None,
    ),
    MetricSpec(
        "overload_headroom",
        Gauge,
        "tailguard_admission_overload_headroom",
        "The share of its time left a request is planned to leave unused now: the share of the "
        "last second's requests refused, up to admission_overload_headroom (0 below capacity)",
        (),
        None,
    ),
    MetricSpec(
        "cache_hits",
        Counter,
        "tailguard_cache_hits",
        "Answered from the degradation cache",
        ("reason",),
        None,
    ),
    MetricSpec("waiting", Gauge, "tailguard_requests_waiting", "Queued in the engine", (), None),
    MetricSpec("running", Gauge, "tailguard_requests_running", "Running in the engine", (), None),
    MetricSpec(
        "in_flight", Gauge, "tailguard_requests_in_flight", "Admitted, not yet answered", (), None
    ),
    MetricSpec(
        "batch_size",
        Histogram,
        "tailguard_batch_size",
        "Sequences per engine step",
        (),
        _SIZE_BUCKETS,
    ),
    MetricSpec(
        "batch_tokens",
        Histogram,
        "tailguard_batch_tokens",
        "Tokens per engine step",
        (),
        _TOKEN_BUCKETS,
    ),
    MetricSpec("max_num_seqs", Gauge, "tailguard_max_num_seqs", "Engine batch capacity", (), None),
    MetricSpec(
        "step_s",
        Histogram,
        "tailguard_engine_step_seconds",
        "Engine step wall time",
        (),
        SLA_BUCKETS,
    ),
    MetricSpec(
        "kv_usage", Gauge, "tailguard_kv_cache_usage_ratio", "Used / total KV blocks", (), None
    ),
    MetricSpec(
        "kv_total", Gauge, "tailguard_kv_cache_blocks_total", "KV blocks in the pool", (), None
    ),
    MetricSpec("preemptions", Counter, "tailguard_preemptions", "Sequences preempted", (), None),
    MetricSpec(
        "expired", Counter, "tailguard_expired", "Dropped unexecuted after deadline", (), None
    ),
    MetricSpec("oom_retries", Counter, "tailguard_oom_retries", "Batch splits after OOM", (), None),
    MetricSpec(
        "oom_failures", Counter, "tailguard_oom_failures", "Failed: OOM even alone", (), None
    ),
    MetricSpec(
        "restarts", Counter, "tailguard_engine_restarts", "Engine process restarts", (), None
    ),
    MetricSpec(
        "engine_up", Gauge, "tailguard_engine_up", "1 when the engine is alive and warm", (), None
    ),
    MetricSpec("shapes", Gauge, "tailguard_forward_shapes", "Distinct forward shapes", (), None),
    MetricSpec("kv_allocs", Counter, "tailguard_kv_allocations", "KV tensors allocated", (), None),
    MetricSpec(
        "loop_lag",
        Histogram,
        "tailguard_event_loop_lag_seconds",
        "HTTP event-loop lag",
        (),
        _LAG_BUCKETS,
    ),
    MetricSpec("gc_pause", Counter, "tailguard_gc_pause_seconds", "Time in GC", ("process",), None),
    MetricSpec(
        "conn_cut",
        Counter,
        "tailguard_connections_cut",
        "Connections the server closed on a timeout or aborted",
        ("reason",),
        None,
    ),
    MetricSpec("cpu", Counter, "tailguard_process_cpu_seconds", "CPU time", ("process",), None),
    MetricSpec("rss", Gauge, "tailguard_process_resident_memory_bytes", "RSS", ("process",), None),
    MetricSpec(
        "threads", Gauge, "tailguard_compute_threads", "Intra-op threads", ("process",), None
    ),
    MetricSpec(
        "alloc_reserved", Gauge, "tailguard_allocator_reserved_bytes", "CUDA reserved", (), None
    ),
    MetricSpec(
        "alloc_allocated", Gauge, "tailguard_allocator_allocated_bytes", "CUDA allocated", (), None
    ),
    MetricSpec(
        "alloc_inactive",
        Gauge,
        "tailguard_allocator_inactive_split_bytes",
        "CUDA inactive split bytes",
        (),
        None,
    ),
    MetricSpec(
        "alloc_retries",
        Counter,
        "tailguard_allocator_alloc_retries",
        "CUDA alloc retries",
        (),
        None,
    ),
    MetricSpec("alloc_ooms", Counter, "tailguard_allocator_ooms", "CUDA OOMs", (), None),
    MetricSpec(
        "alloc_device", Counter, "tailguard_allocator_device_allocs", "cudaMalloc calls", (), None
    ),
    MetricSpec("sla", Gauge, "tailguard_sla_seconds", "Configured SLA", (), None),
)


class ServerMetrics:
    # declared in REGISTERED, created in __init__
    ttft: Histogram
    tpot: Histogram
    calibration: Gauge
    step_cost: Gauge
    expected_misses: Gauge
    overload_headroom: Gauge
    cache_hits: Counter
    waiting: Gauge
    running: Gauge
    in_flight: Gauge
    batch_size: Histogram
    batch_tokens: Histogram
    max_num_seqs: Gauge
    step_s: Histogram
    kv_usage: Gauge
    kv_total: Gauge
    preemptions: Counter
    expired: Counter
    oom_retries: Counter
    oom_failures: Counter
    restarts: Counter
    engine_up: Gauge
    shapes: Gauge
    kv_allocs: Counter
    loop_lag: Histogram
    gc_pause: Counter
    conn_cut: Counter
    cpu: Counter
    rss: Gauge
    threads: Gauge
    alloc_reserved: Gauge
    alloc_allocated: Gauge
    alloc_inactive: Gauge
    alloc_retries: Counter
    alloc_ooms: Counter
    alloc_device: Counter
    sla: Gauge

    def __init__(self, sla_s: float, max_num_seqs: int) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.request_path = path = RequestPathCollector()
        r.register(path)
        self.intake = path.child("intake")
        self._per_conn = path.child("per_connection")
        for spec in REGISTERED:
            setattr(self, spec.attr, spec.create(r))
        self.sla.set(sla_s)
        self.max_num_seqs.set(max_num_seqs)
        self.threads.labels("server").set(1)
        self._answers: dict[tuple[str, str], HotHistogram] = {}
        self._rejections: dict[str, HotHistogram] = {}
        self._queue_children: dict[Any, HotHistogram] = {}
        self._prediction = {  # by single_pass: one answer each, bound once
            sp: path.child("prediction", ("single_pass" if sp else "generate",))
            for sp in (True, False)
        }
        self._engine_totals: dict[str, float] = {}
        self._server_cpu = 0.0
        self._gc = GCTimer()  # this process's collections (the engine's come in its stats)

    def close(self) -> None:
        self._gc.close()

    # ---- per request: plain Python, exported by RequestPathCollector -------------------------
    def queue_for(self, priority: Any) -> HotHistogram:
        child = self._queue_children.get(priority)
        if child is None:
            child = self.request_path.child("queue", (priority.name.lower(),))
            self._queue_children[priority] = child
        return child

    def answered(self, endpoint: str, outcome: str, seconds: float) -> None:
        """One answer: its latency (`mistral_inference_latency_seconds`) and its count
        (`tailguard_requests_total`)."""
        h = self._answers.get((endpoint, outcome))
        if h is None:
            h = self._answers[(endpoint, outcome)] = self.request_path.child(
                "latency", (endpoint, outcome)
            )
        h.observe(seconds)

    def rejected(self, reason: str, seconds: float) -> None:
        """One refusal: its server time (`tailguard_rejection_seconds`) and its count
        (`tailguard_rejections_total`)."""
        h = self._rejections.get(reason)
        if h is None:
            h = self._rejections[reason] = self.request_path.child("rejection", (reason,))
        h.observe(seconds)

    def admission_refused(self, code: str, single_pass: bool) -> None:
        """One admission refusal (`tailguard_admission_refusals_total`; a burst brings
        thousands)."""
        key = (code, "single_pass" if single_pass else "generate")
        refusals = self.request_path.refusals
        refusals[key] = refusals.get(key, 0) + 1

    def prediction(self, single_pass: bool, actual_s: float, planned_s: float) -> None:
        """One admitted request's deadline event against the time admission planned for."""
        ratio = actual_s / planned_s if planned_s > 0 else 0.0
        self._prediction[single_pass].observe(ratio)

    def calibration_now(self, single_pass: bool, calibration: Any, edges: Iterable[float]) -> None:
        """The excess admission plans for now, per prediction size (unmeasured sizes left out)."""
        kind = "single_pass" if single_pass else "generate"
        g = self.calibration
        for edge in edges:
            excess = calibration.excess_s(edge)
            if excess is not None:
                g.labels(kind, f"{edge:g}").set(excess)
        g.labels(kind, "live").set(calibration.live_excess_s)

    def connection_opened(self) -> None:
        self.request_path.connections_opened += 1
        self.request_path.connections_active += 1

    def connection_closed(self, requests: int) -> None:
        """A connection closed after `requests` requests (`tailguard_requests_per_connection`)."""
        self.request_path.connections_active -= 1
        self._per_conn.observe(requests)

    def connection_cut(self, reason: str) -> None:
        """The server ended a connection: idle, header_timeout, body_timeout, send_timeout,
        linger_timeout (`tailguard_connections_cut_total{reason}`; rare, so counted directly)."""
        self.conn_cut.labels(reason).inc()

    # ---- engine snapshot --------------------------------------------------------------------
    def _counter_to(self, key: str, counter: Any, total: float) -> None:
        """Advance a counter to an engine-side cumulative total (a restart resets the engine's)."""
        prev = self._engine_totals.get(key, 0.0)
        counter.inc(total - prev if total >= prev else total)
        self._engine_totals[key] = total

    def observe_engine(self, s: EngineStats, *, ready: bool, restarts: int) -> list[StepStats]:
        """Update from a snapshot; returns its steps (each engine client hands a step over
        once: `EngineClientProtocol.stats`)."""
        new = s.recent_steps
        for step in new:
            self.batch_size.observe(step.num_seqs)
            self.batch_tokens.observe(step.num_tokens)
            self.step_s.observe(step.step_s)
        self.waiting.set(s.waiting)
        self.running.set(s.running)
        self.engine_up.set(1 if ready else 0)
        self.kv_total.set(s.kv_blocks_total)
        self.kv_usage.set(s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        self.shapes.set(s.distinct_shapes)
        if s.max_num_seqs:
            self.max_num_seqs.set(s.max_num_seqs)
        self._counter_to("preemptions", self.preemptions, s.preemptions_total)
        self._counter_to("expired", self.expired, s.expired_total)
        self._counter_to("oom_retries", self.oom_retries, s.oom_retries_total)
        self._counter_to("oom_failures", self.oom_failures, s.oom_failures_total)
        self._counter_to("kv_allocs", self.kv_allocs, s.kv_allocations_total)
        self._counter_to("restarts", self.restarts, restarts)
        self._counter_to("engine_gc", self.gc_pause.labels("engine"), s.gc_pause_s_total)
        self._counter_to("engine_cpu", self.cpu.labels("engine"), s.cpu_seconds_total)
        self.rss.labels("engine").set(s.allocator.rss_bytes)
        self.threads.labels("engine").set(s.intra_op_threads)
        a = s.allocator
        self.alloc_reserved.set(a.reserved_bytes)
        self.alloc_allocated.set(a.allocated_bytes)
        self.alloc_inactive.set(a.inactive_split_bytes)
        self._counter_to("alloc_retries", self.alloc_retries, a.num_alloc_retries)
        self._counter_to("alloc_ooms", self.alloc_ooms, a.num_ooms)
        self._counter_to("alloc_device", self.alloc_device, a.num_device_alloc)
        return new

    def render(self) -> bytes:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        cpu = ru.ru_utime + ru.ru_stime
        self.cpu.labels("server").inc(max(cpu - self._server_cpu, 0.0))
        self._server_cpu = cpu
        self.rss.labels("server").set(_rss_bytes())
        self._counter_to("server_gc", self.gc_pause.labels("server"), self._gc.pause_s_total)
        return generate_latest(self.registry)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

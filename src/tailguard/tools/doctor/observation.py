"""Everything collected over one window, and the figures derived from it.

The rules read only this module's types, so they run the same on a live collection, a
Prometheus range query or a recorded folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlparse

from tailguard.core.stats import AllocatorStats, EngineStats
from tailguard.tools.doctor import thresholds as T
from tailguard.tools.doctor.loadreport import LoadSummary
from tailguard.tools.doctor.snapshot import Histogram, Snapshot, counter_delta, histogram_delta
from tailguard.tools.doctor.vllm import is_vllm, translate
from tailguard.tools.doctor.watch import Neighbour, Watch

LATENCY = "mistral_inference_latency_seconds"


@dataclass(frozen=True)
class ServerWindow:
    """One tailguard server (or anything exporting the same names) at both ends of the window."""

    name: str  # the URL scraped, or the Prometheus instance
    before: Snapshot
    after: Snapshot
    engine_before: EngineStats | None = None  # recorded EngineStats, when available
    engine_after: EngineStats | None = None
    watch: Watch | None = None  # the doctor's own probe and /proc samples (live runs only)

    def __post_init__(self) -> None:
        # A vLLM scrape gets tailguard-named copies of its series, so the rules read one set.
        object.__setattr__(self, "before", translate(self.before))
        object.__setattr__(self, "after", translate(self.after))

    @property
    def kind(self) -> str:
        """Which server this is, from its metric names: tailguard, vllm or other."""
        if is_vllm(self.after):
            return "vllm"
        return "tailguard" if self.after.has("tailguard_sla_seconds") else "other"

    @property
    def host(self) -> str:
        """Host part of the name; loopback spellings collapse to one host."""
        h = urlparse(self.name).hostname if "://" in self.name else self.name.rsplit(":", 1)[0]
        return "localhost" if h in (None, "", "127.0.0.1", "::1", "localhost", "0.0.0.0") else h

    def delta(self, name: str, **match: str) -> float:
        return counter_delta(self.before, self.after, name, **match)

    def hist(self, name: str, **match: str) -> Histogram:
        return histogram_delta(self.before, self.after, name, **match)

    def has(self, name: str) -> bool:
        return self.after.has(name)


@dataclass(frozen=True)
class AllocatorWindow:
    """Allocator figures at both ends, from EngineStats when recorded, else from /metrics."""

    before: AllocatorStats
    after: AllocatorStats
    warm: bool  # the engine had finished warm-up before the window began
    shapes_added: int  # distinct forward shapes first seen inside the window
    kv_allocations_added: int

    @property
    def on_device(self) -> bool:
        return self.after.reserved_bytes > 0 or self.after.device.startswith("cuda")


def _alloc_from_metrics(s: Snapshot) -> AllocatorStats:
    reserved = int(s.get("tailguard_allocator_reserved_bytes"))
    return AllocatorStats(
        device="cuda" if reserved > 0 else "cpu",
        reserved_bytes=reserved,
        allocated_bytes=int(s.get("tailguard_allocator_allocated_bytes")),
        inactive_split_bytes=int(s.get("tailguard_allocator_inactive_split_bytes")),
        num_alloc_retries=int(s.get("tailguard_allocator_alloc_retries_total")),
        num_ooms=int(s.get("tailguard_allocator_ooms_total")),
        num_device_alloc=int(s.get("tailguard_allocator_device_allocs_total")),
    )


def allocator_window(sw: ServerWindow) -> AllocatorWindow:
    eb, ea = sw.engine_before, sw.engine_after
    if eb is not None and ea is not None:
        return AllocatorWindow(
            before=eb.allocator,
            after=ea.allocator,
            warm=eb.warmup_done,
            shapes_added=max(0, ea.distinct_shapes - eb.distinct_shapes),
            kv_allocations_added=max(0, ea.kv_allocations_total - eb.kv_allocations_total),
        )
    # /metrics: engine_up is 1 only after warm-up; absent (another server) counts as warm.
    warm = sw.before.get("tailguard_engine_up") >= 1 or not sw.before.has("tailguard_engine_up")
    shapes = sw.after.get("tailguard_forward_shapes") - sw.before.get("tailguard_forward_shapes")
    return AllocatorWindow(
        before=_alloc_from_metrics(sw.before),
        after=_alloc_from_metrics(sw.after),
        warm=warm,
        shapes_added=int(max(0.0, shapes)),
        kv_allocations_added=int(sw.delta("tailguard_kv_allocations_total")),
    )


def merge_histograms(hs: list[Histogram]) -> Histogram:
    """Add histograms that share bucket bounds (one per server); others are skipped."""
    hs = [h for h in hs if h.count > 0]
    if not hs:
        return Histogram(bounds=(math.inf,), cumulative=(0.0,), sum=0.0, count=0.0)
    base = hs[0]
    same = [h for h in hs if h.bounds == base.bounds]
    cum = tuple(sum(h.cumulative[i] for h in same) for i in range(len(base.bounds)))
    return Histogram(
        bounds=base.bounds,
        cumulative=cum,
        sum=sum(h.sum for h in same),
        count=sum(h.count for h in same),
    )


@dataclass(frozen=True)
class Observation:
    """One window of evidence from every source the doctor was given."""

    window_s: float
    servers: tuple[ServerWindow, ...] = ()
    envoy_before: Snapshot | None = None
    envoy_after: Snapshot | None = None
    load: LoadSummary | None = None
    host_cores: int = 1  # cores of the host(s) running the servers
    sla_override_s: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)  # collection remarks (partial scrapes)
    host_cpu_busy: float | None = None  # whole host, all processes (/proc/stat); live local runs
    neighbours: tuple[Neighbour, ...] = ()  # busiest processes on the host that are no server

    @property
    def sla_s(self) -> float:
        if self.sla_override_s is not None:
            return self.sla_override_s
        for sw in self.servers:
            v = sw.after.get("tailguard_sla_seconds")
            if v > 0:
                return v / max(1, len(sw.after.series("tailguard_sla_seconds")))
        return T.SLA_DEFAULT_S

    @property
    def has_envoy(self) -> bool:
        return self.envoy_before is not None and self.envoy_after is not None


@dataclass(frozen=True)
class Symptom:
    """Is there a tail in this window, and how large?"""

    sla_s: float
    server_requests: int  # requests answered ok by the servers in the window
    server_within_sla: float  # share of those within the SLA (bucket ratio, exact)
    server_p50_upper_s: float  # "p50 <= this" (bucket upper bound)
    server_p99_upper_s: float
    client: LoadSummary | None
    server_refused: int = 0  # refused by admission (overloaded, expired, answered from cache)
    server_refused_share: float = 0.0  # of every request the servers answered or refused

    @property
    def within_sla(self) -> float:
        """The worse of the server's and the client's view (the client also sees the network)."""
        shares = []
        if self.server_requests >= T.MIN_REQUESTS:
            shares.append(self.server_within_sla)
        if self.client is not None and self.client.requests >= T.MIN_REQUESTS:
            shares.append(self.client.within_sla)
        return min(shares) if shares else 1.0

    @property
    def enough_traffic(self) -> bool:
        client_n = self.client.requests if self.client else 0
        return max(self.server_requests, client_n) >= T.MIN_REQUESTS

    @property
    def tail(self) -> bool:
        return self.enough_traffic and self.within_sla < T.SLA_TARGET_SHARE

    @property
    def refused_share(self) -> float:
        """The larger of the servers' and the client's refused share."""
        client = (
            self.client.refused / self.client.requests
            if self.client and self.client.requests
            else 0.0
        )
        return max(self.server_refused_share, client)

    @property
    def refusing(self) -> bool:
        return self.enough_traffic and self.refused_share > T.REJECT_SHARE

    @property
    def missed(self) -> bool:
        """The SLA was missed: a tail (server or client), or work refused (shed load)."""
        return self.tail or self.refusing

    @property
    def how_missed(self) -> str:
        parts = []
        if self.tail:
            parts.append(f"{self.within_sla:.1%} within SLA (target {T.SLA_TARGET_SHARE:.0%})")
        if self.refusing:
            parts.append(f"{self.refused_share:.1%} of requests refused")
        return " and ".join(parts) if parts else "met"


def refused(sw: ServerWindow) -> float:
    """Requests a server refused in the window: admission said no (overloaded), the deadline
    passed in its queue (expired), or the degradation cache answered instead (shed, politely)."""
    return (
        sw.delta("tailguard_rejections_total", reason="overloaded")
        + sw.delta("tailguard_rejections_total", reason="expired")
        + sw.delta("tailguard_cache_hits_total", reason="overload")
    )


def symptom(obs: Observation) -> Symptom:
    lat = merge_histograms([sw.hist(LATENCY, outcome="ok") for sw in obs.servers])
    sla = obs.sla_s
    shed = sum(refused(sw) for sw in obs.servers)
    # requests_total counts every answer, refusals included; the ok histogram is the floor
    seen = sum(max(sw.delta("tailguard_requests_total"), sw.hist(LATENCY).count + refused(sw))
               for sw in obs.servers)  # fmt: skip
    return Symptom(
        sla_s=sla,
        server_requests=int(lat.count),
        server_within_sla=lat.share_le(sla),
        server_p50_upper_s=lat.quantile_upper(0.50),
        server_p99_upper_s=lat.quantile_upper(0.99),
        client=obs.load,
        server_refused=int(shed),
        server_refused_share=shed / seen if seen > 0 else 0.0,
    )

"""One rule per cause. Each returns a Finding with its numbers, a confidence and the fix.

Confidence combines independent signals as 1 - prod(1 - weight) over the signals that fired, so
one strong signal (a per-connection cap being hit, an allocator retry) names a cause alone while
weak ones (threads over cores) need company. Weights are chosen so that a single weak signal
stays under `CAUSE_MIN_CONFIDENCE` and is reported as a note, not a cause.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tailguard.tools.doctor import thresholds as T
from tailguard.tools.doctor.observation import (
    LATENCY,
    Observation,
    ServerWindow,
    Symptom,
    allocator_window,
    symptom,
)
from tailguard.tools.doctor.snapshot import envoy_sum


class Cause(enum.StrEnum):
    FRAGMENTATION = "fragmentation"
    STARVATION = "starvation"
    CHURN = "churn"
    OVERLOAD = "overload"
    UNEXPLAINED = "unexplained"  # a tail that no rule explains
    NONE = "none"


@dataclass(frozen=True)
class Evidence:
    """One number a rule looked at, against the threshold it was judged by."""

    what: str
    value: float
    threshold: float | None
    fired: bool
    weight: float = 0.0  # contribution to confidence when fired
    unit: str = ""
    where: str = ""


@dataclass(frozen=True)
class Finding:
    cause: Cause
    title: str
    confidence: float  # 0..1
    summary: str  # one line with the decisive numbers
    evidence: tuple[Evidence, ...] = ()
    fix: tuple[str, ...] = ()
    where: str = ""  # the server / proxy the evidence came from

    @property
    def is_cause(self) -> bool:
        return self.confidence >= T.CAUSE_MIN_CONFIDENCE


def _combine(ev: Sequence[Evidence]) -> float:
    miss = 1.0
    for e in ev:
        if e.fired:
            miss *= 1.0 - e.weight
    return round(1.0 - miss, 3)


def _ev(what: str, value: float, threshold: float | None, fired: bool, weight: float,
        unit: str = "", where: str = "") -> Evidence:  # fmt: skip
    return Evidence(what, round(value, 6), threshold, fired, weight, unit, where)


def _fmt(e: Evidence) -> str:
    return f"{e.what} {e.value:.3g}{e.unit}"


def _summary(ev: Sequence[Evidence], fallback: str) -> str:
    fired = [e for e in ev if e.fired]
    return "; ".join(_fmt(e) for e in fired) if fired else fallback


def batch_fill(sw: ServerWindow) -> float | None:
    """Mean sequences per engine step over max_num_seqs; None when the server has no batches."""
    cap = sw.after.get("tailguard_max_num_seqs")
    h = sw.hist("tailguard_batch_size")
    if cap <= 0 or h.count <= 0:
        return None
    return h.mean / cap


@dataclass(frozen=True)
class Capacity:
    """Is the engine at capacity? Either batches are full of sequences, or the engine steps
    back to back while requests wait (batches bound by the token budget)."""

    fill: float | None  # mean batch / max_num_seqs; None: the server has no batches
    busy: float  # engine step time / window
    waiting: float  # the larger of the two waiting-queue readings

    @property
    def busy_with_queue(self) -> bool:
        return self.busy >= T.ENGINE_BUSY_RATIO and self.waiting >= T.WAITING_MIN

    @property
    def saturated(self) -> bool:
        return (self.fill is not None and self.fill >= T.BATCH_FULL_RATIO) or self.busy_with_queue


def capacity(sw: ServerWindow, window_s: float) -> Capacity:
    busy = sw.delta("tailguard_engine_step_seconds_sum") / max(window_s, 1e-9)
    waiting = max(sw.before.get("tailguard_requests_waiting"),
                  sw.after.get("tailguard_requests_waiting"))  # fmt: skip
    return Capacity(fill=batch_fill(sw), busy=busy, waiting=waiting)


def queue_slow_share(sw: ServerWindow, sla_s: float) -> float:
    h = sw.hist("tailguard_queue_seconds")
    return h.share_over(T.QUEUE_SLA_FRACTION * sla_s) if h.count > 0 else 0.0


def requests_in_window(sw: ServerWindow) -> float:
    """Requests answered in the window (the counter, else the latency histogram's count)."""
    return sw.delta("tailguard_requests_total") or sw.hist(LATENCY).count


# --- allocator fragmentation ----------------------------------------------------------------


def fragmentation(obs: Observation, sym: Symptom) -> Finding:
    best: tuple[float, list[Evidence], str] = (0.0, [], "")
    for sw in obs.servers:
        a = allocator_window(sw)
        if not a.on_device:
            continue
        b, f = a.before, a.after
        retries = f.num_alloc_retries - b.num_alloc_retries
        mallocs = f.num_device_alloc - b.num_device_alloc
        gap = f.reserved_bytes - f.allocated_bytes
        gap_ratio = gap / f.reserved_bytes if f.reserved_bytes else 0.0
        split_ratio = f.inactive_split_bytes / f.reserved_bytes if f.reserved_bytes else 0.0
        ooms = f.num_ooms - b.num_ooms
        w = sw.name
        ev = [
            _ev("alloc retries in window", retries, T.ALLOC_RETRIES_MIN,
                a.warm and retries >= T.ALLOC_RETRIES_MIN, 0.6, where=w),
            _ev("cudaMalloc calls after warm-up", mallocs, T.DEVICE_ALLOCS_GROWTH_MIN,
                a.warm and mallocs >= T.DEVICE_ALLOCS_GROWTH_MIN, 0.5, where=w),
            _ev("reserved-minus-allocated ratio", gap_ratio, T.RESERVED_GAP_RATIO,
                gap_ratio > T.RESERVED_GAP_RATIO and gap >= T.RESERVED_GAP_MIN_BYTES, 0.25,
                where=w),
            _ev("inactive split / reserved", split_ratio, T.INACTIVE_SPLIT_RATIO,
                split_ratio > T.INACTIVE_SPLIT_RATIO, 0.2, where=w),
            _ev("new forward shapes after warm-up", a.shapes_added, T.NEW_SHAPES_MIN,
                a.warm and a.shapes_added >= T.NEW_SHAPES_MIN, 0.3, where=w),
            _ev("KV tensors allocated after warm-up", a.kv_allocations_added, 1,
                a.warm and a.kv_allocations_added >= 1, 0.2, where=w),
            _ev("allocator OOMs in window", ooms, 1, ooms >= 1, 0.3, where=w),
        ]  # fmt: skip
        conf = _combine(ev)
        if conf >= best[0]:
            best = (conf, ev, w)
    conf, ev, where = best
    if not ev:
        summary = "no device allocator figures (CPU run, or the server exports none)"
    else:
        summary = _summary(ev, "allocator flat after warm-up")
    return Finding(
        cause=Cause.FRAGMENTATION,
        title="CUDA allocator fragmentation",
        confidence=conf,
        summary=summary,
        evidence=tuple(ev),
        where=where,
        fix=(
            "serve with tailguard's engine: one KV block pool sized at start-up and forwards "
            "padded to fixed (batch, tokens) buckets, so the allocator sees only cached shapes",
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA initialises "
            "(TORCH_CUDA_ALLOC_CONF is ignored; do not combine with max_split_size_mb)",
            "if new shapes keep appearing, add the missing bucket instead of running unpadded",
        ),
    )


# --- dispatcher / thread starvation ---------------------------------------------------------


@dataclass(frozen=True)
class HostFigures:
    threads: float  # exported intra-op threads, less one per HTTP front-end
    runnable: float | None  # mean runnable threads sampled from /proc; None: not sampled
    cpu: float  # cores' worth of CPU used by the servers' processes


def _host_figures(obs: Observation) -> dict[str, HostFigures]:
    """Per host, adding up the servers that share it.

    Exported threads: every process's `tailguard_compute_threads`, less the one thread of each
    HTTP front-end (`process="server"`): tailguard's layout gives it 1 thread and no model work.
    Runnable: threads running or waiting for a core, sampled by the doctor from /proc over the
    servers' process trees: the direct measure of "more compute threads than cores".
    CPU: the larger of the exported CPU counter and the /proc figure.
    """
    threads: dict[str, float] = defaultdict(float)
    runnable: dict[str, float] = {}
    cpu: dict[str, float] = defaultdict(float)
    cpu_proc: dict[str, float] = defaultdict(float)
    window = max(obs.window_s, 1e-9)
    for sw in obs.servers:
        front_end = min(1.0, sw.after.get("tailguard_compute_threads", process="server"))
        threads[sw.host] += sw.after.get("tailguard_compute_threads") - front_end
        cpu[sw.host] += sw.delta("tailguard_process_cpu_seconds_total") / window
        proc = sw.watch.proc if sw.watch is not None else None
        if proc is not None:
            runnable[sw.host] = runnable.get(sw.host, 0.0) + proc.runnable_mean
            cpu_proc[sw.host] += proc.cpu_s / window
    return {
        h: HostFigures(threads[h], runnable.get(h), max(cpu[h], cpu_proc[h]))
        for h in {sw.host for sw in obs.servers}
    }


def probe_slow_share(sw: ServerWindow, bound_s: float) -> float:
    """Share of the doctor's own /health probes slower than `bound_s` (no answer counts)."""
    lat = sw.watch.probe_latencies if sw.watch is not None else []
    return sum(1 for x in lat if x > bound_s) / len(lat) if lat else 0.0


def starvation(obs: Observation, sym: Symptom) -> Finding:
    sla = sym.sla_s
    hosts = _host_figures(obs)
    best: tuple[float, list[Evidence], str] = (0.0, [], "")
    for sw in obs.servers:
        w = sw.name
        cap = capacity(sw, obs.window_s)
        not_full = not cap.saturated
        lag = sw.hist("tailguard_event_loop_lag_seconds")
        bound = T.LOOP_LAG_SLA_FRACTION * sla
        # The server's own lag probe if it exports one; else (or if worse) the doctor's probe.
        lag_share = max(lag.share_over(bound) if lag.count > 0 else 0.0,
                        probe_slow_share(sw, bound))  # fmt: skip
        q_share = queue_slow_share(sw, sla)
        hf = hosts[sw.host]
        host_busy = -1.0 if obs.host_cpu_busy is None else obs.host_cpu_busy
        cores = max(1, obs.host_cores)
        run_pc = -1.0 if hf.runnable is None else hf.runnable / cores
        gc_share = sw.delta("tailguard_gc_pause_seconds_total") / max(obs.window_s, 1e-9)
        ev = [
            _ev("event-loop lag share over SLA/3 (server's probe or the doctor's)", lag_share,
                T.LOOP_LAG_SLOW_SHARE,
                lag_share > T.LOOP_LAG_SLOW_SHARE, 0.45, where=w),
            _ev("queue-time share over SLA/2, engine not at capacity", q_share,
                T.QUEUE_SLOW_SHARE, not_full and q_share > T.QUEUE_SLOW_SHARE, 0.4, where=w),
            _ev("compute threads per core on host (exported)", hf.threads / cores,
                T.OVERSUBSCRIPTION_RATIO, hf.threads / cores > T.OVERSUBSCRIPTION_RATIO, 0.3,
                unit="x", where=sw.host),
            _ev("runnable threads per core (sampled from /proc)", run_pc,
                T.OVERSUBSCRIPTION_RATIO, run_pc > T.OVERSUBSCRIPTION_RATIO, 0.5, unit="x",
                where=sw.host),
            _ev("GC pause share of wall time", gc_share, T.GC_SHARE, gc_share > T.GC_SHARE, 0.3,
                where=w),
            _ev("servers' CPU busy (cores used / cores)", hf.cpu / cores, T.CPU_SATURATION,
                hf.cpu / cores > T.CPU_SATURATION, 0.15, where=sw.host),
            _ev("host CPU busy, all processes (/proc/stat)", host_busy, T.CPU_SATURATION,
                host_busy > T.CPU_SATURATION, 0.15, where="this host"),
            _ev("mean batch fill", -1.0 if cap.fill is None else cap.fill, T.BATCH_FULL_RATIO,
                False, 0.0, where=w),
            _ev("engine busy (step time / window)", cap.busy, T.ENGINE_BUSY_RATIO, False, 0.0,
                where=w),
        ]  # fmt: skip
        conf = _combine(ev)
        if not not_full:  # the engine is at capacity: dispatch is not what limits it
            conf = round(conf * 0.3, 3)
        if conf >= best[0]:
            best = (conf, ev, w)
    conf, ev, where = best
    summary = _summary(ev, "dispatch keeps up (no loop lag, queue short)")
    servers_busy = max((h.cpu for h in hosts.values()), default=0.0) / max(1, obs.host_cores)
    if (obs.host_cpu_busy or 0.0) > T.CPU_SATURATION and servers_busy < 0.5:
        # The threads wait for cores that other processes hold: a neighbour, not our layout.
        summary = (f"the host is busy ({obs.host_cpu_busy:.0%}) but the servers use only "
                   f"{servers_busy:.0%} of it: other processes take the cores; move them or "
                   f"pin the server to its own cores ({summary})")  # fmt: skip
    return Finding(
        cause=Cause.STARVATION,
        title="dispatcher / thread starvation",
        confidence=conf,
        summary=summary,
        evidence=tuple(ev),
        where=where,
        fix=(
            "run the model in one engine process that batches all admitted work; keep the HTTP "
            "event loop free of model calls (no per-request forward in a thread pool)",
            "intra-op threads = physical cores in the model process, 1 everywhere else "
            "(OMP_NUM_THREADS / torch.set_num_threads); never cores x 2",
            "one replica per host unless each gets its own cores (taskset / cpusets)",
        ),
    )


# --- connection churn -------------------------------------------------------------------------


def churn(obs: Observation, sym: Symptom) -> Finding:
    ev: list[Evidence] = []
    if obs.envoy_before is not None and obs.envoy_after is not None:
        b, a = obs.envoy_before, obs.envoy_after

        def d(prefix: str, suffix: str) -> float:
            skip = ("admin",)
            return max(0.0, envoy_sum(a, prefix, suffix, skip) - envoy_sum(b, prefix, suffix, skip))

        def g(prefix: str, suffix: str) -> float:  # gauge change (connections still open)
            skip = ("admin",)
            return envoy_sum(a, prefix, suffix, skip) - envoy_sum(b, prefix, suffix, skip)

        rq = d("http", "downstream_rq_total")
        # Connections closed in the window: opened minus the growth of those still open.
        # Opening connections because concurrency grew (a queue) is not churn.
        cx = max(0.0, d("http", "downstream_cx_total") - g("http", "downstream_cx_active"))
        tls = d("listener", "ssl.handshake")
        cap_down = d("http", "downstream_cx_max_requests_reached")
        cap_up = d("cluster", "upstream_cx_max_requests")
        up_rq = d("cluster", "upstream_rq_total")
        up_cx = max(0.0, d("cluster", "upstream_cx_total") - g("cluster", "upstream_cx_active"))
        torn = d("cluster", "upstream_cx_destroy_local_with_active_rq") + d(
            "cluster", "upstream_cx_destroy_remote_with_active_rq"
        )
        ev += [
            _ev("downstream_cx_max_requests_reached", cap_down, T.MAX_REQUESTS_HIT_MIN,
                cap_down >= T.MAX_REQUESTS_HIT_MIN, 0.6, where="envoy"),
            _ev("upstream_cx_max_requests", cap_up, T.MAX_REQUESTS_HIT_MIN,
                cap_up >= T.MAX_REQUESTS_HIT_MIN, 0.5, where="envoy"),
            _ev("downstream connections closed per request", cx / rq if rq else 0.0,
                T.CX_PER_REQUEST, rq > 0 and cx / rq > T.CX_PER_REQUEST, 0.45, where="envoy"),
            _ev("upstream connections closed per request", up_cx / up_rq if up_rq else 0.0,
                T.CX_PER_REQUEST, up_rq > 0 and up_cx / up_rq > T.CX_PER_REQUEST, 0.3,
                where="envoy"),
            _ev("TLS handshakes per request", tls / rq if rq else 0.0, T.TLS_PER_REQUEST,
                rq > 0 and tls / rq > T.TLS_PER_REQUEST, 0.3, where="envoy"),
            _ev("upstream connections torn down with a request on them", torn, 1,
                torn >= 1, 0.3, where="envoy"),
        ]  # fmt: skip
    for sw in obs.servers:
        rq = requests_in_window(sw)
        opened = sw.delta("tailguard_connections_opened_total")
        grew = sw.after.get("tailguard_connections_active") - sw.before.get(
            "tailguard_connections_active"
        )
        cx = max(0.0, opened - grew)
        if sw.has("tailguard_connections_opened_total") and rq > 0:
            ev.append(
                _ev("server connections closed per request", cx / rq, T.CX_PER_REQUEST,
                    cx / rq > T.CX_PER_REQUEST, 0.45, where=sw.name)
            )  # fmt: skip
    if obs.load is not None and obs.load.known_connection:
        ld = obs.load
        ev += [
            _ev("client reconnects per request (new connections beyond peak concurrency)",
                ld.reconnects_per_request, T.CX_PER_REQUEST,
                ld.reconnects_per_request > T.CX_PER_REQUEST, 0.3, where="load report"),
            # Only when some connections replaced closed ones: set-up paid because concurrency
            # grew (opening the pool) is not churn.
            _ev("requests that connection set-up pushed over the SLA", ld.slow_from_connect,
                T.SLOW_NEW_CX_MIN, ld.slow_from_connect >= T.SLOW_NEW_CX_MIN
                and ld.new_connections > ld.peak_in_flight, 0.45, where="load report"),
            _ev("mean connect time of new connections", ld.mean_connect_s, None, False, 0.0,
                unit="s", where="load report"),
        ]  # fmt: skip
    conf = _combine(ev)
    return Finding(
        cause=Cause.CHURN,
        title="connection churn (TCP/TLS set-up on the request path)",
        confidence=conf,
        summary=_summary(ev, "connections are reused" if ev else "no connection figures"),
        evidence=tuple(ev),
        where="envoy" if obs.has_envoy else (obs.servers[0].name if obs.servers else ""),
        fix=(
            "remove max_requests_per_connection (HttpProtocolOptions under "
            "common_http_protocol_options, downstream and upstream) or set it very high; "
            "`tailguard deploy envoy` renders it unset and its drift check fails on low values",
            "keep the server's keep-alive timeout longer than Envoy's upstream idle_timeout",
            "clients: keep connections alive and pool them (aiohttp TCPConnector(limit=0))",
        ),
    )


# --- plain overload ------------------------------------------------------------------------------


def overload(obs: Observation, sym: Symptom) -> Finding:
    sla = sym.sla_s
    client: list[Evidence] = []
    if obs.load is not None and obs.load.requests:
        refused = obs.load.refused / obs.load.requests
        client.append(
            _ev("client refused share (429/503)", refused, T.REJECT_SHARE,
                refused > T.REJECT_SHARE, 0.3, where="load report")
        )  # fmt: skip
    client_refusing = any(e.fired for e in client)
    best: tuple[float, list[Evidence], str] = (0.0, list(client), "")
    over_refusing = False
    for sw in obs.servers:
        w = sw.name
        c = capacity(sw, obs.window_s)
        full = c.saturated
        rq = requests_in_window(sw)
        # Answers from the degradation cache under overload are shed load too, only politer.
        rejected = (
            sw.delta("tailguard_rejections_total", reason="overloaded")
            + sw.delta("tailguard_rejections_total", reason="expired")
            + sw.delta("tailguard_cache_hits_total", reason="overload")
        )
        rej_share = rejected / rq if rq else 0.0
        wait_b = sw.before.get("tailguard_requests_waiting")
        wait_a = sw.after.get("tailguard_requests_waiting")
        cap = sw.after.get("tailguard_max_num_seqs")
        backlog = wait_a >= max(T.WAITING_MIN, cap) and wait_a > wait_b
        q_share = queue_slow_share(sw, sla)
        preempt = sw.delta("tailguard_preemptions_total")
        ev = [
            _ev("mean batch fill", -1.0 if c.fill is None else c.fill, T.BATCH_FULL_RATIO,
                c.fill is not None and c.fill >= T.BATCH_FULL_RATIO, 0.3, where=w),
            _ev("engine busy (step time / window) with requests in its queue", c.busy,
                T.ENGINE_BUSY_RATIO, c.busy_with_queue, 0.3, where=w),
            _ev("queue-time share over SLA/2", q_share, T.QUEUE_SLOW_SHARE,
                q_share > T.QUEUE_SLOW_SHARE, 0.35, where=w),
            _ev("waiting queue growth (before -> after)", wait_a - wait_b, max(T.WAITING_MIN, cap),
                backlog, 0.3, where=w),
            _ev("refused or answered from cache (overloaded, expired) per request", rej_share,
                T.REJECT_SHARE,
                rej_share > T.REJECT_SHARE, 0.3, where=w),
            _ev("preemptions for KV space", preempt, 1, preempt >= 1 and full, 0.15, where=w),
            *client,
        ]  # fmt: skip
        conf = _combine(ev)
        refusing = rej_share > T.REJECT_SHARE or client_refusing
        # An engine that reports steps but was mostly idle is not over capacity, refusals or not.
        idle = sw.has("tailguard_engine_step_seconds_sum") and c.busy < T.ENGINE_BUSY_RATIO
        if not full and (not refusing or idle):
            conf = round(conf * 0.3, 3)  # queueing with room in the engine: a dispatch problem
        if conf >= best[0]:
            best = (conf, ev, w)
            over_refusing = refusing and idle and not full
    conf, ev, where = best
    if not obs.servers:
        conf = round(_combine(ev) * 0.5, 3)  # refusals alone, without server figures
    summary = _summary(ev, "queue short, batches have room")
    if obs.servers and over_refusing:
        summary = ("refusing while the engine was mostly idle: admission control over-refuses "
                   f"(check its cost model), not demand above capacity ({summary})")  # fmt: skip
    if not sym.tail and conf >= T.CAUSE_MIN_CONFIDENCE:
        # Admission control shedding load while admitted requests meet the SLA: no spike to
        # explain. Say so as a note: the answer is capacity or pacing, not tuning.
        conf = min(conf, T.CAUSE_MIN_CONFIDENCE - 0.05)
        summary = f"shedding load, admitted requests within SLA ({summary})"
    return Finding(
        cause=Cause.OVERLOAD,
        title="plain overload (demand above capacity)",
        confidence=conf,
        summary=summary,
        evidence=tuple(ev),
        where=where,
        fix=(
            "add capacity (replicas, a bigger device) or pace the clients: this is not a tuning "
            "problem",
            "keep admission control on so excess is refused fast with Retry-After instead of "
            "queueing past the SLA; batch clients should follow Retry-After "
            "(`tailguard batch` does)",
        ),
    )


RULES: tuple[Callable[[Observation, Symptom], Finding], ...] = (
    fragmentation,
    starvation,
    churn,
    overload,
)


@dataclass(frozen=True)
class Diagnosis:
    window_s: float
    symptom: Symptom
    causes: tuple[Finding, ...]  # most likely first; empty when healthy
    notes: tuple[Finding, ...]  # rules that looked and did not name a cause
    collection_notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def verdict(self) -> Cause:
        if self.causes:
            return self.causes[0].cause
        return Cause.UNEXPLAINED if self.symptom.tail else Cause.NONE

    @property
    def exit_code(self) -> int:
        """0 healthy; 1 a cause named, or a tail no rule explains (not healthy either)."""
        return 0 if self.verdict is Cause.NONE else 1


def diagnose(obs: Observation) -> Diagnosis:
    sym = symptom(obs)
    findings = [rule(obs, sym) for rule in RULES]
    if not sym.enough_traffic:
        # Too few requests to judge shares; configuration signals still count.
        findings = [f if f.cause is not Cause.STARVATION else _demote(f) for f in findings]
    ranked = sorted(findings, key=lambda f: f.confidence, reverse=True)
    return Diagnosis(
        window_s=obs.window_s,
        symptom=sym,
        causes=tuple(f for f in ranked if f.is_cause),
        notes=tuple(f for f in ranked if not f.is_cause),
        collection_notes=obs.notes,
    )


def _demote(f: Finding) -> Finding:
    conf = min(f.confidence, T.CAUSE_MIN_CONFIDENCE - 0.05)
    return Finding(f.cause, f.title, conf, f.summary + " (too little traffic to judge)",
                   f.evidence, f.fix, f.where)  # fmt: skip


__all__ = ["RULES", "Cause", "Diagnosis", "Evidence", "Finding", "diagnose"]

"""The rules for the server's own layout and its connections: fragmentation, starvation, churn.

Each returns a Finding (finding.py) with its numbers, a confidence and the fix. Weights are
chosen so that a single weak signal stays under `CAUSE_MIN_CONFIDENCE`. The engine-side rules
(overload, KV, prefill, admission) are in rules_engine.py, the host's (neighbours, GC) in
rules_host.py; diagnosis.py runs them all.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tailguard.tools.doctor import thresholds as T
from tailguard.tools.doctor.finding import Cause, Evidence, Finding, combine
from tailguard.tools.doctor.finding import ev as _ev
from tailguard.tools.doctor.finding import summary as _summary
from tailguard.tools.doctor.observation import (
    LATENCY,
    Observation,
    ServerWindow,
    Symptom,
    allocator_window,
)
from tailguard.tools.doctor.snapshot import Snapshot, envoy_sum


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

    backlog_only: bool = False  # no step or batch figures (vLLM): a growing queue is the sign
    decode_slowdown: float | None = None  # vLLM: per-token time in the window / before it

    @property
    def batch_outgrown(self) -> bool:
        """vLLM: the running batch outgrew the hardware (per-token time rose DECODE_SLOWDOWN x)."""
        s = self.decode_slowdown
        return self.backlog_only and s is not None and s >= T.DECODE_SLOWDOWN

    @property
    def saturated(self) -> bool:
        full = self.fill is not None and self.fill >= T.BATCH_FULL_RATIO
        backlog = self.backlog_only and self.waiting >= T.WAITING_MIN
        return full or self.busy_with_queue or backlog or self.batch_outgrown


TPOT = "tailguard_time_per_output_token_seconds"


def decode_slowdown(sw: ServerWindow) -> float | None:
    """Mean per-token time in the window over the server's own mean before it (its history);
    None without both."""
    h = sw.hist(TPOT)
    n0 = sw.before.get(TPOT + "_count")
    if h.count <= 0 or n0 <= 0:
        return None
    before = sw.before.get(TPOT + "_sum") / n0
    return h.mean / before if before > 0 else None


def capacity(sw: ServerWindow, window_s: float) -> Capacity:
    busy = sw.delta("tailguard_engine_step_seconds_sum") / max(window_s, 1e-9)
    waiting = max(sw.before.get("tailguard_requests_waiting"),
                  sw.after.get("tailguard_requests_waiting"))  # fmt: skip
    # vLLM's scheduler leaves a request waiting only when the batch or the KV pool is full, so
    # a queue of 8+ there means at capacity (it exports no step time or max_num_seqs).
    vllm = sw.kind == "vllm"
    return Capacity(fill=batch_fill(sw), busy=busy, waiting=waiting, backlog_only=vllm,
                    decode_slowdown=decode_slowdown(sw) if vllm else None)  # fmt: skip


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
                a.warm and retries >= T.ALLOC_RETRIES_MIN, 0.6, where=w, risk=True),
            _ev("cudaMalloc calls after warm-up", mallocs, T.DEVICE_ALLOCS_GROWTH_MIN,
                a.warm and mallocs >= T.DEVICE_ALLOCS_GROWTH_MIN, 0.5, where=w, risk=True),
            _ev("reserved-minus-allocated ratio", gap_ratio, T.RESERVED_GAP_RATIO,
                gap_ratio > T.RESERVED_GAP_RATIO and gap >= T.RESERVED_GAP_MIN_BYTES, 0.25,
                where=w),
            _ev("inactive split / reserved", split_ratio, T.INACTIVE_SPLIT_RATIO,
                split_ratio > T.INACTIVE_SPLIT_RATIO, 0.2, where=w),
            _ev("new forward shapes after warm-up", a.shapes_added, T.NEW_SHAPES_MIN,
                a.warm and a.shapes_added >= T.NEW_SHAPES_MIN, 0.3, where=w, risk=True),
            _ev("KV tensors allocated after warm-up", a.kv_allocations_added, 1,
                a.warm and a.kv_allocations_added >= 1, 0.2, where=w, risk=True),
            _ev("allocator OOMs in window", ooms, 1, ooms >= 1, 0.3, where=w, risk=True),
        ]  # fmt: skip
        conf = combine(ev)
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


def lag_slow_share(sw: ServerWindow, sla_s: float) -> float:
    """Share of event-loop lag samples over SLA/3: the server's own lag metric, or the doctor's
    probe when that is worse (or the only one)."""
    lag = sw.hist("tailguard_event_loop_lag_seconds")
    bound = T.LOOP_LAG_SLA_FRACTION * sla_s
    return max(lag.share_over(bound) if lag.count > 0 else 0.0, probe_slow_share(sw, bound))


def starvation(obs: Observation, sym: Symptom) -> Finding:
    sla = sym.sla_s
    hosts = _host_figures(obs)
    best: tuple[float, list[Evidence], str] = (0.0, [], "")
    for sw in obs.servers:
        w = sw.name
        cap = capacity(sw, obs.window_s)
        not_full = not cap.saturated
        lag_share = lag_slow_share(sw, sla)
        q_share = queue_slow_share(sw, sla)
        hf = hosts[sw.host]
        host_busy = -1.0 if obs.host_cpu_busy is None else obs.host_cpu_busy
        cores = max(1, obs.host_cores)
        run_pc = -1.0 if hf.runnable is None else hf.runnable / cores
        ev = [
            _ev("event-loop lag share over SLA/3 (server's probe or the doctor's)", lag_share,
                T.LOOP_LAG_SLOW_SHARE,
                lag_share > T.LOOP_LAG_SLOW_SHARE, 0.45, where=w),
            _ev("queue-time share over SLA/2, engine not at capacity", q_share,
                T.QUEUE_SLOW_SHARE, not_full and q_share > T.QUEUE_SLOW_SHARE, 0.4, where=w),
            _ev("compute threads per core on host (exported)", hf.threads / cores,
                T.OVERSUBSCRIPTION_RATIO, hf.threads / cores > T.OVERSUBSCRIPTION_RATIO, 0.3,
                unit="x", where=sw.host, risk=True),
            _ev("the servers' runnable threads per core (sampled from /proc)", run_pc,
                T.OVERSUBSCRIPTION_RATIO, run_pc > T.OVERSUBSCRIPTION_RATIO, 0.5, unit="x",
                where=sw.host, risk=True),
            _ev("servers' CPU busy (cores used / cores)", hf.cpu / cores, T.CPU_SATURATION,
                hf.cpu / cores > T.CPU_SATURATION, 0.15, where=sw.host),
            # Whoever keeps the host busy: read for context only (other processes' CPU is the
            # noisy-neighbour rule's evidence, never this server's own starvation).
            _ev("host CPU busy, all processes (/proc/stat)", host_busy, T.CPU_SATURATION,
                False, 0.0, where="this host"),
            _ev("mean batch fill", -1.0 if cap.fill is None else cap.fill, T.BATCH_FULL_RATIO,
                False, 0.0, where=w),
            _ev("engine busy (step time / window)", cap.busy, T.ENGINE_BUSY_RATIO, False, 0.0,
                where=w),
        ]  # fmt: skip
        conf = combine(ev)
        if not not_full:  # the engine is at capacity: dispatch is not what limits it
            conf = round(conf * 0.3, 3)
        if conf >= best[0]:
            best = (conf, ev, w)
    conf, ev, where = best
    summary = _summary(ev, "dispatch keeps up (no loop lag, queue short)")
    others = sum(n.cpu_cores for n in obs.neighbours) / max(1, obs.host_cores)
    own_layout = any(e.fired and e.risk for e in ev)
    if others > T.NEIGHBOUR_CPU_SHARE and not own_layout:
        # The threads wait for cores that other processes hold: a neighbour, not our layout.
        conf = round(conf * 0.3, 3)
        summary = (f"other processes use {others:.0%} of the host's cores and the servers' own "
                   f"threads fit their cores: see noisy_neighbour ({summary})")  # fmt: skip
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


def _envoy_churn(b: Snapshot, a: Snapshot) -> list[Evidence]:
    """Churn evidence from Envoy's counters at both ends of the window."""

    def d(prefix: str, suffix: str) -> float:
        skip = ("admin",)
        return max(0.0, envoy_sum(a, prefix, suffix, skip) - envoy_sum(b, prefix, suffix, skip))

    def g(prefix: str, suffix: str) -> float:  # gauge at the end (connections still open)
        return envoy_sum(a, prefix, suffix, ("admin",))

    rq = d("http", "downstream_rq_total")
    # Connections opened in the window and closed again: at least opened minus all still
    # open at its end. Opening connections because concurrency grew (a queue) is not churn,
    # and neither is the closing of connections opened before it (a client that left).
    cx = max(0.0, d("http", "downstream_cx_total") - g("http", "downstream_cx_active"))
    tls = d("listener", "ssl.handshake")
    cap_down = d("http", "downstream_cx_max_requests_reached")
    cap_up = d("cluster", "upstream_cx_max_requests")
    up_rq = d("cluster", "upstream_rq_total")
    up_cx = max(0.0, d("cluster", "upstream_cx_total") - g("cluster", "upstream_cx_active"))
    torn = d("cluster", "upstream_cx_destroy_local_with_active_rq") + d(
        "cluster", "upstream_cx_destroy_remote_with_active_rq"
    )
    return [
        _ev("downstream_cx_max_requests_reached", cap_down, T.MAX_REQUESTS_HIT_MIN,
            cap_down >= T.MAX_REQUESTS_HIT_MIN, 0.6, where="envoy", risk=True),
        _ev("upstream_cx_max_requests", cap_up, T.MAX_REQUESTS_HIT_MIN,
            cap_up >= T.MAX_REQUESTS_HIT_MIN, 0.5, where="envoy", risk=True),
        _ev("downstream connections closed per request", cx / rq if rq else 0.0,
            T.CX_PER_REQUEST, rq > 0 and cx >= T.CX_CLOSED_MIN and cx / rq > T.CX_PER_REQUEST,
            0.45, where="envoy", risk=True),
        _ev("upstream connections closed per request", up_cx / up_rq if up_rq else 0.0,
            T.CX_PER_REQUEST, up_rq > 0 and up_cx >= T.CX_CLOSED_MIN
            and up_cx / up_rq > T.CX_PER_REQUEST, 0.3,
            where="envoy", risk=True),
        _ev("TLS handshakes per request", tls / rq if rq else 0.0, T.TLS_PER_REQUEST,
            rq > 0 and tls >= T.CX_CLOSED_MIN and tls / rq > T.TLS_PER_REQUEST, 0.3,
            where="envoy", risk=True),
        _ev("upstream connections torn down with a request on them", torn, 1,
            torn >= 1, 0.3, where="envoy", risk=True),
    ]  # fmt: skip


def churn(obs: Observation, sym: Symptom) -> Finding:
    ev: list[Evidence] = []
    if obs.envoy_before is not None and obs.envoy_after is not None:
        ev += _envoy_churn(obs.envoy_before, obs.envoy_after)
    for sw in obs.servers:
        rq = requests_in_window(sw)
        opened = sw.delta("tailguard_connections_opened_total")
        cx = max(0.0, opened - sw.after.get("tailguard_connections_active"))  # as for Envoy
        if sw.has("tailguard_connections_opened_total") and rq > 0:
            ev.append(
                _ev("server connections closed per request", cx / rq, T.CX_PER_REQUEST,
                    cx >= T.CX_CLOSED_MIN and cx / rq > T.CX_PER_REQUEST, 0.45, where=sw.name,
                    risk=True)
            )  # fmt: skip
    if obs.load is not None and obs.load.known_connection:
        ld = obs.load
        ev += [
            _ev("client reconnects per request (new connections beyond peak concurrency)",
                ld.reconnects_per_request, T.CX_PER_REQUEST,
                ld.reconnects_per_request > T.CX_PER_REQUEST
                and ld.new_connections - ld.peak_in_flight >= T.CX_CLOSED_MIN, 0.3,
                where="load report", risk=True),
            # Only when some connections replaced closed ones: set-up paid because concurrency
            # grew (opening the pool) is not churn.
            _ev("requests that connection set-up pushed over the SLA", ld.slow_from_connect,
                T.SLOW_NEW_CX_MIN, ld.slow_from_connect >= T.SLOW_NEW_CX_MIN
                and ld.new_connections > ld.peak_in_flight, 0.45, where="load report"),
            _ev("mean connect time of new connections", ld.mean_connect_s, None, False, 0.0,
                unit="s", where="load report"),
        ]  # fmt: skip
    conf = combine(ev)
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


__all__ = [
    "Capacity",
    "capacity",
    "churn",
    "fragmentation",
    "lag_slow_share",
    "queue_slow_share",
    "requests_in_window",
    "starvation",
]

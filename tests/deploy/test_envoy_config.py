"""The generated Envoy config: typed settings refuse bad values; real Envoy loads the output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tailguard.deploy.envoy import (
    EnvoySettings,
    Replica,
    ServerLimits,
    find_envoy,
    render,
    render_yaml,
)
from tailguard.errors import ConfigError

TWO = (Replica("127.0.0.1", 8001), Replica("127.0.0.1", 8002))


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    return dict(listener["filter_chains"][0]["filters"][0]["typed_config"])


def _cluster(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config["static_resources"]["clusters"][0])


def _upstream(config: dict[str, Any]) -> dict[str, Any]:
    opts = _cluster(config)["typed_extension_protocol_options"]
    return dict(opts["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"])


def test_max_requests_per_connection_is_unset_downstream_and_upstream() -> None:
    config = render(EnvoySettings(replicas=TWO))
    assert "max_requests_per_connection" not in _hcm(config)["common_http_protocol_options"]
    assert "max_requests_per_connection" not in _upstream(config)["common_http_protocol_options"]
    assert "max_requests_per_connection" not in yaml.safe_dump(config)


def test_churn_reproduction_sets_it_where_envoy_reads_it() -> None:
    config = render(
        EnvoySettings(
            replicas=TWO,
            downstream_max_requests_per_connection=100,
            upstream_max_requests_per_connection=100,
        )
    )
    assert _hcm(config)["common_http_protocol_options"]["max_requests_per_connection"] == 100
    assert _upstream(config)["common_http_protocol_options"]["max_requests_per_connection"] == 100


def test_server_keepalive_outlives_envoy_upstream_idle_timeout() -> None:
    s = EnvoySettings(replicas=TWO, server=ServerLimits(keepalive_timeout_s=75))
    idle = _upstream(render(s))["common_http_protocol_options"]["idle_timeout"]
    assert float(idle.rstrip("s")) + s.keepalive_margin_s <= 75
    with pytest.raises(ConfigError, match=r"keepalive_timeout_s=30.*lower the Envoy idle"):
        EnvoySettings(replicas=TWO, server=ServerLimits(keepalive_timeout_s=30))


def test_breakers_sized_from_admission_limits() -> None:
    limits = ServerLimits(max_num_seqs=32, max_queued_requests=224)  # 256 per replica
    cluster = _cluster(render(EnvoySettings(replicas=TWO, server=limits)))
    t = cluster["circuit_breakers"]["thresholds"][0]
    assert t["max_requests"] == t["max_pending_requests"] == 512
    assert t["retry_budget"]["budget_percent"]["value"] == 20.0
    # k8s: one DNS name stands for up to --fleet-size pods
    dns = EnvoySettings(replicas=(Replica("svc.ns", 8000),), server=limits, fleet_size=8)
    cluster = _cluster(render(dns))
    assert cluster["cluster_type"]["name"] == "envoy.cluster.dns"
    assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] == 8 * 256


def test_health_retry_and_balancing_shape() -> None:
    config = render(EnvoySettings(replicas=TWO))
    cluster = _cluster(config)
    assert cluster["lb_policy"] == "LEAST_REQUEST"
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/ready"
    # an overloaded replica's 503 must not eject it; a dead one's connect failures must
    assert cluster["outlier_detection"]["enforcing_consecutive_5xx"] == 0
    assert cluster["outlier_detection"]["consecutive_local_origin_failure"] == 2
    route = _hcm(config)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    policy = route["retry_policy"]
    assert policy["retriable_status_codes"] == [503]
    assert {"reset", "connect-failure", "retriable-status-codes"} <= set(
        policy["retry_on"].split(",")
    )
    assert policy["rate_limited_retry_back_off"]["reset_headers"] == [
        {"name": "Retry-After", "format": "SECONDS"}
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": ()}, "no replicas"),
        ({"replicas": (TWO[0], TWO[0])}, "the same HOST:PORT twice"),
        ({"replicas": TWO, "tls_cert": "c.pem"}, "both --tls-cert and --tls-key"),
        ({"replicas": TWO, "downstream_max_requests_per_connection": 0}, "leave unset"),
        ({"replicas": TWO, "health_timeout_s": 2.0}, "checks overlap"),
    ],
)
def test_bad_settings_are_refused_with_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EnvoySettings(**kwargs)


def test_replica_parse() -> None:
    assert Replica.parse("10.0.0.1:8000") == Replica("10.0.0.1", 8000)
    assert Replica.parse("[::1]:8000").is_ip
    with pytest.raises(ConfigError, match="HOST:PORT"):
        Replica.parse("localhost")


@pytest.mark.parametrize("variant", ["plain", "tls+metrics", "h2-upstream+dns", "churn"])
def test_real_envoy_validates_the_config(
    variant: str, tmp_path: Path, tls_files: tuple[str, str]
) -> None:
    settings: dict[str, Any] = {"replicas": TWO}
    if variant == "tls+metrics":
        settings.update(tls_cert=tls_files[0], tls_key=tls_files[1], metrics_port=9902)
    elif variant == "h2-upstream+dns":
        settings.update(
            replicas=(Replica("tailguard.ns.svc.cluster.local", 8000),),
            upstream_http2=True,
            fleet_size=4,
        )
    elif variant == "churn":
        settings.update(
            downstream_max_requests_per_connection=100, upstream_max_requests_per_connection=100
        )
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(EnvoySettings(**settings)))
    out = subprocess.run(
        [str(find_envoy()), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout + out.stderr
    assert "deprecated" not in (out.stdout + out.stderr).lower()


def test_real_envoy_rejects_a_broken_config(tmp_path: Path) -> None:
    """The validation step can fail: a misspelt field is refused by Envoy."""
    config = render(EnvoySettings(replicas=TWO))
    config["static_resources"]["clusters"][0]["lb_polcy"] = "LEAST_REQUEST"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [str(find_envoy()), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0


def test_cli_sizes_from_print_config_dump(tmp_path: Path) -> None:
    dump = tmp_path / "server.json"
    dump.write_text(
        '{"keepalive_timeout_s": 120, "max_num_seqs": 16, "max_queued_requests": 48,'
        ' "sla_ms": 150, "host": "127.0.0.1", "port": 8000}'
    )
    out = tmp_path / "envoy.yaml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tailguard.cli",
            "deploy",
            "envoy",
            "--replicas",
            "127.0.0.1:8001",
            "127.0.0.1:8002",
            "--server-config",
            str(dump),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    cluster = _cluster(yaml.safe_load(out.read_text()))
    assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] == 2 * (16 + 48)
    bad = subprocess.run(
        [sys.executable, "-m", "tailguard.cli", "deploy", "envoy", "--replicas", "nohost"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "expected HOST:PORT" in bad.stderr

"""Prometheus rules and config: promtool checks, rule unit tests, and a real Prometheus that
scrapes a backend and Envoy and evaluates the shipped recording rules."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import REPO, Backend, Envoy, free_port, http_get, wait_for

PROM = REPO / "deploy" / "prometheus"
RULES = PROM / "tailguard-rules.yml"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool missing: `make promtool` installs it"
)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


@needs_promtool
def test_promtool_check_rules_and_config() -> None:
    rules = _promtool("check", "rules", str(RULES))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = _promtool("check", "config", str(PROM / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr


@needs_promtool
def test_promtool_rule_unit_tests() -> None:
    tests = sorted(str(p) for p in (PROM / "tests").glob("*.test.yml"))
    assert tests
    out = _promtool("test", "rules", *tests)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_rule_tests_can_fail(tmp_path: Path) -> None:
    """Loosen the SLA alert to 0.9: the unit test that expects it to fire must now fail."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tailguard-rules.yml").write_text(
        RULES.read_text().replace("ratio_rate5m < 0.99", "ratio_rate5m < 0.9")
    )
    for test in (PROM / "tests").glob("*.test.yml"):
        shutil.copy(test, tmp_path / "tests" / test.name)
    out = _promtool("test", "rules", *map(str, (tmp_path / "tests").glob("*.test.yml")))
    assert out.returncode != 0
    assert "TailguardSLAShareLow" in out.stdout + out.stderr


def test_required_alerts_exist_and_sla_checks_use_buckets() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert {
        "TailguardSLAShareLow",
        "TailguardRequestOver200ms",
        "EnvoyConnectionChurn",
        "EnvoyRequestsPerConnectionCapped",
        "TailguardQueueGrowingBatchNotFull",
        "TailguardEngineRestarted",
        "TailguardOOMRetries",
        "TailguardAllocatorRetries",
    } <= alerts
    exprs = " ".join(r["expr"] for r in rules)
    assert "histogram_quantile" not in exprs
    assert 'le="0.15"' in exprs and 'le="0.2"' in exprs


def _query(prom: str, expr: str) -> list[dict[str, Any]]:
    status, body = http_get(f"{prom}/api/v1/query?query={urllib.parse.quote(expr)}")
    if status != 200:
        return []
    return list(json.loads(body)["data"]["result"])


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus binary missing")
def test_real_prometheus_scrapes_backend_and_envoy_and_records(
    tmp_path: Path, start_backend: Any, start_envoy: Any
) -> None:
    backend: Backend = start_backend("a")
    envoy: Envoy = start_envoy([backend])
    # The shipped rules, evaluated every second instead of every 15 s so the test is short.
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(tmp_path / "rules.yml")],
                "scrape_configs": [
                    {
                        "job_name": "tailguard",
                        "static_configs": [{"targets": [f"127.0.0.1:{backend.port}"]}],
                    },
                    {
                        "job_name": "envoy",
                        "metrics_path": "/stats/prometheus",
                        "static_configs": [{"targets": [f"127.0.0.1:{envoy.admin_port}"]}],
                    },
                ],
            }
        )
    )
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()

    def traffic() -> None:  # keep-alive client: one connection, many requests
        conn = http.client.HTTPConnection("127.0.0.1", envoy.listen_port, timeout=5)
        while not stop.is_set():
            conn.request(
                "POST",
                "/v1/infer",
                body=b'{"prompt": "x"}',
                headers={"Content-Type": "application/json"},
            )
            conn.getresponse().read()
            time.sleep(0.02)

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    try:
        wait_for(lambda: http_get(f"{url}/-/ready")[0] == 200, 30, "Prometheus ready", prom)
        wait_for(
            lambda: bool(_query(url, "tailguard:requests_within_sla:ratio_rate5m")),
            30,
            "the SLA recording rule",
            prom,
        )
        wait_for(
            lambda: bool(_query(url, "envoy:downstream_cx_per_rq:ratio_rate5m")),
            30,
            "the churn recording rule",
            prom,
        )
        share = _query(url, "tailguard:requests_within_sla:ratio_rate5m")[0]
        churn = _query(
            url, 'envoy:downstream_cx_per_rq:ratio_rate5m{envoy_http_conn_manager_prefix="ingress"}'
        )
        targets = json.loads(http_get(f"{url}/api/v1/targets")[1])["data"]["activeTargets"]
    finally:
        stop.set()
        sender.join(5)
        prom.terminate()
        prom.wait(10)
    assert share["metric"]["job"] == "tailguard"
    assert 0.9 <= float(share["value"][1]) <= 1.0  # a 5 ms stand-in: (almost) all within 0.15 s
    assert {t["labels"]["job"]: t["health"] for t in targets} == {"tailguard": "up", "envoy": "up"}
    # one keep-alive connection carried every request: far below the 0.05 churn threshold
    assert churn and float(churn[0]["value"][1]) < 0.05

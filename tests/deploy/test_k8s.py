"""Kubernetes manifests: schema-valid offline (kubernetes-validate ships the schemas), the
Envoy ConfigMap is exactly what the renderer produces, and it passes the drift check."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import REPO

K8S = REPO / "deploy" / "k8s"
kubernetes_validate = pytest.importorskip("kubernetes_validate")
K8S_VERSION = "1.33.0"  # oldest version we claim: preStop `sleep` needs >= 1.30


def _docs() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (path, doc)
        for path in sorted(K8S.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _find(kind: str, name: str) -> dict[str, Any]:
    return next(d for _, d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_every_manifest_is_schema_valid_strict() -> None:
    kinds = set()
    for path, doc in _docs():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any error
        kinds.add(doc["kind"])
        assert doc["metadata"].get("namespace", "tailguard") == "tailguard", path
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    } <= kinds


def test_validation_can_fail() -> None:
    bad = copy.deepcopy(_find("Deployment", "tailguard-server"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_server_probes_drain_and_resources() -> None:
    pod = _find("Deployment", "tailguard-server")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["lifecycle"]["preStop"]
    assert pod["terminationGracePeriodSeconds"] > c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert _find("Service", "tailguard-server")["spec"]["clusterIP"] == "None"  # per-pod DNS


def test_autoscaler_scales_on_in_flight_and_matches_envoy_fleet_size() -> None:
    hpa = _find("HorizontalPodAutoscaler", "tailguard-server")["spec"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "tailguard_requests_in_flight"
    assert "tailguard_requests_in_flight" in (REPO / "docs" / "metrics.md").read_text()
    envoy_manifest = (K8S / "envoy.yaml").read_text()
    fleet = re.search(r"--fleet-size (\d+)", envoy_manifest)
    assert fleet is not None and int(fleet.group(1)) == hpa["maxReplicas"]


def test_envoy_configmap_is_the_renderer_output_and_passes_drift_check() -> None:
    manifest = (K8S / "envoy.yaml").read_text()
    command = re.search(r"^#\s+(tailguard deploy envoy .+)$", manifest, re.M)
    assert command is not None
    args = command.group(1).split()[1:]
    rendered = subprocess.run(
        [sys.executable, "-m", "tailguard.cli", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    data = _find("ConfigMap", "tailguard-envoy")["data"]["envoy.yaml"]
    assert data == rendered, f"regenerate deploy/k8s/envoy.yaml with `{command.group(1)}`"
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "tailguard.cli",
            "deploy",
            "check",
            "--baseline",
            str(REPO / "deploy/baseline/tail.yaml"),
            "--config",
            str(K8S / "envoy.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    envoy = _find("Deployment", "tailguard-envoy")["spec"]["template"]["spec"]["containers"][0]
    prestop = " ".join(envoy["lifecycle"]["preStop"]["exec"]["command"])
    assert "drain_listeners?graceful" in prestop and "quitquitquit" not in prestop

"""The Grafana dashboard: generated from deploy/grafana/build_dashboard.py, structurally sound,
and reading only metrics that exist (docs/metrics.md, the recording rules, Envoy's stats)."""

from __future__ import annotations

import importlib.util
import json
import re
from typing import Any

import yaml

from .conftest import REPO

GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "tailguard.json"


def _load() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def documented_metrics() -> set[str]:
    """Names from the docs/metrics.md table, with the series a histogram exposes."""
    names = set()
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"\|\s*`([a-z_:]+)`\s*\|\s*(\w+)", line)
        if m is None:
            continue
        name, kind = m.groups()
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


def recorded_metrics() -> set[str]:
    groups = yaml.safe_load((REPO / "deploy/prometheus/tailguard-rules.yml").read_text())["groups"]
    return {r["record"] for g in groups for r in g["rules"] if "record" in r}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (identifiers not followed by '(' or in braces)."""
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # drop label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # and ranges
    words = [
        m.group()
        for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)
        if not expr[m.end() :].lstrip().startswith("(")
    ]  # a function, not a metric
    keywords = {
        "sum",
        "by",
        "on",
        "and",
        "or",
        "max",
        "rate",
        "increase",
        "le",
        "instance",
        "job",
        "reason",
        "histogram_quantile",
        "ignoring",
        "without",
    }
    return {w for w in words if w not in keywords and ("_" in w or ":" in w)}


def test_committed_json_is_the_generator_output() -> None:
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), (
        "run `.venv/bin/python deploy/grafana/build_dashboard.py` and commit tailguard.json"
    )


def test_structure() -> None:
    d = _load()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in d["templating"]["list"]}
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["refId"] and t["expr"]
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), (var, p["title"])


def test_required_panels() -> None:
    titles = " | ".join(p["title"].lower() for p in _load()["panels"])
    for needle in (
        "heatmap",
        "within sla",
        "queue",
        "batch size",
        "kv cache",
        "rejections",
        "cache hits",
        "connection churn",
        "event-loop lag",
        "allocator",
    ):
        assert needle in titles, needle
    heatmap = next(p for p in _load()["panels"] if p["type"] == "heatmap")
    assert heatmap["targets"][0]["format"] == "heatmap"
    sla = next(p for p in _load()["panels"] if "within sla" in p["title"].lower())
    steps = sla["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert any(s["value"] == 0.99 for s in steps)  # the SLA target drawn as a line
    assert sla["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "line"


def test_every_metric_exists() -> None:
    known = documented_metrics() | recorded_metrics()
    assert "mistral_inference_latency_seconds_bucket" in known  # the parser read the table
    for p in _load()["panels"]:
        for t in p["targets"]:
            for name in metric_names(t["expr"]):
                assert name in known or name.startswith("envoy_"), (name, p["title"])


def test_rules_read_only_documented_metrics() -> None:
    known = documented_metrics() | recorded_metrics()
    groups = yaml.safe_load((REPO / "deploy/prometheus/tailguard-rules.yml").read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        for name in metric_names(rule["expr"]):
            assert name in known or name.startswith("envoy_"), (name, rule)


def test_metric_name_parser() -> None:
    expr = 'sum by (job, le) (rate(foo_bar_bucket{le="0.2", job=~"$job"}[5m])) / x:y_z'
    assert metric_names(expr) == {"foo_bar_bucket", "x:y_z"}

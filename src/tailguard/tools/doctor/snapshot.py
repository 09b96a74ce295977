"""What the doctor reads: metric snapshots, histogram deltas and their parsers.

A snapshot is flat: (sample name, labels) -> value, the same shape whether it came from a
`/metrics` scrape, an Envoy `/stats` page or a Prometheus range query. Everything the rules
need is a difference between two snapshots over a known window.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs


class ParseError(ValueError):
    """A scrape or recorded file that is not in the format it claims to be."""


def _labels(d: Mapping[str, str]) -> Labels:
    return tuple(sorted(d.items()))


@dataclass(frozen=True)
class Snapshot:
    """One scrape. `values` sums duplicates (the same series from two scrapes is an error)."""

    values: Mapping[tuple[str, Labels], float] = field(default_factory=dict)

    def get(self, name: str, **match: str) -> float:
        """Sum of every series called `name` whose labels include `match` (0 when absent)."""
        want = set(match.items())
        return sum(v for (n, lab), v in self.values.items() if n == name and want <= set(lab))

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.values)

    def names(self) -> set[str]:
        return {n for n, _ in self.values}

    def series(self, name: str) -> dict[Labels, float]:
        return {lab: v for (n, lab), v in self.values.items() if n == name}

    def buckets(self, hist: str, **match: str) -> dict[float, float]:
        """Cumulative bucket counts of histogram `hist` by upper bound, summed over labels."""
        want = set(match.items())
        out: dict[float, float] = {}
        for (n, lab), v in self.values.items():
            if n != f"{hist}_bucket" or not want <= set(lab):
                continue
            le = dict(lab).get("le")
            if le is None:
                continue
            bound = math.inf if le in ("+Inf", "Inf", "inf") else float(le)
            out[bound] = out.get(bound, 0.0) + v
        return out


@dataclass(frozen=True)
class Histogram:
    """A histogram over a window: cumulative counts per upper bound (bounds ascending)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float
    count: float

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count > 0 else 0.0

    def share_le(self, x: float) -> float:
        """Share of observations <= the largest bound <= x (exact when x is a bound)."""
        if self.count <= 0:
            return 1.0
        below = 0.0
        for b, c in zip(self.bounds, self.cumulative, strict=True):
            if b <= x + 1e-12:
                below = c
        return below / self.count

    def share_over(self, x: float) -> float:
        return 1.0 - self.share_le(x)

    def quantile_upper(self, q: float) -> float:
        """Upper bound of the bucket holding quantile q: "p99 <= this", never interpolated."""
        if self.count <= 0:
            return 0.0
        need = q * self.count
        for b, c in zip(self.bounds, self.cumulative, strict=True):
            if c >= need - 1e-9:
                return b
        return math.inf


def histogram_delta(before: Snapshot, after: Snapshot, hist: str, **match: str) -> Histogram:
    """The histogram of observations made between two scrapes (a reset counts from zero)."""
    b_after = after.buckets(hist, **match)
    b_before = before.buckets(hist, **match)
    count_after = after.get(f"{hist}_count", **match)
    count_before = before.get(f"{hist}_count", **match)
    reset = count_after < count_before
    bounds = tuple(sorted(b_after))
    cum = tuple(b_after[b] - (0.0 if reset else b_before.get(b, 0.0)) for b in bounds)
    total = count_after - (0.0 if reset else count_before)
    s = after.get(f"{hist}_sum", **match) - (0.0 if reset else before.get(f"{hist}_sum", **match))
    if bounds and not math.isinf(bounds[-1]):  # a histogram always ends at +Inf
        bounds, cum = (*bounds, math.inf), (*cum, total)
    return Histogram(bounds=bounds, cumulative=cum, sum=s, count=total)


def counter_delta(before: Snapshot, after: Snapshot, name: str, **match: str) -> float:
    """Increase of a counter over the window; a restart (value fell) counts from zero."""
    a, b = after.get(name, **match), before.get(name, **match)
    return a if a < b else a - b


# --- parsers ---------------------------------------------------------------------------------


def parse_prometheus_text(text: str) -> Snapshot:
    """Prometheus text exposition format, through prometheus_client's own parser."""
    values: dict[tuple[str, Labels], float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, _labels(s.labels))
                values[key] = values.get(key, 0.0) + float(s.value)
    except ValueError as e:
        raise ParseError(f"not Prometheus text format ({e}); is the URL a /metrics page?") from e
    return Snapshot(values)


def parse_envoy_stats(text: str) -> Snapshot:
    """Envoy admin `/stats` (`name: value` lines) or `/stats?format=json`.

    Histogram lines (`P0(...)`) and text-readouts are skipped: the rules use counters and gauges.
    """
    values: dict[tuple[str, Labels], float] = {}
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            doc = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ParseError(f"Envoy /stats?format=json is not valid JSON: {e}") from e
        for item in doc.get("stats", []):
            value = item.get("value") if isinstance(item, dict) else None
            if isinstance(value, int | float) and "name" in item:
                values[(str(item["name"]), ())] = float(value)
        return Snapshot(values)
    for line in text.splitlines():
        name, sep, raw = line.partition(": ")
        if not sep:
            continue
        try:
            values[(name.strip(), ())] = float(raw.strip())
        except ValueError:
            continue  # histogram summaries, text readouts
    if not values and text.strip():
        raise ParseError("no `name: value` lines found; is the URL Envoy's admin /stats?")
    return Snapshot(values)


def parse_prometheus_range(doc: Mapping[str, object]) -> dict[str, tuple[Snapshot, Snapshot]]:
    """A Prometheus `/api/v1/query_range` answer -> per-instance (first, last) snapshots."""
    if doc.get("status") != "success":
        raise ParseError(f"Prometheus answered {doc.get('status')!r}: {doc.get('error', '')}")
    data = doc.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list):
        raise ParseError("Prometheus answer has no data.result list (is it a query_range answer?)")
    first: dict[str, dict[tuple[str, Labels], float]] = {}
    last: dict[str, dict[tuple[str, Labels], float]] = {}
    for series in result:
        metric = dict(series.get("metric", {}))
        points = series.get("values", [])
        if not points:
            continue
        name = metric.pop("__name__", "")
        instance = metric.pop("instance", "prometheus")
        metric.pop("job", None)
        key = (name, _labels(metric))
        # A series born inside the window was 0 at its start (counters) - the safe reading.
        v0 = float(points[0][1]) if len(points) > 1 else 0.0
        first.setdefault(instance, {})[key] = v0
        last.setdefault(instance, {})[key] = float(points[-1][1])
    return {i: (Snapshot(first[i]), Snapshot(last[i])) for i in last}


def envoy_sum(snap: Snapshot, prefix: str, suffix: str, skip: Iterable[str] = ()) -> float:
    """Sum of Envoy stats `prefix.<anything>.suffix`, e.g. ("http", "downstream_rq_total").

    `skip` names scopes to leave out (Envoy's own admin listener is `http.admin.*`).
    """
    skipped = tuple(f"{prefix}.{s}." for s in skip)
    total = 0.0
    for (name, _), v in snap.values.items():
        ours = name.startswith(prefix + ".") and name.endswith("." + suffix)
        if ours and not name.startswith(skipped):
            total += v
    return total

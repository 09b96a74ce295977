"""Server-side SLA checks from the server's own latency histogram (`--metrics-url`).

The histogram is scraped before and after the run; the difference covers this run only. SLA
checks use bucket counts (`bucket{le="0.15"} / count`), never `histogram_quantile`, which
interpolates inside a bucket and cannot prove "no request over 200 ms".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import aiohttp

__all__ = [
    "DEFAULT_HISTOGRAM",
    "BucketCheck",
    "HistogramSnapshot",
    "ServerSide",
    "compare",
    "parse_histogram",
    "scrape",
    "scrape_many",
]

DEFAULT_HISTOGRAM = "mistral_inference_latency_seconds"  # docs/metrics.md
SERVER_SLA_BOUNDS_S = (0.15, 0.2)  # the project's SLA buckets, always reported


@dataclass(frozen=True)
class HistogramSnapshot:
    """One scrape of a histogram, summed over all its label sets except `le`."""

    buckets: dict[float, float]  # upper bound (s) -> cumulative count; +Inf included
    count: float
    error: str | None = None  # why the scrape failed, if it did
    sum: float = 0.0  # `<name>_sum`, summed over label sets


@dataclass(frozen=True)
class BucketCheck:
    bound_s: float
    within: float  # requests the server answered within bound during the run
    share: float | None  # within / count; None when the server saw no requests


@dataclass(frozen=True)
class ServerSide:
    metric: str
    count: float  # requests the server recorded during the run
    checks: tuple[BucketCheck, ...]
    missing_bounds: tuple[float, ...]  # asked-for bounds the histogram has no bucket for
    error: str | None = None


def parse_histogram(text: str, name: str = DEFAULT_HISTOGRAM) -> HistogramSnapshot:
    """Sum `<name>_bucket` by `le`, and `<name>_count` and `<name>_sum`, over every other
    label."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(name + "_bucket"):
            le = _label(line, "le")
            if le is None:
                continue
            bound = math.inf if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + _value(line)
        elif line.startswith(name + "_count"):
            count += _value(line)
        elif line.startswith(name + "_sum"):
            total += _value(line)
    return HistogramSnapshot(buckets, count, sum=total)


def _label(line: str, key: str) -> str | None:
    start = line.find(key + '="')
    if start < 0:
        return None
    start += len(key) + 2
    return line[start : line.index('"', start)]


def _value(line: str) -> float:
    # the value follows the closing brace (or the name); an optional timestamp may follow it
    rest = line[line.rindex("}") + 1 :] if "}" in line else line.split(None, 1)[1]
    return float(rest.split()[0])


async def scrape(url: str | None, name: str = DEFAULT_HISTOGRAM) -> HistogramSnapshot:
    """GET url with a session of its own, so no load-test connection is pre-warmed."""
    return (await scrape_many(url, (name,)))[name]


async def scrape_many(url: str | None, names: tuple[str, ...]) -> dict[str, HistogramSnapshot]:
    """`scrape` of several histograms from one GET."""
    if url is None:
        return dict.fromkeys(names, HistogramSnapshot({}, 0.0, "no --metrics-url"))
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(url) as resp,
        ):
            text = await resp.text()
            if resp.status != 200:
                return dict.fromkeys(
                    names, HistogramSnapshot({}, 0.0, f"GET {url}: http {resp.status}")
                )
    except Exception as exc:  # the run still counts; the server-side half is marked missing
        failed = HistogramSnapshot({}, 0.0, f"GET {url}: {type(exc).__name__}: {exc}")
        return dict.fromkeys(names, failed)
    # No series yet is fine before the run: a labelled histogram appears on first use.
    return {name: parse_histogram(text, name) for name in names}


def compare(
    before: HistogramSnapshot,
    after: HistogramSnapshot,
    bounds_s: tuple[float, ...],
    name: str = DEFAULT_HISTOGRAM,
) -> ServerSide:
    err = before.error or after.error
    if err:
        return ServerSide(name, 0.0, (), (), err)
    if not after.buckets:
        return ServerSide(name, 0.0, (), (), f"the server's /metrics has no {name}_bucket series")
    count = after.count - before.count
    checks: list[BucketCheck] = []
    missing: list[float] = []
    for b in sorted(set(bounds_s) | set(SERVER_SLA_BOUNDS_S)):
        key = next((k for k in after.buckets if math.isclose(k, b, rel_tol=1e-9)), None)
        if key is None:
            missing.append(b)
            continue
        within = after.buckets[key] - before.buckets.get(key, 0.0)
        checks.append(BucketCheck(b, within, within / count if count > 0 else None))
    return ServerSide(name, count, tuple(checks), tuple(missing))

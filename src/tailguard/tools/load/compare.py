"""`tailguard load compare A B`: two saved runs side by side, with B/A ratios, and one HTML page.

A and B are result.json files (or the --report folders holding them) of two single runs or
two sweeps. Single runs compare their summary figures; sweeps compare knee, maxima, and the
figures of every offered rate the two have in common; the page draws both runs' curves on the
same axes.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailguard.errors import ConfigError
from tailguard.tools.load.html_report import OK_COLOR
from tailguard.tools.load.sweep_html import _STYLE, ORANGE, Series, line_chart, sweep_charts

__all__ = ["Row", "compare_rows", "load_result", "render_compare_html"]

COLORS = (OK_COLOR, ORANGE)


@dataclass(frozen=True)
class Row:
    metric: str
    unit: str  # "ms", "/s", "tok/s", "%"
    a: float | None
    b: float | None
    better: str  # "higher" or "lower": which way B improving on A goes

    @property
    def ratio(self) -> float | None:
        if self.a is None or self.b is None or self.a == 0:
            return None
        return self.b / self.a


def load_result(path: Path) -> dict[str, Any]:
    """A result.json (single run or sweep), or a --report folder that holds one."""
    file = path / "result.json" if path.is_dir() else path
    try:
        d = json.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(f"compare: cannot read {file} ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"compare: {file} is not JSON ({exc})") from exc
    if not isinstance(d, dict) or not ("summary" in d or d.get("kind") == "sweep"):
        raise ConfigError(f"compare: {file} is not a tailguard load result.json")
    return d


def _kind(d: dict[str, Any]) -> str:
    return "sweep" if d.get("kind") == "sweep" else "run"


def _get(d: dict[str, Any], *keys: str) -> float | None:
    cur: Any = d
    for k in keys:
        if not isinstance(cur, dict) or cur.get(k) is None:
            return None
        cur = cur[k]
    return float(cur)


def _single_rows(a: dict[str, Any], b: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []

    def add(metric: str, unit: str, better: str, *keys: str, scale: float = 1.0) -> None:
        va, vb = _get(a, "summary", *keys), _get(b, "summary", *keys)
        if va is None and vb is None:
            return
        rows.append(
            Row(
                metric,
                unit,
                None if va is None else va * scale,
                None if vb is None else vb * scale,
                better,
            )
        )

    add("requests sent", "", "higher", "total")
    add("throughput (sent / window)", "/s", "higher", "throughput")
    add("requests ok / wall", "/s", "higher", "requests_per_s")
    add("goodput", "/s", "higher", "goodput")
    for q in ("p50", "p90", "p99", "p99_9", "max"):
        add(f"latency {q.replace('_', '.')}", "ms", "lower", "latency", q, scale=1e3)
    for m in ("ttft", "tpot", "itl"):
        for q in ("p50", "p99"):
            add(f"{m.upper()} {q}", "ms", "lower", m, q, scale=1e3)
    add("output tokens/s", "tok/s", "higher", "output_tokens_per_s")
    add("failed", "", "lower", "failed")
    return rows


def _by_rate(d: dict[str, Any]) -> dict[float, dict[str, Any]]:
    return {round(float(p["offered_rps"]), 3): p for p in d.get("points") or []}


def _sweep_rows(a: dict[str, Any], b: dict[str, Any]) -> list[Row]:
    rows = [Row("knee (offered)", "/s", _get(a, "knee", "offered_rps"),
                _get(b, "knee", "offered_rps"), "higher")]  # fmt: skip

    def peak(d: dict[str, Any], key: str) -> float | None:
        vals = [float(p[key]) for p in d.get("points") or [] if p.get(key) is not None]
        return max(vals) if vals else None

    for key, name, unit in (
        ("throughput_rps", "max throughput", "/s"),
        ("goodput_rps", "max goodput", "/s"),
        ("output_tokens_per_s", "max output tokens/s", "tok/s"),
    ):
        va, vb = peak(a, key), peak(b, key)
        if va is not None or vb is not None:
            rows.append(Row(name, unit, va, vb, "higher"))
    ra, rb = _by_rate(a), _by_rate(b)
    for rate in sorted(set(ra) & set(rb)):
        pa, pb = ra[rate], rb[rate]
        for key, name in (("latency_p99_s", "p99 latency"), ("ttft_p99_s", "p99 TTFT")):
            if pa.get(key) is not None or pb.get(key) is not None:
                rows.append(Row(f"{name} at {rate:g}/s", "ms", _ms(pa.get(key)),
                                _ms(pb.get(key)), "lower"))  # fmt: skip
        rows.append(Row(f"goodput at {rate:g}/s", "/s", _f(pa.get("goodput_rps")),
                        _f(pb.get("goodput_rps")), "higher"))  # fmt: skip
    return rows


def _ms(v: Any) -> float | None:
    return None if v is None else float(v) * 1e3


def _f(v: Any) -> float | None:
    return None if v is None else float(v)


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[Row]:
    if _kind(a) != _kind(b):
        raise ConfigError(
            f"compare: A is a {_kind(a)} and B a {_kind(b)}; compare two runs or two sweeps"
        )
    return _sweep_rows(a, b) if _kind(a) == "sweep" else _single_rows(a, b)


def fmt(v: float | None, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.1f}" if unit in ("ms", "tok/s", "/s") else f"{v:,.0f}"


def fmt_ratio(r: Row) -> str:
    return "-" if r.ratio is None else f"{r.ratio:.3f}x"


def _percentile_chart(runs: list[tuple[str, dict[str, Any]]], measure: str) -> str:
    nines = (("p50", math.log10(2)), ("p90", 1.0), ("p99", 2.0), ("p99_9", 3.0), ("p99_99", 4.0))
    series = []
    for (name, d), color in zip(runs, COLORS, strict=False):
        pct = (d.get("summary") or {}).get(measure) or {}
        pts = [(x, float(pct[q])) for q, x in nines if pct.get(q) is not None]
        if pts:
            series.append(Series(f"{name} {measure}", color, pts))
    if not series:
        return ""
    return line_chart(
        f"{measure} percentiles (x: 0.3 = p50, 1 = p90, 2 = p99, 3 = p99.9, 4 = p99.99)",
        series,
        xlabel="nines",
        ylabel="seconds",
        logy=True,
    )


def render_compare_html(
    names: tuple[str, str], a: dict[str, Any], b: dict[str, Any], rows: list[Row]
) -> str:
    runs = [(names[0], a), (names[1], b)]
    body = "".join(
        f"<tr><td>{html.escape(r.metric)}{' (' + r.unit + ')' if r.unit else ''}</td>"
        f"<td>{fmt(r.a, r.unit)}</td><td>{fmt(r.b, r.unit)}</td><td>{fmt_ratio(r)}</td>"
        f"<td>{r.better}</td></tr>"
        for r in rows
    )
    if _kind(a) == "sweep":
        charts = sweep_charts(runs, COLORS)
    else:
        charts = _percentile_chart(runs, "latency") + _percentile_chart(runs, "ttft")

    def desc(d: dict[str, Any]) -> str:
        c = d.get("config") or {}
        return html.escape(f"{c.get('url', '')} | {c.get('profile_text', '')} | {d['verdict']}")

    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>tailguard load compare</title>
{_STYLE}</head><body>
<h1>tailguard load compare</h1>
<p><b style="color:{COLORS[0]}">A = {html.escape(names[0])}</b>: {desc(a)}<br>
<b style="color:{COLORS[1]}">B = {html.escape(names[1])}</b>: {desc(b)}</p>
<table><tr><th>metric</th><th>A</th><th>B</th><th>B / A</th><th>better</th></tr>{body}</table>
{charts}
</body></html>
"""

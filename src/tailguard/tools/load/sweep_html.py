"""HTML for sweeps and A/B comparisons: curves against offered load, the knee marked.

Works from result.json dicts (a sweep's or a single run's), so `tailguard load compare` draws
two saved runs without their raw records. Self-contained like report.html: inline SVG only.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tailguard.tools.load.html_report import FAIL_COLOR, MB, MT, OK_COLOR, SLA_COLOR, H, _Plot

__all__ = ["Series", "line_chart", "render_sweep_html", "sweep_charts"]

ORANGE, GREY, KNEE_COLOR = "#ff7f0e", "#999", "#9467bd"
_STYLE = """<style>
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 960px; }
table { border-collapse: collapse; margin: 8px 0 16px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.warn { color: #b35900; font-weight: bold; }
figure { margin: 16px 0; } figcaption { font-weight: bold; margin-bottom: 4px; }
</style>"""


@dataclass(frozen=True)
class Series:
    name: str
    color: str
    points: Sequence[tuple[float, float]]  # (x, y), sorted by x
    dashed: bool = False


def line_chart(
    title: str,
    series: Sequence[Series],
    *,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
    hlines: Sequence[tuple[float, str]] = (),
    vlines: Sequence[tuple[float, str, str]] = (),  # (x, label, color)
    diagonal: bool = False,  # y = x (offered load) for reference
) -> str:
    xs = [x for s in series for x, _ in s.points] + [x for x, _, _ in vlines]
    ys = [y for s in series for _, y in s.points if y is not None] + [y for y, _ in hlines]
    if not xs or not ys:
        return f"<p>{html.escape(title)}: no data.</p>"
    pos = [y for y in ys if y > 0] or [1e-3]
    y0 = min(pos) / 1.5 if logy else 0.0
    y1 = max(ys) * (1.5 if logy else 1.1)
    p = _Plot(0.0, max(xs) * 1.05, y0, y1, logy=logy, xlabel=xlabel, ylabel=ylabel)
    if diagonal:
        a, b = p.px(0), p.px(min(max(xs) * 1.05, y1))
        p.parts.append(
            f'<line x1="{a:.1f}" y1="{p.py(0):.1f}" x2="{b:.1f}" '
            f'y2="{p.py(min(max(xs) * 1.05, y1)):.1f}" stroke="{GREY}" stroke-dasharray="2 4"/>'
        )
    for y, label in hlines:
        p.hline(y, label)
    for x, label, color in vlines:
        xx = p.px(x)
        p.parts.append(
            f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{MT}" y2="{H - MB}" stroke="{color}" '
            f'stroke-width="2"/><text x="{xx + 4:.1f}" y="{MT + 14}" font-size="11" '
            f'fill="{color}">{html.escape(label)}</text>'
        )
    legend = []
    for k, s in enumerate(series):
        pts = [(x, y) for x, y in s.points if y is not None and (y > 0 or not logy)]
        if not pts:
            continue
        d = " ".join(f"{p.px(x):.1f},{p.py(y):.1f}" for x, y in pts)
        dash = ' stroke-dasharray="6 3"' if s.dashed else ""
        p.parts.append(
            f'<polyline points="{d}" fill="none" stroke="{s.color}" stroke-width="2"{dash}>'
            f"<title>{html.escape(s.name)}</title></polyline>"
            + "".join(
                f'<circle cx="{p.px(x):.1f}" cy="{p.py(y):.1f}" r="3" fill="{s.color}"/>'
                for x, y in pts
            )
        )
        legend.append(
            f'<text x="{90}" y="{MT + 16 + 14 * k}" font-size="11" fill="{s.color}">'
            f"{'- -' if s.dashed else '---'} {html.escape(s.name)}</text>"
        )
    p.parts.extend(legend)
    return p.svg(title)


def _pts(points: list[dict[str, Any]], key: str, scale: float = 1.0) -> list[tuple[float, float]]:
    return [
        (float(q["offered_rps"]), float(q[key]) * scale)
        for q in points
        if q.get("offered_rps") is not None and q.get(key) is not None
    ]


def sweep_charts(runs: Sequence[tuple[str, dict[str, Any]]], colors: Sequence[str]) -> str:
    """Goodput/throughput, p99 latency and output tokens/s against offered load, per run."""
    tp: list[Series] = []
    lat: list[Series] = []
    tok: list[Series] = []
    vlines: list[tuple[float, str, str]] = []
    bounds: set[float] = set()
    single = len(runs) == 1  # one run: a colour per measure; two: a colour per run
    for (name, d), color in zip(runs, colors, strict=False):
        pts = d.get("points") or []
        prefix = "" if single else f"{name}: "
        second = SLA_COLOR if single else color
        tp.append(Series(f"{prefix}throughput", color, _pts(pts, "throughput_rps")))
        good = _pts(pts, "goodput_rps")
        if good:
            tp.append(Series(f"{prefix}goodput", second, good, dashed=True))
        lat.append(Series(f"{prefix}p99 latency", color, _pts(pts, "latency_p99_s")))
        ttft = _pts(pts, "ttft_p99_s")
        if ttft:
            lat.append(Series(f"{prefix}p99 TTFT", ORANGE if single else color, ttft, dashed=True))
        out = _pts(pts, "output_tokens_per_s")
        if any(y > 0 for _, y in out):
            tok.append(Series(f"{prefix}output tokens/s", color, out))
        knee = d.get("knee")
        if knee and knee.get("offered_rps"):
            rate = float(knee["offered_rps"])
            vlines.append((rate, f"{prefix}knee {rate:.3g}/s", KNEE_COLOR if single else color))
        for text in (d.get("config") or {}).get("sla", []):
            b = _bound_of(text)
            if b is not None:
                bounds.add(b)
    out_html = line_chart(
        "Throughput (solid) and goodput (dashed) vs offered load; dotted: y = offered",
        tp,
        xlabel="offered load (requests/s)",
        ylabel="requests/s",
        vlines=vlines,
        diagonal=True,
    )
    out_html += line_chart(
        "p99 latency (solid) and p99 TTFT (dashed) vs offered load",
        lat,
        xlabel="offered load (requests/s)",
        ylabel="seconds",
        logy=True,
        hlines=[(b, f"SLA {b * 1e3:g} ms") for b in sorted(bounds)],
        vlines=vlines,
    )
    if tok:
        out_html += line_chart(
            "Output tokens/s vs offered load",
            tok,
            xlabel="offered load (requests/s)",
            ylabel="tokens/s",
            vlines=vlines,
        )
    return out_html


def _bound_of(text: str) -> float | None:
    from tailguard.errors import ConfigError
    from tailguard.tools.load.config import parse_sla

    try:
        s = parse_sla(text)
    except ConfigError:
        return None
    return s.threshold if s.metric in ("percentile", "max", "ttft", "e2e") else None


def _ms(v: Any) -> str:
    return "-" if v is None else f"{float(v) * 1e3:,.1f}"


def _num(v: Any, fmt: str = ",.2f") -> str:
    return "-" if v is None else format(float(v), fmt)


def points_table(d: dict[str, Any]) -> str:
    head = (
        "<tr><th>step</th><th>offered/s</th><th>sent</th><th>ok</th><th>throughput/s</th>"
        "<th>goodput/s</th><th>good %</th><th>p50 ms</th><th>p99 ms</th><th>TTFT p99 ms</th>"
        "<th>TPOT p99 ms</th><th>out tok/s</th><th>SLA</th><th>trusted</th></tr>"
    )
    rows = []
    knee = (d.get("knee") or {}).get("label")
    for q in [*(d.get("probes") or []), *(d.get("points") or [])]:
        mark = " &larr; knee" if q["label"] == knee else ""
        sla = "PASS" if q["sla_passed"] else "FAIL"
        color = OK_COLOR if q["sla_passed"] else FAIL_COLOR
        share = q.get("good_share")
        rows.append(
            f"<tr><td>{html.escape(q['label'])}{mark}</td><td>{_num(q.get('offered_rps'))}</td>"
            f"<td>{q['total']:,}</td><td>{q['ok']:,}</td><td>{_num(q['throughput_rps'])}</td>"
            f"<td>{_num(q.get('goodput_rps'))}</td>"
            f"<td>{'-' if share is None else f'{share:.1%}'}</td>"
            f"<td>{_ms(q.get('latency_p50_s'))}</td><td>{_ms(q.get('latency_p99_s'))}</td>"
            f"<td>{_ms(q.get('ttft_p99_s'))}</td><td>{_ms(q.get('tpot_p99_s'))}</td>"
            f"<td>{_num(q.get('output_tokens_per_s'), ',.1f')}</td>"
            f"<td style='color:{color}'>{sla}</td><td>{'yes' if q['trusted'] else 'NO'}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def render_sweep_html(d: dict[str, Any]) -> str:
    cfg = d.get("config") or {}
    knee = d.get("knee")
    knee_text = (
        f"Knee: <b>{float(knee['offered_rps']):.3g} req/s</b> ({html.escape(d['knee_rule'])})."
        if knee
        else f"No knee ({html.escape(d.get('knee_rule') or 'no rate step')})."
    )
    color = {0: SLA_COLOR, 1: FAIL_COLOR, 2: ORANGE}.get(int(d.get("exit_code", 2)), ORANGE)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>tailguard load sweep</title>
{_STYLE}</head><body>
<h1>tailguard load: sweep</h1>
<p style="font-size:1.3em;font-weight:bold;color:{color}">{html.escape(d["verdict"])}
(exit {d["exit_code"]})</p>
<p>{html.escape(cfg.get("url", ""))} &middot; {html.escape(cfg.get("profile_text", ""))}
&middot; SLA: {html.escape(", ".join(cfg.get("sla", [])) or "none")}</p>
<p>Bodies: {html.escape(cfg.get("source_text", ""))}</p>
<p>{knee_text}</p>
{points_table(d)}
{sweep_charts([("run", d)], [OK_COLOR])}
</body></html>
"""

"""report.html: one self-contained file (inline SVG, no scripts, no CDN) a person can look at.

Plots: latency of each request over time with the SLA lines, latency histogram, percentile
curve (latency from intended send vs from actual send: the coordinated-omission gap), and
throughput and in-flight requests over time.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Sequence

from tailguard.tools.load.analysis import LoadResult, Percentiles

__all__ = ["MAX_POINTS", "render_html"]

MAX_POINTS = 20_000  # scatter points; above this, fast ok requests are thinned (said so)
W, H = 900, 320
ML, MR, MT, MB = 70, 20, 20, 40  # margins: left, right, top, bottom
OK_COLOR, FAIL_COLOR, SLA_COLOR = "#1f77b4", "#d62728", "#2ca02c"


def _fmt_s(v: float) -> str:
    if v >= 1:
        return f"{v:g} s"
    if v >= 1e-3:
        return f"{v * 1e3:g} ms"
    return f"{v * 1e6:g} us"


class _Plot:
    """A single SVG chart with linear x and linear or log10 y."""

    def __init__(
        self, x0: float, x1: float, y0: float, y1: float, *, logy: bool, xlabel: str, ylabel: str
    ) -> None:
        if x1 <= x0:
            x1 = x0 + 1.0
        if logy:
            y0 = max(y0, 1e-6)
            y1 = max(y1, y0 * 10)
        elif y1 <= y0:
            y1 = y0 + 1.0
        self.x0, self.x1, self.y0, self.y1, self.logy = x0, x1, y0, y1, logy
        self.parts: list[str] = []
        self.xlabel, self.ylabel = xlabel, ylabel

    def px(self, x: float) -> float:
        return ML + (x - self.x0) / (self.x1 - self.x0) * (W - ML - MR)

    def py(self, y: float) -> float:
        if self.logy:
            y = max(y, self.y0)
            f = (math.log10(y) - math.log10(self.y0)) / (math.log10(self.y1) - math.log10(self.y0))
        else:
            f = (y - self.y0) / (self.y1 - self.y0)
        return H - MB - f * (H - MT - MB)

    def y_ticks(self) -> list[tuple[float, str]]:
        if self.logy:
            ticks = []
            for e in range(math.floor(math.log10(self.y0)), math.ceil(math.log10(self.y1)) + 1):
                for m in (1, 2, 5):
                    v = m * 10.0**e
                    if self.y0 <= v <= self.y1:
                        ticks.append((v, _fmt_s(v)))
            return ticks
        step = _nice_step((self.y1 - self.y0) / 5)
        n0 = math.ceil(self.y0 / step)
        return [(k * step, f"{k * step:g}") for k in range(n0, int(self.y1 / step) + 1)]

    def x_ticks(self) -> list[tuple[float, str]]:
        step = _nice_step((self.x1 - self.x0) / 8)
        n0 = math.ceil(self.x0 / step)
        return [(k * step, f"{k * step:g}") for k in range(n0, int(self.x1 / step) + 1)]

    def hline(self, y: float, label: str, color: str = SLA_COLOR) -> None:
        if not self.y0 <= y <= self.y1:
            return
        yy = self.py(y)
        self.parts.append(
            f'<line x1="{ML}" x2="{W - MR}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="{color}" '
            f'stroke-dasharray="6 4" stroke-width="1.5"/>'
            f'<text x="{W - MR - 4}" y="{yy - 4:.1f}" text-anchor="end" fill="{color}" '
            f'font-size="11">{html.escape(label)}</text>'
        )

    def svg(self, title: str) -> str:
        axes = [
            f'<rect x="{ML}" y="{MT}" width="{W - ML - MR}" height="{H - MT - MB}" '
            'fill="#fff" stroke="#999"/>'
        ]
        for v, lab in self.y_ticks():
            y = self.py(v)
            axes.append(
                f'<line x1="{ML}" x2="{W - MR}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{lab}</text>'
            )
        for v, lab in self.x_ticks():
            x = self.px(v)
            axes.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT}" y2="{H - MB}" stroke="#f3f3f3"/>'
                f'<text x="{x:.1f}" y="{H - MB + 15}" text-anchor="middle" font-size="11">'
                f"{lab}</text>"
            )
        axes.append(
            f'<text x="{(ML + W - MR) / 2}" y="{H - 6}" text-anchor="middle" font-size="12">'
            f"{html.escape(self.xlabel)}</text>"
            f'<text x="14" y="{(MT + H - MB) / 2}" text-anchor="middle" font-size="12" '
            f'transform="rotate(-90 14 {(MT + H - MB) / 2})">{html.escape(self.ylabel)}</text>'
        )
        body = "".join(axes) + "".join(self.parts)
        return (
            f"<figure><figcaption>{html.escape(title)}</figcaption>"
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" '
            f'height="{H}" font-family="sans-serif">{body}</svg></figure>'
        )


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _bounds(result: LoadResult) -> list[float]:
    return sorted({s.latency_bound_s for s in result.config.sla if s.latency_bound_s})


def _scatter(result: LoadResult) -> str:
    recs = result.records
    if not recs:
        return "<p>No requests.</p>"
    bounds = _bounds(result)
    lo = min(r.latency_s for r in recs)
    hi = max(r.latency_s for r in recs)
    # Thin only fast ok requests; every failure and every request over the tightest bound stays.
    limit = bounds[0] if bounds else sorted(r.latency_s for r in recs)[int(0.99 * len(recs))]
    keep = [r for r in recs if not r.ok or r.latency_s > limit]
    rest = [r for r in recs if r.ok and r.latency_s <= limit]
    stride = max(1, math.ceil(len(rest) / max(1, MAX_POINTS - len(keep))))
    shown = keep + rest[::stride]
    p = _Plot(
        0.0,
        max(r.intended_s for r in recs) * 1.02 + 1e-3,
        lo / 1.5,
        max(hi, *bounds) * 1.5 if bounds else hi * 1.5,
        logy=True,
        xlabel="intended send time (s after start)",
        ylabel="latency",
    )
    dots = []
    for r in shown:
        color = OK_COLOR if r.ok else FAIL_COLOR
        dots.append(
            f'<circle cx="{p.px(r.intended_s):.1f}" cy="{p.py(r.latency_s):.1f}" r="1.6" '
            f'fill="{color}" fill-opacity="0.55"/>'
        )
    p.parts.append("".join(dots))
    for b in bounds:
        p.hline(b, f"SLA {_fmt_s(b)}")
    note = (
        f"; showing all {len(recs):,}"
        if stride == 1
        else f"; showing {len(shown):,} of {len(recs):,}: every failed or slow request, "
        f"every {stride}th fast one"
    )
    return p.svg(f"Latency of each request (blue ok, red failed){note}")


def _histogram(result: LoadResult) -> str:
    lat = [r.latency_s for r in result.records]
    if not lat:
        return ""
    lo, hi = max(min(lat), 1e-6), max(max(lat), 1e-6)
    nb = 50
    llo, lhi = math.log10(lo), math.log10(hi) + 1e-9
    counts = [0] * nb
    for v in lat:
        k = int((math.log10(max(v, 1e-6)) - llo) / (lhi - llo + 1e-12) * nb)
        counts[min(max(k, 0), nb - 1)] += 1
    p = _Plot(llo, lhi, 0, max(counts) * 1.1, logy=False, xlabel="", ylabel="requests")
    p.xlabel = "latency (log scale)"
    p.x_ticks = lambda: [  # type: ignore[method-assign]
        (math.log10(v), _fmt_s(v))
        for e in range(math.floor(llo), math.ceil(lhi) + 1)
        for v in ((1 * 10.0**e,) if lhi - llo > 3 else (1 * 10.0**e, 2 * 10.0**e, 5 * 10.0**e))
        if llo <= math.log10(v) <= lhi
    ]
    width = (p.px(lhi) - p.px(llo)) / nb
    for k, n in enumerate(counts):
        if n:
            x = p.px(llo + (lhi - llo) * k / nb)
            y = p.py(n)
            p.parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(width - 1, 1):.1f}" '
                f'height="{p.py(0) - y:.1f}" fill="{OK_COLOR}"><title>{n}</title></rect>'
            )
    for b in _bounds(result):
        if llo <= math.log10(b) <= lhi:
            x = p.px(math.log10(b))
            p.parts.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT}" y2="{H - MB}" stroke="{SLA_COLOR}" '
                f'stroke-dasharray="6 4"/><text x="{x + 3:.1f}" y="{MT + 12}" font-size="11" '
                f'fill="{SLA_COLOR}">SLA {_fmt_s(b)}</text>'
            )
    return p.svg("Latency histogram (from intended send time)")


def _curve_points(values: Sequence[float]) -> list[tuple[float, float]]:
    """(nines, value): x = -log10(1 - q), so 90 % -> 1, 99 % -> 2, 99.9 % -> 3."""
    v = sorted(values)
    n = len(v)
    pts = []
    for i in range(n):
        q = i / n
        pts.append((-math.log10(1 - q), v[i]))
    # thin to ~2,000 points spread over the nines (the tail keeps its resolution)
    if len(pts) > 2000:
        step_x = pts[-1][0] / 2000
        thinned, last = [], -1.0
        for x, y in pts:
            if x - last >= step_x:
                thinned.append((x, y))
                last = x
        thinned.append(pts[-1])
        pts = thinned
    return pts


def _percentile_curve(result: LoadResult) -> str:
    recs = result.records
    if not recs:
        return ""
    lat = _curve_points([r.latency_s for r in recs])
    svc = _curve_points([r.service_s for r in recs])
    ys = [y for _, y in lat + svc]
    p = _Plot(
        0,
        max(4.0, lat[-1][0]),
        min(ys) / 1.5,
        max(ys) * 1.5,
        logy=True,
        xlabel="percentile",
        ylabel="latency",
    )
    p.x_ticks = lambda: [(0, "0%"), (1, "90%"), (2, "99%"), (3, "99.9%"), (4, "99.99%")]  # type: ignore[method-assign]
    for pts, color, name in ((lat, OK_COLOR, "latency"), (svc, "#ff7f0e", "service")):
        d = " ".join(f"{p.px(x):.1f},{p.py(y):.1f}" for x, y in pts)
        p.parts.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2">'
                       f"<title>{name}</title></polyline>")  # fmt: skip
    for b in _bounds(result):
        p.hline(b, f"SLA {_fmt_s(b)}")
    return p.svg(
        "Percentile curve: blue from intended send time (what users saw), orange from actual "
        "send (what a closed-loop tool reports)"
    )


def _series(result: LoadResult) -> str:
    sm = result.samples
    if len(sm) < 2:
        return "<p>Run too short for time series.</p>"
    rates = [
        (b.t_s, (b.done - a.done) / max(b.t_s - a.t_s, 1e-9)) for a, b in itertools.pairwise(sm)
    ]
    out = []
    for title, pts, ylabel in (
        ("Throughput (finished requests per second)", rates, "requests/s"),
        ("Requests in flight", [(s.t_s, float(s.in_flight)) for s in sm], "in flight"),
        ("Client CPU (share of one core)", [(s.t_s, s.cpu) for s in sm], "cores"),
    ):
        p = _Plot(0, pts[-1][0], 0, max(y for _, y in pts) * 1.1 + 1e-9, logy=False,
                  xlabel="time (s after start)", ylabel=ylabel)  # fmt: skip
        d = " ".join(f"{p.px(x):.1f},{p.py(y):.1f}" for x, y in pts)
        p.parts.append(
            f'<polyline points="{d}" fill="none" stroke="{OK_COLOR}" stroke-width="1.5"/>'
        )
        out.append(p.svg(title))
    return "".join(out)


def _pct_cells(p: Percentiles) -> str:
    vals = (p.p50, p.p90, p.p99, p.p99_9, p.p99_99, p.max)
    return "".join(f"<td>{'-' if v is None else f'{v * 1e3:,.2f}'}</td>" for v in vals)


def _token_rows(result: LoadResult) -> str:
    s = result.summary
    if not s.ttft.count:
        return ""
    return (
        f"<tr><td>TTFT</td>{_pct_cells(s.ttft)}</tr>"
        f"<tr><td>TPOT (time per output token)</td>{_pct_cells(s.tpot)}</tr>"
        f"<tr><td>ITL (inter-token latency)</td>{_pct_cells(s.itl)}</tr>"
    )


def _token_line(result: LoadResult) -> str:
    s = result.summary
    parts = []
    if s.output_tokens.requests:
        parts.append(
            f"Output tokens (server usage) {s.output_tokens.total:,}, mean "
            f"{s.output_tokens.mean or 0:,.1f}; {s.output_tokens_per_s:,.1f} output tok/s, "
            f"{s.total_tokens_per_s:,.1f} total tok/s, {s.requests_per_s:,.2f} requests/s."
        )
    if s.prompt_tokens.requests:
        parts.append(f"Prompt tokens mean {s.prompt_tokens.mean or 0:,.1f}.")
    if s.goodput is not None:
        parts.append(
            f"Goodput {s.goodput:,.2f}/s: {s.good:,} requests ok meeting "
            f"{html.escape(', '.join(s.goodput_terms))}."
        )
    return f"<p>{' '.join(parts)}</p>" if parts else ""


def render_html(result: LoadResult) -> str:
    cfg, s, c = result.config, result.summary, result.client
    code = result.exit_code()
    color = {0: "#2ca02c", 1: "#d62728", 2: "#ff7f0e"}[code]
    sla_rows = "".join(
        f"<tr><td>{html.escape(r.text)}</td><td>{html.escape(r.observed)}</td>"
        f"<td style='color:{'#2ca02c' if r.passed else '#d62728'}'>"
        f"{'PASS' if r.passed else 'FAIL'}</td><td>{html.escape(r.detail)}</td></tr>"
        for r in result.sla
    )
    errors = ", ".join(f"{html.escape(k)} x{n}" for k, n in s.errors_by_kind.items()) or "none"
    loop_note = (
        ""
        if cfg.profile.open_loop
        else "<p class='warn'>CLOSED-LOOP run: a stall is counted once per worker, not for every "
        "request a user would have sent. Use an open-loop profile to judge an SLA.</p>"
    )
    trust = (
        "<p>Client kept up (loop lag p99 "
        f"{c.loop_lag_p99_s * 1e3:.1f} ms, CPU {c.cpu_mean:.0%} of a core).</p>"
        if c.trusted
        else "<p class='warn'>NOT TRUSTWORTHY: "
        + html.escape("; ".join(c.reasons))
        + f". Latencies may be overstated by about {c.overstated_by_s * 1e3:.1f} ms.</p>"
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>tailguard load report</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; max-width: 960px; }}
table {{ border-collapse: collapse; margin: 8px 0 16px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
.verdict {{ font-size: 1.4em; font-weight: bold; color: {color}; }}
.warn {{ color: #b35900; font-weight: bold; }}
figure {{ margin: 16px 0; }} figcaption {{ font-weight: bold; margin-bottom: 4px; }}
</style></head><body>
<h1>tailguard load</h1>
<p class="verdict">{html.escape(result.verdict())} (exit {code})</p>
<p>{html.escape(cfg.target_url)} &middot; {html.escape(cfg.profile.describe())} &middot;
<b>{cfg.profile.loop_label}</b> &middot; started {html.escape(result.facts.started_at)}</p>
<p>Bodies: {html.escape(result.facts.source_text or "-")}</p>
{loop_note}{trust}
<p>Sent {s.total:,}; ok {s.ok:,}; failed {s.failed:,} ({errors}); throughput
{s.throughput:,.1f}/s over {s.rate_window_s:.2f} s; connections new {s.new_connections:,},
reused {s.reused_connections:,}.</p>
<table><tr><th>ms</th><th>p50</th><th>p90</th><th>p99</th><th>p99.9</th><th>p99.99</th>
<th>max</th></tr>
<tr><td>latency (from intended send)</td>{_pct_cells(s.latency)}</tr>
<tr><td>service (from actual send)</td>{_pct_cells(s.service)}</tr>
<tr><td>time to first byte</td>{_pct_cells(s.ttfb)}</tr>{_token_rows(result)}</table>
{_token_line(result)}
<table><tr><th>SLA</th><th>observed</th><th>result</th><th>detail</th></tr>{sla_rows}</table>
{_scatter(result)}
{_histogram(result)}
{_percentile_curve(result)}
{_series(result)}
</body></html>
"""

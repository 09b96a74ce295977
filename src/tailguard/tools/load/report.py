"""Outputs of a run: console summary (rich), result.json, requests.jsonl/.csv, report.html."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tailguard.tools.load.analysis import LoadResult, Percentiles, TokenCounts
from tailguard.tools.load.html_report import render_html
from tailguard.tools.load.records import write_csv, write_jsonl

__all__ = ["print_summary", "write_report"]


def write_report(result: LoadResult, out_dir: Path, *, csv: bool = False) -> list[Path]:
    """Write result.json, requests.jsonl (and .csv), report.html into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "result.json", out_dir / "requests.jsonl", out_dir / "report.html"]
    paths[0].write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    write_jsonl(paths[1], result.records)
    paths[2].write_text(render_html(result), encoding="utf-8")
    if csv:
        paths.append(out_dir / "requests.csv")
        write_csv(paths[-1], result.records)
    return paths


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.2f}"


def _pct_row(name: str, p: Percentiles) -> list[str]:
    return [
        name,
        f"{p.count:,}",
        _ms(p.p50),
        _ms(p.p90),
        _ms(p.p99),
        _ms(p.p99_9),
        _ms(p.p99_99),
        _ms(p.max),
    ]


def print_summary(result: LoadResult, console: Console | None = None) -> None:
    # 80 columns (rich's default off a terminal) wraps the tables in CI logs
    con = console or Console(width=None if sys.stdout.isatty() else 130)
    cfg, s, c = result.config, result.summary, result.client
    p = cfg.profile
    con.print(
        f"[bold]tailguard load[/] {cfg.target_url}  {p.describe()}  "
        f"[{'green' if p.open_loop else 'yellow'}]{p.loop_label.upper()}[/]"
    )
    if result.facts.source_text:
        repeat = "REPEAT" in result.facts.source_text
        con.print(f"[{'yellow' if repeat else 'default'}]bodies: {result.facts.source_text}[/]")
    if not p.open_loop:
        con.print(
            "[yellow]closed-loop: a stalled server slows the sender, so a stall is counted "
            "once per worker, not for every request a user would have sent.[/]"
        )
    counts = (
        f"sent {s.total:,}  ok {s.ok:,}  failed {s.failed:,}  timeouts {s.timeouts:,}  "
        f"throughput {s.throughput:,.1f}/s over {s.rate_window_s:.2f} s  "
        f"connections new {s.new_connections:,} / reused {s.reused_connections:,}"
    )
    if s.goodput is not None:
        counts += (
            f"  goodput {s.goodput:,.1f}/s ({s.good:,} ok meeting {', '.join(s.goodput_terms)})"
        )
    con.print(counts)
    if s.output_tokens.requests or s.prompt_tokens.requests:
        con.print(
            f"tokens (server usage): prompt {_counts(s.prompt_tokens)}  output "
            f"{_counts(s.output_tokens)}  output {s.output_tokens_per_s:,.1f} tok/s  total "
            f"{s.total_tokens_per_s:,.1f} tok/s  requests {s.requests_per_s:,.2f}/s (over "
            f"{result.facts.wall_s:.2f} s wall)"
        )
    if s.errors_by_kind:
        con.print(
            "errors: " + ", ".join(f"{k or 'unknown'} x{n:,}" for k, n in s.errors_by_kind.items())
        )

    t = Table(title="latency (ms); every request counted, failures included")
    for col in ("measure", "n", "p50", "p90", "p99", "p99.9", "p99.99", "max"):
        t.add_column(col, justify="right" if col != "measure" else "left")
    origin = "intended send" if p.open_loop else "send"
    t.add_row(*_pct_row(f"latency (from {origin})", s.latency))
    if p.open_loop:
        t.add_row(*_pct_row("service (from actual send)", s.service))
    t.add_row(*_pct_row("time to first byte", s.ttfb))
    if s.ttft.count:
        t.add_row(*_pct_row(f"TTFT (from {origin})", s.ttft))
        t.add_row(*_pct_row("TPOT (time per output token)", s.tpot))
        t.add_row(*_pct_row("ITL (inter-token latency)", s.itl))
    elif s.first_token.count:
        t.add_row(*_pct_row("time to first event", s.first_token))
    if s.connect.count:
        t.add_row(*_pct_row("connection setup", s.connect))
    con.print(t)

    shares = "  ".join(
        f"<= {float(b) * 1000:g} ms: {v:.4%}" for b, v in sorted(s.share_within.items(), key=_k)
    )
    con.print(f"ok within bound (share of all requests): {shares}")
    if result.server is not None:
        sv = result.server
        if sv.error:
            con.print(f"[yellow]server /metrics: {sv.error}[/]")
        else:
            parts = [
                f'le="{b.bound_s:g}": {b.within:,.0f}/{sv.count:,.0f}'
                + (f" = {b.share:.4%}" if b.share is not None else "")
                for b in sv.checks
            ]
            con.print(f"server-side {sv.metric}: " + "  ".join(parts))
            if sv.missing_bounds:
                con.print(f"[yellow]server histogram has no bucket at {sv.missing_bounds}[/]")

    if result.sla:
        st = Table(title="SLA")
        for col in ("check", "observed", "result", "detail"):
            st.add_column(col)
        for r in result.sla:
            mark = "[green]PASS[/]" if r.passed else "[red]FAIL[/]"
            st.add_row(r.text, r.observed, mark, r.detail)
        con.print(st)

    con.print(
        f"client: {c.event_loop}, CPU {c.cpu_mean:.0%} of a core (worst interval "
        f"{c.cpu_max:.0%}), loop lag p99 {_ms(c.loop_lag_p99_s)} ms max "
        f"{_ms(c.loop_lag_max_s)} ms, send lag p99 {_ms(c.send_lag_p99_s)} ms, "
        f"open-files limit {c.nofile_limit:,}, machine CPU {c.machine_cpu:.0%} busy"
    )
    code = result.exit_code()
    color = {0: "green", 1: "red", 2: "yellow"}[code]
    con.print(f"[bold {color}]{result.verdict()}[/]  (exit {code})")


def _counts(c: TokenCounts) -> str:
    if not c.requests or c.mean is None:
        return "-"
    return f"mean {c.mean:,.1f} ({c.min:,}-{c.max:,})"


def _k(item: tuple[str, float]) -> float:
    return float(item[0])

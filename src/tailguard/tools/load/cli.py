"""`tailguard load URL ...`: open-loop load test, LLM serving benchmark and SLA gate.

    tailguard load URL [source] [profile] [--sla ...]      one run, or --profile sweep
    tailguard load compare A.json B.json [--report DIR]     two saved runs side by side

Exit codes: 0 every --sla term holds; 1 one fails; 2 the run could not start or could not be
trusted (the client itself lagged or saturated), so its numbers must not pass or fail a gate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Coroutine
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tailguard.errors import ConfigError
from tailguard.tools.load.analysis import LoadResult
from tailguard.tools.load.compare import (
    compare_rows,
    fmt,
    fmt_ratio,
    load_result,
    render_compare_html,
)
from tailguard.tools.load.config import (
    ENDPOINT_PATHS,
    LoadConfig,
    Profile,
    SourceSpec,
    TrustLimits,
    parse_duration,
    parse_length,
    parse_sla,
)
from tailguard.tools.load.report import print_summary, write_report
from tailguard.tools.load.runner import Progress, run_load
from tailguard.tools.load.sources import BodySource
from tailguard.tools.load.sweep import run_sweep, write_sweep_report

__all__ = ["add_arguments", "config_from_args", "run"]

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0] if __doc__ else None
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "profiles:\n"
        "  constant --rate R --duration D        open-loop, evenly spaced\n"
        "  poisson  --rate R --duration D        open-loop, random arrivals\n"
        "  ramp --to-rate R --steps N --hold D   open-loop steps up to R (start: --rate)\n"
        "  ramp --to-inflight N --steps K --hold D   closed-loop steps of in-flight requests\n"
        "  burst --count N                       N requests at once\n"
        "  closed --concurrency C --requests N   hey-like closed loop; sends exactly N\n"
        "  sweep --duration D [--steps N]        probe the max, then N rates up to and past it\n"
        "request sources: (default) --prompt with a per-request suffix | --dataset FILE |\n"
        "  --random-input-len N[:M] [--random-output-len N[:M]] [--tokenizer DIR|embedded]\n"
        "SLA terms: p99<=150ms  max<=200ms  errors<=0.1%  goodput>=500/s  goodput(150ms)>=500/s"
        "  throughput>=1000/s\n"
        "SLO terms (per request, combined into goodput): ttft<=150ms  tpot<=50ms  itl<=100ms"
        "  e2e<=2s\n"
        "compare: tailguard load compare A.json B.json [--report DIR] [--json]\n"
        "exit: 0 SLA holds, 1 SLA fails, 2 run untrustworthy or could not start"
    )
    parser.add_argument(
        "url",
        help="base URL (http://host:port); the full URL for --endpoint raw; or 'compare'",
    )
    parser.add_argument("files", nargs="*", help=argparse.SUPPRESS)  # compare A B
    parser.add_argument("--endpoint", default="infer", choices=list(ENDPOINT_PATHS))
    parser.add_argument(
        "--body", type=Path, metavar="FILE", help="JSON body file (required for raw)"
    )
    parser.add_argument("--model", default="tailguard-embedded")
    parser.add_argument("--prompt", default=None, help="prompt text for built bodies")
    parser.add_argument("--stream", action="store_true", help="SSE for completions/chat")
    parser.add_argument("--header", action="append", default=[], help="'Name: value'")
    r = parser.add_argument_group("request source (every request different unless said)")
    r.add_argument("--dataset", metavar="FILE", help="JSONL of bodies or OpenAI Batch input lines")
    r.add_argument("--random-input-len", metavar="N[:M]", help="random prompts of N..M tokens")
    r.add_argument("--random-output-len", metavar="N[:M]", help="max_tokens N..M + ignore_eos")
    r.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="vocabulary for random prompts: a model folder or 'embedded'",
    )
    g = parser.add_argument_group("profile")
    g.add_argument(
        "--profile",
        default="constant",
        choices=["constant", "poisson", "ramp", "burst", "closed", "sweep"],
    )
    g.add_argument("--rate", type=float, help="requests/s (ramp: start rate)")
    g.add_argument("--duration", help="sending time, e.g. 30s, 2m")
    g.add_argument("--count", type=int, help="burst size")
    g.add_argument("--concurrency", type=int, help="closed-loop workers")
    g.add_argument("--requests", type=int, help="closed-loop total requests (sent exactly)")
    g.add_argument("--to-rate", type=float, help="ramp target rate")
    g.add_argument("--to-inflight", type=int, help="ramp target in-flight requests")
    g.add_argument("--steps", type=int, help="ramp steps (default 5), sweep rate steps (8)")
    g.add_argument("--hold", help="ramp: time held per step, e.g. 10s")
    g.add_argument("--seed", type=int, default=0, help="poisson arrivals, random bodies")
    g.add_argument(
        "--arrivals", choices=["poisson", "constant"], default="poisson", help="sweep steps"
    )
    s = parser.add_argument_group("gate and output")
    s.add_argument("--sla", action="append", default=[], help='e.g. "p99<=150ms" (repeatable)')
    s.add_argument(
        "--slo-attainment",
        default="99%",
        help="share of requests an SLO term (ttft, tpot, itl, e2e) must hold for (default 99%%)",
    )
    s.add_argument("--timeout", default="30s", help="per request (default 30s)")
    s.add_argument(
        "--deadline",
        default="auto",
        help="propagate each request's remaining budget as X-Request-Timeout-Ms (the budget "
        "less the client's own send lag): auto (the ttft term of a stream, else the e2e term "
        "or goodput bound), off, or a duration such as 150ms",
    )
    s.add_argument("--metrics-url", help="server /metrics to scrape before and after")
    s.add_argument(
        "--report", type=Path, metavar="DIR", help="write result.json, requests.jsonl, report.html"
    )
    s.add_argument("--csv", action="store_true", help="also write requests.csv")
    s.add_argument("--json", action="store_true", help="print result JSON on stdout")
    s.add_argument("--quiet", action="store_true", help="no progress display or table")
    t = parser.add_argument_group("trust (client self-check)")
    t.add_argument("--max-loop-lag", default="50ms", help="p99 event-loop lag allowed")
    t.add_argument("--max-send-lag", default="50ms", help="p99 late-send allowed (open-loop)")
    t.add_argument("--max-cpu", type=float, default=0.95, help="client CPU, share of one core")
    t.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")


def _share(text: str, what: str) -> float:
    t = text.strip()
    try:
        return float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ConfigError(f"{what} {text!r}: write a share, e.g. 99% or 0.9") from None


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    if args.files:
        raise ConfigError(f"unexpected arguments {args.files}; only 'compare' takes two files")
    steps = args.steps if args.steps is not None else (8 if args.profile == "sweep" else 5)
    profile = Profile(
        kind=args.profile,
        rate=args.rate,
        duration_s=parse_duration(args.duration, what="--duration") if args.duration else None,
        count=args.count,
        concurrency=args.concurrency,
        requests=args.requests,
        to_rate=args.to_rate,
        to_inflight=args.to_inflight,
        steps=steps,
        hold_s=parse_duration(args.hold, what="--hold") if args.hold else None,
        seed=args.seed,
        arrivals=args.arrivals,
    )
    source = SourceSpec(
        dataset=args.dataset,
        input_len=(
            parse_length(args.random_input_len, what="--random-input-len")
            if args.random_input_len
            else None
        ),
        output_len=(
            parse_length(args.random_output_len, what="--random-output-len")
            if args.random_output_len
            else None
        ),
        tokenizer=args.tokenizer,
        seed=args.seed,
    )
    body = None
    if args.body is not None:
        try:
            body = args.body.read_bytes()
        except OSError as exc:
            raise ConfigError(f"--body {args.body}: cannot read ({exc.strerror})") from exc
    headers = []
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise ConfigError(f"--header {h!r}: write 'Name: value'")
        headers.append((name.strip(), value.strip()))
    extra = {"prompt": args.prompt} if args.prompt else {}
    return LoadConfig(
        url=args.url,
        profile=profile,
        endpoint=args.endpoint,
        body=body,
        model=args.model,
        stream=args.stream,
        timeout_s=parse_duration(args.timeout, what="--timeout"),
        sla=tuple(parse_sla(x) for x in args.sla),
        trust=TrustLimits(
            max_loop_lag_s=parse_duration(args.max_loop_lag, what="--max-loop-lag"),
            max_send_lag_s=parse_duration(args.max_send_lag, what="--max-send-lag"),
            max_cpu=args.max_cpu,
        ),
        metrics_url=args.metrics_url,
        headers=tuple(headers),
        source=source,
        slo_attainment=_share(args.slo_attainment, "--slo-attainment"),
        deadline=(
            args.deadline
            if args.deadline in ("auto", "off")
            else parse_duration(args.deadline, what="--deadline")
        ),
        **extra,
    )


def _progress_line(p: Progress) -> Text:
    if p.planned_s:
        frac = min(1.0, p.elapsed_s / p.planned_s)
    elif p.expected:
        frac = min(1.0, p.done / p.expected)
    else:
        frac = 0.0
    bar = "#" * int(frac * 30) + "-" * (30 - int(frac * 30))
    total = f"/{p.expected:,}" if p.expected else ""
    return Text(
        f"[{bar}] {p.elapsed_s:6.1f}s  sent {p.sent:,}{total}  done {p.done:,}  "
        f"in flight {p.in_flight:,}  errors {p.errors:,}  loop lag {p.loop_lag_s * 1e3:.0f} ms"
    )


def _run_loop(coro: Coroutine[Any, Any, T], loop_kind: str) -> T:
    if loop_kind == "uvloop":
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    if args.url == "compare":
        return run_compare(args, err)
    try:
        cfg = config_from_args(args)
        source = BodySource(cfg)
    except ConfigError as exc:
        err.print(f"[red]tailguard load: {exc.message}[/]")
        return 2
    if cfg.profile.kind == "sweep":
        return run_sweep_cli(args, cfg, source, err)
    show_progress = not args.quiet and err.is_terminal
    result: LoadResult
    try:
        if show_progress:
            with Live(console=err, auto_refresh=False, transient=True) as live:

                def on_progress(p: Progress) -> None:
                    live.update(_progress_line(p), refresh=True)

                result = _run_loop(run_load(cfg, on_progress, source), args.loop)
        else:
            result = _run_loop(run_load(cfg, source=source), args.loop)
    except (OSError, ValueError) as exc:
        err.print(f"[red]tailguard load: could not run: {exc}[/]")
        return 2
    if not args.quiet:
        print_summary(result, Console(stderr=args.json, width=None if err.is_terminal else 130))
    if args.report is not None:
        paths = write_report(result, args.report, csv=args.csv)
        if not args.quiet:
            err.print("report: " + ", ".join(str(p) for p in paths))
    if args.json:
        sys.stdout.write(json.dumps(result.to_dict(), default=str) + "\n")
    return result.exit_code()


def run_sweep_cli(
    args: argparse.Namespace, cfg: LoadConfig, source: BodySource, err: Console
) -> int:
    out = Console(stderr=args.json, width=None if err.is_terminal else 130)
    show_progress = not args.quiet and err.is_terminal

    def on_step(label: str, res: LoadResult) -> None:
        if args.quiet:
            return
        s = res.summary
        good = f"  goodput {s.good / res.facts.wall_s:,.2f}/s" if s.good is not None else ""
        ttft = f"  TTFT p99 {s.ttft.p99 * 1e3:,.1f} ms" if s.ttft.p99 is not None else ""
        p99 = f"{s.latency.p99 * 1e3:,.1f} ms" if s.latency.p99 is not None else "-"
        out.print(
            f"{label:>16}: sent {s.total:,}  ok {s.ok:,}  {s.requests_per_s:,.2f} ok/s{good}  "
            f"p99 {p99}{ttft}  {res.verdict()}"
        )

    try:
        if show_progress:
            with Live(console=err, auto_refresh=False, transient=True) as live:

                def on_progress(p: Progress) -> None:
                    live.update(_progress_line(p), refresh=True)

                result = _run_loop(
                    run_sweep(cfg, source=source, on_step=on_step, progress=on_progress),
                    args.loop,
                )
        else:
            result = _run_loop(run_sweep(cfg, source=source, on_step=on_step), args.loop)
    except (OSError, ValueError) as exc:
        err.print(f"[red]tailguard load: could not run: {exc}[/]")
        return 2
    d = result.to_dict()
    if not args.quiet:
        print_sweep(d, out)
    if args.report is not None:
        paths = write_sweep_report(result, args.report, csv=args.csv)
        if not args.quiet:
            err.print("report: " + ", ".join(str(p) for p in paths) + f", {args.report}/steps/")
    if args.json:
        sys.stdout.write(json.dumps(d, default=str) + "\n")
    return result.exit_code()


def print_sweep(d: dict[str, Any], con: Console) -> None:
    cfg = d["config"]
    con.print(f"[bold]tailguard load sweep[/] {cfg['url']}  {cfg['profile_text']}")
    con.print(f"bodies: {cfg['source_text']}")
    t = Table(title="sweep (throughput and goodput per second of wall time)")
    cols = ("step", "offered/s", "sent", "ok/s", "goodput/s", "good", "p50 ms", "p99 ms")
    for col in (*cols, "TTFT p99", "TPOT p99", "out tok/s", "SLA"):
        t.add_column(col, justify="left" if col == "step" else "right")
    knee = (d.get("knee") or {}).get("label")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:,.1f}"

    for q in [*d["probes"], *d["points"]]:
        share = q["good_share"]
        t.add_row(
            q["label"] + (" <- knee" if q["label"] == knee else ""),
            "-" if q["offered_rps"] is None else f"{q['offered_rps']:,.2f}",
            f"{q['total']:,}",
            f"{q['throughput_rps']:,.2f}",
            "-" if q["goodput_rps"] is None else f"{q['goodput_rps']:,.2f}",
            "-" if share is None else f"{share:.1%}",
            ms(q["latency_p50_s"]),
            ms(q["latency_p99_s"]),
            ms(q["ttft_p99_s"]),
            ms(q["tpot_p99_s"]),
            f"{q['output_tokens_per_s']:,.1f}",
            ("PASS" if q["sla_passed"] else "FAIL") + ("" if q["trusted"] else " (untrusted)"),
        )
    con.print(t)
    con.print(f"knee rule: {d['knee_rule']}")
    code = d["exit_code"]
    color = {0: "green", 1: "red", 2: "yellow"}[code]
    con.print(f"[bold {color}]{d['verdict']}[/]  (exit {code})")


def run_compare(args: argparse.Namespace, err: Console) -> int:
    """`tailguard load compare A B`: exit 0 when both could be read and compared, else 2."""
    if len(args.files) != 2:
        err.print("[red]tailguard load compare: give two result.json files (or report dirs)[/]")
        return 2
    pa, pb = (Path(f) for f in args.files)
    try:
        a, b = load_result(pa), load_result(pb)
        rows = compare_rows(a, b)
    except ConfigError as exc:
        err.print(f"[red]tailguard load {exc.message}[/]")
        return 2
    names = (_name(pa), _name(pb))
    if not args.quiet:
        con = Console(stderr=args.json, width=None if err.is_terminal else 130)
        t = Table(title=f"A = {names[0]}   B = {names[1]}")
        for col in ("metric", "A", "B", "B / A", "better"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        for r in rows:
            unit = f" ({r.unit})" if r.unit else ""
            t.add_row(r.metric + unit, fmt(r.a, r.unit), fmt(r.b, r.unit), fmt_ratio(r), r.better)
        con.print(t)
    if args.report is not None:
        args.report.mkdir(parents=True, exist_ok=True)
        page = args.report / "compare.html"
        page.write_text(render_compare_html(names, a, b, rows), encoding="utf-8")
        table = [{**asdict(r), "ratio": r.ratio} for r in rows]
        (args.report / "compare.json").write_text(
            json.dumps({"a": str(pa), "b": str(pb), "rows": table}, indent=2) + "\n"
        )
        if not args.quiet:
            err.print(f"report: {page}, {args.report / 'compare.json'}")
    if args.json:
        out = {"a": str(pa), "b": str(pb), "rows": [{**asdict(r), "ratio": r.ratio} for r in rows]}
        sys.stdout.write(json.dumps(out) + "\n")
    return 0


def _name(path: Path) -> str:
    return path.name if path.is_dir() else (path.parent.name or path.stem)

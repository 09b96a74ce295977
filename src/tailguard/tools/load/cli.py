"""`tailguard load URL ...`: open-loop load test and SLA gate.

Exit codes: 0 every --sla term holds; 1 one fails; 2 the run could not start or could not be
trusted (the client itself lagged or saturated), so its numbers must not pass or fail a gate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.live import Live
from rich.text import Text

from tailguard.errors import ConfigError
from tailguard.tools.load.analysis import LoadResult
from tailguard.tools.load.config import (
    ENDPOINT_PATHS,
    LoadConfig,
    Profile,
    TrustLimits,
    parse_duration,
    parse_sla,
)
from tailguard.tools.load.report import print_summary, write_report
from tailguard.tools.load.runner import Progress, run_load

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
        "SLA terms: p99<=150ms  max<=200ms  errors<=0.1%  goodput>=500/s  goodput(150ms)>=500/s"
        "  throughput>=1000/s\n"
        "exit: 0 SLA holds, 1 SLA fails, 2 run untrustworthy or could not start"
    )
    parser.add_argument("url", help="base URL (http://host:port); the full URL for --endpoint raw")
    parser.add_argument("--endpoint", default="infer", choices=list(ENDPOINT_PATHS))
    parser.add_argument(
        "--body", type=Path, metavar="FILE", help="JSON body file (required for raw)"
    )
    parser.add_argument("--model", default="tailguard-embedded")
    parser.add_argument("--prompt", default=None, help="prompt text for built bodies")
    parser.add_argument("--stream", action="store_true", help="SSE for completions/chat")
    parser.add_argument("--header", action="append", default=[], help="'Name: value'")
    g = parser.add_argument_group("profile")
    g.add_argument(
        "--profile",
        default="constant",
        choices=["constant", "poisson", "ramp", "burst", "closed"],
    )
    g.add_argument("--rate", type=float, help="requests/s (ramp: start rate)")
    g.add_argument("--duration", help="sending time, e.g. 30s, 2m")
    g.add_argument("--count", type=int, help="burst size")
    g.add_argument("--concurrency", type=int, help="closed-loop workers")
    g.add_argument("--requests", type=int, help="closed-loop total requests (sent exactly)")
    g.add_argument("--to-rate", type=float, help="ramp target rate")
    g.add_argument("--to-inflight", type=int, help="ramp target in-flight requests")
    g.add_argument("--steps", type=int, default=5, help="ramp steps (default 5)")
    g.add_argument("--hold", help="ramp: time held per step, e.g. 10s")
    g.add_argument("--seed", type=int, default=0, help="poisson arrival seed")
    s = parser.add_argument_group("gate and output")
    s.add_argument("--sla", action="append", default=[], help='e.g. "p99<=150ms" (repeatable)')
    s.add_argument("--timeout", default="30s", help="per request (default 30s)")
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


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    profile = Profile(
        kind=args.profile,
        rate=args.rate,
        duration_s=parse_duration(args.duration, what="--duration") if args.duration else None,
        count=args.count,
        concurrency=args.concurrency,
        requests=args.requests,
        to_rate=args.to_rate,
        to_inflight=args.to_inflight,
        steps=args.steps,
        hold_s=parse_duration(args.hold, what="--hold") if args.hold else None,
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
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        err.print(f"[red]tailguard load: {exc.message}[/]")
        return 2
    show_progress = not args.quiet and err.is_terminal
    result: LoadResult
    try:
        if show_progress:
            with Live(console=err, auto_refresh=False, transient=True) as live:

                def on_progress(p: Progress) -> None:
                    live.update(_progress_line(p), refresh=True)

                result = _run_loop(run_load(cfg, on_progress), args.loop)
        else:
            result = _run_loop(run_load(cfg), args.loop)
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

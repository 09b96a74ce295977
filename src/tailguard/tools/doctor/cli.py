"""`tailguard doctor`: name the cause of a latency spike, with the numbers and the fix.

Exit codes: 0 the SLA was met and no risk seen, 1 the SLA was missed (the cause is named, or
`unexplained`), 2 nothing could be collected, 3 the SLA was met but risks were seen.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from pathlib import Path

from tailguard.tools.doctor.collect import (
    CollectConfig,
    CollectError,
    collect,
    load_recorded,
    with_load_report,
)
from tailguard.tools.doctor.diagnosis import EXIT_COLLECT, diagnose
from tailguard.tools.doctor.report import render_json, render_text
from tailguard.tools.doctor.snapshot import ParseError

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|min|h)?\s*$")


def parse_duration(text: str) -> float:
    """'120s', '2m', '500ms', '1.5' (seconds) -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: use a duration such as 120s, 2m or 500ms")
    scale = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}[m.group(2)]
    value = float(m.group(1)) * scale
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0] if __doc__ else None
    # fmt: off
    p.add_argument("--server", action="append", default=[], metavar="URL",
                   help="tailguard server base URL (its /metrics is scraped); repeatable")
    p.add_argument("--envoy-admin", metavar="URL", help="Envoy admin base URL (reads /stats)")
    p.add_argument("--prometheus", metavar="URL",
                   help="read the servers' metrics for the window from Prometheus instead")
    p.add_argument("--load-report", type=Path, metavar="FILE",
                   help="a `tailguard load --report` folder or its requests.jsonl")
    p.add_argument("--window", type=parse_duration, default=120.0, metavar="DURATION",
                   help="time between the two scrapes (default 120s)")
    p.add_argument("--timeout", type=parse_duration, default=5.0, metavar="DURATION",
                   help="per-request HTTP timeout (default 5s)")
    p.add_argument("--sla", type=parse_duration, default=None, metavar="DURATION",
                   help="SLA to judge by (default: the server's tailguard_sla_seconds, else 150ms)")
    p.add_argument("--host-cores", type=int, default=0, metavar="N",
                   help="cores of the servers' host (default: this machine's)")
    p.add_argument("--record", type=Path, metavar="DIR",
                   help="also write what was collected to DIR (re-read with --from-dir)")
    p.add_argument("--from-dir", type=Path, metavar="DIR",
                   help="diagnose a recorded window instead of collecting one")
    p.add_argument("--probe-path", default="/health", metavar="PATH",
                   help="GET this on each server every 100 ms during the window (default /health)")
    p.add_argument("--no-probe", action="store_true", help="do not probe the servers")
    p.add_argument("--no-proc", action="store_true",
                   help="do not sample /proc for servers on this host")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    # fmt: on


def run(args: argparse.Namespace) -> int:
    try:
        if args.from_dir is not None:
            obs = load_recorded(args.from_dir, host_cores=args.host_cores, sla_s=args.sla)
            if args.load_report is not None:
                obs = with_load_report(obs, args.load_report)
        else:
            cfg = CollectConfig(
                servers=tuple(args.server),
                envoy_admin=args.envoy_admin,
                prometheus=args.prometheus,
                load_report=args.load_report,
                window_s=args.window,
                timeout_s=args.timeout,
                host_cores=args.host_cores,
                sla_s=args.sla,
                record_dir=args.record,
                probe_path=None if args.no_probe else args.probe_path,
                watch_procs=not args.no_proc,
            )
            obs = asyncio.run(collect(cfg))
    except (CollectError, ParseError, ValueError, OSError) as e:
        print(f"tailguard doctor: could not collect: {e}", file=sys.stderr)
        return EXIT_COLLECT
    diagnosis = diagnose(obs)
    try:
        print(render_json(diagnosis) if args.json else render_text(diagnosis), flush=True)
    except BrokenPipeError:  # `tailguard doctor ... | head`: the reader left; the verdict stands
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return diagnosis.exit_code

"""`tailguard batch INPUT.jsonl --output OUT.jsonl --endpoint URL [...]`

Exit codes: 0 every request succeeded; 1 some failed (see the errors file); 2 the input or the
options were refused before anything was sent; 130 interrupted (run the same command again to
resume).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import signal
import sqlite3
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from tailguard.errors import ConfigError
from tailguard.tools.batch.config import BatchConfig
from tailguard.tools.batch.inputs import read_input
from tailguard.tools.batch.ledger import Ledger
from tailguard.tools.batch.report import LiveProgress, print_summary, summarize
from tailguard.tools.batch.runner import BatchRunner, RunStats

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BatchConfig(Path("in"), Path("out"), ("http://x",))
    p.description = "Run an OpenAI Batch file against tailguard endpoints; resumable."
    p.add_argument("input", type=Path, metavar="INPUT.jsonl", help="OpenAI Batch input file")
    p.add_argument("--output", "-o", type=Path, required=True, help="results (JSONL)")
    p.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="URL",
        help="server base URL, e.g. http://127.0.0.1:8000; repeat for several",
    )
    p.add_argument("--errors", type=Path, help="failed requests (default: OUT.errors.jsonl)")
    p.add_argument("--ledger", type=Path, help="ledger (default: OUT.jsonl.ledger.sqlite)")
    p.add_argument(
        "--sla-ms",
        type=float,
        default=d.sla_ms,
        help="latency bound per request (default: %(default)s)",
    )
    p.add_argument("--max-rps", type=float, help="cap on requests started per second")
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=d.max_in_flight,
        help="ceiling of the adaptive in-flight limit, all endpoints together "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--initial-in-flight",
        type=int,
        default=d.initial_in_flight,
        help="starting in-flight limit per endpoint (default: %(default)s)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=d.max_attempts,
        help="per request, first try included (default: %(default)s)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=d.timeout_s, help="per attempt (default: %(default)s)"
    )
    p.add_argument("--strict", action="store_true", help="refuse input with malformed lines")
    p.add_argument(
        "--retry-failed", action="store_true", help="on resume, resend requests that failed"
    )
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.add_argument("--summary-json", type=Path, help="also write the summary here")


def _config(a: argparse.Namespace) -> BatchConfig:
    return BatchConfig(
        input_path=a.input,
        output_path=a.output,
        endpoints=tuple(a.endpoint),
        errors_path=a.errors,
        ledger_path=a.ledger,
        sla_ms=a.sla_ms,
        max_rps=a.max_rps,
        max_in_flight=a.max_in_flight,
        initial_in_flight=a.initial_in_flight,
        max_attempts=a.max_attempts,
        timeout_s=a.timeout_s,
        strict=a.strict,
        retry_failed=a.retry_failed,
        progress=not a.no_progress,
        summary_json=a.summary_json,
    )


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        cfg = _config(args)
    except ConfigError as exc:
        err.print(f"tailguard batch: {exc}")
        return 2
    try:
        report = read_input(cfg.input_path)
    except OSError as exc:
        err.print(f"tailguard batch: cannot read the input: {exc}")
        return 2
    if report.duplicates or (report.malformed and cfg.strict):
        why = "duplicate custom_ids" if report.duplicates else "malformed lines (--strict)"
        err.print(f"tailguard batch: refused {cfg.input_path}: {why}; nothing was sent")
        for line in report.problems():
            err.print(f"  {line}")
        return 2
    if report.malformed:
        err.print(f"tailguard batch: skipping {len(report.malformed)} malformed line(s):")
        for line in report.problems():
            err.print(f"  {line}")
    if not report.items:
        err.print(f"tailguard batch: {cfg.input_path} has no valid request; nothing to do")
        return 2

    ledger = Ledger(cfg.ledger)
    try:
        try:
            resumed = ledger.bind_input(report.fingerprint, cfg.input_path)
        except ConfigError as exc:
            err.print(f"tailguard batch: {exc}")
            return 2
        if cfg.retry_failed:
            n = ledger.forget_failed()
            err.print(f"tailguard batch: {n} failed request(s) will be sent again")
        done = ledger.done_ids()
        todo = [it for it in report.items if it.custom_id not in done]
        already = len(report.items) - len(todo)
        if resumed:
            err.print(
                f"tailguard batch: resuming from {cfg.ledger}: {already} of "
                f"{len(report.items)} already done"
            )
        runner = BatchRunner(cfg, todo, ledger, already_done=already)
        try:
            stats = _run_loop(lambda: _drive(runner, err))
            succeeded, failed = ledger.write_outputs(cfg.output_path, cfg.errors)
        except (sqlite3.Error, OSError) as exc:
            err.print(
                f"tailguard batch: cannot write the ledger or the output ({exc}); results "
                "committed before this are kept: fix the cause (disk space, permissions) and "
                "run the same command again to resume"
            )
            return 2
    finally:
        ledger.close()

    summary = summarize(
        runner,
        stats,
        succeeded=succeeded,
        failed=failed,
        paths=(cfg.output_path, cfg.errors, cfg.ledger),
    )
    print_summary(summary, Console(highlight=False, soft_wrap=True))
    if cfg.summary_json is not None:
        cfg.summary_json.write_bytes(orjson.dumps(summary.to_dict(), option=orjson.OPT_INDENT_2))
    left = len(report.items) - succeeded - failed
    if stats.interrupted and left > 0:
        err.print(
            f"tailguard batch: interrupted with {left} request(s) not done; the ledger keeps "
            f"what finished. Resume with the same command:\n  {_command_line()}"
        )
        return 130
    return 0 if failed == 0 else 1


async def _drive(runner: BatchRunner, err: Console) -> RunStats:
    loop = asyncio.get_running_loop()
    interrupts = 0

    def on_signal() -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            err.print(
                f"\ntailguard batch: stopping: finishing {runner.in_flight} in-flight "
                "request(s); interrupt again to abandon them (they will be resent on resume)"
            )
            runner.request_stop()
        else:
            runner.abandon_in_flight()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    live = None
    if runner.cfg.progress:
        live = asyncio.create_task(LiveProgress(runner, err).run())
    try:
        return await runner.run()
    finally:
        if live is not None:
            live.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await live
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _run_loop(main: Callable[[], Coroutine[Any, Any, RunStats]]) -> RunStats:
    """asyncio with uvloop when it is installed (a cheaper event loop: more requests per core)."""
    factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as r:
        return r.run(main())


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("cli.py", "__main__.py")):
        argv[0:1] = ["tailguard"]
    elif argv:
        argv[0] = Path(argv[0]).name
    return shlex.join(argv)

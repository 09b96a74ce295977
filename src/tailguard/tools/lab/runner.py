"""Run one side of a scenario: start it, load it, let the doctor watch, record what it said.

The doctor's window opens just before the load starts and closes when the sending ends (it
looks during the incident, as an operator would); the load report, complete only after the last
response, is attached afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from tailguard.tools.doctor.collect import (
    CollectConfig,
    CollectError,
    Collector,
    default_cores,
    with_load_report,
)
from tailguard.tools.doctor.diagnosis import diagnose
from tailguard.tools.doctor.finding import Cause
from tailguard.tools.doctor.loadreport import LoadSummary
from tailguard.tools.doctor.report import plain, render_json, render_text
from tailguard.tools.doctor.snapshot import ParseError
from tailguard.tools.lab.procs import LabError, has_cuda
from tailguard.tools.lab.scenarios import Scenario, Side
from tailguard.tools.lab.setups import launch

LOAD_STARTUP_S = 2.0  # `tailguard load` imports and connects before its first send


@dataclass(frozen=True)
class LabConfig:
    out: Path = Path(".tailguard/lab")  # logs, load reports and doctor reports per run
    repeat: int = 1  # runs of every side
    scale: float = 1.0  # multiplies every load rate (bigger hosts)
    host_cores: int = 0  # 0: this machine's
    gap_s: float = 2.0  # pause between runs (sockets in TIME_WAIT, queues drain)

    def __post_init__(self) -> None:
        if self.repeat < 1:
            raise ValueError(f"--repeat {self.repeat}: must be >= 1")
        if self.scale <= 0:
            raise ValueError(f"--scale {self.scale}: must be positive")
        if self.gap_s < 0:
            raise ValueError(f"gap {self.gap_s}: must be >= 0")


@dataclass(frozen=True)
class SideResult:
    scenario: str
    side: str
    setup: str  # what ran, in words
    expected: Cause
    run: int  # 1-based repeat index
    verdict: Cause | None = None  # None: it could not run
    confidence: float = 0.0
    summary: str = ""  # the top finding's numbers, or why it did not run
    tails: LoadSummary | None = None
    load_exit: int | None = None  # `tailguard load` exit code (2: untrustworthy run)
    error: str | None = None
    skipped: bool = False  # True: allowed not to run here (CUDA-only on a CPU machine)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def correct(self) -> bool:
        return self.verdict is self.expected


async def run_side(scn: Scenario, side: Side, run: int, cfg: LabConfig) -> SideResult:
    base = SideResult(scn.name, side.name, side.setup.describe(), side.expected, run)
    if scn.needs_cuda and not has_cuda():
        return _replace(
            base, error="needs a CUDA GPU (none on this machine); skipped", skipped=True
        )
    missing = side.setup.missing()
    if missing:
        return _replace(base, error=f"not run: {missing}")
    d = (cfg.out / f"{scn.name}-{side.name}-{run}").resolve()
    d.mkdir(parents=True, exist_ok=True)
    try:
        with launch(side.setup, d) as r:
            if scn.load.warmup_s > 0:
                await _load(
                    scn.load.warmup(r.target_url, str(d / "warmup"), cfg.scale),
                    d / "warmup.log",
                    r.client_env,
                )
            collector = Collector(
                CollectConfig(
                    servers=(r.server_url,),
                    envoy_admin=r.envoy_admin,
                    window_s=scn.load.duration_s,
                    sla_s=scn.sla_s,
                    host_cores=cfg.host_cores or default_cores(),
                    record_dir=d / "window",  # re-read with `tailguard doctor --from-dir`
                )
            )
            await collector.start()
            load_args = scn.load.args(r.target_url, str(d / "load"), cfg.scale)
            with (d / "load.log").open("wb") as log:
                proc = await _start_load(load_args, log, r.client_env)
                # sending is over after duration + start-up; responses may still be draining
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        asyncio.shield(proc.wait()), scn.load.duration_s + LOAD_STARTUP_S
                    )
                obs = await collector.finish()
                load_exit = await proc.wait()
    except (LabError, CollectError, ParseError, OSError, ValueError) as e:
        return _replace(base, error=f"{type(e).__name__}: {e}")
    if not (d / "load" / "requests.jsonl").is_file():
        return _replace(
            base, error=f"the load produced no report; see {d / 'load.log'}", load_exit=load_exit
        )
    obs = with_load_report(obs, d / "load")
    shutil.copyfile(d / "load" / "requests.jsonl", d / "window" / "requests.jsonl")
    diagnosis = diagnose(obs)
    (d / "doctor.txt").write_text(render_text(diagnosis) + "\n")
    (d / "doctor.json").write_text(render_json(diagnosis) + "\n")
    top = diagnosis.causes[0] if diagnosis.causes else None
    notes = [] if load_exit != 2 else ["tailguard load flagged its own run untrustworthy (exit 2)"]
    return _replace(
        base,
        verdict=diagnosis.verdict,
        confidence=top.confidence if top else 0.0,
        summary=top.summary if top else diagnosis.verdict.value,
        tails=obs.load,
        load_exit=load_exit,
        notes=tuple(notes) + diagnosis.collection_notes,
    )


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}


async def _start_load(
    args: list[str], log: IO[bytes], env: dict[str, str]
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tailguard.cli", "load", *args, stdout=log, stderr=log, env=_env(env)
    )


async def _load(args: list[str], log_path: Path, env: dict[str, str]) -> int:
    """Run `tailguard load ARGS` to completion; its exit code."""
    with log_path.open("wb") as log:
        return await (await _start_load(args, log, env)).wait()


def _replace(r: SideResult, **changes: object) -> SideResult:
    return replace(r, **changes)  # type: ignore[arg-type]


async def run_scenarios(
    scenarios: list[Scenario],
    cfg: LabConfig,
    on_result: Callable[[SideResult], None] | None = None,
) -> list[SideResult]:
    """Every side of every scenario, `cfg.repeat` times; the sides alternate within a repeat so
    a slow patch of the machine hits both sides, not one."""
    results: list[SideResult] = []
    for scn in scenarios:
        for run in range(1, cfg.repeat + 1):
            for side in scn.sides:
                res = await run_side(scn, side, run, cfg)
                results.append(res)
                if on_result is not None:
                    on_result(res)
                if res.error is None:
                    await asyncio.sleep(cfg.gap_s)
    return results


def results_json(results: list[SideResult]) -> str:
    return json.dumps([plain(r) for r in results], indent=2)

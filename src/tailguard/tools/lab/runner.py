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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import aiohttp

from tailguard.tools.doctor import thresholds as T
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
from tailguard.tools.doctor.snapshot import ParseError, parse_prometheus_text
from tailguard.tools.lab.procs import LabError, Proc, has_cuda, start, stop
from tailguard.tools.lab.scenarios import Scenario, Side
from tailguard.tools.lab.setups import launch

LOAD_STARTUP_S = 20.0  # most `tailguard load` may take to import and send (a host full of hogs)


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

    standing_risk: bool = False  # the injection is a hazard even when the SLA holds

    @property
    def truth(self) -> Cause | None:
        """What the doctor should say (expected_verdict); None: a void run."""
        return expected_verdict(self.expected, self.standing_risk, self.tails)

    @property
    def correct(self) -> bool:
        return self.verdict is not None and self.verdict is self.truth


def sla_missed(t: LoadSummary | None) -> bool:
    """The client's view of the window (the ground truth the lab judges by): under 99% within
    the SLA, or over 1% refused."""
    if t is None or t.requests < T.MIN_REQUESTS:
        return False
    return t.within_sla < T.SLA_TARGET_SHARE or t.refused / t.requests > T.REJECT_SHARE


def expected_verdict(
    injected: Cause, standing_risk: bool, tails: LoadSummary | None
) -> Cause | None:
    """The injected cause when the client saw the SLA missed; otherwise healthy with risk (an
    injection that is a standing hazard, e.g. a per-connection cap) or healthy. None (void):
    nothing was injected and yet the client saw a miss - the shared machine's own noise."""
    if sla_missed(tails):
        return None if injected is Cause.NONE else injected
    return Cause.RISK if standing_risk else Cause.NONE


async def run_side(scn: Scenario, side: Side, run: int, cfg: LabConfig) -> SideResult:
    base = SideResult(scn.name, side.name, side.setup.describe(), side.expected, run,
                      standing_risk=side.standing_risk)  # fmt: skip
    if scn.needs_cuda and not has_cuda():
        return _replace(
            base, error="needs a CUDA GPU (none on this machine); skipped", skipped=True
        )
    missing = side.setup.missing()
    if missing:
        return _replace(base, error=f"not run: {missing}")
    load = side.load or scn.load
    d = (cfg.out / f"{scn.name}-{side.name}-{run}").resolve()
    d.mkdir(parents=True, exist_ok=True)
    try:
        with launch(side.setup, d) as r:
            if load.warmup_s > 0:
                await _load(
                    load.warmup(r.target_url, str(d / "warmup"), cfg.scale),
                    d / "warmup.log",
                    r.client_env,
                )
            collector = Collector(
                CollectConfig(
                    servers=(r.server_url,),
                    envoy_admin=r.envoy_admin,
                    window_s=load.duration_s,
                    sla_s=scn.sla_s,
                    host_cores=cfg.host_cores or default_cores(),
                    record_dir=d / "window",  # re-read with `tailguard doctor --from-dir`
                )
            )
            with hogging(side.hogs, d / "hogs.log"):
                await collector.start()
                watch = AnswerWatch(r.server_url)
                watch.baseline = await watch.answers()
                load_args = load.args(r.target_url, str(d / "load"), cfg.scale)
                with (d / "load.log").open("wb") as log:
                    proc = await _start_load(load_args, log, r.client_env)
                    # Sending is over `duration` after the first answer (the client's start-up
                    # takes seconds on a busy host); responses may still drain after it.
                    try:
                        await watch.first_answer(LOAD_STARTUP_S)
                    finally:
                        await watch.session.close()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(proc.wait()), load.duration_s)
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


class AnswerWatch:
    """Polls the server's answered-request count on one kept-alive connection (a poll that
    opened a connection each time would itself look like churn to the doctor)."""

    def __init__(self, server_url: str) -> None:
        self.url = server_url + "/metrics"
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=5), connector=aiohttp.TCPConnector(limit=1)
        )
        self.baseline = -1.0

    async def answers(self) -> float:
        """Requests answered so far (the latency histogram's count, every outcome); -1 when
        /metrics cannot be read."""
        try:
            async with self.session.get(self.url) as resp:
                snap = parse_prometheus_text(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ParseError):
            return -1.0
        # tailguard's answered requests, or a vLLM server's finished ones
        return snap.get("mistral_inference_latency_seconds_count") + snap.get(
            "vllm:e2e_request_latency_seconds_count"
        )

    async def first_answer(self, timeout_s: float) -> None:
        """Wait (every 0.1 s, at most `timeout_s`) until the server answered more than at the
        baseline: the load is sending."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n = await self.answers()
            if n < 0 or n > self.baseline:
                return
            await asyncio.sleep(0.1)


HOG = "import time\nwhile True: time.perf_counter()"  # a CPU-bound neighbour, nothing else


@contextlib.contextmanager
def hogging(n: int, log: Path) -> Iterator[list[Proc]]:
    """`n` CPU-bound processes next to the server for the block (stopped by their pids)."""
    hogs: list[Proc] = []
    try:
        for i in range(n):
            hogs.append(start(f"hog-{i}", [sys.executable, "-c", HOG], log))
        yield hogs
    finally:
        for h in hogs:
            stop(h, timeout_s=2.0)


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

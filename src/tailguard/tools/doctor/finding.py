"""What a rule returns: the cause it looks for, the numbers it read, how sure it is, the fix.

Confidence combines independent signals as 1 - prod(1 - weight) over the signals that fired, so
one strong signal (a per-connection cap being hit, an allocator retry) names a cause alone while
weak ones (threads over cores) need company. A signal marked `risk` is a standing hazard
(misconfiguration, a pool running dry): on a window that met its SLA it is reported as a risk
with its fix, never as the cause of anything.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from tailguard.tools.doctor import thresholds as T


class Cause(enum.StrEnum):
    OVERLOAD = "overload"
    NOISY_NEIGHBOUR = "noisy_neighbour"
    STARVATION = "starvation"
    GC = "gc"
    KV_EXHAUSTION = "kv_exhaustion"
    PREFILL = "prefill_heavy"
    ADMISSION = "admission_miscalibrated"
    CHURN = "churn"
    FRAGMENTATION = "fragmentation"
    UNEXPLAINED = "unexplained"  # the SLA was missed and no rule explains it
    RISK = "healthy_with_risk"  # the SLA was met; risks listed with their fix
    NONE = "none"  # the SLA was met; nothing to fix


@dataclass(frozen=True)
class Evidence:
    """One number a rule looked at, against the threshold it was judged by."""

    what: str
    value: float  # -1.0: could not be read
    threshold: float | None
    fired: bool
    weight: float = 0.0  # contribution to confidence when fired
    unit: str = ""
    where: str = ""
    risk: bool = False  # a standing hazard worth fixing even when the SLA was met


@dataclass(frozen=True)
class Finding:
    cause: Cause
    title: str
    confidence: float  # 0..1
    summary: str  # one line with the decisive numbers
    evidence: tuple[Evidence, ...] = ()
    fix: tuple[str, ...] = ()
    where: str = ""  # the server / proxy the evidence came from
    first: bool = False  # outranks every other cause when named (overload while refusing)

    @property
    def is_cause(self) -> bool:
        return self.confidence >= T.CAUSE_MIN_CONFIDENCE

    @property
    def risks(self) -> tuple[Evidence, ...]:
        """The standing hazards this rule saw (fired signals marked `risk`)."""
        return tuple(e for e in self.evidence if e.fired and e.risk)

    def with_confidence(self, conf: float, note: str = "") -> Finding:
        summary = f"{self.summary} ({note})" if note else self.summary
        return Finding(self.cause, self.title, round(conf, 3), summary, self.evidence, self.fix,
                       self.where, self.first)  # fmt: skip


def combine(ev: Sequence[Evidence]) -> float:
    miss = 1.0
    for e in ev:
        if e.fired:
            miss *= 1.0 - e.weight
    return round(1.0 - miss, 3)


def ev(what: str, value: float, threshold: float | None, fired: bool, weight: float,
       unit: str = "", where: str = "", risk: bool = False) -> Evidence:  # fmt: skip
    return Evidence(what, round(value, 6), threshold, fired, weight, unit, where, risk)


def fmt(e: Evidence) -> str:
    return f"{e.what} {e.value:.3g}{e.unit}"


def summary(evidence: Sequence[Evidence], fallback: str) -> str:
    fired = [e for e in evidence if e.fired]
    return "; ".join(fmt(e) for e in fired) if fired else fallback


class Strongest:
    """The window (server) whose evidence is strongest, across the windows a rule looks at;
    a later window wins a tie. `finding` turns it into the rule's finding."""

    def __init__(self) -> None:
        self.conf = 0.0
        self.evidence: list[Evidence] = []
        self.where = ""

    def offer(self, evidence: list[Evidence], where: str, conf: float | None = None) -> None:
        """One window's evidence; `conf` overrides `combine(evidence)` (a rule's own discount)."""
        c = combine(evidence) if conf is None else round(conf, 3)
        if c >= self.conf:
            self.conf, self.evidence, self.where = c, evidence, where

    def finding(
        self, cause: Cause, title: str, fix: tuple[str, ...], healthy: str, missing: str = ""
    ) -> Finding:
        """`healthy`: the summary when nothing fired; `missing`: when no window had figures."""
        text = summary(self.evidence, healthy) if self.evidence or not missing else missing
        return Finding(cause=cause, title=title, confidence=self.conf, summary=text,
                       evidence=tuple(self.evidence), fix=fix, where=self.where)  # fmt: skip


__all__ = ["Cause", "Evidence", "Finding", "Strongest", "combine", "ev", "fmt", "summary"]

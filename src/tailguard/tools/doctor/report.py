"""Render a Diagnosis: a readable report (most likely cause first) or JSON."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Any

from tailguard.tools.doctor import thresholds as T
from tailguard.tools.doctor.diagnosis import Diagnosis
from tailguard.tools.doctor.finding import Evidence, Finding


def _ms(s: float) -> str:
    if math.isinf(s):
        return "> largest bucket"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _level(conf: float) -> str:
    return "high" if conf >= 0.8 else "medium" if conf >= T.CAUSE_MIN_CONFIDENCE else "low"


def _evidence_line(e: Evidence) -> str:
    mark = ("[!]" if e.risk else "[x]") if e.fired else "[ ]"
    thr = "" if e.threshold is None else f"  (threshold {e.threshold:g})"
    where = f"  @ {e.where}" if e.where else ""
    value = "n/a" if e.value == -1.0 else f"{e.value:.4g}{e.unit}"
    return f"     {mark} {e.what} = {value}{thr}{where}"


def _finding(i: int, f: Finding) -> list[str]:
    lines = [
        f"{i}. {f.cause.value.upper()}: {f.title}  "
        f"(confidence {f.confidence:.2f}, {_level(f.confidence)})",
        f"   {f.summary}",
        "   evidence:",
        *(_evidence_line(e) for e in f.evidence),
        "   fix:",
        *(f"     - {x}" for x in f.fix),
    ]
    return lines


def render_text(d: Diagnosis) -> str:
    s = d.symptom
    out = [f"tailguard doctor: window {d.window_s:.1f} s, SLA {_ms(s.sla_s)}"]
    if s.server_requests:
        out.append(
            f"server: {s.server_requests} requests ok, {s.server_within_sla:.1%} within SLA "
            f"(target {T.SLA_TARGET_SHARE:.0%}), p50 <= {_ms(s.server_p50_upper_s)}, "
            f"p99 <= {_ms(s.server_p99_upper_s)} (bucket bounds)"
        )
    if s.client is not None:
        c = s.client
        out.append(
            f"client: {c.requests} requests, {c.ok} ok, {c.refused} refused, p50 {_ms(c.p50_s)}, "
            f"p99 {_ms(c.p99_s)}, max {_ms(c.max_s)}, {c.within_sla:.1%} within SLA, "
            f"{c.new_cx_per_request:.3f} new connections/request"
        )
    if not s.enough_traffic:
        out.append(f"(fewer than {T.MIN_REQUESTS} requests in the window: shares are not judged)")
    out += [f"note: {n}" for n in d.collection_notes]
    out.append("")
    if not s.missed:
        out.append("the window met its SLA: no cause is named"
                   + (" (risks below)" if d.risks else "; no standing risk seen"))  # fmt: skip
    elif d.causes:
        out.append(f"SLA missed ({s.how_missed}); causes, most likely first:")
        for i, f in enumerate(d.causes, 1):
            out += _finding(i, f)
    else:
        out.append(
            f"SLA missed ({s.how_missed}) and no rule explains it: every rule's evidence is "
            "below its bar. Look outside these processes: CPU steal, the network, the client."
        )
    if d.risks:
        out.append("")
        out.append("risks (standing hazards, each with its fix; [!] marks the signal):")
        for f in d.risks:
            out.append(f"   {f.cause.value}: {f.title}: "
                       + "; ".join(f"{e.what} {e.value:.3g}{e.unit}" for e in f.risks))  # fmt: skip
            out += [f"     - fix: {x}" for x in f.fix[:2]]
    out.append("")
    out.append("looked at and not named:")
    for f in d.notes:
        out.append(f"   {f.cause.value} ({f.confidence:.2f}): {f.summary}")
    if d.not_evaluated:
        out.append("")
        out.append("could not evaluate (the evidence is not exported):")
        out += [f"   {x}" for x in d.not_evaluated]
    out.append("")
    out.append(f"verdict: {d.verdict.value} (exit {d.exit_code})")
    return "\n".join(out)


def plain(x: Any) -> Any:
    """Dataclasses, enums and tuples as JSON-ready values (infinity as null)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, tuple | list):
        return [plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None  # JSON has no infinity; null = "beyond the largest bucket"
    return x


def to_json(d: Diagnosis) -> dict[str, Any]:
    s = d.symptom
    return {
        "verdict": d.verdict.value,
        "exit_code": d.exit_code,
        "window_s": d.window_s,
        "symptom": {
            **plain(s),
            "tail": s.tail,
            "within_sla": s.within_sla,
            "missed": s.missed,
            "refused_share": s.refused_share,
        },
        "causes": [{**plain(f), "is_cause": True} for f in d.causes],
        "risks": [{**plain(f), "is_cause": False} for f in d.risks],
        "notes": [{**plain(f), "is_cause": False} for f in d.notes],
        "not_evaluated": list(d.not_evaluated),
        "collection_notes": list(d.collection_notes),
    }


def render_json(d: Diagnosis) -> str:
    return json.dumps(to_json(d), indent=2)

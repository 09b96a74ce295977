"""Side-by-side tails, the confusion matrix and the acceptance verdict (pure functions)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tailguard.tools.doctor.finding import Cause
from tailguard.tools.lab.runner import SideResult
from tailguard.tools.lab.scenarios import Scenario

ACCEPT_SHARE = 0.95  # the bar: the injected cause named in >= 95% of broken runs
COLUMNS = (*(c for c in Cause if c is not Cause.NONE), Cause.NONE)


def _ms(s: float) -> str:
    return f"{s * 1000:.0f}ms" if s < 10 else f"{s:.1f}s"


def side_by_side(results: list[SideResult]) -> str:
    """One row per run: the tail the client saw and the doctor's verdict."""
    head = (
        f"{'scenario':<14}{'side':<8}{'run':>3}  {'requests':>8} {'p50':>7} {'p99':>7} "
        f"{'max':>7} {'in SLA':>7} {'refused':>7} {'newcx/rq':>8}  doctor"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        prefix = f"{r.scenario:<14}{r.side:<8}{r.run:>3}  "
        if r.error is not None:
            lines.append(prefix + r.error)
            continue
        t = r.tails
        verdict = "none" if r.verdict is None else r.verdict.value
        if r.verdict not in (None, Cause.NONE):
            verdict += f" ({r.confidence:.2f})"
        if t is None:
            lines.append(prefix + f"{'-':>8}  doctor: {verdict}")
            continue
        lines.append(
            prefix + f"{t.requests:>8} {_ms(t.p50_s):>7} {_ms(t.p99_s):>7} {_ms(t.max_s):>7} "
            f"{t.within_sla:>7.1%} {t.refused:>7} {t.new_cx_per_request:>8.3f}  {verdict}"
        )
    return "\n".join(lines)


def confusion_matrix(results: list[SideResult]) -> str:
    """Rows: scenario/side with the cause it should get; columns: what the doctor named."""
    rows: dict[tuple[str, str, Cause], Counter[str]] = {}
    for r in results:
        key = (r.scenario, r.side, r.truth if r.truth is not None else r.expected)
        cell = "not run" if r.verdict is None else r.verdict.value
        rows.setdefault(key, Counter())[cell] += 1
    cols = [c.value for c in COLUMNS] + ["not run"]
    width = max([len(f"{s}/{side} ({e.value})") for s, side, e in rows] + [20])
    corner = "expected \\ named"
    out = [f"{corner:<{width}} " + " ".join(f"{c:>13}" for c in cols)]
    for (s, side, e), counts in rows.items():
        label = f"{s}/{side} ({e.value})"
        out.append(f"{label:<{width}} " + " ".join(f"{counts.get(c, 0):>13}" for c in cols))
    return "\n".join(out)


@dataclass(frozen=True)
class Acceptance:
    passed: bool
    ran: int  # sides that ran at least once
    failures: tuple[str, ...]
    skipped: tuple[str, ...]


def acceptance(results: list[SideResult], scenarios: list[Scenario]) -> Acceptance:
    """The issue's bar: broken sides name the injected cause in >= 95% of runs, fixed and healthy
    sides name none, and every fixed/healthy side's p99 is inside the SLA."""
    failures: list[str] = []
    skipped: list[str] = []
    ran = 0
    by_scn = {s.name: s for s in scenarios}
    for scn_name, side_name in dict.fromkeys((r.scenario, r.side) for r in results):
        runs = [r for r in results if (r.scenario, r.side) == (scn_name, side_name)]
        done = [r for r in runs if r.verdict is not None]
        if not done:
            if all(r.skipped for r in runs):
                skipped.append(f"{scn_name}/{side_name}: {runs[0].error}")
            else:  # a piece missing or broken: the acceptance run is incomplete
                failures.append(f"{scn_name}/{side_name}: could not run: {runs[0].error}")
            continue
        ran += 1
        expected = runs[0].expected
        right = sum(r.correct for r in done)
        bar = ACCEPT_SHARE if expected is not Cause.NONE else 1.0
        if right < bar * len(done):
            named = Counter(r.verdict.value for r in done if r.verdict is not None)
            void = sum(r.truth is None for r in done)
            failures.append(
                f"{scn_name}/{side_name}: expected {expected.value} in "
                f"{right}/{len(done)} runs (named: {dict(named)}"
                + (f"; {void} void: nothing injected, yet the SLA was missed)" if void else ")")
            )
        if expected is Cause.NONE or side_name == "fixed":
            scn = by_scn.get(scn_name)
            side = next((x for x in scn.sides if x.name == side_name), None) if scn else None
            allowed = side.max_refused if side else 0.01
            refusing = [
                r
                for r in done
                if r.tails is not None
                and r.tails.requests
                and r.tails.refused / r.tails.requests > allowed
            ]
            if refusing:
                worst_share = max(
                    r.tails.refused / r.tails.requests for r in refusing if r.tails is not None
                )
                failures.append(
                    f"{scn_name}/{side_name}: refused over {allowed:.0%} of requests "
                    f"in {len(refusing)}/{len(done)} runs (worst {worst_share:.0%})"
                )
            sla = scn.sla_s if scn else 0.15
            over = [r for r in done if r.tails is not None and r.tails.p99_s > sla]
            if over:
                worst = max(r.tails.p99_s for r in over if r.tails is not None)
                failures.append(
                    f"{scn_name}/{side_name}: p99 over the SLA in {len(over)}/"
                    f"{len(done)} runs (worst {_ms(worst)} > {_ms(sla)})"
                )
        if len(done) < len(runs):
            failures.append(f"{scn_name}/{side_name}: {len(runs) - len(done)} run(s) failed to run")
    return Acceptance(not failures and ran > 0, ran, tuple(failures), tuple(skipped))

"""The rules about what happens around the server's work: other processes taking the host's
cores (noisy neighbour) and garbage-collector pauses. diagnosis.py runs them with the others.
"""

from __future__ import annotations

from tailguard.tools.doctor import thresholds as T
from tailguard.tools.doctor.finding import Cause, Evidence, Finding, Strongest, combine, ev, summary
from tailguard.tools.doctor.observation import Observation, Symptom
from tailguard.tools.doctor.rules import lag_slow_share


def noisy_neighbour(obs: Observation, sym: Symptom) -> Finding:
    """Processes that are not the servers hold the cores the servers' threads wait for.

    Evidence from /proc (servers on this host): the other processes' CPU share, named; how long
    the servers' threads waited for a core (schedstat); the host's CPU; the loop's stalls.
    """
    cores = max(1, obs.host_cores)
    others = sum(n.cpu_cores for n in obs.neighbours) / cores
    window = max(obs.window_s, 1e-9)
    waits = [sw.watch.proc.runq_wait_s for sw in obs.servers
             if sw.watch is not None and sw.watch.proc is not None]  # fmt: skip
    waited = sum(w for w in waits if w >= 0) / window if any(w >= 0 for w in waits) else -1.0
    host = -1.0 if obs.host_cpu_busy is None else obs.host_cpu_busy
    lag = max((lag_slow_share(sw, sym.sla_s) for sw in obs.servers), default=0.0)
    evaluated = obs.host_cpu_busy is not None or bool(obs.neighbours)
    evidence: list[Evidence] = []
    if evaluated:
        evidence = [
            ev("other processes' CPU (cores used / host cores)", others, T.NEIGHBOUR_CPU_SHARE,
               others > T.NEIGHBOUR_CPU_SHARE, 0.45, where="this host"),
            ev("servers' threads waiting for a core (s per s, schedstat)", waited,
               T.RUNQ_WAIT_SHARE, waited > T.RUNQ_WAIT_SHARE, 0.35, where="this host"),
            ev("host CPU busy, all processes (/proc/stat)", host, T.CPU_SATURATION,
               host > T.CPU_SATURATION, 0.25, where="this host"),
            ev("event-loop lag share over SLA/3", lag, T.LOOP_LAG_SLOW_SHARE,
               lag > T.LOOP_LAG_SLOW_SHARE, 0.2),
        ]  # fmt: skip
    conf = combine(evidence)
    if evidence and not evidence[0].fired:  # without others' CPU it is not a neighbour
        conf = round(conf * 0.3, 3)
    named = ", ".join(
        f"pid {n.pid} `{n.name[:80]}` {n.cpu_cores / cores:.0%}" for n in obs.neighbours[:3]
    )
    text = summary(evidence, "other processes leave the cores free")
    if not evaluated:
        text = "not evaluated: the servers are not on this host (or --no-proc)"
    return Finding(
        cause=Cause.NOISY_NEIGHBOUR,
        title="noisy neighbour (other processes take the servers' cores)",
        confidence=conf,
        summary=f"{text}; busiest: {named}" if named else text,
        evidence=tuple(evidence),
        where="this host",
        fix=(
            "move the named processes off the serving host (a load generator belongs on its "
            "own machine), or give the server its own cores (taskset / cpusets, "
            "`docker --cpuset-cpus`) and the neighbours the rest",
            "if they must share: lower the neighbours' priority (nice 19, a CPU quota)",
        ),
    )


def gc_pauses(obs: Observation, sym: Symptom) -> Finding:
    """Garbage-collector pauses stop every request of a process (tailguard_gc_pause_seconds)."""
    best = Strongest()
    for sw in obs.servers:
        if not sw.has("tailguard_gc_pause_seconds_total"):
            continue
        w = sw.name
        window = max(obs.window_s, 1e-9)
        procs = {dict(lab).get("process", "") for lab in sw.after.series(
            "tailguard_gc_pause_seconds_total")}  # fmt: skip
        shares = {p: sw.delta("tailguard_gc_pause_seconds_total", process=p) / window
                  for p in procs}  # fmt: skip
        worst = max(shares, key=lambda p: shares[p])
        share = shares[worst]
        lag = lag_slow_share(sw, sym.sla_s)
        ev_ = [
            ev(f"GC pause share of wall time (process {worst or '?'})", share, T.GC_MISS_SHARE,
               share > T.GC_MISS_SHARE, 0.45, where=w),
            ev("GC pause share over the standing bar", share, T.GC_SHARE, share > T.GC_SHARE,
               0.25, where=w, risk=True),
            ev("event-loop lag share over SLA/3", lag, T.LOOP_LAG_SLOW_SHARE,
               share > T.GC_MISS_SHARE and lag > T.LOOP_LAG_SLOW_SHARE, 0.25, where=w),
        ]  # fmt: skip
        best.offer(ev_, w)
    return best.finding(
        Cause.GC,
        "garbage-collector pauses",
        healthy="GC pauses are a small share of the window",
        missing="no GC pause figures exported",
        fix=(
            "find what allocates: long-lived object graphs (caches of dicts, per-request "
            "objects kept alive) make every full collection walk them",
            "gc.freeze() after start-up so the warm heap is never scanned again; raise "
            "gc.set_threshold() for generation 0 in the serving process",
        ),
    )


__all__ = ["gc_pauses", "noisy_neighbour"]

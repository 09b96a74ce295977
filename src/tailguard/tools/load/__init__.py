"""tailguard.tools.load: open-loop load tester and SLA gate, usable as a library.

    from tailguard.tools.load import LoadConfig, Profile, parse_sla, run_load
    result = await run_load(LoadConfig("http://127.0.0.1:8000", Profile("constant", rate=200,
                                       duration_s=30), sla=(parse_sla("p99<=150ms"),)))
    result.exit_code(), result.summary.latency.p99, result.records
    # an LLM benchmark: random lengths, streamed, token-level SLO terms, a sweep to the knee
    cfg = LoadConfig(url, Profile("sweep", duration_s=10), endpoint="completions", stream=True,
                     source=SourceSpec(input_len=(128, 128), output_len=(32, 32)),
                     sla=(parse_sla("ttft<=150ms"),))
    sweep = await run_sweep(cfg); sweep.knee, sweep.points

Exports resolve lazily so `python -m tailguard.tools.load.testserver` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "LoadConfig",
    "LoadResult",
    "Profile",
    "SourceSpec",
    "TrustLimits",
    "parse_sla",
    "run_load",
    "run_sweep",
]

_WHERE = {
    "LoadConfig": "config",
    "Profile": "config",
    "TrustLimits": "config",
    "SourceSpec": "config",
    "parse_sla": "config",
    "LoadResult": "analysis",
    "run_load": "runner",
    "run_sweep": "sweep",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'tailguard.tools.load' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tailguard.tools.load.{_WHERE[name]}"), name)

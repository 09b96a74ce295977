"""tailguard.tools.load: open-loop load tester and SLA gate, usable as a library.

    from tailguard.tools.load import LoadConfig, Profile, parse_sla, run_load
    result = await run_load(LoadConfig("http://127.0.0.1:8000", Profile("constant", rate=200,
                                       duration_s=30), sla=(parse_sla("p99<=150ms"),)))
    result.exit_code(), result.summary.latency.p99, result.records

Exports resolve lazily so `python -m tailguard.tools.load.testserver` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LoadConfig", "LoadResult", "Profile", "TrustLimits", "parse_sla", "run_load"]

_WHERE = {
    "LoadConfig": "config",
    "Profile": "config",
    "TrustLimits": "config",
    "parse_sla": "config",
    "LoadResult": "analysis",
    "run_load": "runner",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'tailguard.tools.load' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tailguard.tools.load.{_WHERE[name]}"), name)

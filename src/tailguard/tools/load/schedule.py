"""Intended send times for open-loop profiles, fixed before the run starts.

Because these times never depend on responses, a server stall cannot slow the sender: every
request scheduled during the stall is still "due" at its own time, and its latency is measured
from that time (no coordinated omission).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from tailguard.tools.load.config import Profile

__all__ = ["expected_count", "intended_times"]


def intended_times(profile: Profile) -> Iterator[float]:
    """Seconds after run start at which each request should be sent, in order."""
    k = profile.kind
    if k == "constant":
        assert profile.rate is not None and profile.duration_s is not None
        yield from _constant(profile.rate, 0.0, profile.duration_s)
    elif k == "poisson":
        assert profile.rate is not None and profile.duration_s is not None
        rng = random.Random(profile.seed)
        t = rng.expovariate(profile.rate)
        while t < profile.duration_s:
            yield t
            t += rng.expovariate(profile.rate)
    elif k == "burst":
        assert profile.count is not None
        for _ in range(profile.count):
            yield 0.0
    elif k == "ramp" and profile.to_rate is not None:
        assert profile.hold_s is not None
        for step, rate in enumerate(profile.ramp_levels()):
            start = step * profile.hold_s
            yield from _constant(rate, start, profile.hold_s)
    else:
        raise ValueError(f"profile {profile.describe()} is not open-loop; it has no schedule")


def _constant(rate: float, start: float, duration: float) -> Iterator[float]:
    # i / rate rather than accumulating 1/rate: no drift over millions of requests.
    n = round(rate * duration)
    for i in range(n):
        yield start + i / rate


def expected_count(profile: Profile) -> int | None:
    """Requests the profile will send (exact except poisson's expectation); None if unbounded."""
    k = profile.kind
    if k in ("constant", "poisson"):
        assert profile.rate is not None and profile.duration_s is not None
        return round(profile.rate * profile.duration_s)
    if k == "burst":
        return profile.count
    if k == "closed":
        return profile.requests
    if k == "ramp" and profile.to_rate is not None:
        assert profile.hold_s is not None
        return sum(round(r * profile.hold_s) for r in profile.ramp_levels())
    return None

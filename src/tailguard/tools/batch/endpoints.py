"""Several endpoints: least-outstanding-requests balancing, Retry-After pauses, ejection.

Each endpoint has its own adaptive limit (servers differ) and its own state:

    healthy --(connection failures/timeouts are half of the last 20 outcomes, and at least
               eject_after of them)--> ejected
    ejected --(ejection time passes)--> probing (one request at a time)
    probing --(success)--> healthy (limit restarts from the initial value)
    probing --(failure)--> ejected again, for twice as long (up to eject_max_s)

Why a share and not "N consecutive failures": failures come back fast (a refused or reset
connection) while successes take a service time, so in completion order a server dropping one
request in five produces runs of failures; a dead server produces nothing else.

An overloaded answer (503/429/504) is not a failure of the endpoint: it is alive and asking for
less. It cuts the limit, and until its Retry-After passes the endpoint gets no more in flight
than it had when it said no (a server refusing everything drains to a full pause).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from tailguard.tools.batch.limiter import AdaptiveLimit, LimiterConfig

__all__ = ["Endpoint", "EndpointPool", "EndpointStats"]


@dataclass
class EndpointStats:
    sent: int = 0
    ok: int = 0
    overloaded: int = 0  # 503/429/504 answers
    failed: int = 0  # connection errors and timeouts
    ejections: int = 0


@dataclass
class Endpoint:
    url: str  # base URL without trailing slash
    limiter: AdaptiveLimit
    paused_until: float = 0.0  # monotonic; until then, Retry-After holds the endpoint ...
    pause_cap: int = 0  # ... to fewer in flight than when it said no (0: a full pause)
    ejected_until: float = 0.0  # monotonic
    probing: bool = False  # back from ejection: one request at a time until one succeeds
    recent: deque[bool] = field(default_factory=lambda: deque(maxlen=20))  # True: success
    eject_streak: int = 0  # ejections without a success in between; doubles the next one
    generation: int = 0  # bumped at each ejection: failures of older sends do not count again
    stats: EndpointStats = field(default_factory=EndpointStats)

    def available(self, now: float) -> bool:
        if now < self.ejected_until:
            return False
        if now < self.paused_until and self.limiter.in_flight >= self.pause_cap:
            return False
        if self.probing:
            return self.limiter.in_flight == 0
        return self.limiter.has_room()

    def state(self, now: float) -> str:
        if now < self.ejected_until:
            return "ejected"
        if now < self.paused_until:
            return "paused"
        return "probing" if self.probing else "healthy"


class EndpointPool:
    def __init__(
        self,
        urls: tuple[str, ...],
        limiter_cfg: LimiterConfig,
        *,
        max_in_flight: int,
        eject_after: int,
        eject_base_s: float,
        eject_max_s: float,
    ) -> None:
        self.endpoints = [Endpoint(u.rstrip("/"), AdaptiveLimit(limiter_cfg)) for u in urls]
        self.max_in_flight = max_in_flight  # all endpoints together
        self.eject_after = eject_after
        self.eject_base_s = eject_base_s
        self.eject_max_s = eject_max_s

    @property
    def in_flight(self) -> int:
        return sum(e.limiter.in_flight for e in self.endpoints)

    def total_limit(self, now: float) -> int:
        """Sum of the limits of endpoints that can take work now (what the display shows)."""
        live = [e for e in self.endpoints if now >= e.ejected_until]
        return min(self.max_in_flight, sum(1 if e.probing else e.limiter.current for e in live))

    def pick(self, now: float) -> Endpoint | None:
        """The available endpoint with the fewest outstanding requests relative to its limit
        (least-outstanding-requests, weighted so a bigger server gets more); None if none."""
        if self.in_flight >= self.max_in_flight:
            return None
        best: Endpoint | None = None
        best_key = (math.inf, math.inf)
        for e in self.endpoints:
            if not e.available(now):
                continue
            key = (e.limiter.in_flight / e.limiter.current, e.limiter.in_flight)
            if key < best_key:
                best, best_key = e, key
        return best

    def next_change(self, now: float) -> float | None:
        """Earliest future moment a pause or ejection ends (when to look again)."""
        times = [t for e in self.endpoints for t in (e.paused_until, e.ejected_until) if t > now]
        return min(times) if times else None

    def send(self, e: Endpoint) -> int:
        """Count a send; returns the endpoint's generation, to hand back to `on_failure`."""
        e.limiter.on_send()
        e.stats.sent += 1
        return e.generation

    def on_success(self, e: Endpoint, latency_s: float, now: float) -> None:
        e.limiter.on_success(latency_s, now)
        e.stats.ok += 1
        e.recent.append(True)
        if e.probing:
            e.probing = False
            e.eject_streak = 0
            e.limiter.reset()

    def on_overload(self, e: Endpoint, retry_after_s: float | None, now: float) -> None:
        e.limiter.on_overload(now)
        e.stats.overloaded += 1  # it answered: alive, not a failure
        if retry_after_s is not None:
            # Until Retry-After passes, never go back up to the load that was refused: what
            # is still in flight may stay, nothing is added. A server refusing everything
            # drains that to zero (a full pause); one refusing only past its queue limit keeps
            # being fed as completions free room, so it never idles during the pause.
            cap = e.limiter.in_flight
            e.pause_cap = min(e.pause_cap, cap) if now < e.paused_until else cap
            e.paused_until = max(e.paused_until, now + retry_after_s)

    def on_failure(self, e: Endpoint, now: float, generation: int) -> bool:
        """A connection error or timeout of a request sent in `generation`. Returns True if
        this ejected the endpoint."""
        e.limiter.on_overload(now)
        e.stats.failed += 1
        if generation != e.generation:
            # Sent before the last ejection: already judged. (Counting it would eject the
            # endpoint again for every request that was in flight when it went down.)
            return False
        e.recent.append(False)
        failures = e.recent.count(False)
        # Judge a share only over enough outcomes: early on, a few fast failures are no trend.
        judged = max(len(e.recent), 2 * self.eject_after)
        if not e.probing and failures * 2 < judged:
            return False
        e.ejected_until = now + min(self.eject_max_s, self.eject_base_s * 2**e.eject_streak)
        e.eject_streak += 1
        e.stats.ejections += 1
        e.recent.clear()
        e.generation += 1
        e.probing = True  # when the ejection ends, try one request before trusting it again
        return True

    def on_neutral(self, e: Endpoint) -> None:
        """A 4xx other than 429: says nothing about the endpoint's load or health."""
        e.limiter.on_neutral()

"""Pace: an adaptive in-flight limit, a token bucket, and retry backoff.

The in-flight limit follows the latency gradient toward a target inside the SLA:

- Completed requests are grouped in windows of about one round trip (half the limit's worth
  of completions, or one second). At the end of a window its p90 latency is compared with the
  target.
- The target is where the p90 must sit for the p99 to land at 0.9x the SLA, given the p99/p90
  spread of the last 1,000 latencies: a tight server (a FIFO queue on a quiet machine) may run
  close to the SLA, a noisy one (CPU contention, pauses) is kept further inside it. Bounded to
  [0.3, 0.75] x SLA; half the SLA until 250 latencies are known; raised toward 1.5x the fastest
  latency seen for a server slower than that even unloaded (never above 0.9x the SLA).
- Below target the limit grows by the ratio target/p90 (at most x1.5 per window, the
  "slow start"), plus one; above target it shrinks by that ratio (at most halving). Against a
  server that queues, latency is proportional to the limit past saturation, so this lands on
  the limit whose latency is the target in one or two windows instead of creeping there.
  Against a batching server, whose throughput grows with concurrency while latency grows
  slowly, it keeps adding concurrency (throughput) as long as the SLA allows.
- It does not grow while the window never used half the limit (the client was the bottleneck:
  no evidence the server can take more).
- A window with more than 1% of its requests over the SLA is an overload signal whatever its
  p90: the tail, not the middle, is what the SLA is about.
- Overload signals (503, 429, 504, timeouts, dropped connections) cut it by `backoff_ratio`,
  at most once per typical latency: the requests that were in flight when the server first
  said no will all say no, and that is one signal, not fifty. The load that was refused is
  remembered as a ceiling: below 90% of it growth is multiplicative, above it one step per
  window (so a server whose queue limit is below the latency target is not overrun again and
  again; the ceiling rises as the limit passes it without a refusal).
- Refusals have a budget, like misses: while more than `miss_budget` of the recent 1,000
  answers were refusals, the limit does not grow at all. A deadline-aware server (tailguard's
  admission) refuses exactly the requests that would be late, so the load where it starts
  refusing is the edge of what it can finish in time: hovering just under it keeps its
  throughput, and probing past it again and again only turns requests into retries (measured:
  4% of a 10,000-request job retried before this rule).

Against a server whose throughput saturates, the extra queue up to the target costs nothing
in throughput (every slot stays busy) and only latency that the SLA allows.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from dataclasses import dataclass

from tailguard.errors import ConfigError

__all__ = ["AdaptiveLimit", "LimiterConfig", "TokenBucket", "backoff_delay"]

_SPREAD_SAMPLES = 1000  # latencies kept to estimate the p99/p90 spread
# Growth per window, at most. A window closes after half the limit's completions, before the
# last increase shows in latency; doubling there overshoots the target by up to 2x.
_MAX_GROWTH = 1.5


@dataclass(frozen=True)
class LimiterConfig:
    sla_s: float  # the latency bound per request
    initial: int = 8  # starting limit
    max_limit: int = 512
    target_fraction: float = (
        0.5  # aim the window p90 here (share of the SLA) until the spread is known
    )
    # then aim so the p99 lands at this share of the SLA: 0.8 kept 99.99% of a 10,000-request
    # job within the SLA where 99% is asked, and ran 1.21x the oracle's makespan (whose p99 is
    # allowed up to the SLA itself); 0.9 keeps a margin for noise and uses more of the SLA
    tail_fraction: float = 0.9
    min_fraction: float = 0.3  # bounds of the p90 target, as shares of the SLA
    max_fraction: float = 0.75
    backoff_ratio: float = 0.8  # multiplicative cut on an overload signal
    smoothing: float = 0.5  # share of each window's new estimate taken at once
    miss_budget: float = 0.01  # share of a window over the SLA that counts as overload

    def __post_init__(self) -> None:
        if self.sla_s <= 0:
            raise ConfigError(f"sla must be > 0 s, got {self.sla_s}")
        if not 1 <= self.initial <= self.max_limit:
            raise ConfigError(
                f"initial limit ({self.initial}) must be within [1, max ({self.max_limit})]"
            )
        fractions = (self.min_fraction, self.target_fraction, self.max_fraction)
        if not 0 < self.min_fraction <= self.target_fraction <= self.max_fraction < 1:
            raise ConfigError(
                f"target shares of the SLA must satisfy 0 < min <= start <= max < 1; got "
                f"{fractions}"
            )
        if not 0 < self.tail_fraction <= 1:
            raise ConfigError(f"tail_fraction must be in (0, 1], got {self.tail_fraction}")
        if not 0 < self.backoff_ratio < 1 or not 0 < self.smoothing <= 1:
            raise ConfigError("backoff_ratio must be in (0, 1) and smoothing in (0, 1]")


class AdaptiveLimit:
    """How many requests one endpoint may have in flight. Stepped by hand in tests: every
    method takes `now` (monotonic seconds) instead of reading a clock."""

    def __init__(self, cfg: LimiterConfig) -> None:
        self.cfg = cfg
        self.limit = float(cfg.initial)
        self.in_flight = 0
        self.floor_s = math.inf  # fastest latency seen: the server's unloaded latency, about
        self.last_p90_s: float | None = None
        self._window: list[float] = []
        self._window_start: float | None = None
        self._window_peak = 0  # most in flight during the window
        self._last_cut = -math.inf
        self.ceiling = math.inf  # in flight when the server last said no; growth slows near it
        self._typical_s = 0.1  # last window's median; spaces overload cuts
        self._recent: deque[float] = deque(maxlen=_SPREAD_SAMPLES)  # for the p99/p90 spread
        self._refused: deque[bool] = deque(maxlen=_SPREAD_SAMPLES)  # recent answers: refused?
        self._p90_target = cfg.sla_s * cfg.target_fraction

    @property
    def current(self) -> int:
        return max(1, int(self.limit))

    def has_room(self) -> bool:
        return self.in_flight < self.current

    @property
    def target_s(self) -> float:
        sla = self.cfg.sla_s
        target = self._p90_target
        if math.isfinite(self.floor_s):
            # A server slower than the target even unloaded: allow it 1.5x its own floor.
            target = max(target, min(1.5 * self.floor_s, 0.9 * sla))
        return target

    @property
    def refusal_share(self) -> float:
        """Share of the recent answers that were refusals (overload signals)."""
        return sum(self._refused) / len(self._refused) if self._refused else 0.0

    def on_send(self) -> None:
        self.in_flight += 1
        self._window_peak = max(self._window_peak, self.in_flight)

    def on_success(self, latency_s: float, now: float) -> None:
        self.in_flight -= 1
        self.floor_s = min(self.floor_s, latency_s)
        if self._window_start is None:
            self._window_start = now
        self._window.append(latency_s)
        self._recent.append(latency_s)
        self._refused.append(False)
        if len(self._window) >= max(4, self.current // 2) or now - self._window_start >= 1.0:
            self._close_window(now)

    def on_overload(self, now: float) -> None:
        """503/429/504, a timeout or a dropped connection."""
        refused_at = self.in_flight  # this one included: the load the server refused
        self.in_flight -= 1
        self._refused.append(True)
        if now - self._last_cut < self._typical_s:
            return
        self._last_cut = now
        self.ceiling = float(refused_at)
        self.limit = max(1.0, self.limit * self.cfg.backoff_ratio)
        self._reset_window()

    def on_neutral(self) -> None:
        """A response that says nothing about load (e.g. 400): release the slot only."""
        self.in_flight -= 1

    def reset(self) -> None:
        """Back to the start (an endpoint coming back from ejection)."""
        self.limit = float(self.cfg.initial)
        self._reset_window()

    def _reset_window(self) -> None:
        self._window = []
        self._window_start = None
        self._window_peak = self.in_flight

    def _update_target(self) -> None:
        """Aim the p90 where the recent p99/p90 spread puts the p99 at `tail_fraction` of the
        SLA: a tight server (FIFO queue, quiet machine) may run close to the SLA, a noisy one
        (CPU contention, pauses) is kept further inside it."""
        if len(self._recent) < _SPREAD_SAMPLES // 4:
            return
        lat = sorted(self._recent)
        p90 = lat[int(0.90 * (len(lat) - 1))]
        p99 = lat[int(0.99 * (len(lat) - 1))]
        spread = max(1.0, p99 / max(p90, 1e-6))
        c, sla = self.cfg, self.cfg.sla_s
        self._p90_target = min(
            c.max_fraction * sla, max(c.min_fraction * sla, c.tail_fraction * sla / spread)
        )

    def _close_window(self, now: float) -> None:
        self._update_target()
        lat = sorted(self._window)
        p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
        self._typical_s = lat[len(lat) // 2]
        self.last_p90_s = p90
        ratio = self.target_s / max(p90, 1e-6)
        misses = len(lat) - bisect.bisect_right(lat, self.cfg.sla_s)
        if misses > self.cfg.miss_budget * len(lat):
            # The SLA itself is being missed (a long tail under a fine p90: CPU starvation,
            # pauses): treat it as a refusal of this load, whatever the p90 says.
            self.ceiling = self.limit
            new = self.limit * min(ratio, self.cfg.backoff_ratio)
        elif ratio >= 1.0:
            if self.refusal_share > self.cfg.miss_budget:
                new = self.limit  # refusals over budget: hold just under the refused load
            elif self._window_peak < self.current / 2:
                ratio = 1.0  # client-limited window: no evidence the server wants more
                new = self.limit
            elif self.limit >= 0.9 * self.ceiling:
                # Near the load the server last refused: probe one step per window (TCP's
                # congestion avoidance) instead of jumping back over it.
                new = self.limit + 1 / self.cfg.smoothing
                self.ceiling = max(self.ceiling, self.limit)
            else:
                new = min(self.limit * min(ratio, _MAX_GROWTH) + 1, 0.9 * self.ceiling + 1)
        else:
            new = self.limit * max(ratio, 0.5)
        s = self.cfg.smoothing
        self.limit = min(float(self.cfg.max_limit), max(1.0, (1 - s) * self.limit + s * new))
        self._reset_window()


class TokenBucket:
    """Caps request starts per second. `reserve` takes a token now and says how long to wait
    before using it, so waiters are served in order without a polling loop."""

    def __init__(self, rate: float, burst: float | None = None, now: float = 0.0) -> None:
        if rate <= 0:
            raise ConfigError(f"token bucket rate must be > 0, got {rate}")
        self.rate = rate
        # 50 ms of burst: smooth enough to not bunch requests, big enough to not add latency.
        self.burst = burst if burst is not None else max(1.0, rate * 0.05)
        self._tokens = self.burst
        self._at = now

    def reserve(self, now: float) -> float:
        """Take one token; returns seconds to wait before sending (0 if one was there)."""
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


def backoff_delay(
    attempt: int,
    *,
    base_s: float,
    cap_s: float,
    retry_after_s: float | None,
    rng: random.Random,
) -> float:
    """Seconds before retry number `attempt` (1 = the first retry).

    Exponential backoff with full jitter (uniform over [0, min(cap, base * 2^(attempt-1))]):
    clients that failed together do not come back together. With a Retry-After the server
    named the earliest useful moment: wait that long, then spread over at most as long again
    so a crowd told the same number does not return in one burst."""
    bound = min(cap_s, base_s * 2 ** (attempt - 1))
    if retry_after_s is None:
        return rng.uniform(0.0, bound)
    return retry_after_s + rng.uniform(0.0, min(bound, retry_after_s))

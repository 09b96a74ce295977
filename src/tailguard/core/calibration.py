"""What admission's predictions rest on, and how wrong they turn out to be, both measured.

`StepCostModel` fits the engine's step time (`a + b * tokens`) from the steps it reports.
`Calibration` keeps the measured error of the predictions made from it: every answered request
gives one sample of actual vs predicted time, and admission plans for a high quantile of those
samples (the bound tightens when predictions are good and widens when the machine is noisy)
instead of fixed safety multipliers. Pure Python, no clock of its own: tests step it by hand.

Why two error terms, a ratio and an excess: a prediction is wrong in two ways. The step-cost fit
can be off by a factor (another process takes the engine's CPU: every step is slower), and there
are fixed delays the fluid model does not see (IPC, the HTTP process's event loop, waiting for the
step already running). The factor dominates large predictions and the fixed delay small ones; a
ratio measured on 1 ms predictions would be a large factor that turns 100 ms predictions away
for no reason, so ratios are only sampled on predictions of at least `floor_s`, and the fixed part
is sampled as an excess in seconds. The bound for a prediction `p` is
`max(p * ratio, p + excess)`, each at the target quantile.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["Calibration", "RecentMax", "StepCostModel"]


class StepCostModel:
    """step_s ~= a + b * num_tokens, fitted over the recent step times of each size class.

    A linear fit rather than a tokens/s average because a step has a fixed cost (launch, python,
    sampling) that a small batch pays in full: a tokens/s figure measured at batch 1 would
    underestimate a full batch's throughput several times over.

    Steps are grouped by size (powers of two of their token count) and each class keeps a moving
    average of its own steps; the fit goes through the class averages. A window of the last N
    steps would not do: a long run of one-token decode steps pushes every larger step out of
    it, and a fit through one size cannot tell the fixed cost from the per-token cost (charging
    it all per token made a 200-token prefill look 100x dearer than it is). A class keeps its
    figure until steps of that size run again.
    """

    def __init__(self, prior_a: float, prior_b: float, alpha: float = 0.2) -> None:
        self.a = prior_a
        self.b = prior_b
        self.alpha = alpha  # weight of a new step in its class's moving average
        self._classes: dict[int, list[float]] = {}  # size class -> [mean tokens, mean seconds]
        self._dirty = False

    def observe(self, num_tokens: int, step_s: float) -> None:
        if num_tokens <= 0 or step_s <= 0:
            return
        c = self._classes.get(num_tokens.bit_length())
        if c is None:
            self._classes[num_tokens.bit_length()] = [float(num_tokens), step_s]
        else:
            c[0] += self.alpha * (num_tokens - c[0])
            c[1] += self.alpha * (step_s - c[1])
        self._dirty = True

    def refit(self) -> None:
        """Recompute (a, b) through the class averages; cheap (at most ~12 classes)."""
        if not self._dirty:
            return
        self._dirty = False
        points = list(self._classes.values())
        if len(points) == 1:
            # One size only: keep the current split of fixed and per-token cost, at the
            # measured level.
            ((x, y),) = points
            scale = y / self.step_s(x)
            self.a, self.b = self.a * scale, self.b * scale
            return
        n = len(points)
        sx = sum(x for x, _ in points)
        sy = sum(y for _, y in points)
        sxx = sum(x * x for x, _ in points)
        sxy = sum(x * y for x, y in points)
        b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        a = (sy - b * sx) / n
        if b <= 0:  # noise: fall back to a pure per-token cost through the mean
            b, a = sy / sx, 0.0
        self.a, self.b = max(a, 0.0), b

    def step_s(self, num_tokens: float) -> float:
        return self.a + self.b * num_tokens


def _quantile(samples: deque[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Calibration:
    """The measured error of one kind of prediction (completion, or first token).

    `observe(predicted, actual)` after each answer; `refresh()` recomputes the quantiles (the
    server calls it every few ms, not per request); `bound(p)` is the time to plan for.
    Until `min_samples` answers are in, the priors stand in for the measured quantiles.

    `live_ratio` / `live_excess` are set by the admission controller from requests still in
    flight that are already later than their bound (censored samples: their actual time is at
    least this much). They widen the bound the moment the engine slows down, long before the
    late answers themselves arrive; 0 when nothing is overdue.
    """

    def __init__(
        self,
        *,
        quantile: float,
        window: int,
        min_samples: int,
        prior_ratio: float,
        prior_excess_s: float,
        floor_s: float,
    ) -> None:
        self.quantile = quantile
        self.min_samples = min_samples
        self.prior_ratio = prior_ratio
        self.prior_excess_s = prior_excess_s
        self.floor_s = floor_s
        self._ratios: deque[float] = deque(maxlen=window)
        self._excess: deque[float] = deque(maxlen=window)
        self._dirty = False
        self.ratio = prior_ratio  # actual / predicted at the target quantile
        self.excess_s = prior_excess_s  # actual - predicted at the target quantile (s)
        self.live_ratio = 0.0
        self.live_excess_s = 0.0

    @property
    def samples(self) -> int:
        return len(self._excess)

    def observe(self, predicted_s: float, actual_s: float) -> None:
        self._excess.append(actual_s - predicted_s)
        if predicted_s >= self.floor_s:
            self._ratios.append(actual_s / predicted_s)
        self._dirty = True

    def refresh(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        if len(self._ratios) >= self.min_samples:
            self.ratio = _quantile(self._ratios, self.quantile)
        if len(self._excess) >= self.min_samples:
            self.excess_s = _quantile(self._excess, self.quantile)

    def bound(self, predicted_s: float) -> float:
        """The time to plan for when the model predicts `predicted_s`."""
        ratio = max(self.ratio, self.live_ratio)
        excess = max(self.excess_s, self.live_excess_s)
        return max(predicted_s * ratio, predicted_s + excess)

    def overdue(self, predicted_s: float, elapsed_s: float) -> bool:
        """True when a request still in flight has already taken longer than its bound."""
        return elapsed_s > max(predicted_s * self.ratio, predicted_s + self.excess_s)


class RecentMax:
    """The largest sample of the last one to two windows (a max that forgets in 2 windows).

    For delays that admission must plan for: a p50 or an average would admit requests that
    then wait through the slow moments the average hides.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._cur = 0.0
        self._prev = 0.0
        self._start = -math.inf

    def _roll(self, now_s: float) -> None:
        age = now_s - self._start
        if age >= self.window_s:
            self._prev = self._cur if age < 2 * self.window_s else 0.0
            self._cur = 0.0
            self._start = now_s

    def observe(self, value: float, now_s: float) -> None:
        self._roll(now_s)
        if value > self._cur:
            self._cur = value

    def value(self, now_s: float) -> float:
        self._roll(now_s)
        return max(self._cur, self._prev)

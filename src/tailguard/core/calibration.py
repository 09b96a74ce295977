"""What admission's predictions rest on, and how wrong they turn out to be, both measured.

`StepCostModel` fits the engine's step time (`a + b * tokens`) from the steps it reports.
`Calibration` keeps the measured error of the predictions made from it: every answered request
gives one sample of actual vs predicted time, and admission plans for a high quantile of those
samples (the bound tightens when predictions are good and widens when the machine is noisy)
instead of fixed safety multipliers. Pure Python, no clock of its own: tests step it by hand.

Why per size class and in seconds: see `Calibration`.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque

__all__ = ["EDGES_S", "Calibration", "RecentMax", "StepCostModel"]


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


# Upper edges (s) of the prediction-size classes the error is measured in; the last is open.
EDGES_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)


class Calibration:
    """The measured error of one kind of prediction (completion, or first token).

    `observe(predicted, actual)` after each answer; `refresh()` recomputes the quantiles (the
    server calls it every few ms, not per request); `bound(p)` is the time to plan for.

    The error is kept as an excess in seconds (actual - predicted), per class of prediction size
    (`EDGES_S`): a 10 ms prediction and a 300 ms one are wrong in different ways (the first by the
    fixed delays, the second also by the step-cost fit), and one pooled figure would make the
    small ones plan for the large ones' error or the other way round. A class's figure is the
    target quantile of its recent samples once it has `min_samples`; the figure used for a
    prediction is the largest over its class and every smaller class that has one (so the bound
    grows with the prediction, and `saturated` may ask about a one-token request for any size).
    A class above every measured one uses the largest measured figure: optimistic, which costs a
    few late answers that then measure it (within one deadline), where a pessimistic guess would
    refuse those requests forever and never learn otherwise. Until any class is measured, the
    priors stand in: `max(p * prior_ratio, p + prior_excess_s)`.

    `live_excess_s` is set by the admission controller from requests still in flight that are
    already later than their bound (censored samples: their actual excess is at least this). It
    widens the bound the moment the engine slows down, long before the late answers arrive.
    """

    def __init__(
        self,
        *,
        quantile: float,
        window: int,
        min_samples: int,
        prior_ratio: float,
        prior_excess_s: float,
    ) -> None:
        self.quantile = quantile
        self.min_samples = min_samples
        self.prior_ratio = prior_ratio
        self.prior_excess_s = prior_excess_s
        self._excess = [deque[float](maxlen=window) for _ in range(len(EDGES_S) + 1)]
        self._dirty: set[int] = set()
        self._measured: list[float | None] = [None] * (len(EDGES_S) + 1)
        self._envelope: list[float | None] = [None] * (len(EDGES_S) + 1)
        self.live_excess_s = 0.0

    @staticmethod
    def size_class(predicted_s: float) -> int:
        return bisect_left(EDGES_S, predicted_s)

    @property
    def samples(self) -> int:
        return sum(len(d) for d in self._excess)

    def observe(self, predicted_s: float, actual_s: float) -> None:
        k = self.size_class(predicted_s)
        self._excess[k].append(actual_s - predicted_s)
        self._dirty.add(k)

    def refresh(self) -> None:
        if not self._dirty:
            return
        for k in self._dirty:
            if len(self._excess[k]) >= self.min_samples:
                self._measured[k] = _quantile(self._excess[k], self.quantile)
        self._dirty.clear()
        top: float | None = None
        first = next((m for m in self._measured if m is not None), None)
        for k, m in enumerate(self._measured):
            if m is not None:
                top = m if top is None else max(top, m)
            # below the smallest measured class: that class's figure (None: nothing measured)
            self._envelope[k] = top if top is not None else first

    def excess_s(self, predicted_s: float) -> float | None:
        """The measured excess planned for at this prediction size (None: nothing measured)."""
        return self._envelope[self.size_class(predicted_s)]

    def bound(self, predicted_s: float) -> float:
        """The time to plan for when the model predicts `predicted_s`."""
        return max(self._measured_bound(predicted_s), predicted_s + self.live_excess_s)

    def overdue(self, predicted_s: float, elapsed_s: float) -> bool:
        """True when a request still in flight has already taken longer than its bound (the
        measured one: what is overdue must not depend on what was overdue before)."""
        return elapsed_s > self._measured_bound(predicted_s)

    def _measured_bound(self, p: float) -> float:
        e = self._envelope[bisect_left(EDGES_S, p)]
        if e is None:
            return max(p * self.prior_ratio, p + self.prior_excess_s)
        return p + max(e, 0.0)


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

"""What admission's predictions rest on, and how wrong they turn out to be, both measured.

`StepCostModel` fits the engine's step time (`a + b * tokens + c * rows`, at the engine's padded
sizes) from the steps it reports.
`Calibration` keeps the measured error of the predictions made from it: every answered request
gives one sample of actual vs predicted time, and admission plans for a high quantile of those
samples (the bound tightens when predictions are good and widens when the machine is noisy)
instead of fixed safety multipliers. Pure Python, no clock of its own: tests step it by hand.

Why per size class and in seconds: see `Calibration`.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left
from collections import deque

__all__ = ["EDGES_S", "Calibration", "PadTable", "RecentMax", "StepCostModel", "padded"]

_TABLE_MAX = 65_536  # largest bucket PadTable tabulates (beyond it: bisect)
_excess = operator.itemgetter(1)  # of a (t, excess) sample


class StepCostModel:
    """step_s ~= level * (a0 + b0 * tokens + c0 * rows): a shape fitted once, a level that
    follows. `tokens` and `rows` are the sizes the engine pads a step to (its token and
    sequence buckets, when given): the forward runs on the padded tokens and the output head on
    one padded row per sequence that completes its prompt or decodes.

    A linear fit rather than a tokens/s average because a step has a fixed cost (launch, python,
    sampling) that a small batch pays in full: a tokens/s figure measured at batch 1 would
    underestimate a full batch's throughput several times over. The rows term because a decode
    token costs a head row (32,000 x hidden) and a prefill token does not: fitted on tokens
    alone, a 36-sequence decode step was predicted at half its time while prefill-heavy steps
    were overpredicted (live steps: tokens alone explained the step time to p10-p90 0.67-1.40x,
    tokens and rows to 0.85-1.19x).

    The shape `(a0, b0, c0)` is fitted by least squares to the first steps the engine reports:
    its warm-up, which runs every token bucket's forward once (one row) and the head alone at
    every row bucket (0 tokens), so every size is in it. After that only the level moves (a
    moving average of actual / shape over the recent steps): when other processes take the
    engine's CPU every step slows by about the same factor, and the level follows within a few
    steps. Refitting the shape from live steps does not work: they cover only the sizes the
    traffic makes, a run of one-token decode steps cannot tell fixed cost from per-token cost,
    and steps slowed by contention at some sizes and not others tilt the line (measured: a
    52 ms fixed cost fitted for 37 ms steps).
    """

    def __init__(
        self,
        prior_a: float,
        prior_b: float,
        alpha: float = 0.1,
        *,
        token_buckets: tuple[int, ...] = (),
        row_buckets: tuple[int, ...] = (),
        rows: bool = True,
    ) -> None:
        self.a0, self.b0, self.c0 = prior_a, prior_b, 0.0
        self.rows = rows  # False: a + b * tokens only (head rows not priced)
        self.level = 1.0
        self.alpha = alpha  # weight of a new step in the level's moving average
        self.token_buckets, self.row_buckets = token_buckets, row_buckets
        self._token_pad, self._row_pad = PadTable(token_buckets), PadTable(row_buckets)
        self._first: list[tuple[int, int, float]] = []  # (tokens, rows, s) before the fit
        self._fitted = False

    @property
    def fitted(self) -> bool:
        """Whether the shape has been fitted (until then the prior's shape prices steps)."""
        return self._fitted

    @property
    def a(self) -> float:
        return self.a0 * self.level

    @property
    def b(self) -> float:
        return self.b0 * self.level

    @property
    def c(self) -> float:
        return self.c0 * self.level

    def observe(self, num_tokens: int, step_s: float, rows: int = 1) -> None:
        """One step of `num_tokens` tokens and `rows` head rows (padded or not: sizes are padded
        here), or a warm-up run of the head alone (`num_tokens` 0)."""
        if not self.rows:
            rows = 0
        if num_tokens < 0 or rows < 0 or num_tokens + rows <= 0 or step_s <= 0:
            return
        if not self._fitted:
            self._first.append((num_tokens, rows, step_s))
            return
        ratio = step_s / self._shape(num_tokens, rows)
        self.level += self.alpha * (ratio - self.level)

    def refit(self) -> None:
        """Fit the shape once enough steps of different sizes are in (cheap; call after a batch
        of observations)."""
        if self._fitted:
            return
        forwards = [(x, r, y) for x, r, y in self._first if x > 0]
        if len(forwards) < 4 or len({x for x, _, _ in forwards}) < 2:
            return  # one size cannot tell fixed from per-token cost: keep the prior's shape
        heads = [(float(r), y) for x, r, y in self._first if x == 0]
        c = max(_slope(heads), 0.0) if len({r for r, _ in heads}) >= 2 and self.rows else 0.0
        points = [(padded(x, self.token_buckets), y - c * r) for x, r, y in forwards]
        b = _slope(points)
        n = len(points)
        a = (sum(y for _, y in points) - b * sum(x for x, _ in points)) / n
        if b <= 0:  # noise: fall back to a pure per-token cost through the mean
            b, a = sum(y for _, y in points) / sum(x for x, _ in points), 0.0
        self.a0, self.b0, self.c0 = max(a, 0.0), b, c
        self._fitted = True
        self._first = []

    def step_s(self, num_tokens: float, rows: float = 1) -> float:
        """The predicted time of a step of `num_tokens` tokens and `rows` head rows."""
        return self.level * self._shape(num_tokens, rows)

    def _shape(self, num_tokens: float, rows: float) -> float:
        # padded through the tables: admission prices several steps for every request, and a
        # bisect on a float costs ~170 ns
        tokens = self._token_pad.padded(num_tokens)
        return self.a0 + self.b0 * tokens + self.c0 * self._row_pad.padded(rows)


def padded(n: float, buckets: tuple[int, ...]) -> float:
    """The bucket `n` runs as (itself past the last bucket, or when there are none)."""
    i = bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) and n > 0 else n


class PadTable:
    """`padded` for one set of (integer, ascending) buckets, by a table lookup up to
    `_TABLE_MAX`: the bucket for a count n is the bucket for ceil(n)."""

    __slots__ = ("_buckets", "_table", "_top")

    def __init__(self, buckets: tuple[int, ...]) -> None:
        self._buckets = buckets
        self._top = min(buckets[-1], _TABLE_MAX) if buckets else 0
        self._table = [int(padded(k, buckets)) for k in range(self._top + 1)]

    def padded(self, n: float) -> float:
        if 0 < n <= self._top:
            k = int(n)
            return self._table[k if k == n else k + 1]
        return padded(n, self._buckets)


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x."""
    n = len(points)
    sx = sum(x for x, _ in points)
    sy = sum(y for _, y in points)
    sxx = sum(x * x for x, _ in points)
    sxy = sum(x * y for x, y in points)
    den = n * sxx - sx * sx
    return (n * sxy - sx * sy) / den if den > 0 else 0.0


def _quantile_sorted(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# Upper edges (s) of the prediction-size classes the error is measured in; the last is open.
EDGES_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)


class Calibration:
    """The measured error of one kind of prediction (completion, or first token).

    `observe(predicted, actual, now)` after each answer; `refresh(now)` recomputes the quantiles
    (the server calls it every few ms, not per request); `bound(p)` is the time to plan for.

    The error is kept as an excess in seconds (actual - predicted), per class of prediction size
    (`EDGES_S`): a 10 ms prediction and a 300 ms one are wrong in different ways (the first by the
    fixed delays and the step boundary, the second also by the step-cost fit), and one pooled
    figure would make the small ones plan for the large ones' error or the other way round. A
    class's figure is the target quantile of its samples of the last `max_age_s` (at most
    `window` of them) once it has `min_samples`: samples age out, because what a class measured
    while the step-cost fit was still wrong says nothing once the fit is right (and its
    predictions have moved to other classes). The excess may be negative: a model that runs
    pessimistic (the step-cost fit too high) is corrected down as well as up, so admission does
    not refuse what the engine would have finished.

    A class without a figure of its own borrows the nearest measured class below it (or above
    it, below every measured one): above the measured range that is optimistic, which costs a
    few late answers that then measure it within one deadline, where a pessimistic guess would
    refuse those requests for good and never learn otherwise. The bound never falls as the
    prediction grows (a larger prediction is planned for at least what the largest smaller
    one was), so `saturated` may judge a request by a one-token version of it. Until any class
    is measured, the priors stand in: `max(p * prior_ratio, p + prior_excess_s)`.

    `ladder` adds quantiles besides the target (`bound(p, level)` indexes `self.ladder`,
    tightest first): admission plans an edge request for a looser one while its miss budget has
    room (core/admission.py). Each level keeps its own monotonic bounds.

    `live_excess_s` is set by the admission controller from requests still in flight that are
    already later than their bound (censored samples: their actual excess is at least this). It
    widens the bound the moment the engine slows down, long before the late answers arrive.

    `tail_samples` (0: off) pools a sparse class with its nearest measured neighbours until the
    target quantile of the pool has at least that many samples above it (a pool of
    `tail_samples / (1 - quantile)` samples): a class of 40 samples plans at 0.99 for its
    largest one, and after one stall of the machine that is the stall. Every request of that
    size and above was then refused, so the class got no sample to correct it until the stall
    aged out (measured, session 27: after a 150 ms SIGSTOP of the engine at 4x overload, infer
    goodput stayed at 0.76-0.89 of the target in the runs that followed, admitting only
    predictions under 10 ms).
    A stall hits whatever is in flight, so its share of misses is its share of *time*, which a
    sparse class overstates many times over; a class whose answers really run later than its
    neighbours' keeps that in the pool's tail as long as they are a `1 - quantile` share of it.
    """

    def __init__(
        self,
        *,
        quantile: float,
        window: int,
        min_samples: int,
        prior_ratio: float,
        prior_excess_s: float,
        max_age_s: float = 30.0,
        ladder: tuple[float, ...] = (),
        tail_samples: int = 0,
    ) -> None:
        self.quantile = quantile
        # samples a class (or its pool) needs for its own figure at the target quantile
        self._pool_size = math.ceil(tail_samples / (1.0 - quantile)) if tail_samples else 0
        # Every quantile kept, tightest (highest) first; `level` arguments index it.
        self.ladder = tuple(sorted({quantile, *ladder}, reverse=True))
        self.target_level = self.ladder.index(quantile)
        self.min_samples = min_samples
        self.prior_ratio = prior_ratio
        self.prior_excess_s = prior_excess_s
        self.max_age_s = max_age_s
        n, m = len(EDGES_S) + 1, len(self.ladder)
        self._samples = [deque[tuple[float, float]](maxlen=window) for _ in range(n)]  # (t, excess)
        self._dirty: set[int] = set()  # classes with new or expired samples
        # per ladder level, per class: the excess planned for, and the bound at the top of
        # every smaller class
        self._own: list[list[float | None]] = [[None] * n for _ in range(m)]
        self._floor: list[list[float]] = [[0.0] * n for _ in range(m)]
        # each class's excess sorted (None: fewer than min_samples), and its quantiles (its own,
        # or its pool's when it is sparse), one per ladder level
        self._sorted: list[list[float] | None] = [None] * n
        self._class_ladder: list[tuple[float, ...] | None] = [None] * n
        self.live_excess_s = 0.0

    @staticmethod
    def size_class(predicted_s: float) -> int:
        return bisect_left(EDGES_S, predicted_s)

    @property
    def samples(self) -> int:
        return sum(len(d) for d in self._samples)

    def observe(self, predicted_s: float, actual_s: float, now_s: float) -> None:
        """One answer: `now_s` is when the engine client read it (answers of one engine output
        batch share it).

        Misses that arrive together count once: when answers of the same batch and class are
        all later than the class plans for, they were held up by one event (a stall of the
        machine, the engine or the front end delays everything in flight at once), and only
        the worst of them is kept. Counted one by one, a single 130 ms stall put three such
        samples in a class of 188 and made its 0.99 quantile the stall for the next 30 s;
        every request of that size and above was refused, so no sample could correct it
        (measured: 10 s of a 2x-overload level with all 2,093 requests refused). Answers on
        time always count one by one, so this only discounts correlated misses.
        """
        k = self.size_class(predicted_s)
        excess = actual_s - predicted_s
        d = self._samples[k]
        own = self._class_ladder[k]
        planned = None if own is None else own[self.target_level]
        same_batch = bool(d) and d[-1][0] == now_s
        if planned is not None and same_batch and min(excess, d[-1][1]) > planned:
            d[-1] = (now_s, max(d[-1][1], excess))
            self._dirty.add(k)
            return
        d.append((now_s, excess))
        self._dirty.add(k)

    def refresh(self, now_s: float) -> None:
        old = now_s - self.max_age_s
        for k, d in enumerate(self._samples):
            while d and d[0][0] < old:
                d.popleft()
                self._dirty.add(k)
        if not self._dirty:
            return
        for k in self._dirty:  # only the classes that changed are sorted again
            d = self._samples[k]
            # every 5 ms: map, not a generator
            ordered = sorted(map(_excess, d)) if len(d) >= self.min_samples else None
            self._sorted[k] = ordered
            self._class_ladder[k] = None if ordered is None else self._quantiles(ordered)
        self._dirty.clear()
        for k, ordered in enumerate(self._sorted):  # sparse ones again: a neighbour may have moved
            if ordered is not None and len(ordered) < self._pool_size:
                self._class_ladder[k] = self._quantiles(self._pooled(k, ordered))
        for level in range(len(self.ladder)):
            self._spread(level)

    def _quantiles(self, ordered: list[float]) -> tuple[float, ...]:
        return tuple(_quantile_sorted(ordered, q) for q in self.ladder)

    def _pooled(self, k: int, own: list[float]) -> list[float]:
        """Class k's samples with its nearest measured neighbours' (below first at each
        distance) until there are `_pool_size` of them, sorted."""
        parts, count = [own], len(own)
        n = len(self._sorted)
        for dist in range(1, n):
            for j in (k - dist, k + dist):
                other = self._sorted[j] if 0 <= j < n else None
                if other is not None and count < self._pool_size:
                    parts.append(other)
                    count += len(other)
            if count >= self._pool_size:
                break
        return sorted([x for part in parts for x in part]) if len(parts) > 1 else own

    def _spread(self, level: int) -> None:
        """Give every class a figure at this ladder level: its own, else the nearest measured
        class's below (or the first measured one), and the floor that keeps bounds monotonic."""
        measured = [None if c is None else c[level] for c in self._class_ladder]
        first = next((m for m in measured if m is not None), None)
        below: float | None = None
        top = 0.0
        owns, floors = self._own[level], self._floor[level]
        for k, m in enumerate(measured):
            if m is not None:
                below = m
            own = below if below is not None else first
            owns[k] = own
            floors[k] = top
            if own is not None and k < len(EDGES_S):
                top = max(top, EDGES_S[k] + own)

    def excess_s(self, predicted_s: float) -> float | None:
        """The measured excess planned for at this prediction size (None: nothing measured)."""
        return self._own[self.target_level][self.size_class(predicted_s)]

    def bound(self, predicted_s: float, level: int | None = None) -> float:
        """The time to plan for when the model predicts `predicted_s`: at the target quantile,
        or at `self.ladder[level]`."""
        lv = self.target_level if level is None else level
        return max(self._measured_bound(predicted_s, lv), predicted_s + self.live_excess_s)

    def overdue(self, predicted_s: float, elapsed_s: float) -> bool:
        """True when a request still in flight has already taken longer than its bound (the
        measured one: what is overdue must not depend on what was overdue before)."""
        return elapsed_s > self._measured_bound(predicted_s, self.target_level)

    def _measured_bound(self, p: float, level: int) -> float:
        k = bisect_left(EDGES_S, p)
        e = self._own[level][k]
        if e is None:
            return max(p * self.prior_ratio, p + self.prior_excess_s)
        return max(p + e, self._floor[level][k], 0.0)


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

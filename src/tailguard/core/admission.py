"""Deadline-aware admission: admit a request only if it is predicted to finish inside its deadline.

Pure policy (no HTTP, no torch, no clock of its own: every call takes `now_s`), so tests step it
by hand. The HTTP server owns one `AdmissionController`; the engine client feeds it step timings.

How a prediction is made
    The server knows every request it admitted and has not answered yet (the *ledger*): each
    entry holds the tokens the engine still has to process for it (prompt tokens until the
    prefill is done, then the remaining output tokens). The engine processes at most
    `max_num_batched_tokens` tokens per step, and a step costs `a + b * tokens` seconds
    (a least-squares fit over recent engine steps, `StepCostModel`). For a new request:

        ahead   = ledger tokens queued ahead of it (interactive work only sees interactive work)
        start   = time to process `ahead + own prompt` tokens in full steps
        decode  = own output tokens x one decode step at the current batch size
        finish  = now + start (+ decode, for single-pass requests there is none)

    It is admitted when `finish <= deadline` (after a safety margin), and when the hard caps on
    queued requests and tokens allow it. Batch work may use only `batch_share` of the caps so
    interactive work always finds room.

Why the ledger and not the engine's own counters: engine stats arrive a few ms late; under a
burst of 10,000 requests thousands arrive within those few ms, and every one of them would see an
empty queue. The ledger changes at the instant of each admission.

Why an adaptive cap on top of the prediction: the prediction is only as good as the step-cost
model, which learns from steps that already ran. At the start of a burst the machine still
looks idle, and if the burst itself starves the engine of CPU (the load generator and the HTTP
process share its cores) every step gets slower than predicted. So admitted work is also capped
by what the engine has recently *proven* it finishes on time, TCP-style: each answer on time
grows the cap by its own tokens (doubling per round trip), each late one halves it, never
below half a step's worth (and a request with nothing queued ahead is never refused by the
cap). A wrong prediction then costs a few requests, not a burst's worth.

Retry-After comes from the same model: the time for the work ahead to drain far enough that this
request would fit, rounded up to whole seconds for the header (RFC 9110 delay-seconds).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from tailguard.core.request import Priority

__all__ = [
    "AdmissionConfig",
    "AdmissionController",
    "Decision",
    "RecentMax",
    "StepCostModel",
    "WorkItem",
    "retry_after_header",
]


@dataclass(frozen=True)
class AdmissionConfig:
    max_queued_requests: int = 2048
    """Hard cap on requests admitted and not yet answered."""
    max_queued_tokens: int = 262_144
    """Hard cap on tokens (prompt + remaining output) admitted and not yet processed."""
    max_num_batched_tokens: int = 1024
    """Engine per-step token budget (from EngineConfig)."""
    max_num_seqs: int = 64
    """Engine batch capacity (from EngineConfig)."""
    batch_share: float = 0.8
    """Share of the caps batch-priority work may fill; the rest is kept for interactive work."""
    safety_margin: float = 0.85
    """Admit only if the predicted finish uses at most this share of the time left to deadline."""
    prior_step_overhead_s: float = 0.004
    """Step cost `a` before the engine has reported steps (fixed cost per step)."""
    prior_s_per_token: float = 0.0002
    """Step cost `b` before the engine has reported steps (seconds per token in a step)."""
    min_retry_after_s: float = 1.0
    """Smallest Retry-After advertised (seconds)."""
    max_retry_after_s: float = 60.0
    """Largest Retry-After advertised (seconds)."""
    adaptive_cap: bool = True
    """Cap admitted tokens by what recently finished on time (AIMD); see the module docstring."""

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests={self.max_queued_requests}: must be >= 1")
        if self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens={self.max_queued_tokens}: must be >= 1")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if not 0.0 < self.batch_share <= 1.0:
            raise ValueError(f"batch_share={self.batch_share}: must be in (0, 1]")
        if not 0.0 < self.safety_margin <= 1.0:
            raise ValueError(f"safety_margin={self.safety_margin}: must be in (0, 1]")
        if self.prior_step_overhead_s < 0 or self.prior_s_per_token <= 0:
            raise ValueError("prior_step_overhead_s must be >= 0 and prior_s_per_token > 0")
        if not 0.0 < self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError(
                f"min_retry_after_s={self.min_retry_after_s} must be > 0 and <= "
                f"max_retry_after_s={self.max_retry_after_s}"
            )


_SLOWDOWN_STEPS = 16  # recent steps that set StepCostModel.slowdown


class StepCostModel:
    """step_s ~= a + b * num_tokens, fitted by least squares over the last `window` steps.

    A linear fit rather than a tokens/s average because a step has a fixed cost (launch, python,
    sampling) that a small batch pays in full: a tokens/s figure measured at batch 1 would
    underestimate a full batch's throughput several times over.
    """

    def __init__(self, prior_a: float, prior_b: float, window: int = 256) -> None:
        self.a = prior_a
        self.b = prior_b
        self._prior = (prior_a, prior_b)
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self.slowdown = 1.0  # the slowest recent step relative to the fit (>= 1)
        self._dirty = False

    def observe(self, num_tokens: int, step_s: float) -> None:
        if num_tokens > 0 and step_s > 0:
            self._steps.append((num_tokens, step_s))
            self._dirty = True

    def refit(self) -> None:
        """Recompute (a, b); cheap (window-sized), call after a batch of observations."""
        if not self._dirty:
            return
        self._dirty = False
        n = len(self._steps)
        if n < 4:
            return
        sx = sum(x for x, _ in self._steps)
        sy = sum(y for _, y in self._steps)
        sxx = sum(x * x for x, _ in self._steps)
        sxy = sum(x * y for x, y in self._steps)
        den = n * sxx - sx * sx
        if den <= 1e-9 * max(1.0, sxx):
            # All steps had the same size, so overhead and per-token cost cannot be told apart.
            # Charge it all per token: that overestimates bigger batches (admits too few) rather
            # than underestimating them (admits requests that then miss the deadline).
            self.a, self.b = 0.0, sy / sx
            self._update_slowdown()
            return
        b = (n * sxy - sx * sy) / den
        a = (sy - b * sx) / n
        if b <= 0:  # noise: fall back to a pure per-token cost through the mean
            b, a = sy / sx, 0.0
        self.a, self.b = max(a, 0.0), b
        self._update_slowdown()

    def _update_slowdown(self) -> None:
        recent = islice(reversed(self._steps), _SLOWDOWN_STEPS)
        self.slowdown = max(1.0, max(y / self.step_s(x) for x, y in recent))

    def step_s(self, num_tokens: int) -> float:
        return self.a + self.b * num_tokens

    def drain_s(self, tokens: int, budget: int) -> float:
        """Time to process `tokens` in steps of at most `budget` tokens, planned for the
        slowest of the recent steps relative to the fit (`slowdown`): the fit averages over
        256 steps, and when other processes start taking the engine's CPU the steps get slower
        at once, long before the average moves."""
        if tokens <= 0:
            return 0.0
        return (math.ceil(tokens / budget) * self.a + tokens * self.b) * self.slowdown


@dataclass(slots=True)
class WorkItem:
    """One admitted request in the ledger."""

    priority: Priority
    prompt_tokens: int  # still to prefill (0 once the first output arrived)
    output_tokens: int  # still to generate
    deadline_s: float = math.inf  # monotonic: finish (single pass) / first token (generate)
    single_pass: bool = True
    judged: bool = False  # on-time verdict already fed to the adaptive cap

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(slots=True)  # not frozen: a frozen init costs ~1 us, on every request
class Decision:
    admitted: bool
    predicted_s: float  # predicted time from now to finish (single-pass) / first token (generate)
    engine_deadline_s: float  # monotonic: the engine must start it by then, else drop it (504)
    retry_after_s: float  # when rejected: seconds until it would likely fit
    reason: str  # "" when admitted; else why (for the error message)


@dataclass(slots=True)
class _Totals:
    requests: int = 0
    tokens: int = 0


@dataclass
class AdmissionController:
    """The ledger of admitted work plus the admit/reject decision."""

    config: AdmissionConfig
    cost: StepCostModel = field(init=False)
    _items: dict[str, WorkItem] = field(default_factory=dict, init=False)
    _all: _Totals = field(default_factory=_Totals, init=False)
    _interactive: _Totals = field(default_factory=_Totals, init=False)
    frontend_delay_s: float = field(default=0.0, init=False)
    """Recent delay the HTTP process itself adds to an answer (event-loop lag, and the time
    answers took from the engine to their handler), set by the server: under a burst the loop
    is busy parsing and rejecting, and an admitted answer waits for it too."""

    cap_tokens: float = field(default=0.0, init=False)
    """Adaptive cap on admitted tokens (AIMD on on-time answers); inf when disabled."""

    def __post_init__(self) -> None:
        self.cost = StepCostModel(self.config.prior_step_overhead_s, self.config.prior_s_per_token)
        self.cap_tokens = self._min_cap if self.config.adaptive_cap else math.inf

    @property
    def _min_cap(self) -> float:
        return self.config.max_num_batched_tokens / 2

    def _judge(self, item: WorkItem, now_s: float | None) -> None:
        """Feed one on-time / late verdict to the adaptive cap."""
        if item.judged or now_s is None or not self.config.adaptive_cap:
            return
        item.judged = True
        if now_s <= item.deadline_s:
            grown = self.cap_tokens + item.prompt_tokens + item.output_tokens + 1
            self.cap_tokens = min(grown, float(self.config.max_queued_tokens))
        else:
            self.cap_tokens = max(self._min_cap, self.cap_tokens / 2)

    # ---- ledger -------------------------------------------------------------------------------
    @property
    def queued_requests(self) -> int:
        return self._all.requests

    @property
    def queued_tokens(self) -> int:
        return self._all.tokens

    def _add(self, item: WorkItem, sign: int) -> None:
        tokens = sign * (item.prompt_tokens + item.output_tokens)
        t = self._all
        t.requests += sign
        t.tokens += tokens
        if item.priority == Priority.INTERACTIVE:
            t = self._interactive
            t.requests += sign
            t.tokens += tokens

    def progress(
        self,
        request_id: str,
        *,
        prefill_done: bool,
        output_tokens_done: int,
        now_s: float | None = None,
    ) -> None:
        """The engine reported progress: shrink the request's remaining work. A generation's
        first output is its deadline event: judge it then."""
        item = self._items.get(request_id)
        if item is None:
            return
        if prefill_done and not item.single_pass:
            self._judge(item, now_s)
        self._add(item, -1)
        if prefill_done:
            item.prompt_tokens = 0
        item.output_tokens = max(0, item.output_tokens - output_tokens_done)
        self._add(item, +1)

    def release(self, request_id: str, now_s: float | None = None) -> None:
        """The request was answered (any outcome): remove it from the ledger. With `now_s`, an
        unjudged request is judged on time or late (a 504 or an error past the deadline is late)."""
        item = self._items.pop(request_id, None)
        if item is not None:
            self._judge(item, now_s)
            self._add(item, -1)

    # ---- decision -----------------------------------------------------------------------------
    def saturated(
        self, *, now_s: float, deadline_s: float, priority: Priority, single_pass: bool
    ) -> Decision | None:
        """The rejection a one-token request would get now, or None if one could still fit.

        Every request has at least one token and `decide` is monotonic in the request's size,
        so when this says no, `decide` would too: the server asks it before tokenizing, so that
        the thousands of requests a burst brings beyond capacity are turned away without paying
        for their tokenization. Commits nothing.
        """
        d = self.decide(
            "",
            now_s=now_s,
            deadline_s=deadline_s,
            prompt_tokens=1,
            output_tokens=0,
            priority=priority,
            single_pass=single_pass,
            commit=False,
        )
        return None if d.admitted else d

    def decide(
        self,
        request_id: str,
        *,
        now_s: float,
        deadline_s: float,
        prompt_tokens: int,
        output_tokens: int,
        priority: Priority,
        single_pass: bool,
        commit: bool = True,
    ) -> Decision:
        """Admit (and enter into the ledger, unless `commit` is False) or reject one request.

        For a single-pass request (score, embed) the deadline bounds completion; for a generation
        it bounds the first token (queue + prefill), and later tokens are paced by decode steps.
        """
        cfg = self.config
        interactive = priority == Priority.INTERACTIVE
        share = 1.0 if interactive else cfg.batch_share
        ahead = self._interactive.tokens if interactive else self._all.tokens
        own = prompt_tokens + (0 if single_pass else 1)
        start_s = self.cost.drain_s(ahead + own, cfg.max_num_batched_tokens)
        if ahead:
            # A request cannot join a step already running: one more step boundary.
            start_s += self.cost.a
        predicted = start_s + self.frontend_delay_s
        budget_s = (deadline_s - now_s) * cfg.safety_margin

        reason = ""
        if self._all.requests + 1 > cfg.max_queued_requests * share:
            reason = (
                f"{self._all.requests} requests already queued (cap "
                f"{int(cfg.max_queued_requests * share)} for this priority)"
            )
        elif self._all.tokens + prompt_tokens + output_tokens > cfg.max_queued_tokens * share:
            reason = (
                f"{self._all.tokens} tokens already queued (cap "
                f"{int(cfg.max_queued_tokens * share)} for this priority)"
            )
        elif ahead and ahead + own > self.cap_tokens:  # alone, anything may try
            reason = (
                f"{ahead} tokens queued ahead; the engine recently finished only "
                f"{self.cap_tokens:.0f} tokens of admitted work on time (adaptive limit)"
            )
        elif predicted > budget_s:
            reason = (
                f"predicted {predicted * 1e3:.0f} ms to "
                f"{'finish' if single_pass else 'first token'} with {ahead} tokens queued ahead; "
                f"the deadline leaves {max(deadline_s - now_s, 0.0) * 1e3:.0f} ms"
            )
        if reason:
            return Decision(False, predicted, 0.0, self._retry_after(ahead, own, budget_s), reason)

        if commit:
            item = WorkItem(priority, prompt_tokens, output_tokens, deadline_s, single_pass)
            self._items[request_id] = item
            self._add(item, +1)
        # The engine drops it unstarted past this instant; a single-pass request that starts
        # later than deadline - own compute could not finish in time anyway.
        own_s = self.cost.drain_s(own, cfg.max_num_batched_tokens) if single_pass else 0.0
        return Decision(True, predicted, deadline_s - own_s, 0.0, "")

    def _retry_after(self, ahead: int, own: int, budget_s: float) -> float:
        """Seconds until enough of the work ahead has drained for this request to fit."""
        cfg = self.config
        fits_tokens = 0
        if budget_s > 0:  # tokens that can be processed inside the budget
            steps = max(1.0, budget_s / max(self.cost.step_s(cfg.max_num_batched_tokens), 1e-6))
            fits_tokens = int(steps * cfg.max_num_batched_tokens)
        excess = max(ahead + own - fits_tokens, 0)
        wait = self.cost.drain_s(excess, cfg.max_num_batched_tokens)
        return min(max(wait, cfg.min_retry_after_s), cfg.max_retry_after_s)


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


def retry_after_header(retry_after_s: float) -> str:
    """RFC 9110 delay-seconds: a non-negative integer, rounded up so clients never come early."""
    return str(max(1, math.ceil(retry_after_s)))

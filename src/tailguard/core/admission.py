"""Goodput-first admission: refuse a request only when it is predicted to miss its deadline.

Pure policy (no HTTP, no torch, no clock of its own: every call takes `now_s`), so tests step it
by hand. The HTTP server owns one `AdmissionController`; the engine client hands it every engine
output as it arrives, and the stats pump feeds it step timings.

The ledger
    Every admitted request the engine has not finished is in the ledger: its prompt tokens until
    the engine reports its prefill done (the first output), then, for a generation, its
    remaining output tokens and the batch slot it holds. The ledger follows the *engine*, not the
    client: an output counts the moment the engine client reads it, whether or not the request's
    handler has consumed it, so a client that stops reading its stream never makes other
    requests look late. It changes at the instant of each admission, so under a burst of
    thousands of requests each one sees the ones admitted just before it.

The prediction (a fluid model of the scheduler in core/scheduler.py)
    The engine runs the decodes of the sequences it holds (D of them) every step, then fills the
    rest of the step's token budget (B) and sequence slots (S) with waiting prompts, interactive
    ones first. For a new request with P prompt tokens, W waiting prompt tokens ahead of it and
    G waiting generations ahead of it (which will hold slots of their own):

        steps  = max(ceil((W + P) / (B - D)),           token budget left after the decodes
                     slot steps)                         ceil(n / free slots), or, when the
                                                         slots are all held, the steps until
                                                         enough decodes finish
        engine = steps * cost(D + (W + P) / steps,       each step at its padded sizes
                              D + (R + 1) / steps)       (tokens, head rows; R: requests ahead)
                 + what is left of the step running now
        bound  = calibrated(engine) + front-end delay

    `cost(tokens, rows) = a + b * tokens + c * rows` at the engine's padded bucket sizes is the
    step-cost fit (`StepCostModel`). The waiting prompts count both in the step running now and
    ahead of the new request: counting the ones admitted before that step began in it only
    measured worse (session 21, docs/benchmarks.md), the engine's real step start being unknown
    here. `calibrated` adds the measured error
    of past predictions of the same size at the target quantile (`Calibration`, per kind).
    The front-end delay is what the HTTP process itself adds after the engine answered (its
    event-loop lag, the time answers took from the engine client to their handler).

    `calibrated` is at the target quantile, or at a looser rung of the calibration's ladder of
    quantiles while the miss budget has room: the target (say 99% in time) is an aggregate over
    the admitted requests, so an edge request whose only risk is the rare stall may be admitted
    at a 2-5% risk as long as the recent admissions' average risk stays under 0.5% (half the
    1% allowed: the other half is for the delays the server cannot see). Each request
    is planned for the tightest rung at which it fits; its risk is that rung's share of misses
    (0 when it fits even the window's largest error). Only a request whose raw prediction leaves
    half its deadline is planned below the target (its risk is a stall's, not the queue's). At
    overload every admission sits at the edge, the average reaches the budget, and the target
    quantile governs.

    It is admitted when `bound <= deadline - now`, and when the hard caps on queued requests and
    tokens allow it (they bound memory, not time; batch work may fill `batch_share` of them).
    There is no other limit: a request with a long deadline is admitted whatever is queued, as
    long as the prediction says it finishes in time. With nothing admitted in flight, only the
    raw prediction counts (refusing protects nobody there, and a calibration still holding a
    past stall's misses must not turn an idle engine's work away).

Measuring the error
    For every admitted request the controller keeps its raw prediction and the instant it was
    made; the request's deadline event (a single-pass request's answer, a generation's first
    token, or its expiry in the engine) gives one (predicted, actual) sample. Requests still in
    flight that are already past their bound are counted too, as censored samples, so the bound
    widens the moment the engine slows down rather than when the late answers arrive.

Overload
    When more requests arrive than the engine can serve, some must be refused whichever they
    are, and refusing one more costs no goodput: the engine stays busy with the rest. What a
    longer queue buys then is only latency, and with it the risk from what the server cannot
    see (the client's send lag, its event loop reading the answer, the network): measured on a
    2-core machine at 2x and 4x the engine's capacity, admitted answers were in time at the
    server but 3-7% late at the client. So under overload a request is planned to leave a share
    of its time left unused: the share of recent decisions (about `overload_window_s`) that
    refused, up to `overload_headroom`. At or below capacity nothing is refused and the whole
    deadline is planned for; at 1.5x about a third is refused and a third of the deadline kept
    free, from 2x on half (0.5 measured better than 0.33 at 4x, where the client's own send lag
    reached 50 ms: session 25, docs/benchmarks.md). It scales with the deadline, so a long
    deadline is still admitted behind a long queue, and it is 0 with nothing in flight (an idle
    engine admits whatever fits).

`enabled=False` (`--admission off`) admits everything the hard caps allow and gives the engine
no deadline to drop requests by: the oracle configuration that goodput is measured against.

Retry-After comes from the same model: how much longer than its deadline allows the request
would take now, which is how long the work ahead needs to drain for it to fit, rounded up to
whole seconds for the header (RFC 9110 delay-seconds).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import islice

from tailguard.core.admission_config import AdmissionConfig
from tailguard.core.calibration import StepCostModel
from tailguard.core.request import EngineOutput, FinishReason, Priority
from tailguard.core.stats import StepStats

__all__ = [
    "AdmissionConfig",
    "AdmissionController",
    "Decision",
    "PredictionSample",
    "RefusedShare",
    "WorkItem",
    "retry_after_header",
]

_SCAN_OVERDUE = 64  # oldest in-flight requests checked for censored (overdue) samples
_LOOSE_SHARE = 0.5  # raw prediction / time left, at most, for planning below the target
# enum members bound once: a class attribute of an Enum costs ~55 ns to read, several per request
_INTERACTIVE = Priority.INTERACTIVE
_NO_SAMPLE = frozenset({FinishReason.ABORTED, FinishReason.ERROR})  # outputs that measure nothing


@dataclass(slots=True)
class WorkItem:
    """One admitted request in the ledger."""

    priority: Priority
    prompt_tokens: int  # still to prefill (0 once the first output arrived)
    output_tokens: int  # still to generate
    single_pass: bool
    decided_s: float  # monotonic: when it was admitted (the prediction's origin)
    engine_s: float  # the raw (uncalibrated) prediction of its deadline event, from decided_s


@dataclass(slots=True)  # not frozen: a frozen init costs ~1 us, on every request
class Decision:
    admitted: bool
    predicted_s: float  # planned time from now to finish (single-pass) / first token (generate)
    engine_deadline_s: float  # monotonic: the engine must start it by then, else drop it (504)
    retry_after_s: float  # when refused: seconds until it would likely fit
    reason: str  # "" when admitted; else why, in words (for the error message)
    # "" when admitted; else the label of tailguard_admission_refusals_total{reason}: late,
    # deadline_passed, queue_requests or queue_tokens
    code: str = ""


@dataclass(slots=True)  # not frozen: a frozen init costs ~0.5 us, on every answer
class PredictionSample:
    """One request's deadline event: how long it took against what was predicted."""

    single_pass: bool
    predicted_s: float  # the calibrated bound admission planned for (front-end delay excluded)
    actual_s: float  # decision -> the engine client read the answer / first token


@dataclass(slots=True)
class _Waiting:
    requests: int = 0
    tokens: int = 0  # prompt tokens still to prefill
    generations: int = 0  # waiting generations: each will hold a batch slot after its prefill
    generation_outputs: int = 0  # output tokens of those generations

    def add(self, requests: int, tokens: int, generations: int, outputs: int) -> None:
        self.requests += requests
        self.tokens += tokens
        self.generations += generations
        self.generation_outputs += outputs


@dataclass(slots=True)
class RefusedShare:
    """The share of recent admission decisions that refused, over about `window_s`: counts in
    two half-window buckets, the older one dropped as time moves on (no per-request memory)."""

    window_s: float
    _start: float = 0.0  # when the current bucket began
    _now: tuple[int, int] = (0, 0)  # (refused, decided) in the current bucket
    _before: tuple[int, int] = (0, 0)  # the bucket before it

    def _roll(self, now_s: float) -> None:
        half = self.window_s / 2
        if now_s - self._start < half:
            return
        self._before = self._now if now_s - self._start < 2 * half else (0, 0)
        self._now = (0, 0)
        self._start = now_s

    def record(self, now_s: float, refused: bool) -> None:
        self._roll(now_s)
        r, n = self._now
        self._now = (r + refused, n + 1)

    def share(self, now_s: float) -> float:
        self._roll(now_s)
        n = self._now[1] + self._before[1]
        return (self._now[0] + self._before[0]) / n if n else 0.0


@dataclass
class AdmissionController:
    """The ledger of admitted work plus the admit/refuse decision."""

    config: AdmissionConfig
    cost: StepCostModel = field(init=False)
    frontend_delay_s: float = field(init=False)  # 0.0, set in __post_init__ (as `cost`)
    """Recent delay the HTTP process itself adds after the engine client has read an answer
    (event-loop lag, the time answers took to reach their handler); set by the server."""

    def __post_init__(self) -> None:
        cfg = self.config
        self.frontend_delay_s = 0.0
        rows = cfg.step_cost == "rows"
        self.cost = StepCostModel(
            cfg.prior_step_overhead_s,
            cfg.prior_s_per_token,
            token_buckets=cfg.token_buckets if rows else (),
            row_buckets=cfg.row_buckets if rows else (),
            rows=rows,
        )
        self.calibration = {True: cfg.calibration(), False: cfg.calibration()}  # by single_pass
        self._items: dict[str, WorkItem] = {}
        self._pending: dict[str, WorkItem] = {}  # deadline event not seen yet, oldest first
        self._decoding: dict[str, WorkItem] = {}  # generations past their prefill
        self._waiting_all = _Waiting()
        self._waiting_interactive = _Waiting()
        self._queued_tokens = 0  # prompt + remaining output over the whole ledger
        self._step_start_s = 0.0  # monotonic: when the engine's current step began (estimated)
        ladder = self.calibration[True].ladder
        self._level_risk = tuple(1.0 - q for q in ladder)  # chance of a miss, per ladder level
        self._target_level = self.calibration[True].target_level
        self._risk_avg = 0.0  # recent admissions' average risk (a moving average)
        self._miss_budget = cfg.miss_budget
        self._allowed = self._allowed_level()  # follows _risk_avg (see _spend)
        self._refused = RefusedShare(cfg.overload_window_s)
        self._budget, self._slots = cfg.max_num_batched_tokens, cfg.max_num_seqs

    # ---- ledger -------------------------------------------------------------------------------
    @property
    def queued_requests(self) -> int:
        return len(self._items)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def decoding(self) -> int:
        return len(self._decoding)

    def _waiting(self, item: WorkItem, sign: int) -> None:
        gen = 0 if item.single_pass else sign
        tokens, outputs = sign * item.prompt_tokens, gen * item.output_tokens
        self._waiting_all.add(sign, tokens, gen, outputs)
        if item.priority == _INTERACTIVE:
            self._waiting_interactive.add(sign, tokens, gen, outputs)

    def step_ended(self, t_s: float) -> None:
        """The engine reported a step that ended at `t_s` (monotonic): the next one began then."""
        self._step_start_s = max(self._step_start_s, t_s)

    def observe_step(self, step: StepStats) -> None:
        """One engine step (or warm-up run) reported: the step-cost fit learns from it, and the
        next step began when it ended."""
        if self.config.step_cost == "rows":
            self.cost.observe(step.padded_tokens, step.step_s, step.padded_seqs)
        else:
            self.cost.observe(step.num_tokens, step.step_s)
        self.step_ended(step.t_s)

    def _enter(self, rid: str, item: WorkItem) -> None:
        if not self._items:  # an idle engine starts a step for this one now
            self._step_start_s = max(self._step_start_s, item.decided_s)
        self._items[rid] = item
        self._pending[rid] = item
        self._waiting(item, +1)
        self._queued_tokens += item.prompt_tokens + item.output_tokens

    def release(self, request_id: str) -> None:
        """The request left the server (answered, failed, client gone): drop it from the ledger.
        Idempotent; the engine client's outputs usually release it first."""
        item = self._items.pop(request_id, None)
        if item is None:
            return
        self._pending.pop(request_id, None)
        if self._decoding.pop(request_id, None) is None:
            self._waiting(item, -1)
        self._queued_tokens -= item.prompt_tokens + item.output_tokens

    def observe_output(self, out: EngineOutput, now_s: float) -> PredictionSample | None:
        """The engine client read one engine output: move the request along the ledger. Returns
        the prediction sample when this output is the request's deadline event."""
        rid = out.request_id
        item = self._items.get(rid)
        if item is None:
            return None
        sample = None
        # the deadline event (leaves _pending); an aborted or failed one measures nothing
        if (
            (out.finished or out.new_token_ids)
            and self._pending.pop(rid, None) is not None
            and out.finish_reason not in _NO_SAMPLE
        ):
            sample = self._sample(item, now_s)
        if out.finished:
            self.release(rid)
            return sample
        if rid not in self._decoding:  # the first output: its prefill is done
            self._waiting(item, -1)
            self._queued_tokens -= item.prompt_tokens
            item.prompt_tokens = 0
            self._decoding[rid] = item
        done = min(len(out.new_token_ids), item.output_tokens)
        item.output_tokens -= done
        self._queued_tokens -= done
        return sample

    def _sample(self, item: WorkItem, now_s: float) -> PredictionSample:
        cal = self.calibration[item.single_pass]
        predicted = cal.bound(item.engine_s)
        actual_s = now_s - item.decided_s
        cal.observe(item.engine_s, actual_s, now_s)
        return PredictionSample(item.single_pass, predicted, actual_s)

    def refresh(self, now_s: float) -> None:
        """Recompute the calibration (call every few ms): measured quantiles, plus censored
        samples from the oldest requests in flight that are already past their bound."""
        live = {True: 0.0, False: 0.0}
        for item in islice(self._pending.values(), _SCAN_OVERDUE):
            elapsed = now_s - item.decided_s
            if self.calibration[item.single_pass].overdue(item.engine_s, elapsed):
                live[item.single_pass] = max(live[item.single_pass], elapsed - item.engine_s)
        for kind, cal in self.calibration.items():
            cal.refresh(now_s)
            cal.live_excess_s = live[kind]

    # ---- prediction ---------------------------------------------------------------------------
    def engine_s(self, prompt_tokens: int, *, interactive: bool, now_s: float) -> float:
        """Raw prediction: seconds from `now_s` until the engine has prefilled `prompt_tokens`
        more (a single-pass request's answer, a generation's first token). See the module
        docstring."""
        budget, slots = self._budget, self._slots
        ahead = self._waiting_interactive if interactive else self._waiting_all
        held = min(len(self._decoding), slots)
        tokens = ahead.tokens + prompt_tokens
        steps = math.ceil(tokens / (budget - held))
        # slots left once the waiting generations hold theirs
        free = slots - held - ahead.generations
        if free >= 1:
            steps = max(steps, math.ceil((ahead.requests - ahead.generations + 1) / free))
        else:
            steps = max(steps, self._steps_until_freed(1 - free) + 1)
        # each step decodes the held sequences and prefills its share of the prompts ahead
        # (the last of them completing: a head row each), at the engine's padded sizes
        per_tokens = min(budget, held + tokens / steps)
        per_rows = min(slots, held + (ahead.requests + 1) / steps)
        t = steps * self.cost.step_s(per_tokens, per_rows)
        if self._items:  # a step is running: ours starts after what is left of it
            running = self.cost.step_s(
                min(budget, held + self._waiting_all.tokens),
                min(slots, held + self._waiting_all.requests),
            )
            t += max(running - (now_s - self._step_start_s), 0.0)
        return t

    def _steps_until_freed(self, k: int) -> int:
        """Decode steps until `k` held batch slots are freed (by remaining output tokens; a
        stop string or EOS may free them sooner). Beyond the held sequences, the waiting
        generations must run through their outputs too: counted as if they shared the batch."""
        remaining = [it.output_tokens for it in self._decoding.values()]
        if k <= len(remaining):
            return heapq.nsmallest(k, remaining)[-1]
        waiting_out = self._waiting_all.generation_outputs
        rounds = (waiting_out + sum(remaining)) / self.config.max_num_seqs
        return max(remaining, default=0) + math.ceil(rounds)

    # ---- decision -----------------------------------------------------------------------------
    def saturated(
        self, *, now_s: float, deadline_s: float, priority: Priority, single_pass: bool
    ) -> Decision | None:
        """The refusal a one-token request would get now, or None if one could still fit.

        `decide` is monotonic in the request's size, so when this says no, `decide` would too:
        the server asks it before tokenizing, so that the thousands of requests a burst brings
        beyond capacity are turned away without paying for their tokenization. Commits nothing.
        """
        interactive = priority == _INTERACTIVE
        _, _, predicted, left, usable = self._predict(
            1, interactive, single_pass, now_s, deadline_s
        )
        refusal = self._refusal(interactive, 1, predicted, left, usable, single_pass)
        if refusal is None:
            return None  # commits nothing, records nothing
        self._refused.record(now_s, True)  # its refusal counts in the refused share
        return self._refused_decision(refusal, predicted, usable)

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
        """Admit (and enter into the ledger, unless `commit` is False) or refuse one request.

        For a single-pass request (score, embed) the deadline bounds completion; for a generation
        it bounds the first token (queue + prefill), and later tokens are paced by decode steps.
        """
        interactive = priority == _INTERACTIVE
        engine, level, predicted, left, usable = self._predict(
            prompt_tokens, interactive, single_pass, now_s, deadline_s
        )
        refusal = self._refusal(
            interactive, prompt_tokens + output_tokens, predicted, left, usable, single_pass
        )
        if commit or refusal is not None:  # uncommitted admissions are not counted
            self._refused.record(now_s, refusal is not None)
        if refusal is not None:
            return self._refused_decision(refusal, predicted, usable)
        if commit:
            item = WorkItem(priority, prompt_tokens, output_tokens, single_pass, now_s, engine)
            self._enter(request_id, item)
            self._spend(self._level_risk[level])
        if not self.config.enabled:
            return Decision(True, predicted, math.inf, 0.0, "")
        # The engine drops it unstarted past this instant: a single-pass request that starts
        # later than deadline - its own compute could not finish in time anyway.
        own = self.cost.step_s(prompt_tokens, 1) if single_pass else 0.0
        return Decision(True, predicted, deadline_s - own, 0.0, "")

    def _predict(
        self,
        prompt_tokens: int,
        interactive: bool,
        single_pass: bool,
        now_s: float,
        deadline_s: float,
    ) -> tuple[float, int, float, float, float]:
        """(raw prediction, ladder level, planned time, time left, time usable): what `decide`
        and `saturated` judge a request by."""
        engine = self.engine_s(prompt_tokens, interactive=interactive, now_s=now_s)
        left = deadline_s - now_s
        usable = left * (1.0 - self.headroom(now_s))
        level, predicted = self._plan(engine, usable, single_pass)
        return engine, level, predicted, left, usable

    def _refused_decision(
        self, refusal: tuple[str, str], predicted: float, usable: float
    ) -> Decision:
        code, reason = refusal
        return Decision(False, predicted, 0.0, self._retry_after(predicted, usable), reason, code)

    def headroom(self, now_s: float) -> float:
        """The share of its time left a request is planned to leave unused now: the share of
        recent requests refused, up to `overload_headroom`; 0 with nothing in flight (an empty
        queue has nothing to shorten) or with admission off."""
        if not self._items or not self.config.enabled:
            return 0.0
        return min(self.config.overload_headroom, self._refused.share(now_s))

    # ---- the miss budget ----------------------------------------------------------------------
    def _plan(self, engine: float, left: float, single_pass: bool) -> tuple[int, float]:
        """(ladder level, planned time) for a raw prediction: the tightest level of the
        calibration ladder at which it fits the time left, among those the miss budget allows
        now; when none fits, the loosest allowed (the request will be refused for it)."""
        cal = self.calibration[single_pass]
        delay = self.frontend_delay_s
        # Looser than the target only for a request whose own prediction leaves at least half
        # its deadline: its risk is the machine's rare stall, which strikes requests one by
        # one. Behind a long queue the error is the queue's, shared by every request in it
        # (all late together), which the per-size samples underestimate (measured: a 2x level
        # with 3.7% of admitted first tokens late, where the budget allowed 0.5%).
        loose = engine <= _LOOSE_SHARE * left
        loosest = self._allowed if loose else self._target_level
        if not self._items:
            # Nothing admitted is in flight: the engine starts this one now, and refusing it
            # protects nobody. Only its own compute can make it late (a calibration still
            # holding a past stall's misses must not turn an idle server's work away).
            return 0, min(cal.bound(engine, loosest), engine) + delay
        predicted = cal.bound(engine, loosest) + delay
        if predicted > left:
            return loosest, predicted
        for level in range(loosest):  # tightest first: the risk it carries is the least
            tighter = cal.bound(engine, level) + delay
            if tighter <= left:
                return level, tighter
        return loosest, predicted

    def _allowed_level(self) -> int:
        """The loosest ladder level a request may be planned for now: the target quantile
        always; a looser one while the recently admitted requests' expected misses (their
        average risk, over about a calibration window of admissions) stay under the budget
        with this one admitted too."""
        budget = self._miss_budget
        room = self._risk_avg + (budget - self._risk_avg) * self.config.calibration_window
        # the risks grow with the level (the ladder is tightest first): the last that fits room
        return max(bisect_right(self._level_risk, room) - 1, self._target_level)

    def _spend(self, risk: float) -> None:
        self._risk_avg += (risk - self._risk_avg) / self.config.calibration_window
        self._allowed = self._allowed_level()

    @property
    def expected_miss_share(self) -> float:
        """The recently admitted requests' average chance of missing their deadline."""
        return self._risk_avg

    def _refusal(
        self,
        interactive: bool,
        tokens: int,
        predicted: float,
        left: float,
        usable: float,
        single_pass: bool,
    ) -> tuple[str, str] | None:
        """(code, reason) when the request must be refused, else None."""
        cfg = self.config
        share = 1.0 if interactive else cfg.batch_share
        if len(self._items) + 1 > cfg.max_queued_requests * share:
            return "queue_requests", (
                f"{len(self._items)} requests already queued (cap "
                f"{int(cfg.max_queued_requests * share)} for this priority)"
            )
        if self._queued_tokens + tokens > cfg.max_queued_tokens * share:
            return "queue_tokens", (
                f"{self._queued_tokens} tokens already queued (cap "
                f"{int(cfg.max_queued_tokens * share)} for this priority)"
            )
        if not cfg.enabled:
            return None
        event = "finish" if single_pass else "first token"
        if left <= 0:
            return "deadline_passed", (
                f"its deadline passed {-left * 1e3:.0f} ms ago, before it could be admitted "
                "(it waited in the server's intake)"
            )
        if predicted > usable:
            ahead = self._waiting_interactive if interactive else self._waiting_all
            plan = (
                f", of which {usable * 1e3:.0f} ms are planned for (overloaded: the queue is "
                f"kept {1.0 - usable / left:.0%} short of deadlines)"
                if usable < left
                else ""
            )
            return "late", (
                f"predicted {predicted * 1e3:.0f} ms to {event} ({ahead.tokens} prompt tokens "
                f"queued ahead, {len(self._decoding)} sequences decoding); the deadline leaves "
                f"{left * 1e3:.0f} ms{plan}"
            )
        return None

    def _retry_after(self, predicted: float, left: float) -> float:
        """Seconds until the work ahead has drained enough for this request to fit."""
        cfg = self.config
        wait = predicted - max(left, 0.0)
        return min(max(wait, cfg.min_retry_after_s), cfg.max_retry_after_s)


def retry_after_header(retry_after_s: float) -> str:
    """RFC 9110 delay-seconds: a non-negative integer, rounded up so clients never come early."""
    return str(max(1, math.ceil(retry_after_s)))

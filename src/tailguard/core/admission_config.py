"""AdmissionConfig: the settings of goodput-first admission (tailguard.core.admission).

Typed, validated at construction, never changed afterwards; `ServerConfig.admission_config()`
builds it from the server's settings. Apart from the controller so that each module stays
legible (and the controller's module compiles on its own: tailguard.compiled).
"""

from __future__ import annotations

from dataclasses import dataclass

from tailguard.core.calibration import Calibration

__all__ = ["AdmissionConfig"]


@dataclass(frozen=True)
class AdmissionConfig:
    enabled: bool = True
    """False: admit everything the hard caps allow, and the engine drops nothing for its deadline
    (the oracle configuration; `--admission off`)."""
    max_queued_requests: int = 2048
    """Hard cap on requests admitted and not yet answered."""
    max_queued_tokens: int = 262_144
    """Hard cap on tokens (prompt + remaining output) admitted and not yet processed."""
    max_num_batched_tokens: int = 1024
    """Engine per-step token budget (from EngineConfig)."""
    max_num_seqs: int = 64
    """Engine batch capacity (from EngineConfig)."""
    token_buckets: tuple[int, ...] = ()
    """The token counts the engine pads a step to (from EngineConfig; empty: no padding)."""
    row_buckets: tuple[int, ...] = ()
    """The sequence counts the engine pads the output head's rows to (EngineConfig's
    seq_buckets; empty: no padding)."""
    step_cost: str = "rows"
    """rows: a step costs a + b * tokens + c * head rows at the padded sizes; tokens: a + b *
    tokens, unpadded (the previous model, kept to compare)."""
    batch_share: float = 0.8
    """Share of the caps batch-priority work may fill; the rest is kept for interactive work."""
    target_quantile: float = 0.99
    """The share of admitted requests meant to meet their deadline. Admission plans each request
    for this quantile of the measured prediction error, or for a looser one (down to
    `1 - max_request_risk`) while the recently admitted requests' expected misses leave room in
    half the budget `1 - target_quantile` (see `miss_budget`)."""
    max_request_risk: float = 0.05
    """The largest chance of missing its deadline that one admitted request may carry, when
    the recent ones leave room in the budget (0: plan every request for the target quantile)."""
    overload_headroom: float = 0.5
    """Under overload, the share of its time left a request is planned to leave unused: the
    share of recent requests refused, up to this (0: plan to the whole deadline always). See
    the module docstring, "Overload"."""
    overload_window_s: float = 1.0
    """How far back the refused share is counted (seconds)."""
    calibration_window: int = 512
    """Recent answers whose prediction error is kept, per kind (completion, first token)."""
    calibration_min_samples: int = 32
    """Answers needed (per prediction-size class) before the measured error replaces the priors."""
    calibration_max_age_s: float = 30.0
    """Answers older than this no longer count (seconds): the machine and the fit change."""
    calibration_tail_samples: int = 2
    """A prediction-size class with too few answers for this many to lie above its target
    quantile is pooled with its neighbours (0: off): one stall must not become a sparse class's
    0.99 quantile (see `Calibration`)."""
    prior_ratio: float = 1.25
    """Actual / predicted time assumed until measured."""
    prior_excess_s: float = 0.010
    """Actual minus predicted time (fixed delays) assumed until measured (seconds)."""
    prior_step_overhead_s: float = 0.004
    """Step cost `a` before the engine has reported steps (fixed cost per step)."""
    prior_s_per_token: float = 0.0002
    """Step cost `b` before the engine has reported steps (seconds per token in a step)."""
    min_retry_after_s: float = 1.0
    """Smallest Retry-After advertised (seconds)."""
    max_retry_after_s: float = 60.0
    """Largest Retry-After advertised (seconds)."""

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.max_queued_requests >= 1, f"max_queued_requests={self.max_queued_requests}: >= 1")
        need(self.max_queued_tokens >= 1, f"max_queued_tokens={self.max_queued_tokens}: >= 1")
        need(
            self.max_num_batched_tokens > self.max_num_seqs >= 1,
            f"max_num_batched_tokens={self.max_num_batched_tokens} must exceed "
            f"max_num_seqs={self.max_num_seqs} (>= 1): a step decodes every held sequence",
        )
        need(
            self.step_cost in ("rows", "tokens"),
            f"step_cost={self.step_cost!r}: use rows or tokens",
        )
        need(0.0 < self.batch_share <= 1.0, f"batch_share={self.batch_share}: in (0, 1]")
        need(
            0.5 <= self.target_quantile < 1.0,
            f"target_quantile={self.target_quantile}: in [0.5, 1), e.g. 0.99",
        )
        need(
            0.0 <= self.max_request_risk <= 0.25,
            f"max_request_risk={self.max_request_risk}: in [0, 0.25], e.g. 0.1",
        )
        need(
            0.0 <= self.overload_headroom <= 0.9,
            f"overload_headroom={self.overload_headroom}: in [0, 0.9], e.g. 0.5",
        )
        need(self.overload_window_s > 0, f"overload_window_s={self.overload_window_s}: > 0")
        need(
            self.calibration_window >= self.calibration_min_samples >= 1,
            f"calibration_window={self.calibration_window} must be >= "
            f"calibration_min_samples={self.calibration_min_samples} >= 1",
        )
        need(
            self.calibration_max_age_s > 0,
            f"calibration_max_age_s={self.calibration_max_age_s}: > 0",
        )
        need(
            self.calibration_tail_samples >= 0,
            f"calibration_tail_samples={self.calibration_tail_samples}: >= 0 (0: off)",
        )
        need(self.prior_ratio >= 1.0, f"prior_ratio={self.prior_ratio}: >= 1")
        need(self.prior_excess_s >= 0, f"prior_excess_s={self.prior_excess_s}: >= 0")
        need(
            self.prior_step_overhead_s >= 0 and self.prior_s_per_token > 0,
            "prior_step_overhead_s must be >= 0 and prior_s_per_token > 0",
        )
        need(
            0.0 < self.min_retry_after_s <= self.max_retry_after_s,
            f"min_retry_after_s={self.min_retry_after_s} must be > 0 and <= "
            f"max_retry_after_s={self.max_retry_after_s}",
        )

    @property
    def miss_budget(self) -> float:
        """The expected share of admitted requests admission may spend on edge requests: half
        of the `1 - target_quantile` allowed to miss. The other half is left for what the server
        cannot see (the client's send lag, the network, the answer's way back to the client),
        which its own samples do not contain."""
        return (1.0 - self.target_quantile) / 2

    def ladder(self) -> tuple[float, ...]:
        """The quantiles admission may plan a request for, tightest first: the window's largest
        error (a request that fits even that carries no measured risk), half the budget, the
        target, then looser ones up to `max_request_risk`."""
        b = 1.0 - self.target_quantile
        risks = [0.0, b / 2, b] + [r * b for r in (2, 5, 10, 20) if r * b < self.max_request_risk]
        if self.max_request_risk > b:
            risks.append(self.max_request_risk)
        return tuple(sorted({round(1.0 - r, 9) for r in risks}, reverse=True))

    def calibration(self) -> Calibration:
        return Calibration(
            quantile=self.target_quantile,
            window=self.calibration_window,
            min_samples=self.calibration_min_samples,
            prior_ratio=self.prior_ratio,
            prior_excess_s=self.prior_excess_s,
            max_age_s=self.calibration_max_age_s,
            ladder=self.ladder(),
            tail_samples=self.calibration_tail_samples,
        )

"""Plain-data statistics. One module (server/metrics.py) translates them to Prometheus."""

from __future__ import annotations

import msgspec


class AllocatorStats(msgspec.Struct):
    """Device allocator figures. On CUDA from torch.cuda.memory_stats(); on CPU only rss_bytes."""

    device: str = "cpu"
    reserved_bytes: int = 0  # "reserved_bytes.all.current"
    allocated_bytes: int = 0  # "allocated_bytes.all.current"
    inactive_split_bytes: int = 0  # "inactive_split_bytes.all.current"
    num_alloc_retries: int = 0  # cumulative
    num_ooms: int = 0  # cumulative
    num_device_alloc: int = 0  # cumulative cudaMalloc calls ("num_device_alloc")
    rss_bytes: int = 0  # engine process resident set size


class StepStats(msgspec.Struct):
    """One engine step (schedule, execute, update)."""

    t_s: float  # monotonic end time of the step
    step_s: float  # wall time of the step
    num_seqs: int  # sequences in the batch (before padding)
    num_tokens: int  # tokens in the batch (before padding)
    padded_seqs: int  # bucket it was padded to
    padded_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int


class EngineStats(msgspec.Struct):
    """Snapshot published by the engine process after steps (at most every few ms)."""

    t_s: float = 0.0  # monotonic time of the snapshot
    steps_total: int = 0
    waiting: int = 0  # requests queued, not yet running
    running: int = 0
    waiting_tokens: int = 0  # prompt tokens not yet prefilled, over waiting+running
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    preemptions_total: int = 0
    expired_total: int = 0
    aborted_total: int = 0
    finished_total: int = 0
    oom_retries_total: int = 0  # batch splits after an OOM
    oom_failures_total: int = 0  # requests failed because they OOM even alone
    kv_allocations_total: int = 0  # KV tensors allocated (must not grow after warm-up)
    distinct_shapes: int = 0  # distinct op shapes run or declared by warm-up, plus escapes
    warmup_done: bool = False
    max_num_seqs: int = 0  # batch capacity (for "batches full?" questions)
    max_num_batched_tokens: int = 0
    gc_pause_s_total: float = 0.0
    gc_collections_total: int = 0
    cpu_seconds_total: float = 0.0  # engine process CPU time
    intra_op_threads: int = 0
    tokens_per_s: float = 0.0  # recent EWMA of processed (prefill + decode) tokens per second
    step_s_ewma: float = 0.0  # recent EWMA of step wall time
    recent_steps: list[StepStats] = []  # steps since the previous snapshot
    allocator: AllocatorStats = msgspec.field(default_factory=AllocatorStats)


def warmup_step(t_s: float, step_s: float, num_tokens: int, rows: int = 1) -> StepStats:
    """A warm-up run published as a step: a forward over `num_tokens` with the head on one row,
    or (`num_tokens` 0) the output head alone on `rows` rows."""
    return StepStats(t_s, step_s, rows, num_tokens, rows, num_tokens, num_tokens, 0)


STEP_EWMA = 0.2  # weight of the newest step in the published step-time / throughput averages


class StepLog:
    """An engine's step bookkeeping, shared by the real and the simulated engine: the steps run
    since the last stats snapshot (bounded, for when nobody reads them) and the recent averages
    of step time and tokens per second that every snapshot carries."""

    def __init__(self, keep: int) -> None:
        self.keep = keep  # past this many unread steps, the older half is dropped
        self.steps = 0  # serving steps run
        self.step_s_ewma = 0.0
        self.tokens_per_s = 0.0
        self._recent: list[StepStats] = []

    def record(self, step: StepStats) -> None:
        """Publish a step with the next snapshot (warm-up steps come only through here)."""
        self._recent.append(step)
        if len(self._recent) > self.keep:
            del self._recent[: self.keep // 2]

    def ran(self, step: StepStats) -> None:
        """A serving step: counted, averaged and published."""
        self.steps += 1
        a = 1.0 if self.steps == 1 else STEP_EWMA
        self.step_s_ewma += a * (step.step_s - self.step_s_ewma)
        rate = step.num_tokens / step.step_s if step.step_s > 0 else 0.0
        self.tokens_per_s += a * (rate - self.tokens_per_s)
        self.record(step)

    def take(self) -> list[StepStats]:
        """The steps since the previous call."""
        recent, self._recent = self._recent, []
        return recent

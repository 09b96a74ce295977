"""EngineCore: one loop that batches all admitted work. A step is three verbs:
schedule, execute (with OOM isolation), update.

EngineCore is synchronous and process-agnostic; `engine/process.py` runs it in a process of its
own behind an IPC channel, and tests drive it directly.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import psutil
import torch

from tailguard.core.block_pool import BlockPool
from tailguard.core.gc_timer import GCTimer
from tailguard.core.request import EngineOutput, EngineRequest
from tailguard.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput, SeqResult
from tailguard.core.stats import AllocatorStats, EngineStats, StepLog, StepStats, warmup_step
from tailguard.engine.allocator import allocator_stats
from tailguard.engine.config import EngineConfig
from tailguard.engine.runner import ModelRunner


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        torch.set_num_threads(config.threads)
        self.config = config
        self.runner = ModelRunner(config, model_dir)
        self.scheduler = Scheduler(
            pool=BlockPool(self.runner.layout.num_blocks, config.block_size),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.runner.max_model_len,
            eos_token_id=self.runner.mcfg.eos_token_id,
        )
        self.oom_retries = 0
        self.oom_failures = 0
        self.gc_timer = GCTimer()
        self._process = psutil.Process(os.getpid())
        self.log = StepLog(keep=256)
        self.warmup_done = False

    # ---- commands ------------------------------------------------------------------------
    def warmup(self) -> None:
        if self.config.warmup:
            # warm-up forwards are real steps of known size: publish them so admission control
            # starts calibrated (the first stats snapshot carries them)
            for rows, tokens, secs in self.runner.warmup():
                self.log.record(warmup_step(time.monotonic(), secs, tokens, rows))
        gc.collect()
        gc.freeze()  # everything alive now (model, pool) is never scanned again
        self.warmup_done = True

    def add(self, request: EngineRequest) -> None:
        self.scheduler.add(request)

    def abort(self, request_id: str) -> EngineOutput | None:
        self.runner.forget(request_id)
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[EngineOutput]:
        t0 = time.monotonic()
        plan = self.scheduler.schedule(t0)
        results = self._execute(plan.scheduled)
        outputs = self.scheduler.update(plan, results, time.monotonic())
        self._after_step(plan, outputs, t0)
        return outputs

    # ---- execute with OOM isolation ------------------------------------------------------
    def _execute(self, items: list[ScheduledSeq]) -> list[SeqResult]:
        if not items:
            return []
        try:
            return self.runner.execute(items)
        except torch.OutOfMemoryError as exc:
            self.runner.release_memory()
            if len(items) == 1:
                return [self._failed_alone(items[0], exc)]
            self.oom_retries += 1
            half = len(items) // 2
            return self._execute(items[:half]) + self._execute(items[half:])

    def _failed_alone(self, item: ScheduledSeq, exc: BaseException) -> SeqResult:
        self.oom_failures += 1
        m = self.runner.mcfg
        # activations of one forward over this chunk: hidden, MLP and logits, a rough lower bound
        est = item.num_new * (4 * m.hidden_size + 3 * m.intermediate_size) * 4 + m.vocab_size * 4
        return SeqResult(
            error=(
                f"out of memory even when run alone: a forward pass over {item.num_new} new tokens "
                f"(context {item.start + item.num_new}) needs at least ~{est / 2**20:.1f} MiB of "
                f"activations beyond the KV pool ({exc}); send a shorter prompt, or give the "
                "engine more memory (lower kv_cache_bytes / kv_cache_memory_fraction or "
                "max_num_batched_tokens)"
            )
        )

    # ---- bookkeeping ---------------------------------------------------------------------
    def _after_step(self, plan: SchedulerOutput, outputs: list[EngineOutput], t0: float) -> None:
        for out in outputs:
            if out.finished:
                self.runner.forget(out.request_id)
        if not plan.scheduled:
            return
        now = time.monotonic()
        dt = now - t0
        n_tokens = plan.num_tokens
        shape = self.runner.last_shape
        decode = sum(1 for s in plan.scheduled if s.num_new == 1)
        self.log.ran(
            StepStats(
                t_s=now,
                step_s=dt,
                num_seqs=len(plan.scheduled),
                num_tokens=n_tokens,
                padded_seqs=shape[0],
                padded_tokens=shape[1],
                num_prefill_tokens=n_tokens - decode,
                num_decode_tokens=decode,
            )
        )

    def stats(self) -> EngineStats:
        """A snapshot; takes the steps recorded since the previous snapshot."""
        cpu = self._process.cpu_times()
        alloc: AllocatorStats = allocator_stats(self.runner.device, self._process.memory_info().rss)
        return self.scheduler.fill_stats(
            EngineStats(
                t_s=time.monotonic(),
                steps_total=self.log.steps,
                oom_retries_total=self.oom_retries,
                oom_failures_total=self.oom_failures,
                kv_allocations_total=self.runner.device_allocations(),
                distinct_shapes=self.runner.shapes.known,
                warmup_done=self.warmup_done,
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                gc_pause_s_total=self.gc_timer.pause_s_total,
                gc_collections_total=self.gc_timer.collections,
                cpu_seconds_total=cpu.user + cpu.system,
                intra_op_threads=torch.get_num_threads(),
                tokens_per_s=self.log.tokens_per_s,
                step_s_ewma=self.log.step_s_ewma,
                recent_steps=self.log.take(),
                allocator=alloc,
            )
        )

"""SimulatedEngineClient: the real scheduler and block pool, with a timed fake model.

The engine that ships (tailguard.core.scheduler: priorities, earliest deadline first, chunked
prefill, KV blocks, preemption, expiry) runs here in the server's event loop; only the model is
replaced: a step of N tokens costs `step_overhead_s + P / tokens_per_s` seconds (asyncio.sleep),
P being N padded up to the engine's token buckets as the real forward pads it, and produces
deterministic tokens and embeddings (tailguard.server.stub). Outputs reach their handlers
through the same RequestRouter as the real engine client's. So every in-process server test
exercises the scheduler that ships, in milliseconds and without torch.

`crash()` makes it behave like a dead engine process (in-flight requests fail with
EngineUnavailableError, not ready) until it restarts itself after `restart_delay_s`, at most
`max_restarts` times.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from tailguard.core.block_pool import BlockPool
from tailguard.core.calibration import padded
from tailguard.core.request import EngineRequest, RequestKind
from tailguard.core.scheduler import Scheduler, SchedulerOutput, SeqResult
from tailguard.core.stats import EngineStats, StepLog, StepStats, warmup_step
from tailguard.engine.router import RequestRouter, RoutedClient
from tailguard.errors import EngineUnavailableError
from tailguard.server.stub import fake_embedding, fake_token, fake_top_logprobs

__all__ = ["SimulatedEngineClient"]

BLOCK_SIZE = 16
EOS_ID = 2  # SimpleTokenizer's; fake tokens are letters, so only a stop token ends early
KEEP_STEPS = 1024  # step records kept until `stats` is read


class SimulatedEngineClient(RoutedClient):
    def __init__(
        self,
        *,
        tokens_per_s: float = 20_000.0,
        step_overhead_s: float = 0.002,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        max_model_len: int = 4096,
        num_kv_blocks: int | None = None,
        max_restarts: int = 3,
        restart_delay_s: float = 0.2,
        warmup_s: float = 0.05,
        token_buckets: tuple[int, ...] = (),
        seq_buckets: tuple[int, ...] = (),
    ) -> None:
        self.tokens_per_s = tokens_per_s  # the step cost's b = 1 / tokens_per_s
        self.step_overhead_s = step_overhead_s  # the step cost's a
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # default: every sequence fits at full length at once (no preemption unless asked)
        self.num_kv_blocks = (
            num_kv_blocks or max_num_seqs * math.ceil(max_model_len / BLOCK_SIZE) + 1
        )
        self.max_restarts = max_restarts
        self.restart_delay_s = restart_delay_s
        self.warmup_s = warmup_s
        self.token_buckets, self.seq_buckets = token_buckets, seq_buckets
        self.scheduler = self._new_scheduler()
        self._router = RequestRouter(self._add, self._abort)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ready = False
        self._restarts = 0
        self.log = StepLog(keep=KEEP_STEPS)

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(
            pool=BlockPool(self.num_kv_blocks, BLOCK_SIZE),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_id=EOS_ID,
        )

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        # Stands in for the real engine's warm-up, which runs every bucket shape once: publish
        # one step per size so the server's cost model is calibrated before the first request.
        await asyncio.sleep(self.warmup_s)
        t = time.monotonic()
        for i, n in enumerate((16, 64, 256, self.max_num_batched_tokens)):
            self.log.record(warmup_step(t + i * 1e-6, self.step_overhead_s + self._padded_s(n), n))
        self._ready = True
        self._task = asyncio.create_task(self._loop(), name="simulated-engine")

    def _padded_s(self, num_tokens: int) -> float:
        """The forward's time for `num_tokens`, run at their token bucket."""
        return padded(num_tokens, self.token_buckets) / self.tokens_per_s

    async def close(self) -> None:
        self._ready = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._router.fail_all("engine stopped")

    def crash(self) -> None:
        """Behave like a dead engine process; restart after restart_delay_s (bounded)."""
        self._ready = False
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._router.fail_all("engine process died; the server is restarting it, retry shortly")
        self.scheduler = self._new_scheduler()  # a new process starts empty
        if self._restarts < self.max_restarts:
            asyncio.get_running_loop().call_later(
                self.restart_delay_s, lambda: asyncio.ensure_future(self._restart())
            )

    async def _restart(self) -> None:
        self._restarts += 1
        await self.start()

    # ---- protocol -----------------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _check_ready(self) -> None:
        if not self._ready:
            raise EngineUnavailableError("engine is not ready (starting or restarting)")

    def _add(self, request: EngineRequest) -> None:
        self.scheduler.add(request)
        self._wake.set()

    def _abort(self, request_id: str) -> None:
        out = self.scheduler.abort(request_id)
        if out is not None:  # the ledger hears of it, as from the real engine
            self._router.deliver([out])

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.fill_stats(
            EngineStats(
                t_s=time.monotonic(),
                steps_total=self.log.steps,
                warmup_done=self._ready,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                tokens_per_s=self.log.tokens_per_s,
                step_s_ewma=self.log.step_s_ewma,
                recent_steps=self.log.take(),
            )
        )

    # ---- the loop: schedule, execute (sleep), update ------------------------------------------
    async def _loop(self) -> None:
        while True:
            sched = self.scheduler
            if not sched.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.monotonic()
            plan = sched.schedule(t0)
            if plan.scheduled:
                await asyncio.sleep(self.step_overhead_s + self._padded_s(plan.num_tokens))
            elif not plan.finished:
                await asyncio.sleep(0.001)  # work that cannot run yet (no blocks): wait
                continue
            end = time.monotonic()  # wall time, like a real engine: a busy loop makes steps longer
            outputs = sched.update(plan, _fake_results(plan), end)
            if plan.scheduled:
                self._after_step(plan, end, end - t0)
            self._router.deliver(outputs)

    def _after_step(self, plan: SchedulerOutput, now: float, step_s: float) -> None:
        decode = sum(1 for s in plan.scheduled if s.num_new == 1 and not s.seq.is_single_pass)
        seqs, tokens = len(plan.scheduled), plan.num_tokens
        self.log.ran(
            StepStats(
                t_s=now,
                step_s=step_s,
                num_seqs=seqs,
                num_tokens=tokens,
                padded_seqs=int(padded(seqs, self.seq_buckets)),
                padded_tokens=int(padded(tokens, self.token_buckets)),
                num_prefill_tokens=tokens - decode,
                num_decode_tokens=decode,
            )
        )


def _fake_results(plan: SchedulerOutput) -> list[SeqResult]:
    """What the model would return for each scheduled chunk: deterministic stand-ins."""
    results = []
    for item in plan.scheduled:
        seq, req = item.seq, item.seq.request
        if not item.completes:
            results.append(SeqResult())
        elif seq.is_single_pass:
            ids = req.prompt_token_ids
            emb = (
                fake_embedding(ids) if req.kind == RequestKind.EMBED or req.want_embedding else None
            )
            top = fake_top_logprobs(ids, req.top_k) if req.kind == RequestKind.SCORE else None
            results.append(SeqResult(embedding=emb, top_logprobs=top))
        else:
            tok = fake_token(req.prompt_token_ids, seq.num_output_tokens, req.sampling.seed)
            results.append(SeqResult(token_id=tok))
    return results

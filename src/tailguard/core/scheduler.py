"""Continuous-batching scheduler. Pure Python: tested by stepping it by hand with fake results.

Each step: running sequences first (decodes, then the rest of chunked prefills), in priority
then earliest-deadline order; then waiting requests fill what is left of the token and sequence
budget. A long prompt is prefilled in chunks, so it never holds up the decodes. When the KV pool
runs out, the lowest-priority, latest-deadline running sequence is preempted (its blocks return
to the pool, it is recomputed later); a request is never failed for blocks that will free up.
A waiting request whose deadline passes before it ever ran is dropped and reported EXPIRED.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from tailguard.core.block_pool import BlockPool
from tailguard.core.request import (
    EngineError,
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestKind,
)
from tailguard.core.sequence import SeqStatus, Sequence
from tailguard.core.stats import EngineStats


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens [start, start + num_new) of seq.token_ids."""

    seq: Sequence
    start: int  # first new token's position (tokens before it are in the cache)
    num_new: int  # tokens computed this step (1 for a decode, a chunk for a prefill)

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the sequence: it produces an output."""
        return self.start + self.num_new == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # what runs this step
    finished: list[EngineOutput]  # answered without running: expired, rejected at add

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


@dataclass(frozen=True)
class SeqResult:
    """What the model runner returns for one scheduled sequence."""

    token_id: int | None = None  # GENERATE, when the chunk completes the sequence
    embedding: list[float] | None = None  # EMBED / SCORE with want_embedding
    top_logprobs: list[tuple[int, float]] | None = None  # SCORE
    error: str | None = None  # set when the sequence does not fit even alone (out of memory)


@dataclass
class SchedulerCounters:
    preemptions: int = 0
    expired: int = 0
    aborted: int = 0
    finished: int = 0
    failed: int = 0


@dataclass
class Scheduler:
    pool: BlockPool
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_id: int
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)

    def __post_init__(self) -> None:
        self._waiting: list[tuple[tuple[int, float, int], Sequence]] = []  # heap by sort_key
        self._deadlines: list[tuple[float, int, Sequence]] = []  # heap by deadline, lazy
        self._running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._rejected: list[EngineOutput] = []
        self._order = 0
        self._now = 0.0  # monotonic time of the update being applied

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._by_id) - len(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_unfinished(self) -> int:
        return len(self._by_id)

    def fill_stats(self, s: EngineStats) -> EngineStats:
        """Write the scheduler's part of an engine snapshot (queues, KV blocks, counters)."""
        c = self.counters
        s.waiting, s.running, s.waiting_tokens = (
            self.num_waiting,
            self.num_running,
            self.pending_tokens(),
        )
        s.kv_blocks_total, s.kv_blocks_used = self.pool.num_usable, self.pool.num_used
        s.preemptions_total, s.expired_total = c.preemptions, c.expired
        s.aborted_total, s.finished_total = c.aborted, c.finished
        return s

    def has_work(self) -> bool:
        return bool(self._by_id) or bool(self._rejected)

    def pending_tokens(self) -> int:
        """Tokens still to compute over all unfinished requests (prefill + remaining outputs)."""
        total = 0
        for seq in self._by_id.values():
            total += seq.num_uncomputed
            if seq.request.kind == RequestKind.GENERATE:
                total += max(0, seq.request.sampling.max_tokens - seq.num_output_tokens)
        return total

    # ---- commands ------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        problem = self._check(request)
        if problem is not None:
            code, why = problem
            self._rejected.append(_failed(request.request_id, code, why))
            return
        self._order += 1
        seq = Sequence.from_request(request, self._order)
        self._by_id[seq.request_id] = seq
        self._compact()
        self._push_waiting(seq)
        if request.deadline_s != float("inf"):
            heapq.heappush(self._deadlines, (request.deadline_s, seq.order, seq))

    def abort(self, request_id: str) -> EngineOutput | None:
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self.counters.aborted += 1
        return self._finish(seq, FinishReason.ABORTED)

    def schedule(self, now: float) -> SchedulerOutput:
        self._now = now
        finished, self._rejected = self._rejected, []
        finished.extend(self._expire(now))
        budget = _Budget(self.max_num_batched_tokens, self.max_num_seqs)
        preemptions_before = self.counters.preemptions
        scheduled = self._schedule_running(budget)
        if self.counters.preemptions == preemptions_before:  # else the pool is full: admit none
            scheduled.extend(self._schedule_waiting(budget, now))
        return SchedulerOutput(scheduled=scheduled, finished=finished)

    def update(
        self, out: SchedulerOutput, results: list[SeqResult], now: float
    ) -> list[EngineOutput]:
        """Apply the runner's results; return the outputs to send (including out.finished)."""
        self._now = now
        outputs = list(out.finished)
        for item, result in zip(out.scheduled, results, strict=True):
            seq = item.seq
            if seq.status is not SeqStatus.RUNNING:  # aborted or preempted meanwhile
                continue
            if result.error is not None:
                self.counters.failed += 1
                failed = self._finish(seq, FinishReason.ERROR, result.error)
                failed.error_code = EngineError.OUT_OF_MEMORY
                outputs.append(failed)
                continue
            seq.num_computed = item.start + item.num_new
            if not item.completes:
                continue
            if seq.is_single_pass:
                outputs.append(self._finish_single_pass(seq, result))
            else:
                outputs.append(self._append_token(seq, result.token_id))
        return outputs

    # ---- internals -----------------------------------------------------------------------
    def _check(self, request: EngineRequest) -> tuple[EngineError, str] | None:
        n = len(request.prompt_token_ids)
        if n == 0:
            return EngineError.INVALID, "empty prompt: send at least one token"
        extra = request.sampling.max_tokens if request.kind == RequestKind.GENERATE else 0
        if n + extra > self.max_model_len:
            return EngineError.INVALID, (
                f"prompt ({n} tokens) + max_tokens ({extra}) = {n + extra} exceeds the "
                f"model's context of {self.max_model_len} tokens: shorten the prompt or "
                "lower max_tokens"
            )
        if self.pool.blocks_for(n + extra) > self.pool.num_usable:
            return EngineError.OUT_OF_MEMORY, (
                f"request needs {self.pool.blocks_for(n + extra)} KV blocks but the pool has "
                f"{self.pool.num_usable}: raise kv_cache_bytes or shorten the request"
            )
        return None

    def _compact(self) -> None:
        """Drop finished sequences from the lazy heaps once they outnumber live entries, so a
        long run holds no memory for requests that are gone."""
        live = len(self._by_id)
        if len(self._deadlines) > 2 * live + 64:
            self._deadlines = [e for e in self._deadlines if e[2].status is not SeqStatus.FINISHED]
            heapq.heapify(self._deadlines)
        if len(self._waiting) > 2 * live + 64:
            self._waiting = [e for e in self._waiting if e[1].status is SeqStatus.WAITING]
            heapq.heapify(self._waiting)

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.sort_key, seq))

    def _expire(self, now: float) -> list[EngineOutput]:
        out = []
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, seq = heapq.heappop(self._deadlines)
            if seq.status is SeqStatus.WAITING and not seq.started:
                self.counters.expired += 1
                out.append(
                    self._finish(
                        seq,
                        FinishReason.EXPIRED,
                        "deadline passed while queued; the request never ran",
                    )
                )
        return out

    def _reserve(self, seq: Sequence, num_new: int) -> bool:
        need = self.pool.blocks_for(seq.num_computed + num_new) - len(seq.block_table)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        self.counters.preemptions += 1
        self._push_waiting(seq)

    def _schedule_running(self, budget: _Budget) -> list[ScheduledSeq]:
        scheduled: list[ScheduledSeq] = []
        self._running.sort(key=lambda s: s.sort_key)
        for seq in list(self._running):
            if not budget.left():
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted below, earlier in this loop
                continue
            num_new = min(seq.num_uncomputed, budget.tokens)
            while not self._reserve(seq, num_new):
                victim = self._running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                scheduled.append(ScheduledSeq(seq, seq.num_computed, num_new))
                budget.take(num_new)
        return scheduled

    def _schedule_waiting(self, budget: _Budget, now: float) -> list[ScheduledSeq]:
        scheduled: list[ScheduledSeq] = []
        while self._waiting and budget.left():
            _, seq = self._waiting[0]
            if seq.status is not SeqStatus.WAITING:  # finished while waiting (lazy removal)
                heapq.heappop(self._waiting)
                continue
            num_new = min(seq.num_uncomputed, budget.tokens)
            if not self._reserve(seq, num_new):
                break  # head of line does not fit: wait for blocks to free up
            heapq.heappop(self._waiting)
            seq.status = SeqStatus.RUNNING
            self._running.append(seq)
            if not seq.started:
                seq.started = True
                seq.first_scheduled_s = now
            scheduled.append(ScheduledSeq(seq, seq.num_computed, num_new))
            budget.take(num_new)
        return scheduled

    def _append_token(self, seq: Sequence, token_id: int | None) -> EngineOutput:
        assert token_id is not None, "runner returned no token for a completed generation chunk"
        seq.token_ids.append(token_id)
        sp = seq.request.sampling
        reason: FinishReason | None = None
        if (token_id == self.eos_token_id and not sp.ignore_eos) or token_id in sp.stop_token_ids:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            return self._finish(seq, reason)
        return self._emit(seq)

    def _finish_single_pass(self, seq: Sequence, result: SeqResult) -> EngineOutput:
        reason = (
            FinishReason.DONE if seq.request.kind != RequestKind.GENERATE else FinishReason.LENGTH
        )
        out = self._finish(seq, reason)
        out.embedding = result.embedding
        out.top_logprobs = result.top_logprobs
        return out

    def _emit(self, seq: Sequence, finished: bool = False) -> EngineOutput:
        new = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted :]
        seq.num_emitted += len(new)
        if new and seq.first_token_s is None:
            seq.first_token_s = self._now
        started = seq.first_scheduled_s
        return EngineOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            finished=finished,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            queue_s=(started - seq.request.arrival_s) if started is not None else 0.0,
            compute_s=max(0.0, self._now - started) if started is not None else 0.0,
            first_token_s=seq.first_token_s,
        )

    def _finish(
        self, seq: Sequence, reason: FinishReason, error: str | None = None
    ) -> EngineOutput:
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self._by_id[seq.request_id]
        if reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.DONE):
            self.counters.finished += 1
        out = self._emit(seq, finished=True)
        out.finish_reason = reason
        out.error = error
        return out


@dataclass
class _Budget:
    tokens: int
    seqs: int

    def left(self) -> bool:
        return self.tokens > 0 and self.seqs > 0

    def take(self, num_tokens: int) -> None:
        self.tokens -= num_tokens
        self.seqs -= 1


def _failed(request_id: str, code: EngineError, error: str) -> EngineOutput:
    return EngineOutput(
        request_id=request_id,
        finished=True,
        finish_reason=FinishReason.ERROR,
        error=error,
        error_code=code,
    )

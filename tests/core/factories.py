"""Small factories for scheduler tests: requests, a scheduler, and fake model results."""

from __future__ import annotations

from tailguard.core.block_pool import BlockPool
from tailguard.core.request import (
    EngineRequest,
    Priority,
    RequestKind,
    SamplingParams,
)
from tailguard.core.scheduler import Scheduler, SchedulerOutput, SeqResult

EOS = 2


def make_request(
    rid: str,
    prompt_len: int = 8,
    max_tokens: int = 4,
    kind: RequestKind = RequestKind.GENERATE,
    priority: Priority = Priority.BATCH,
    deadline_s: float = float("inf"),
    ignore_eos: bool = True,
) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=tuple(range(10, 10 + prompt_len)),
        kind=kind,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        priority=priority,
        deadline_s=deadline_s,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
) -> Scheduler:
    return Scheduler(
        pool=BlockPool(num_blocks, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_id=EOS,
    )


def fake_results(out: SchedulerOutput, token: int = 7) -> list[SeqResult]:
    """What a model would return: a token for completed generation chunks, pooled data else."""
    results = []
    for item in out.scheduled:
        if not item.completes:
            results.append(SeqResult())
        elif item.seq.is_single_pass:
            results.append(SeqResult(embedding=[0.5], top_logprobs=[(token, -0.1)]))
        else:
            results.append(SeqResult(token_id=token))
    return results

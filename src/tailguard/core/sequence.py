"""Scheduler-side state of one request. Pure Python, no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tailguard.core.request import EngineRequest, FinishReason, RequestKind


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    started: bool = False  # scheduled at least once: never expired after this
    first_scheduled_s: float | None = None  # monotonic
    first_token_s: float | None = None  # monotonic
    num_emitted: int = 0  # output tokens already sent to the client
    finish_reason: FinishReason | None = None
    order: int = 0  # arrival counter: FIFO tie-break

    @classmethod
    def from_request(cls, request: EngineRequest, order: int) -> Sequence:
        ids = list(request.prompt_token_ids)
        return cls(request=request, token_ids=ids, num_prompt_tokens=len(ids), order=order)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_single_pass(self) -> bool:
        return self.request.kind != RequestKind.GENERATE or self.request.sampling.max_tokens == 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: priority class, then earliest deadline, then arrival."""
        return (int(self.request.priority), self.request.deadline_s, self.order)

"""The dataclasses that cross the engine boundary (server -> engine client -> engine process).

Pure data, no torch: these are serialised with msgspec over the IPC channel. Times are
`time.monotonic()` seconds; on Linux that clock is shared by every process on the machine,
so a deadline set by the HTTP process means the same instant in the engine process.
"""

from __future__ import annotations

import enum

import msgspec


class RequestKind(enum.IntEnum):
    GENERATE = 0  # prefill, then decode until max_tokens / stop / EOS
    EMBED = 1  # single pass: pooled hidden state, finishes after prefill
    SCORE = 2  # single pass: top-k next-token log-probs (and/or embedding), finishes after prefill


class Priority(enum.IntEnum):
    INTERACTIVE = 0  # admitted and scheduled ahead of batch work
    BATCH = 1


class Pooling(enum.IntEnum):
    MEAN = 0  # mean of the final-norm hidden states over the prompt
    LAST = 1  # final-norm hidden state of the last prompt token


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS or a stop token
    LENGTH = 1  # max_tokens reached
    DONE = 2  # single-pass query completed
    ABORTED = 3  # cancelled by the caller (client disconnect, shutdown)
    EXPIRED = 4  # deadline passed before it ran; never executed
    ERROR = 5  # failed; EngineOutput.error_code says why, EngineOutput.error in words


class EngineError(enum.IntEnum):
    """Why a request failed (finish_reason ERROR). It crosses the IPC channel as an int; the
    server maps it to its HTTP error through one table (tailguard.server.errors), never by
    reading the message."""

    INTERNAL = 0  # a bug or an unexpected failure in the engine
    INVALID = 1  # the request cannot run on this engine (empty prompt, past the context)
    OUT_OF_MEMORY = 2  # does not fit even when run alone (KV pool or activations)


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 16  # new tokens to generate (GENERATE only)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # per-request RNG seed (deterministic sampling)
    stop_token_ids: tuple[int, ...] = ()  # besides EOS
    ignore_eos: bool = False


class EngineRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: tuple[int, ...]
    kind: RequestKind = RequestKind.GENERATE
    sampling: SamplingParams = SamplingParams()
    priority: Priority = Priority.BATCH
    deadline_s: float = float("inf")  # monotonic; dropped (EXPIRED) if not started by then
    arrival_s: float = 0.0  # monotonic; when the server received it
    pooling: Pooling = Pooling.MEAN  # EMBED / SCORE with want_embedding
    top_k: int = 0  # SCORE: how many next-token (id, logprob) pairs to return
    want_embedding: bool = False  # SCORE: also return the pooled embedding


class EngineOutput(msgspec.Struct):
    """One update for one request. Generation streams several; single-pass queries send one."""

    request_id: str
    new_token_ids: list[int] = []  # tokens produced since the previous output
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None  # human-readable, with the fix, when finish_reason is ERROR
    error_code: EngineError | None = None  # set when finish_reason is ERROR
    embedding: list[float] | None = None  # EMBED, or SCORE with want_embedding
    top_logprobs: list[tuple[int, float]] | None = None  # SCORE: (token id, log-prob), best first
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    queue_s: float = 0.0  # arrival -> first scheduled (set on the first output)
    compute_s: float = 0.0  # first scheduled -> this output
    first_token_s: float | None = None  # monotonic time the first new token was produced
    received_s: float = 0.0  # monotonic: when the HTTP process read it (set by the engine client)

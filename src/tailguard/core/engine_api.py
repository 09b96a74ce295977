"""What the HTTP server needs from an engine: the protocol the real engine client
(`tailguard.engine.client.EngineClient`, model in a separate process), the instant stub of the
front-end benchmarks (`tailguard.server.stub.StubEngineClient`) and the simulated engine of the
server tests (`tailguard.server.simulated.SimulatedEngineClient`) implement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tailguard.core.request import EngineOutput, EngineRequest
from tailguard.core.stats import EngineStats


class EngineStream(Protocol):
    """One submitted request's outputs: an async iterator that can be closed early."""

    def __aiter__(self) -> EngineStream: ...

    async def __anext__(self) -> EngineOutput: ...

    async def aclose(self) -> None:
        """Stop reading: a request not finished yet is aborted in the engine."""


class EngineClientProtocol(Protocol):
    on_output: Callable[[EngineOutput], None] | None
    """Called with every engine output the moment the client reads it, before any handler sees
    it, with `received_s` set: the admission ledger follows the engine through it, so a handler
    that is slow to consume its outputs (a client that stops reading) changes nothing there."""

    async def start(self) -> None:
        """Start the engine (process) and return once it is warmed up and ready."""

    async def close(self) -> None:
        """Stop the engine; in-flight requests finish with EngineUnavailableError."""

    def submit(self, request: EngineRequest) -> EngineStream:
        """Submit one request and iterate its outputs until one has finished=True.

        Closing the iterator early (client disconnect, cancellation) aborts the request in the
        engine and returns its KV blocks. Raises tailguard.errors.EngineUnavailableError if the
        engine process dies while the request is in flight.
        """
        ...

    async def run(self, request: EngineRequest) -> EngineOutput:
        """A single-pass request (score or embed): its one, final output.

        The hot path of /v1/infer: one future instead of a queue and a stream.
        Cancelling the await aborts the request in the engine. A failed request returns its
        final output with the failure's finish_reason; a dead engine raises
        EngineUnavailableError.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Cancel a request at any point; its blocks return to the pool."""

    @property
    def stats(self) -> EngineStats:
        """Latest snapshot published by the engine (plain data). Its `recent_steps` are the
        steps since the previous read: each step record is handed over once."""
        ...

    @property
    def ready(self) -> bool:
        """True when the engine process is alive and warm-up is done."""
        ...

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output the engine accepts, as it reports once started (0 before):
        the server checks requests against this figure, never one of its own."""
        ...

    @property
    def restarts(self) -> int:
        """Engine process restarts so far (bounded; see EngineConfig.max_restarts)."""
        ...

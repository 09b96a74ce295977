"""Errors on their way to the client: engine failures -> errors -> HTTP answers.

`engine_error` turns a failed engine output into its error through one table keyed by the
output's typed finish reason and error code (tailguard.core.request.EngineError): nothing
reads the engine's message to decide. `error_answer` is the one place that maps an error to an
HTTP answer: every TailguardError subclass already knows its status and metric label
(tailguard.errors); this adds the headers (Retry-After for every RetryLaterError, Allow for
405, WWW-Authenticate for 401, Connection: close for 413) and turns anything else into a 500
that does not leak internals.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from tailguard.core.admission import retry_after_header
from tailguard.core.request import EngineError, EngineOutput, FinishReason
from tailguard.errors import (
    DeadlineExpiredError,
    EngineUnavailableError,
    InvalidRequestError,
    OutOfMemoryRequestError,
    PayloadTooLargeError,
    RetryLaterError,
    TailguardError,
    UnauthorizedError,
)

__all__ = ["ErrorAnswer", "engine_error", "error_answer"]

# What a failed engine output becomes: its error class and the message when the engine gave none.
ENGINE_ERRORS: dict[FinishReason | EngineError, tuple[type[TailguardError], str]] = {
    FinishReason.EXPIRED: (
        DeadlineExpiredError,
        "the request waited past its deadline and was never executed; retry later or allow a "
        "longer deadline (X-Request-Timeout-Ms)",
    ),
    FinishReason.ABORTED: (
        EngineUnavailableError,
        "the engine aborted the request (shutting down?); retry",
    ),
    EngineError.INTERNAL: (TailguardError, "engine error"),
    EngineError.INVALID: (InvalidRequestError, "the engine refused the request"),
    EngineError.OUT_OF_MEMORY: (
        OutOfMemoryRequestError,
        "the request does not fit in the engine's memory even when run alone",
    ),
}
_SUCCESS = frozenset({FinishReason.STOP, FinishReason.LENGTH, FinishReason.DONE})


def engine_error(out: EngineOutput) -> TailguardError | None:
    """The error a finished engine output carries, or None when it succeeded (or is not
    finished yet)."""
    reason = out.finish_reason
    if reason is None or reason in _SUCCESS:
        return None
    key: FinishReason | EngineError = reason
    if reason == FinishReason.ERROR:
        key = out.error_code if out.error_code is not None else EngineError.INTERNAL
    cls, default = ENGINE_ERRORS[key]
    return cls(out.error or default)


@dataclass(frozen=True)
class ErrorAnswer:
    status: int
    body: bytes  # {"error": {...}} as JSON
    headers: list[tuple[bytes, bytes]]
    label: str  # outcome / rejection reason for the metrics


def error_answer(exc: BaseException, *, allow: str | None = None) -> ErrorAnswer:
    if not isinstance(exc, TailguardError):
        exc = TailguardError(
            f"internal error ({type(exc).__name__}); the server logged the details"
        )
    headers: list[tuple[bytes, bytes]] = []
    if isinstance(exc, RetryLaterError):  # its body says retry_after_s (RetryLaterError.to_dict)
        headers.append((b"retry-after", retry_after_header(exc.retry_after_s).encode()))
    if isinstance(exc, PayloadTooLargeError):
        headers.append((b"connection", b"close"))  # do not wait for the rest of a huge body
    if isinstance(exc, UnauthorizedError):
        headers.append((b"www-authenticate", b'Bearer realm="tailguard"'))  # RFC 6750 3
    if exc.status == 405 and allow:
        headers.append((b"allow", allow.encode()))
    return ErrorAnswer(exc.status, orjson.dumps(exc.to_dict()), headers, exc.label)

"""The one place that maps an error to an HTTP answer: status, OpenAI-shaped body, headers, label.

Every TailguardError subclass already knows its status and metric label (tailguard.errors); this
module adds the headers (Retry-After for 429/503, Allow for 405, WWW-Authenticate for 401,
Connection: close for 413) and turns anything else into a 500 that does not leak internals.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from tailguard.core.admission import retry_after_header
from tailguard.errors import (
    EngineUnavailableError,
    OverloadedError,
    PayloadTooLargeError,
    QuotaExceededError,
    TailguardError,
    UnauthorizedError,
)

__all__ = ["ErrorAnswer", "error_answer"]


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
    body = exc.to_dict()
    retry = getattr(exc, "retry_after_s", None)
    if isinstance(exc, OverloadedError | QuotaExceededError | EngineUnavailableError):
        assert retry is not None
        headers.append((b"retry-after", retry_after_header(retry).encode()))
        body["error"]["retry_after_s"] = round(retry, 3)  # type: ignore[index]
    if isinstance(exc, PayloadTooLargeError):
        headers.append((b"connection", b"close"))  # do not wait for the rest of a huge body
    if isinstance(exc, UnauthorizedError):
        headers.append((b"www-authenticate", b'Bearer realm="tailguard"'))  # RFC 6750 3
    if exc.status == 405 and allow:
        headers.append((b"allow", allow.encode()))
    return ErrorAnswer(exc.status, orjson.dumps(body), headers, exc.label)

"""One error hierarchy; each error knows its HTTP status and its metric label.

TailguardError                 500 internal
├── ConfigError                (start-up only; never reaches HTTP)
├── ModelLoadError             (start-up only) names the file or field that is wrong
├── InvalidRequestError        400 invalid        names the field and the fix
│   ├── ContextLengthError     400 invalid        prompt + max_tokens vs the model's context
│   ├── RequestTimeoutError    408 invalid        request head or body not read in time
│   ├── PayloadTooLargeError   413 invalid
│   ├── UriTooLongError        414 invalid        request target over max_url_bytes
│   ├── HeadersTooLargeError   431 invalid        request head over max_header_bytes / count
│   ├── UnsupportedFramingError 501 invalid       a transfer coding other than chunked
│   └── HttpVersionError       505 invalid        a version other than HTTP/1.0 and 1.1
├── UnauthorizedError          401 unauthorized
├── NotFoundError              404 not_found      (unknown model, unknown route)
├── MethodNotAllowedError      405 invalid
├── QuotaExceededError         429 quota          a client over its own quota
├── OverloadedError            503 overloaded     carries retry_after_s
├── EngineUnavailableError     503 engine_down    engine process died or not ready
├── DeadlineExpiredError       504 expired        queued past its deadline, never executed
└── OutOfMemoryRequestError    507 oom            a request that cannot fit even alone
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ContextLengthError",
    "DeadlineExpiredError",
    "EngineUnavailableError",
    "HeadersTooLargeError",
    "HttpVersionError",
    "InvalidRequestError",
    "MethodNotAllowedError",
    "ModelLoadError",
    "NotFoundError",
    "OutOfMemoryRequestError",
    "OverloadedError",
    "PayloadTooLargeError",
    "QuotaExceededError",
    "RequestTimeoutError",
    "RetryLaterError",
    "TailguardError",
    "UnauthorizedError",
    "UnsupportedFramingError",
    "UriTooLongError",
]


class TailguardError(Exception):
    """Base of every tailguard error."""

    status: int = 500
    label: str = "internal"  # metric label: tailguard_rejections_total{reason=...}
    error_type: str = "internal_error"  # OpenAI error.type

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_dict(self) -> dict[str, object]:
        """OpenAI-shaped error body."""
        err: dict[str, object] = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.label,
        }
        return {"error": err}


class ConfigError(TailguardError):
    label = "config"
    error_type = "config_error"


class ModelLoadError(TailguardError):
    label = "model_load"
    error_type = "model_load_error"


class InvalidRequestError(TailguardError):
    status = 400
    label = "invalid"
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    pass


class PayloadTooLargeError(InvalidRequestError):
    status = 413


class RequestTimeoutError(InvalidRequestError):
    status = 408


class UriTooLongError(InvalidRequestError):
    status = 414


class HeadersTooLargeError(InvalidRequestError):
    status = 431


class UnsupportedFramingError(InvalidRequestError):
    """Something the request's framing needs that the server does not do (HTTP 501)."""

    status = 501


class HttpVersionError(InvalidRequestError):
    status = 505


class UnauthorizedError(TailguardError):
    status = 401
    label = "unauthorized"
    error_type = "authentication_error"


class NotFoundError(TailguardError):
    status = 404
    label = "not_found"
    error_type = "not_found_error"


class MethodNotAllowedError(TailguardError):
    status = 405
    label = "invalid"
    error_type = "invalid_request_error"


class RetryLaterError(TailguardError):
    """An error that tells the client when to come back (HTTP `Retry-After`)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, object]:
        body = super().to_dict()
        body["error"]["retry_after_s"] = round(self.retry_after_s, 3)  # type: ignore[index]
        return body


class QuotaExceededError(RetryLaterError):
    status = 429
    label = "quota"
    error_type = "rate_limit_exceeded"


class OverloadedError(RetryLaterError):
    status = 503
    label = "overloaded"
    error_type = "overloaded"


class EngineUnavailableError(RetryLaterError):
    status = 503
    label = "engine_down"
    error_type = "engine_unavailable"


class DeadlineExpiredError(TailguardError):
    status = 504
    label = "expired"
    error_type = "deadline_expired"


class OutOfMemoryRequestError(TailguardError):
    status = 507
    label = "oom"
    error_type = "out_of_memory"

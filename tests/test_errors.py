"""The error hierarchy: every error knows its HTTP status and metric label; __all__ is complete."""

from __future__ import annotations

import inspect

import tailguard.errors as errors


def test_all_lists_every_public_error() -> None:
    public = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, Exception) and not name.startswith("_")
    }
    assert set(errors.__all__) == public


def test_statuses_and_labels() -> None:
    table = {
        errors.InvalidRequestError: (400, "invalid"),
        errors.ContextLengthError: (400, "invalid"),
        errors.PayloadTooLargeError: (413, "invalid"),
        errors.RequestTimeoutError: (408, "invalid"),
        errors.UriTooLongError: (414, "invalid"),
        errors.HeadersTooLargeError: (431, "invalid"),
        errors.UnsupportedFramingError: (501, "invalid"),
        errors.HttpVersionError: (505, "invalid"),
        errors.UnauthorizedError: (401, "unauthorized"),
        errors.NotFoundError: (404, "not_found"),
        errors.MethodNotAllowedError: (405, "invalid"),
        errors.QuotaExceededError: (429, "quota"),
        errors.OverloadedError: (503, "overloaded"),
        errors.EngineUnavailableError: (503, "engine_down"),
        errors.DeadlineExpiredError: (504, "expired"),
        errors.OutOfMemoryRequestError: (507, "oom"),
    }
    for cls, (status, label) in table.items():
        assert (cls.status, cls.label) == (status, label), cls.__name__


def test_retry_later_errors_carry_retry_after_in_the_openai_body() -> None:
    body = errors.OverloadedError("too much work queued", retry_after_s=2.5).to_dict()
    assert body == {
        "error": {
            "message": "too much work queued",
            "type": "overloaded",
            "param": None,
            "code": "overloaded",
            "retry_after_s": 2.5,
        }
    }
    assert errors.EngineUnavailableError("down").retry_after_s == 1.0
    assert issubclass(errors.QuotaExceededError, errors.RetryLaterError)

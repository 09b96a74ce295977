"""Engine failures -> errors -> HTTP answers (tailguard.server.errors)."""

from __future__ import annotations

import orjson
import pytest

from tailguard.core.request import EngineError, EngineOutput, FinishReason
from tailguard.errors import (
    DeadlineExpiredError,
    EngineUnavailableError,
    InvalidRequestError,
    OutOfMemoryRequestError,
    OverloadedError,
    QuotaExceededError,
    RetryLaterError,
    TailguardError,
)
from tailguard.server.errors import ENGINE_ERRORS, engine_error, error_answer


def _failed(reason: FinishReason, code: EngineError | None = None, msg: str | None = None):
    return EngineOutput("r", finished=True, finish_reason=reason, error=msg, error_code=code)


def test_every_failure_kind_has_an_entry() -> None:
    failures = set(FinishReason) - {FinishReason.STOP, FinishReason.LENGTH, FinishReason.DONE}
    assert set(ENGINE_ERRORS) == (failures - {FinishReason.ERROR}) | set(EngineError)


@pytest.mark.parametrize(
    ("reason", "code", "cls"),
    [
        (FinishReason.EXPIRED, None, DeadlineExpiredError),
        (FinishReason.ABORTED, None, EngineUnavailableError),
        (FinishReason.ERROR, EngineError.OUT_OF_MEMORY, OutOfMemoryRequestError),
        (FinishReason.ERROR, EngineError.INVALID, InvalidRequestError),
        (FinishReason.ERROR, EngineError.INTERNAL, TailguardError),
        (FinishReason.ERROR, None, TailguardError),  # an engine that names no code: a 500
    ],
)
def test_the_code_decides_not_the_message(
    reason: FinishReason, code: EngineError | None, cls: type[TailguardError]
) -> None:
    # the message says "memory" whatever the code: only the code may decide the status
    err = engine_error(_failed(reason, code, "something about memory"))
    assert type(err) is cls and err.message == "something about memory"


def test_default_message_when_the_engine_gives_none() -> None:
    err = engine_error(_failed(FinishReason.EXPIRED))
    assert isinstance(err, DeadlineExpiredError) and "X-Request-Timeout-Ms" in err.message


@pytest.mark.parametrize("reason", [FinishReason.STOP, FinishReason.LENGTH, FinishReason.DONE])
def test_success_is_no_error(reason: FinishReason) -> None:
    assert engine_error(_failed(reason)) is None
    assert engine_error(EngineOutput("r", new_token_ids=[5])) is None


@pytest.mark.parametrize(
    "exc",
    [
        OverloadedError("busy", retry_after_s=2.345678),
        QuotaExceededError("slow down", retry_after_s=2.345678),
        EngineUnavailableError("down", retry_after_s=2.345678),
    ],
)
def test_retry_after_in_header_and_body_from_one_value(exc: RetryLaterError) -> None:
    ans = error_answer(exc)
    assert dict(ans.headers)[b"retry-after"] == b"3"  # whole seconds, rounded up
    assert orjson.loads(ans.body)["error"]["retry_after_s"] == 2.346


def test_other_errors_have_no_retry_after() -> None:
    ans = error_answer(OutOfMemoryRequestError("too big"))
    assert ans.status == 507 and b"retry-after" not in dict(ans.headers)
    assert "retry_after_s" not in orjson.loads(ans.body)["error"]


def test_unexpected_exceptions_do_not_leak() -> None:
    ans = error_answer(KeyError("secret internals"))
    assert ans.status == 500 and b"secret" not in ans.body

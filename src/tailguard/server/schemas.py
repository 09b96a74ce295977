"""Request bodies (msgspec structs: decoding and validation in one C pass) and their OpenAPI.

A decode error names the field and the problem ("Expected `int` >= 1, got `0` - at
`$.max_tokens`"); `decode()` turns it into an InvalidRequestError with `param` set.
Unknown fields are ignored, as OpenAI clients send extras (`stream_options`, `logprobs`, ...).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from tailguard.errors import InvalidRequestError

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "InferRequest",
    "decode",
    "openapi_document",
]

PriorityName = Literal["interactive", "batch"]
Timeout = Annotated[float, Meta(gt=0, description="deadline in seconds (capped by config)")]
MaxTokens = Annotated[int, Meta(ge=1, le=1_000_000)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
# Bounded so that no client number overflows a 64-bit field downstream (cache keys, the
# engine's sampler): a value out of range is a 400 naming the field, never a 500.
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    timeout: Timeout | None = None
    priority: PriorityName | None = None
    user: str | None = None


class _Sampling(_Common, kw_only=True):
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stop: str | list[str] | None = None
    seed: Seed | None = None
    n: Annotated[int, Meta(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens (benchmark clients)


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | Annotated[list[TokenId], Meta(min_length=1)]


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None


class EmbeddingRequest(_Common, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; msgspec unions allow one array type, so the
    # list forms are checked in `inputs()`.
    input: str | Annotated[list[Any], Meta(min_length=1, max_length=2048)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in self.input):
            return [list(self.input)]
        out: list[str | list[int]] = []
        for i, x in enumerate(self.input):
            if isinstance(x, str):
                out.append(x)
            elif (
                isinstance(x, list)
                and x
                and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
            ):
                out.append(list(x))
            else:
                raise InvalidRequestError(
                    f"input[{i}]: expected a string or a non-empty list of token ids",
                    param="input",
                )
        return out


class InferRequest(_Common, kw_only=True):
    """The runbook's single-pass query: one forward pass, no generation."""

    prompt: str | None = None
    input_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=100)] = 5
    embedding: bool = False
    pooling: Literal["mean", "last"] = "mean"


T = TypeVar("T")
_PATH = re.compile(r"at `\$\.?([A-Za-z_][A-Za-z0-9_]*)")
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def decode(body: bytes, cls: type[T]) -> T:
    """Parse and validate a JSON body; errors say what is wrong and where."""
    dec = _decoders.get(cls)
    if dec is None:
        dec = _decoders[cls] = msgspec.json.Decoder(cls)
    try:
        return dec.decode(body)
    except msgspec.ValidationError as e:
        m = _PATH.search(str(e))
        raise InvalidRequestError(
            f"invalid request body: {e}", param=m.group(1) if m else None
        ) from None
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"malformed JSON body: {e}") from None
    except RecursionError:  # msgspec recurses per nesting level, even into ignored fields
        raise InvalidRequestError(
            "malformed JSON body: nested too deeply; send at most a few levels of arrays and "
            "objects"
        ) from None


def openapi_document(model_name: str) -> dict[str, Any]:
    """OpenAPI 3.1 for the endpoints (schemas generated from the structs above)."""
    structs = [CompletionRequest, ChatRequest, EmbeddingRequest, InferRequest]
    (refs, components) = msgspec.json.schema_components(
        structs, ref_template="#/components/schemas/{name}"
    )
    error = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                    "retry_after_s": {"type": "number"},
                },
                "required": ["message", "type"],
            }
        },
        "required": ["error"],
    }
    components["Error"] = error
    err_ref = {"$ref": "#/components/schemas/Error"}

    def errors(*codes: int) -> dict[str, Any]:
        return {
            str(c): {"description": "error", "content": {"application/json": {"schema": err_ref}}}
            for c in codes
        }

    def post(ref: dict[str, Any], summary: str) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
                "responses": {
                    "200": {"description": "ok", "content": {"application/json": {"schema": {}}}},
                    **errors(400, 401, 404, 413, 429, 503, 504, 507),
                },
            }
        }

    def get(summary: str) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": {"description": "ok"}}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "tailguard", "version": "0.1.0", "description": f"serving {model_name}"},
        "paths": {
            "/v1/completions": post(refs[0], "text completion (SSE when stream=true)"),
            "/v1/chat/completions": post(refs[1], "chat completion (SSE when stream=true)"),
            "/v1/embeddings": post(refs[2], "embeddings (OpenAI shape)"),
            "/v1/infer": post(refs[3], "single-pass query: top-k next tokens and/or embedding"),
            "/v1/models": get("served models"),
            "/health": get("process alive"),
            "/ready": get("200 when the engine is warm and alive, else 503"),
            "/metrics": get("Prometheus text format"),
        },
        "components": {"schemas": components},
    }

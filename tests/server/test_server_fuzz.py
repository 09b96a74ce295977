"""Schema-driven fuzzing: no body, however malformed, crashes or wedges the server.

Hypothesis builds bodies from the request schemas (valid, nearly valid and garbage) and sends
them in-process to every POST endpoint; every answer must be a known status with an
OpenAI-shaped error, and the server must still answer a normal request afterwards.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.server.inproc import request, running_app

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/infer"]
ALLOWED = {200, 400, 404, 413, 503, 504}


def _dump(v: Any) -> bytes:
    # stdlib json: big integers and NaN/Infinity (not valid JSON) go through as written
    return json.dumps(v, default=str).encode()


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=40),
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model",
    "prompt",
    "input_ids",
    "input",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "n",
    "stream",
    "timeout",
    "priority",
    "top_k",
    "embedding",
    "pooling",
    "encoding_format",
    "max_completion_tokens",
]
valid_like = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 300), max_size=6)),
        "input_ids": st.lists(st.integers(-5, 300), max_size=6),
        "input": st.one_of(st.text(max_size=20), st.lists(json_values, max_size=3)),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "bot"]),
                    "content": st.one_of(st.text(max_size=20), json_values),
                }
            ),
            max_size=3,
        ),
        "max_tokens": st.one_of(st.integers(-3, 6000), json_values),
        "temperature": st.one_of(st.floats(-1, 3), json_values),
        "top_k": st.integers(-2, 200),
        "stream": st.booleans(),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
        "model": st.sampled_from(["tailguard-embedded", "other", ""]),
        "timeout": st.one_of(st.floats(-1, 5), json_values),
        "priority": st.sampled_from(["interactive", "batch", "urgent"]),
        "embedding": st.booleans(),
    },
)
bodies = st.one_of(
    valid_like.map(_dump),
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(_dump),
    st.binary(max_size=64),
    json_values.map(_dump),  # not an object at all
)


def test_fuzzed_bodies_get_well_formed_answers() -> None:
    # One server for all examples: it must survive every input in sequence, not just one.
    loop = asyncio.new_event_loop()
    ctx = running_app(simulated_tokens_per_s=1e6, simulated_step_overhead_ms=0)
    app = loop.run_until_complete(ctx.__aenter__())
    try:

        @settings(
            max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(
            endpoint=st.sampled_from(ENDPOINTS),
            body=bodies,
            headers=st.dictionaries(
                st.sampled_from(
                    ["X-Priority", "X-Request-Timeout-Ms", "Cache-Control", "Content-Length"]
                ),
                st.text(alphabet="abcdefgh-0123456789.", max_size=6),
                max_size=2,
            ),
        )
        def one(endpoint: str, body: bytes, headers: dict[str, str]) -> None:
            loop.run_until_complete(_one(app, endpoint, body, headers))

        one()
        ok = loop.run_until_complete(
            request(app, "POST", "/v1/infer", {"prompt": "still alive?", "top_k": 1})
        )
        assert ok.status == 200
        assert app.admission.queued_requests == 0  # nothing leaked in the ledger
    finally:
        loop.run_until_complete(ctx.__aexit__(None, None, None))
        loop.close()


async def _one(app: Any, endpoint: str, body: bytes, headers: dict[str, str]) -> None:
    r = await asyncio.wait_for(request(app, "POST", endpoint, body, headers), timeout=5)
    assert r.status in ALLOWED, (r.status, r.body)
    if r.status != 200:
        err = orjson.loads(r.body)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] != "internal_error", err

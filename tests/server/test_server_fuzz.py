"""Schema-driven fuzzing: no body, however malformed, crashes or wedges the server.

Hypothesis builds bodies from the request schemas (valid, nearly valid and garbage) and sends
them in-process to every POST endpoint; every answer must be a known status with an
OpenAI-shaped error, and the server must still answer a normal request afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
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


raw_requests = st.one_of(
    st.binary(max_size=200),  # garbage
    st.builds(  # request-shaped, with mangled parts
        lambda method, path, version, headers, body: (
            f"{method} {path} {version}\r\n".encode()
            + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
            + b"\r\n"
            + body
        ),
        st.sampled_from(["GET", "POST", "PUT", "HEAD", "G\x00T", ""]),
        st.sampled_from(["/v1/infer", "/health", "/x?y=%zz", "/%2e%2e/", "*", ""]),
        st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/9", ""]),
        st.lists(
            st.tuples(
                st.sampled_from(
                    [b"Content-Length", b"Transfer-Encoding", b"Expect", b"Connection", b"Upgrade"]
                ),
                st.sampled_from([b"5", b"-1", b"999999999999", b"chunked", b"100-continue", b"x"]),
            ),
            max_size=3,
        ),
        st.binary(max_size=40),
    ),
)


def test_fuzzed_raw_http_never_wedges_the_server() -> None:
    """Garbage and mangled HTTP over real sockets, split at random points: every connection ends
    (answered or closed), and the server still answers a normal request afterwards."""
    from tests.server.test_server_http import http_app, read_answers

    loop = asyncio.new_event_loop()
    ctx = http_app(keepalive_timeout_s=1, max_body_bytes=4096)
    _app, port = loop.run_until_complete(ctx.__aenter__())

    async def send(data: bytes, cut: int) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(data[:cut])
        await asyncio.sleep(0)
        w.write(data[cut:])
        with contextlib.suppress(ConnectionError):
            w.write_eof()
            async with asyncio.timeout(5):  # answered and/or closed, never left hanging
                while await r.read(65536):
                    pass
        w.close()

    try:

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(data=raw_requests, cut=st.integers(0, 200))
        def one(data: bytes, cut: int) -> None:
            loop.run_until_complete(send(data, cut))

        one()

        async def healthy() -> int:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            (a,), _ = await read_answers(r, 1)
            w.close()
            return a.status

        assert loop.run_until_complete(healthy()) == 200
    finally:
        loop.run_until_complete(ctx.__aexit__(None, None, None))
        loop.close()

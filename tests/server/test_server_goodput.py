"""Goodput-first admission over real sockets: the server refuses only what would be late.

In-process server (our HTTP layer on a real loopback socket) with the simulated engine, which
runs its steps on the same event loop; every request below would meet its deadline, so every
one must be admitted.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import orjson
from tests.server.inproc import until
from tests.server.test_server_http import http_app


def _stalled_stream(port: int, max_tokens: int) -> socket.socket:
    """Open a streaming completion and never read it (a tiny receive window, so the server's
    writes back up at once)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect(("127.0.0.1", port))
    body = orjson.dumps(
        {"prompt": "stall", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    )
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    return s


async def test_a_stream_nobody_reads_never_makes_other_requests_look_late() -> None:
    async with http_app(simulated_tokens_per_s=50_000.0) as (app, port):
        stalled = _stalled_stream(port, max_tokens=4000)
        try:
            # wait until its handler is stuck behind a full socket while the engine goes on
            sched = app.engine.scheduler  # type: ignore[attr-defined]

            def stalled_seq() -> Any:
                return next((q for q in sched._by_id.values() if q.num_output_tokens > 1000), None)

            await until(lambda: stalled_seq() is not None, 10.0)
            seq = stalled_seq()
            # the ledger followed the engine, not the handler stuck behind the socket
            assert app.admission.queued_tokens == 4000 - seq.num_output_tokens
            url = f"http://127.0.0.1:{port}/v1/completions"
            async with aiohttp.ClientSession() as s:

                async def one(i: int) -> int:
                    async with s.post(url, json={"prompt": f"p{i}", "max_tokens": 2}) as r:
                        await r.read()
                        return r.status

                codes = [await one(i) for i in range(20)]
            assert codes == [200] * 20
        finally:
            stalled.close()


async def test_64_concurrent_generations_with_a_60_s_deadline_are_all_admitted() -> None:
    async with http_app(simulated_tokens_per_s=20_000.0) as (_app, port):
        url = f"http://127.0.0.1:{port}/v1/completions"
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:

            async def client(c: int) -> list[int]:
                codes = []
                for i in range(4):
                    body = {"prompt": f"c{c} r{i} " * 8, "max_tokens": 16, "stream": True}
                    hdrs = {"X-Request-Timeout-Ms": "60000"}
                    async with s.post(url, json=body, headers=hdrs) as r:
                        await r.read()
                        codes.append(r.status)
                return codes

            codes = [c for cs in await asyncio.gather(*(client(c) for c in range(64))) for c in cs]
        assert codes.count(200) == len(codes) == 256


async def test_an_idle_server_admits_every_kind_at_once() -> None:
    async with http_app() as (_app, port):
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            for path, body in (
                ("/v1/infer", {"prompt": "the quick brown fox " * 20, "top_k": 1}),
                ("/v1/completions", {"prompt": "hi " * 50, "max_tokens": 4}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                ("/v1/embeddings", {"input": ["a b c " * 30]}),
            ):
                async with s.post(base + path, json=body) as r:
                    assert r.status == 200, (path, await r.text())

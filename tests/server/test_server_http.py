"""The HTTP/1.1 layer (tailguard.server.http) over real sockets, in-process: framing, keep-alive,
pipelining, body limits, 100-continue, malformed input, disconnects, graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httptools
import orjson
import pytest
from tests.server.inproc import running_app

from tailguard.deploy.tls import self_signed_cert
from tailguard.server.app import App
from tailguard.server.serving import bind, start_server, stop_server


@contextlib.asynccontextmanager
async def http_app(**kw: Any) -> AsyncIterator[tuple[App, int]]:
    async with running_app(**kw) as app:
        sock = bind("127.0.0.1", 0, 128)
        port = sock.getsockname()[1]
        http, server, sweeper = await start_server(app, sock)
        try:
            yield app, port
        finally:
            await stop_server(http, server, sweeper, grace_s=1.0)


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.complete = False

    def json(self) -> Any:
        return orjson.loads(self.body)


class _Collector:
    """httptools response-parser callbacks: every complete response on a connection."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.answers.append(Answer())

    def on_header(self, name: bytes, value: bytes) -> None:
        self.answers[-1].headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.answers[-1].status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.answers[-1].body += body

    def on_message_complete(self) -> None:
        self.answers[-1].complete = True


async def read_answers(
    reader: asyncio.StreamReader, n: int, timeout_s: float = 5.0
) -> tuple[list[Answer], bool]:
    """Read until `n` complete answers arrived (or the server closed); (answers, closed)."""
    col = _Collector()
    closed = False
    async with asyncio.timeout(timeout_s):
        while sum(a.complete for a in col.answers) < n:
            data = await reader.read(65536)
            if not data:
                closed = True
                break
            col.parser.feed_data(data)
    return [a for a in col.answers if a.complete], closed


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


INFER = orjson.dumps({"prompt": "hello there", "top_k": 2})


async def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async with http_app() as (_app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(post("/v1/infer", INFER) + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n" * 2)
        w.write(post("/v1/infer", b"{"))
        answers, closed = await read_answers(r, 4)
        assert [a.status for a in answers] == [200, 200, 200, 400]
        assert answers[0].json()["object"] == "inference"
        assert answers[1].json() == {"status": "ok"}
        assert "malformed JSON" in answers[3].json()["error"]["message"]
        assert not closed and "date" in answers[0].headers
        w.close()


GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
STREAM = orjson.dumps({"prompt": "hi", "max_tokens": 8, "stream": True})
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@pytest.mark.parametrize(
    ("refused", "status"),
    [
        (b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * 40_000 + b"\r\n\r\n", 431),
        (b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", 414),
        (b"THIS IS NOT HTTP\r\n\r\n", 400),
        (b"GET /health HTTP/2.0\r\nHost: t\r\n\r\n", 505),
        (b"POST /v1/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n", 413),
    ],
    ids=["431", "414", "400", "505", "413"],
)
async def test_a_refused_pipelined_request_gets_its_own_answer_after_those_before_it(
    refused: bytes, status: int
) -> None:
    """A stream is being answered and a request waits behind it when a refused one is read:
    all three are answered, in order, then the connection closes."""
    async with http_app(max_body_bytes=4096, simulated_tokens_per_s=200.0) as (_app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(post("/v1/completions", STREAM) + GET_HEALTH + refused)
        answers, _ = await read_answers(r, 3)
        assert [a.status for a in answers] == [200, 200, status]
        assert (
            answers[0].body.endswith(b"data: [DONE]\n\n") and "connection" not in answers[0].headers
        )
        assert answers[1].json() == {"status": "ok"}
        assert answers[2].headers["connection"] == "close" and "error" in answers[2].json()
        async with asyncio.timeout(3):
            assert await r.read() == b""  # then the server ends the connection
        w.close()


async def test_100_continue_for_a_pipelined_request_waits_for_the_answers_before_it() -> None:
    """The interim answer goes out after the stream before it (never inside its bytes), and the
    body timeout starts then: the client sends its body only once it is asked to."""
    slow = orjson.dumps(
        {"prompt": "hi", "max_tokens": 20, "stream": True, "ignore_eos": True, "timeout": 30}
    )  # ~4 s at 5 tokens/s: longer than the body timeout
    async with http_app(simulated_tokens_per_s=5.0, body_timeout_s=3.0) as (_app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        # (a long deadline: the slow stream must not make admission refuse it)
        extra = "Expect: 100-continue\r\nX-Request-Timeout-Ms: 20000\r\n"
        head = post("/v1/infer", INFER, extra)[: -len(INFER)]
        w.write(post("/v1/completions", slow) + head)
        data = b""
        async with asyncio.timeout(15):
            while CONTINUE not in data:
                chunk = await r.read(65536)
                assert chunk, data
                data += chunk
        assert data.startswith(b"HTTP/1.1 200 OK\r\n")
        assert data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n" + CONTINUE)
        await asyncio.sleep(1.2)  # past the head's body deadline, within the new one
        w.write(INFER)
        (a,), closed = await read_answers(r, 1)
        assert a.status == 200 and a.json()["object"] == "inference" and not closed, a.body
        w.close()


async def test_chunked_request_body_is_read_whole() -> None:
    async with http_app() as (_app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        half = len(INFER) // 2
        w.write(
            b"POST /v1/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n" % (half, INFER[:half])
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(INFER) - half, INFER[half:])
        )
        (a,), _ = await read_answers(r, 1)
        assert a.status == 200 and a.json()["usage"]["prompt_tokens"] > 1
        w.close()


async def test_too_large_content_length_is_413_before_the_body_is_sent() -> None:
    async with http_app(max_body_bytes=4096) as (app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /v1/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n")
        (a,), _ = await read_answers(r, 1)  # answered without a single body byte sent
        assert a.status == 413 and a.headers["connection"] == "close"
        msg = a.json()["error"]["message"]
        assert "100000" in msg and "4096" in msg and "max_body_bytes" in msg
        assert await r.read() == b""  # and the connection is closed
        w.close()
        assert 'tailguard_rejections_total{reason="invalid"} 1.0' in app.metrics.render().decode()


async def test_chunked_body_over_the_limit_is_413() -> None:
    async with http_app(max_body_bytes=4096) as (_app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /v1/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            w.write(b"800\r\n" + b"x" * 0x800 + b"\r\n")
        answers, _closed = await read_answers(r, 1)
        assert answers[0].status == 413
        w.close()


async def test_expect_100_continue_gets_continue_then_the_answer() -> None:
    async with http_app() as (_app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        head = post("/v1/infer", INFER, "Expect: 100-continue\r\n")[: -len(INFER)]
        w.write(head)
        line = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        assert line == b"HTTP/1.1 100 Continue\r\n\r\n"
        w.write(INFER)
        (a,), _ = await read_answers(r, 1)
        assert a.status == 200
        w.close()


async def test_malformed_http_is_400_in_openai_shape_and_closes() -> None:
    async with http_app() as (_app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"THIS IS NOT HTTP\r\n\r\n")
        answers, _closed = await read_answers(r, 1)
        assert answers[0].status == 400
        assert "malformed HTTP request" in answers[0].json()["error"]["message"]
        assert await r.read() == b""
        w.close()


async def test_http10_without_keepalive_is_closed_after_the_answer() -> None:
    async with http_app() as (_app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /health HTTP/1.0\r\n\r\n")
        answers, _ = await read_answers(r, 1)
        assert answers[0].status == 200 and answers[0].headers["connection"] == "close"
        assert await r.read() == b""
        w.close()


async def test_idle_connection_is_closed_after_the_keepalive_timeout() -> None:
    async with http_app(keepalive_timeout_s=1) as (_app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        (a,), _ = await read_answers(r, 1)
        assert a.status == 200 and "connection" not in a.headers  # kept alive
        await asyncio.sleep(0.5)
        w.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")  # still open at 0.5 s
        (a,), _ = await read_answers(r, 1)
        assert a.status == 200
        async with asyncio.timeout(4):  # idle > 1 s: the once-a-second sweep closes it
            assert await r.read() == b""
        w.close()


async def test_client_disconnect_mid_request_aborts_the_engine_request() -> None:
    async with http_app(simulated_tokens_per_s=100.0) as (app, port):
        _r, w = await asyncio.open_connection("127.0.0.1", port)
        body = orjson.dumps({"prompt": "long", "max_tokens": 500, "timeout": 30})
        w.write(post("/v1/completions", body))
        await asyncio.sleep(0.1)
        assert app.admission.queued_requests == 1
        w.close()
        for _ in range(100):
            if app.engine.stats.aborted_total == 1:
                break
            await asyncio.sleep(0.02)
        assert app.engine.stats.aborted_total == 1
        assert app.admission.queued_requests == 0


async def test_stream_is_chunked_and_ends_with_done() -> None:
    async with http_app() as (_app, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        body = orjson.dumps({"prompt": "hi", "max_tokens": 4, "stream": True})
        w.write(post("/v1/completions", body) + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        answers, _ = await read_answers(r, 2)
        stream, health = answers
        assert stream.status == 200 and stream.headers["transfer-encoding"] == "chunked"
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.body.endswith(b"data: [DONE]\n\n")
        assert health.status == 200  # the connection was reusable after the stream
        w.close()


async def test_drain_finishes_in_flight_answers_and_closes_idle_connections() -> None:
    async with running_app(simulated_tokens_per_s=2000.0) as app:
        sock = bind("127.0.0.1", 0, 128)
        port = sock.getsockname()[1]
        http, server, sweeper = await start_server(app, sock)
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)  # busy
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)  # idle
        w2.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        await read_answers(r2, 1)
        body = orjson.dumps({"prompt": "x", "max_tokens": 50, "timeout": 30})
        w1.write(post("/v1/completions", body))
        await asyncio.sleep(0.05)
        stop = asyncio.create_task(stop_server(http, server, sweeper, grace_s=5.0))
        assert await asyncio.wait_for(r2.read(), 2) == b""  # the idle one is closed at once
        (a,), _closed = await read_answers(r1, 1)
        assert a.status == 200 and a.headers["connection"] == "close"
        assert a.json()["usage"]["completion_tokens"] == 50
        await stop
        w1.close()
        w2.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)  # no longer accepting


async def test_intake_parses_a_bounded_slice_per_iteration_in_arrival_order() -> None:
    from tailguard.server.http import HttpServer

    fed: list[tuple[str, bytes]] = []

    class Conn:
        def __init__(self, name: str) -> None:
            self.name, self.deferred, self.closed = name, 0, False

        def feed(self, data: bytes, t_read: float) -> None:
            assert t_read <= time.monotonic()  # when it was read, not when it is parsed
            fed.append((self.name, data))

    async with running_app(handlers_per_iteration=2) as app:
        srv = HttpServer(app)
        a, b, c, gone = Conn("a"), Conn("b"), Conn("c"), Conn("gone")
        for conn, data in ((a, b"1"), (b, b"1"), (c, b"1"), (a, b"2"), (gone, b"1"), (b, b"2")):
            srv.take(conn, data)
        assert fed == [("a", b"1"), ("b", b"1")]  # this iteration's slice
        gone.closed = True  # its client left while it waited: skipped, takes no slot
        await asyncio.sleep(0)
        assert fed[2:] == [("c", b"1"), ("a", b"2")]
        await asyncio.sleep(0)
        assert fed[4:] == [("b", b"2")]
        await asyncio.sleep(0)
        assert a.deferred == b.deferred == c.deferred == gone.deferred == 0
        srv.take(c, b"2")  # a new iteration, nothing waiting: straight through
        assert fed[-1] == ("c", b"2")
        # the three chunks that waited (not the skipped one) are in the intake-wait histogram
        text = app.metrics.render().decode()
        assert "tailguard_intake_wait_seconds_count 3.0" in text


async def test_a_burst_of_connections_is_accepted_in_slices_and_all_answered() -> None:
    async with http_app(accepts_per_iteration=4, handlers_per_iteration=4) as (_app, port):
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(40)]
        for _r, w in conns:
            w.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        for r, w in conns:
            (a,), _ = await read_answers(r, 1)
            assert a.status == 200
            w.close()


async def test_tls_serves_https(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI missing")
    cert, key = self_signed_cert(tmp_path)
    async with http_app(ssl_certfile=str(cert), ssl_keyfile=str(key)) as (_app, port):
        ctx = ssl.create_default_context(cafile=str(cert))
        r, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        w.write(post("/v1/infer", INFER) + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        answers, _ = await read_answers(r, 2)
        assert [a.status for a in answers] == [200, 200]
        w.close()
        plain_r, plain_w = await asyncio.open_connection("127.0.0.1", port)
        plain_w.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")  # not TLS: no answer
        assert await asyncio.wait_for(plain_r.read(), 5) == b""
        plain_w.close()

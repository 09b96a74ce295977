"""End to end: the real `tailguard serve` process on a free port, real sockets, real clients."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import aiohttp
import openai
import pytest

SERVER_PIDS: dict[str, int] = {}  # url -> pid of the `tailguard serve` process we started


@contextlib.contextmanager
def serve(*args: str, ready: bool = True) -> Iterator[str]:
    """Start `tailguard serve --port 0 ...`; yield its base URL once it listens (and is ready)."""
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tailguard.cli",
            "serve",
            "--port",
            "0",
            "--log-level",
            "warning",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None:
            log.seek(0)
            m = re.search(r"listening on (https?://\S+)", log.read())
            if m:
                url = m.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise AssertionError(f"server did not start:\n{log.read()}")
            else:
                time.sleep(0.05)
        SERVER_PIDS[url] = proc.pid
        if ready:
            _wait_ready(url)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(urllib.error.URLError, ConnectionError),
            urllib.request.urlopen(url + "/ready", timeout=2) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url}/ready never became 200")


def test_openai_client_works_against_the_server() -> None:
    with serve("--engine", "simulated", "--api-key", "k3y") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0)
        model = client.models.list().data[0].id
        c = client.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0)
        assert len(c.choices[0].text) == 4
        assert c.usage is not None and c.usage.completion_tokens == 4
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert len(text) == 5 and chunks[-1].usage is not None
        emb = client.embeddings.create(model=model, input=["a", "bc"])  # base64 by default
        assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=1)


async def _burst(url: str, n: int) -> list[tuple[int, dict[str, object], str | None]]:
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:

        async def one(i: int) -> tuple[int, dict[str, object], str | None]:
            async with s.post(
                url + "/v1/infer", json={"prompt": f"burst {i:05d}", "top_k": 1}
            ) as r:
                return r.status, await r.json(), r.headers.get("Retry-After")

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_burst_far_beyond_capacity_gets_every_request_an_answer() -> None:
    with serve("--engine", "simulated", "--simulated-tokens-per-s", "3000") as url:
        results = asyncio.run(_burst(url, 600))
        codes = [c for c, _, _ in results]
        assert set(codes) <= {200, 503}, set(codes)
        ok = [b for c, b, _ in results if c == 200]
        assert 0 < len(ok) < 600
        # The simulated engine shares the HTTP process's event loop, so the burst's own parsing
        # stretches its steps (the real engine runs in another process); the strict per-request
        # bound is asserted in-process (test_server_app.py) and measured by bench_overload.py.
        times = sorted(b["timing"]["server_ms"] for b in ok)  # type: ignore[index]
        assert times[-1] <= 300, times
        for c, b, retry in results:
            if c == 503:
                assert retry is not None and int(retry) >= 1
                assert b["error"]["type"] == "overloaded"  # type: ignore[index]
        metrics = asyncio.run(_get(url + "/metrics"))
        assert _metric(metrics, "tailguard_connections_opened_total") >= 600
        assert 'tailguard_rejections_total{reason="overloaded"}' in metrics


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_keepalive_is_long_and_connections_are_counted() -> None:
    import urllib.request

    def scrape(url: str) -> str:  # its own short connection (urllib closes it)
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            return str(r.read().decode())

    with serve("--engine", "stub") as url:
        before = scrape(url)

        async def go() -> str:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
                for _ in range(5):
                    async with s.post(url + "/v1/infer", json={"prompt": "x"}) as r:
                        assert r.status == 200
                        await r.read()  # an unread body makes aiohttp drop the connection
                await asyncio.sleep(0.5)  # well below 75 s: the connection must still be open
                async with s.get(url + "/metrics") as r:
                    return await r.text()

        during = asyncio.run(go())
        after = scrape(url)
        opened = "tailguard_connections_opened_total"
        # `before` already counted its own connection: one more, kept alive for all six requests
        assert _metric(during, opened) - _metric(before, opened) == 1
        assert _metric(during, "tailguard_connections_active") >= 1
        per_conn = "tailguard_requests_per_connection_sum"
        # closed since `before`: the first scrape (1 request) and the session (6 requests)
        assert _metric(after, per_conn) - _metric(before, per_conn) == 7


@pytest.mark.skipif(
    not os.environ.get("TAILGUARD_E2E_REAL")
    and not __import__("importlib").util.find_spec("tailguard.engine.client"),
    reason="the real engine (tailguard.engine.client) is not available yet",
)
def test_real_engine_killed_mid_run_goes_unready_then_recovers() -> None:
    import psutil

    with serve("--engine", "real") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        c = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0)
        assert c.usage is not None and c.usage.completion_tokens >= 1
        # only the children of the server this test started (other servers may be running)
        engines = psutil.Process(SERVER_PIDS[url]).children(recursive=True)
        assert engines, "no engine child process found"
        for e in engines:
            e.kill()
        deadline = time.monotonic() + 10
        seen_503 = False
        import urllib.error
        import urllib.request

        while time.monotonic() < deadline and not seen_503:
            try:
                urllib.request.urlopen(url + "/ready", timeout=2)
            except urllib.error.HTTPError as e:
                seen_503 = e.code == 503
            except (urllib.error.URLError, TimeoutError):
                pass  # a busy machine: poll again
            time.sleep(0.02)
        assert seen_503, "/ready never reported the dead engine"
        _wait_ready(url, timeout_s=120)
        c = client.completions.create(model=model, prompt="Again", max_tokens=2, temperature=0)
        assert c.usage is not None

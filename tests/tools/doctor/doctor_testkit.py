"""Helpers for the doctor tests: fixture paths and a tiny HTTP server that replays recordings."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aiohttp import web

from tailguard.tools.lab.procs import free_port

FIXTURES = Path(__file__).parent / "fixtures"
__all__ = ["FIXTURES", "Replay", "fixture_pair", "free_port"]


class Replay:
    """Serves `pages[path]` in turn: the first GET gets the first text, later GETs the last.

    That is how a real scrape pair looks: `before` at the start of the window, `after` at its end.
    """

    def __init__(self, pages: dict[str, list[str]], content_type: str = "text/plain") -> None:
        self.pages = pages
        self.hits: dict[str, int] = {}
        self.content_type = content_type
        self.port = 0

    async def _handle(self, request: web.Request) -> web.Response:
        path = request.path
        if path not in self.pages:
            return web.Response(status=404, text=f"no {path}")
        n = self.hits.get(path, 0)
        self.hits[path] = n + 1
        texts = self.pages[path]
        return web.Response(text=texts[min(n, len(texts) - 1)], content_type=self.content_type)

    @contextmanager
    def running(self) -> Iterator[str]:
        """Run in a thread with its own event loop; yields the base URL."""
        loop = asyncio.new_event_loop()
        started = threading.Event()
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        runner = web.AppRunner(app)

        async def start() -> None:
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            server = site._server
            assert server is not None and server.sockets  # type: ignore[attr-defined]
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
            started.set()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(start())
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())

        t = threading.Thread(target=main, daemon=True)
        t.start()
        if not started.wait(10):
            raise RuntimeError("replay server did not start")
        try:
            yield f"http://127.0.0.1:{self.port}"
        finally:
            loop.call_soon_threadsafe(loop.stop)
            t.join(10)


def fixture_pair(scenario: str, stem: str) -> list[str]:
    d = FIXTURES / scenario
    ext = "prom" if stem.startswith("server") else "txt"
    return [(d / f"{stem}.before.{ext}").read_text(), (d / f"{stem}.after.{ext}").read_text()]

"""Running the app on uvicorn (uvloop + httptools) with real connection metrics and a big backlog.

Why uvicorn with our own listening socket: we pass `listen(backlog)` ourselves (uvicorn's default
is 2048, and the kernel silently caps it at net.core.somaxconn), print the bound port (port 0 in
tests), and subclass the httptools protocol to count connections opened / active and requests
per connection (ASGI itself never sees connections).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import socket
import sys
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tailguard.server.app import App
from tailguard.server.metrics import ServerMetrics

__all__ = ["raise_nofile_limit", "serve"]

log = logging.getLogger("tailguard.server")


class OneWriteTransport:
    """A transport that sends a response's status line and headers in one write with its body.

    Why: uvicorn writes `http.response.start` and each body part with its own
    `transport.write`, and uvloop sends every write at once: two syscalls per small response,
    about a fifth of the server's CPU per request under keep-alive load (profile in
    docs/bench-notes/server.md). Here a write is held back and sent together with the next one;
    whatever is still held at the end of the loop iteration goes out then, so nothing (a
    `100 Continue`, a stream's headers before its first token) waits longer than that.
    """

    __slots__ = ("_held", "_loop", "_t")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._t = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is None:
            self._held = data
            self._loop.call_soon(self._flush)
        else:
            self._held = None
            self._t.write(held + data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._t.is_closing():
            self._t.write(held)

    def close(self) -> None:
        self._flush()
        self._t.close()

    # the calls uvicorn makes per request, forwarded without __getattr__'s lookup
    def is_closing(self) -> bool:
        return self._t.is_closing()

    def pause_reading(self) -> None:
        self._t.pause_reading()

    def resume_reading(self) -> None:
        self._t.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._t.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


def tracked_protocol(metrics: ServerMetrics) -> type[asyncio.Protocol]:
    """An httptools protocol class that reports connections to `metrics` and writes each
    response in one piece (`OneWriteTransport`)."""
    opened, active, per_conn = metrics.conn_opened, metrics.conn_active, metrics.req_per_conn

    class TrackedHttpToolsProtocol(HttpToolsProtocol):
        _tg_requests = 0

        def connection_made(self, transport: Any) -> None:
            opened.inc()
            active.inc()
            super().connection_made(
                cast(asyncio.Transport, OneWriteTransport(transport, self.loop))
            )

        def on_message_begin(self) -> None:
            self._tg_requests += 1
            super().on_message_begin()

        def connection_lost(self, exc: Exception | None) -> None:
            active.dec()
            per_conn.observe(self._tg_requests)
            super().connection_lost(exc)

    return TrackedHttpToolsProtocol


def raise_nofile_limit() -> int:
    """Raise the open-files soft limit to the hard limit (10,000 connections need 10,000 fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def somaxconn() -> int | None:
    try:
        with open("/proc/sys/net/core/somaxconn") as fh:
            return int(fh.read())
    except OSError:  # pragma: no cover
        return None


def bind(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def serve(app: App) -> int:
    cfg = app.config
    nofile = raise_nofile_limit()
    cap = somaxconn()
    if cap is not None and cap < cfg.backlog:
        log.warning(
            "backlog %d is capped by net.core.somaxconn=%d; for bursts run "
            "`sysctl -w net.core.somaxconn=%d` as root",
            cfg.backlog,
            cap,
            cfg.backlog,
        )
    # Fewer, larger young-generation collections: a burst allocates ~100 objects per request
    # and the default threshold (700) collects every few requests.
    gc.set_threshold(50_000, 20, 20)
    sock = bind(cfg.host, cfg.port, cfg.backlog)
    host, port = sock.getsockname()[:2]
    scheme = "https" if cfg.ssl_certfile else "http"
    uv_config = uvicorn.Config(
        app,
        loop="uvloop",
        http=tracked_protocol(app.metrics),
        lifespan="on",
        backlog=cfg.backlog,
        timeout_keep_alive=cfg.keepalive_timeout_s,
        limit_max_requests=None,  # no per-connection (or per-process) request cap
        access_log=cfg.access_log,
        log_level=cfg.log_level,
        server_header=False,
        proxy_headers=False,  # no X-Forwarded-* rewriting: a per-request cost nothing here uses
        ssl_certfile=cfg.ssl_certfile,
        ssl_keyfile=cfg.ssl_keyfile,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(uv_config)
    print(
        f"tailguard: listening on {scheme}://{host}:{port} (engine={cfg.engine}, "
        f"model={app.model_name}, sla_ms={cfg.sla_ms:g}, open files={nofile})",
        flush=True,
    )
    server.run(sockets=[sock])
    return 0 if not server.should_exit or server.started else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `tailguard serve`")

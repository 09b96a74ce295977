"""Serving the app: the listening socket, accepting connections, start and graceful stop.

`serve(app)` binds its own socket (our `listen` backlog; the kernel caps it at
net.core.somaxconn), accepts a bounded slice of connections per loop iteration (`Listener`),
hands each to an `HttpProtocol` (tailguard.server.http), and on SIGTERM/SIGINT drains: stop
accepting, close idle connections, let in-flight requests finish (5 s at most), stop the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tailguard.server.http import HttpServer

if TYPE_CHECKING:
    from tailguard.server.app import App
    from tailguard.server.http_read import Handler

__all__ = ["Listener", "bind", "raise_nofile_limit", "serve", "start_server", "stop_server"]

log = logging.getLogger("tailguard.server")


class Listener:
    """Accepts at most `per_iteration` connections per event-loop iteration.

    uvloop's own server accepts every pending connection in one go: at the start of a
    10,000-connection burst that is thousands of connections (and then their reads and parses)
    in one loop iteration, measured at 200+ ms, while answers for requests already admitted
    wait behind it. Here the listening socket is read level-triggered: each iteration takes a
    bounded slice and leaves the rest queued in the kernel (the listen backlog), so iterations
    stay short and admitted answers go out within one or two of them.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        per_iteration: int,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.factory = factory
        self.per_iteration = per_iteration
        self.ssl = ssl_context
        self._pending: set[asyncio.Task[Any]] = set()  # connections being set up (TLS)
        self._closed = False
        self._family, self._type = int(sock.family), int(sock.type)
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(self.per_iteration):
            try:
                # the raw accept: socket.accept() converts family and type to enums per call
                fd, _addr = self.sock._accept()  # type: ignore[attr-defined]
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the client reset before we accepted: next one
                continue
            except OSError as e:  # EMFILE and the like: back off, the kernel keeps the queue
                log.warning("accept failed (%s); pausing accepts for 100 ms", e)
                self.loop.remove_reader(self.sock.fileno())
                self.loop.call_later(0.1, self._resume)
                return
            conn = socket.socket(self._family, self._type, 0, fd)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self.loop.create_task(
                self.loop.connect_accepted_socket(self.factory, conn, ssl=self.ssl)
            )
            self._pending.add(task)
            task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("connection set-up failed: %s", task.exception())

    def _resume(self) -> None:
        if not self._closed:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            for task in self._pending:
                task.cancel()


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


def _ssl_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


async def start_server(
    app: Handler, sock: socket.socket
) -> tuple[HttpServer, Listener, asyncio.Task[None]]:
    """Serve `app` on an already listening socket; for `serve` and in-process tests."""
    cfg = app.config
    http = HttpServer(app)
    ctx = None
    if cfg.ssl_certfile and cfg.ssl_keyfile:  # the config allows both or neither
        ctx = _ssl_context(cfg.ssl_certfile, cfg.ssl_keyfile)
    listener = Listener(http.loop, sock, http.protocol, cfg.accepts_per_iteration, ctx)
    sweeper = http.loop.create_task(http.run_sweeper(), name="http-sweep")
    return http, listener, sweeper


async def stop_server(
    http: HttpServer, listener: Listener, sweeper: asyncio.Task[None], grace_s: float
) -> None:
    listener.close()
    http.drain()
    deadline = time.monotonic() + grace_s
    while http.busy and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for conn in list(http.connections):
        if conn.call is not None and conn.call.task is not None:
            conn.call.task.cancel()
        conn.close()
    sweeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sweeper


async def _main(app: App, sock: socket.socket, banner: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await app.startup()
    http, server, sweeper = await start_server(app, sock)
    print(banner, flush=True)
    try:
        await stop.wait()
        log.info("shutting down: draining connections")
        await stop_server(http, server, sweeper, grace_s=5.0)
    finally:
        await app.shutdown()


def serve(app: App) -> int:
    import uvloop

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
    banner = (
        f"tailguard: listening on {scheme}://{host}:{port} (engine={cfg.engine}, "
        f"model={app.model_name}, sla_ms={cfg.sla_ms:g}, open files={nofile})"
    )
    uvloop.run(_main(app, sock, banner))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `tailguard serve`")

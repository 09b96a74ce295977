"""A tiny, fast HTTP/1.1 server to test load tools against.

    python -m tailguard.tools.load.testserver [options]

Raw asyncio (uvloop when present) so it outruns the client it is testing. Misbehaviours on
demand, each one a known answer the load tester must report:

    --stall-at 1 --stall-for 1   once, 1 s after the first request, hold every response for 1 s
    --delay 0.05                 answer every request after 50 ms
    --fail-every 10              every 10th request gets 503 with Retry-After: 1
    --stream-tokens 4            bodies with "stream": true get 4 SSE events (chunked), or
                                 max_tokens events when the body sets it; first event after
                                 delay + token delay, then one every --token-delay
    --slow-every 5 --slow-delay 0.2   every 5th request starts answering 200 ms later
    --capacity 4                 serve at most 4 requests at a time, the rest wait in FIFO
                                 order (a known knee: capacity / delay requests per second)

Bodies with "stream_options": {"include_usage": true} get a usage event (prompt_tokens: the
prompt's token ids, or its words; completion_tokens: the events sent); completions and chat
JSON answers carry the same usage. GET /stats returns {"requests": N, "connections": N,
"distinct_bodies": N}; GET /metrics exports the server-side latency histogram
`mistral_inference_latency_seconds` with the SLA buckets.
Prints `LISTENING <port>` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

__all__ = ["ServerOptions", "main", "serve"]

# docs/metrics.md's SLA buckets
SLA_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.18, 0.2)
SLA_BUCKETS += (0.25, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    backlog: int = 16384
    stall_at_s: float | None = None  # after the first request; None = never stall
    stall_for_s: float = 1.0
    delay_s: float = 0.0
    fail_every: int = 0  # 0 = never fail
    stream_tokens: int = 4
    token_delay_s: float = 0.005
    capacity: int = 0  # requests served at once; 0 = unlimited
    slow_every: int = 0  # every Nth request waits slow_delay_s more before answering
    slow_delay_s: float = 0.0


class _Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.connections = 0
        self.first_at: float | None = None
        self.buckets = [0] * len(SLA_BUCKETS)
        self.count = 0
        self.sum = 0.0
        self.bodies: set[int] = set()
        self.busy = 0  # requests being served (--capacity)
        self.waiting: list[Callable[[], None]] = []  # FIFO of requests waiting for capacity

    def release(self) -> None:
        self.busy -= 1
        if self.waiting:
            self.busy += 1
            self.waiting.pop(0)()

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        for k, b in enumerate(SLA_BUCKETS):
            if seconds <= b:
                self.buckets[k] += 1

    def metrics(self) -> bytes:
        name = "mistral_inference_latency_seconds"
        lab = 'endpoint="infer",outcome="ok"'
        lines = [f"# TYPE {name} histogram"]
        for b, n in zip(SLA_BUCKETS, self.buckets, strict=True):
            lines.append(f'{name}_bucket{{{lab},le="{b}"}} {n}')
        lines.append(f'{name}_bucket{{{lab},le="+Inf"}} {self.count}')
        lines.append(f"{name}_count{{{lab}}} {self.count}")
        lines.append(f"{name}_sum{{{lab}}} {self.sum}")
        return ("\n".join(lines) + "\n").encode()


class _Conn(asyncio.Protocol):
    def __init__(self, opts: ServerOptions, stats: _Stats) -> None:
        self.opts, self.stats = opts, stats
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.streams: set[asyncio.Future[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they implement it
        self.transport = cast(asyncio.Transport, transport)
        self.stats.connections += 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            close = False
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                k = k.strip().lower()
                if k == "content-length":
                    length = int(v.strip())
                elif k == "connection" and v.strip().lower() == "close":
                    close = True
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            method, path = [*head.split(" ", 2), "", ""][:2]
            self._handle(method, path, body, close)

    def _handle(self, method: str, path: str, body: bytes, close: bool) -> None:
        now = time.perf_counter()
        st, o = self.stats, self.opts
        if method == "GET" and path == "/stats":
            data = json.dumps(
                {
                    "requests": st.requests,
                    "connections": st.connections,
                    "distinct_bodies": len(st.bodies),
                }
            )
            self._write(200, data.encode(), "application/json", close)
            return
        if method == "GET" and path == "/metrics":
            self._write(200, st.metrics(), "text/plain; version=0.0.4", close)
            return
        st.requests += 1
        n = st.requests
        st.bodies.add(hash(body))
        if st.first_at is None:
            st.first_at = now
        fail = o.fail_every > 0 and n % o.fail_every == 0
        req = _parse(body)
        stream = req.get("stream") is True
        chat = path.endswith("/chat/completions")
        tokens = req.get("max_tokens") if isinstance(req.get("max_tokens"), int) else None
        opts = req.get("stream_options")
        with_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        usage = _usage(req, tokens if tokens is not None else o.stream_tokens)

        def respond() -> None:
            if self.transport is None or self.transport.is_closing():
                st.release()
                return
            if fail:
                err = b'{"error":{"message":"overloaded","code":"overloaded"}}'
                self._write(503, err, "application/json", close, extra="Retry-After: 1\r\n")
            elif stream:
                count = tokens if tokens is not None else o.stream_tokens
                coro = self._stream(now, close, count, chat, usage if with_usage else None)
                self.streams.add(task := asyncio.ensure_future(coro))
                task.add_done_callback(self.streams.discard)
                return
            else:
                extra = b',"usage":' + json.dumps(usage).encode() if "max_tokens" in req else b""
                self._write(200, b'{"ok":true,"n":%d%s}' % (n, extra), "application/json", close)
            st.observe(time.perf_counter() - now)
            st.release()

        def start() -> None:
            begin = time.perf_counter()
            ready = begin + o.delay_s
            if o.slow_every and n % o.slow_every == 0:
                ready += o.slow_delay_s
            if o.stall_at_s is not None and st.first_at is not None:
                stall_start = st.first_at + o.stall_at_s
                stall_end = stall_start + o.stall_for_s
                if stall_start <= ready < stall_end:
                    ready = stall_end
            delay = ready - begin
            if delay > 0:
                self.loop.call_later(delay, respond)
            else:
                respond()

        if o.capacity and st.busy >= o.capacity:
            st.waiting.append(start)
        else:
            st.busy += 1
            start()

    async def _stream(
        self, started: float, close: bool, count: int, chat: bool, usage: dict[str, int] | None
    ) -> None:
        t = self.transport
        try:
            if t is None:
                return
            t.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            for k in range(count):
                await asyncio.sleep(self.opts.token_delay_s)
                if chat:
                    event = b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % k
                else:
                    event = b'data: {"choices":[{"text":"t%d"}]}\n\n' % k
                t.write(b"%x\r\n%s\r\n" % (len(event), event))
            if usage is not None:
                event = b'data: {"choices":[],"usage":%s}\n\n' % json.dumps(usage).encode()
                t.write(b"%x\r\n%s\r\n" % (len(event), event))
            done = b"data: [DONE]\n\n"
            t.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            self.stats.observe(time.perf_counter() - started)
            if close:
                t.close()
        finally:
            self.stats.release()

    def _write(self, status: int, body: bytes, ctype: str, close: bool, extra: str = "") -> None:
        assert self.transport is not None
        reason = {200: "OK", 503: "Service Unavailable"}.get(status, "OK")
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}"
            + ("Connection: close\r\n" if close else "")
            + "\r\n"
        )
        self.transport.write(head.encode() + body)
        if close:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def _parse(body: bytes) -> dict[str, Any]:
    if not body.startswith(b"{"):
        return {}
    try:
        obj = json.loads(body)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _usage(req: dict[str, Any], completion: int) -> dict[str, int]:
    """Prompt tokens: a token-id prompt's length, else the words of the prompt or messages."""
    prompt = req.get("prompt", req.get("input_ids"))
    if isinstance(prompt, list):
        n = len(prompt)
    elif isinstance(prompt, str):
        n = len(prompt.split())
    else:
        msgs = req.get("messages") or []
        n = sum(len(str(m.get("content", "")).split()) for m in msgs if isinstance(m, dict))
    return {"prompt_tokens": n, "completion_tokens": completion, "total_tokens": n + completion}


async def serve(opts: ServerOptions, ready: asyncio.Future[int] | None = None) -> None:
    """Serve forever; sets `ready` to the bound port (also printed as LISTENING <port>)."""
    loop = asyncio.get_running_loop()
    stats = _Stats()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((opts.host, opts.port))
    server = await loop.create_server(lambda: _Conn(opts, stats), sock=sock, backlog=opts.backlog)
    port = server.sockets[0].getsockname()[1]
    print(f"LISTENING {port}", flush=True)
    if ready is not None:
        ready.set_result(port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tailguard.tools.load.testserver")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--backlog", type=int, default=16384)
    ap.add_argument("--stall-at", type=float, default=None)
    ap.add_argument("--stall-for", type=float, default=1.0)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--stream-tokens", type=int, default=4)
    ap.add_argument("--token-delay", type=float, default=0.005)
    ap.add_argument("--capacity", type=int, default=0)
    ap.add_argument("--slow-every", type=int, default=0)
    ap.add_argument("--slow-delay", type=float, default=0.0)
    a = ap.parse_args(argv)
    opts = ServerOptions(
        a.host, a.port, a.backlog, a.stall_at, a.stall_for, a.delay, a.fail_every,
        a.stream_tokens, a.token_delay, a.capacity, a.slow_every, a.slow_delay,
    )  # fmt: skip
    try:
        import uvloop

        uvloop.run(serve(opts))
    except ImportError:
        asyncio.run(serve(opts))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Overload: 10,000 connections each send one /v1/infer at once; tailguard vs the runbook's server.

Both servers run the same embedded model on this machine, one after the other, under the same
load: a client in its own process (one connection per request) opens N connections and sends one
single-pass query on each, all at once. Reported side by side:

* client side: every request's status and latency (whole distribution), connection errors and
  timeouts (must be zero for tailguard);
* server side, from /metrics (request read -> response written, exact SLA-bucket ratios):
  admitted requests within the SLA, and rejections within 10 / 25 ms.

    .venv/bin/python bench/bench_overload.py [--requests 10000] [--sla-ms 150]

The client (`--client-impl raw`, default) is uvloop + one raw asyncio.Protocol per connection +
httptools, ~0.1 ms of CPU a request, so that the client is not the bottleneck; `--client-impl
aiohttp` (the old client) needs ~0.75 ms a request, 7-8 s of a core for 10,000 connections.
The report adds when each connection was established (connected_s, client-side: 10,000 connect()
calls alone take ~0.35 s of kernel time here) and the client's own CPU seconds.

Needs root for `sysctl -w net.core.somaxconn=16384` (else 4096 caps the listen backlog).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from tailguard.tools.lab.procs import free_port, serving

PROMPT = (
    "Batch item {i}: classify the following support ticket and return the most likely "
    "next token. Ticket: the nightly export stalled at step {i} again."
)


# ---- the clients (run in their own process: `bench_overload.py --client URL N TIMEOUT`) --------


async def _client_aiohttp(url: str, n: int, timeout_s: float) -> dict[str, Any]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    records: list[dict[str, Any]] = []
    trace = aiohttp.TraceConfig()

    async def on_conn_end(_s: Any, ctx: Any, _params: Any) -> None:
        if ctx.trace_request_ctx is not None:
            ctx.trace_request_ctx["connected_s"] = time.monotonic() - t0

    trace.on_connection_create_end.append(on_conn_end)
    cpu0 = _cpu_now()
    t0 = time.monotonic()
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s), trace_configs=[trace]
    ) as s:

        async def one(i: int) -> None:
            rec: dict[str, Any] = {"status": 0, "error": None}
            try:
                async with s.post(
                    url + "/v1/infer",
                    json={"prompt": PROMPT.format(i=i), "top_k": 5},
                    trace_request_ctx=rec,
                ) as r:
                    body = await r.read()
                    rec["status"] = r.status
                    rec["retry_after"] = r.headers.get("Retry-After")
                    if r.status == 200:
                        with contextlib.suppress(Exception):
                            timing = json.loads(body)["timing"]
                            rec["server_ms"] = timing["server_ms"]
                            rec["queue_ms"] = timing.get("queue_ms")
                            rec["compute_ms"] = timing.get("compute_ms")
            except TimeoutError:
                rec["error"] = "timeout"
            except aiohttp.ClientError as e:
                rec["error"] = type(e).__name__
            rec["latency_s"] = time.monotonic() - t0  # all intended at t0: no coordinated omission
            records.append(rec)

        await asyncio.gather(*(one(i) for i in range(n)))
    return {"wall_s": time.monotonic() - t0, "records": records, **_cpu("aiohttp", cpu0)}


def _cpu(impl: str, cpu0: float) -> dict[str, Any]:
    """Which client ran, and the CPU seconds (user + system) it spent from t0 to the end."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"client_impl": impl, "client_cpu_s": ru.ru_utime + ru.ru_stime - cpu0}


def _cpu_now() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class _Run:
    """State shared by all connections of one raw-client run."""

    __slots__ = ("done", "left", "t0")

    def __init__(self, n: int, done: asyncio.Future[None]) -> None:
        self.t0 = 0.0
        self.left = n
        self.done = done


class _Conn(asyncio.Protocol):
    """One connection, one pre-built request, one record (exactly one, whatever happens)."""

    __slots__ = (
        "body",
        "finished",
        "framed",
        "headers_done",
        "parser",
        "rec",
        "req",
        "run",
        "task",
        "transport",
    )

    def __init__(self, run: _Run, req: bytes) -> None:
        self.run = run
        self.req = req
        self.rec: dict[str, Any] = {"status": 0, "error": None, "retry_after": None}
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[Any] | None = None
        self.finished = False
        self.headers_done = False
        self.framed = False  # Content-Length or chunked: the parser sees the end by itself

    def factory(self) -> _Conn:
        return self

    # -- transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.rec["connected_s"] = time.monotonic() - self.run.t0
        t = cast(asyncio.Transport, transport)  # uvloop's TCPTransport: not a subclass
        if self.finished:  # timed out while connecting
            t.abort()
            return
        self.transport = t
        t.write(self.req)

    def data_received(self, data: bytes) -> None:
        if self.finished:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.finish(type(e).__name__)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.finished:
            return
        if self.headers_done and not self.framed:  # body delimited by EOF
            self.on_message_complete()
        else:
            self.finish(type(exc).__name__ if exc is not None else "closed_early")

    def connect_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or self.finished:
            return
        exc = task.exception()
        if exc is not None:
            self.finish(type(exc).__name__)

    # -- parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"retry-after":
            self.rec["retry_after"] = value.decode("latin-1")
        elif name in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        rec = self.rec
        status = self.parser.get_status_code()
        rec["status"] = status
        if status == 200:
            with contextlib.suppress(Exception):
                timing = json.loads(b"".join(self.body))["timing"]
                rec["server_ms"] = timing["server_ms"]
                rec["queue_ms"] = timing.get("queue_ms")
                rec["compute_ms"] = timing.get("compute_ms")
        self.finish(None)

    # -- the one way out
    def finish(self, error: str | None, abort: bool = False) -> None:
        if self.finished:
            return
        self.finished = True
        run = self.run
        self.rec["error"] = error
        self.rec["latency_s"] = time.monotonic() - run.t0  # all intended at t0
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()
            self.transport = None
        self.body = []
        run.left -= 1
        if run.left == 0 and not run.done.done():
            run.done.set_result(None)


def _build_requests(host: str, port: int, n: int) -> list[bytes]:
    head = (
        f"POST /v1/infer HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: "
    ).encode()
    out = []
    for i in range(n):
        body = json.dumps({"prompt": PROMPT.format(i=i), "top_k": 5}).encode()
        out.append(b"%s%d\r\nConnection: close\r\n\r\n%s" % (head, len(body), body))
    return out


async def _client_raw(url: str, n: int, timeout_s: float, chunk: int = 0) -> dict[str, Any]:
    """uvloop + one raw asyncio.Protocol per connection + httptools: a few µs of CPU a request.

    All N connects are issued at t0 (chunk=0: N tasks created in one tight loop; chunk=K: K at a
    time, yielding to the loop between chunks). One timer at t0 + timeout_s marks whatever is
    still open as "timeout".
    """
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    loop = asyncio.get_running_loop()
    run = _Run(n, loop.create_future())
    conns = [_Conn(run, req) for req in _build_requests(host, port, n)]
    gc.collect()
    gc.disable()  # ~100k short-lived objects: collections would be pure overhead here

    def expire() -> None:
        for c in conns:
            if not c.finished:
                if c.task is not None and not c.task.done():
                    c.task.cancel()
                c.finish("timeout", abort=True)

    cpu0 = _cpu_now()
    run.t0 = t0 = time.monotonic()
    timer = loop.call_at(t0 + timeout_s, expire)
    step = chunk if chunk > 0 else n
    for lo in range(0, n, step):
        for c in conns[lo : lo + step]:
            task = loop.create_task(loop.create_connection(c.factory, host, port))
            task.add_done_callback(c.connect_done)
            c.task = task
        if lo + step < n:
            await asyncio.sleep(0)
    if n:
        await run.done
    wall = time.monotonic() - t0
    timer.cancel()
    out = {"wall_s": wall, "records": [c.rec for c in conns], **_cpu("raw", cpu0)}
    gc.enable()
    return out


def run_client(impl: str, url: str, n: int, timeout_s: float, chunk: int = 0) -> dict[str, Any]:
    _raise_nofile()
    if impl == "aiohttp":
        return asyncio.run(_client_aiohttp(url, n, timeout_s))
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        return r.run(_client_raw(url, n, timeout_s, chunk))


# ---- orchestration ------------------------------------------------------------------------------


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def hist(text: str, name: str, labels: dict[str, str]) -> dict[str, float]:
    """Bucket counts {le: count} of one labelled histogram series (any label order)."""
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{name}_bucket{{([^}}]*)}} (\S+)$", text, re.M):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(pairs.get(k) == v for k, v in labels.items()):
            out[pairs["le"]] = float(m.group(2))
    return out


def _two_ratios(s: dict[str, Any], a: str, b: str) -> str:
    if a not in s:
        return "-"
    return f"{s[a]:.3f} / {s[b]:.3f}"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def run_load(url: str, n: int, timeout_s: float, args: argparse.Namespace) -> dict[str, Any]:
    out = subprocess.run(
        [
            *(sys.executable, __file__, "--client", url, str(n), str(timeout_s)),
            *("--client-impl", args.client_impl, "--connect-chunk", str(args.connect_chunk)),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(out.stdout))


def summarize(name: str, res: dict[str, Any], metrics: str, sla_s: float) -> dict[str, Any]:
    recs = res["records"]
    lat = [r["latency_s"] * 1e3 for r in recs]
    statuses = Counter(r["status"] for r in recs if not r["error"])
    errors = Counter(r["error"] for r in recs if r["error"])
    ok_lat = [r["latency_s"] * 1e3 for r in recs if r["status"] == 200]
    rej_lat = [r["latency_s"] * 1e3 for r in recs if r["status"] == 503]
    s: dict[str, Any] = {
        "name": name,
        "wall_s": res["wall_s"],
        "statuses": dict(statuses),
        "errors": dict(errors),
        "n": len(recs),
        "client_ms": {
            q: pct(lat, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
        },
        "client_ok_ms": {
            "p50": pct(ok_lat, 0.5),
            "p99": pct(ok_lat, 0.99),
            "max": pct(ok_lat, 1.0),
        },
        "client_503_ms": {
            "p50": pct(rej_lat, 0.5),
            "p99": pct(rej_lat, 0.99),
            "max": pct(rej_lat, 1.0),
        },
        "retry_after_present": sum(1 for r in recs if r["status"] == 503 and r["retry_after"]),
        "client_impl": res.get("client_impl", "?"),
        "client_cpu_s": res.get("client_cpu_s", float("nan")),
    }
    conn = [r["connected_s"] * 1e3 for r in recs if r.get("connected_s") is not None]
    s["connected_ms"] = {"p50": pct(conn, 0.5), "p99": pct(conn, 0.99), "max": pct(conn, 1.0)}
    server_ms = [r["server_ms"] for r in recs if "server_ms" in r]
    s["server_ok_ms"] = {
        "p50": pct(server_ms, 0.5),
        "p99": pct(server_ms, 0.99),
        "max": pct(server_ms, 1.0),
    }
    for part in ("queue_ms", "compute_ms"):  # where an admitted request's server time went
        vals = [r[part] for r in recs if r.get(part) is not None]
        s[f"ok_{part}"] = {"p50": pct(vals, 0.5), "p99": pct(vals, 0.99)}
    ok = hist(metrics, "mistral_inference_latency_seconds", {"endpoint": "infer", "outcome": "ok"})
    if ok.get("+Inf"):
        s["server_ok_within_sla"] = ok[_le(sla_s)] / ok["+Inf"]
    rej = hist(metrics, "tailguard_rejection_seconds", {"reason": "overloaded"})
    if rej.get("+Inf"):
        s["server_rejections_within_10ms"] = rej["0.01"] / rej["+Inf"]
        s["server_rejections_within_25ms"] = rej["0.025"] / rej["+Inf"]
    intake = hist(metrics, "tailguard_intake_wait_seconds", {})
    if intake.get("+Inf"):  # read but left for a later loop iteration (not in server time)
        s["intake_waits"] = intake["+Inf"]
        s["intake_within_100ms"] = intake["0.1"] / intake["+Inf"]
        s["intake_within_1s"] = intake["1.0"] / intake["+Inf"]
    return s


def _le(sla_s: float) -> str:
    return repr(float(sla_s)) if sla_s not in (1.0, 5.0, 10.0) else f"{sla_s:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--sla-ms", type=float, default=150.0)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="client timeout per request")
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `tailguard serve` argument (repeatable), e.g. --server-arg=--engine-threads=1",
    )
    ap.add_argument(
        "--client-impl",
        choices=("raw", "aiohttp"),
        default="raw",
        help="load client: raw (uvloop + asyncio.Protocol + httptools, default) or aiohttp",
    )
    ap.add_argument(
        "--connect-chunk",
        type=int,
        default=0,
        help="raw client: issue connects K at a time, yielding between chunks (0: all at once)",
    )
    ap.add_argument("--client", nargs=3, metavar=("URL", "N", "TIMEOUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        url, n, timeout = args.client
        res = run_client(args.client_impl, url, int(n), float(timeout), args.connect_chunk)
        print(json.dumps(res))
        return 0

    r = subprocess.run(["sysctl", "-w", "net.core.somaxconn=16384"], capture_output=True, text=True)
    print(f"sysctl net.core.somaxconn=16384: {'ok' if r.returncode == 0 else r.stderr.strip()}")
    py = sys.executable
    results = []
    logs = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tailguard = [py, "-m", "tailguard.cli", "serve", "--port", str(port)]
    tailguard += ["--sla-ms", str(args.sla_ms), "--log-level", "warning", *args.server_arg]
    with serving("tailguard", tailguard, logs / "tailguard.log", url + "/ready"):
        res = run_load(url, args.requests, args.timeout_s, args)
        results.append(summarize("tailguard", res, get(url + "/metrics")[1], args.sla_ms / 1e3))
    if not args.skip_naive:
        time.sleep(10)  # TIME_WAIT and accept queues drain between heavy runs
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        naive = [py, "-m", "tailguard.tools.lab.naive_server", "--port", str(port)]
        with serving("naive server", naive, logs / "naive.log", url + "/health"):
            res = run_load(url, args.requests, args.timeout_s, args)
            results.append(
                summarize("naive (runbook)", res, get(url + "/metrics")[1], args.sla_ms / 1e3)
            )
    report(results, args)
    return 0


def _pair(s: dict[str, Any], key: str) -> str:
    v = s.get(key) or {}
    if not v or v.get("p50") != v.get("p50"):  # absent or NaN (the naive server has no timing)
        return "-"
    return f"{v['p50']:.0f} / {v['p99']:.0f}"


def _triple(s: dict[str, Any], key: str) -> str:
    v = s.get(key) or {}
    if not v or v.get("p50") != v.get("p50"):
        return "-"
    return f"{v['p50']:.0f} / {v['p99']:.0f} / {v['max']:.0f}"


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    def f(x: Any) -> str:
        if isinstance(x, float):
            return "-" if x != x else f"{x:.3f}" if x < 10 else f"{x:.0f}"
        return str(x)

    rows = [
        ("requests", lambda s: s["n"]),
        ("wall time (s)", lambda s: s["wall_s"]),
        ("200 ok", lambda s: s["statuses"].get(200, 0)),
        ("503 overloaded", lambda s: s["statuses"].get(503, 0)),
        (
            "other statuses",
            lambda s: {k: v for k, v in s["statuses"].items() if k not in (200, 503)} or 0,
        ),
        ("connection errors / timeouts", lambda s: s["errors"] or 0),
        ("503 with Retry-After", lambda s: s["retry_after_present"]),
        ("client p50 ms (all)", lambda s: s["client_ms"]["p50"]),
        ("client p90 ms (all)", lambda s: s["client_ms"]["p90"]),
        ("client p99 ms (all)", lambda s: s["client_ms"]["p99"]),
        ("client max ms (all)", lambda s: s["client_ms"]["max"]),
        ("client p99 ms (200)", lambda s: s["client_ok_ms"]["p99"]),
        ("client max ms (503)", lambda s: s["client_503_ms"]["max"]),
        ("connected p50 / p99 / max ms", lambda s: _triple(s, "connected_ms")),
        ("client CPU (s)", lambda s: s["client_cpu_s"]),
        ("server p99 ms (200)", lambda s: s["server_ok_ms"]["p99"]),
        ("server max ms (200)", lambda s: s["server_ok_ms"]["max"]),
        ("  of which queue p50 / p99 ms", lambda s: _pair(s, "ok_queue_ms")),
        ("  of which compute p50 / p99 ms", lambda s: _pair(s, "ok_compute_ms")),
        (f"server 200 within {args.sla_ms:g} ms", lambda s: s.get("server_ok_within_sla", "-")),
        ("server 503 within 10 ms", lambda s: s.get("server_rejections_within_10ms", "-")),
        ("server 503 within 25 ms", lambda s: s.get("server_rejections_within_25ms", "-")),
        ("requests parsed a loop iteration later", lambda s: s.get("intake_waits", 0)),
        (
            "  of which waited < 100 ms / < 1 s",
            lambda s: _two_ratios(s, "intake_within_100ms", "intake_within_1s"),
        ),
        ("504 expired (never executed)", lambda s: s["statuses"].get(504, 0)),
    ]
    print(
        f"\n{args.requests} concurrent connections, one POST /v1/infer each, "
        f"SLA {args.sla_ms:g} ms, {os.cpu_count()} cores, client: {args.client_impl}"
        + (f" (connects in chunks of {args.connect_chunk})" if args.connect_chunk else "")
    )
    print(f"{'':32}" + "".join(f"{s['name']:>20}" for s in results))
    for label, fn in rows:
        print(f"{label:32}" + "".join(f"{f(fn(s)):>20}" for s in results))
    print("\njson: " + json.dumps(results))


if __name__ == "__main__":
    raise SystemExit(main())

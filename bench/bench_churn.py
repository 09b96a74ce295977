"""Connection churn through Envoy with TLS: `max_requests_per_connection: 100` vs the generated
config, same backend, same open-loop load, side by side.

    .venv/bin/python bench/bench_churn.py           # stand-in, 600 req/s, 128 conns, ~7 min
    .venv/bin/python bench/bench_churn.py --rate 300 --connections 4 --duration 10
    .venv/bin/python bench/bench_churn.py --backend-cmd "{python} -m tailguard.cli serve \\
        --engine simulated --host 127.0.0.1 --port {port}"   # the real server

Open loop: request i is due at start + i / rate whatever happened before, and its latency is
measured from that intended time, so a stall (a burst of TLS handshakes) is charged to every
request that waited behind it (no coordinated omission). The client first opens its pool of
--connections connections (unmeasured), then keeps at most that many; Envoy's counters say how
many it had to open in total.
Default backend: tests/deploy/standin_backend.py (NOT the tailguard server: no model).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import yaml

from tailguard.deploy.envoy import EnvoySettings, Replica, find_envoy, render
from tailguard.deploy.tls import self_signed_cert

REPO = Path(__file__).resolve().parent.parent
STANDIN = REPO / "tests" / "deploy" / "standin_backend.py"
SLA_S = 0.15


@dataclass(frozen=True)
class Run:
    config: str
    sent: int
    ok: int
    errors: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    within_sla: float  # share of all requests answered 200 within 0.15 s
    cx_total: int  # downstream connections Envoy accepted (each one a TLS handshake)
    handshakes: int  # listener ssl.handshake
    cx_max_requests: int  # downstream_cx_max_requests_reached
    upstream_cx: int  # upstream connections opened to the backend
    reconnect_ms: float  # mean client time to open a connection (TCP + TLS), per opening
    p50_new_ms: float  # median latency of requests that had to open a connection
    p50_reused_ms: float  # median latency of requests sent on a kept-alive connection


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status), resp.read().decode()
    except OSError as exc:
        return 0, str(exc)


def wait_for(url: str, body_has: str = "", timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, body = get(url)
        if status == 200 and body_has in body:
            return
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {url}")


def make_cert(d: Path) -> tuple[str, str]:
    cert, key = self_signed_cert(d, rsa=True)  # RSA-2048: the handshake cost being priced
    return str(cert), str(key)


def stats(admin: str) -> dict[str, int]:
    _, text = get(f"{admin}/stats")
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


@dataclass
class Load:
    latencies: list[float]  # of 200s, s, from the intended send time
    errors: int
    connect_s: list[float]  # each connection the client opened: TCP + TLS time
    new_conn: list[float]  # latencies of requests that opened a connection
    reused: list[float]  # latencies of requests on a kept-alive connection


async def load(
    url: str, rate: float, duration_s: float, connections: int, ctx: ssl.SSLContext
) -> Load:
    """Open-loop POSTs; a trace tells which requests paid for a new connection."""
    out = Load([], 0, [], [], [])
    total = int(rate * duration_s)
    trace = aiohttp.TraceConfig()

    async def conn_start(_s: object, ctx_: SimpleNamespace, _p: object) -> None:
        ctx_.trace_request_ctx["t0"] = time.perf_counter()

    async def conn_end(_s: object, ctx_: SimpleNamespace, _p: object) -> None:
        out.connect_s.append(time.perf_counter() - ctx_.trace_request_ctx["t0"])
        ctx_.trace_request_ctx["new"] = True

    trace.on_connection_create_start.append(conn_start)
    trace.on_connection_create_end.append(conn_end)
    conn = aiohttp.TCPConnector(limit=connections, ssl=ctx)
    async with aiohttp.ClientSession(connector=conn, trace_configs=[trace]) as session:

        async def warm() -> None:
            async with session.post(url, json={"prompt": "x"}, trace_request_ctx={}) as r:
                await r.read()

        # Open the whole pool first, unmeasured: the question is the steady state, and the
        # first handshake storm is the same for both configs.
        await asyncio.gather(*(warm() for _ in range(connections)))
        out.connect_s.clear()
        start = time.perf_counter() + 0.1

        async def one(i: int) -> None:
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            info: dict[str, object] = {}
            try:
                async with session.post(url, json={"prompt": "x"}, trace_request_ctx=info) as r:
                    await r.read()
                    if r.status != 200:
                        out.errors += 1
                        return
            except (aiohttp.ClientError, OSError):
                out.errors += 1
                return
            latency = time.perf_counter() - due
            out.latencies.append(latency)
            (out.new_conn if info.get("new") else out.reused).append(latency)

        await asyncio.gather(*(one(i) for i in range(total)))
    return out


def pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] * 1000


def run_one(
    name: str, settings: EnvoySettings, args: argparse.Namespace, tmp: Path, ctx: ssl.SSLContext
) -> Run:
    path = tmp / f"envoy-{name}.yaml"
    path.write_text(yaml.safe_dump(render(settings), sort_keys=False))
    envoy = subprocess.Popen(
        [
            str(find_envoy()),
            "-c",
            str(path),
            "--concurrency",
            "1",
            "--use-dynamic-base-id",
            "-l",
            "error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    admin = f"http://127.0.0.1:{settings.admin_port}"
    try:
        wait_for(f"{admin}/clusters", "health_flags::healthy")
        url = f"https://127.0.0.1:{settings.listen_port}/v1/infer"
        result = asyncio.run(load(url, args.rate, args.duration, args.connections, ctx))
        s = stats(admin)
    finally:
        envoy.terminate()
        envoy.wait(10)
    lat = sorted(result.latencies)
    sent = int(args.rate * args.duration)
    ssl_key = next(
        (
            k
            for k in s
            if k.startswith("listener.") and k.endswith(".ssl.handshake") and "admin" not in k
        ),
        "",
    )
    return Run(
        config=name,
        sent=sent,
        ok=len(lat),
        errors=result.errors,
        p50_ms=pct(lat, 0.5),
        p99_ms=pct(lat, 0.99),
        p999_ms=pct(lat, 0.999),
        max_ms=(lat[-1] * 1000 if lat else 0),
        within_sla=sum(1 for x in lat if x <= SLA_S) / sent,
        cx_total=s.get("http.ingress.downstream_cx_total", 0),
        handshakes=s.get(ssl_key, 0),
        cx_max_requests=s.get("http.ingress.downstream_cx_max_requests_reached", 0),
        upstream_cx=s.get("cluster.tailguard.upstream_cx_total", 0),
        reconnect_ms=statistics.fmean(result.connect_s) * 1000 if result.connect_s else 0.0,
        p50_new_ms=pct(sorted(result.new_conn), 0.5),
        p50_reused_ms=pct(sorted(result.reused), 0.5),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=600, help="requests per second (open loop)")
    p.add_argument("--duration", type=float, default=30, help="seconds per run")
    p.add_argument("--connections", type=int, default=128, help="client connection pool size")
    p.add_argument("--cap", type=int, default=100, help="max_requests_per_connection (bad)")
    p.add_argument("--repeats", type=int, default=2, help="runs per config, interleaved")
    p.add_argument("--service-ms", type=float, default=2.0, help="stand-in service time")
    p.add_argument(
        "--backend-cmd",
        default=None,
        help="backend command with {python} {port}; default: the stand-in",
    )
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-churn-"))
    cert, key = make_cert(tmp)
    ctx = ssl.create_default_context(cafile=cert)
    ctx.check_hostname = False
    port = free_port()
    template = args.backend_cmd or (
        f"{{python}} {STANDIN} --port {{port}} --service-ms "
        f"{args.service_ms:g} --max-in-flight 100000"
    )
    cmd = [c.format(python=sys.executable, port=port) for c in shlex.split(template)]
    backend = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: list[Run] = []
    try:
        wait_for(f"http://127.0.0.1:{port}/ready", timeout_s=600)
        configs = [("capped", args.cap), ("generated", None)]
        # A discarded warm-up run first (cold TLS and backend paths cost tens of ms on the
        # first connections), then ABBA order so neither config always runs first.
        schedule = [("warm-up", None)] + [
            c for i in range(args.repeats) for c in (configs if i % 2 == 0 else configs[::-1])
        ]
        for name, cap in schedule:
            settings = EnvoySettings(
                replicas=(Replica("127.0.0.1", port),),
                listen_port=free_port(),
                admin_port=free_port(),
                tls_cert=cert,
                tls_key=key,
                downstream_max_requests_per_connection=cap,
                upstream_max_requests_per_connection=cap,
            )
            run = run_one(name, settings, args, tmp, ctx)
            if name != "warm-up":
                runs.append(run)
            time.sleep(2)  # let TIME_WAIT and queues settle between runs
    finally:
        backend.terminate()
        backend.wait(10)

    print(
        f"# bench_churn: TLS, {args.rate:g} req/s open loop, {args.duration:g} s, "
        f"{args.connections} client connections, cap={args.cap}"
    )
    head = (
        "config",
        "sent",
        "ok",
        "err",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "max ms",
        "<=150ms",
        "cx",
        "tls hs",
        "cx/req",
        "max_req",
        "up cx",
        "connect ms",
        "p50 new-cx ms",
        "p50 reused ms",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in runs:
        print(
            f"| {r.config} | {r.sent} | {r.ok} | {r.errors} | {r.p50_ms:.1f} | {r.p99_ms:.1f} "
            f"| {r.p999_ms:.1f} | {r.max_ms:.1f} | {r.within_sla:.4f} | {r.cx_total} "
            f"| {r.handshakes} | {r.cx_total / max(1, r.sent):.4f} | {r.cx_max_requests} "
            f"| {r.upstream_cx} | {r.reconnect_ms:.1f} | {r.p50_new_ms:.1f} "
            f"| {r.p50_reused_ms:.1f} |"
        )

    def med(config: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs if r.config == config)

    print("\nratios capped / generated (medians):")
    for field in ("cx_total", "handshakes", "p50_ms", "p99_ms", "p999_ms", "max_ms"):
        g = med("generated", field)
        print(
            f"  {field:<11} {med('capped', field):>9.1f} / {g:>9.1f} = "
            f"{med('capped', field) / g if g else float('inf'):.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

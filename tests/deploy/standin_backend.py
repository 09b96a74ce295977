"""A small real HTTP backend that stands in for `tailguard serve` in the deploy tests.

It is NOT the tailguard server: it has no engine and no model. It speaks the server's HTTP
contract that Envoy, Prometheus and the fleet tooling depend on: `/ready` (503 until "warm"),
`/health`, `/metrics` (a few names from docs/metrics.md, SLA buckets), `/v1/infer`, and overload
as 503 + Retry-After when more than --max-in-flight requests are inside.

    python tests/deploy/standin_backend.py --port 8001 --name a --service-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tailguard.core.sla import SLA_BUCKETS


def build_app(
    name: str, service_s: float, max_in_flight: int, ready_after_s: float
) -> web.Application:
    registry = CollectorRegistry()
    latency = Histogram(
        "mistral_inference_latency_seconds",
        "server time",
        ["endpoint", "outcome"],
        buckets=SLA_BUCKETS,
        registry=registry,
    )
    requests = Counter(
        "tailguard_requests", "requests answered", ["endpoint", "outcome"], registry=registry
    )
    rejections = Counter("tailguard_rejections", "requests refused", ["reason"], registry=registry)
    in_flight = Gauge("tailguard_requests_in_flight", "admitted, not answered", registry=registry)
    Gauge("tailguard_requests_waiting", "queued", registry=registry)  # no queue: always 0
    Gauge("tailguard_sla_seconds", "SLA", registry=registry).set(0.15)
    Gauge("tailguard_max_num_seqs", "batch capacity", registry=registry).set(max_in_flight)
    started = time.monotonic()
    state = {"in_flight": 0}

    async def ready(_: web.Request) -> web.Response:
        if time.monotonic() - started < ready_after_s:
            return web.json_response({"ready": False}, status=503, headers={"Retry-After": "1"})
        return web.json_response({"ready": True, "replica": name})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def infer(request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        await request.read()
        if state["in_flight"] >= max_in_flight:
            rejections.labels("overloaded").inc()
            requests.labels("infer", "overloaded").inc()
            latency.labels("infer", "overloaded").observe(time.perf_counter() - t0)
            return web.json_response(
                {"error": {"code": "overloaded"}},
                status=503,
                headers={"Retry-After": "1", "X-Replica": name},
            )
        state["in_flight"] += 1
        in_flight.set(state["in_flight"])
        try:
            await asyncio.sleep(service_s)
        finally:
            state["in_flight"] -= 1
            in_flight.set(state["in_flight"])
        requests.labels("infer", "ok").inc()
        latency.labels("infer", "ok").observe(time.perf_counter() - t0)
        return web.json_response({"replica": name, "output": "ok"}, headers={"X-Replica": name})

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/infer", infer)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="standin")
    p.add_argument("--service-ms", type=float, default=5.0)
    p.add_argument("--max-in-flight", type=int, default=64)
    p.add_argument("--ready-after-s", type=float, default=0.0)
    a = p.parse_args()
    app = build_app(a.name, a.service_ms / 1000, a.max_in_flight, a.ready_after_s)
    # keep-alive 75 s like the server's default, so Envoy's 60 s upstream idle timeout closes first
    web.run_app(
        app,
        host=a.host,
        port=a.port,
        print=None,
        keepalive_timeout=75,
        access_log=None,
        backlog=4096,
    )


if __name__ == "__main__":
    main()

"""A small real HTTP server that behaves like tailguard's server under load, for tests and benches.

It speaks the server's overload contract, so `tailguard batch` can be exercised end to end before
(and besides) the real server:

- `slots` requests execute at once; the rest queue in FIFO order. Each executing request takes
  `service_ms * (1 + growth * (busy - 1) / slots)`: more concurrent work makes every step slower
  (as a batched forward pass does), and the queue adds waiting time on top. So latency rises
  with load and a latency-following client has a real gradient to climb down.
- More than `max_in_flight` requests (executing + queued) are refused at once with `503`,
  `Retry-After` and `{"error": {"type": "overloaded", ..., "retry_after_s": ...}}`.
- `queue_deadline_ms`: a request that waited longer than this in the queue gets `504`
  `deadline_expired` without executing.
- `overload_for_s`: for the first N seconds after start every request gets `503` (a server that
  is swamped for a while, then recovers).
- `drop_rate`: that share of requests has its connection closed with no response.

`/v1/infer` needs `prompt` or `input_ids` (else `400`, like the real server). `GET /stats`
returns counters the tests assert on.

    python -m tailguard.tools.batch.simserver --port 0 --slots 16 --service-ms 20

prints `listening on http://127.0.0.1:PORT` on its first line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

__all__ = ["SimConfig", "build_app", "main"]

ROUTES = ("/v1/infer", "/v1/completions", "/v1/chat/completions", "/v1/embeddings")


@dataclass(frozen=True)
class SimConfig:
    slots: int = 16  # requests executing at once
    service_ms: float = 20.0  # time one request takes when it executes alone
    growth: float = 0.5  # extra service time at full occupancy, as a share of service_ms
    max_in_flight: int = 256  # executing + queued; beyond this: 503 + Retry-After
    queue_deadline_ms: float = 0.0  # 0: no deadline; else 504 after waiting this long
    overload_for_s: float = 0.0  # answer 503 to everything for this long after start
    overload_retry_after_s: float = 0.5  # Retry-After sent during that window
    drop_rate: float = 0.0  # share of requests whose connection is closed without answer
    seed: int = 0

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.service_ms < 0 or self.growth < 0:
            raise ValueError("service_ms and growth must be >= 0")
        if self.max_in_flight < self.slots:
            raise ValueError(
                f"max_in_flight ({self.max_in_flight}) must be >= slots ({self.slots}): "
                "a server that refuses work it has room to execute is not a useful model"
            )
        if not 0.0 <= self.drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {self.drop_rate}")

    @property
    def capacity_rps(self) -> float:
        """Completions per second with every slot busy (the server's throughput ceiling)."""
        return self.slots / (
            self.service_ms * (1 + self.growth * (self.slots - 1) / self.slots) / 1000
        )


class _State:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.started = time.monotonic()
        self.sem = asyncio.Semaphore(cfg.slots)
        self.rng = random.Random(cfg.seed)
        self.in_flight = 0
        self.busy = 0
        self.counts: dict[str, int] = {
            "received": 0,
            "ok": 0,
            "overloaded": 0,
            "overload_window": 0,
            "expired": 0,
            "dropped": 0,
            "invalid": 0,
        }
        self.max_in_flight_seen = 0


def _error(status: int, etype: str, message: str, retry_after_s: float | None) -> web.Response:
    err: dict[str, object] = {"message": message, "type": etype, "param": None, "code": etype}
    headers = {}
    if retry_after_s is not None:
        err["retry_after_s"] = retry_after_s
        # Retry-After is integer seconds in HTTP; tailguard also sends fractional values,
        # and clients read the exact figure from the body.
        headers["Retry-After"] = f"{retry_after_s:g}"
    return web.json_response({"error": err}, status=status, headers=headers)


async def _handle(request: web.Request) -> web.StreamResponse:
    st: _State = request.app["state"]
    cfg = st.cfg
    st.counts["received"] += 1
    try:
        body = await request.json()
    except ValueError:
        st.counts["invalid"] += 1
        return _error(400, "invalid_request_error", "body is not valid JSON", None)
    if cfg.overload_for_s > 0 and time.monotonic() - st.started < cfg.overload_for_s:
        st.counts["overloaded"] += 1
        st.counts["overload_window"] += 1
        return _error(503, "overloaded", "server overloaded", cfg.overload_retry_after_s)
    if cfg.drop_rate > 0 and st.rng.random() < cfg.drop_rate:
        st.counts["dropped"] += 1
        if request.transport is not None:
            request.transport.abort()  # RST: the client sees a dropped connection
        raise asyncio.CancelledError  # nothing more to send on this connection
    if request.path == "/v1/infer" and (
        not isinstance(body, dict) or ("prompt" not in body and "input_ids" not in body)
    ):
        st.counts["invalid"] += 1
        return _error(400, "invalid_request_error", "body needs 'prompt' or 'input_ids'", None)
    if st.in_flight >= cfg.max_in_flight:
        st.counts["overloaded"] += 1
        # Time for the queue ahead to drain: what a client should wait before trying again.
        drain_s = st.in_flight / cfg.slots * cfg.service_ms * (1 + cfg.growth) / 1000
        return _error(503, "overloaded", "queue full", round(max(0.05, drain_s), 3))
    st.in_flight += 1
    st.max_in_flight_seen = max(st.max_in_flight_seen, st.in_flight)
    t0 = time.monotonic()
    try:
        async with st.sem:
            queue_ms = (time.monotonic() - t0) * 1000
            if cfg.queue_deadline_ms > 0 and queue_ms > cfg.queue_deadline_ms:
                st.counts["expired"] += 1
                return _error(504, "deadline_expired", "queued past its deadline", None)
            st.busy += 1
            try:
                occupancy = (st.busy - 1) / cfg.slots
                await asyncio.sleep(cfg.service_ms * (1 + cfg.growth * occupancy) / 1000)
            finally:
                st.busy -= 1
            compute_ms = (time.monotonic() - t0) * 1000 - queue_ms
    finally:
        st.in_flight -= 1
    st.counts["ok"] += 1
    request_id = f"infer-{uuid.uuid4().hex[:16]}"
    out = {
        "id": request_id,
        "object": request.path.rsplit("/", 1)[-1],
        "top_k": body.get("top_k") if isinstance(body, dict) else None,
        "output": [1, 2, 3],
        "queue_ms": round(queue_ms, 3),
        "compute_ms": round(compute_ms, 3),
    }
    return web.json_response(out, headers={"x-request-id": request_id})


async def _stats(request: web.Request) -> web.Response:
    st: _State = request.app["state"]
    return web.json_response(
        {**st.counts, "in_flight": st.in_flight, "max_in_flight_seen": st.max_in_flight_seen}
    )


def build_app(cfg: SimConfig) -> web.Application:
    app = web.Application()
    app["state"] = _State(cfg)
    for route in ROUTES:
        app.router.add_post(route, _handle)
    app.router.add_get("/stats", _stats)
    return app


def _parse(argv: list[str] | None) -> tuple[SimConfig, str, int]:
    p = argparse.ArgumentParser(prog="simserver", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    d = SimConfig()
    p.add_argument("--slots", type=int, default=d.slots)
    p.add_argument("--service-ms", type=float, default=d.service_ms)
    p.add_argument("--growth", type=float, default=d.growth)
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight)
    p.add_argument("--queue-deadline-ms", type=float, default=d.queue_deadline_ms)
    p.add_argument("--overload-for-s", type=float, default=d.overload_for_s)
    p.add_argument("--overload-retry-after-s", type=float, default=d.overload_retry_after_s)
    p.add_argument("--drop-rate", type=float, default=d.drop_rate)
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    cfg = SimConfig(
        slots=a.slots,
        service_ms=a.service_ms,
        growth=a.growth,
        max_in_flight=a.max_in_flight,
        queue_deadline_ms=a.queue_deadline_ms,
        overload_for_s=a.overload_for_s,
        overload_retry_after_s=a.overload_retry_after_s,
        drop_rate=a.drop_rate,
        seed=a.seed,
    )
    return cfg, a.host, a.port


async def _serve(cfg: SimConfig, host: str, port: int) -> None:
    runner = web.AppRunner(build_app(cfg), access_log=None, handle_signals=True)
    await runner.setup()
    # A deep backlog: the runbook-style client opens thousands of connections at once.
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    bound = runner.addresses[0][1]  # the port the kernel chose for --port 0
    print(f"listening on http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    cfg, host, port = _parse(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(cfg, host, port))
    return 0


if __name__ == "__main__":
    sys.exit(main())

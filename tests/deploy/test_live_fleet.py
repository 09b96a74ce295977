"""Envoy in front of real backend processes.

By default the backends are the STAND-IN (tests/deploy/standin_backend.py), not the tailguard
server; BACKEND in conftest.py (or TAILGUARD_DEPLOY_BACKEND=server) runs the same tests against
`tailguard serve --engine simulated`. Replica counts come from Envoy's per-host counters, so
no test depends on a stand-in-only header.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from .conftest import (
    BACKEND,
    BACKEND_CMD,
    STANDIN_ONLY,
    Backend,
    Envoy,
    free_port,
    http_get,
    wait_for,
)


@dataclass(frozen=True)
class Result:
    status: int  # 0: the client saw an exception (a lost request)
    retry_after: str | None
    latency_s: float
    error: str = ""


async def _load(
    url: str,
    total: int,
    concurrency: int,
    *,
    ssl_ctx: ssl.SSLContext | None = None,
    on_progress: Any = None,
) -> list[Result]:
    """Closed-loop keep-alive load: `concurrency` connections, `total` POSTs."""
    results: list[Result] = []
    sent = 0
    connector = aiohttp.TCPConnector(limit=concurrency, ssl=ssl_ctx if ssl_ctx else False)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal sent
            while sent < total:
                sent += 1
                if on_progress is not None:
                    on_progress(sent)
                t0 = time.perf_counter()
                try:
                    async with session.post(url, json={"prompt": "x"}) as resp:
                        await resp.read()
                        results.append(
                            Result(
                                resp.status,
                                resp.headers.get("Retry-After"),
                                time.perf_counter() - t0,
                            )
                        )
                except (aiohttp.ClientError, OSError) as exc:
                    results.append(Result(0, None, time.perf_counter() - t0, repr(exc)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def _survivor_sla_share(backend: Backend) -> tuple[float, float]:
    """(ok answered, within 0.15 s) from the backend's own histogram."""
    _, text = http_get(f"{backend.url}/metrics")
    count = within = 0.0
    for line in text.splitlines():
        if 'outcome="ok"' not in line:
            continue
        if line.startswith("mistral_inference_latency_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith("mistral_inference_latency_seconds_bucket") and 'le="0.15"' in line:
            within += float(line.rsplit(" ", 1)[1])
    return count, within


def test_balanced_and_sigkill_mid_load_loses_no_request(
    start_backend: Any, start_envoy: Any
) -> None:
    a: Backend = start_backend("a", "--service-ms", "5")
    b: Backend = start_backend("b", "--service-ms", "5")
    envoy: Envoy = start_envoy([a, b])
    url = f"http://127.0.0.1:{envoy.listen_port}/v1/infer"

    before_kill: dict[str, int] = {}

    def kill_b(sent: int) -> None:
        if sent == 300:
            before_kill.update(a=envoy.host_counter(a.port), b=envoy.host_counter(b.port))
            b.kill()  # SIGKILL: in-flight requests on b see a reset, new ones a refused connect

    results = asyncio.run(_load(url, 900, 16, on_progress=kill_b))
    assert len(results) == 900
    lost = [
        r
        for r in results
        if not (r.status == 200 or (r.status == 503 and r.retry_after is not None))
    ]
    assert not lost, f"{len(lost)} requests lost, e.g. {lost[:3]}"
    # least-request spread the load before the kill; after it only a served
    assert before_kill["a"] > 60 and before_kill["b"] > 60, before_kill
    assert envoy.host_counter(a.port, "rq_success") >= 900 - before_kill["b"] - 16
    stats = envoy.stats()
    # The kill was absorbed by retries or ejection, not passed on to clients.
    assert (
        stats["cluster.tailguard.upstream_rq_retry"]
        + stats["cluster.tailguard.outlier_detection.ejections_enforced_total"]
        >= 1
    ), stats
    count, within = _survivor_sla_share(a)
    assert count > 500 and within / count >= 0.99, (count, within)

    # With no replica left, Envoy's own 503 still carries Retry-After.
    a.kill()
    wait_for(lambda: envoy.healthy_hosts() == 0, 15, "Envoy to mark both replicas down")
    status = asyncio.run(_load(url, 1, 1))[0]
    assert status.status == 503 and status.retry_after == "1", status


@pytest.mark.skipif(BACKEND != "standin", reason=STANDIN_ONLY)
def test_overload_503_is_retried_after_retry_after(start_backend: Any, start_envoy: Any) -> None:
    slow: Backend = start_backend("slow", "--service-ms", "300", "--max-in-flight", "1")
    envoy: Envoy = start_envoy([slow])
    url = f"http://127.0.0.1:{envoy.listen_port}/v1/infer"
    results = asyncio.run(_load(url, 3, 3))
    assert all(r.status == 200 for r in results), results
    # Two of the three were refused at first; Envoy waited the Retry-After (1 s), then retried.
    waited = sorted(r.latency_s for r in results)
    assert waited[-1] >= 0.9, waited
    assert envoy.stats()["cluster.tailguard.upstream_rq_retry_backoff_ratelimited"] >= 1


def _client_ctx(cert: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=cert)
    ctx.check_hostname = False
    return ctx


def test_connection_churn_reproduced_and_visible_in_envoy_counters(
    start_backend: Any, start_envoy: Any, tls_files: tuple[str, str]
) -> None:
    cert, key = tls_files
    backend: Backend = start_backend("a", "--service-ms", "1")
    capped: Envoy = start_envoy(
        [backend],
        tls_cert=cert,
        tls_key=key,
        downstream_max_requests_per_connection=100,
        upstream_max_requests_per_connection=100,
    )
    generated: Envoy = start_envoy([backend], tls_cert=cert, tls_key=key)
    total, conns = 1000, 4
    counts = {}
    for name, envoy in (("capped", capped), ("generated", generated)):
        url = f"https://127.0.0.1:{envoy.listen_port}/v1/infer"
        results = asyncio.run(_load(url, total, conns, ssl_ctx=_client_ctx(cert)))
        assert all(r.status == 200 for r in results), Counter(r.error for r in results)
        counts[name] = envoy.stats()
    cx = {n: s["http.ingress.downstream_cx_total"] for n, s in counts.items()}
    # capped: a connection closes at its 100th request; however the client spreads requests
    # over its connections, at least (total - conns * 99) / 100 closes must happen.
    closes = (total - conns * 99) // 100
    assert counts["capped"]["http.ingress.downstream_cx_max_requests_reached"] >= closes
    assert cx["capped"] >= conns + closes, cx
    assert counts["capped"]["cluster.tailguard.upstream_cx_max_requests"] >= 1
    # generated: one handshake per client connection, whatever the request count
    assert cx["generated"] <= conns, cx
    assert counts["generated"]["http.ingress.downstream_cx_max_requests_reached"] == 0
    assert cx["capped"] > cx["generated"]


def test_fleet_up_status_down(tmp_path: Path) -> None:
    listen, admin = free_port(), free_port()
    state = tmp_path / "fleet"
    base = [sys.executable, "-m", "tailguard.cli", "fleet"]
    up = subprocess.run(
        [
            *base,
            "up",
            "--replicas",
            "2",
            "--base-port",
            "0",
            "--listen",
            f"127.0.0.1:{listen}",
            "--admin-port",
            str(admin),
            "--state-dir",
            str(state),
            "--drain-time-s",
            "1",
            "--server-cmd",
            " ".join(BACKEND_CMD).replace("{name}", "r{index}"),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"http://127.0.0.1:{listen}" in up.stdout
        assert f"http://127.0.0.1:{admin}/stats/prometheus" in up.stdout
        results = asyncio.run(_load(f"http://127.0.0.1:{listen}/v1/infer", 60, 4))
        assert {r.status for r in results} == {200}
        fleet = json.loads((state / "fleet.json").read_text())
        admin_url = f"http://127.0.0.1:{admin}"
        for replica in fleet["replicas"]:  # Envoy sent each replica a share
            _, body = http_get(f"{admin_url}/clusters")
            sent = [
                line
                for line in body.splitlines()
                if line.startswith(f"tailguard::127.0.0.1:{replica['port']}::rq_total::")
            ]
            assert sent and int(sent[0].rsplit("::", 1)[1]) > 5, body
        status = subprocess.run(
            [*base, "status", "--state-dir", str(state)], capture_output=True, text=True, timeout=30
        )
        assert status.returncode == 0 and status.stdout.count(" ready") == 3, status.stdout
        # A config Envoy refuses is caught before the restart; the running Envoy is untouched.
        bad = tmp_path / "bad.yaml"
        bad.write_text((state / "envoy.yaml").read_text().replace("lb_policy", "lb_polcy"))
        refused = subprocess.run(
            [*base, "reload", "--state-dir", str(state), "--envoy-config", str(bad)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and "nothing changed" in refused.stderr, refused.stderr
        # Hot restart under load: epoch 1 takes over, no request fails.
        during = subprocess.Popen(
            [*base, "reload", "--state-dir", str(state)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        results = asyncio.run(_load(f"http://127.0.0.1:{listen}/v1/infer", 400, 4))
        out, err = during.communicate(timeout=60)
        assert during.returncode == 0, out + err
        assert "epoch 1 serves" in out
        assert {r.status for r in results} == {200}, Counter(r.error for r in results)
        info = json.loads(http_get(f"http://127.0.0.1:{admin}/server_info")[1])
        assert int(info["command_line_options"]["restart_epoch"]) == 1
        assert {
            r.status for r in asyncio.run(_load(f"http://127.0.0.1:{listen}/v1/infer", 20, 2))
        } == {200}
        again = subprocess.run(
            [*base, "up", "--state-dir", str(state)], capture_output=True, text=True, timeout=30
        )
        assert again.returncode == 2 and "already running" in again.stderr
    finally:
        down = subprocess.run(
            [*base, "down", "--state-dir", str(state)], capture_output=True, text=True, timeout=60
        )
    assert down.returncode == 0, down.stdout + down.stderr
    # epoch 1 and the two replicas; epoch 0 has drained and exited (or is stopped now)
    assert down.stdout.count("stopped (SIGTERM)") >= 3, down.stdout
    pids = [int(line.split()[2]) for line in status.stdout.splitlines() if " pid " in line]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), pid
    assert http_get(f"http://127.0.0.1:{admin}/ready", 0.5)[0] == 0
    assert not (state / "fleet.json").exists()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_fleet_down_without_fleet_says_how(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tailguard.cli", "fleet", "down", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ},
    )
    assert out.returncode == 2 and "tailguard fleet up" in out.stderr

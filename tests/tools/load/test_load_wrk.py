"""Cross-check against an external tool: same local server, p50 within 20 % of wrk's."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tailguard.tools.load.config import LoadConfig, Profile
from tailguard.tools.load.runner import run_load

_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def _wrk() -> str:
    path = shutil.which("wrk")
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("wrk not installed (Debian package 'wrk'; `make promtool` installs it)")
    install = ["apt-get", "install", "-y", "-q", "wrk"]
    if subprocess.run(install, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, check=True)
        subprocess.run(install, capture_output=True, check=True)
    found = shutil.which("wrk")
    assert found, "apt-get installed wrk but it is not on PATH"
    return found


def _wrk_p50(output: str) -> float:
    m = re.search(r"^\s+50%\s+([0-9.]+)(us|ms|s)\s*$", output, re.M)
    assert m, f"no p50 in wrk output:\n{output}"
    return float(m.group(1)) * _UNIT[m.group(2)]


def test_p50_within_20_percent_of_wrk(local_server, tmp_path: Path) -> None:
    wrk = _wrk()
    # A 50 ms service time, like a small model server, at 4 connections (~80 req/s): this checks
    # that both tools time the same thing; client throughput is bench/bench_load.py's job, and a
    # light load keeps a busy shared machine's scheduling delays well under the 20 % margin.
    srv = local_server("--delay", "0.05")
    script = tmp_path / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.body = \'{"prompt": "hi", "top_k": 5}\'\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    out = subprocess.run(
        [wrk, "-t1", "-c4", "-d2s", "--latency", "-s", str(script), srv.url + "/v1/infer"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    wrk_p50 = _wrk_p50(out.stdout)
    cfg = LoadConfig(srv.url, Profile("closed", concurrency=4, requests=200))
    res = asyncio.run(run_load(cfg))
    ours = res.summary.latency.p50
    assert res.summary.ok == 200 and ours is not None
    assert abs(ours - wrk_p50) <= 0.2 * wrk_p50, (ours, wrk_p50)

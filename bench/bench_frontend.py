"""Front-end overhead: tailguard's full HTTP + admission path vs a raw uvicorn ASGI echo app.

Both run as single-process servers on this machine in the same run; the model is replaced by the
instant stub (`tailguard serve --engine stub`), so the figure is the cost of parsing, validation,
tokenization, admission, the engine-client round trip, the cache and the metrics. The load
generator is wrk (Debian package `wrk`), 64 keep-alive connections, POST /v1/infer.

    .venv/bin/python bench/bench_frontend.py [--duration 10] [--connections 64]

Target: tailguard >= 0.5x the raw app's requests/s.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tailguard.tools.lab.procs import free_port, serving

RAW_APP = """
import orjson

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    out = orjson.dumps({"echo": len(body)})
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})
"""

BODY = '{"prompt": "The quick brown fox jumps over the lazy dog", "top_k": 5}'


def wrk(url: str, duration: int, connections: int, script: Path) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)

    def lat(label: str) -> float:
        m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)\b", out)
        if not m:
            return float("nan")
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    return {
        "rps": rps,
        "p50_ms": lat("50%"),
        "p99_ms": lat("99%"),
        "non_2xx": float(errors.group(1)) if errors else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--connections", type=int, default=64)
    args = ap.parse_args()
    if not shutil.which("wrk"):
        print("wrk is missing: apt-get install -y wrk", file=sys.stderr)
        return 2
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        lua = Path(tmp) / "post.lua"
        lua.write_text(
            'wrk.method = "POST"\nwrk.body = \'' + BODY + "'\n"
            'wrk.headers["Content-Type"] = "application/json"\n'
        )
        (Path(tmp) / "rawapp.py").write_text(RAW_APP)
        results: dict[str, dict[str, float]] = {}
        port = free_port()
        raw_cmd = [
            py,
            "-m",
            "uvicorn",
            "rawapp:app",
            "--port",
            str(port),
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            "--no-access-log",
            "--log-level",
            "warning",
        ]
        log = Path(tmp) / "raw.log"
        ready = f"http://127.0.0.1:{port}/"
        with serving("raw ASGI app", raw_cmd, log, ready, env={"PYTHONPATH": tmp}):
            wrk(f"http://127.0.0.1:{port}/v1/infer", 2, args.connections, lua)  # warm-up
            results["raw uvicorn ASGI echo"] = wrk(
                f"http://127.0.0.1:{port}/v1/infer", args.duration, args.connections, lua
            )
        time.sleep(2)
        port = free_port()
        tg_cmd = [
            py,
            "-m",
            "tailguard.cli",
            "serve",
            "--engine",
            "stub",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        log = Path(tmp) / "tailguard.log"
        with serving("tailguard", tg_cmd, log, f"http://127.0.0.1:{port}/ready"):
            wrk(f"http://127.0.0.1:{port}/v1/infer", 2, args.connections, lua)
            results["tailguard (stub engine)"] = wrk(
                f"http://127.0.0.1:{port}/v1/infer", args.duration, args.connections, lua
            )
    print(
        f"\nfront-end overhead: POST /v1/infer, {args.connections} keep-alive connections, "
        f"wrk -t1, {args.duration} s, {os.cpu_count()} cores"
    )
    print(f"{'server':28} {'req/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>8}")
    for name, r in results.items():
        print(
            f"{name:28} {r['rps']:>10.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{r['non_2xx']:>8.0f}"
        )
    ratio = results["tailguard (stub engine)"]["rps"] / results["raw uvicorn ASGI echo"]["rps"]
    print(f"tailguard / raw = {ratio:.2f}x (target >= 0.5x): {'PASS' if ratio >= 0.5 else 'MISS'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

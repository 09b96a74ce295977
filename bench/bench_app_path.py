"""The app path alone, in-process: compiled request path vs pure Python, side by side.

`App.handle` on a recording connection (no sockets), the stub engine, the front-end bench's
`POST /v1/infer` body, 64 requests in flight at a time; each side runs in its own process
(`TAILGUARD_COMPILED=0` for pure Python), alternating, best of `--rounds`:

    .venv/bin/python bench/bench_app_path.py [--requests 64000] [--rounds 2]

Prints microseconds per request for each and their ratio. Without a compiled build for the
current sources (`make compiled`) both sides are pure Python, and the report says so.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from tailguard.compiled import ENV_SWITCH, status

CHILD = r"""
import asyncio, gc, sys, time
import uvloop
from tailguard.compiled import status
from tailguard.server.call import Call
from tailguard.server.cli import build_app
from tailguard.server.config import load_config

BODY = b'{"prompt": "The quick brown fox jumps over the lazy dog", "top_k": 5}'
HEADERS = {b"host": b"127.0.0.1", b"content-type": b"application/json",
           b"content-length": str(len(BODY)).encode()}


class Conn:
    status = 0

    def send_response(self, call, status, headers, body):
        self.status = status

    def send_head(self, call, status, headers):
        raise AssertionError("no streams here")

    async def send_chunk(self, call, data, more):
        raise AssertionError("no streams here")


async def main(n):
    app = build_app(load_config(None, {"engine": "stub", "log_level": "warning"}))
    await app.startup()
    while not app.engine.ready:
        await asyncio.sleep(0.01)
    conn = Conn()
    loop = asyncio.get_running_loop()

    async def one():
        call = Call("POST", "/v1/infer", dict(HEADERS), BODY, "127.0.0.1", conn)
        call.t_arrival = time.monotonic()
        call.task = asyncio.current_task()
        await app.handle(call)
        assert conn.status == 200, conn.status

    for _ in range(2000):  # warm-up
        await loop.create_task(one())
    t = time.perf_counter()
    for _ in range(n // 64):
        await asyncio.gather(*[loop.create_task(one()) for _ in range(64)])
    us = (time.perf_counter() - t) / (n // 64 * 64) * 1e6
    await app.shutdown()
    print(f"{us:.2f} {int(status()[0])}")


gc.set_threshold(50_000, 20, 20)  # as `tailguard serve` does
uvloop.run(main(int(sys.argv[1])))
"""


def run(n: int, pure: bool) -> tuple[float, bool]:
    env = {**os.environ, ENV_SWITCH: "0"} if pure else dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(n)], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[0]), out[1] == "1"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64_000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    compiled_us: list[float] = []
    pure_us: list[float] = []
    ran_compiled = False
    for _ in range(args.rounds):
        us, ran_compiled = run(args.requests, pure=False)
        compiled_us.append(us)
        pure_us.append(run(args.requests, pure=True)[0])
    why = status()[1]
    print(
        f"app path in-process, POST /v1/infer, stub engine, {args.requests} requests x 64 in flight"
    )
    print(f"compiled      {min(compiled_us):7.2f} us/request  (runs: {compiled_us})")
    print(f"pure Python   {min(pure_us):7.2f} us/request  (runs: {pure_us})")
    if not ran_compiled:
        print(f"NOTE: no compiled build was used ({why}): both rows are pure Python")
    print(f"pure / compiled = {min(pure_us) / min(compiled_us):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

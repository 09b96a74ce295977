"""Front-end overhead: tailguard's full HTTP + admission path vs raw echo apps, and vs granian.

All run as single-process servers on this machine in the same run, one after the other:
- raw uvicorn ASGI echo: uvicorn (uvloop + httptools) answering `{"echo": n}`, no app work;
- raw granian RSGI echo: the same echo on granian (Rust HTTP, 1 worker, 1 runtime thread);
- granian + tailguard App: granian serving tailguard's own `App.handle` (the same app path:
  parsing, validation, tokenization, admission, engine stub, cache, metrics) through a thin RSGI
  adapter, i.e. what we would run if granian replaced our HTTP layer (server/http.py);
- tailguard HTTP layer, echo: our own HTTP/1.1 layer (server/http*.py) with the echo in place
  of the App: what the layer itself costs per request, apart from the app path;
- tailguard (stub engine): `tailguard serve --engine stub`, our own HTTP/1.1 layer, on the
  compiled request path when it is built (tailguard.compiled; the report says which);
- tailguard, pure Python: the same with `TAILGUARD_COMPILED=0` (the compiled path's A/B).
The model is replaced by the instant stub, so the figures are the front end's cost. The load
generator is wrk (Debian package `wrk`), 64 keep-alive connections, POST /v1/infer.

    .venv/bin/python bench/bench_frontend.py [--duration 10] [--connections 64] [--no-granian]
                                             [--no-pure] [--ab-src ../other-checkout/src]

Target: tailguard >= 0.5x the raw uvicorn echo's requests/s. The granian + App row says whether
our own HTTP layer still earns its keep against a maintained server with its own limits.
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

from tailguard.compiled import ENV_SWITCH, status
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

RAW_RSGI = """
import orjson

class App:
    async def __rsgi__(self, scope, proto):
        body = await proto()
        proto.response_bytes(200, [("content-type", "application/json")],
                             orjson.dumps({"echo": len(body)}))

app = App()
"""

# tailguard's App behind granian: the same Call / Conn path our HTTP layer drives.
TG_RSGI = """
import asyncio, gc
from tailguard.server.app import Call
from tailguard.server.cli import build_app
from tailguard.server.config import load_config

gc.set_threshold(50_000, 20, 20)  # as `tailguard serve` does


class _Conn:
    __slots__ = ("status", "headers", "body")

    def send_response(self, call, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def send_head(self, call, status, headers):
        raise NotImplementedError("streams are not part of this benchmark")

    async def send_chunk(self, call, data, more):
        raise NotImplementedError


class Adapter:
    def __init__(self):
        self.app = build_app(load_config(None, {"engine": "stub", "log_level": "warning"}))
        self.started = None

    async def _start(self):
        await self.app.startup()
        while not self.app.engine.ready:
            await asyncio.sleep(0.01)

    async def __rsgi__(self, scope, proto):
        if self.started is None:
            self.started = asyncio.ensure_future(self._start())
        await self.started
        body = await proto()
        headers = {k.encode(): v.encode() for k, v in scope.headers.items()}
        conn = _Conn()
        call = Call(scope.method, scope.path, headers, body, scope.client, conn)
        call.task = asyncio.current_task()
        await self.app.handle(call)
        proto.response_bytes(
            conn.status, [(k.decode(), v.decode()) for k, v in conn.headers], conn.body
        )


app = Adapter()
"""

# tailguard's own HTTP layer with an echo in place of the App: the layer's own cost per request
# (parse, limits, Call, a task, one write), apart from the app path.
TG_ECHO = """
import asyncio, gc, sys
import orjson, uvloop
from tailguard.server.cli import build_app
from tailguard.server.config import load_config
from tailguard.server.serving import bind, start_server


class EchoApp:
    def __init__(self, app):
        self.config, self.metrics = app.config, app.metrics  # limits, connection counters

    def precheck(self, call):
        return None

    async def handle(self, call):
        call.respond(200, orjson.dumps({"echo": len(call.body)}))


async def main(port):
    app = build_app(load_config(None, {"engine": "stub", "log_level": "warning"}))
    await start_server(EchoApp(app), bind("127.0.0.1", port, 1024))
    await asyncio.Event().wait()


gc.set_threshold(50_000, 20, 20)  # as `tailguard serve` does
uvloop.run(main(int(sys.argv[1])))
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


def granian_cmd(py: str, target: str, port: int) -> list[str]:
    return [
        py,
        "-m",
        "granian",
        "--interface",
        "rsgi",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--runtime-threads",
        "1",
        "--loop",
        "uvloop",
        "--http",
        "1",
        "--no-ws",
        "--log-level",
        "warning",
        target,
    ]


Server = tuple[str, list[str], str]  # name, command, ready URL
PURE = "tailguard, pure Python"


def _servers(args: argparse.Namespace, tmp: str) -> list[Server]:
    """Every server of the run, in the order they are measured."""
    py = sys.executable

    def url(port: int, path: str = "") -> str:
        return f"http://127.0.0.1:{port}/{path}"

    servers: list[Server] = []
    port = free_port()
    uvicorn = [py, "-m", "uvicorn", "rawapp:app", "--port", str(port), "--loop", "uvloop"]
    uvicorn += ["--http", "httptools", "--no-access-log", "--log-level", "warning"]
    servers.append(("raw uvicorn ASGI echo", uvicorn, url(port)))
    if not args.no_granian:
        port = free_port()
        servers.append(("raw granian RSGI echo", granian_cmd(py, "rawrsgi:app", port), url(port)))
        port = free_port()
        servers.append(
            ("granian + tailguard App", granian_cmd(py, "tgrsgi:app", port), url(port, "health"))
        )
    port = free_port()
    echo = [py, str(Path(tmp) / "tgecho.py"), str(port)]
    servers.append(("tailguard HTTP layer, echo", echo, url(port)))
    names = ["tailguard (stub engine)"]
    names += [] if args.no_pure else [PURE]
    names += ["tailguard, --ab-src"] if args.ab_src else []
    for name in names:
        port = free_port()
        cmd = [py, "-m", "tailguard.cli", "serve", "--engine", "stub", "--port", str(port)]
        servers.append((name, [*cmd, "--log-level", "warning"], url(port, "ready")))
    return servers


def _report(args: argparse.Namespace, results: dict[str, dict[str, float]]) -> None:
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
    tg = results["tailguard (stub engine)"]["rps"]
    raw = results["raw uvicorn ASGI echo"]["rps"]
    ratio = tg / raw
    print(f"tailguard / raw = {ratio:.2f}x (target >= 0.5x): {'PASS' if ratio >= 0.5 else 'MISS'}")
    layer = results["tailguard HTTP layer, echo"]["rps"]
    print(f"tailguard HTTP layer echo / raw uvicorn echo = {layer / raw:.2f}x (the layer alone)")
    if "granian + tailguard App" in results:
        own = tg / results["granian + tailguard App"]["rps"]
        print(f"tailguard / granian + tailguard App = {own:.2f}x (our HTTP layer vs granian's)")
    compiled, why = status()
    print(f"tailguard ran {'compiled (mypyc)' if compiled else 'as pure Python'}: {why}")
    if PURE in results:
        print(f"tailguard / tailguard pure Python = {tg / results[PURE]['rps']:.2f}x")
    if "tailguard, --ab-src" in results:
        ab = tg / results["tailguard, --ab-src"]["rps"]
        print(f"tailguard / tailguard from --ab-src = {ab:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--no-granian", action="store_true", help="skip the two granian rows")
    ap.add_argument("--no-pure", action="store_true", help="skip the pure-Python tailguard row")
    ap.add_argument(
        "--ab-src",
        metavar="DIR",
        help="also run `tailguard serve` from another checkout's src folder, right after ours "
        "(an A/B of two versions in the same run)",
    )
    args = ap.parse_args()
    if not shutil.which("wrk"):
        print("wrk is missing: apt-get install -y wrk", file=sys.stderr)
        return 2
    src = str(Path(__file__).resolve().parents[1] / "src")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        lua = Path(tmp) / "post.lua"
        lua.write_text(
            'wrk.method = "POST"\nwrk.body = \'' + BODY + "'\n"
            'wrk.headers["Content-Type"] = "application/json"\n'
        )
        for name, code in (("rawapp", RAW_APP), ("rawrsgi", RAW_RSGI), ("tgrsgi", TG_RSGI)):
            (Path(tmp) / f"{name}.py").write_text(code)
        (Path(tmp) / "tgecho.py").write_text(TG_ECHO)
        path = os.pathsep.join([tmp, src, os.environ.get("PYTHONPATH", "")])
        for i, (name, cmd, ready) in enumerate(_servers(args, tmp)):
            if i:
                time.sleep(2)
            base = ready.rsplit("/", 1)[0]
            env = {"PYTHONPATH": path}
            if name == PURE:
                env[ENV_SWITCH] = "0"
            if name == "tailguard, --ab-src":
                env = {"PYTHONPATH": os.pathsep.join([str(Path(args.ab_src).resolve()), path])}
            with serving(name, cmd, Path(tmp) / f"server{i}.log", ready, env=env):
                wrk(f"{base}/v1/infer", 2, args.connections, lua)  # warm-up
                results[name] = wrk(f"{base}/v1/infer", args.duration, args.connections, lua)
    _report(args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

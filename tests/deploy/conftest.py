"""Real processes for the deploy tests: backends, Envoy, TLS files.

The backend behind Envoy is chosen by ONE line, BACKEND below: "standin" runs
tests/deploy/standin_backend.py (an aiohttp app with the server's HTTP contract, NOT the
tailguard server); "server" runs `tailguard serve --engine simulated`. The environment variable
TAILGUARD_DEPLOY_BACKEND overrides it for a run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tailguard.deploy.envoy import EnvoySettings, Replica, find_envoy, render
from tailguard.deploy.tls import self_signed_cert
from tailguard.tools.lab.procs import free_port

HERE = Path(__file__).parent
REPO = HERE.parent.parent
STANDIN = HERE / "standin_backend.py"

BACKEND = os.environ.get("TAILGUARD_DEPLOY_BACKEND", "server")  # the one line: or "standin"

# {python}, {port} and {name} are filled in per replica.
BACKEND_CMDS = {
    "standin": ["{python}", str(STANDIN), "--port", "{port}", "--name", "{name}"],
    "server": [
        "{python}",
        "-m",
        "tailguard.cli",
        "serve",
        "--engine",
        "simulated",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
    ],
}
BACKEND_CMD = BACKEND_CMDS[BACKEND]
STANDIN_ONLY = "needs the stand-in's knobs (--service-ms, --max-in-flight)"


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def wait_for(
    check: Callable[[], bool],
    timeout_s: float,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@dataclass
class Backend:
    name: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(5)


@dataclass
class Envoy:
    proc: subprocess.Popen[bytes]
    listen_port: int
    admin_port: int
    config_path: Path

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def stats(self) -> dict[str, int]:
        status, body = http_get(f"{self.admin}/stats?format=json")
        assert status == 200, body
        return {
            s["name"]: int(s["value"])
            for s in json.loads(body)["stats"]
            if "value" in s and isinstance(s["value"], int)
        }

    def host_counter(self, port: int, counter: str = "rq_total") -> int:
        """A per-replica counter from /clusters, e.g. requests Envoy sent to that port."""
        _, body = http_get(f"{self.admin}/clusters")
        prefix = f"tailguard::127.0.0.1:{port}::{counter}::"
        return sum(
            int(line[len(prefix) :]) for line in body.splitlines() if line.startswith(prefix)
        )

    def healthy_hosts(self, cluster: str = "tailguard") -> int:
        _, body = http_get(f"{self.admin}/clusters")
        return sum(
            1
            for line in body.splitlines()
            if line.startswith(f"{cluster}::") and line.endswith("health_flags::healthy")
        )


@pytest.fixture
def start_backend() -> Iterator[Callable[..., Backend]]:
    started: list[Backend] = []

    def start(name: str, *standin_extra: str) -> Backend:
        """standin_extra: stand-in flags (--service-ms ...); ignored for the real server."""
        port = free_port()
        fields = {"python": sys.executable, "port": port, "name": name}
        cmd = [part.format(**fields) for part in BACKEND_CMD]
        if BACKEND == "standin":
            cmd += standin_extra
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        backend = Backend(name, port, proc)
        started.append(backend)
        wait_for(
            lambda: http_get(f"{backend.url}/ready", 0.5)[0] == 200,
            120.0,
            f"backend {name} /ready",
            proc,
        )
        return backend

    yield start
    for b in started:
        if b.proc.poll() is None:
            b.proc.terminate()
    for b in started:
        try:
            b.proc.wait(10)
        except subprocess.TimeoutExpired:
            b.proc.kill()


@pytest.fixture
def start_envoy(tmp_path: Path) -> Iterator[Callable[..., Envoy]]:
    started: list[Envoy] = []

    def start(
        backends: list[Backend],
        *,
        config_edit: Callable[[dict[str, Any]], None] | None = None,
        wait_healthy: bool = True,
        **settings: Any,
    ) -> Envoy:
        listen, admin = free_port(), free_port()
        s = EnvoySettings(
            replicas=tuple(Replica("127.0.0.1", b.port) for b in backends),
            listen_port=listen,
            admin_port=admin,
            **settings,
        )
        config = render(s)
        if config_edit is not None:
            config_edit(config)
        path = tmp_path / f"envoy-{len(started)}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        log = (tmp_path / f"envoy-{len(started)}.log").open("wb")
        proc = subprocess.Popen(
            [
                str(find_envoy()),
                "-c",
                str(path),
                "--concurrency",
                "1",
                "--use-dynamic-base-id",
                "-l",
                "warn",
                "--drain-time-s",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        envoy = Envoy(proc, listen, admin, path)
        started.append(envoy)
        wait_for(
            lambda: http_get(f"{envoy.admin}/ready", 0.5)[0] == 200, 20.0, "Envoy /ready", proc
        )
        if wait_healthy:
            wait_for(
                lambda: envoy.healthy_hosts() == len(backends),
                20.0,
                "Envoy to see every backend healthy",
                proc,
            )
        return envoy

    yield start
    for e in started:
        if e.proc.poll() is None:
            e.proc.terminate()
        try:
            e.proc.wait(10)
        except subprocess.TimeoutExpired:
            e.proc.kill()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 / localhost (openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI missing")
    cert, key = self_signed_cert(tmp_path_factory.mktemp("tls"), rsa=True)
    return str(cert), str(key)

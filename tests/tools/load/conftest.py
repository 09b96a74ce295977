"""Real local HTTP servers (tailguard.tools.load.testserver in a subprocess) for load tests."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest


class LocalServer:
    def __init__(self, *options: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tailguard.tools.load.testserver", *options],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "LISTENING <port>" once it accepts
        if not line.startswith("LISTENING"):
            self.proc.kill()
            raise RuntimeError(f"test server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(self.url + "/stats", timeout=5) as resp:
            return dict(json.load(resp))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=5)


@pytest.fixture
def local_server() -> Iterator[Callable[..., LocalServer]]:
    """Factory: local_server("--delay", "0.01") starts a fresh server; all are killed after."""
    started: list[LocalServer] = []

    def start(*options: str) -> LocalServer:
        srv = LocalServer(*options)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


class SimulatedServer:
    """`tailguard serve --engine simulated` in a subprocess: the real HTTP server, no model."""

    def __init__(self, *options: str) -> None:
        cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--engine", "simulated"]
        self.proc = subprocess.Popen(
            [*cmd, "--port", "0", *options],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        seen = []
        for line in self.proc.stdout:  # "tailguard: listening on http://127.0.0.1:PORT (...)"
            seen.append(line)
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].split()[0]
                break
        else:
            self.proc.kill()
            raise RuntimeError(f"simulated server did not start: {''.join(seen)}")
        # keep reading its log so a full pipe never blocks the server
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        deadline = time.monotonic() + 20
        while self._status("/ready") != 200:
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("simulated server never became ready")
            time.sleep(0.05)

    def _status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    def metric(self, name: str) -> float:
        """Sum of every sample of one metric in /metrics (0 when it has none yet)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return sum(
            float(line.rsplit(None, 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and line[len(name)] in "{ "
        )

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=5)


@pytest.fixture
def simulated_server() -> Iterator[Callable[..., SimulatedServer]]:
    started: list[SimulatedServer] = []

    def start(*options: str) -> SimulatedServer:
        srv = SimulatedServer(*options)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()

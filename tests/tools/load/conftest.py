"""Real local HTTP servers (tailguard.tools.load.testserver in a subprocess) for load tests."""

from __future__ import annotations

import json
import subprocess
import sys
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

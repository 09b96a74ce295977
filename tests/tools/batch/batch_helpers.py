"""Real local servers and real `tailguard batch` processes for the batch runner's tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Sim:
    url: str
    proc: subprocess.Popen[str]

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(self.url + "/stats", timeout=5) as r:
            return json.loads(r.read())


@contextmanager
def sim_server(*args: str) -> Iterator[Sim]:
    """Start `tailguard.tools.batch.simserver` on a free port in its own process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailguard.tools.batch.simserver", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), f"simserver did not start: {line!r}"
        yield Sim(line.split()[-1], proc)
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def tailguard_server(*args: str) -> Iterator[str]:
    """Start the real `tailguard serve` (simulated engine: no model, no torch) on a free port."""
    cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--engine", "simulated", "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://" in line, f"tailguard serve did not start: {line!r}"
        yield line.split("listening on ")[1].split()[0]
    finally:
        proc.kill()
        proc.wait()


def dead_url() -> str:
    """A URL where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def write_input(path: Path, n: int, *, extra: list[str] | None = None) -> list[str]:
    """n valid /v1/infer lines (custom ids r0..r{n-1}), then the raw `extra` lines."""
    ids = [f"r{i}" for i in range(n)]
    with path.open("w") as f:
        for cid in ids:
            line = {"custom_id": cid, "method": "POST", "url": "/v1/infer"}
            line["body"] = {"prompt": f"hello {cid}", "top_k": 5}  # type: ignore[assignment]
            f.write(json.dumps(line) + "\n")
        for raw in extra or []:
            f.write(raw + "\n")
    return ids


def batch_cmd(inp: Path, out: Path, *urls: str, extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "tailguard.cli", "batch", str(inp), "--output", str(out)]
    for u in urls:
        cmd += ["--endpoint", u]
    return [*cmd, "--no-progress", "--summary-json", str(out) + ".summary.json", *extra]


def run_batch(
    inp: Path, out: Path, *urls: str, extra: tuple[str, ...] = (), timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        batch_cmd(inp, out, *urls, extra=extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def summary(out: Path) -> dict:
    return json.loads(Path(str(out) + ".summary.json").read_text())


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def id_counts(path: Path) -> Counter[str]:
    return Counter(rec["custom_id"] for rec in read_jsonl(path))


def errors_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}.errors{out.suffix}")

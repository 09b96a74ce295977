"""Child processes of the lab: start with a log file, wait until ready, stop by pid.

Every process the lab starts is its own child (not a new session): if the lab dies, nothing it
started is meant to outlive it, and `stop` only ever signals the pids it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tailguard.deploy.tls import self_signed_cert
from tailguard.errors import ConfigError


class LabError(RuntimeError):
    """A setup could not be started (the message says which process and where its log is)."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(name: str, cmd: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        popen = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    return Proc(name, popen, log)


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def http_status(url: str, timeout_s: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def wait_until(
    check: Callable[[], bool], procs: Sequence[Proc], timeout_s: float, what: str
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        for p in procs:
            if not p.alive:
                raise LabError(
                    f"{p.name} exited while waiting for {what}; log {p.log}:\n{tail(p.log)}"
                )
        time.sleep(0.2)
    raise LabError(
        f"timed out after {timeout_s:g} s waiting for {what}; logs: "
        + ", ".join(str(p.log) for p in procs)
    )


def stop(p: Proc, timeout_s: float = 10.0) -> None:
    """SIGTERM (graceful), then SIGKILL after `timeout_s`; only the pid this lab started."""
    if not p.alive:
        return
    with contextlib.suppress(ProcessLookupError):
        p.popen.send_signal(signal.SIGTERM)
    try:
        p.popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            p.popen.kill()
        p.popen.wait(5)


@contextlib.contextmanager
def serving(
    name: str,
    cmd: Sequence[str],
    log: Path,
    ready_url: str,
    *,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> Iterator[Proc]:
    """A server process, from the moment `ready_url` answers 200 until the block ends."""
    proc = start(name, cmd, log, env)
    try:
        wait_until(lambda: http_status(ready_url) == 200, [proc], timeout_s, f"{name} ready")
        yield proc
    finally:
        stop(proc)


def make_tls_cert(folder: Path) -> tuple[Path, Path]:
    """The lab's certificate (the load client trusts it through SSL_CERT_FILE)."""
    try:
        return self_signed_cert(folder, name="lab")
    except ConfigError as e:
        raise LabError(str(e)) from e


def has_cuda() -> bool:
    """A CUDA device is present (checked without importing torch: tools never import it)."""
    return Path("/proc/driver/nvidia/gpus").is_dir() and any(
        Path("/proc/driver/nvidia/gpus").iterdir()
    )

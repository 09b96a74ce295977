"""Evidence the doctor gathers itself during the window, for servers that export little.

    probe      GET <server>/health every 100 ms: how long a trivial request waits for the
               server's event loop / dispatcher (a server that exports no loop-lag metric still
               answers this)
    procfs     for a server on this host: the process listening on its port and its children,
               sampled every 100 ms from /proc: runnable threads, CPU time (what the runbook's
               team read from `ps` and `top -H`)

Both are best effort: a probe that fails is counted as a failure, and a server whose process
cannot be found (another host, another user) simply has no process figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

PROBE_INTERVAL_S = 0.1  # 10 probes a second: cheap, and enough samples for a 1% share in 10 s
SAMPLE_INTERVAL_S = 0.1


@dataclass(frozen=True)
class ProcWindow:
    """A server's process tree over the window, from /proc."""

    pids: tuple[int, ...]
    cpu_s: float  # user + system CPU seconds used in the window, all processes of the tree
    runnable_mean: float  # mean number of threads in state R (running or waiting for a core)
    threads_max: int  # most threads seen at once
    samples: int
    runq_wait_s: float = -1.0  # seconds the tree's threads waited for a core (schedstat); -1: n/a


@dataclass
class Watch:
    """Probe latencies and /proc samples of one server over the window."""

    name: str
    probe_latencies: list[float] = field(default_factory=list)  # seconds; inf = no answer
    proc: ProcWindow | None = None


# --- /proc ------------------------------------------------------------------------------------


def _listen_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])  # state 0A = LISTEN
    return inodes


def pid_listening_on(port: int) -> int | None:
    """The process listening on a local TCP port (needs permission to read its fds)."""
    inodes = _listen_inodes(port)
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        return int(proc.name)
    return None


def _stat(pid: int | str, tid: int | str | None = None) -> list[str] | None:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant (tailguard's engine is a child of its HTTP process)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            f = _stat(proc.name)
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_and_threads(pids: list[int]) -> tuple[float, int, int]:
    """(CPU seconds, threads, runnable threads) over the processes."""
    cpu, threads, runnable = 0.0, 0, 0
    for pid in pids:
        f = _stat(pid)
        if f is None:
            continue
        cpu += (int(f[11]) + int(f[12])) / _TICK  # utime, stime (fields 14, 15 of proc(5))
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                t = _stat(pid, task.name)
                if t is not None:
                    threads += 1
                    runnable += t[0] == "R"
    return cpu, threads, runnable


def runq_wait(pids: list[int]) -> float | None:
    """Seconds the processes' threads spent runnable but waiting for a core, so far
    (`/proc/PID/task/TID/schedstat`, field 2, ns); None when the kernel does not report it."""
    total, seen = 0.0, False
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    total += int((task / "schedstat").read_text().split()[1]) / 1e9
                    seen = True
    return total if seen else None


@dataclass(frozen=True)
class Neighbour:
    """A process on the servers' host that is not one of them, and the CPU it used."""

    pid: int
    name: str  # its command line (shortened)
    cpu_cores: float  # CPU seconds in the window / window seconds


def host_processes() -> dict[int, tuple[float, str]]:
    """Every process on this host: pid -> (CPU seconds so far, command line)."""
    out: dict[int, tuple[float, str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        f = _stat(proc.name)
        if f is None:
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = ""
        out[int(proc.name)] = ((int(f[11]) + int(f[12])) / _TICK, cmd.strip()[:80])
    return out


def neighbours_between(
    a: dict[int, tuple[float, str]],
    b: dict[int, tuple[float, str]],
    exclude: set[int],
    window_s: float,
    top: int = 50,
) -> tuple[Neighbour, ...]:
    """The processes outside `exclude` that used CPU (1% of a core or more) between two
    host_processes(), busiest first (at most `top`: a bounded record)."""
    used = []
    for pid, (cpu1, name) in b.items():
        if pid in exclude:
            continue
        cpu0 = a.get(pid, (0.0, ""))[0]  # born inside the window: all its CPU is the window's
        share = max(0.0, cpu1 - cpu0) / max(window_s, 1e-9)
        if share >= 0.01:
            used.append(Neighbour(pid, name or f"pid {pid}", round(share, 4)))
    used.sort(key=lambda n: n.cpu_cores, reverse=True)
    return tuple(used[:top])


def host_cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of the whole host from /proc/stat; None off Linux."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    ticks = [float(x) for x in first[1:9]]  # user nice system idle iowait irq softirq steal
    idle = ticks[3] + ticks[4]
    return sum(ticks) - idle, sum(ticks)


def host_busy_between(a: tuple[float, float] | None, b: tuple[float, float] | None) -> float | None:
    """Share of the host's CPU time that was busy between two host_cpu_times() readings."""
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


# --- the watchers -------------------------------------------------------------------------------


async def _probe(session: aiohttp.ClientSession, url: str, out: list[float]) -> None:
    while True:
        t0 = time.monotonic()
        try:
            async with session.get(url) as resp:
                await resp.read()
            out.append(time.monotonic() - t0)
        except (aiohttp.ClientError, TimeoutError):
            out.append(float("inf"))
        await asyncio.sleep(max(0.0, PROBE_INTERVAL_S - (time.monotonic() - t0)))


async def _sample(pids: list[int], acc: list[tuple[int, int]]) -> None:
    while True:
        _, threads, runnable = await asyncio.to_thread(_cpu_and_threads, pids)
        acc.append((threads, runnable))
        await asyncio.sleep(SAMPLE_INTERVAL_S)


class Watcher:
    """Runs the probe and the /proc sampler for one server between start() and stop()."""

    def __init__(self, name: str, base_url: str, probe_path: str, port: int | None,
                 timeout_s: float, *, probe: bool = True) -> None:  # fmt: skip
        self.watch = Watch(name)
        self._url = base_url.rstrip("/") + probe_path
        self._port = port
        self._timeout_s = timeout_s
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._pids: list[int] = []
        self._cpu0 = 0.0
        self._wait0: float | None = None
        self._samples: list[tuple[int, int]] = []
        self._probe = probe

    @property
    def local(self) -> bool:
        """The server is on this host (its /proc is sampled)."""
        return self._port is not None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout_s),
            connector=aiohttp.TCPConnector(limit=1),  # one kept-alive connection, no churn
        )
        if self._probe:
            self._tasks.append(asyncio.create_task(_probe(self._session, self._url,
                                                          self.watch.probe_latencies)))  # fmt: skip
        pid = pid_listening_on(self._port) if self._port else None
        if pid is not None:
            self._pids = process_tree(pid)
            self._cpu0 = _cpu_and_threads(self._pids)[0]
            self._wait0 = runq_wait(self._pids)
            self._tasks.append(asyncio.create_task(_sample(self._pids, self._samples)))

    async def stop(self) -> Watch:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._session is not None:
            await self._session.close()
        if self._pids and self._samples:
            cpu1 = _cpu_and_threads(self._pids)[0]
            wait1 = runq_wait(self._pids)
            waited = -1.0 if wait1 is None or self._wait0 is None else wait1 - self._wait0
            self.watch.proc = ProcWindow(
                pids=tuple(self._pids),
                cpu_s=max(0.0, cpu1 - self._cpu0),
                runnable_mean=sum(r for _, r in self._samples) / len(self._samples),
                threads_max=max(t for t, _ in self._samples),
                samples=len(self._samples),
                runq_wait_s=max(-1.0, waited),
            )
        return self.watch

"""Collect one window of evidence over HTTP, or read one recorded earlier.

Live: scrape every server's `/metrics` and Envoy's `/stats` at the start and the end of the
window (or ask Prometheus for the window with one range query). Recorded: a folder in the layout
`--record DIR` writes, which is also the layout of the test fixtures:

    meta.json                      {"window_s": 120, "host_cores": 2, "servers": [...]}
    server-0.before.prom           /metrics at the start (server-1... for more servers)
    server-0.after.prom            /metrics at the end
    engine-0.before.json           optional EngineStats (msgspec JSON), e.g. CUDA allocator figures
    engine-0.after.json
    envoy.before.txt               optional Envoy /stats (plain or ?format=json)
    envoy.after.txt
    requests.jsonl                 optional `tailguard load` per-request report
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import msgspec

from tailguard.core.stats import EngineStats
from tailguard.tools.doctor.loadreport import LoadRequest, read_requests, summarize
from tailguard.tools.doctor.observation import Observation, ServerWindow
from tailguard.tools.doctor.report import plain
from tailguard.tools.doctor.snapshot import (
    ParseError,
    Snapshot,
    parse_envoy_stats,
    parse_prometheus_range,
    parse_prometheus_text,
)
from tailguard.tools.doctor.watch import (
    Neighbour,
    ProcWindow,
    Watch,
    Watcher,
    host_busy_between,
    host_cpu_times,
    host_processes,
    neighbours_between,
)


class CollectError(RuntimeError):
    """Nothing usable could be collected (exit code 2)."""


def default_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CollectConfig:
    servers: tuple[str, ...] = ()  # tailguard base URLs (or full /metrics URLs)
    envoy_admin: str | None = None  # Envoy admin base URL (or a full /stats URL)
    prometheus: str | None = None  # Prometheus base URL: servers are read from it instead
    load_report: Path | None = None  # `tailguard load --report` folder or its requests.jsonl
    window_s: float = 120.0  # seconds between the two scrapes
    timeout_s: float = 5.0  # per HTTP request
    host_cores: int = 0  # cores of the servers' host; 0: this machine's
    sla_s: float | None = None  # override the server's tailguard_sla_seconds
    record_dir: Path | None = None  # write what was collected here (re-read with --from-dir)
    probe_path: str | None = "/health"  # probed every 100 ms during the window; None: no probe
    watch_procs: bool = True  # sample /proc for servers listening on this host

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError(f"window {self.window_s}s: must be positive, e.g. --window 120s")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout {self.timeout_s}s: must be positive")
        if not (self.servers or self.envoy_admin or self.prometheus or self.load_report):
            raise ValueError(
                "nothing to collect: give --server URL, --envoy-admin URL, --prometheus URL "
                "or --load-report DIR (or --from-dir DIR for a recorded window)"
            )
        if self.sla_s is not None and self.sla_s <= 0:
            raise ValueError(f"sla {self.sla_s}s: must be positive, e.g. --sla 0.15")


def metrics_url(url: str) -> str:
    u = urlparse(url)
    return url if u.path not in ("", "/") else url.rstrip("/") + "/metrics"


def stats_url(url: str) -> str:
    u = urlparse(url)
    return url if u.path not in ("", "/") else url.rstrip("/") + "/stats"


async def _get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as resp:
        body = await resp.text()
        if resp.status != 200:
            raise CollectError(f"{url}: HTTP {resp.status}: {body[:200]}")
        return body


async def _scrape(session: aiohttp.ClientSession, urls: list[str]) -> list[str | Exception]:
    async def one(url: str) -> str | Exception:
        try:
            return await _get(session, url)
        except (aiohttp.ClientError, TimeoutError, CollectError) as e:
            return e if isinstance(e, CollectError) else CollectError(f"{url}: {e!r}")

    return list(await asyncio.gather(*(one(u) for u in urls)))


async def _prometheus_window(
    session: aiohttp.ClientSession, base: str, start: float, end: float
) -> dict[str, tuple[Snapshot, Snapshot]]:
    step = max(1.0, end - start)
    params = {
        "query": '{__name__=~"(tailguard|mistral)_.+|vllm:.+"}',
        "start": f"{start:.3f}",
        "end": f"{end:.3f}",
        "step": f"{step:.3f}",
    }
    url = base.rstrip("/") + "/api/v1/query_range"
    try:
        async with session.get(url, params=params) as resp:
            doc = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        raise CollectError(f"{url}: {e!r}; is --prometheus the Prometheus base URL?") from e
    return parse_prometheus_range(doc)


class Collector:
    """Two-phase collection, for callers that drive the window themselves (the lab):
    `await start()` scrapes the beginning, `await finish()` the end and builds the Observation.
    """

    def __init__(self, cfg: CollectConfig) -> None:
        self.cfg = cfg
        self.murls = [metrics_url(u) for u in cfg.servers] if not cfg.prometheus else []
        self.eurls = [stats_url(cfg.envoy_admin)] if cfg.envoy_admin else []
        self._first: list[str | Exception] = []
        self._wall0 = time.time()
        self._t0 = time.monotonic()
        self._watchers: dict[str, Watcher] = {}
        self._host0: tuple[float, float] | None = None
        self._procs0: dict[int, tuple[float, str]] = {}

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))

    async def start(self) -> None:
        """Scrape the start of the window. Raises CollectError when no live source answers."""
        urls = self.murls + self.eurls
        if urls:
            async with self._session() as session:
                self._first = await _scrape(session, urls)
            if not any(not isinstance(r, Exception) for r in self._first):
                raise CollectError("no source answered: " + "; ".join(map(str, self._first)))
        self._wall0, self._t0 = time.time(), time.monotonic()
        for url, first in zip(self.murls, self._first, strict=False):
            if isinstance(first, Exception):
                continue
            u = urlparse(url)
            base = f"{u.scheme}://{u.netloc}"
            local = u.hostname in ("127.0.0.1", "localhost", "::1")
            port = u.port if (local and self.cfg.watch_procs) else None
            if self.cfg.probe_path is None and port is None:
                continue
            w = Watcher(url, base, self.cfg.probe_path or "", port, self.cfg.timeout_s,
                        probe=self.cfg.probe_path is not None)  # fmt: skip
            await w.start()
            self._watchers[url] = w
        if any(w.local for w in self._watchers.values()):  # a server on this host: its CPU
            self._host0 = host_cpu_times()
            self._procs0 = host_processes()

    async def finish(self) -> Observation:
        """Scrape the end of the window (or query Prometheus for it) and build the Observation."""
        cfg, murls, eurls = self.cfg, self.murls, self.eurls
        notes: list[str] = []
        live = bool(murls or eurls)
        prom: dict[str, tuple[Snapshot, Snapshot]] = {}
        watches = {url: await w.stop() for url, w in self._watchers.items()}
        host_busy = host_busy_between(self._host0, host_cpu_times()) if self._host0 else None
        neighbours: tuple[Neighbour, ...] = ()
        if self._procs0:
            ours = {os.getpid()} | {p for w in watches.values() if w.proc for p in w.proc.pids}
            span = time.monotonic() - self._t0
            neighbours = neighbours_between(self._procs0, host_processes(), ours, span)
        async with self._session() as session:
            second = await _scrape(session, murls + eurls) if live else []
            window = time.monotonic() - self._t0 if live else cfg.window_s
            if cfg.prometheus:
                # With Envoy scraped live the window is the one just waited; else the last one.
                end = time.time()
                start = self._wall0 if eurls else end - cfg.window_s
                prom = await _prometheus_window(session, cfg.prometheus, start, end)
                if not prom:
                    notes.append(f"Prometheus {cfg.prometheus} has no tailguard_* series")
        raw = {u: [a, b] for u, a, b in zip(murls + eurls, self._first, second, strict=True)}
        servers: list[ServerWindow] = []
        for url in murls:
            a, b = raw[url]
            if isinstance(a, Exception) or isinstance(b, Exception):
                notes.append(f"skipped {url}: {a if isinstance(a, Exception) else b}")
                continue
            before, after = parse_prometheus_text(a), parse_prometheus_text(b)
            servers.append(ServerWindow(url, before, after, watch=watches.get(url)))
        servers += [ServerWindow(inst, s0, s1) for inst, (s0, s1) in sorted(prom.items())]
        envoy: tuple[Snapshot, Snapshot] | None = None
        if eurls:
            a, b = raw[eurls[0]]
            if isinstance(a, Exception) or isinstance(b, Exception):
                notes.append(f"skipped Envoy: {a if isinstance(a, Exception) else b}")
            else:
                envoy = (parse_envoy_stats(a), parse_envoy_stats(b))
        load_reqs = read_requests(cfg.load_report) if cfg.load_report else None
        if not servers and envoy is None and load_reqs is None:
            raise CollectError("no source could be read: " + "; ".join(notes))
        if cfg.record_dir is not None:
            _record(cfg, raw, murls, eurls, watches, window, host_busy, neighbours)
        obs = Observation(
            window_s=window,
            servers=tuple(servers),
            envoy_before=envoy[0] if envoy else None,
            envoy_after=envoy[1] if envoy else None,
            host_cores=cfg.host_cores or default_cores(),
            sla_override_s=cfg.sla_s,
            notes=tuple(notes),
            host_cpu_busy=host_busy,
            neighbours=neighbours,
        )
        return obs if load_reqs is None else _with_load(obs, load_reqs)


async def collect(cfg: CollectConfig) -> Observation:
    """Collect one window live. Raises CollectError when no source answered."""
    c = Collector(cfg)
    await c.start()
    if c.murls or c.eurls:
        await asyncio.sleep(cfg.window_s)
    return await c.finish()


def with_load_report(obs: Observation, path: Path) -> Observation:
    """Attach a `tailguard load` report read now (after the load finished) to an Observation."""
    return _with_load(obs, read_requests(path))


def _with_load(obs: Observation, reqs: list[LoadRequest]) -> Observation:
    return replace(obs, load=summarize(reqs, obs.sla_s))


def _record(
    cfg: CollectConfig,
    raw: dict[str, list[str | Exception]],
    murls: list[str],
    eurls: list[str],
    watches: dict[str, Watch],
    window_s: float,
    host_busy: float | None,
    neighbours: tuple[Neighbour, ...] = (),
) -> None:
    d = cfg.record_dir
    if d is None:
        return
    d.mkdir(parents=True, exist_ok=True)
    for i, url in enumerate(murls):
        for side, text in zip(("before", "after"), raw[url], strict=True):
            if isinstance(text, str):
                (d / f"server-{i}.{side}.prom").write_text(text)
    for i, url in enumerate(murls):
        if url in watches:
            (d / f"watch-{i}.json").write_text(json.dumps(plain(watches[url])))
    for url in eurls:
        for side, text in zip(("before", "after"), raw[url], strict=True):
            if isinstance(text, str):
                (d / f"envoy.{side}.txt").write_text(text)
    if cfg.load_report is not None:
        src = cfg.load_report / "requests.jsonl" if cfg.load_report.is_dir() else cfg.load_report
        (d / "requests.jsonl").write_text(src.read_text())
    meta = {
        "window_s": window_s,
        "host_cores": cfg.host_cores or default_cores(),
        "host_cpu_busy": host_busy,
        "neighbours": [plain(n) for n in neighbours],
        "sla_s": cfg.sla_s,
        "servers": murls,
    }
    (d / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_recorded(d: Path, *, host_cores: int = 0, sla_s: float | None = None) -> Observation:
    """Read a recorded window (the layout in this module's docstring)."""
    if not (d / "meta.json").is_file():
        raise CollectError(f"{d}: no meta.json; is this a folder written by `doctor --record`?")
    meta = json.loads((d / "meta.json").read_text())
    names = list(meta.get("servers", []))
    servers: list[ServerWindow] = []
    i = 0
    while (d / f"server-{i}.before.prom").is_file():
        before = parse_prometheus_text((d / f"server-{i}.before.prom").read_text())
        after = parse_prometheus_text((d / f"server-{i}.after.prom").read_text())
        eb = _engine(d / f"engine-{i}.before.json")
        ea = _engine(d / f"engine-{i}.after.json")
        name = names[i] if i < len(names) else f"server-{i}"
        servers.append(ServerWindow(name, before, after, eb, ea, _watch(d / f"watch-{i}.json")))
        i += 1
    envoy = None
    if (d / "envoy.before.txt").is_file():
        envoy = (
            parse_envoy_stats((d / "envoy.before.txt").read_text()),
            parse_envoy_stats((d / "envoy.after.txt").read_text()),
        )
    obs = Observation(
        window_s=float(meta.get("window_s", 120.0)),
        servers=tuple(servers),
        envoy_before=envoy[0] if envoy else None,
        envoy_after=envoy[1] if envoy else None,
        host_cores=host_cores or int(meta.get("host_cores") or default_cores()),
        sla_override_s=sla_s if sla_s is not None else meta.get("sla_s"),
        host_cpu_busy=meta.get("host_cpu_busy"),
        neighbours=tuple(Neighbour(**n) for n in meta.get("neighbours", [])),
    )
    if (d / "requests.jsonl").is_file():
        obs = _with_load(obs, read_requests(d / "requests.jsonl"))
    if not servers and envoy is None and obs.load is None:
        raise CollectError(f"{d}: holds no server-*.prom, envoy.*.txt or requests.jsonl")
    return obs


def _watch(p: Path) -> Watch | None:
    if not p.is_file():
        return None
    doc = json.loads(p.read_text())
    proc = doc.get("proc")
    return Watch(
        name=str(doc.get("name", "")),
        # JSON has no infinity: a probe without an answer was written as null
        probe_latencies=[float("inf") if x is None else float(x) for x in doc["probe_latencies"]],
        proc=None if proc is None else ProcWindow(**{**proc, "pids": tuple(proc["pids"])}),
    )


def _engine(p: Path) -> EngineStats | None:
    if not p.is_file():
        return None
    try:
        return msgspec.json.decode(p.read_bytes(), type=EngineStats)
    except msgspec.ValidationError as e:
        raise ParseError(f"{p}: not an EngineStats snapshot ({e})") from e


__all__ = [
    "CollectConfig",
    "CollectError",
    "Collector",
    "collect",
    "load_recorded",
    "with_load_report",
]

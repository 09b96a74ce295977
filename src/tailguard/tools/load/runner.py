"""The load generator: `await run_load(cfg)` sends the profile's requests and returns the result.

    run_load
    ├── raise the open-files limit; one aiohttp session, no connection cap, a TraceConfig
    ├── Monitor            event-loop lag timer, CPU, in-flight samples, progress callback
    ├── send               open-loop schedule | closed-loop workers | in-flight ramp steps
    ├── scrape /metrics    before and after (optional)
    └── analyse            -> LoadResult (summary, SLA checks, trust verdict)

Every request becomes a RequestRecord, whatever happens to it: failures are data.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson
import psutil

from tailguard.tools.load.analysis import LoadResult, RunFacts, analyse
from tailguard.tools.load.config import LoadConfig
from tailguard.tools.load.records import RequestRecord, Sample
from tailguard.tools.load.schedule import expected_count, intended_times
from tailguard.tools.load.server_metrics import scrape
from tailguard.tools.load.sources import BodySource

PREPARE_MAX = 200_000  # bodies built before the clock starts; later ones are built on demand
DEADLINE_HEADER = "X-Request-Timeout-Ms"  # the budget left, in ms, when the request is sent
_USAGE_PATHS = (b"/v1/completions", b"/v1/chat/completions")

__all__ = ["Progress", "raise_nofile_limit", "run_load"]


@dataclass(frozen=True)
class Progress:
    """What the progress display shows; passed to the callback every ~0.25 s."""

    elapsed_s: float
    sent: int
    done: int
    errors: int
    in_flight: int
    expected: int | None  # total requests the profile will send, when known
    planned_s: float | None  # sending time of time-bounded profiles
    loop_lag_s: float  # worst event-loop lag of the last interval


ProgressCallback = Callable[[Progress], None]


def raise_nofile_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; each connection is a descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass
class _State:
    t0: float  # perf_counter at run start
    records: list[RequestRecord] = field(default_factory=list)
    sent: int = 0
    done: int = 0
    errors: int = 0


class _Monitor:
    """The client watching itself: a timer that measures its own lateness, and CPU use.

    A timer that should fire every `period` but fires late means the event loop was busy; any
    request due in that time was sent late too, so the lag is reported next to the results.
    """

    def __init__(
        self, cfg: LoadConfig, st: _State, expected: int | None, cb: ProgressCallback | None
    ) -> None:
        self.cfg, self.st, self.expected, self.cb = cfg, st, expected, cb
        self.lags: list[float] = []
        self.samples: list[Sample] = []
        self._recent_lag = 0.0

    async def run(self) -> None:
        period = self.cfg.loop_lag_interval_s
        st = self.st
        next_sample = next_progress = time.perf_counter()
        last_cpu, last_wall = time.process_time(), time.perf_counter()
        while True:
            before = time.perf_counter()
            await asyncio.sleep(period)
            now = time.perf_counter()
            lag = max(0.0, now - before - period)
            self.lags.append(lag)
            self._recent_lag = max(self._recent_lag, lag)
            if now >= next_sample:
                cpu = time.process_time()
                share = (cpu - last_cpu) / max(now - last_wall, 1e-9)
                last_cpu, last_wall = cpu, now
                machine = psutil.cpu_percent(interval=None) / 100  # all cores, since last call
                self.samples.append(
                    Sample(
                        now - st.t0, st.sent - st.done, st.sent, st.done, st.errors, share, machine
                    )
                )
                next_sample = now + self.cfg.sample_interval_s
            if self.cb is not None and now >= next_progress:
                self.cb(self.progress(now))
                self._recent_lag = 0.0
                next_progress = now + 0.25

    def progress(self, now: float) -> Progress:
        st = self.st
        return Progress(
            elapsed_s=now - st.t0,
            sent=st.sent,
            done=st.done,
            errors=st.errors,
            in_flight=st.sent - st.done,
            expected=self.expected,
            planned_s=self.cfg.profile.planned_duration_s(),
            loop_lag_s=self._recent_lag,
        )


def _trace_config() -> aiohttp.TraceConfig:
    """New-vs-reused connection and its setup time, per request (trace_request_ctx = record)."""
    tc = aiohttp.TraceConfig()

    async def create_start(_s: aiohttp.ClientSession, ctx: SimpleNamespace, _p: Any) -> None:
        rec: RequestRecord = ctx.trace_request_ctx
        rec.new_connection = True
        rec._conn_start = time.perf_counter()

    async def create_end(_s: aiohttp.ClientSession, ctx: SimpleNamespace, _p: Any) -> None:
        rec: RequestRecord = ctx.trace_request_ctx
        rec.connect_s = time.perf_counter() - rec._conn_start

    async def reuse(_s: aiohttp.ClientSession, ctx: SimpleNamespace, _p: Any) -> None:
        ctx.trace_request_ctx.new_connection = False

    tc.on_connection_create_start.append(create_start)
    tc.on_connection_create_end.append(create_end)
    tc.on_connection_reuseconn.append(reuse)
    return tc


def _describe_error(exc: BaseException) -> str:
    """A short, stable error label (grouped in the summary) with the detail after a colon."""
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_err = exc.os_error
        if isinstance(os_err, ConnectionRefusedError):
            return "connection refused"
        return f"connect error: {os_err.strerror or os_err}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server disconnected"
    if isinstance(exc, ConnectionResetError | aiohttp.ClientOSError):
        return f"connection error: {exc}"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"incomplete body: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        return None  # an HTTP date; not used by tailguard servers


class _Sender:
    """Sends one request and fills its record; never raises for a failed request."""

    def __init__(
        self, cfg: LoadConfig, session: aiohttp.ClientSession, st: _State, source: BodySource
    ) -> None:
        self.cfg, self.session, self.st, self.source = cfg, session, st, source
        self.headers = {"Content-Type": "application/json", **dict(cfg.headers)}
        self.timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        self.deadline_s = cfg.deadline_s()

    def _headers(self, rec: RequestRecord) -> dict[str, str]:
        """The request's headers; with deadline propagation, the budget left after the client's
        own lag (an open loop that sends late has less of it; at least 1 ms: the server then
        refuses at once, which is what a request already past its deadline should get)."""
        if self.deadline_s is None:
            return self.headers
        left = self.deadline_s - max(0.0, rec.sent_s - rec.intended_s)
        return self.headers | {DEADLINE_HEADER: f"{max(1.0, left * 1e3):.0f}"}

    async def send(self, rec: RequestRecord) -> None:
        st, cfg = self.st, self.cfg
        body = self.source.body(rec.i)
        sent = time.perf_counter()
        rec.sent_s = sent - st.t0
        st.sent += 1
        first: float | None = None  # perf_counter of the first content event (streams)
        try:
            async with self.session.post(
                body.url,
                data=body.data,
                headers=self._headers(rec),
                timeout=self.timeout,
                trace_request_ctx=rec,
            ) as resp:
                rec.ttfb_s = time.perf_counter() - sent
                rec.status = resp.status
                rec.retry_after_s = _retry_after(resp.headers.get("Retry-After"))
                stream_error = None
                if resp.content_type == "text/event-stream":
                    first, stream_error = await self._read_stream(resp, rec, sent)
                else:
                    data = await resp.read()
                    rec.bytes_in = len(data)
                    if resp.status == 200 and body.url.encode().endswith(_USAGE_PATHS):
                        _read_usage(data, rec)
                rec.ok = 200 <= resp.status < 300 and stream_error is None
                if not 200 <= resp.status < 300:
                    rec.error = f"http {resp.status}"
                elif stream_error is not None:
                    rec.error = stream_error
        except asyncio.CancelledError:
            rec.error = "cancelled"
            raise
        except Exception as exc:  # every failure is recorded, none is swallowed silently
            rec.error = _describe_error(exc)
        finally:
            done = time.perf_counter()
            rec.done_s = done - st.t0
            rec.service_s = done - sent
            # from the intended time, or from the actual send if a timer fired a little early
            origin = min(rec.intended_s, rec.sent_s)
            rec.latency_s = rec.done_s - origin
            if first is not None:
                rec.ttft_s = first - st.t0 - origin
                n = rec.output_tokens or 0
                if n > 1:  # vLLM's and DistServe's TPOT: decode time per token after the first
                    rec.tpot_s = (done - first) / (n - 1)
            if rec.error == "timeout":  # never shorter than the timeout it hit
                rec.service_s = max(rec.service_s, cfg.timeout_s)
                rec.latency_s = max(rec.latency_s, cfg.timeout_s)
            st.done += 1
            if not rec.ok:
                st.errors += 1

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, rec: RequestRecord, sent: float
    ) -> tuple[float | None, str | None]:
        """Read SSE events: content events time the tokens, the usage event counts them.

        Returns (perf_counter of the first content event, in-band error or None). A content
        event is a choice with non-empty `text` (completions) or `delta.content` (chat); role-only
        and finish-only chunks are not tokens. ITL gaps are between content events.
        """
        first: float | None = None
        last = 0.0
        events = 0
        gaps: list[float] = []
        error: str | None = None
        async for line in resp.content:
            rec.bytes_in += len(line)
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            now = time.perf_counter()
            if rec.first_token_s is None:
                rec.first_token_s = now - sent
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue  # not JSON: still an event (first_token_s), not a token
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                err = obj["error"]
                msg = err.get("message") if isinstance(err, dict) else err
                error = f"stream error: {msg}"
            choices = obj.get("choices")
            if choices and isinstance(choices[0], dict):
                c0 = choices[0]
                delta = c0.get("delta")
                text = c0.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
                if text:
                    events += 1
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
            usage = obj.get("usage")
            if isinstance(usage, dict):
                _take_usage(usage, rec)
        if first is not None:
            rec.itl_s = gaps
            if rec.output_tokens is None:  # no usage event: count content events
                rec.output_tokens = events
        return first, error


def _take_usage(usage: dict[str, Any], rec: RequestRecord) -> None:
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    rec.prompt_tokens = p if isinstance(p, int) else rec.prompt_tokens
    rec.output_tokens = c if isinstance(c, int) else rec.output_tokens


def _read_usage(data: bytes, rec: RequestRecord) -> None:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return
    if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
        _take_usage(obj["usage"], rec)


async def _open_loop(cfg: LoadConfig, sender: _Sender, st: _State) -> None:
    tasks: set[asyncio.Task[None]] = set()
    since_yield = 0
    for i, t in enumerate(intended_times(cfg.profile)):
        delay = t - (time.perf_counter() - st.t0)
        if delay > 0:
            # Timers may fire early (uvloop rounds to whole ms): sleep again while >= 1 ms is
            # left; a send up to 1 ms early is timed from its actual send (see _Sender.send).
            while delay >= 0.001:
                await asyncio.sleep(delay)
                delay = t - (time.perf_counter() - st.t0)
            since_yield = 0
        elif since_yield >= 256:
            # Behind schedule: launch due sends in batches, yielding between them so responses
            # are still read. Too small a batch caps the catch-up rate at batch / loop iteration.
            await asyncio.sleep(0)
            since_yield = 0
        rec = RequestRecord(i, t)
        st.records.append(rec)
        task = asyncio.create_task(sender.send(rec))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        since_yield += 1
    if tasks:
        await asyncio.gather(*tasks)


async def _backoff(cfg: LoadConfig, rec: RequestRecord) -> None:
    """A closed-loop worker refused with Retry-After waits (capped) instead of re-sending at once:
    a server that refuses in microseconds would otherwise be hammered by its own refusals."""
    if cfg.reject_backoff_s > 0 and not rec.ok and rec.retry_after_s:
        await asyncio.sleep(min(rec.retry_after_s, cfg.reject_backoff_s))


async def _closed_loop(cfg: LoadConfig, sender: _Sender, st: _State) -> None:
    """hey-like workers, but exactly `requests` are sent (hey sends (n // c) * c)."""
    total = cfg.profile.requests
    assert total is not None and cfg.profile.concurrency is not None

    async def worker() -> None:
        while len(st.records) < total:
            rec = RequestRecord(len(st.records), time.perf_counter() - st.t0)
            st.records.append(rec)
            await sender.send(rec)
            await _backoff(cfg, rec)

    await asyncio.gather(*(worker() for _ in range(cfg.profile.concurrency)))


async def _inflight_ramp(cfg: LoadConfig, sender: _Sender, st: _State) -> None:
    """Closed-loop steps: hold N requests in flight per step (the nightly ramp to 10k)."""
    p = cfg.profile
    assert p.hold_s is not None
    end = st.t0 + p.hold_s * p.steps

    async def worker() -> None:
        while time.perf_counter() < end:
            rec = RequestRecord(len(st.records), time.perf_counter() - st.t0)
            st.records.append(rec)
            await sender.send(rec)
            await _backoff(cfg, rec)

    workers: list[asyncio.Task[None]] = []
    for step, level in enumerate(p.ramp_levels()):
        for _ in range(round(level) - len(workers)):
            workers.append(asyncio.create_task(worker()))
        step_end = st.t0 + (step + 1) * p.hold_s
        await asyncio.sleep(max(0.0, step_end - time.perf_counter()))
    await asyncio.gather(*workers)
    st.records.sort(key=lambda r: r.i)


def _busy_share(a: Any, b: Any) -> float:
    """Share of all cores' time that was not idle between two psutil.cpu_times()."""
    total = sum(b) - sum(a)
    idle = (b.idle - a.idle) + (getattr(b, "iowait", 0.0) - getattr(a, "iowait", 0.0))
    return max(0.0, min(1.0, 1 - idle / total)) if total > 0 else 0.0


async def run_load(
    cfg: LoadConfig, progress: ProgressCallback | None = None, source: BodySource | None = None
) -> LoadResult:
    """Run one load test in the current event loop and return everything it measured."""
    source = source or BodySource(cfg)
    expected = expected_count(cfg.profile)
    await source.ask_server_vocab()  # token ids the server has (before any body is built)
    t_prep = time.perf_counter()
    source.prepare(min(expected or 0, PREPARE_MAX))
    prepare_s = time.perf_counter() - t_prep
    nofile = raise_nofile_limit()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    # No connection cap (aiohttp's default of 100 would make this a closed-loop tester), and
    # no per-host cap either: the profile alone decides how many requests are in flight.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
    before = await scrape(cfg.metrics_url) if cfg.metrics_url else None
    async with aiohttp.ClientSession(
        connector=connector, trace_configs=[_trace_config()], skip_auto_headers=("User-Agent",)
    ) as session:
        st = _State(t0=time.perf_counter())
        sender = _Sender(cfg, session, st, source)
        monitor = _Monitor(cfg, st, expected, progress)
        cpu0 = time.process_time()
        machine0 = psutil.cpu_times()
        psutil.cpu_percent(interval=None)  # starts the per-sample machine-wide CPU interval
        mon_task = asyncio.create_task(monitor.run())
        try:
            if cfg.profile.open_loop:
                await _open_loop(cfg, sender, st)
            elif cfg.profile.kind == "closed":
                await _closed_loop(cfg, sender, st)
            else:
                await _inflight_ramp(cfg, sender, st)
        finally:
            mon_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mon_task
        wall = time.perf_counter() - st.t0
        cpu = time.process_time() - cpu0
        machine_cpu = _busy_share(machine0, psutil.cpu_times())
        if progress is not None:
            progress(monitor.progress(time.perf_counter()))
    after = await scrape(cfg.metrics_url) if cfg.metrics_url else None
    facts = RunFacts(
        started_at=started_at,
        wall_s=wall,
        cpu_s=cpu,
        machine_cpu=machine_cpu,
        loop_lags_s=monitor.lags,
        nofile_limit=nofile,
        event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
        source={**source.to_dict(), "prepare_s": round(prepare_s, 4)},
        source_text=source.describe(len(st.records)),
    )
    return analyse(cfg, st.records, monitor.samples, facts, before, after)

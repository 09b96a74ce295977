"""The run loop: send every request under the pace limits, retry, record into the ledger.

One dispatcher task decides what is sent where and when; each attempt is its own task; one
flusher task commits finished results to the ledger in groups. Reading order:
`run` -> `_dispatch_loop` -> `_attempt` -> `_settle` -> `_flush`.

What is retried: 429, 502, 503, 504, timeouts and connection errors (the server did not do the
work, or said "later"). What is not: every other status; 4xx other than 429 says the request
itself is wrong and would fail again, and is recorded with the server's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import random
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field

import aiohttp
import orjson

from tailguard.tools.batch.config import BatchConfig
from tailguard.tools.batch.endpoints import Endpoint, EndpointPool
from tailguard.tools.batch.inputs import BatchItem
from tailguard.tools.batch.ledger import Ledger, LedgerRow
from tailguard.tools.batch.limiter import LimiterConfig, TokenBucket, backoff_delay

__all__ = ["BatchRunner", "RunStats"]

RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
_HEADERS = {"Content-Type": "application/json"}
_FLUSH_EVERY_S = 0.05  # group commit: one fsync per 50 ms, not one per result

# Latencies and deadlines use the monotonic clock, not loop.time(): uvloop's loop time has
# millisecond resolution and is cached per loop iteration, which under load skews exactly
# the latencies the limiter steers by. (Timers still run on the loop; only durations are
# passed to it.)
_now = time.monotonic


@dataclass
class RunStats:
    total: int  # requests in the job (valid input lines)
    already_done: int  # found finished in the ledger when this run started
    done: int = 0  # committed to the ledger by this run
    ok: int = 0
    failed: int = 0
    attempts: int = 0
    retries: int = 0
    retry_reasons: Counter[str] = field(default_factory=Counter)  # "503", "timeout", ...
    latencies_s: list[float] = field(default_factory=list)  # successful attempts
    e2e_s: list[float] = field(default_factory=list)  # first send -> success, retries included
    started: float = 0.0  # monotonic
    finished: float = 0.0
    interrupted: bool = False


@dataclass(frozen=True)
class _Outcome:
    status: int | None  # HTTP status; None: no response (connection error or timeout)
    body: bytes
    request_id: str | None
    retry_after_s: float | None  # from the body's retry_after_s, else the header
    transport_error: str | None  # "timeout" or "connection_error: ..." when status is None


class BatchRunner:
    def __init__(
        self, cfg: BatchConfig, items: list[BatchItem], ledger: Ledger, *, already_done: int
    ) -> None:
        self.cfg = cfg
        self.items = items
        self.ledger = ledger
        limiter_cfg = LimiterConfig(
            sla_s=cfg.sla_ms / 1000,
            initial=min(cfg.initial_in_flight, cfg.max_in_flight),
            max_limit=cfg.max_in_flight,
        )
        self.pool = EndpointPool(
            cfg.endpoints,
            limiter_cfg,
            max_in_flight=cfg.max_in_flight,
            eject_after=cfg.eject_after,
            eject_base_s=cfg.eject_base_s,
            eject_max_s=cfg.eject_max_s,
        )
        self.bucket = TokenBucket(cfg.max_rps) if cfg.max_rps else None
        self.stats = RunStats(total=already_done + len(items), already_done=already_done)
        self._fresh: deque[int] = deque(range(len(items)))
        self._retry: list[tuple[float, int]] = []  # heap of (ready_at, item index)
        self._attempts = [0] * len(items)
        self._first_send = [0.0] * len(items)
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: list[LedgerRow] = []  # settled, not yet committed
        self._stopping = False  # graceful stop: no new sends, in-flight ones finish
        self._closing = False  # tells the flusher to end
        self._rng = random.Random()
        self._wake: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None
        self._crash: BaseException | None = None  # a bug inside an attempt task

    # ---- control, called from signal handlers -------------------------------------------
    def request_stop(self) -> None:
        """Finish what is in flight, send nothing new."""
        self._stopping = True
        self.stats.interrupted = True
        self._poke()

    def abandon_in_flight(self) -> None:
        """Second interrupt: stop waiting for in-flight requests (they are resent on resume)."""
        self.request_stop()
        for t in list(self._tasks):
            t.cancel()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    # ---- the run --------------------------------------------------------------------------
    async def run(self) -> RunStats:
        self._wake = asyncio.Event()
        self.stats.started = _now()
        # Our limiter bounds concurrency; aiohttp's default cap of 100 connections would be a
        # second, hidden limit that silently queues requests inside the client.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self._session = session
            flusher = asyncio.create_task(self._flush_loop())
            try:
                await self._dispatch_loop()
                while self._tasks:  # a graceful stop: let in-flight requests finish
                    await asyncio.gather(*self._tasks, return_exceptions=True)
            finally:
                self._closing = True
                await flusher
                await self._flush()
        self.stats.finished = _now()
        if self._crash is not None:
            raise self._crash
        return self.stats

    async def _dispatch_loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            self._wake.clear()
            now = _now()
            if not self._fresh and not self._retry and not self._tasks:
                return  # everything settled
            idx = self._ready_item(now)
            wait_until: float | None = None
            if idx is None:  # nothing to send yet: wait for a retry to come due or a result
                wait_until = self._retry[0][0] if self._retry else None
            else:
                ep = self.pool.pick(now)
                if ep is None:  # every endpoint full, paused or ejected
                    wait_until = self.pool.next_change(now)
                else:
                    self._pop_ready(now)
                    generation = self.pool.send(ep)
                    if self.bucket is not None:
                        delay = self.bucket.reserve(now)
                        if delay > 0:
                            await asyncio.sleep(delay)
                    task = asyncio.create_task(self._attempt(idx, ep, generation))
                    self._tasks.add(task)
                    task.add_done_callback(self._task_done)
                    continue
            timeout = None if wait_until is None else max(0.0, wait_until - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _ready_item(self, now: float) -> int | None:
        # Due retries go first so old requests finish instead of being overtaken forever.
        if self._retry and self._retry[0][0] <= now:
            return self._retry[0][1]
        return self._fresh[0] if self._fresh else None

    def _pop_ready(self, now: float) -> None:
        if self._retry and self._retry[0][0] <= now:
            heapq.heappop(self._retry)
        else:
            self._fresh.popleft()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._crash is None:
            # A bug, not a server answer: stop cleanly (what is recorded stays recorded).
            self._crash = task.exception()
            self.request_stop()
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _attempt(self, idx: int, ep: Endpoint, generation: int) -> None:
        assert self._session is not None
        item = self.items[idx]
        self._attempts[idx] += 1
        self.stats.attempts += 1
        t0 = _now()
        if self._attempts[idx] == 1:
            self._first_send[idx] = t0
        try:
            async with self._session.post(
                ep.url + item.url, data=item.body, headers=_HEADERS
            ) as resp:
                body = await resp.read()
                outcome = _Outcome(
                    status=resp.status,
                    body=body,
                    request_id=resp.headers.get("x-request-id"),
                    retry_after_s=_retry_after(resp.headers.get("Retry-After"), body),
                    transport_error=None,
                )
        except TimeoutError:
            outcome = _Outcome(None, b"", None, None, f"timeout after {self.cfg.timeout_s:g} s")
        except (aiohttp.ClientError, OSError) as exc:
            err = f"connection_error: {type(exc).__name__}: {exc}"
            outcome = _Outcome(None, b"", None, None, err)
        self._settle(idx, ep, generation, outcome, t0, _now())

    def _settle(
        self, idx: int, ep: Endpoint, generation: int, out: _Outcome, t0: float, now: float
    ) -> None:
        item = self.items[idx]
        attempt = self._attempts[idx]
        latency = now - t0
        if out.status is not None and 200 <= out.status < 300:
            self.pool.on_success(ep, latency, now)
            self.stats.latencies_s.append(latency)
            self.stats.e2e_s.append(now - self._first_send[idx])
            rec = _record(item, out.status, out.request_id, _json_or_text(out.body), None)
            self._pending.append(
                LedgerRow(item.custom_id, item.line_no, True, attempt, latency * 1000, rec)
            )
            return
        if out.status is None:
            self.pool.on_failure(ep, now, generation)
            reason = "timeout" if out.transport_error.startswith("timeout") else "connection"  # type: ignore[union-attr]
            self._retry_or_fail(idx, reason, None, out, ep)
            return
        body = _json_or_text(out.body)
        if out.status in RETRYABLE_STATUS:
            retry_after = out.retry_after_s
            if retry_after is not None:
                retry_after = min(retry_after, self.cfg.max_retry_after_s)
            self.pool.on_overload(ep, retry_after, now)
            self._retry_or_fail(idx, str(out.status), retry_after, out, ep)
            return
        # Not retryable: the request itself is wrong (4xx) or the server failed it for good.
        self.pool.on_neutral(ep)
        error = {"code": _error_type(body) or f"http_{out.status}", "message": _message(body)}
        rec = _record(item, out.status, out.request_id, body, error)
        self._pending.append(LedgerRow(item.custom_id, item.line_no, False, attempt, None, rec))

    def _retry_or_fail(
        self, idx: int, reason: str, retry_after: float | None, out: _Outcome, ep: Endpoint
    ) -> None:
        attempt = self._attempts[idx]
        if attempt < self.cfg.max_attempts:
            delay = backoff_delay(
                attempt,
                base_s=self.cfg.backoff_base_s,
                cap_s=self.cfg.backoff_cap_s,
                retry_after_s=retry_after,
                rng=self._rng,
            )
            heapq.heappush(self._retry, (_now() + delay, idx))
            self.stats.retries += 1
            self.stats.retry_reasons[reason] += 1
            return
        item = self.items[idx]
        if out.status is None:
            message = f"gave up after {attempt} attempts; last: {out.transport_error} ({ep.url})"
            error = {"code": "connection_error" if reason == "connection" else reason}
            error["message"] = message
            rec = _record(item, None, None, None, error)
        else:
            body = _json_or_text(out.body)
            message = f"gave up after {attempt} attempts; last: {_message(body)} ({ep.url})"
            error = {"code": _error_type(body) or f"http_{out.status}", "message": message}
            rec = _record(item, out.status, out.request_id, body, error)
        self._pending.append(LedgerRow(item.custom_id, item.line_no, False, attempt, None, rec))

    # ---- durability -----------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(_FLUSH_EVERY_S)
            await self._flush()

    async def _flush(self) -> None:
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        # The commit fsyncs; a worker thread keeps the event loop sending meanwhile.
        await asyncio.to_thread(self.ledger.record_many, rows)
        self.stats.done += len(rows)
        ok = sum(1 for r in rows if r.ok)
        self.stats.ok += ok
        self.stats.failed += len(rows) - ok


def _retry_after(header: str | None, body: bytes) -> float | None:
    """Seconds the server asked us to wait: the body's exact `retry_after_s` if present, else
    the `Retry-After` header in seconds (HTTP-date form is not used by tailguard: ignored)."""
    if body[:1] == b"{":
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            value = obj["error"].get("retry_after_s")
            if isinstance(value, int | float) and value >= 0:
                return float(value)
    if header:
        try:
            value = float(header)
        except ValueError:
            return None
        return value if value >= 0 else None
    return None


def _json_or_text(body: bytes) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")


def _error_type(body: object) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        etype = body["error"].get("type") or body["error"].get("code")
        return str(etype) if etype else None
    return None


def _message(body: object) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return str(body)[:500]


def _record(
    item: BatchItem,
    status: int | None,
    request_id: str | None,
    body: object,
    error: dict[str, str] | None,
) -> str:
    """One line of OpenAI's batch output format."""
    response = None
    if status is not None:
        response = {"status_code": status, "request_id": request_id or "", "body": body}
    rec = {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": item.custom_id,
        "response": response,
        "error": error,
    }
    return orjson.dumps(rec).decode()

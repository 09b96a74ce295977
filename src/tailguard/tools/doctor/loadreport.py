"""A `tailguard load --report DIR` as evidence: which requests were slow, and on what connection.

Only `requests.jsonl` is read (fields `i, intended_s, sent_s, latency_s, service_s, status, ok,
error, new_connection, connect_s, ttfb_s, retry_after_s`); missing fields read as absent, so
reports from other versions still load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tailguard.tools.doctor.snapshot import ParseError


@dataclass(frozen=True)
class LoadRequest:
    latency_s: float | None  # from the intended send time (open loop); None when it never finished
    status: int  # HTTP status, 0 when no response
    ok: bool
    new_connection: bool | None  # None when the load tester did not know
    connect_s: float | None
    start_s: float | None = None  # when it was sent (run clock)
    end_s: float | None = None  # when its answer ended (run clock); None if it never did
    retry_after: bool = False  # the answer carried Retry-After (a refusal that says when)


@dataclass(frozen=True)
class LoadSummary:
    """Client-side view of one run, judged against the SLA."""

    requests: int
    ok: int
    failed: int  # errors, timeouts, non-2xx
    refused: int  # 429 / 503: the server shed them
    p50_s: float
    p99_s: float
    max_s: float
    within_sla: float  # share of non-refused requests answered ok within the SLA
    slow: int  # requests answered over the SLA, or failed other than by a fast refusal
    new_connections: int
    known_connection: int  # requests whose new_connection flag is known
    slow_on_new: int  # slow requests that paid for a new connection
    slow_from_connect: int  # slow requests within the SLA but for their connect time
    mean_connect_s: float  # mean connect time of new connections (TCP + TLS), 0 if none
    peak_in_flight: int = 0  # most requests outstanding at once (connections they needed)
    retry_after: int = 0  # refusals that carried Retry-After
    sending_s: float = 0.0  # first send -> last send (run clock); 0 when unknown

    @property
    def offered_rps(self) -> float:
        """Requests offered per second over the sending period (0 when unknown)."""
        return self.requests / self.sending_s if self.sending_s > 0 else 0.0

    @property
    def new_cx_per_request(self) -> float:
        return self.new_connections / self.known_connection if self.known_connection else 0.0

    @property
    def reconnects_per_request(self) -> float:
        """New connections beyond those the peak concurrency needed, per request: connections
        that replaced closed ones. Growth in concurrency (a queue) opens connections too; that
        is not churn."""
        extra = max(0, self.new_connections - self.peak_in_flight)
        return extra / self.known_connection if self.known_connection else 0.0


def _exact_quantile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    idx = min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[idx]


def read_requests(path: Path) -> list[LoadRequest]:
    """Read requests.jsonl (or the folder holding it)."""
    if path.is_dir():
        path = path / "requests.jsonl"
    if not path.is_file():
        raise ParseError(f"{path}: no such load report; pass `tailguard load --report DIR`'s DIR")
    out: list[LoadRequest] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ParseError(f"{path}:{n}: not JSON ({e})") from e
        lat = r.get("latency_s")
        nc = r.get("new_connection")
        cs = r.get("connect_s")
        intended = r.get("intended_s")
        sent = r.get("sent_s")
        start = sent if isinstance(sent, int | float) else intended
        timed = isinstance(intended, int | float) and isinstance(lat, int | float)
        end = float(intended) + float(lat) if timed else None
        out.append(
            LoadRequest(
                latency_s=float(lat) if isinstance(lat, int | float) else None,
                status=int(r.get("status") or 0),
                ok=bool(r.get("ok")),
                new_connection=bool(nc) if isinstance(nc, bool) else None,
                connect_s=float(cs) if isinstance(cs, int | float) else None,
                start_s=float(start) if isinstance(start, int | float) else None,
                end_s=float(end) if end is not None else None,
                retry_after=isinstance(r.get("retry_after_s"), int | float),
            )
        )
    return out


def peak_in_flight(reqs: list[LoadRequest]) -> int:
    """Most requests outstanding at once (a request that never ended counts to the last end)."""
    ends = [r.end_s for r in reqs if r.end_s is not None]
    horizon = max(ends) if ends else 0.0
    events: list[tuple[float, int]] = []
    for r in reqs:
        if r.start_s is None:
            continue
        events.append((r.start_s, 1))
        events.append((r.end_s if r.end_s is not None else horizon, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    peak = cur = 0
    for _, step in events:
        cur += step
        peak = max(peak, cur)
    return peak


def summarize(reqs: list[LoadRequest], sla_s: float) -> LoadSummary:
    lat = sorted(r.latency_s for r in reqs if r.ok and r.latency_s is not None)
    ok = sum(1 for r in reqs if r.ok)
    # A 429/503 refusal is load shedding doing its job, not a tail; everything else that failed
    # (timeouts, resets, 5xx) counts as slow, because the caller waited and got nothing.
    refused = [r for r in reqs if r.status in (429, 503)]
    slow_reqs = [
        r
        for r in reqs
        if r.status not in (429, 503) and (not r.ok or r.latency_s is None or r.latency_s > sla_s)
    ]
    known = [r for r in reqs if r.new_connection is not None]
    new = [r for r in known if r.new_connection]
    connects = [r.connect_s for r in new if r.connect_s is not None]
    n = len(reqs)
    return LoadSummary(
        requests=n,
        ok=ok,
        failed=n - ok,
        refused=len(refused),
        p50_s=_exact_quantile(lat, 0.50),
        p99_s=_exact_quantile(lat, 0.99),
        max_s=lat[-1] if lat else 0.0,
        within_sla=1.0 - len(slow_reqs) / (n - len(refused)) if n > len(refused) else 1.0,
        slow=len(slow_reqs),
        new_connections=len(new),
        known_connection=len(known),
        slow_on_new=sum(1 for r in slow_reqs if r.new_connection),
        slow_from_connect=sum(
            1
            for r in slow_reqs
            if r.ok
            and r.latency_s is not None
            and r.connect_s is not None
            and r.latency_s - r.connect_s <= sla_s
        ),
        mean_connect_s=sum(connects) / len(connects) if connects else 0.0,
        peak_in_flight=peak_in_flight(reqs),
        retry_after=sum(1 for r in refused if r.retry_after),
        sending_s=_sending_s(reqs),
    )


def _sending_s(reqs: list[LoadRequest]) -> float:
    starts = [r.start_s for r in reqs if r.start_s is not None]
    if len(starts) < 2:
        return 0.0
    # n sends at a steady rate span (n - 1) intervals: scale to n for a rate of n / time
    return (max(starts) - min(starts)) * len(starts) / (len(starts) - 1)

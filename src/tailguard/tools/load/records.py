"""Per-request records and time-series samples: the raw data every figure is computed from.

`requests.jsonl` is a contract (tailguard doctor reads it): keep the field names.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import orjson

__all__ = ["RECORD_FIELDS", "RequestRecord", "Sample", "write_csv", "write_jsonl"]

RECORD_FIELDS = (
    "i",
    "intended_s",
    "sent_s",
    "done_s",
    "latency_s",
    "service_s",
    "status",
    "ok",
    "error",
    "new_connection",
    "connect_s",
    "ttfb_s",
    "first_token_s",
    "retry_after_s",
    "bytes_in",
    "prompt_tokens",
    "output_tokens",
    "ttft_s",
    "tpot_s",
    "itl_s",
)


@dataclass(slots=True)
class RequestRecord:
    """One request as the user would have seen it. Times are seconds after run start."""

    i: int  # sequence number, 0-based, in intended-send order
    intended_s: float  # when it should have been sent (open-loop schedule; = sent_s closed-loop)
    sent_s: float = math.nan  # when the client actually started it
    done_s: float = math.nan  # when the response body was read, or the error happened
    latency_s: float = math.nan  # done - intended: what a user scheduled at intended_s saw
    service_s: float = math.nan  # done - sent: what a closed-loop tool would report
    status: int = 0  # HTTP status; 0 when no HTTP response arrived
    ok: bool = False  # 2xx and body read completely
    error: str | None = None  # "timeout", "connection refused", "http 503", ...
    new_connection: bool = False  # a TCP connection was opened for this request
    connect_s: float | None = None  # TCP(+TLS) setup time of that new connection
    ttfb_s: float | None = None  # sent -> response headers
    first_token_s: float | None = None  # sent -> first SSE data event (streams)
    retry_after_s: float | None = None  # server's Retry-After header, seconds
    bytes_in: int = 0  # response body bytes
    prompt_tokens: int | None = None  # the server's usage count
    output_tokens: int | None = None  # usage completion_tokens (else content events counted)
    ttft_s: float | None = None  # intended send -> first content event: what its user waited
    tpot_s: float | None = None  # (done - first content event) / (output_tokens - 1)
    itl_s: list[float] | None = None  # gaps between successive content events (streams)
    _conn_start: float = 0.0  # perf_counter at connection-create start (internal)

    def as_dict(self) -> dict[str, object]:
        return {name: _clean(getattr(self, name)) for name in RECORD_FIELDS}


def _clean(v: object) -> object:
    # JSON has no NaN; a record that never completed cannot exist, but be strict anyway.
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 7)
    if isinstance(v, list):
        return [round(x, 7) for x in v]
    return v


@dataclass(slots=True)
class Sample:
    """Client state every sample interval, for the in-flight and throughput plots."""

    t_s: float  # seconds after run start
    in_flight: int  # requests sent and not finished
    sent: int  # cumulative requests sent
    done: int  # cumulative requests finished (ok or not)
    errors: int  # cumulative failed requests
    cpu: float  # client process CPU over the last interval, share of one core
    machine_cpu: float = 0.0  # whole machine busy share (all cores) over the last interval


def write_jsonl(path: Path, records: list[RequestRecord]) -> None:
    with path.open("wb") as f:
        for r in records:
            f.write(orjson.dumps(r.as_dict()))
            f.write(b"\n")


def write_csv(path: Path, records: list[RequestRecord]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(RECORD_FIELDS)
        for r in records:
            d = r.as_dict()
            w.writerow([_cell(d[k]) for k in RECORD_FIELDS])


def _cell(v: object) -> object:
    if v is None:
        return ""
    return " ".join(f"{x:g}" for x in v) if isinstance(v, list) else v  # itl_s: space-separated

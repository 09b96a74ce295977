"""Settings of one `tailguard batch` run: a frozen dataclass that refuses bad values up front."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tailguard.errors import ConfigError

__all__ = ["BatchConfig", "default_errors_path", "default_ledger_path"]


def default_errors_path(output: Path) -> Path:
    """`out.jsonl` -> `out.errors.jsonl` (beside the output)."""
    suffix = output.suffix or ".jsonl"
    return output.with_name(f"{output.stem}.errors{suffix}")


def default_ledger_path(output: Path) -> Path:
    """`out.jsonl` -> `out.jsonl.ledger.sqlite` (beside the output, so a resume finds it)."""
    return output.with_name(output.name + ".ledger.sqlite")


@dataclass(frozen=True)
class BatchConfig:
    input_path: Path  # OpenAI Batch input, one JSON object per line
    output_path: Path  # successful results, OpenAI batch output format
    endpoints: tuple[str, ...]  # base URLs, e.g. http://127.0.0.1:8000
    errors_path: Path | None = None  # failed requests; None: beside the output
    ledger_path: Path | None = None  # SQLite ledger; None: beside the output
    sla_ms: float = 150.0  # latency bound per request; the pace limiter aims well inside it
    max_rps: float | None = None  # token-bucket cap on request starts per second; None: no cap
    max_in_flight: int = 512  # hard cap on the adaptive in-flight limit, all endpoints together
    initial_in_flight: int = 8  # per endpoint; the limiter grows from here
    max_attempts: int = 10  # per request, first try included
    timeout_s: float = 60.0  # per attempt
    backoff_base_s: float = 0.1  # exponential backoff: full jitter over [0, base * 2^(n-1)]
    backoff_cap_s: float = 10.0  # ... capped here
    max_retry_after_s: float = 60.0  # a larger Retry-After is clipped to this
    eject_after: int = 5  # connection failures/timeouts (half the recent outcomes) that eject
    eject_base_s: float = 1.0  # first ejection; doubles per consecutive ejection
    eject_max_s: float = 30.0
    strict: bool = False  # malformed input lines refuse the run instead of being skipped
    retry_failed: bool = False  # on resume, send again the requests recorded as failed
    progress: bool = True  # live progress bar on stderr
    summary_json: Path | None = None  # also write the end summary here as JSON

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("no endpoint given: pass --endpoint http://HOST:PORT (repeatable)")
        for url in self.endpoints:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(
                    f"endpoint {url!r} is not an http(s) base URL; "
                    "expected e.g. http://127.0.0.1:8000 (the path comes from each input line)"
                )
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ConfigError(f"endpoints repeat: {list(self.endpoints)}; give each one once")
        if self.sla_ms <= 0:
            raise ConfigError(f"--sla-ms must be > 0, got {self.sla_ms}")
        if self.max_rps is not None and self.max_rps <= 0:
            raise ConfigError(f"--max-rps must be > 0, got {self.max_rps}; omit it for no cap")
        if self.max_in_flight < len(self.endpoints):
            raise ConfigError(
                f"--max-in-flight ({self.max_in_flight}) is below the number of endpoints "
                f"({len(self.endpoints)}): each endpoint needs room for at least one request"
            )
        if self.initial_in_flight < 1:
            raise ConfigError(f"initial in-flight must be >= 1, got {self.initial_in_flight}")
        if self.max_attempts < 1:
            raise ConfigError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout-s must be > 0, got {self.timeout_s}")
        if not 0 < self.backoff_base_s <= self.backoff_cap_s:
            raise ConfigError(
                f"backoff base ({self.backoff_base_s}s) must be > 0 and <= the cap "
                f"({self.backoff_cap_s}s)"
            )
        if self.eject_after < 1 or not 0 < self.eject_base_s <= self.eject_max_s:
            raise ConfigError(
                f"ejection needs eject_after >= 1 and 0 < base ({self.eject_base_s}s) "
                f"<= max ({self.eject_max_s}s)"
            )
        for what, path in (("--output", self.output_path), ("the ledger", self.ledger)):
            if not path.parent.is_dir():
                raise ConfigError(
                    f"the folder of {what} ({path.parent}) does not exist; create it first"
                )
        if self.output_path.resolve() == self.input_path.resolve():
            raise ConfigError("--output is the input file; choose another path")

    @property
    def errors(self) -> Path:
        return self.errors_path or default_errors_path(self.output_path)

    @property
    def ledger(self) -> Path:
        return self.ledger_path or default_ledger_path(self.output_path)

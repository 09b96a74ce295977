"""`ServerConfig`: every `tailguard serve` setting, typed and validated at construction.

One flat namespace of settings, the same in three places: the TOML file (`--config`, flat keys,
no tables), the command line flags (`--sla-ms 150` for `sla_ms`), and `--print-config` (JSON).
Engine settings (`EngineConfig`) live in the same namespace; the engine's `threads`, `seed` and
`model_dir` are spelled `engine_threads`, `engine_seed` and `model` there.
Precedence: defaults < file < flags. The attribute docstrings below are the documentation:
`--help` and `docs/server.md` are generated from them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import ipaddress
import itertools
import os
import tomllib
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

from tailguard.core.admission import AdmissionConfig
from tailguard.engine.config import EngineConfig
from tailguard.errors import ConfigError

__all__ = ["ENGINE_ALIASES", "ServerConfig", "field_docs", "load_config"]

# ServerConfig-namespace name -> EngineConfig field name, where they differ.
ENGINE_ALIASES = {"model": "model_dir", "engine_threads": "threads", "engine_seed": "seed"}


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Bind address. Loopback by default; binding elsewhere (e.g. 0.0.0.0) must be explicit."""
    port: int = 8000
    """TCP port (0: pick a free port and print it)."""
    sla_ms: float = 150.0
    """Default deadline of a request (ms): completion for /v1/infer and /v1/embeddings, first
    token for completions and chat."""
    max_deadline_ms: float = 60_000.0
    """Cap on a client-chosen deadline (X-Request-Timeout-Ms header or `timeout` field)."""
    default_priority: str = "interactive"
    """Priority of a request that names none (X-Priority header / `priority` field):
    interactive or batch."""
    engine: str = "real"
    """Which engine answers: real (the model in its own process), stub (instant answers, for
    front-end benchmarks) or simulated (a timed queue without a model, for tests)."""
    model_name: str | None = None
    """Model id served under /v1/models and accepted in `model` (default: the model folder's name,
    or tailguard-embedded)."""
    api_key: str | None = None
    """If set, every /v1 request needs `Authorization: Bearer <key>` (else 401). Also read from
    the TAILGUARD_API_KEY environment variable."""
    backlog: int = 16384
    """listen() backlog. The kernel caps it at net.core.somaxconn; raise that too for bursts."""
    keepalive_timeout_s: int = 75
    """Idle keep-alive timeout; longer than load balancers' idle timeouts (often 60 s) so the
    server never closes a connection a proxy is about to reuse."""
    max_body_bytes: int = 1_048_576
    """Largest request body accepted (413 beyond it)."""
    max_url_bytes: int = 8192
    """Longest request target (path and query) accepted (414 beyond it)."""
    max_header_bytes: int = 32_768
    """Most bytes of request line and headers (names and values) per request (431 beyond it)."""
    max_header_count: int = 100
    """Most header fields per request (431 beyond it)."""
    header_timeout_s: float = 10.0
    """Time a client has to send a whole request head (request line and headers), counted from
    its first byte; also how long a new connection may stay silent before its first request
    (408 and close beyond it)."""
    body_timeout_s: float = 30.0
    """Time a client has to send a whole request body, counted from the end of its headers (408
    and close beyond it). 30 s for the default max_body_bytes is ~35 KB/s."""
    send_timeout_s: float = 30.0
    """Longest a connection may keep answer bytes unsent because the client does not read
    (a stalled stream, unread pipelined answers); beyond it the connection is aborted and its
    request cancelled."""
    linger_timeout_s: float = 5.0
    """After answering a request it will not read (413, 431, 414, a refused 100-continue...),
    the server keeps reading and discarding what the client still sends for up to this long
    before closing, so the client reads the answer instead of a connection reset."""
    ssl_certfile: str | None = None
    """TLS certificate (PEM); TLS is on when both certfile and keyfile are set."""
    ssl_keyfile: str | None = None
    """TLS private key (PEM)."""
    max_queued_requests: int = 2048
    """Hard cap on admitted, unanswered requests (backs the deadline prediction)."""
    max_queued_tokens: int = 262_144
    """Hard cap on admitted, unprocessed tokens (prompt + remaining output)."""
    batch_share: float = 0.8
    """Share of the queue caps batch-priority requests may use; the rest is kept for
    interactive requests."""
    admission: str = "on"
    """on: refuse (fast 503 + Retry-After) a request predicted to miss its deadline; off: admit
    everything the queue caps allow and let the engine run it however late (the oracle
    configuration goodput is measured against)."""
    admission_quantile: float = 0.99
    """Admission plans for this quantile of its measured prediction error: the share of admitted
    requests meant to meet their deadline (0.5 to 0.999). That share is an aggregate: while the
    recently admitted requests' expected misses stay under half of 1 - admission_quantile, a
    request at the edge may be planned for a looser quantile (see admission_max_request_risk)."""
    admission_max_request_risk: float = 0.05
    """The largest chance of missing its deadline one admitted request may carry while the
    recent admissions leave room in the miss budget (0 to 0.25; 0: plan every request for
    admission_quantile)."""
    admission_overload_headroom: float = 0.5
    """Under overload, the share of its time left a request is planned to leave unused: the
    share of the last second's requests refused, up to this (0 to 0.9; 0: always plan to the
    whole deadline). Refusing one more request then costs no goodput, and the shorter queue
    leaves room for the delays the server cannot see (the client's, the network's)."""
    admission_tail_samples: int = 2
    """A prediction-size class whose measured error has too few samples for this many to lie
    above its admission_quantile is pooled with its neighbours' (0: off, each class alone).
    Keeps one stall from becoming a sparse class's quantile and refusing its sizes for the
    samples' 30 s lifetime."""
    admission_step_cost: str = "rows"
    """How admission prices an engine step: rows (a + b * tokens + c * head rows, at the
    engine's padded bucket sizes) or tokens (a + b * tokens, unpadded: the model before
    session 20, kept to compare)."""
    cache_max_entries: int = 10_000
    """Degradation cache: most responses kept (0 disables the cache)."""
    cache_max_bytes: int = 64 * 1024 * 1024
    """Degradation cache: most bytes of response bodies kept."""
    client_quota_rps: float = 0.0
    """Per-client request quota (requests/s; 0: no quota). A client over it gets 429. The client
    is its X-Client-Id when the connection comes from one of `trusted_proxies`, else its peer
    address together with its API key (when `api_key` is set)."""
    client_quota_burst: int = 100
    """Per-client quota burst size (requests)."""
    client_quota_max_clients: int = 100_000
    """Most clients whose quota state is kept; beyond it the least recently seen is forgotten
    (a client idle for burst / rps seconds has a full bucket anyway)."""
    trusted_proxies: tuple[str, ...] = ()
    """Addresses or networks (comma-separated, e.g. 10.0.0.0/8,127.0.0.1) of proxies whose
    X-Client-Id header names the client for the quota; from anyone else it is ignored."""
    simulated_tokens_per_s: float = 20_000.0
    """--engine simulated: tokens processed per second (in steps of max_num_batched_tokens)."""
    simulated_step_overhead_ms: float = 2.0
    """--engine simulated: fixed cost of every step (ms)."""
    simulated_kv_blocks: int = 0
    """--engine simulated: KV blocks (16 tokens each) in its pool; 0: every sequence fits at
    full length (no preemption). Fewer: the scheduler preempts and recomputes, as a real engine
    with a small pool does."""
    handlers_per_iteration: int = 64
    """Most chunks of newly read request data parsed (and their handlers started) per event-loop
    iteration; the rest wait their turn in arrival order (bounds how long answers for admitted
    requests wait behind a burst of new arrivals)."""
    accepts_per_iteration: int = 64
    """Most connections accepted per event-loop iteration. The rest wait in the kernel's accept
    queue (the `backlog`) for the next iteration, instead of one iteration accepting thousands
    of connections while admitted requests' answers wait behind it."""
    loop_lag_interval_ms: float = 50.0
    """Event-loop lag probe period (ms)."""
    access_log: bool = False
    """Log every request (costly at high request rates)."""
    log_level: str = "info"
    """debug, info, warning or error."""
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    """Engine settings (flat names: max_num_seqs, max_num_batched_tokens, engine_threads, ...)."""

    def __post_init__(self) -> None:
        # Over 80 lines on purpose: one flat check per setting, in the order of the fields, each
        # with its message; split up, a reader would have to look for a setting's check.
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(0 <= self.port <= 65535, f"port={self.port}: must be in 0..65535")
        need(self.sla_ms > 0, f"sla_ms={self.sla_ms}: must be > 0 (e.g. 150)")
        need(
            self.max_deadline_ms >= self.sla_ms,
            f"max_deadline_ms={self.max_deadline_ms} < sla_ms={self.sla_ms}: raise the cap",
        )
        need(
            self.default_priority in ("interactive", "batch"),
            f"default_priority={self.default_priority!r}: use interactive or batch",
        )
        need(
            self.engine in ("real", "stub", "simulated"),
            f"engine={self.engine!r}: use real, stub or simulated",
        )
        need(self.backlog >= 1, f"backlog={self.backlog}: must be >= 1")
        need(
            self.keepalive_timeout_s >= 1,
            f"keepalive_timeout_s={self.keepalive_timeout_s}: must be >= 1 (default 75)",
        )
        need(self.max_body_bytes >= 1024, f"max_body_bytes={self.max_body_bytes}: must be >= 1024")
        need(self.max_url_bytes >= 256, f"max_url_bytes={self.max_url_bytes}: must be >= 256")
        need(
            self.max_header_bytes >= self.max_url_bytes + 1024,
            f"max_header_bytes={self.max_header_bytes} leaves too little room for headers after "
            f"max_url_bytes={self.max_url_bytes} (the request line counts too): raise "
            f"max_header_bytes to at least {self.max_url_bytes + 1024} or lower max_url_bytes",
        )
        need(
            self.max_header_count >= 8,
            f"max_header_count={self.max_header_count}: must be >= 8 (default 100)",
        )
        for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s", "linger_timeout_s"):
            value = getattr(self, name)
            need(value > 0, f"{name}={value}: must be > 0")
        need(
            (self.ssl_certfile is None) == (self.ssl_keyfile is None),
            "ssl_certfile and ssl_keyfile go together: set both for TLS, or neither",
        )
        need(
            self.cache_max_entries >= 0 and self.cache_max_bytes >= 0,
            "cache_max_entries and cache_max_bytes must be >= 0",
        )
        need(
            self.client_quota_rps >= 0 and self.client_quota_burst >= 1,
            "client_quota_rps must be >= 0 and client_quota_burst >= 1",
        )
        need(
            self.client_quota_max_clients >= 1,
            f"client_quota_max_clients={self.client_quota_max_clients}: must be >= 1",
        )
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ConfigError(
                    f"trusted_proxies: {proxy!r} is not an IP address or network "
                    "(e.g. 10.0.0.5 or 10.0.0.0/8)"
                ) from None
        need(
            self.simulated_tokens_per_s > 0 and self.simulated_step_overhead_ms >= 0,
            "simulated_tokens_per_s must be > 0 and simulated_step_overhead_ms >= 0",
        )
        need(
            self.simulated_kv_blocks >= 0,
            f"simulated_kv_blocks={self.simulated_kv_blocks}: must be >= 0 (0: enough for all)",
        )
        need(self.loop_lag_interval_ms > 0, "loop_lag_interval_ms must be > 0")
        need(
            self.handlers_per_iteration >= 1,
            f"handlers_per_iteration={self.handlers_per_iteration}: must be >= 1",
        )
        need(
            self.accepts_per_iteration >= 1,
            f"accepts_per_iteration={self.accepts_per_iteration}: must be >= 1",
        )
        need(
            self.log_level in ("debug", "info", "warning", "error"),
            f"log_level={self.log_level!r}: use debug, info, warning or error",
        )
        need(
            self.admission in ("on", "off"),
            f"admission={self.admission!r}: use on or off",
        )
        try:
            self.admission_config()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def admission_config(self) -> AdmissionConfig:
        e = self.engine_config
        return AdmissionConfig(
            max_queued_requests=self.max_queued_requests,
            max_queued_tokens=self.max_queued_tokens,
            max_num_batched_tokens=e.max_num_batched_tokens,
            max_num_seqs=e.max_num_seqs,
            token_buckets=e.token_buckets,
            row_buckets=e.seq_buckets,
            batch_share=self.batch_share,
            enabled=self.admission == "on",
            target_quantile=self.admission_quantile,
            max_request_risk=self.admission_max_request_risk,
            overload_headroom=self.admission_overload_headroom,
            calibration_tail_samples=self.admission_tail_samples,
            step_cost=self.admission_step_cost,
        )

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.engine_config.model_dir:
            return Path(self.engine_config.model_dir).name
        return "tailguard-embedded"

    def to_flat(self) -> dict[str, Any]:
        """The effective settings as one flat JSON-able dict (the api key masked)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name != "engine_config":
                out[f.name] = getattr(self, f.name)
        if out["api_key"]:
            out["api_key"] = "***"
        inverse = {v: k for k, v in ENGINE_ALIASES.items()}
        for f in dataclasses.fields(self.engine_config):
            value = getattr(self.engine_config, f.name)
            out[inverse.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
        return out


# ---- settings namespace ---------------------------------------------------------------------


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal after each field)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def settings() -> dict[str, tuple[type, str, Any, str]]:
    """name -> (owner class, type annotation text, default, doc) for every setting."""
    out: dict[str, tuple[type, str, Any, str]] = {}
    inverse = {v: k for k, v in ENGINE_ALIASES.items()}
    for cls in (ServerConfig, EngineConfig):
        docs = field_docs(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            if f.name == "engine_config":
                continue
            name = inverse.get(f.name, f.name) if cls is EngineConfig else f.name
            doc = docs.get(f.name, "")
            out[name] = (cls, str(f.type), getattr(defaults, f.name), doc)
    return out


@cache
def _setting_types() -> dict[str, Any]:
    """name -> the setting's type (resolved, not its annotation text)."""
    inverse = {v: k for k, v in ENGINE_ALIASES.items()}
    out: dict[str, Any] = {}
    for cls in (ServerConfig, EngineConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name != "engine_config":
                out[inverse.get(f.name, f.name) if cls is EngineConfig else f.name] = hints[f.name]
    return out


def convert(name: str, value: Any) -> Any:
    """Coerce a TOML value or a flag string to the setting's type (msgspec, lax: "12" is an
    int, "true" or "1" a bool, "a,b" a tuple of two); say which setting is wrong."""
    kind = _setting_types()[name]
    if isinstance(value, str):
        if type(None) in typing.get_args(kind) and value.strip().lower() in ("", "none"):
            return None
        is_tuple = any(typing.get_origin(t) is tuple for t in (kind, *typing.get_args(kind)))
        if is_tuple:
            value = [x.strip() for x in value.split(",") if x.strip()]
    try:
        return msgspec.convert(value, kind, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{name}={value!r}: expected {settings()[name][1]} ({e})") from None


def load_config(path: str | None, overrides: dict[str, Any]) -> ServerConfig:
    """Defaults < TOML file < overrides (already-typed values from flags; None = not given)."""
    known = settings()
    values: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found: check --config") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from None
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(
                    f"config file {path}: unknown setting {key!r}; "
                    "see `tailguard serve --help` or docs/server.md"
                )
            values[name] = convert(name, value)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "api_key" not in values and os.environ.get("TAILGUARD_API_KEY"):
        values["api_key"] = os.environ["TAILGUARD_API_KEY"]
    server_kw: dict[str, Any] = {}
    engine_kw: dict[str, Any] = {}
    for name, value in values.items():
        owner = known[name][0]
        if owner is EngineConfig:
            engine_kw[ENGINE_ALIASES.get(name, name)] = value
        else:
            server_kw[name] = value
    return ServerConfig(engine_config=EngineConfig(**engine_kw), **server_kw)

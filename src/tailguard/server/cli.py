"""`tailguard serve`: flags (generated from ServerConfig), config file, engine choice, run."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from tailguard.core.engine_api import EngineClientProtocol
from tailguard.errors import ConfigError, TailguardError
from tailguard.server.config import ServerConfig, convert, load_config, settings

__all__ = ["add_arguments", "build_app", "make_engine", "run"]

# Flags with a short, documented spelling of their own (the rest: --setting-name).
_HELP_FIRST = ("model", "host", "port", "sla_ms", "api_key", "engine")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Start the OpenAI-compatible server. Flags override the config file; "
        "every setting is listed below and in docs/server.md."
    )
    parser.add_argument("--config", metavar="TOML", help="settings file (tailguard.toml)")
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective settings as JSON and exit"
    )
    known = settings()
    names = [n for n in _HELP_FIRST if n in known] + [n for n in known if n not in _HELP_FIRST]
    for name in names:
        _owner, type_text, default, doc = known[name]
        flag = "--" + name.replace("_", "-")
        shown = list(default) if isinstance(default, tuple) else default
        help_ = f"{doc} (default: {shown})".replace("%", "%%")
        if type_text == "bool":
            parser.add_argument(
                flag, dest=name, default=None, help=help_, action=argparse.BooleanOptionalAction
            )
        else:
            parser.add_argument(
                flag, dest=name, default=None, metavar=_metavar(type_text), help=help_
            )


def _metavar(type_text: str) -> str:
    base = type_text.replace("| None", "").strip()
    if base.startswith("tuple[str"):
        return "ADDR,ADDR,..."
    return {"int": "N", "float": "X", "str": "TEXT"}.get(base, "N,N,...")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    known = settings()
    overrides: dict[str, Any] = {}
    for name in known:
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = convert(name, value)
    return load_config(args.config, overrides)


def make_engine(cfg: ServerConfig) -> EngineClientProtocol:
    e = cfg.engine_config
    if cfg.engine == "stub":
        from tailguard.server.stub import StubEngineClient

        return StubEngineClient(
            e.max_num_seqs, e.max_num_batched_tokens, max_model_len=e.max_model_len or 4096
        )
    if cfg.engine == "simulated":
        from tailguard.server.simulated import SimulatedEngineClient

        return SimulatedEngineClient(
            tokens_per_s=cfg.simulated_tokens_per_s,
            step_overhead_s=cfg.simulated_step_overhead_ms / 1e3,
            max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens,
            max_model_len=e.max_model_len or 4096,
            num_kv_blocks=cfg.simulated_kv_blocks or None,
            max_restarts=e.max_restarts,
            token_buckets=e.token_buckets,
            seq_buckets=e.seq_buckets,
        )
    try:
        from tailguard.engine.client import EngineClient
    except ImportError as exc:
        raise ConfigError(
            f"the real engine is not importable ({exc}); use --engine simulated or stub"
        ) from None
    return EngineClient(e)


def build_app(cfg: ServerConfig, engine: EngineClientProtocol | None = None) -> Any:
    """The ASGI app with its engine client and tokenizer (never imports torch)."""
    from tailguard.server.app import App
    from tailguard.server.tokenizer import load_model_info

    info = load_model_info(cfg.engine_config.model_dir, need_model=cfg.engine == "real")
    return App(cfg, engine or make_engine(cfg), info)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        if args.print_config:
            print(json.dumps(cfg.to_flat(), indent=2, sort_keys=True))
            return 0
        logging.basicConfig(
            level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        app = build_app(cfg)
        from tailguard.compiled import status

        compiled, why = status()
        logging.getLogger("tailguard.server").info(
            "request path: %s (%s)", "compiled (mypyc)" if compiled else "pure Python", why
        )
    except TailguardError as e:
        print(f"tailguard serve: {e.message}", file=sys.stderr)
        return 2
    from tailguard.server.serving import serve

    return serve(app)
